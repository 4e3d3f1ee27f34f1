"""What a checkpoint records of the model and of its sharding, and whether this run can load it.

Compared before any tensor is read, for both checkpoint formats: the model's shape in
Megatron-LM's argument names (:func:`model_mismatch` names the flag that differs), the GeLU it
computed, the scheduler state's units, and whether a distributed optimizer's state can load at
this run's (TP, PP) layout (:func:`check_optimizer_resharding`).
"""
from __future__ import annotations

from typing import Optional, Sequence

from dynapipe.config import VOCAB_DIVISIBLE_BY, padded_vocab_size
from dynapipe.errors import DynaPipeError
from megatron_integration.scheduler_state import UNITS_ARG


# The flag that sets a recorded argument, where its name is not the argument's.
FLAG_OF = {"add_bias_linear": "--disable-bias-linear"}  # padded_vocab_size: _vocab_mismatch


def model_values(cfg) -> dict:
    """Megatron-LM argument name -> this GPT's value: what a checkpoint's recorded arguments
    must match before any tensor is read (an argument the checkpoint lacks is not compared)."""
    m = cfg.model
    return {"num_layers": m.num_layers, "hidden_size": m.hidden_size, "num_attention_heads": m.num_attention_heads,
            "ffn_hidden_size": m.ffn_hidden_size, "kv_channels": m.kv_channels, "padded_vocab_size": m.vocab_size,
            "position_embedding_type": m.position_embedding_type, "add_bias_linear": m.add_bias_linear,
            "untie_embeddings_and_output_weights": not m.tie_embeddings, "qk_layernorm": m.qk_layernorm,
            "add_qkv_bias": m.add_qkv_bias or m.add_bias_linear, "normalization": m.normalization,
            "swiglu": m.swiglu}


def recorded_model_args(cfg, mine: Optional[dict] = None) -> dict:
    """What a ``dynapipe``-format checkpoint records of its model, in Megatron-LM's argument
    names: ``mine`` (a T5's values) or :func:`model_values` with the key/value heads and the
    position table that :func:`model_mismatch` compares as a torch_dist checkpoint's, and the
    GeLU it computed."""
    m = cfg.model
    gpt = {} if mine else {"group_query_attention": m.num_query_groups is not None,
                           "num_query_groups": m.num_query_groups or 1,
                           "max_position_embeddings": m.max_position_embeddings}
    return {**(mine or model_values(cfg)), **gpt, "bias_gelu_fusion": m.gelu_approximation == "tanh",
            "transformer_impl": m.transformer_impl}


def impl_mismatch(recorded: dict, cfg) -> Optional[str]:
    """A ``dynapipe``-format checkpoint's layer implementation (``recorded``: its model
    arguments) against this run's, named by the flag; None if they fit or it is not recorded.
    The layers' own state keys differ (Transformer Engine fuses the norms into its linear
    layers), and this format is each rank's state as its modules hold it; a ``torch_dist``
    checkpoint is keyed by megatron-core's sharded names and is not compared."""
    impl = recorded.get("transformer_impl")
    if impl is None or impl == cfg.model.transformer_impl:
        return None
    return f"--transformer-impl {impl} in the checkpoint, {cfg.model.transformer_impl} here"


def model_mismatch(ckpt_args, cfg, mine: Optional[dict] = None,
                   saved_keys: Optional[Sequence[str]] = None) -> Optional[str]:
    """How a checkpoint's recorded arguments (``ckpt_args``, attributes by Megatron-LM name)
    differ from this model's (``mine``, else :func:`model_values`), naming the flag; None if
    they fit. ``saved_keys``: a torch_dist checkpoint's tensor keys, which tell a T5's
    checkpoint (it holds ``encoder.*``) from a GPT's where the arguments cannot (Megatron-LM
    records no decoder layer count unless one was given)."""
    m = cfg.model
    decoder_layers = getattr(ckpt_args, "decoder_num_layers", None)
    if mine is None and decoder_layers is not None:
        # A T5's decoder keys are GPT's; without this its checkpoint would load into a GPT.
        return (f"it records --decoder-num-layers {decoder_layers}: an encoder-decoder (T5) model's checkpoint, "
                f"and this run trains a GPT; resume it with scripts/pretrain_t5.py")
    if mine is not None and "decoder_num_layers" in mine:
        has_encoder = (any(k.startswith("encoder.") for k in saved_keys) if saved_keys is not None
                       else decoder_layers is not None)
        if not has_encoder:
            return ("it holds no encoder: a decoder-only (GPT) model's checkpoint, and this run trains a T5; "
                    "resume it with scripts/pretrain_gpt.py")
        depth = getattr(ckpt_args, "num_layers", None)
        if saved_keys is not None and getattr(ckpt_args, "dynapipe_placement", None) is None and depth is not None:
            # Megatron-LM wrote it: its pretrain_t5.py builds the decoder from --num-layers, which it
            # sets to the encoder's, and records --decoder-num-layers without reading it.
            if depth != mine["decoder_num_layers"]:
                return (f"a Megatron-LM T5 checkpoint, whose decoder has --num-layers layers ({depth}, the "
                        f"encoder's) whatever its --decoder-num-layers ({decoder_layers}) says, and "
                        f"{mine['decoder_num_layers']} here: pass --decoder-num-layers {depth}")
            mine = {k: v for k, v in mine.items() if k != "decoder_num_layers"}
    if mine is None:
        # Key/value heads: Megatron-LM records --num-query-groups whatever it is, and reads it
        # only with --group-query-attention (one group a head otherwise).
        groups = m.num_query_groups or m.num_attention_heads
        if getattr(ckpt_args, "group_query_attention", None) is not None:
            theirs = (getattr(ckpt_args, "num_query_groups", None) if ckpt_args.group_query_attention
                      else getattr(ckpt_args, "num_attention_heads", None))
            if theirs is not None and theirs != groups:
                return (f"{theirs} key/value heads in the checkpoint, {groups} here: --group-query-attention "
                        f"--num-query-groups")
        # A learned position table has --max-position-embeddings rows (rotary positions hold none).
        theirs = getattr(ckpt_args, "max_position_embeddings", None)
        if (m.position_embedding_type == "learned_absolute" and theirs is not None
                and getattr(ckpt_args, "position_embedding_type", "learned_absolute") == "learned_absolute"
                and theirs != m.max_position_embeddings):
            return f"--max-position-embeddings {theirs} in the checkpoint, {m.max_position_embeddings} here"
    for name, value in (mine or model_values(cfg)).items():
        theirs = getattr(ckpt_args, name, None)
        if theirs is not None and theirs != value:
            if name == "padded_vocab_size":
                return _vocab_mismatch(theirs, value, ckpt_args, cfg)
            if name in FLAG_OF:
                return f"{name} {theirs} in the checkpoint, {value} here: {FLAG_OF[name]}"
            return f"--{name.replace('_', '-')} {theirs} in the checkpoint, {value} here"
    return _gelu_mismatch(ckpt_args, m)


def _vocab_mismatch(theirs: int, mine: int, ckpt_args, cfg) -> str:
    """Why the embedding's rows differ. Megatron-LM pads the vocabulary to a multiple of
    ``--make-vocab-size-divisible-by x TP``, so the same ``--vocab-size`` (or tokenizer) saved
    at another TP size can pad to other rows: name the divisor that reproduces the checkpoint's."""
    base = getattr(cfg, "base", cfg)  # a T5 config wraps the shared one
    unpadded = getattr(base.model, "unpadded_vocab_size", 0)
    tp = base.parallel.tensor_model_parallel_size
    their_tp = getattr(ckpt_args, "tensor_model_parallel_size", None)
    head = f"padded_vocab_size {theirs} in the checkpoint, {mine} here"
    # Only the same vocabulary, padded the checkpoint's way at its TP size, gives its rows; any
    # other is another vocabulary, which no divisor may paper over.
    their_divisor = getattr(ckpt_args, "make_vocab_size_divisible_by", None) or VOCAB_DIVISIBLE_BY
    same = (unpadded and their_tp not in (None, tp)
            and padded_vocab_size(unpadded, their_divisor, their_tp) == theirs
            and getattr(ckpt_args, "vocab_size", None) in (None, unpadded))
    if not same:
        return f"{head}: --vocab-size (or the tokenizer)"
    # Divisors that pad this vocabulary to the saved rows at this TP, largest first, powers of two
    # (the alignments Megatron-LM users pick) before the rest.
    fits = sorted((d for d in range(theirs // tp, 0, -1) if theirs % (d * tp) == 0 and theirs - unpadded < d * tp),
                  key=lambda d: (d & (d - 1) != 0, -d))
    if not fits:
        return (f"{head}: the {unpadded}-id vocabulary was padded for TP {their_tp}, and no "
                f"--make-vocab-size-divisible-by pads it to {theirs} rows at TP {tp}; resume at TP {their_tp}")
    return (f"{head}: the {unpadded}-id vocabulary was padded to a multiple of --make-vocab-size-divisible-by x TP "
            f"at TP {their_tp}; add --make-vocab-size-divisible-by {fits[0]} to pad it to the same {theirs} rows "
            f"at TP {tp}")


def _gelu_mismatch(ckpt_args, m) -> Optional[str]:
    """The GeLU a checkpoint's model computed against this run's (a biased, ungated MLP only):
    Megatron-LM's bias-GeLU fusion (``bias_gelu_fusion``) computes the tanh approximation. A
    checkpoint that records ``no_bias_gelu_fusion`` instead was written by an earlier build of
    this project, which computed the exact GeLU whatever the flag said."""
    if getattr(m, "swiglu", True) or not getattr(m, "add_bias_linear", False):
        return None
    if getattr(ckpt_args, "bias_gelu_fusion", None) is not None:
        theirs = bool(ckpt_args.bias_gelu_fusion)
    elif getattr(ckpt_args, "no_bias_gelu_fusion", None) is not None:
        theirs = False
    else:
        return None
    ours = m.gelu_approximation == "tanh"
    if theirs == ours:
        return None
    if ours:
        return ("the checkpoint's model computed the exact GeLU (Megatron-LM's unfused path), this run the tanh "
                "approximation of its default bias-GeLU fusion: --no-bias-gelu-fusion")
    return "the checkpoint's model computed the tanh-approximated GeLU of the bias-GeLU fusion, this run the exact one"


def scheduler_units(ckpt_args) -> Optional[str]:
    """The units of a torch_dist checkpoint's scheduler state: what it records (this project's
    builds since it was recorded), ``samples`` for Megatron-LM's own checkpoints (no
    ``dynapipe_*`` arguments), None (to be told from the values) for this project's older ones."""
    if ckpt_args is None:
        return None
    recorded = getattr(ckpt_args, UNITS_ARG, None)
    if recorded is not None:
        return recorded
    return None if any(k.startswith("dynapipe_") for k in vars(ckpt_args)) else "samples"


# megatron-core's distributed-optimizer formats keyed by the model's parameters (DistributedOptimizer.
# checkpoint_fully_reshardable_formats); the others are its flat buffers, one layout a model-parallel rank.
FULLY_RESHARDABLE = ("fully_reshardable", "fully_sharded_model_space", "fsdp_dtensor")


def check_optimizer_resharding(sharding_type: Optional[str], saved_layout: tuple, layout: tuple,
                               where: str) -> None:
    """Refuse, as Megatron-LM does, loading a distributed optimizer's state saved in a
    buffer-keyed format (``dp_reshardable``, this project's and Megatron-LM's default) at
    another (TP, PP) ``layout`` than ``saved_layout``: its buffers hold another rank's
    parameters there, and megatron-core would fail on a bucket's key, not on the cause."""
    if sharding_type is None or sharding_type in FULLY_RESHARDABLE or tuple(saved_layout) == tuple(layout):
        return
    raise DynaPipeError(f"{where}: (TP, PP) {tuple(layout)} here, {tuple(saved_layout)} in the checkpoint: the "
                        f"distributed optimizer's state was saved as {sharding_type}, sharded by model-parallel "
                        f"rank, which loads only at the sizes (and pipeline split) it was saved at; resume at "
                        f"those, or add --no-load-optim to load the weights and start a fresh optimizer.")
