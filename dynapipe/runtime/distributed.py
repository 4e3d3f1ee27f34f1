"""Process-group set-up and spawned multi-process runs, for tests, benchmarks and scripts.

:func:`spawn` runs a function on ``world_size`` spawned processes, each with its process
groups ready (:class:`DistContext`), and returns every rank's result; it never hangs:
past ``timeout_s`` the processes are killed and the call raises. :func:`spawn_outcomes`
waits for every rank and reports each one's result, traceback or exit code, which is what
a test needs to check how the other ranks behave when one dies.

Rank layout (Megatron's, with tensor parallelism 1): global rank = ``stage * dp +
replica``; pipeline ``r`` is ranks ``[r, dp + r, 2 dp + r, ...]``. The key-value store is
hosted by the parent process, so it outlives any rank that is killed.

Also the helpers every launch path shares (the Megatron one, :mod:`megatron_integration.launch`
and :mod:`megatron_integration.initialize`, included): :func:`free_port` and the choice of a
rank's GPU, :func:`local_gpu` / :func:`local_cuda_device` / :func:`select_local_gpu`.
"""
from __future__ import annotations

import datetime
import os
import pickle
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dynapipe.errors import DynaPipeError, spelled_as, spelling
from dynapipe.runtime.process_start import rank_start_method


# The ports :func:`free_port` hands out: below the kernel's ephemeral range, clear of torchrun's
# default 29500 and its neighbours (another job launched with the default).
_TORCHRUN_DEFAULT_PORTS = range(29400, 29600)
_next_port: Optional[int] = None


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default 32768 where unknown)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that is free now, for a server (a torchrun store, a TCP init
    method) that binds it a moment later in another process.

    A port the kernel picks with ``bind(host, 0)`` comes from the ephemeral range, which every
    outgoing connection also draws from: gloo opens many, so another job on the machine can take
    the port between this check and the server's bind (``EADDRINUSE``). The port is taken from
    below that range instead, where only servers that name their port bind, and each process
    walks it from its own pid-derived start, so two processes that ask at the same time get
    different ports. Falls back to ``bind(host, 0)`` where the ephemeral range leaves no room
    below it."""
    global _next_port
    high = _ephemeral_low()
    low = max(1024, high - 12000)
    span = high - low
    if span < 1000:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            return s.getsockname()[1]
    if _next_port is None:
        _next_port = low + (os.getpid() * 7919) % span
    for _ in range(span):
        port, _next_port = _next_port, low + (_next_port + 1 - low) % span
        if port in _TORCHRUN_DEFAULT_PORTS:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise DynaPipeError(f"no free TCP port on {host} in {low}..{high - 1}: free some, or name the port yourself "
                        f"(--master-port)")


def cuda_device_count() -> int:
    """The CUDA devices this process sees (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def local_gpu(local_rank: int, local_world_size: Optional[str], count: int, visible: Optional[str] = None) -> int:
    """The index of this rank's GPU among the ``count`` it sees: ``local_rank`` modulo ``count``.
    ``local_world_size`` (torchrun's ``LOCAL_WORLD_SIZE``, None without torchrun): torchrun shows
    every local rank the same GPUs, so more local ranks than GPUs would put two ranks on one GPU,
    which NCCL refuses only later ("Duplicate GPU detected"); refused here in one line. Except
    where ``visible`` (``CUDA_VISIBLE_DEVICES``) names one GPU: a wrapper that gives each rank
    its own (``CUDA_VISIBLE_DEVICES=$LOCAL_RANK``) shows each one GPU, as it should."""
    own = count == 1 and visible is not None and len([v for v in visible.split(",") if v.strip()]) == 1
    if local_world_size is not None and int(local_world_size) > count and not own:
        raise DynaPipeError(f"torchrun started {local_world_size} processes on this node but it has {count} visible "
                            f"GPU(s): NCCL needs one GPU a rank. Give --nproc_per_node {count} (or fewer), or make "
                            f"more GPUs visible (CUDA_VISIBLE_DEVICES).")
    return local_rank % count


def local_cuda_device(default_local_rank: int = 0, *, local_rank: Optional[int] = None) -> Optional[int]:
    """The CUDA device this rank should use (:func:`local_gpu`); None without CUDA.

    ``local_rank`` given (ranks this process spawned on its own host, which know their place):
    that rank modulo the devices. Otherwise the environment decides, as torchrun sets it:
    ``LOCAL_RANK`` (``default_local_rank`` when unset), checked against ``LOCAL_WORLD_SIZE``
    and ``CUDA_VISIBLE_DEVICES``. Never the global rank: on a second node, or with each rank
    shown only its own GPU, that names a device the rank does not have."""
    count = cuda_device_count()
    if not count:
        return None
    if local_rank is not None:
        return local_gpu(local_rank, None, count)
    return local_gpu(int(os.environ.get("LOCAL_RANK", default_local_rank)), os.environ.get("LOCAL_WORLD_SIZE"),
                     count, os.environ.get("CUDA_VISIBLE_DEVICES"))


def select_local_gpu(default_local_rank: int = 0, *, local_rank: Optional[int] = None) -> None:
    """Make this rank's GPU (:func:`local_cuda_device`: ``LOCAL_RANK``, modulo the visible
    devices: a scheduler that shows each task only its own GPU still numbers local ranks from 0
    up) the current CUDA device; nothing without CUDA. Called before anything may touch CUDA
    (Transformer Engine's import while the arguments are checked included), so no rank opens a
    context on GPU 0."""
    device = local_cuda_device(default_local_rank, local_rank=local_rank)
    if device is not None:
        torch.cuda.set_device(device)


def pipeline_ranks(world_size: int, pp: int) -> list[list[int]]:
    """Global ranks of each pipeline (replica ``r`` is entry ``r``), stage order."""
    if pp < 1 or world_size % pp:
        raise DynaPipeError(f"pipeline size {pp} does not divide the world size {world_size}; "
                            f"use a world of pp x dp processes.")
    dp = world_size // pp
    return [[s * dp + r for s in range(pp)] for r in range(dp)]


@dataclass
class DistContext:
    """One rank's view of the job: its place in the pipeline and its process groups.

    ``store`` is the job's key-value store (give it to the executor so failures reach
    every rank); ``pipeline_group`` links the stages of this rank's replica,
    ``data_group`` the replicas of this rank's stage.
    """

    rank: int
    world_size: int
    pp: int
    dp: int
    stage: int
    replica: int
    store: dist.Store
    pipeline_group: Any
    data_group: Any


def init_distributed(rank: int, world_size: int, *, store_port: int, pp: int = 1, backend: str = "gloo",
                     timeout_s: float = 60.0, host: str = "127.0.0.1",
                     local_rank: Optional[int] = None) -> DistContext:
    """Join the store at ``host:store_port``, initialise the default process group and build
    the pipeline and data-parallel groups. ``timeout_s`` bounds collectives and store calls;
    with NCCL it is also what bounds a stuck transfer (the watchdog aborts).

    With NCCL the rank's GPU is its local rank's (:func:`select_local_gpu`): ``local_rank`` if
    given, else ``LOCAL_RANK`` as torchrun sets it, else ``rank`` (one host, no launcher)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if "nccl" in backend:
        select_local_gpu(rank, local_rank=local_rank)
    store = dist.TCPStore(host, store_port, world_size, False, timeout=timeout)
    dist.init_process_group(backend, store=dist.PrefixStore("pg", store), rank=rank, world_size=world_size,
                            timeout=timeout)
    pipes = pipeline_ranks(world_size, pp)
    dp = len(pipes)
    stage, replica = divmod(rank, dp)
    pipe_group = data_group = dist.group.WORLD
    # Every rank creates every group, in the same order; a group spanning the world is WORLD.
    if dp > 1:
        for ranks in pipes:
            g = dist.new_group(ranks)
            if rank in ranks:
                pipe_group = g
    if pp > 1:
        for s in range(pp):
            ranks = [s * dp + r for r in range(dp)]
            g = dist.new_group(ranks)
            if rank in ranks:
                data_group = g
    return DistContext(rank, world_size, pp, dp, stage, replica, store, pipe_group, data_group)


@dataclass
class RankOutcome:
    """How one spawned rank ended: its return value, or its traceback, or its exit code."""

    rank: int
    value: Any = None
    error: Optional[str] = None
    exitcode: Optional[int] = None
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None and not self.timed_out and self.exitcode == 0


class SpawnError(DynaPipeError):
    """One or more spawned ranks failed; the message holds every failing rank's traceback."""


def _rank_main(rank: int, fn: Callable, world_size: int, port: int, pp: int, backend: str, timeout_s: float,
               threads: int, args: tuple, results, names: dict) -> None:
    torch.set_num_threads(threads)
    try:
        # A spawned rank starts without its parent's spelling: its errors name parameters as the parent's do.
        with spelled_as(names):
            # Every rank runs on this host: its rank is its local rank, whatever LOCAL_RANK the
            # parent (or the fork server) was started with.
            ctx = init_distributed(rank, world_size, store_port=port, pp=pp, backend=backend, timeout_s=timeout_s,
                                   local_rank=rank)
            results.put((rank, "ok", pickle.dumps(fn(ctx, *args))))
        code = 0
    except BaseException:  # noqa: BLE001 - reported to the parent with its traceback
        results.put((rank, "error", traceback.format_exc()))
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: a process group whose peer failed can block in its destructor.
    os._exit(code)


def spawn_outcomes(fn: Callable, world_size: int, *, args: Sequence = (), pp: int = 1, backend: str = "gloo",
                   timeout_s: float = 120.0, threads: int = 1) -> list[RankOutcome]:
    """Run ``fn(ctx: DistContext, *args)`` on ``world_size`` spawned processes; one outcome per rank.

    ``fn`` must be importable (a module-level function) and its return value picklable.
    Waits for every rank; a rank still running after ``timeout_s`` seconds (start-up
    included) is killed and marked ``timed_out``.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timeout, wait_for_workers=False)
    method = rank_start_method()
    results = mp.get_context(method).SimpleQueue()
    pc = mp.start_processes(_rank_main, args=(fn, world_size, store.port, pp, backend, timeout_s, threads,
                                              tuple(args), results, spelling()),
                            nprocs=world_size, join=False, start_method=method)
    outcomes = {r: RankOutcome(r) for r in range(world_size)}

    def drain() -> None:
        while not results.empty():
            rank, kind, payload = results.get()
            if kind == "ok":
                outcomes[rank].value = pickle.loads(payload)
            else:
                outcomes[rank].error = payload

    deadline = time.monotonic() + timeout_s
    procs = pc.processes
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        drain()
        time.sleep(0.02)
    for r, p in enumerate(procs):
        if p.is_alive():
            p.kill()
            outcomes[r].timed_out = True
        p.join(5)
        outcomes[r].exitcode = p.exitcode
    drain()
    for o in outcomes.values():
        if o.error is None and not o.timed_out and o.exitcode != 0:
            o.error = f"rank {o.rank} exited with code {o.exitcode} without reporting a result"
    del store
    return [outcomes[r] for r in range(world_size)]


def spawn(fn: Callable, world_size: int, *, args: Sequence = (), pp: int = 1, backend: str = "gloo",
          timeout_s: float = 120.0, threads: int = 1) -> list[Any]:
    """Like :func:`spawn_outcomes`, but returns the values and raises :class:`SpawnError`
    (with every failing rank's traceback) unless every rank succeeded."""
    outs = spawn_outcomes(fn, world_size, args=args, pp=pp, backend=backend, timeout_s=timeout_s, threads=threads)
    bad = [o for o in outs if not o.ok]
    if bad:
        parts = [f"--- rank {o.rank}: " + ("timed out after %gs" % timeout_s if o.timed_out else o.error or "")
                 for o in bad]
        raise SpawnError(f"{len(bad)} of {world_size} ranks failed:\n" + "\n".join(parts))
    return [o.value for o in outs]
