"""Point-to-point transfers of an execution plan: checked tensors, posting, bounded waits.

Plans name peers by pipeline rank; :class:`PeerComm` maps them to global ranks once and
posts ``isend``/``irecv`` (``batch_isend_irecv`` for a group of starts) on the pipeline
process group. Gloo carries CPU tensors, NCCL CUDA tensors. Every tensor is checked
against the plan's :class:`TensorSpec` before it is handed to the backend, because gloo
aborts the whole process when a message does not fit its receive buffer.

:class:`Waiter` bounds every wait by a timeout and, given an :class:`AbortChannel`
(a key-value store every rank can reach), stops waiting as soon as another rank reports
a failure, so no rank hangs on a peer that will never send.
"""
from __future__ import annotations

import datetime
import queue
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from dynapipe.errors import ExecutorError
from dynapipe.plan.instructions import TensorSpec
from dynapipe.runtime.abort_channel import AbortChannel

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
    "int64": torch.int64, "int32": torch.int32, "bool": torch.bool, "uint8": torch.uint8,
}


class CommFailure(ExecutorError):
    """A transfer failed or did not complete within the timeout."""


class RemoteFailure(ExecutorError):
    """This rank stopped because another rank reported a failure."""


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a plan dtype name (``"bfloat16"`` -> ``torch.bfloat16``)."""
    try:
        return TORCH_DTYPES[name]
    except KeyError:
        raise ExecutorError(f"dtype {name!r} is not one a plan may use; use one of {sorted(TORCH_DTYPES)}.") from None


def allocate(spec: TensorSpec, device: torch.device) -> torch.Tensor:
    """An uninitialised receive buffer with the spec's exact shape and dtype."""
    return torch.empty(spec.shape, dtype=torch_dtype(spec.dtype), device=device)


def check_tensor(t, spec: TensorSpec, device: torch.device, where: str) -> torch.Tensor:
    """Return ``t`` as a contiguous tensor on ``device`` after checking it against ``spec``.

    Raises :class:`ExecutorError` naming ``where`` when the type, shape or dtype differs
    from the plan: a wrong size must never reach gloo, which aborts the process.
    """
    if not isinstance(t, torch.Tensor):
        raise ExecutorError(f"{where}: tensor {spec.name!r} is a {type(t).__name__}, the plan expects "
                            f"a tensor {list(spec.shape)} {spec.dtype}.")
    if tuple(t.shape) != tuple(spec.shape) or t.dtype != torch_dtype(spec.dtype):
        got = str(t.dtype).replace("torch.", "")
        raise ExecutorError(f"{where}: tensor {spec.name!r} is {list(t.shape)} {got}, the plan says "
                            f"{list(spec.shape)} {spec.dtype}; the handler and the plan disagree on "
                            f"the micro-batch shape.")
    if t.device != device:
        # Asynchronous only towards the GPU: a copy to the host would hand back a tensor that
        # the transfer could read before the copy has landed.
        t = t.to(device, non_blocking=device.type == "cuda")
    return t.contiguous()


@dataclass
class _Job:
    call: Callable[[], None]
    keep: list  # tensors kept alive until their transfers complete
    done: threading.Event = field(default_factory=threading.Event)
    error: Optional[BaseException] = None


# A transfer watched from the moment it is posted may be waited for much later: the bound
# that matters (``timeout_s`` from the moment the rank waits) is kept by the waiting thread,
# so the background wait itself only guards against a backend that never answers.
_BACKGROUND_TIMEOUT_S = 7 * 24 * 3600.0


class Waiter:
    """Waits for posted transfers, each wait bounded by ``timeout_s`` seconds.

    Without an abort channel (or with ``watch=False``) a wait blocks in the calling
    thread. Otherwise a backend wait (which nothing can interrupt once started) runs on a
    helper thread while the caller polls the channel every ``poll_s`` seconds: this is how a rank stops promptly
    when a rank it is not talking to has failed. To keep that off the critical path, a
    transfer is watched from the moment it is posted (:meth:`watch`), one helper thread per
    peer and direction (transfers of one peer and direction complete in posting order, so
    no watch waits behind one that needs this rank to move on first); by the time the
    rank needs the data it is usually there. CUDA (NCCL) waits only order the current
    stream after the transfer, so transfers are not watched there and the process group's own
    timeout is the bound (see :func:`dynapipe.runtime.distributed.init_distributed`); blocking
    calls (:meth:`submit`, the plan-digest exchange) still run on a helper thread.
    """

    def __init__(self, timeout_s: float, abort: Optional[AbortChannel] = None, poll_s: float = 0.1,
                 stream_ordered: bool = False, watch: bool = True):
        self.timeout_s = timeout_s
        self.abort = abort
        self.poll_s = poll_s
        self.stream_ordered = stream_ordered
        # Threaded under NCCL too: its transfers' waits only order the stream, but a blocking call
        # (the plan-digest exchange through the store) must still yield to another rank's report.
        self.threaded = abort is not None and watch
        self._queues: dict = {}
        self._threads: list[threading.Thread] = []
        # An executor dropped without close() still stops its helper threads once collected:
        # they hold only their queue, never the waiter.
        self._stop = weakref.finalize(self, _stop_serving, self._queues)

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop the helper threads: each finishes the jobs already queued, then ends.

        Waits up to ``timeout_s`` seconds in all; a thread still inside a backend wait that
        never returns (a transfer of a failed iteration) is left behind as a daemon. Idempotent;
        jobs submitted afterwards run in the calling thread."""
        self._stop()
        self.threaded = False
        deadline = time.monotonic() + timeout_s
        threads, self._threads = self._threads, []
        for t in threads:
            t.join(max(deadline - time.monotonic(), 0.0))

    def submit(self, fn: Callable[[], None], keep: Sequence = (), key: object = "calls") -> _Job:
        """Start ``fn`` on the helper thread of ``key`` (without an abort channel: run it
        now); :meth:`join` waits for it."""
        job = _Job(fn, list(keep))
        if not self.threaded:
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - raised by join, like the threaded case
                job.error = e
            job.done.set()
            return job
        jobs = self._queues.get(key)
        if jobs is None:
            jobs = self._queues[key] = queue.SimpleQueue()
            t = threading.Thread(target=_serve, args=(jobs,), name=f"dynapipe-wait-{key}", daemon=True)
            t.start()
            self._threads.append(t)
        jobs.put(job)
        return job

    def join(self, job: _Job, where, deadline: Optional[float] = None) -> None:
        """Wait for a submitted ``fn`` and raise its exception; raise :class:`RemoteFailure`
        naming ``where`` as soon as another rank reports a failure, and :class:`CommFailure`
        past ``deadline`` (``time.monotonic()``)."""
        while not job.done.wait(self.poll_s if deadline is None
                                else max(min(self.poll_s, deadline - time.monotonic()), 0.0)):
            if self.abort is not None and self.abort.count():
                raise RemoteFailure(f"{where}: stopped because another rank failed; {self.abort.root_cause()}")
            if deadline is not None and time.monotonic() >= deadline:
                raise self.failure(TimeoutError("Timed out"), where)
        if job.error is not None:
            raise job.error

    def call(self, fn: Callable[[], None], where, keep: Sequence = ()) -> None:
        """Run the blocking ``fn`` so that another rank's failure interrupts the wait."""
        self.join(self.submit(fn, keep), where)

    def watch(self, pending: "Pending", key: object) -> None:
        """Start waiting for ``pending`` in the background on the thread of ``key`` (a peer
        and a direction), when there is an abort channel to poll meanwhile."""
        if not self.threaded or self.stream_ordered or pending.job is not None or not pending.works:
            return
        works = [(w, 0) for w in pending.works]
        pending.job = self.submit(lambda: _wait_all(works, _BACKGROUND_TIMEOUT_S), pending.tensors, key)

    def wait(self, pending: "Pending", where) -> None:
        """Wait for ``pending``; raise :class:`CommFailure` or :class:`RemoteFailure` naming ``where``."""
        self.wait_many([(pending, where)])

    def wait_many(self, items: Sequence[tuple["Pending", object]]) -> None:
        """Wait for several ``(pending, where)`` in one go, all within one ``timeout_s``; a
        failure names the ``where`` of the transfer that failed. Transfers already waited
        for are skipped."""
        todo = [(p, w) for p, w in items if not p.done and p.works]
        for p, _ in todo:
            p.done = True
        if not todo:
            return
        if self.stream_ordered:
            for p, _ in todo:
                for w in p.works:
                    w.wait()
            return
        if not self.threaded:
            works = [(w, k) for k, (p, _) in enumerate(todo) for w in p.works]
            try:
                _wait_all(works, self.timeout_s)
            except _WaitError as e:
                raise self.failure(e.error, todo[e.owner][1]) from e.error
            return
        deadline = time.monotonic() + self.timeout_s
        for p, where in todo:
            if p.job is None:
                self.watch(p, "unwatched")
            try:
                self.join(p.job, where, deadline)
            except _WaitError as e:
                raise self.failure(e.error, where) from e.error

    def failure(self, e: BaseException, where: str) -> ExecutorError:
        """The :class:`CommFailure` of a transfer that raised ``e`` at ``where``: why in words,
        and the root cause another rank reported, if any (waiting up to 1 s for it)."""
        text = str(e)
        if "Timed out" in text or "timed out" in text:
            reason = (f"no matching transfer within the {self.timeout_s:g} s timeout (the peer is stuck, "
                      f"slow, or its plan does not match this one)")
        elif "closed" in text or "Connection reset" in text:
            reason = "the peer closed its connection (its process crashed or exited)"
        else:
            reason = "the transfer failed"
        cause = self.abort.root_cause(grace_s=1.0) if self.abort is not None else None
        more = f"; {cause}" if cause else ""
        return CommFailure(f"{where}: {reason} [{type(e).__name__}: {text.splitlines()[0] if text else ''}]{more}")


def _serve(jobs: "queue.SimpleQueue[Optional[_Job]]") -> None:
    """A helper thread: run jobs in order until the stop marker (``None``)."""
    while True:
        job = jobs.get()
        if job is None:
            return
        try:
            job.call()
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            job.error = e
        job.done.set()
        del job  # drop its tensors now, not when the next job arrives


def _stop_serving(queues: dict) -> None:
    for jobs in queues.values():
        jobs.put(None)
    queues.clear()


class _WaitError(Exception):
    """A backend wait failed: ``error``, for the transfer of owner index ``owner``."""

    def __init__(self, error: BaseException, owner: int):
        super().__init__(str(error))
        self.error, self.owner = error, owner


def _wait_all(works: Sequence[tuple], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for w, owner in works:
        left = max(deadline - time.monotonic(), 0.001)
        try:
            w.wait(datetime.timedelta(seconds=left))
        except Exception as e:  # noqa: BLE001 - backend errors are RuntimeErrors of many kinds
            raise _WaitError(e, owner) from e


def neighbour_exchanges(rank: int, size: int, ring: bool = True) -> list[tuple[int, bool]]:
    """The exchanges pipeline rank ``rank`` of ``size`` makes with its neighbours (``rank`` +- 1;
    with ``ring``, the last and the first too, which interleaved plans link) to set up their
    NCCL channels: ``(peer, send_first)``
    in one global order of the pairs (by their ranks), the lower rank of a pair sending first.
    Each exchange blocks until both ends made it, so a pair order every rank follows, and one
    end sending while the other receives, make the whole set of exchanges end (tested by
    playing them out)."""
    peers = {(rank - 1) % size, (rank + 1) % size} - {rank}
    if not ring:
        peers &= {rank - 1, rank + 1}
    return [(peer, rank < peer) for peer in sorted(peers, key=lambda q: (min(q, rank), max(q, rank)))]


class PeerComm:
    """Posts a plan's transfers on the pipeline process group.

    ``group`` is the pipeline group (``None``: the default group); pipeline rank ``p``
    is ``group``'s rank ``p``. ``device`` decides the backend: CUDA tensors need NCCL,
    CPU tensors gloo; a group without the needed backend is refused up front. ``ring``:
    set up the last rank's link to the first under NCCL (interleaved plans send over it); a
    plan that uses a link not set up still runs, torch creating it on first use.
    """

    def __init__(self, group: Optional[dist.ProcessGroup], device: torch.device, ring: bool = True):
        self.group = group
        self.device = device
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.global_ranks = [dist.get_global_rank(group, p) if group is not None else p
                             for p in range(self.size)]
        backend = str(dist.get_backend(group)).lower()
        need = "nccl" if device.type == "cuda" else "gloo"
        if need not in backend and device.type in ("cpu", "cuda"):
            raise ExecutorError(f"the pipeline process group uses backend {backend!r} but the executor's "
                                f"device is {device}: {device.type} tensors need {need}; create the group "
                                f"with backend {need!r} (or 'cpu:gloo,cuda:nccl').")
        # torch requires every rank of a group to join the group's first batch_isend_irecv under
        # NCCL (it creates the group-wide communicator lazily), but a plan that groups starts
        # (the compiler's do not; a hand-written one may) may batch on some stages only: the
        # others never would, and the batching stages would wait on them forever. One
        # collective first, on every rank (executors are created in the same order on all of
        # them), creates it up front. gloo has no such rule, and there a rank that never builds
        # its executor must not hold the others in a collective the executor's timeout and
        # failure watch cannot end.
        if device.type == "cuda":
            dist.all_reduce(torch.zeros(1, device=device), group=group)
        # Under NCCL a lone isend/irecv runs on a two-rank communicator of its own, which torch
        # creates on first use: mid-iteration, blocking the host, and past the failure watch if
        # the peer has died by then. One exchange with each pipeline neighbour creates them now.
        # (Not everything posted as one batch on the group's communicator: all of a rank's
        # transfers would then run in posting order on one stream, and a receive posted early
        # from one neighbour would hold back every later send to the other.)
        if device.type == "cuda":
            for peer, send_first in neighbour_exchanges(self.rank, self.size, ring):
                mine, theirs = torch.zeros(1, device=device), torch.empty(1, device=device)
                first, second = ((dist.isend, mine), (dist.irecv, theirs))[::1 if send_first else -1]
                works = [fn(t, self.global_ranks[peer], group=group) for fn, t in (first, second)]
                for w in works:
                    w.wait()
            torch.cuda.synchronize(device)
        self.posted = 0

    def global_rank(self, peer: int) -> int:
        """Global rank of pipeline rank ``peer``."""
        return self.global_ranks[peer]

    def post(self, ops: list[tuple[object, bool, torch.Tensor, int]], batch: bool = False) -> dict[object, "Pending"]:
        """Post ``(owner, is_send, tensor, peer)`` transfers, in order: one by one, or with
        ``batch`` (a plan's grouped starts) as one ``batch_isend_irecv``.

        Returns one :class:`Pending` per owner (an instruction posts one transfer per
        tensor of its message). When the backend coalesces a batch into fewer works than
        transfers, every owner of the batch shares one :class:`Pending`.
        """
        self.posted += len(ops)
        if not batch or len(ops) == 1:
            # The tensors of one message (a T5 decoder's hidden states and encoder output)
            # go one by one: each end posts them in the same order, which the pair's FIFO
            # matches, and under NCCL they stay on the pair's own communicator rather than the
            # group's, whose one stream would hold them behind every other transfer posted.
            out: dict[object, Pending] = {}
            for owner, is_send, t, peer in ops:
                fn = dist.isend if is_send else dist.irecv
                p = out.setdefault(owner, Pending([], []))
                p.works.append(fn(t, self.global_ranks[peer], group=self.group))
                p.tensors.append(t)
            return out
        p2p = [dist.P2POp(dist.isend if s else dist.irecv, t, self.global_ranks[p], group=self.group)
               for _, s, t, p in ops]
        works = list(dist.batch_isend_irecv(p2p))
        if len(works) != len(ops):
            shared = Pending(works, [t for _, _, t, _ in ops])
            return {owner: shared for owner, *_ in ops}
        out: dict[object, Pending] = {}
        for (owner, _, t, _), w in zip(ops, works):
            p = out.setdefault(owner, Pending([], []))
            p.works.append(w)
            p.tensors.append(t)
        return out


@dataclass
class Pending:
    """Posted transfers not yet waited for (a backend work may be waited only once).

    ``tensors`` keeps what is sent or received alive until the transfer completes.
    """

    works: list
    tensors: list = field(default_factory=list)
    done: bool = False
    job: Optional[_Job] = None  # the background wait, when watched
