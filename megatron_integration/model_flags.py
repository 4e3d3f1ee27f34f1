"""Megatron-LM's model-shape and fp16 loss-scale flags: validated, with Megatron's defaults.

Called from :mod:`megatron_integration.arguments`; returns plain values for
:class:`~megatron_integration.train_config.GPTModelArgs` and
:class:`~megatron_integration.train_config.OptimizerArgs`. No torch or megatron import.
"""
from __future__ import annotations

import argparse
from typing import Optional

from dynapipe.errors import DynaPipeError

# Megatron-LM's loss-scale defaults (arguments.py, "mixed precision" group).
LOSS_SCALE_DEFAULTS = {"initial_loss_scale": 2.0 ** 32, "min_loss_scale": 1.0, "loss_scale_window": 1000.0,
                       "hysteresis": 2}


def add_loss_scale_args(group: argparse._ArgumentGroup) -> None:
    """The fp16 loss-scale flags Megatron-LM has besides ``--loss-scale``/``--initial-loss-scale``."""
    group.add_argument("--min-loss-scale", type=float, default=LOSS_SCALE_DEFAULTS["min_loss_scale"],
                       help="fp16: the dynamic loss scale is never lowered below this")
    group.add_argument("--loss-scale-window", type=float, default=LOSS_SCALE_DEFAULTS["loss_scale_window"],
                       help="fp16: steps without overflow before the dynamic loss scale is doubled")
    group.add_argument("--hysteresis", type=int, default=LOSS_SCALE_DEFAULTS["hysteresis"],
                       help="fp16: overflowing steps tolerated before the dynamic loss scale is halved")


def swiglu_ffn_hidden_size(hidden_size: int) -> int:
    """Megatron-LM's FFN width for ``--swiglu`` without ``--ffn-hidden-size``: 2/3 of 4 x hidden
    (the two FC1 halves then hold about as many weights as a 4h GeLU MLP), rounded down to a
    multiple of 64."""
    return int((4 * hidden_size * 2 / 3) / 64) * 64


def model_shape_from_args(args: argparse.Namespace) -> dict:
    """``GPTModelArgs`` fields of the shape flags, as Megatron-LM derives them:
    ``ffn_hidden_size``, ``swiglu``, ``add_bias_linear``, ``add_qkv_bias`` (only with
    ``--disable-bias-linear``: the linear biases include it), ``qk_layernorm``, ``num_query_groups``, ``rotary_base``, the RoPE scaling."""
    ffn = args.ffn_hidden_size
    if ffn is None:
        ffn = swiglu_ffn_hidden_size(args.hidden_size) if args.swiglu else 4 * args.hidden_size
        if ffn <= 0:
            raise DynaPipeError(f"--swiglu with --hidden-size {args.hidden_size}: Megatron's default FFN width "
                                f"(2/3 of 4 x hidden, rounded down to a multiple of 64) is 0; give --ffn-hidden-size.")
    groups = None
    if args.group_query_attention:
        groups = args.num_query_groups
        heads, tp = args.num_attention_heads, args.tensor_model_parallel_size
        if groups is None or groups <= 0 or heads % groups:
            raise DynaPipeError(f"--num-query-groups {groups} must be a positive divisor of --num-attention-heads "
                                f"{heads} (each key/value head serves heads / groups query heads).")
        if groups % tp:
            # megatron-core replicates the key/value heads when there are fewer groups than TP
            # ranks; this build's seeded initialisation and cost model slice whole groups only.
            raise DynaPipeError(f"--num-query-groups {groups} is not divisible by --tensor-model-parallel-size {tp}: "
                                f"megatron-core would replicate the key/value heads over the TP ranks, which this "
                                f"build does not support; use a --tensor-model-parallel-size that divides {groups}.")
    elif args.num_query_groups != 1:
        # Megatron-LM reads it only with --group-query-attention; a GQA checkpoint's shape would be lost here.
        raise DynaPipeError(f"--num-query-groups {args.num_query_groups} without --group-query-attention: the "
                            f"layers would be built with one key/value head per query head; add "
                            f"--group-query-attention or drop it.")
    if args.rotary_base <= 0:
        raise DynaPipeError(f"--rotary-base {args.rotary_base}: must be positive (RoPE's base period, "
                            f"Megatron's default 10000).")
    if args.add_qkv_bias and not args.disable_bias_linear:
        raise DynaPipeError("--add-qkv-bias without --disable-bias-linear: every linear layer (the QKV projection "
                            "too) already has its bias; add --disable-bias-linear (Qwen2's layer) or drop it.")
    if getattr(args, "apply_wd_to_qk_layernorm", False) and not args.qk_layernorm:
        raise DynaPipeError("--apply-wd-to-qk-layernorm without --qk-layernorm: there are no query/key norm "
                            "weights to decay; add --qk-layernorm or drop it.")
    return dict(ffn_hidden_size=ffn, swiglu=bool(args.swiglu), add_bias_linear=not args.disable_bias_linear,
                add_qkv_bias=bool(args.add_qkv_bias),
                qk_layernorm=bool(args.qk_layernorm), num_query_groups=groups, rotary_base=int(args.rotary_base),
                **rope_scaling_from_args(args))


def position_embedding_from_args(args: argparse.Namespace) -> str:
    """``--position-embedding-type`` with Megatron-LM's legacy RoPE arguments applied, as its
    ``validate_args`` applies them: ``--use-rotary-position-embeddings`` means ``rope``, and
    ``--no-position-embedding`` is only taken with rotary embeddings (which add none)."""
    kind = "rope" if getattr(args, "use_rotary_position_embeddings", False) else args.position_embedding_type
    if kind not in ("learned_absolute", "rope"):
        why = {"yarn": "YaRN rotary embeddings are not built", "mrope": "multimodal rotary embeddings are not built",
               "relative": "T5's relative position buckets are not built (T5 stages take learned positions)",
               "none": "a model without position embeddings (NoPE) is not built"}.get(kind, "not built")
        raise DynaPipeError(f"--position-embedding-type {kind} is not supported by dynapipe-megatron: {why}; use "
                            f"learned_absolute or rope.")
    if not getattr(args, "add_position_embedding", True) and kind != "rope":
        raise DynaPipeError(f"--no-position-embedding with --position-embedding-type {kind}: deprecated in "
                            f"Megatron-LM, which takes it with rotary embeddings only; give --position-embedding-type "
                            f"rope (or drop it).")
    return kind


def rope_scaling_from_args(args: argparse.Namespace) -> dict:
    """Megatron's ``--use-rope-scaling``, ``--rope-scaling-factor`` and
    ``--rotary-seq-len-interpolation-factor`` as ``GPTModelArgs`` fields; they change rotary
    embeddings only, so without ``--position-embedding-type rope`` they are refused."""
    scaling = bool(getattr(args, "use_rope_scaling", False))
    factor = float(getattr(args, "rope_scaling_factor", 8.0))
    interpolation = getattr(args, "rotary_seq_len_interpolation_factor", None)
    given = [f for f, v in (("--use-rope-scaling", scaling), ("--rope-scaling-factor", factor != 8.0),
                            ("--rotary-seq-len-interpolation-factor", interpolation is not None)) if v]
    rope_type = getattr(args, "rope_type", None)
    if rope_type == "yarn":
        raise DynaPipeError("--rope-type yarn: YaRN rotary embeddings (Megatron-LM's choice for multi-latent "
                            "attention) are not built; use --rope-type rope or drop it.")
    if rope_type is not None:
        given.append(f"--rope-type {rope_type}")
    if given and args.position_embedding_type != "rope":
        raise DynaPipeError(f"{given[0]} applies to rotary position embeddings; add --position-embedding-type rope "
                            f"or drop it.")
    if factor <= 0:
        raise DynaPipeError(f"--rope-scaling-factor {factor}: must be positive (Llama 3.x uses 8).")
    if factor != 8.0 and not scaling:
        raise DynaPipeError(f"--rope-scaling-factor {factor} needs --use-rope-scaling; add it or drop the factor.")
    if interpolation is not None and interpolation < 1:
        raise DynaPipeError(f"--rotary-seq-len-interpolation-factor {interpolation}: must be 1 or more (positions "
                            f"are divided by it).")
    return dict(rope_scaling=scaling, rope_scaling_factor=factor, rotary_seq_len_interpolation_factor=interpolation)


def loss_scale_from_args(args: argparse.Namespace) -> dict:
    """``OptimizerArgs`` fields of the loss-scale flags (Megatron-LM's meaning and defaults): a
    static ``--loss-scale`` applies under ``--fp16`` and ``--bf16`` (megatron-core then scales by
    the constant), the dynamic scaler's flags under ``--fp16`` only; any other is refused."""
    values = dict(loss_scale=args.loss_scale, initial_loss_scale=args.initial_loss_scale,
                  min_loss_scale=args.min_loss_scale, loss_scale_window=args.loss_scale_window,
                  hysteresis=args.hysteresis)
    changed = [k for k, v in values.items() if v != LOSS_SCALE_DEFAULTS.get(k)]
    dynamic = [k for k in changed if k != "loss_scale"]
    if dynamic and not args.fp16:
        flag = "--" + dynamic[0].replace("_", "-")
        raise DynaPipeError(f"{flag} sets the dynamic loss scale, which --fp16 only uses; drop it.")
    if values["loss_scale"] is not None and not (args.fp16 or args.bf16):
        raise DynaPipeError("--loss-scale applies to --fp16 and --bf16 (fp32 is not loss-scaled); drop it.")
    for key in ("loss_scale", "initial_loss_scale", "min_loss_scale", "loss_scale_window"):
        if values[key] is not None and not values[key] > 0:
            raise DynaPipeError(f"--{key.replace('_', '-')} {values[key]}: must be positive.")
    if values["hysteresis"] < 1:
        raise DynaPipeError(f"--hysteresis {values['hysteresis']}: must be at least 1 (overflowing steps before "
                            f"the scale is halved).")
    if values["min_loss_scale"] > values["initial_loss_scale"]:
        raise DynaPipeError(f"--min-loss-scale {values['min_loss_scale']} is above --initial-loss-scale "
                            f"{values['initial_loss_scale']}; lower it.")
    return values


def nan_check_enabled(requested: Optional[bool], fp16: bool, loss_scale) -> bool:
    """Whether the check runs, as Megatron-LM decides it: on unless
    ``--no-check-for-nan-in-loss-and-grad`` (``requested`` False), turned off under ``--fp16``
    with dynamic loss scaling (``loss_scale`` None), where a non-finite gradient is the
    scaler's signal to skip the step and lower the scale. With a static ``--loss-scale`` the
    loss and the gradients are checked. The check asked for by name (``requested`` True;
    Megatron-LM has only the ``--no-`` spelling) where dynamic scaling turns it off is refused,
    not dropped."""
    dynamic_fp16 = fp16 and loss_scale is None
    if requested is True and dynamic_fp16:
        raise DynaPipeError("--check-for-nan-in-loss-and-grad: under --fp16 with dynamic loss scaling a non-finite "
                            "gradient is the scaler's signal to skip the step and lower the scale, so the check is "
                            "off (as in Megatron-LM); drop the flag, or give a static --loss-scale to check.")
    return requested is not False and not dynamic_fp16
