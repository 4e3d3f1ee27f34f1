"""Start a gloo (or NCCL) job of N local ranks from Python, without torchrun.

Used by ``python -m dynapipe bench`` (so the command alone trains PP2 on a CPU) and by
the tests. Each rank runs ``fn(*args)`` in a spawned process with torchrun's
environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``)
set; the results come back in rank order. A rank that raises stops the whole job and
its traceback is re-raised here (a :class:`DynaPipeError` comes back as its one line); a job that runs past ``timeout_s`` is killed and
reported, never left hanging.
"""
from __future__ import annotations

import os
import queue
import resource
import time
import traceback
from typing import Any, Callable, Optional, Sequence

from dynapipe.errors import DynaPipeError, spelled_as, spelling
from dynapipe.runtime.distributed import free_port
from dynapipe.runtime.process_start import add_preload, rank_context

# What a training or profiling rank imports, so forked ranks find it imported.
add_preload("megatron.core", "megatron.core.models.gpt", "megatron.core.pipeline_parallel",
            "megatron.core.distributed", "megatron.core.optimizer", "megatron_integration.training",
            "megatron_integration.t5_training")


class RankFailed(RuntimeError):
    """A rank of a spawned job raised; the message holds its traceback.

    Not :class:`dynapipe.runtime.SpawnError` (a :class:`DynaPipeError`, for the runtime's
    ``spawn``): a crash here is not bad input, so the command line reports it with exit
    status 1, and only :class:`RankUserError` is a :class:`DynaPipeError` (one line, status 2)."""


class RankUserError(RankFailed, DynaPipeError):
    """A rank stopped on a :class:`DynaPipeError` (bad input, a diverged loss): the message
    is that rank's one line, no traceback."""


# CPU seconds the ranks of finished spawn() jobs reported (see ranks_cpu_s).
_RANKS_CPU_S = [0.0]


def ranks_cpu_s() -> float:
    """User + system CPU seconds of every rank this process started with :func:`spawn`, and
    of the processes those ranks started and reaped (planner workers), as each rank measured
    them when it finished. Ranks fork from a server process (:mod:`dynapipe.runtime.process_start`),
    so they are not this process's children and ``RUSAGE_CHILDREN`` here never counts them."""
    return _RANKS_CPU_S[0]


def _own_cpu_s() -> float:
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def _entry(rank: int, world_size: int, port: int, threads: int, fn: Callable, args: Sequence[Any],
           results, names: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    import torch

    if threads > 0:
        torch.set_num_threads(threads)
    try:
        with spelled_as(names):  # a spawned rank starts without its parent's spelling
            value = fn(*args)
        results.put((rank, "ok", value, _own_cpu_s()))
    except DynaPipeError as e:
        results.put((rank, "user-error", " ".join(str(e).split()), _own_cpu_s()))
        raise SystemExit(2)
    except BaseException:
        results.put((rank, "error", traceback.format_exc(), _own_cpu_s()))
        raise SystemExit(1)
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def spawn(fn: Callable, world_size: int, args: Sequence[Any] = (), timeout_s: float = 600.0,
          threads_per_rank: Optional[int] = None) -> list:
    """Run ``fn(*args)`` on ``world_size`` spawned ranks; return their results in rank order.

    ``fn`` must be importable (a module-level function). ``threads_per_rank`` defaults to
    the CPU count divided by the ranks (at least 1).
    """
    if world_size < 1:
        raise DynaPipeError(f"world size {world_size}: need at least one rank.")
    threads = threads_per_rank or max(1, (os.cpu_count() or 1) // world_size)
    ctx = rank_context()
    results = ctx.Queue()
    port = free_port()
    procs = []
    for rank in range(world_size):
        p = ctx.Process(target=_entry, args=(rank, world_size, port, threads, fn, tuple(args), results, spelling()),
                        daemon=False)
        p.start()
        procs.append(p)
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RankFailed(f"job of {world_size} ranks did not finish within {timeout_s:.0f} s "
                                 f"(ranks done: {sorted(out)})")
            try:
                rank, status, payload, cpu_s = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in out]
                if dead:
                    raise RankFailed(f"rank {dead[0]} exited with code {procs[dead[0]].exitcode} "
                                     f"before reporting a result")
                continue
            _RANKS_CPU_S[0] += cpu_s
            if status == "user-error":
                raise RankUserError(f"rank {rank}: {payload}")
            if status == "error":
                raise RankFailed(f"rank {rank} failed:\n{payload}")
            out[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=5 if len(out) == world_size else 0.5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        results.close()
    return [out[r] for r in range(world_size)]
