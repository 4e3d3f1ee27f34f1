"""The training schedule of Megatron's arguments, validated into config: how many
iterations (``--train-iters`` or ``--train-samples``), the learning-rate schedule and the
optimizer (:class:`OptimizerArgs`), as Megatron-LM reads them.

No torch or megatron import.
"""
from __future__ import annotations

import argparse

from dynapipe.errors import DynaPipeError
from megatron_integration.args_checks import _fraction, _need, _positive, _unsupported_value
from megatron_integration.args_megatron import WEIGHT_DECAY_DEFAULT
from megatron_integration.model_flags import loss_scale_from_args
from megatron_integration.train_config import OptimizerArgs

def _schedule_from_samples(args: argparse.Namespace) -> None:
    """Megatron-LM's ``--train-samples``: iterations = samples // global batch (no batch ramp-up),
    written into ``args.train_iters``; the learning-rate schedule then runs in those iterations."""
    if args.train_samples is None:
        return
    if args.train_iters is not None:
        raise DynaPipeError(f"--train-samples {args.train_samples} and --train-iters {args.train_iters} were both "
                            f"given; give one (as in Megatron-LM).")
    if args.lr_decay_iters is not None or args.lr_warmup_iters:
        raise DynaPipeError("--train-samples schedules in samples: drop --lr-decay-iters / --lr-warmup-iters "
                            "(give --lr-decay-samples / --lr-warmup-samples, or --lr-warmup-fraction).")
    if args.dynapipe_tokens_per_global_batch is not None:
        raise DynaPipeError("--train-samples needs global batches of --global-batch-size samples; with "
                            "--dynapipe-tokens-per-global-batch give --train-iters.")
    gbs = _need(args, "global-batch-size", args.global_batch_size)
    _positive("train-samples", args.train_samples)
    if args.train_samples < gbs:
        raise DynaPipeError(f"--train-samples {args.train_samples} is below --global-batch-size {gbs}: not one "
                            f"iteration; raise it.")
    args.train_iters = args.train_samples // gbs


def _schedule_in_iterations(args: argparse.Namespace) -> tuple[float, float]:
    """(decay, warm-up) of the learning-rate schedule in iterations: Megatron's ``--lr-*-iters``,
    or with ``--train-samples`` its ``--lr-*-samples`` over ``--global-batch-size`` (Megatron-LM
    steps its scheduler by the samples of each iteration, so a fixed global batch makes the two
    the same schedule, fractional iterations included)."""
    # With --train-samples Megatron-LM decays over the samples themselves (not the whole iterations
    # they round down to) even when no --lr-*-samples is given.
    samples = args.train_samples is not None or args.lr_decay_samples is not None or args.lr_warmup_samples
    if not samples:
        return _positive("lr-decay-iters", args.lr_decay_iters) or args.train_iters, \
            _positive("lr-warmup-iters", args.lr_warmup_iters, allow_zero=True)
    if args.train_samples is None:
        raise DynaPipeError("--lr-decay-samples / --lr-warmup-samples schedule in samples and need --train-samples "
                            "(as in Megatron-LM); with --train-iters give --lr-decay-iters / --lr-warmup-iters.")
    gbs = args.global_batch_size
    decay = _positive("lr-decay-samples", args.lr_decay_samples) or args.train_samples
    warmup = _positive("lr-warmup-samples", args.lr_warmup_samples, allow_zero=True)
    return decay / gbs, warmup / gbs


def optimizer_args_from_args(args: argparse.Namespace) -> OptimizerArgs:
    """The learning-rate schedule (iterations) and Adam's settings, validated as Megatron-LM
    validates them; ``args.train_iters`` must be set (see :func:`_schedule_from_samples`)."""
    decay_iters, warmup_iters = _schedule_in_iterations(args)
    if args.lr_warmup_fraction is not None:
        if warmup_iters:
            raise DynaPipeError(f"--lr-warmup-fraction {args.lr_warmup_fraction} and a warm-up length "
                                f"(--lr-warmup-iters / --lr-warmup-samples) were both given; give one (as in "
                                f"Megatron-LM).")
        _fraction("lr-warmup-fraction", args.lr_warmup_fraction)
        # Megatron-LM: warm-up steps = fraction x decay steps.
        warmup_iters = args.lr_warmup_fraction * decay_iters  # not rounded, as Megatron-LM's
    if args.min_lr > args.lr:
        raise DynaPipeError(f"--min-lr {args.min_lr} is above --lr {args.lr}; the decay would raise the rate.")
    # megatron-core's scheduler asserts this for every decay style, the constant one included.
    if warmup_iters >= decay_iters:
        raise DynaPipeError(f"the warm-up ({warmup_iters} iterations) must be shorter than the decay "
                            f"({decay_iters} iterations, --lr-decay-iters or --train-iters); shorten the warm-up "
                            f"or lengthen the decay.")
    wsd = _wsd_schedule(args, decay_iters)
    if args.lr_decay_style == "inverse-square-root" and not warmup_iters:
        # Its rate is --lr x sqrt(warm-up / step); without a warm-up megatron-core takes one step,
        # a sample in Megatron-LM's units and an iteration here: another schedule.
        raise DynaPipeError("--lr-decay-style inverse-square-root needs a warm-up (--lr-warmup-iters, "
                            "--lr-warmup-samples or --lr-warmup-fraction): it decays as sqrt(warm-up / step).")
    decoupled = _decoupled_lr(args)
    if args.grad_reduce_in_bf16 and not args.bf16:
        raise DynaPipeError("--grad-reduce-in-bf16 applies to --bf16 only (gradients of other precisions are "
                            "reduced as they are); add --bf16 or drop it.")
    if args.grad_reduce_in_bf16 and args.accumulate_allreduce_grads_in_fp32:
        raise DynaPipeError("--grad-reduce-in-bf16 and --accumulate-allreduce-grads-in-fp32 were both given; give "
                            "one (Megatron-LM would drop the fp32 accumulation asked for without a word).")
    if args.optimizer != "adam":
        raise _unsupported_value("--optimizer", args.optimizer,
                                 "only adam (megatron-core's Adam with decoupled weight decay) is built; use "
                                 "--optimizer adam")
    warmup_init = getattr(args, "lr_warmup_init", 0.0)
    if warmup_init < 0:
        raise DynaPipeError(f"--lr-warmup-init {warmup_init}: a learning rate cannot be negative; "
                            f"give 0 (the default) or more.")
    if args.lr is not None and warmup_init > args.lr:
        raise DynaPipeError(f"--lr-warmup-init {warmup_init} exceeds --lr {args.lr}: the warm-up rises to --lr "
                            f"(megatron-core's scheduler asserts init <= max); give at most {args.lr}.")
    if warmup_init and not warmup_iters:
        raise DynaPipeError(f"--lr-warmup-init {warmup_init} is where a warm-up starts, and there is none; "
                            f"give --lr-warmup-iters, --lr-warmup-samples or --lr-warmup-fraction, or drop it.")
    loss_scale = loss_scale_from_args(args)
    # torch's Adam asserts these deep in the first step's set-up; refused here in one line.
    for flag in ("adam-beta1", "adam-beta2"):
        _fraction(flag, getattr(args, flag.replace("-", "_")))
    _positive("adam-eps", args.adam_eps, allow_zero=True)
    _positive("clip-grad", args.clip_grad, allow_zero=True)  # 0: no clipping, as Megatron-LM reads it
    return OptimizerArgs(lr=args.lr, min_lr=args.min_lr, lr_decay_style=args.lr_decay_style,
                         lr_warmup_iters=warmup_iters, lr_decay_iters=decay_iters, lr_warmup_init=warmup_init,
                         weight_decay=args.weight_decay, adam_beta1=args.adam_beta1,
                         adam_beta2=args.adam_beta2, adam_eps=args.adam_eps, clip_grad=args.clip_grad,
                         distributed=args.use_distributed_optimizer,
                         override_scheduler=args.override_opt_param_scheduler,
                         use_checkpoint_scheduler=args.use_checkpoint_opt_param_scheduler,
                         grad_reduce_in_bf16=args.grad_reduce_in_bf16, grad_reduce_in_fp32=_grad_reduce_in_fp32(args),
                         log_num_zeros_in_grad=args.log_num_zeros_in_grad,
                         wd_incr_iters=(None if args.train_samples is None
                                        else args.train_samples / args.global_batch_size),
                         apply_wd_to_qk_layernorm=bool(getattr(args, "apply_wd_to_qk_layernorm", False)),
                         **_weight_decay_schedule(args), **decoupled, **loss_scale, **wsd)


def _wsd_schedule(args: argparse.Namespace, decay_iters: float) -> dict:
    """Megatron's ``--lr-wsd-decay-iters`` / ``-samples`` / ``-style`` for ``--lr-decay-style WSD``
    (the anneal at the end of the decay span), in iterations; refused for another style."""
    given = [f for f, v in (("--lr-wsd-decay-iters", args.lr_wsd_decay_iters),
                            ("--lr-wsd-decay-samples", args.lr_wsd_decay_samples)) if v is not None]
    if args.lr_decay_style != "WSD":
        if given or args.lr_wsd_decay_style != "exponential":
            flag = given[0] if given else "--lr-wsd-decay-style"
            raise DynaPipeError(f"{flag} shapes the anneal of --lr-decay-style WSD, and the style is "
                                f"{args.lr_decay_style}; add --lr-decay-style WSD or drop {flag}.")
        return {}
    if args.train_samples is None:
        if args.lr_wsd_decay_samples is not None:
            raise DynaPipeError("--lr-wsd-decay-samples needs --train-samples (as in Megatron-LM); with "
                                "--train-iters give --lr-wsd-decay-iters.")
        iters = _positive("lr-wsd-decay-iters", args.lr_wsd_decay_iters)
    else:
        if args.lr_wsd_decay_iters is not None:
            raise DynaPipeError("--lr-wsd-decay-iters with --train-samples: give --lr-wsd-decay-samples (as in "
                                "Megatron-LM).")
        samples = _positive("lr-wsd-decay-samples", args.lr_wsd_decay_samples)
        iters = samples / args.global_batch_size if samples else None
    if not iters:
        raise DynaPipeError("--lr-decay-style WSD needs the length of its final anneal: --lr-wsd-decay-iters "
                            "(or --lr-wsd-decay-samples with --train-samples).")
    if iters > decay_iters:
        raise DynaPipeError(f"the WSD anneal ({iters} iterations) is longer than the decay span ({decay_iters}, "
                            f"--lr-decay-iters or --train-iters); shorten --lr-wsd-decay-iters.")
    return {"wsd_decay_iters": iters, "lr_wsd_decay_style": args.lr_wsd_decay_style}


def _grad_reduce_in_fp32(args: argparse.Namespace) -> bool:
    """Megatron-LM's ``validate_args``: bf16 gradients accumulate and reduce in fp32 unless
    ``--grad-reduce-in-bf16``; fp16 ones stay fp16 unless ``--accumulate-allreduce-grads-in-fp32``
    (fp32 ones are fp32 either way)."""
    if args.bf16:
        return not args.grad_reduce_in_bf16
    if args.fp16:
        return bool(args.accumulate_allreduce_grads_in_fp32)
    return True


def _weight_decay_schedule(args: argparse.Namespace) -> dict:
    """Megatron's ``--start-weight-decay`` / ``--end-weight-decay`` / ``--weight-decay-incr-style``,
    validated as Megatron-LM validates them: the constant style takes ``--weight-decay`` and
    neither bound, the others take both."""
    style = args.weight_decay_incr_style
    start = _positive("start-weight-decay", args.start_weight_decay, allow_zero=True)
    end = _positive("end-weight-decay", args.end_weight_decay, allow_zero=True)
    _positive("weight-decay", args.weight_decay, allow_zero=True)
    given = [f for f, v in (("--start-weight-decay", start), ("--end-weight-decay", end)) if v is not None]
    if style == "constant" and given:
        raise DynaPipeError(f"{given[0]} with --weight-decay-incr-style constant: the constant decay is "
                            f"--weight-decay; give --weight-decay-incr-style linear or cosine to move between "
                            f"--start-weight-decay and --end-weight-decay.")
    if style != "constant" and len(given) < 2:
        raise DynaPipeError(f"--weight-decay-incr-style {style} needs --start-weight-decay and --end-weight-decay "
                            f"(as in Megatron-LM).")
    if style != "constant" and args.weight_decay != WEIGHT_DECAY_DEFAULT:
        raise DynaPipeError(f"--weight-decay {args.weight_decay} is not used under --weight-decay-incr-style {style}: "
                            f"the decay moves from --start-weight-decay to --end-weight-decay; drop it.")
    # The style is named "incr": megatron-core's scheduler asserts the decay only grows.
    if style != "constant" and end < start:
        raise DynaPipeError(f"--end-weight-decay {end} is below --start-weight-decay {start}: "
                            f"--weight-decay-incr-style {style} only raises the weight decay (megatron-core's "
                            f"scheduler asserts end >= start); swap them or use --weight-decay-incr-style constant.")
    return {"start_weight_decay": start, "end_weight_decay": end, "weight_decay_incr_style": style}


def _decoupled_lr(args: argparse.Namespace) -> dict:
    """Megatron's ``--decoupled-lr`` / ``--decoupled-min-lr`` (the embedding's and output layer's
    own rates), validated."""
    lr, min_lr = _positive("decoupled-lr", args.decoupled_lr, allow_zero=True), \
        _positive("decoupled-min-lr", args.decoupled_min_lr, allow_zero=True)
    if min_lr is not None and lr is None:
        raise DynaPipeError(f"--decoupled-min-lr {min_lr} needs --decoupled-lr (the embedding's own peak rate); "
                            f"add it or drop --decoupled-min-lr.")
    if lr is not None and min_lr is not None and min_lr > lr:
        raise DynaPipeError(f"--decoupled-min-lr {min_lr} is above --decoupled-lr {lr}; the decay would raise it.")
    return {"decoupled_lr": lr, "decoupled_min_lr": min_lr}
