"""The training schedule of Megatron's arguments, validated into config: how many
iterations (``--train-iters`` or ``--train-samples``), the learning-rate schedule and the
optimizer (:class:`OptimizerArgs`), as Megatron-LM reads them.

No torch or megatron import.
"""
from __future__ import annotations

import argparse

from dynapipe.errors import DynaPipeError
from megatron_integration.args_checks import _fraction, _need, _positive, _unsupported
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
                            "(the decay then spans the run; use --lr-warmup-fraction for the warm-up).")
    if args.dynapipe_tokens_per_global_batch is not None:
        raise DynaPipeError("--train-samples needs global batches of --global-batch-size samples; with "
                            "--dynapipe-tokens-per-global-batch give --train-iters.")
    gbs = _need(args, "global-batch-size", args.global_batch_size)
    _positive("train-samples", args.train_samples)
    if args.train_samples < gbs:
        raise DynaPipeError(f"--train-samples {args.train_samples} is below --global-batch-size {gbs}: not one "
                            f"iteration; raise it.")
    args.train_iters = args.train_samples // gbs


def optimizer_args_from_args(args: argparse.Namespace) -> OptimizerArgs:
    """The learning-rate schedule (iterations) and Adam's settings, validated as Megatron-LM
    validates them; ``args.train_iters`` must be set (see :func:`_schedule_from_samples`)."""
    decay_iters = _positive("lr-decay-iters", args.lr_decay_iters) or args.train_iters
    warmup_iters = _positive("lr-warmup-iters", args.lr_warmup_iters, allow_zero=True)
    if args.lr_warmup_fraction is not None:
        if args.lr_warmup_iters:
            raise DynaPipeError(f"--lr-warmup-fraction {args.lr_warmup_fraction} and --lr-warmup-iters "
                                f"{args.lr_warmup_iters} were both given; give one (as in Megatron-LM).")
        _fraction("lr-warmup-fraction", args.lr_warmup_fraction)
        # Megatron-LM: warm-up steps = fraction x decay steps.
        warmup_iters = int(args.lr_warmup_fraction * decay_iters)
    if args.min_lr > args.lr:
        raise DynaPipeError(f"--min-lr {args.min_lr} is above --lr {args.lr}; the decay would raise the rate.")
    if args.lr_decay_style != "constant" and warmup_iters >= decay_iters:
        raise DynaPipeError(f"the warm-up ({warmup_iters} iterations) must be shorter than the decay "
                            f"({decay_iters} iterations, --lr-decay-iters or --train-iters).")
    if args.optimizer != "adam":
        raise _unsupported("--optimizer", f"{args.optimizer}: only adam (megatron-core's Adam with decoupled "
                                          f"weight decay) is built; use --optimizer adam")
    loss_scale = loss_scale_from_args(args)
    return OptimizerArgs(lr=args.lr, min_lr=args.min_lr, lr_decay_style=args.lr_decay_style,
                         lr_warmup_iters=warmup_iters, lr_decay_iters=decay_iters,
                         weight_decay=args.weight_decay, adam_beta1=args.adam_beta1,
                         adam_beta2=args.adam_beta2, adam_eps=args.adam_eps, clip_grad=args.clip_grad,
                         distributed=args.use_distributed_optimizer,
                         override_scheduler=args.override_opt_param_scheduler,
                         use_checkpoint_scheduler=args.use_checkpoint_opt_param_scheduler, **loss_scale)
