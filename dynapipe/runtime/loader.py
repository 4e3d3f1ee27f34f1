"""DynaPipeDataLoader: every rank's plan and micro-batch tensors, planned ahead elsewhere.

Per iteration each rank receives one payload from the key-value store: its own
execution plan (its pipeline stage of its data-parallel replica), the micro-batch
tensors its plan loads (first stage: inputs; last stage: labels and loss mask; every
stage: the shapes, inside the plan) and metadata. Planning happens ahead of training in
planner worker processes on the planner nodes: iteration ``i`` is planned on planner
node ``i % planner_nodes`` (a node's local rank 0 hosts its workers), at most
``prefetch`` iterations ahead of the training loop.

On every rank a fetch thread (:mod:`dynapipe.runtime.plan_fetcher`) takes the payloads
from the store and decodes them ahead of the training loop, so ``next()`` only pops a
ready iteration. Once every rank that reads a payload (the tensor-parallel ranks of one
stage of one replica) has it, the last reader deletes it. ``close()`` stops the workers and
removes anything planned but never read; garbage collection and exit stop the workers and the
threads too, and leave unread payloads to the store (Redis expires them after the spec's TTL,
the job's TCPStore ends with the job).
"""
from __future__ import annotations

import sys
import threading
import time
import weakref
from typing import Callable, Optional

from dynapipe.data.config import DatasetConfig
from dynapipe.data.sampler import SamplerConfig
from dynapipe.data.samples import SampleDataset
from dynapipe.errors import DynaPipeError, iteration_name, spelling
from dynapipe.runtime.kv_store import KVStore, KVStoreSpec, TorchStoreKV, delete_blob, job_tcp_store, \
    tcp_store_address
from dynapipe.runtime.loader_config import LoaderConfig, RankLayout, planner_node_count, plans_here
from dynapipe.runtime.loader_store import agreed_run_id, default_store_for_single_process
from dynapipe.runtime.plan_fetcher import IterationData, IterationMeta, PayloadFetcher
from dynapipe.runtime.plan_source import PlannerSettings, check_planner_settings
from dynapipe.runtime.p2p import RemoteFailure
from dynapipe.runtime.planner_workers import (Keyspace, PlannerPool, PlannerWorkerError, WorkerJob, post_error,
                                              watch_workers)
from dynapipe.runtime.store_watch import RestartWatcher

__all__ = ["DynaPipeDataLoader", "LoaderConfig", "RankLayout", "IterationData", "IterationMeta",
           "default_store_for_single_process"]


def _weakly(method):
    """``method`` (a bound method) called through a weak reference to its object: a no-op once
    the object is gone."""
    ref = weakref.WeakMethod(method)

    def call(*args, **kwargs):
        bound = ref()
        if bound is not None:
            bound(*args, **kwargs)
    return call


# How often a rank waiting for its plan asks ``failure_watch`` (s): a store round trip each.
WATCH_EVERY_S = 0.25


def queued_through(current: int, prefetch: int, end: Optional[int]) -> int:
    """The iterations queued for planning (all those below the returned number) once the
    training loop asks for iteration ``current``: ``prefetch`` ahead, never past ``end``
    (None: no last iteration). The benchmark counts the plans made in its timed window by it."""
    return current + prefetch if end is None else min(current + prefetch, end)


class DynaPipeDataLoader:
    """Iterate to get :class:`IterationData` per training iteration (see the module docstring).

    ``dataset`` is needed on planner nodes only (other ranks may pass None); a
    :class:`DatasetConfig` is opened on planner nodes. ``store`` overrides the job's
    torch.distributed store for the ``store`` backend (a TCPStore).

    ``failure_watch`` (settable, None by default): a callable a rank waiting for its plan asks
    a few times a second for a failure reported elsewhere (``Executor.failure_elsewhere``, over
    the job's own store), returning its text or None. A planner failure the plan store cannot
    carry (a Redis server out of memory or gone) then stops the waiting ranks with its cause
    instead of at the plan timeout.
    """

    def __init__(self, config: LoaderConfig, dataset: SampleDataset | DatasetConfig | None,
                 planner: PlannerSettings, layout: RankLayout = RankLayout(), store=None):
        self.config = config.validate()
        self.layout = layout.validate()
        check_planner_settings(planner)
        if planner.dp != layout.dp_size or planner.num_stages != layout.pp_size:
            raise DynaPipeError(f"planner settings (dp {planner.dp}, stages {planner.num_stages}) disagree with "
                                f"the rank layout (dp {layout.dp_size}, pp {layout.pp_size}).")
        self.planner = planner
        self._next = config.start_iteration
        self.consumed_samples = config.consumed_samples
        self._dispatched = config.start_iteration  # next iteration not yet considered for dispatch
        self._pool: Optional[PlannerPool] = None
        self._watcher: Optional[RestartWatcher] = None
        self._lock = threading.Lock()  # _dispatched is also read by the restart watcher
        self._replanned_from: Optional[int] = None
        self._closed = False
        self._watch_stop = threading.Event()  # ends the planner workers' watcher
        self._timed_out: Optional[DynaPipeError] = None  # a plan timeout, raised again by every later next()
        self._fetcher: Optional[PayloadFetcher] = None
        self.failure_watch: Optional[Callable[[], Optional[str]]] = None
        self._planner_nodes = planner_node_count(config.planner_nodes, config.split_replicas, layout)
        self.is_planner = plans_here(config.planner_nodes, config.split_replicas, layout)

        self._kv, spec = self._connect(store)
        self.keys = Keyspace(f"{config.namespace}/{agreed_run_id(layout, config.namespace)}")
        if self.is_planner:
            try:
                self._start_workers(dataset, spec)
            except BaseException as e:
                self._post_error(f"planner node {layout.node} failed to start: {e}")
                self.close()
                raise
        self._fetcher = PayloadFetcher(spec, self.keys, layout.dp_rank, layout.pp_rank, layout.readers_per_payload,
                                       config.start_iteration, self._end(), config.fetch_ahead)
        # Workers and the fetch thread stop even if close() is never called (garbage
        # collection or exit).
        self._finalizer = weakref.finalize(self, DynaPipeDataLoader._shutdown, self._pool, self._fetcher,
                                           self._watcher)

    # ---- set-up -----------------------------------------------------------------------

    def _connect(self, store) -> tuple[KVStore, KVStoreSpec]:
        c = self.config
        if c.kv_backend == "redis":
            spec = KVStoreSpec("redis", c.redis_host, c.redis_port, c.redis_db, c.connect_timeout_s,
                               retry_s=c.store_retry_s)
            return spec.connect(), spec
        if store is None:
            store = job_tcp_store()
        host, port = tcp_store_address(store)
        # The workers and fetchers connect to the TCPStore itself, so this rank writes there too:
        # through a PrefixStore its error reports and deletes would go where nobody reads.
        while hasattr(store, "underlying_store"):
            store = store.underlying_store
        return TorchStoreKV(store), KVStoreSpec("store", host, port, 0, c.connect_timeout_s)

    def _start_workers(self, dataset, spec: KVStoreSpec) -> None:
        if dataset is None:
            raise DynaPipeError(f"rank {self.layout.rank} plans for node {self.layout.node} and needs the dataset.")
        if isinstance(dataset, DatasetConfig):
            dataset = dataset.build()
        c = self.config
        sampler = SamplerConfig(c.global_batch_size, c.tokens_per_global_batch, c.seed, c.shuffle,
                                min_samples=self.layout.dp_size).validate()
        job = WorkerJob(dataset, sampler, c.consumed_samples, c.start_iteration, self.planner, spec,
                        self.keys, self.layout.node, self._replicas_here(), spelling())
        self._pool = PlannerPool(job, c.num_workers)
        # A worker killed after publishing this rank's payload would otherwise go unreported:
        # this rank is in the step's transfers, not here, and the others wait out the timeout.
        threading.Thread(target=watch_workers, args=(self._pool, spec, self.keys.error, self._watch_stop),
                         daemon=True, name="dynapipe-worker-watch").start()
        if spec.backend == "redis":
            # Weakly: the watcher's thread must not keep the loader alive, or garbage collection
            # would never run the finalizer that stops it and the workers.
            self._watcher = RestartWatcher(spec, _weakly(self._replan_lost), on_error=_weakly(self._post_error),
                                           keep_alive=self.keys.prefix)
        self._dispatch(self._next)

    def _replan_lost(self) -> None:
        """The Redis server restarted: plan again what it may have lost.

        Every rank has finished iteration ``_next - 2`` (each step ends in a collective),
        so payloads from ``_next - 1`` on may still be unread; the planned-ahead ones are
        all lost. Plans are deterministic, so republishing gives every rank the same data.
        """
        with self._lock:
            first = max(self.config.start_iteration, self._next - 1)
            for it in range(first, self._dispatched):
                if self._plans_here(it):
                    self._pool.submit(it)
            self._replanned_from = first if self._replanned_from is None else min(first, self._replanned_from)

    def _end(self) -> Optional[int]:
        n = self.config.train_iters
        return None if n is None else self.config.start_iteration + n

    def _dispatch(self, current: int) -> None:
        """Queue this node's share of the iterations up to ``current + prefetch``."""
        end = queued_through(current, self.config.prefetch, self._end())
        with self._lock:
            while self._dispatched < end:
                it = self._dispatched
                if self._plans_here(it):
                    self._pool.submit(it)
                self._dispatched += 1

    def _plans_here(self, iteration: int) -> bool:
        return self.config.split_replicas or iteration % self._planner_nodes == self.layout.node

    def _replicas_here(self) -> Optional[tuple[int, ...]]:
        """The replicas whose plans this node publishes (None: all of them)."""
        if not self.config.split_replicas:
            return None
        return tuple(r for r in range(self.layout.dp_size) if r % self._planner_nodes == self.layout.node)

    def _planner_of(self, iteration: int) -> int:
        """The node that publishes this rank's plan of ``iteration``."""
        if self.config.split_replicas:
            return self.layout.dp_rank % self._planner_nodes
        return iteration % self._planner_nodes

    # ---- iteration --------------------------------------------------------------------

    def __iter__(self):
        return self

    def __next__(self) -> IterationData:
        if self._closed:
            raise DynaPipeError("the data loader is closed.")
        if self._timed_out is not None:
            raise self._timed_out
        it = self._next
        if self._end() is not None and it >= self._end():
            raise StopIteration
        t0 = time.perf_counter()
        if self._pool is not None:
            self._dispatch(it)
            self._pool.absorb()
            if self.config.split_replicas and self._planner_of(it) != self.layout.node:
                # Split replicas: this rank's plans always come from another node, so the wait
                # below never consults this node's workers, and no rank would until the plan
                # timeout: look at them now, once an iteration. (Otherwise each node plans whole
                # iterations, and the wait for one of its own consults them.)
                self._check_workers(it)
        deadline = time.monotonic() + self.config.plan_timeout_s
        watched = time.monotonic()
        while True:
            data = self._fetcher.get(0.05)
            if data is not None:
                break
            # Only a missing payload consults the workers: with prefetch, every rank then fails
            # at the same iteration instead of the planner rank running ahead of the others.
            if self._pool is not None:
                self._check_workers(it)
            if self.failure_watch is not None and time.monotonic() - watched > WATCH_EVERY_S:
                watched = time.monotonic()
                cause = self.failure_watch()
                if cause is not None:
                    # A consequence of another rank's failure: its report stays the root cause.
                    raise RemoteFailure(f"stopped waiting for the plan of {iteration_name(it)}: {cause}")
            if time.monotonic() > deadline:
                # Kept: a caller that retries must not get a fresh timeout and then data, going
                # on where the other ranks stopped.
                self._timed_out = DynaPipeError(
                    f"the plan of {iteration_name(it)} (replica {self.layout.dp_rank}, stage {self.layout.pp_rank}, planned "
                    f"on node {self._planner_of(it)}) did not arrive within {self.config.plan_timeout_s:g} s. "
                    f"The planner workers may be stuck or too slow: raise the plan timeout or the number of "
                    f"planner workers, and check the planner nodes' logs.")
                raise self._timed_out
        if data.iteration != it:
            raise DynaPipeError(f"expected the plan of {iteration_name(it)}, got {iteration_name(data.iteration)}.")
        data.meta.wait_ms = (time.perf_counter() - t0) * 1e3
        self._next += 1
        self.consumed_samples = data.meta.consumed_samples
        return data

    def _check_workers(self, iteration: int) -> None:
        """Raise if a planner worker failed; a worker that died without a word (killed, out of
        memory) is reported through the store too, so every rank stops with its cause instead
        of waiting out the plan timeout."""
        try:
            self._pool.check()
        except PlannerWorkerError as e:
            self._post_error(f"{e}\n(the plan of {iteration_name(iteration)} was awaited)")
            raise

    def report_failure(self, text: str) -> None:
        """This rank failed (``text`` says where and why): where its node plans, every rank's
        loader is told now (each stops with ``text`` at its next plan), so the ranks awaiting
        this node's plans do not wait out the plan timeout for plans that will not come once
        :meth:`close` stops the workers. Nothing is posted from a node that plans nothing,
        after the loader closed, or over a failure already posted."""
        if self._pool is None or self._closed:
            return
        try:
            if self._kv.get(self.keys.error) is not None:
                return  # an earlier failure's cause is the one every rank reads
        except Exception:  # noqa: BLE001 - the store may be what failed; _post_error says so
            pass
        self._post_error(f"planner node {self.layout.node} stopped: {text}")

    def _post_error(self, text: str) -> None:
        try:
            post_error(self._kv, self.keys, text)
        except Exception as e:  # noqa: BLE001 - the store may be what failed; say so and go on failing
            print(f"dynapipe: could not report a planner failure to the store ({type(e).__name__}: {e}): "
                  f"{text.splitlines()[0]}", file=sys.stderr, flush=True)

    # ---- state and shutdown -----------------------------------------------------------

    @property
    def iteration(self) -> int:
        """The next iteration this loader yields."""
        return self._next

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of this rank's planner workers (empty on non-planner ranks)."""
        return list(self._pool.pids) if self._pool is not None else []

    def planner_stats(self) -> dict:
        """This node's planner workers: per planned iteration, planner ms and whole worker
        ms (planning, tensors, publishing). Empty lists on ranks that do not plan."""
        if self._pool is None:
            return {"iterations": [], "planning_ms": [], "worker_ms": []}
        return self._pool.stats()

    def state_dict(self) -> dict:
        """What a checkpoint keeps to resume the exact stream."""
        return {"consumed_samples": self.consumed_samples, "iteration": self._next}

    @staticmethod
    def _shutdown(pool: Optional[PlannerPool], fetcher: Optional[PayloadFetcher],
                  watcher: Optional[RestartWatcher] = None) -> None:
        # No reference to the loader itself. The fetch thread would otherwise poll the store for ever.
        if watcher is not None:
            watcher.close()
        if fetcher is not None:
            fetcher.close()
        if pool is not None:
            pool.close()

    def close(self) -> None:
        """Stop the planner workers and delete payloads this node planned that nobody read."""
        if self._closed:
            return
        self._closed = True
        self._watch_stop.set()
        if self._watcher is not None:
            self._watcher.close()
        if self._fetcher is not None:
            self._fetcher.close()
        if self._pool is not None:
            self._pool.close()
            # Iterations planned again after a server restart may have been published twice.
            first = min(self._next, self._replanned_from if self._replanned_from is not None else self._next)
            try:
                for it in filter(self._plans_here, range(first, self._dispatched)):
                    for r in range(self.layout.dp_size):
                        for s in range(self.layout.pp_size):
                            key = self.keys.payload(it, r, s)
                            delete_blob(self._kv, key)
                            self._kv.delete(Keyspace.acks(key))
            except Exception:
                pass  # the store may already be gone at exit
        if self.config.kv_backend == "redis":
            self._kv.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
