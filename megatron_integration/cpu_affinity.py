"""Pin each local rank to its own CPU cores (``--dynapipe-cpu-affinity cores``).

Unpinned, the kernel moves a rank's compute thread between cores, and for a while two ranks
can share one core while the other idles. A pipeline stage then runs an op at half speed
exactly when the schedule expected both stages to compute, which hurts most the schedules
that keep both stages busy (DynaPipe's). Measured on a 2-core host, the representative
preset's stage-1 compute for the same micro-batches varied by a third between runs unpinned.
Pinning gives each local rank a disjoint, equal slice of the cores this process may use;
processes it starts later (the planner workers) inherit its slice.
"""
from __future__ import annotations

import os
from typing import Optional

from dynapipe.errors import DynaPipeError

AFFINITIES = ("none", "cores")

# The slice this process was pinned to: a job that trains several runs in one process
# (the T5 bench, the tests) pins once; its later runs must not slice the slice again.
_pinned: Optional[list[int]] = None


def local_rank_and_size() -> tuple[int, int]:
    """This process's rank among the ranks on its host and their number (torchrun's
    ``LOCAL_RANK``/``LOCAL_WORLD_SIZE``; a single-host job's ``RANK``/``WORLD_SIZE`` without them)."""
    rank = os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0"))
    size = os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1"))
    return int(rank), int(size)


def core_slice(cores: list[int], local_rank: int, local_world_size: int) -> list[int]:
    """The cores ``local_rank`` gets: ``cores`` cut into ``local_world_size`` equal,
    disjoint slices in order (the remainder, if any, unused). Refuses fewer cores than ranks."""
    if local_world_size > len(cores):
        raise DynaPipeError(f"--dynapipe-cpu-affinity cores needs a core for each of the {local_world_size} "
                            f"ranks on this host, but this process may use {len(cores)} ({cores}); "
                            f"launch fewer ranks per host or pass --dynapipe-cpu-affinity none.")
    if not 0 <= local_rank < local_world_size:
        raise DynaPipeError(f"local rank {local_rank} is outside the {local_world_size} ranks of this host")
    per = len(cores) // local_world_size
    return cores[local_rank * per:(local_rank + 1) * per]


def pin_local_rank(local_rank: Optional[int] = None, local_world_size: Optional[int] = None) -> list[int]:
    """Restrict this process to its slice of the cores it may use (see :func:`core_slice`);
    returns the slice; idempotent. Linux only: elsewhere it raises ``DynaPipeError`` (use ``none``)."""
    global _pinned
    if _pinned is not None:
        return list(_pinned)
    if not hasattr(os, "sched_setaffinity"):
        raise DynaPipeError("--dynapipe-cpu-affinity cores needs Linux (os.sched_setaffinity); "
                            "pass --dynapipe-cpu-affinity none.")
    env_rank, env_size = local_rank_and_size()
    rank = env_rank if local_rank is None else local_rank
    size = env_size if local_world_size is None else local_world_size
    mine = core_slice(sorted(os.sched_getaffinity(0)), rank, size)
    os.sched_setaffinity(0, mine)
    _pinned = list(mine)
    return mine


def bench_default(nproc: int) -> str:
    """The affinity a bench gives every method it runs on ``nproc`` local ranks: ``cores``
    where each rank can have a core of its own (Linux), else ``none``."""
    if not hasattr(os, "sched_getaffinity"):
        return "none"
    return "cores" if nproc <= len(os.sched_getaffinity(0)) else "none"


def use_profiler_threads(threads: Optional[int], cuda: bool) -> Optional[list[int]]:
    """Give this profiling process ``threads`` torch threads and, on CPU, ``threads`` cores of
    its own (its local rank's slice), as a training rank with that many threads runs under
    ``cores``; returns the cores, or None where it pins nothing (no ``threads``, CUDA, not
    Linux, fewer cores than asked).

    Why: a profile is what the planner prices the pinned training ranks with. Measured on the
    2-core host, an unpinned one-thread profile timed the ops 1.5x faster than the pinned ranks
    then ran them (its process could use the second core); a pinned one, within 3%.
    """
    if not threads:
        return None
    import torch

    torch.set_num_threads(threads)
    if cuda or not hasattr(os, "sched_setaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0)) if _pinned is None else list(_pinned)
    rank, _ = local_rank_and_size()
    slices = len(cores) // threads
    if rank >= slices:
        return None
    return pin_local_rank(rank, slices)
