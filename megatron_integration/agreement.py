"""Ranks agree on a failure before anything collective, so one rank's error stops every rank.

Why: a rank that fails alone (a file only its node cannot see, its disk full, a data file only
rank 0 reads) would leave the others waiting in their next collective until the process-group
timeout, and then die with a gloo or NCCL traceback that does not name the cause. Here every
rank posts its own result (None or one line) and every rank raises the first failing rank's
line.

Two moments: :func:`same_error_everywhere` once the process group exists (an all-gather), and
:func:`agree_at_start` before it does (argument and file checks of a ``torchrun`` job run before
``init_process_group``), through the job's rendezvous store, which
:func:`megatron_integration.initialize.init_distributed` then reuses for the process group.
"""
from __future__ import annotations

import datetime
import os
import time
from typing import Callable, Optional, Sequence, TypeVar

import torch.distributed as dist

from dynapipe.errors import DynaPipeError, error_lines, refusal_of

# The job's rendezvous (store, rank, world size), joined by agree_at_start before the process group.
_RENDEZVOUS: list = []
_START_KEY = "dynapipe/start-up"
T = TypeVar("T")


def from_rank_0(read: Callable[[], T], what: str) -> T:
    """``read()`` run on rank 0 alone and its result sent to every rank; collective. A failure
    (one line naming ``what``) is raised on every rank, so no rank waits for a value that never
    comes."""
    value, error = attempt(read, what) if not dist.is_initialized() or dist.get_rank() == 0 else (None, None)
    same_error_everywhere(error)
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [value]
        dist.broadcast_object_list(box, src=0)
        value = box[0]
    return value


def everyone(value) -> list:
    """Every rank's ``value`` (a picklable object), by rank; collective (a one-item list
    without a process group)."""
    values = [value]
    if dist.is_initialized() and dist.get_world_size() > 1:
        values = [None] * dist.get_world_size()
        dist.all_gather_object(values, value)
    return values


def first_failure(errors: list) -> None:
    """Raise the first failing rank's line from every rank's ``errors`` (None: that rank is fine)."""
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        rank, text = failed[0]
        raise refusal_of(text if len(errors) == 1 else "\n".join(f"rank {rank}: {x}" for x in text.split("\n")))


def same_error_everywhere(error: Optional[str], errors: Optional[list] = None) -> None:
    """Raise on every rank if any rank failed (the first failing rank's line); collective,
    unless ``errors`` (every rank's, already gathered) is given."""
    first_failure(everyone(error) if errors is None else errors)


def attempt(fn: Callable[[], object], what: str, fix: str = ""):
    """``(fn(), None)``, or ``(None, one line)`` naming ``what`` failed, why, and ``fix``.

    Any exception counts, not only :class:`DynaPipeError`: an ``OSError`` or a torch error on
    one rank must reach :func:`same_error_everywhere` like a refusal does."""
    try:
        return fn(), None
    except DynaPipeError as e:
        return None, str(e)
    except BaseException as e:  # noqa: BLE001 - reported on every rank, then raised there
        if not isinstance(e, Exception) and not is_checkpoint_exception(e):
            raise  # KeyboardInterrupt, SystemExit
        return None, f"{what} failed: {one_line(e)}" + (f"; {fix}" if fix else "")


UNNAMED_RANK = "a rank failed (the coordinating rank holds its cause)"


def is_checkpoint_exception(e: BaseException) -> bool:
    """torch.distributed.checkpoint's ``CheckpointException``, a ``BaseException`` that
    ``except Exception`` lets through."""
    from torch.distributed.checkpoint.api import CheckpointException

    return isinstance(e, CheckpointException)


def one_line(e: BaseException) -> str:
    """``e`` as one line: its type and text, or for a ``CheckpointException`` (whose text holds
    tracebacks) each failing rank's exception (only the coordinating rank has them:
    :data:`UNNAMED_RANK` elsewhere)."""
    if not is_checkpoint_exception(e):
        return f"{type(e).__name__}: {' '.join(str(e).split())}"
    causes = []
    for rank, cause in sorted(e.failures.items()):
        cause = cause[0] if isinstance(cause, tuple) else cause  # (exception, traceback) when wrapped
        causes.append(f"rank {rank}: {type(cause).__name__}: {' '.join(str(cause).split())}")
    return "; ".join(causes) or UNNAMED_RANK


def launched_job() -> bool:
    """True for a rank of a multi-rank job started with ``torchrun`` (or its environment)."""
    return "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1


def joined_rendezvous() -> Optional[tuple]:
    """``(store, rank, world_size)`` joined by :func:`agree_at_start`, or None; taken once (the
    process group is built on it, and a later job in the same process joins afresh)."""
    return _RENDEZVOUS.pop() if _RENDEZVOUS else None


def agree_at_start(error: Optional[str], timeout_minutes: float = 10.0) -> None:
    """Before the process group exists: every rank of a ``torchrun`` job posts its start-up
    result (``error``: None or one line) to the job's rendezvous store and waits for every
    other rank's; all raise the first failing rank's line. A no-op for a one-process run or
    when the process group already exists.

    ``timeout_minutes``: how long to wait for a rank that never reports (it crashed before
    reaching here); the error then names the ranks that did not.
    Why the store and not a process group: a rank whose check failed may not know the backend,
    and NCCL needs its device before a collective; the store is what ``init_process_group``
    would create anyway, and :func:`megatron_integration.initialize.init_distributed` reuses it."""
    if not launched_job() or dist.is_initialized():
        if error is not None:
            raise refusal_of(error)
        return
    timeout = datetime.timedelta(minutes=timeout_minutes)
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
    store.set_timeout(timeout)
    # torchrun's agent store outlives a restart (--max-restarts): each attempt agrees under its own keys.
    prefix = f"{_START_KEY}/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    store.set(f"{prefix}/{rank}", "" if error is None else "!" + error)
    keys = [f"{prefix}/{r}" for r in range(world_size)]
    try:
        store.wait(keys, timeout)
    except Exception:  # noqa: BLE001 - a store timeout: name who never came
        missing = [r for r, k in enumerate(keys) if not store.check([k])]
        raise refusal_of(error or f"ranks {missing} did not finish their start-up checks within "
                            f"{timeout_minutes:g} min (they crashed or are still starting; see their logs); "
                            f"--distributed-timeout-minutes sets the wait.") from None
    errors = [None if not v else v.decode()[1:] for v in store.multi_get(keys)]
    if any(e is not None for e in errors):
        # The store lives in rank 0's process: it leaves only after every rank has read.
        store.add(f"{prefix}/read", 1)
        if rank == 0:
            deadline = time.monotonic() + 30.0
            while store.add(f"{prefix}/read", 0) < world_size and time.monotonic() < deadline:
                time.sleep(0.05)
        first_failure(errors)
    _RENDEZVOUS[:] = [(store, rank, world_size)]


def timeout_in_argv(argv: Sequence[str], default: float = 10.0) -> float:
    """``--distributed-timeout-minutes`` as a command line gives it (``default`` when absent or
    not a number): the wait of a rank whose own checks failed, which has no parsed config."""
    value = None
    for i, a in enumerate(argv):
        if a == "--distributed-timeout-minutes" and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith("--distributed-timeout-minutes="):
            value = a.split("=", 1)[1]
    try:
        minutes = float(value) if value is not None else default
    except ValueError:
        return default
    return minutes if minutes > 0 and minutes == minutes else default


def agreed_start(build: Callable[[], T], timeout_minutes: Callable[[T], float] = lambda value: 10.0,
                 failed_timeout_minutes: float = 10.0) -> T:
    """``build()`` (an entry point's argument and file checks), agreed on by every rank of a
    ``torchrun`` job with :func:`agree_at_start`: a rank whose checks fail stops every rank with
    its line. ``timeout_minutes(value)``: the wait for ranks still checking (the job's
    ``--distributed-timeout-minutes``); ``failed_timeout_minutes``: the same wait for a rank whose
    own checks failed (:func:`timeout_in_argv`). Any other exception is posted as its one line,
    then re-raised on its own rank with its traceback."""
    try:
        value = build()
    except DynaPipeError as e:
        # One line per refusal (a RefusedArguments has several), for every rank to print alike.
        agree_at_start("\n".join(error_lines(e)), failed_timeout_minutes)
        raise  # unreachable: agree_at_start raised
    except Exception as e:
        try:
            agree_at_start(f"start-up checks failed: {type(e).__name__}: {' '.join(str(e).split())}",
                           failed_timeout_minutes)
        except DynaPipeError:
            pass
        raise
    agree_at_start(None, timeout_minutes(value))
    return value


# What gloo and NCCL say when the other end of a connection is gone (its process exited).
_PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "NCCL communicator was aborted",
              "remote process exited")


def peer_lost(e: BaseException, where: str) -> Optional[DynaPipeError]:
    """``e`` as one line when it is the backend's report that another rank is gone (a
    ``RuntimeError`` from gloo or NCCL inside a collective or point-to-point transfer), else
    None. ``where``: what this rank was doing (``iteration 3``).

    Why: the survivor of a killed or crashed rank otherwise stops with a traceback through
    megatron-core's schedule whose last line blames no one; the dead rank's log holds the cause."""
    text = str(e)
    if not isinstance(e, RuntimeError) or not any(s in text for s in _PEER_GONE):
        return None
    rank = dist.get_rank() if dist.is_initialized() else 0
    first = " ".join(text.splitlines()[0].split()) if text else ""
    first = first.split(". This is typically caused")[0]  # gloo's boilerplate advice
    return DynaPipeError(f"{where}: rank {rank} lost a peer ({type(e).__name__}: {first}); another rank stopped "
                         f"(it crashed, was killed or ran out of memory): its own log holds the cause.")


def exit_line(e: BaseException, started: bool) -> Optional[str]:
    """The one line a training script prints for ``e`` before exiting (status 2, or a rejected
    result's 16 or 17), or None
    when ``e`` is to be raised as it is: a :class:`DynaPipeError` (bad input, a refused plan, a
    failure the loop already named), or once training has ``started`` another rank gone before
    the training loop (building the model or the optimizer, loading a checkpoint), as the loop
    names it (:func:`peer_lost`), not with the backend's traceback."""
    if isinstance(e, DynaPipeError):
        return " ".join(str(e).split())
    lost = peer_lost(e, "start-up") if started else None
    return None if lost is None else " ".join(str(lost).split())
