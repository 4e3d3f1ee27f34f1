"""Process groups, megatron parallel state and random seeds for one training job.

``initialize_megatron`` is what every entry point calls first: it joins (or starts)
the torch.distributed job, applies the CPU compatibility layer when there is no CUDA,
creates megatron-core's tensor/pipeline/data-parallel groups and seeds every generator
the way Megatron-LM does (seed + 100 x pipeline rank, so stages draw different dropout
masks; the model-parallel RNG tracker seeded from it).
"""
from __future__ import annotations

import datetime
import gc
import logging
import os
import random
import warnings
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from dynapipe.errors import DynaPipeError
from dynapipe.megatron_core import require_megatron_core
from dynapipe.runtime import distributed as _runtime_dist
from megatron_integration import cpu_compat
from megatron_integration.agreement import joined_rendezvous
from megatron_integration.cpu_affinity import pin_local_rank
from megatron_integration.cpu_allocator import keep_freed_memory, pretouch_heap
from megatron_integration.train_config import ParallelArgs

# Optional-dependency notices megatron-core prints at import; expected on CPU.
_QUIET = ("Transformer Engine and Apex are not installed", "Apex is not installed",
          "Transformer Engine is not installed", "full scope is deprecated")


def quiet_megatron_warnings() -> None:
    """Silence megatron-core's notices about missing optional GPU packages."""
    for text in _QUIET:
        warnings.filterwarnings("ignore", message=f".*{text}.*")


@dataclass(frozen=True)
class RankInfo:
    """Where this process sits: global rank and its pipeline / data-parallel coordinates."""

    rank: int
    world_size: int
    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int
    tp_rank: int
    tp_size: int
    device: torch.device

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


def init_distributed(parallel: ParallelArgs, private_store: bool = False) -> None:
    """Join the job's process group (torchrun's environment), unless already joined. A single
    process started without a launcher is a one-rank job; ``private_store`` (a profile): its
    store lives in this process, with no port, so profiles started side by side never race
    for one (a training job's planner workers reach its store over TCP)."""
    if dist.is_initialized():
        return
    alone = "RANK" not in os.environ
    if alone:
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
    if parallel.backend == "nccl":
        select_local_gpu()
    timeout = datetime.timedelta(minutes=parallel.timeout_minutes)
    if alone and private_store:
        dist.init_process_group(parallel.backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return
    if alone:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
    joined = joined_rendezvous()
    if joined is None:
        dist.init_process_group(parallel.backend, timeout=timeout)
        return
    # The store the ranks agreed on their start-up checks through (agreement.agree_at_start).
    store, rank, world_size = joined
    store.set_timeout(timeout)
    dist.init_process_group(parallel.backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


# The GPU choice is the runtime's (one implementation for both launch paths); kept under these
# names here for the modules and scripts that import them from this one.
select_local_gpu = _runtime_dist.select_local_gpu
local_gpu = _runtime_dist.local_gpu


def set_logging_level(level: Optional[int]) -> None:
    """Megatron-LM's ``--logging-level``: Python's root logger at ``level`` with a handler
    (Megatron-LM's training module installs one at INFO; this project none unless asked), so
    log records at ``level`` and above are printed. None: leave logging as it is."""
    if level is None:
        return
    logging.basicConfig(level=level)
    logging.getLogger().setLevel(level)


def initialize_megatron(parallel: ParallelArgs, seed: int, deterministic: bool = False,
                        logging_level: Optional[int] = None, private_store: bool = False) -> RankInfo:
    """Process groups, megatron parallel state, CPU compatibility, the rank's CPU cores
    (``parallel.cpu_affinity``), its pre-touched heap (``parallel.cpu_pretouch_mb``) and
    seeds; returns this rank's place. ``deterministic``: ``--deterministic-mode``, applied
    before the process group exists; ``logging_level``: :func:`set_logging_level`;
    ``private_store``: as for :func:`init_distributed`."""
    from megatron_integration.determinism import start_deterministic_run

    require_megatron_core("a training rank")
    set_logging_level(logging_level)
    start_deterministic_run(deterministic)
    quiet_megatron_warnings()
    init_distributed(parallel, private_store)
    init_model_parallel(parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size,
                        parallel.virtual_pipeline_model_parallel_size, timeout_minutes=parallel.timeout_minutes)
    if parallel.cpu_affinity == "cores":
        pin_local_rank()
    if not torch.cuda.is_available():
        # After pinning, so the rank's own cores write it (and fault it in). Called with 0 too,
        # so a run of a job's ranks never reports the pre-touch of a run before it.
        try:
            pretouch_heap(parallel.cpu_pretouch_mb)
        except (ValueError, MemoryError) as e:
            raise DynaPipeError(f"--dynapipe-cpu-pretouch-mb {parallel.cpu_pretouch_mb}: {e}") from None
    info = rank_info()
    set_seeds(seed, info)
    return info


def init_model_parallel(tp_size: int, pp_size: int, vp_size: Optional[int] = None,
                        timeout_minutes: Optional[float] = None) -> None:
    """megatron's tensor/pipeline/data-parallel groups on the joined process group, the CPU
    compatibility layer first when there is no CUDA; idempotent. Collective: every rank calls it.
    ``vp_size``: model chunks per pipeline rank (megatron's virtual pipeline size; None: one).
    ``timeout_minutes``: the groups' collective timeout, ``--distributed-timeout-minutes`` as
    Megatron-LM passes it (None: megatron-core's default, 30). The executor's transfers run on
    the pipeline group, so on GPUs this is what bounds a transfer that never completes.

    CPU ranks also keep freed memory for reuse (:mod:`megatron_integration.cpu_allocator`):
    every method a bench compares starts here, so all get the same allocator."""
    if not torch.cuda.is_available():
        cpu_compat.apply()
        keep_freed_memory()
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        timeout = {} if timeout_minutes is None else {"distributed_timeout_minutes": timeout_minutes}
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp_size,
                                                 pipeline_model_parallel_size=pp_size,
                                                 virtual_pipeline_model_parallel_size=vp_size, **timeout)


def rank_info() -> RankInfo:
    """This rank's coordinates from megatron's parallel state."""
    from megatron.core import parallel_state as ps

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return RankInfo(rank=dist.get_rank(), world_size=dist.get_world_size(),
                    pp_rank=ps.get_pipeline_model_parallel_rank(), pp_size=ps.get_pipeline_model_parallel_world_size(),
                    dp_rank=ps.get_data_parallel_rank(), dp_size=ps.get_data_parallel_world_size(),
                    tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=ps.get_tensor_model_parallel_world_size(),
                    device=device)


def set_seeds(seed: int, info: RankInfo) -> None:
    """Seed Python, numpy, torch and megatron's model-parallel RNG tracker as Megatron-LM does."""
    from megatron.core import tensor_parallel

    stage_seed = seed + 100 * info.pp_rank
    random.seed(stage_seed)
    np.random.seed(stage_seed % (2**32))
    torch.manual_seed(stage_seed)
    tensor_parallel.model_parallel_cuda_manual_seed(stage_seed)


def destroy(failed: bool = False) -> None:
    """Tear down megatron's parallel state and the process group (tests, the bench).
    ``failed``: the run stopped on an error; NCCL's groups are then aborted, not shut down."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if not dist.is_initialized():
        return
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if failed and "nccl" in str(dist.get_backend()).lower() and abort is not None:
        # After a failure this rank may hold posted receives its failed peer never answers; a
        # graceful NCCL shutdown can wait on them, an abort cannot (gloo's shutdown never waits).
        abort()
        return
    dist.destroy_process_group()


def end_run() -> int:
    """Tear down one run's megatron parallel state and every process group it created, keeping
    the default one (jobs that train several runs in one process: the bench, the tests), and
    turn ``--deterministic-mode``'s torch switch off; returns how many groups were destroyed.

    Why: megatron's ``destroy_model_parallel`` only drops its references; torch keeps every
    group, and each gloo group keeps three threads and its connections. Measured: a T5 bench
    of 45 runs in one job reached about 1,000 threads a rank, and its last round ran every
    method 1.3-2x slower than its first (load average 65 on 2 cores)."""
    from megatron.core import parallel_state
    from torch.distributed import distributed_c10d as c10d

    from megatron_integration.determinism import end_deterministic_run

    end_deterministic_run()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if not dist.is_initialized():
        return 0
    default = c10d._get_default_group()
    groups = [g for g in list(c10d._world.pg_map) if g is not default]
    dist.barrier()  # no rank still has a transfer of this run in flight on a group
    for g in groups:
        dist.destroy_process_group(g)
    # A group's threads stop when its last reference goes; the run's models, DDP buckets and
    # optimizers hold some in reference cycles (and --manual-gc leaves the collector off).
    gc.collect()
    # What survived (the modules the run imported, caches) lives as long as the process: frozen,
    # the next runs' collections skip it (as the rank server froze its imports; preload_freeze).
    gc.freeze()
    return len(groups)


def thread_count() -> int:
    """OS threads of this process (Linux: ``/proc/self/task``; elsewhere Python's own), so a
    job can show that its runs leave none behind."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        import threading

        return threading.active_count()
