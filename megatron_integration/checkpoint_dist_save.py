"""Writing ``--ckpt-format torch_dist`` checkpoints (the format is described in
:mod:`megatron_integration.checkpoint_dist`, which reads them).

megatron-core writes the shards in processes it forks from the rank; here they are tied to the
rank's life, every step one rank can fail alone ends in an agreement of all ranks, and each file
gets its ``.sha256`` sidecar once written.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import glob
import os
import signal
import sys
from typing import Optional

from dynapipe.errors import DynaPipeError
from megatron_integration.agreement import UNNAMED_RANK, attempt, everyone
from megatron_integration.checkpoint_dist import (CHECKPOINT_VERSION, _checkpoint_files, _gathered_rng,
                                                  _rng_sharded_object, _sharded_state_dict, _sharding_metadata)
from megatron_integration.checkpoint_files import CHECKSUM_SUFFIX, StagedSave, save_failed_advice, write_checksum
from megatron_integration.initialize import RankInfo
from megatron_integration.scheduler_state import UNITS_ARG, in_samples

# megatron-core modules that ask for CUDA during a dist_checkpointing save (a synchronize after
# the device-to-host copy, the verification and failure flags); redirected to the CPU like the others.
_CPU_REDIRECTS = ("megatron.core.dist_checkpointing.strategies.filesystem_async",
                  "megatron.core.dist_checkpointing.strategies.state_dict_saver")


def _prepare_writer() -> None:
    """CPU redirects, and an in-process results queue for the synchronous writer.

    megatron-core's writer collects its results through a queue made by a ``Manager`` on
    first use: a spawned interpreter (seconds per job) that only a background (async) save
    needs. Saves here are synchronous, so the writer's results are put and taken in this
    process and a plain queue serves."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron_integration import cpu_compat

    if cpu_compat.is_applied():
        for name in _CPU_REDIRECTS:
            cpu_compat._patch_module(name)
    if getattr(filesystem_async, "_results_queue", False) is None:
        filesystem_async._results_queue = queue.Queue()


# The rank's pid while a save may fork writers (see writers_die_with_rank); empty otherwise.
_WRITING_RANK: list = []
_PR_SET_PDEATHSIG = 1


def _die_with_the_rank() -> None:
    """In a process forked while a save runs (megatron-core's shard writers): be killed when the
    rank dies. Why: a rank killed mid-save (``kill -9``, the job's scheduler) left its writers
    behind, each a copy of the rank's memory, blocked for ever on a results queue nobody reads."""
    if not _WRITING_RANK:
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        return
    if os.getppid() != _WRITING_RANK[0]:  # the rank died before the line above
        os._exit(1)


if sys.platform.startswith("linux"):
    os.register_at_fork(after_in_child=_die_with_the_rank)


@contextlib.contextmanager
def writers_die_with_rank():
    """Within the block, processes this rank forks die with it (Linux; elsewhere a no-op).
    Forks must come from the calling thread: the parent-death signal follows the thread."""
    _WRITING_RANK[:] = [os.getpid()]
    try:
        yield
    finally:
        _WRITING_RANK.clear()


def _save_strategy(fully_parallel: bool):
    """megatron-core's default torch_dist writer, wrapped as Megatron-LM wraps it for
    ``--ckpt-fully-parallel-save`` (its default): the data-parallel replicas split the writing
    of what they all hold instead of leaving it to the first. None: megatron-core's default."""
    if not fully_parallel:
        return None
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    return FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy(),
                                            ps.get_data_parallel_group(with_context_parallel=True))


def save_dist(iter_dir: str, iteration: int, gpt, optimizer, scheduler, info: RankInfo,
              args: argparse.Namespace, distributed_optimizer: bool, fully_parallel: bool = True,
              samples_per_iteration: Optional[int] = None, flops_so_far: float = 0.0) -> None:
    """Write this rank's shards of the checkpoint of ``iteration`` into ``iter_dir``; collective.

    ``args`` (see :func:`megatron_integration.checkpoint_dist.megatron_args`) carries the consumed samples; ``fully_parallel``:
    Megatron-LM's ``--ckpt-fully-parallel-save``; ``samples_per_iteration``: the global batch
    when fixed, to write the scheduler in Megatron-LM's units (samples; None: iterations);
    ``flops_so_far``: Megatron-LM's ``num_floating_point_operations_so_far``. The caller writes
    ``latest_checkpointed_iteration.txt`` afterwards (after a barrier)."""
    from megatron.core import dist_checkpointing

    vars(args)[UNITS_ARG] = "samples" if samples_per_iteration else "iterations"
    _prepare_writer()
    metadata = _sharding_metadata(distributed_optimizer)
    state = _sharded_state_dict(gpt, optimizer, metadata, with_optim=True, is_loading=False)
    state.update(args=args, checkpoint_version=CHECKPOINT_VERSION, iteration=iteration,
                 num_floating_point_operations_so_far=float(flops_so_far),
                 # In Megatron-LM's units (samples), so its runs resume this schedule and back.
                 opt_param_scheduler=in_samples(scheduler.state_dict(), samples_per_iteration),
                 rng_state=_rng_sharded_object(info, _gathered_rng(info)))
    # The shards go to a staging directory first: a complete checkpoint of the same iteration
    # (a run saving into a --save it did not load from) stays until the new one is complete.
    staged = StagedSave(iter_dir, info.rank)
    staging = staged.staging
    staged.begin()
    # megatron-core raises on every rank when one cannot write; the coordinator's line names the
    # failing ranks and their causes, the others only know that it failed.
    with writers_die_with_rank():
        error = attempt(lambda: dist_checkpointing.save(state, staging, sharded_strategy=_save_strategy(fully_parallel),
                                                        content_metadata=metadata), "writing the shards")[1]
    errors = [e for e in everyone(error) if e is not None]
    if errors:
        named = [e for e in errors if UNNAMED_RANK not in e] or errors
        staged.abandon()
        raise DynaPipeError(f"saving {iter_dir}: {named[0]}. {save_failed_advice(os.path.dirname(iter_dir))}")
    # Each rank digests the shard files it wrote (in parallel, still in the page cache) ...
    staged.agree(attempt(lambda: [write_checksum(p) for p in glob.glob(os.path.join(staging, f"__{info.rank}_*.distcp"))],
                         f"writing the checksums of {staging}")[1])
    # ... and rank 0 the shared files (metadata.json, .metadata, common.pt where written).
    staged.agree(attempt(lambda: _checksum_shared(staging), f"writing the checksums of {staging}")[1]
                 if info.rank == 0 else None)
    staged.complete()


def _checksum_shared(iter_dir: str) -> None:
    for path in _checkpoint_files(iter_dir):
        if not os.path.exists(path + CHECKSUM_SUFFIX):
            write_checksum(path)
