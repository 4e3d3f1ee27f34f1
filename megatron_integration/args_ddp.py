"""Megatron-LM's data-parallel gradient-reduction arguments (megatron-core's DDP), validated into
:class:`~megatron_integration.train_config.DDPArgs`.

Honoured: ``--overlap-grad-reduce`` (every method: megatron-core's schedules through its
``no_sync``/``grad_sync`` hooks, DynaPipe's executor by running every backward of a chunk but
its plan's last under ``no_sync``), ``--ddp-bucket-size`` and ``--ddp-num-buckets`` (with the
overlap, as Megatron-LM sizes buckets only then), ``--ddp-pad-buckets-for-high-nccl-busbw``
(with the distributed optimizer, whose buckets it pads). Refused with a reason:
``--overlap-param-gather`` and ``--ddp-average-in-collective``
(:mod:`~megatron_integration.args_refusals`). No torch or megatron import.
"""
from __future__ import annotations

import argparse

from dynapipe.errors import DynaPipeError
from megatron_integration.args_checks import _positive
from megatron_integration.train_config import DDPArgs


def add_ddp_args(parser: argparse.ArgumentParser) -> None:
    """Declare Megatron-LM's DDP flags (names and defaults as Megatron-LM's)."""
    g = parser.add_argument_group("data-parallel gradient reduction")
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="start each gradient bucket's data-parallel reduction as soon as the iteration's last "
                        "backward has produced it, overlapping it with the rest of that backward")
    g.add_argument("--ddp-bucket-size", type=int, default=None,
                   help="parameters per gradient bucket with --overlap-grad-reduce (default: megatron-core's, "
                        "max(40M, 1M x data-parallel size); the first pipeline stage only, later ones use one "
                        "bucket, as in megatron-core)")
    g.add_argument("--ddp-num-buckets", type=int, default=None,
                   help="with --overlap-grad-reduce: this rank's parameters over this many buckets "
                        "(instead of --ddp-bucket-size)")
    g.add_argument("--ddp-pad-buckets-for-high-nccl-busbw", action="store_true",
                   help="with --use-distributed-optimizer: pad buckets to a multiple of 2^16 x data-parallel "
                        "size for NCCL's bus bandwidth")


def ddp_args_from_args(args: argparse.Namespace) -> DDPArgs:
    """The DDP settings of a parsed command line; a bucket flag without the overlap (where
    Megatron-LM reduces in one bucket and drops it unsaid) is refused with what to add."""
    size = _positive("ddp-bucket-size", args.ddp_bucket_size)
    count = _positive("ddp-num-buckets", args.ddp_num_buckets)
    if size is not None and count is not None:
        raise DynaPipeError(f"--ddp-bucket-size {size} and --ddp-num-buckets {count} were both given: each sizes "
                            f"the buckets; give one.")
    if not args.overlap_grad_reduce:
        for flag, value in (("--ddp-bucket-size", size), ("--ddp-num-buckets", count)):
            if value is not None:
                raise DynaPipeError(f"{flag} {value} without --overlap-grad-reduce: gradients are then reduced in "
                                    f"one bucket after the backward (as in Megatron-LM), so it would change "
                                    f"nothing; add --overlap-grad-reduce or drop it.")
    if args.ddp_pad_buckets_for_high_nccl_busbw and not args.use_distributed_optimizer:
        raise DynaPipeError("--ddp-pad-buckets-for-high-nccl-busbw pads the distributed optimizer's buckets; add "
                            "--use-distributed-optimizer or drop it.")
    return DDPArgs(overlap_grad_reduce=args.overlap_grad_reduce, bucket_size=size, num_buckets=count,
                   pad_buckets_for_high_nccl_busbw=args.ddp_pad_buckets_for_high_nccl_busbw)
