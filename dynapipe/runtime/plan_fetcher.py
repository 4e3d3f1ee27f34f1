"""Take this rank's payloads from the store ahead of the training loop, in a thread.

A :class:`PayloadFetcher` thread, with its own store connection, waits for this rank's
payload of each iteration in turn, acknowledges it (the last reader deletes it), decodes
it into an :class:`IterationData` (plan, torch tensors, metadata) and queues it, at most
``depth`` iterations ahead. The training loop then only pops a decoded iteration: the
transfer and decoding overlap the training step instead of adding to it.

The thread never raises into nowhere: an error (a planner failure posted to the store,
a corrupted payload, a lost store) is queued and re-raised by :meth:`PayloadFetcher.get`
in the training loop.
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

from dynapipe.errors import DynaPipeError, iteration_name
from dynapipe.plan.instructions import ExecutionPlan
from dynapipe.runtime.kv_store import KVStore, KVStoreSpec, delete_blob, wait_blob
from dynapipe.runtime.plan_payload import decode_payload
from dynapipe.runtime.plan_source import decode_plan
from dynapipe.runtime.planner_workers import Keyspace, PlannerWorkerError


@dataclass
class IterationMeta:
    """Figures of one iteration. Tokens are counts; times in ms.

    ``real_tokens`` / ``padded_tokens``: this rank's replica; real = non-pad tokens,
    input + target; padded = computed, padding included. ``global_*`` over the whole
    global batch, every replica; ``global_loss_tokens`` the tokens the loss counts, i.e.
    the sum of every ``loss_mask`` of the global batch (normalise the loss by it; the
    plan's own ``global_loss_tokens`` is the planner's count, which for decoder-only data
    also counts the input tokens). ``truncated_samples`` of the batch were cut to the length
    limit. ``planner_node`` planned it; ``wait_ms`` is the time this rank's training loop
    spent in ``next()`` for it (the planners' times: ``DynaPipeLoader.planner_stats``).
    """

    iteration: int
    num_samples: int
    consumed_samples: int
    real_tokens: int
    padded_tokens: int
    global_real_tokens: int
    global_padded_tokens: int
    global_loss_tokens: int
    # dynapipe.cost.model_flops.TokenWork as JSON, over the global batch: the planned
    # micro-batches' shapes, and the samples at their own lengths (--log-throughput prices them).
    global_executed_work: dict
    global_real_work: dict
    truncated_samples: int
    planner_node: int
    wait_ms: float = 0.0
    extra: dict = field(default_factory=dict)


@dataclass
class IterationData:
    """What the loader yields: this rank's plan, its tensors by micro-batch and name, metadata."""

    plan: ExecutionPlan
    micro_batches: dict  # mb -> {name: torch.Tensor}
    meta: IterationMeta
    digest: int = 0  # CRC32 of what the rank runs (plan and tensors; not the planning metadata)

    @property
    def iteration(self) -> int:
        return self.meta.iteration


def unpack(blob: bytes, iteration: int, replica: int, stage: int) -> IterationData:
    """Decode one payload into plan, torch tensors (sharing the payload's memory) and metadata."""
    import torch

    p = decode_payload(bytearray(blob))  # writable memory: tensors need no copy
    if (p.iteration, p.replica, p.stage) != (iteration, replica, stage):
        raise DynaPipeError(f"received the payload of {iteration_name(p.iteration)} replica {p.replica} stage {p.stage} "
                            f"for {iteration_name(iteration)} replica {replica} stage {stage}; is another job using "
                            f"the same store namespace?")
    plan = decode_plan(p.plan_bytes)
    tensors = {mb: {name: torch.from_numpy(arr) for name, arr in d.items()} for mb, d in p.tensors.items()}
    m = dict(p.meta)
    fields = set(IterationMeta.__dataclass_fields__) - {"iteration", "wait_ms", "extra"}
    missing = sorted(fields - set(m))
    if missing:
        raise DynaPipeError(f"payload of {iteration_name(iteration)} lacks metadata {missing}; "
                            f"run the same dynapipe version on every node.")
    meta = IterationMeta(iteration=iteration, **{k: m.pop(k) for k in fields}, extra=m)
    return IterationData(plan, tensors, meta, p.content_crc)


class _Stopped(Exception):
    pass


class PayloadFetcher:
    """The fetch thread of one rank (see the module docstring).

    Iterations ``start, start + 1, ...`` (up to ``end`` exclusive when given) of
    (``replica``, ``stage``); ``readers`` ranks read each payload.
    """

    def __init__(self, store: KVStoreSpec, keys: Keyspace, replica: int, stage: int, readers: int,
                 start: int, end: Optional[int], depth: int = 2):
        self.store, self.keys = store, keys
        self.replica, self.stage, self.readers = replica, stage, readers
        self.start, self.end = start, end
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._error: Optional[BaseException] = None  # the thread's failure, once the loop has seen it
        self._stop = threading.Event()
        self._last_error_check = 0.0
        self._kv: Optional[KVStore] = None
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"dynapipe-fetch-r{replica}-s{stage}")
        self._thread.start()

    def _on_poll(self) -> None:
        if self._stop.is_set():
            raise _Stopped()
        now = time.monotonic()
        if now - self._last_error_check > 0.05:  # a store round trip; not on every poll
            self._last_error_check = now
            err = self._kv.get(self.keys.error)
            if err is not None:
                raise PlannerWorkerError(err.decode(errors="replace"))

    def _put(self, item) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def _run(self) -> None:
        try:
            self._kv = self.store.connect()
            it = self.start
            while not self._stop.is_set() and (self.end is None or it < self.end):
                key = self.keys.payload(it, self.replica, self.stage)
                blob = wait_blob(self._kv, key, float("inf"), self._on_poll,
                                 what=f"the plan of {iteration_name(it)}")
                if self._kv.add(Keyspace.acks(key), 1) >= self.readers:
                    delete_blob(self._kv, key)
                    self._kv.delete(Keyspace.acks(key))
                self._put(unpack(blob, it, self.replica, self.stage))
                it += 1
        except _Stopped:
            pass
        except BaseException as e:  # handed to the training loop
            self._put(e)
        finally:
            if self._kv is not None:
                try:
                    self._kv.close()
                except Exception:
                    pass

    def get(self, timeout_s: float) -> Optional[IterationData]:
        """The next iteration, or None if none arrived within ``timeout_s``; re-raises the
        thread's error."""
        if self._error is not None:  # every later call gets the same cause, not a stopped thread
            raise self._error
        try:
            item = self._queue.get(timeout=timeout_s)
        except queue.Empty:
            if not self._thread.is_alive() and self._queue.empty():
                raise DynaPipeError("the plan fetch thread has stopped; the loader was closed or ran out of iterations.")
            return None
        if isinstance(item, BaseException):
            self._error = item
            raise item
        return item

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop the thread (it may be waiting for a payload that will never come)."""
        self._stop.set()
        self._thread.join(timeout_s)
