"""Megatron-LM's distributed-checkpoint arguments (``torch_dist``), validated into
:class:`~megatron_integration.train_config.DistCkptArgs`.

Honoured: ``--no-ckpt-fully-parallel-save`` (Megatron-LM saves fully parallel by default: the
data-parallel replicas split the writing of what they all hold), ``--ckpt-fully-parallel-load``
(GPUs: the replicas split the reading and exchange the rest), ``--dist-ckpt-strictness`` (how a load
treats keys the checkpoint and the run do not share). ``--ckpt-fully-parallel-save`` is
Megatron-LM's deprecated spelling of the default. No torch or megatron import.
"""
from __future__ import annotations

import argparse

from dynapipe.errors import DynaPipeError
from megatron_integration.train_config import DistCkptArgs

# megatron-core's StrictHandling values; the return_* ones hand the mismatches to a caller.
STRICTNESS = ("assume_ok_unexpected", "log_unexpected", "log_all", "raise_unexpected", "raise_all",
              "return_unexpected", "return_all", "ignore_all")


def add_checkpoint_args(group: argparse._ArgumentGroup) -> None:
    """Declare the distributed-checkpoint flags (names and defaults as Megatron-LM's)."""
    group.add_argument("--no-ckpt-fully-parallel-save", action="store_false", dest="ckpt_fully_parallel_save",
                       help="torch_dist: data-parallel rank 0 writes what the replicas share (default: they split it)")
    group.add_argument("--ckpt-fully-parallel-save", action="store_true", dest="ckpt_fully_parallel_save_deprecated",
                       help="deprecated in Megatron-LM: fully parallel saving is the default")
    group.add_argument("--ckpt-fully-parallel-load", action="store_true",
                       help="torch_dist: the data-parallel replicas split the reading and exchange the shards")
    group.add_argument("--dist-ckpt-strictness", default="assume_ok_unexpected", choices=STRICTNESS,
                       help="torch_dist load, megatron-core's terms: how keys the run asks for that the checkpoint "
                            "lacks (unexpected) and keys the checkpoint holds that the run leaves unread (missing, "
                            "the *_all values) are treated: assumed fine, logged, raised, or ignored (the return_* "
                            "values, which hand the keys to a caller, are refused)")


def dist_ckpt_args_from_args(args: argparse.Namespace, cuda: bool) -> DistCkptArgs:
    """The distributed-checkpoint settings of a parsed command line; a flag the run cannot use
    (a save flag with this project's per-rank format, a load flag without ``--load``, the fully
    parallel load without CUDA) is refused."""
    strictness = args.dist_ckpt_strictness
    if strictness.startswith("return_"):
        raise DynaPipeError(f"--dist-ckpt-strictness {strictness} returns the mismatched keys to the caller, and "
                            f"the training loop has nothing to do with them; use log_{strictness[7:]} or "
                            f"raise_{strictness[7:]}.")
    if args.ckpt_fully_parallel_save_deprecated and not args.ckpt_fully_parallel_save:
        raise DynaPipeError("--ckpt-fully-parallel-save and --no-ckpt-fully-parallel-save contradict each other; "
                            "give one (fully parallel is the default).")
    if not args.ckpt_fully_parallel_save and args.ckpt_format != "torch_dist":
        raise DynaPipeError(f"--no-ckpt-fully-parallel-save applies to torch_dist checkpoints; --ckpt-format "
                            f"{args.ckpt_format} writes one file a rank anyway. Drop it.")
    given = [f for f, on in (("--ckpt-fully-parallel-load", args.ckpt_fully_parallel_load),
                             (f"--dist-ckpt-strictness {strictness}", strictness != STRICTNESS[0])) if on]
    if given and not args.load:
        raise DynaPipeError(f"{given[0]} sets how a checkpoint is loaded; add --load DIR or drop it.")
    if args.ckpt_fully_parallel_load and not cuda:
        # Measured with megatron-core 0.16: its exchange allocates the shards it receives on "cuda".
        raise DynaPipeError("--ckpt-fully-parallel-load needs GPUs: megatron-core's fully parallel load exchanges "
                            "the shards through CUDA tensors; drop it on CPU (every rank then reads its own).")
    return DistCkptArgs(fully_parallel_save=args.ckpt_fully_parallel_save,
                        fully_parallel_load=args.ckpt_fully_parallel_load, strictness=strictness)
