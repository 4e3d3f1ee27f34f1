"""Planner worker processes: plan iterations ahead and publish each rank's payload.

A planner node (a node's local rank 0) starts ``num_workers`` processes (forked from a server
that has imported the planner: :func:`~dynapipe.runtime.process_start.helper_context`). They
share one task queue of iteration numbers; for each, a worker draws the global batch
from the sampler, plans it, fills every (replica, stage)'s micro-batch tensors and puts
one payload per (replica, stage) into the key-value store (with ``WorkerJob.replicas``,
only those replicas' plans are compiled and published: nodes split the replicas). Workers talk to their parent
only through two local queues (iterations in; "done" and error reports out).

A worker that fails reports its traceback to its parent and writes a short error to
the store, where every rank's loader sees it; a worker whose parent dies exits at once.
"""
from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import multiprocessing.util
import os
import queue
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from dynapipe.cost.model_flops import micro_batches_work, samples_work
from dynapipe.data.collate import TensorRequest, collate
from dynapipe.data.sampler import GlobalBatchSampler, SamplerConfig
from dynapipe.data.samples import SampleDataset
from dynapipe.errors import DynaPipeError, ExecutorError, PlanError, given, iteration_name, spelled_as
from dynapipe.plan.instructions import ExecutionPlan, LoadInput
from dynapipe.runtime.kv_store import KVStoreSpec, put_blob
from dynapipe.runtime.plan_payload import encode_payload
from dynapipe.runtime.plan_source import IterationPlanner, PlannerSettings, encode_plan
from dynapipe.runtime.process_start import helper_context


class PlannerWorkerError(DynaPipeError):
    """A planner worker failed; the message carries its traceback."""


@dataclass(frozen=True)
class Keyspace:
    """Key names of one job: ``<namespace>/<run id>/...``."""

    prefix: str

    def payload(self, iteration: int, replica: int, stage: int) -> str:
        return f"{self.prefix}/it{iteration}/r{replica}/s{stage}"

    @staticmethod
    def acks(key: str) -> str:
        return key + "/acks"

    @property
    def error(self) -> str:
        return f"{self.prefix}/error"


def post_error(kv, keys: Keyspace, text: str) -> None:
    """Post ``text`` under ``keys.error`` for every rank's fetcher to raise. A store that refuses
    the write (Redis under ``maxmemory`` refuses writes but not deletes) gets room first: the
    job's payloads are deleted, since the job is stopping, and the ranks waiting for them then
    read the error instead of waiting out the plan timeout. Raises if the write still fails."""
    try:
        kv.set(keys.error, text.encode())
        return
    except Exception:  # noqa: BLE001 - out of memory, most likely: make room and try once more
        pass
    for key in kv.keys(f"{keys.prefix}/it"):
        kv.delete(key)
    kv.set(keys.error, text.encode())


@dataclass(frozen=True)
class WorkerJob:
    """What every worker of a node receives at start-up (pickled once, locally)."""

    dataset: SampleDataset
    sampler: SamplerConfig
    consumed_samples: int
    start_iteration: int
    planner: PlannerSettings
    store: KVStoreSpec
    keys: Keyspace
    node: int
    replicas: Optional[tuple[int, ...]] = None
    # How the job's errors name parameters (:func:`dynapipe.errors.spelled_as`): a worker
    # process starts without its parent's.
    spelling: dict = field(default_factory=dict)


def _rank_tensors(plan: ExecutionPlan, dataset: SampleDataset, batch_indices: np.ndarray,
                  cache: dict) -> dict[int, dict[str, np.ndarray]]:
    infos = {m.mb: m for m in plan.micro_batches}
    out: dict[int, dict[str, np.ndarray]] = {}
    for instr in plan.instructions:
        if not isinstance(instr, LoadInput) or not instr.tensors:
            continue
        info = infos.get(instr.mb)
        if info is None:
            raise DynaPipeError(f"plan of {iteration_name(plan.iteration)} (replica {plan.replica}, stage {plan.stage}) "
                                f"loads micro-batch {instr.mb}, which it does not describe.")
        rows_pos = info.rows or tuple((s,) for s in info.samples)
        rows = []
        for row in rows_pos:
            samples = []
            for pos in row:
                if pos not in cache:
                    cache[pos] = dataset[int(batch_indices[pos])]
                samples.append(cache[pos])
            rows.append(samples)
        reqs = [TensorRequest(t.name, tuple(t.shape), t.dtype) for t in instr.tensors]
        out.setdefault(instr.mb, {}).update(
            collate(rows, reqs, info.seqlen, info.dec_seqlen, dataset.encoder_decoder, dataset.pad_id, dataset.eod_id))
    return out


def plan_and_publish(job: WorkerJob, planner: IterationPlanner, sampler: GlobalBatchSampler, kv,
                     iteration: int) -> float:
    """Plan ``iteration`` and put every (replica, stage) payload into the store; planning ms."""
    batch = sampler.batch(iteration - job.start_iteration)
    lengths = job.dataset.planner_lengths(batch.indices)
    t0 = time.perf_counter()
    planned = planner.plan_iteration(lengths, iteration, replicas=job.replicas)
    grid = planned.plans
    planning_ms = (time.perf_counter() - t0) * 1e3
    # Every stage of a replica runs the same micro-batches: stage 0 stands for the replica
    # (rows of replicas another node publishes are empty). Real tokens: non-pad, input +
    # target (the planner's lengths); see IterationMeta.
    padded = [sum(m.mbs * (m.seqlen + m.dec_seqlen) for m in row[0].micro_batches) if row else 0 for row in grid]
    real = [int(sum(int(lengths[list(m.samples)].sum()) for m in row[0].micro_batches)) if row else 0
            for row in grid]
    common = {
        "num_samples": int(batch.indices.shape[0]),
        "consumed_samples": batch.end,
        "global_real_tokens": int(lengths.sum()),
        "global_padded_tokens": int(sum(mb.padded_tokens for mb in planned.batch_plan.micro_batches)),
        "global_executed_work": micro_batches_work(planned.batch_plan.micro_batches,
                                                   job.dataset.encoder_decoder).to_json(),
        "global_real_work": samples_work(lengths).to_json(),
        "global_loss_tokens": job.dataset.loss_tokens(batch.indices),
        "truncated_samples": int(job.dataset.truncated[batch.indices].sum()),
        # No timing and no worker id: a payload planned again (a store restart) must be the same
        # bytes, or a reader could join the chunks of two copies (planner_stats has the times).
        "planner_node": job.node,
    }
    cache: dict = {}
    for r, row in enumerate(grid):
        for s, plan in enumerate(row):
            tensors = _rank_tensors(plan, job.dataset, batch.indices, cache)
            meta = dict(common, real_tokens=real[r], padded_tokens=padded[r])
            payload = encode_payload(iteration, r, s, encode_plan(plan), tensors, meta)
            put_blob(kv, job.keys.payload(iteration, r, s), payload)
    return planning_ms


def _exit_with_parent(parent) -> None:
    """Block until the parent process is gone, then end this process at once.

    A thread, so a worker stuck in a store call (whose server may have died with the
    training process) still exits.
    """
    multiprocessing.connection.wait([parent.sentinel])
    os._exit(0)


def _kill_all(procs) -> None:
    """Kill the workers still alive (a pool left open at interpreter exit)."""
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(2.0)


def worker_main(worker: int, job: WorkerJob, tasks, events) -> None:
    """Entry point of a planner worker process."""
    with spelled_as(job.spelling):  # its refusals name the parameters as the job's user gave them
        _work(worker, job, tasks, events)


# Signals a launcher or scheduler sends to a job's process group (torchrun forwards SIGTERM,
# SIGINT, SIGHUP and SIGQUIT to each rank's group, Slurm SIGUSR1/2 when asked): a worker ignores
# them and ends with its rank, which decides what they mean (--exit-signal-handler finishes the
# iteration and saves; without it the rank ends, and so do its workers, through the parent watch).
JOB_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")


def _work(worker: int, job: WorkerJob, tasks, events) -> None:
    parent = multiprocessing.parent_process()
    if parent is not None:
        for name in JOB_SIGNALS:
            signal.signal(getattr(signal, name), signal.SIG_IGN)
        threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True, name="parent-watch").start()
    iteration: Optional[int] = None
    kv = None
    try:
        kv = job.store.connect()
        planner = IterationPlanner(job.planner)
        sampler = GlobalBatchSampler(job.dataset.sample_tokens(), job.sampler, job.consumed_samples)
        events.put(("ready", worker, os.getpid()))
        while True:
            iteration = tasks.get()
            if iteration is None:
                return
            t0 = time.perf_counter()
            ms = plan_and_publish(job, planner, sampler, kv, iteration)
            events.put(("done", worker, iteration, ms, (time.perf_counter() - t0) * 1e3))
    except BaseException as e:
        # A refusal is the user's to act on: its message, in their flags. Anything else is a bug,
        # a plan the compiler or validator rejects included (PlanError): its traceback.
        refusal = isinstance(e, DynaPipeError) and not isinstance(e, (PlanError, ExecutorError))
        tb = str(e) if refusal else traceback.format_exc()
        events.put(("error", worker, iteration, tb))
        if kv is not None:
            try:
                post_error(kv, job.keys, _error_text(job.node, worker, iteration, tb))
            except Exception:  # noqa: BLE001 - the planner rank's loader still raises the event's text
                pass
        events.close()
        events.join_thread()
        sys.exit(REPORTED_EXIT)


def _error_text(node: int, worker: int, iteration: Optional[int], tb: str) -> str:
    when = f"while planning {iteration_name(iteration)}" if iteration is not None else "while starting"
    sep = "\n" if tb.startswith("Traceback") else " "
    return f"planner worker {worker} on planner node {node} failed {when}:{sep}{tb.rstrip()}"


#: A worker's exit code after it reported its failure (to the pool's events and the store); not
#: 1, which is also Python's for an uncaught exception: a worker that died so reported nothing.
REPORTED_EXIT = 86


def death_text(node: int, worker: int, proc) -> str:
    """What to say of planner worker ``worker`` (process ``proc``) that ended without a report."""
    how = (f"was killed by signal {-proc.exitcode} (out of memory?)" if proc.exitcode < 0 else
           f"exited with code {proc.exitcode} (its error is on stderr; a script that starts the loader "
           f"outside `if __name__ == '__main__':` makes every worker exit so)")
    return f"planner worker {worker} (pid {proc.pid}) on planner node {node} {how}, without a report."


def watch_workers(pool: "PlannerPool", store, error_key: str, stop: threading.Event, poll_s: float = 0.5) -> None:
    """Thread body on a planner rank: when a worker of ``pool`` dies without a report (killed,
    out of memory) while the pool runs, post why under ``error_key`` of ``store`` (a
    :class:`~dynapipe.runtime.kv_store.KVStoreSpec`; this thread's own connection), unless an
    error is there already. The planner rank may be inside a step's transfers by then, not in
    the loader, so only a watcher tells the ranks awaiting payloads the dead worker never
    published; each stops at its next missing payload with this text instead of waiting out the
    plan timeout. A worker that fails with a report posts it itself (exit code
    :data:`REPORTED_EXIT`)."""
    procs = dict((p.sentinel, (i, p)) for i, p in enumerate(pool.procs))
    kv = None
    while procs and not stop.is_set():
        ready = multiprocessing.connection.wait(list(procs), timeout=poll_s)
        if stop.is_set() or pool.closed:
            return
        for sentinel in ready:
            i, p = procs.pop(sentinel)
            if p.exitcode in (0, REPORTED_EXIT):  # a clean exit, or a failure the worker reported
                continue
            try:
                kv = kv or store.connect()
                if kv.get(error_key) is None:
                    post_error(kv, pool.job.keys, death_text(pool.job.node, i, p))
            except Exception as e:  # noqa: BLE001 - the store may be gone too; the loader's check still raises
                print(f"dynapipe: could not report a dead planner worker to the store ({type(e).__name__}: {e})",
                      file=sys.stderr, flush=True)


# Iterations whose planning times a pool keeps for stats(): bounded, so a long run does not grow.
STATS_KEPT = 10_000


class PlannerPool:
    """The worker processes of one planner node and their two queues."""

    def __init__(self, job: WorkerJob, num_workers: int):
        if num_workers < 1:
            raise DynaPipeError(f"{given('num_workers', num_workers)}: a planner node needs at least 1 worker.")
        ctx = helper_context()
        self.job = job
        self.tasks = ctx.Queue()
        self.events = ctx.Queue()
        self._failure: Optional[PlannerWorkerError] = None  # a worker's reported error, raised by check()
        # Per iteration planned here: planner ms, and the worker's whole ms (planning,
        # tensors, encoding, publishing); the latest STATS_KEPT only, as a run may plan millions.
        self.planning_ms: dict[int, float] = {}
        self.worker_ms: dict[int, float] = {}
        self.pids: list[int] = []
        self._closed = False
        self.procs = [ctx.Process(target=worker_main, args=(i, job, self.tasks, self.events), daemon=True,
                                  name=f"dynapipe-planner-{job.node}-{i}") for i in range(num_workers)]
        for p in self.procs:
            p.start()
            self.pids.append(p.pid)
        # At interpreter exit multiprocessing terminates daemonic children (SIGTERM, which workers
        # ignore) and joins them without a limit: a pool still open then is killed first.
        multiprocessing.util.Finalize(self, _kill_all, args=(list(self.procs),), exitpriority=10)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has begun stopping the workers."""
        return self._closed

    def submit(self, iteration: int) -> None:
        """Queue ``iteration`` for the next free worker."""
        self.tasks.put(iteration)

    def _drain(self) -> None:
        self.absorb()
        if self._failure is not None:
            raise self._failure

    def absorb(self) -> None:
        """Take the workers' reports without raising (once an iteration, so that a long run whose
        plans are always ready does not leave them piling up in the workers' queue buffers); a
        failure among them is kept for :meth:`check`, which the loader calls only while it waits
        for a plan, so that every rank stops at the same iteration."""
        while True:
            try:
                ev = self.events.get_nowait()
            except (queue.Empty, OSError, ValueError):
                return
            self._handle(ev)

    def _handle(self, ev) -> None:
        if ev[0] == "done":
            self.planning_ms[ev[2]] = ev[3]
            self.worker_ms[ev[2]] = ev[4]
            while len(self.worker_ms) > STATS_KEPT:  # the oldest reports first (insertion order)
                oldest = next(iter(self.worker_ms))
                del self.worker_ms[oldest], self.planning_ms[oldest]
        elif ev[0] == "error" and self._failure is None:
            _, worker, iteration, tb = ev
            self._failure = PlannerWorkerError(_error_text(self.job.node, worker, iteration, tb))

    def stats(self) -> dict:
        """Planner ms and whole worker ms of the iterations this node planned (the latest
        :data:`STATS_KEPT`)."""
        self._drain()
        its = sorted(self.worker_ms)
        return {"iterations": its, "planning_ms": [self.planning_ms[i] for i in its],
                "worker_ms": [self.worker_ms[i] for i in its]}

    def check(self) -> None:
        """Raise :class:`PlannerWorkerError` if a worker reported a failure or died."""
        if self._closed:
            return
        self._drain()
        for i, p in enumerate(self.procs):
            if p.exitcode is not None:
                try:  # its report may still be in flight
                    self._handle(self.events.get(timeout=1.0))
                except queue.Empty:
                    pass
                self._drain()
                raise PlannerWorkerError(death_text(self.job.node, i, p))

    def close(self, timeout_s: float = 1.0) -> None:
        """Stop every worker: ask, wait ``timeout_s``, then kill.

        Workers keep no state worth saving (a half-written payload is deleted by the
        loader), so the grace period is short.
        """
        if self._closed:
            return
        self._closed = True
        for _ in self.procs:
            try:
                self.tasks.put(None)
            except (ValueError, OSError):
                pass
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.kill()  # not SIGTERM: workers ignore it (JOB_SIGNALS)
                p.join(2.0)
        for q in (self.tasks, self.events):
            q.cancel_join_thread()
            q.close()
