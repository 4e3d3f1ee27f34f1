"""The model part of Megatron's arguments, validated into config: the network's shape and
numerics (:class:`GPTModelArgs`, with Megatron-LM's vocabulary padding) and activation
recomputation (Megatron's ``--recompute-*`` and the level DynaPipe's planner must use).

Shared by training and profiling. No torch or megatron import.
"""
from __future__ import annotations

import argparse
from typing import Optional, Sequence

from dynapipe.config import padded_vocab_size
from dynapipe.errors import DynaPipeError
from megatron_integration.args_checks import _fraction, _need, _positive
from megatron_integration.args_refusals import _model_flags_honoured
from megatron_integration.model_flags import model_shape_from_args, position_embedding_from_args
from megatron_integration.tokenizer import tokenizer_info
from megatron_integration.train_config import GPTModelArgs, RecomputeArgs

# The byte-level tokenizer's ids (256 bytes and its specials), before padding.
BYTE_LEVEL_VOCAB = 384


def model_args_from_args(args: argparse.Namespace, cuda: bool) -> GPTModelArgs:
    """The model part of the arguments, validated (shared by training and profiling)."""
    for flag in ("num-layers", "hidden-size", "num-attention-heads", "seq-length"):
        _need(args, flag, getattr(args, flag.replace("-", "_")))
    for flag in ("num-layers", "hidden-size", "num-attention-heads", "seq-length", "ffn-hidden-size",
                 "kv-channels", "max-position-embeddings", "vocab-size"):
        _positive(flag, getattr(args, flag.replace("-", "_")))
    for flag in ("hidden-dropout", "attention-dropout"):
        _fraction(flag, getattr(args, flag.replace("-", "_")))
    if args.fp16 and args.bf16:
        raise DynaPipeError("--fp16 and --bf16 were both given; choose one (or neither for fp32).")
    dtype = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    # As Megatron-LM: the head size defaults to hidden / heads, which must then be whole;
    # a given --kv-channels sets it instead (projections of heads x kv-channels).
    if args.kv_channels is None and args.hidden_size % args.num_attention_heads:
        raise DynaPipeError(f"--hidden-size {args.hidden_size} is not divisible by "
                            f"--num-attention-heads {args.num_attention_heads}; change one, or give the head "
                            f"size with --kv-channels.")
    _model_flags_honoured(args, cuda)
    if args.disable_bf16_reduced_precision_matmul and dtype != "bf16":
        raise DynaPipeError("--disable-bf16-reduced-precision-matmul applies to bf16 matmuls; add --bf16 or drop it.")
    if args.deterministic_mode and args.cross_entropy_loss_fusion:
        raise DynaPipeError("--deterministic-mode with --cross-entropy-loss-fusion: Megatron-LM requires the fused "
                            "cross-entropy off for bit-reproducible runs; drop one of them.")
    # Megatron-LM's legacy RoPE spellings mean --position-embedding-type rope from here on.
    args.position_embedding_type = position_embedding_from_args(args)
    shape = model_shape_from_args(args)
    _positive("make-vocab-size-divisible-by", args.make_vocab_size_divisible_by)
    unpadded = tokenizer_info(args).vocab_size
    tp = args.tensor_model_parallel_size
    if tp < 1:  # it pads the vocabulary below; the layout checks come later
        raise DynaPipeError(f"--tensor-model-parallel-size {tp}: must be at least 1.")
    vocab = padded_vocab_size(unpadded, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size)
    max_pos = args.max_position_embeddings or args.seq_length
    # Megatron-LM asserts this whatever the position type (RoPE's tables are sized by it too).
    if args.seq_length > max_pos:
        raise DynaPipeError(f"--seq-length {args.seq_length} exceeds --max-position-embeddings {max_pos}; "
                            f"raise --max-position-embeddings to at least {args.seq_length} or shorten --seq-length.")
    return GPTModelArgs(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        ffn_hidden_size=shape.pop("ffn_hidden_size"),
        kv_channels=args.kv_channels or args.hidden_size // args.num_attention_heads,
        seq_length=args.seq_length, max_position_embeddings=max_pos, vocab_size=vocab,
        unpadded_vocab_size=unpadded,
        position_embedding_type=args.position_embedding_type,
        tie_embeddings=not args.untie_embeddings_and_output_weights, normalization=args.normalization,
        # On CPUs every run is local: Transformer Engine needs CUDA.
        transformer_impl="transformer_engine" if cuda and args.transformer_impl == "transformer_engine" else "local",
        hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
        init_method_std=_positive("init-method-std", args.init_method_std, allow_zero=True), dtype=dtype,
        norm_epsilon=_positive("norm-epsilon", args.norm_epsilon),
        cross_entropy_loss_fusion=args.cross_entropy_loss_fusion, deterministic_mode=args.deterministic_mode,
        disable_bf16_reduced_precision_matmul=args.disable_bf16_reduced_precision_matmul,
        apply_query_key_layer_scaling=args.apply_query_key_layer_scaling,
        attention_softmax_in_fp32=args.attention_softmax_in_fp32,
        bias_gelu_fusion=getattr(args, "bias_gelu_fusion", True), **shape)


def _recompute_modules(modules: Optional[list], granularity: Optional[str]) -> None:
    """Megatron's ``--recompute-modules``: which submodules selective recompute checkpoints. The
    selective level here checkpoints the core attention, Megatron's default and the one the
    planner prices; any other list is refused, as is the flag without selective recompute
    (where Megatron-LM drops it unsaid)."""
    if modules is None:
        return
    given = " ".join(modules) or "(none)"
    if granularity != "selective":
        raise DynaPipeError(f"--recompute-modules {given} chooses what selective recompute checkpoints; add "
                            f"--recompute-granularity selective (or --recompute-activations) or drop it.")
    if modules != ["core_attn"]:
        raise DynaPipeError(f"--recompute-modules {given}: selective recompute here checkpoints the core attention "
                            f"only (core_attn, Megatron's default, which the planner prices); give "
                            f"--recompute-modules core_attn or drop it.")


def check_uniform_recompute(recompute: RecomputeArgs, block_layers: Sequence[int]) -> None:
    """Refuse ``--recompute-method uniform --recompute-num-layers N`` where N does not divide a
    model chunk's layers (``block_layers``: transformer layers of every virtual stage):
    megatron-core 0.16 recomputes whole groups of N layers without clamping the last, and
    indexes past the chunk's end at the first forward."""
    if recompute.granularity != "full" or recompute.method != "uniform" or not recompute.num_layers:
        return
    n = recompute.num_layers
    bad = sorted({m for m in block_layers if m % n})
    if bad:
        fits = sorted({d for d in range(1, n + 1) if all(m % d == 0 for m in block_layers)})
        raise DynaPipeError(f"--recompute-method uniform --recompute-num-layers {n}: a model chunk of {bad[0]} "
                            f"layer(s) is not a whole number of groups of {n} (megatron-core recomputes groups "
                            f"of N layers and fails past a chunk's end); use --recompute-num-layers "
                            f"{fits[-1]}, or --recompute-method block.")


def recompute_from_args(args: argparse.Namespace,
                        stage_layers: Optional[int] = None) -> tuple[RecomputeArgs, Optional[str]]:
    """Megatron's ``--recompute-*`` (validated as Megatron-LM validates them) and the level
    DynaPipe's planner must use (None: ``--dynapipe-recompute auto``, the search chooses).
    ``stage_layers``: the most layers a pipeline rank holds (default: the even split's)."""
    gran, method, layers = args.recompute_granularity, args.recompute_method, args.recompute_num_layers
    if args.recompute_activations:
        # Megatron-LM: --recompute-activations sets the selective granularity.
        if gran == "full":
            raise DynaPipeError("--recompute-activations (selective) and --recompute-granularity full were both "
                                "given; give one.")
        gran = "selective"
    _recompute_modules(args.recompute_modules, gran)
    if gran is None and (method is not None or layers is not None):
        raise DynaPipeError("--recompute-method / --recompute-num-layers need --recompute-granularity full.")
    if gran == "selective" and (method is not None or layers is not None):
        raise DynaPipeError("--recompute-granularity selective takes no --recompute-method / --recompute-num-layers "
                            "(as in Megatron-LM); drop them.")
    if gran == "full":
        if method is None or layers is None:
            raise DynaPipeError("--recompute-granularity full needs --recompute-method {uniform,block} and "
                                "--recompute-num-layers N (as in Megatron-LM).")
        per_stage = stage_layers or args.num_layers // max(args.pipeline_model_parallel_size, 1)
        if not 1 <= layers <= per_stage:
            raise DynaPipeError(f"--recompute-num-layers {layers}: must be between 1 and the {per_stage} layers "
                                f"of the largest pipeline stage.")
    recompute = RecomputeArgs(gran, method, layers)
    dyn = getattr(args, "dynapipe_recompute", "auto")
    if not args.use_dynapipe:
        if dyn != "auto":
            raise DynaPipeError(f"--dynapipe-recompute {dyn} needs --use-dynapipe; the baselines take Megatron's "
                                f"--recompute-granularity.")
        return recompute, None
    if gran == "full" and (method, layers) != ("uniform", 1):
        # The planner's 'full' keeps every layer's input and rematerialises one layer at a time.
        raise DynaPipeError(f"--use-dynapipe plans full recompute layer by layer; --recompute-method {method} "
                            f"--recompute-num-layers {layers} cannot be honoured: use --recompute-method uniform "
                            f"--recompute-num-layers 1, or --dynapipe-recompute full.")
    if gran is not None and dyn not in ("auto", gran):
        raise DynaPipeError(f"--recompute-granularity {gran} and --dynapipe-recompute {dyn} disagree; give one.")
    return recompute, gran or (None if dyn == "auto" else dyn)
