"""A run's arguments as Megatron-LM holds them once its ``validate_args`` has run: under
Megatron-LM's names, with the values it derives filled in.

Two readers need the same answer: rank 0's start-up argument block
(:func:`megatron_integration.run_report.resolved_args`) and a torch_dist checkpoint's ``args``
(:func:`megatron_integration.checkpoint_dist.megatron_args`), which Megatron-LM's own loader
reads. No torch import.
"""
from __future__ import annotations

from dynapipe.data.splits import MEGATRON_DEFAULT_SPLIT

# This project's negative flags -> the positive name Megatron-LM stores them under (store_false).
NEGATED = (("no_masked_softmax_fusion", "masked_softmax_fusion"),
           ("no_bias_swiglu_fusion", "bias_swiglu_fusion"),
           ("no_bias_dropout_fusion", "bias_dropout_fusion"),
           ("no_gradient_accumulation_fusion", "gradient_accumulation_fusion"),
           ("no_rope_fusion", "apply_rope_fusion"))


def megatron_resolved_args(recorded: dict, cfg) -> dict:
    """``recorded`` (the parsed arguments, plain values) with what Megatron-LM's validation
    derives for the run ``cfg`` (a DynaPipeTrainingConfig): model widths and the padded
    vocabulary, the layers' implementation (local on CPUs), parallel sizes, iterations and
    schedule lengths (iterations), the resolved NaN
    check, recompute granularity, transfer overlap, weight-decay range, data split, and the
    positive names of this project's ``--no-*-fusion`` flags. This project's own keys stay."""
    m, p, o = cfg.model, cfg.parallel, cfg.optimizer
    values = dict(recorded)
    values.update(
        num_layers=m.num_layers, hidden_size=m.hidden_size, ffn_hidden_size=m.ffn_hidden_size,
        num_attention_heads=m.num_attention_heads, kv_channels=m.kv_channels, seq_length=m.seq_length,
        # Megatron-LM's validation sets the encoder's spellings of the two from them.
        encoder_num_layers=m.num_layers, encoder_seq_length=m.seq_length,
        max_position_embeddings=m.max_position_embeddings, padded_vocab_size=m.vocab_size,
        position_embedding_type=m.position_embedding_type,
        # Megatron-LM's meaning: on unless --no-position-embedding, whatever the position type
        # (its check_checkpoint_args compares it with the resuming run's flag).
        add_position_embedding=bool(values.get("add_position_embedding", True)),
        add_bias_linear=m.add_bias_linear,
        untie_embeddings_and_output_weights=not m.tie_embeddings, normalization=m.normalization,
        # Megatron-LM's validate_args sets add_qkv_bias whenever the linear layers have biases.
        qk_layernorm=m.qk_layernorm, add_qkv_bias=m.add_qkv_bias or m.add_bias_linear,
        # Megatron-LM's validate_args drops the bias-GeLU fusion without biases.
        bias_gelu_fusion=m.bias_gelu_fusion and m.add_bias_linear,
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size,
        data_parallel_size=p.data_parallel_size, world_size=p.world_size, distributed_backend=p.backend,
        # Without model chunks Megatron-LM turns the overlap off (it overlaps only the interleaved schedule).
        overlap_p2p_comm=p.overlap_p2p_comm,
        micro_batch_size=cfg.micro_batch_size, global_batch_size=cfg.global_batch_size,
        train_iters=cfg.train_iters, lr_decay_iters=o.lr_decay_iters, lr_warmup_iters=o.lr_warmup_iters,
        eval_iters=cfg.evaluation.eval_iters, rerun_mode=cfg.rerun.rerun_mode,
        # On unless --no-check-for-nan-in-loss-and-grad, off under fp16's dynamic loss scale.
        check_for_nan_in_loss_and_grad=cfg.check_for_nan_in_loss_and_grad,
        # --recompute-activations is Megatron-LM's shorthand for selective; it deletes the flag.
        recompute_granularity=cfg.recompute.granularity,
        use_distributed_optimizer=o.distributed,
        # The layers built: Transformer Engine's only on GPUs (Megatron-LM's default names it on CPUs too).
        transformer_impl=m.transformer_impl,
        # Megatron-LM derives it from the format (its --use-dist-ckpt flag is a deprecated no-op).
        use_dist_ckpt=cfg.ckpt_format == "torch_dist")
    values.pop("recompute_activations", None)
    values["start_weight_decay"], values["end_weight_decay"] = o.weight_decay_range
    if values.get("split") is None and values.get("data_path"):
        values["split"] = MEGATRON_DEFAULT_SPLIT  # Megatron-LM's legacy split of a lone --data-path
    for negative, positive in NEGATED:
        if negative in values:
            values[positive] = not values[negative]
    if "norm_epsilon" in values:
        values["layernorm_epsilon"] = values["norm_epsilon"]  # the name later Megatron-LM records it under
    values.setdefault("make_vocab_size_divisible_by", 128)
    values.setdefault("tokenizer_type", cfg.data.tokenizer_type)
    values.setdefault("tokenizer_model", cfg.data.tokenizer_model)
    values.setdefault("vocab_file", None)
    return values


def dumped_names(values: dict) -> dict:
    """``values`` without the keys Megatron-LM never holds: this project's negative spellings of
    flags whose positive name :func:`megatron_resolved_args` filled in."""
    gone = {negative for negative, positive in NEGATED if positive in values}
    if "add_bias_linear" in values:
        gone.add("disable_bias_linear")
    if "layernorm_epsilon" in values:
        gone.add("norm_epsilon")
    return {k: v for k, v in values.items() if k not in gone}


def split_warning(args) -> str | None:
    """Megatron-LM's warning when ``--data-path`` comes without ``--split`` (the legacy split then
    holds out about 3% of the documents for validation and test), or None."""
    if getattr(args, "data_path", None) and getattr(args, "split", None) is None:
        return ("WARNING: Please specify --split when using --data-path. Using legacy default value of "
                f'"{MEGATRON_DEFAULT_SPLIT}"')
    return None
