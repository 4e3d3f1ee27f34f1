"""Runs one pipeline rank's execution plan for one iteration, instruction by instruction.

The model integration supplies a :class:`StageHandlers` (load a micro-batch, run this
stage's forward, optionally its backward); the :class:`Executor` owns everything else:
receive buffers allocated from the plan's shapes, point-to-point transfers, gradients
of received activations, buffer lifetimes, loss normalisation, timeouts and failure
reports. The same executor drives a plain torch stage and a megatron-core stage.

The contract with the model integration (handlers, configuration, results) is in
:mod:`dynapipe.runtime.contract`. This module holds the entry point, the instruction loop
and failure handling; the compute instructions are in :mod:`dynapipe.runtime.exec_compute`,
the transfers in :mod:`dynapipe.runtime.exec_transfers`, failure reports to and from peers
in :mod:`dynapipe.runtime.exec_failures`, an iteration's bookkeeping in
:mod:`dynapipe.runtime.run_state`.

Before anything is sent, every pipeline rank's plan is compared with its peers'
(:class:`dynapipe.runtime.plan_check.PeerPlanCheck`); the exchange is started with the
iteration and settled before the first transfer, so it overlaps the first micro-batch's
load and forward on the first stage. An error in that window on a plan the check then
refuses is reported as the refusal, on every rank alike.

Transfers are posted exactly where the plan's ``*Start`` instructions stand. A receive
is waited for at its ``*Finish``; a send's wait is deferred to the next point where the
rank blocks anyway (a receive's ``*Finish``) or at the latest to just before the second
forward or backward after it, so a send overlaps the compute op that follows it (as the
simulator prices it: a transfer delays its receiver, not its sender); the free of a buffer
whose send is still deferred waits for that send. Waits standing together are done in one
go. A send is posted where the plan posts it and its wait blocks nothing but this rank, so
delaying the wait never makes a deadlock-free plan deadlock; sent data is released one
compute op later than the plan lists it, which the activation plan
(:mod:`dynapipe.runtime.activation_plan`) counts.
"""
from __future__ import annotations

import traceback
from typing import Optional, Union

import torch
import torch.distributed as dist

from dynapipe.errors import ExecutorError, PlanError
from dynapipe.plan.instructions import (RECV_STARTS, SEND_STARTS, BackwardPass, ExecutionPlan, FINISHES,
                                        ForwardPass, FreeBuffer, Instruction, LoadInput, SendActivationStart,
                                        SendGradStart)
from dynapipe.runtime.activation_meter import ActivationMeter
from dynapipe.runtime.buffers import BufferTable
from dynapipe.runtime.exec_compute import ComputeOps
from dynapipe.runtime.exec_failures import FailureOps
from dynapipe.runtime.exec_transfers import TransferOps
from dynapipe.runtime.exec_trace import WAIT_SENDS, DeviceClock, ExecEvent, ExecTrace, describe, now_us
from dynapipe.runtime.contract import ExecutorConfig, HandlerFailure, IterationResult, StageHandlers
from dynapipe.runtime.device_wait import wait_for_device
from dynapipe.runtime.abort_channel import AbortChannel
from dynapipe.runtime.p2p import CommFailure, PeerComm, RemoteFailure, Waiter
from dynapipe.runtime.plan_check import PeerPlanCheck, accept_plan, executor_prefix, pair_starts, row_key
from dynapipe.runtime.run_state import TRANSFERS, RunState, Where

# A RuntimeError subclass: not a transfer failure even when a transfer's buffer allocation raises it.
_OUT_OF_MEMORY = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


class Executor(ComputeOps, TransferOps, FailureOps):
    """Runs execution plans on one pipeline rank.

    ``group``: the pipeline process group (``None``: the default group); pipeline rank
    ``p`` of a plan is this group's rank ``p``. ``device``: where activations live (CPU ->
    gloo, CUDA -> NCCL). ``store``: a key-value store every rank of the job reaches (e.g.
    the one the process group was initialised with); with it a failure on any rank stops
    every rank promptly with that rank's message, without it ranks stop on a broken
    connection or the timeout. ``replica``: this rank's data-parallel index, checked
    against the plan's when given. ``meter``: an
    :class:`~dynapipe.runtime.activation_meter.ActivationMeter` told of every buffer, so a
    rank measuring its activation memory counts received and unsent tensors too.

    :meth:`close` (or ``with Executor(...) as ex:``) stops its helper threads and removes
    its store keys. Every rank of a pipeline must create its executors in the same order;
    a new executor on the same store works once the previous one is closed on every rank.
    """

    def __init__(self, handlers: StageHandlers, *, group: Optional[dist.ProcessGroup] = None,
                 device: Union[str, torch.device] = "cpu", store: Optional[dist.Store] = None,
                 config: Optional[ExecutorConfig] = None, replica: Optional[int] = None,
                 meter: Optional[ActivationMeter] = None):
        self.handlers = handlers
        self._trace_note = getattr(handlers, "trace_note", None)  # optional: what the trace adds to an op
        self.config = ExecutorConfig.of(config)
        self.device = torch.device(device)
        self.comm = PeerComm(group, self.device, ring=self.config.ring)
        self.store = store
        # A second store client for blocking waits, so the abort channel stays usable meanwhile.
        self._wait_store = store.clone() if store is not None and hasattr(store, "clone") else None
        self.global_rank = dist.get_rank()
        # This executor's plan-check rows and failure reports live in their own namespace: an
        # earlier executor's leftovers on the same store (a failed run of a multi-run job) can
        # never pass for this one's.
        self._plan_prefix = executor_prefix(store, self.global_rank) if store is not None else ""
        self.abort = AbortChannel(store, dist.get_world_size(), f"{self._plan_prefix}/abort") \
            if store is not None else None
        self.waiter = Waiter(self.config.timeout_s, self.abort, self.config.poll_s,
                             stream_ordered=self.device.type == "cuda", watch=self.config.watch_failures)
        self.replica = replica
        # Told of every buffer held and dropped, so the rank's activation peak counts them.
        self.meter = meter
        self._runs = 0
        self._failed: Optional[str] = None
        # Traced on CUDA, ops are timed on the device (the host only launches them). Whether a
        # run is traced is read per run (config.trace may change between runs), so the clock is
        # in use (self._clock) only during traced runs: an untraced one synchronises nothing.
        self._device_clock = DeviceClock(lambda: torch.cuda.Event(enable_timing=True),
                                         lambda: torch.cuda.synchronize(self.device)) \
            if self.device.type == "cuda" else None
        self._clock: Optional[DeviceClock] = None
        # On CUDA with an abort channel: an event recorded after a plan's work, which the end of
        # the plan polls (transfer waits there only ordered streams). None: nothing to wait for.
        self._device_done = self._record_done if self.device.type == "cuda" and self.abort is not None else None
        self._closed = False
        # Exchange seq of the last plan-check row, while peers may still have to read it.
        self._unread_row: Optional[int] = None
        # Instruction type -> how it runs; every method takes (index, instruction, run, where).
        self._ops = {ForwardPass: self._forward, BackwardPass: self._backward, LoadInput: self._load,
                     FreeBuffer: self._free, **{t: self._start for t in SEND_STARTS + RECV_STARTS},
                     **{t: self._finish for t in FINISHES}}

    # ---- entry point -------------------------------------------------------------------
    def run(self, plan: Union[ExecutionPlan, bytes], *, loss_tokens: Optional[int] = None) -> IterationResult:
        """Run one iteration of ``plan`` (an :class:`ExecutionPlan` or its serialized bytes).

        ``loss_tokens``: the number of tokens (whole global batch, every replica) the summed
        loss is divided by; default ``plan.global_loss_tokens``, the planner's count (every
        non-pad token of a decoder-only batch). Data whose loss covers only some tokens
        (instruction targets) passes its loss-mask count here.

        Every pipeline rank must call ``run`` for the same iteration. Raises
        :class:`PlanError` on every rank, before anything is sent, when any rank's plan is
        corrupted, invalid or does not match its peers'; :class:`ExecutorError` (naming this
        rank, the instruction index and the peer) when a transfer fails or times out, a
        tensor differs from the plan, a handler raises, or another rank failed.
        """
        if self._closed:
            raise ExecutorError(f"global rank {self.global_rank}: this executor was closed; create a new one "
                                f"(on every pipeline rank) to run more iterations.")
        if self._failed:
            raise ExecutorError(f"global rank {self.global_rank}: this executor stopped after a failure and "
                                f"cannot run again ({self._failed}); restart the job.")
        seq, self._runs = self._runs, self._runs + 1
        where = f"pipeline rank {self.comm.rank} (global rank {self.global_rank})"
        plan_obj, pairing, tokens, refusal = self._accept(plan, where, loss_tokens)
        check = None
        if self.config.check_peers and self.comm.size > 1:
            check = PeerPlanCheck(self.comm, plan_obj, refusal, seq, self._plan_prefix)
            if self.store is not None:
                self._unread_row = seq
            self._guard(lambda: check.start(self.waiter, self.store, where, self._wait_store))
            if refusal is not None:  # every rank refuses alike: the group stays usable
                self._guard(lambda: check.settle(self.waiter))
        elif refusal is not None:
            raise PlanError(refusal)
        result = self._execute(plan_obj, *pairing, check, tokens)
        if any(isinstance(x, RECV_STARTS) for x in plan_obj.instructions):
            # A peer sends only after it read every row, and in a plan whose micro-batches
            # pass through every stage, each receive depends on every stage having sent.
            self._unread_row = None
        return result

    # ---- lifetime ----------------------------------------------------------------------
    def close(self, timeout_s: float = 2.0) -> None:
        """Stop the helper threads (waiting up to ``timeout_s`` s for them), release the
        second store client and delete this rank's own plan-check rows. Idempotent; call it
        on every rank once no more iterations will run (not while :meth:`run` is running).

        The row of the last exchange is kept when a peer may still be reading it (the
        last iteration was refused, or moved nothing between stages, or this rank failed: a
        peer may be between its wait for the rows and its read of them); it lies in this
        executor's own namespace, so no later executor reads it. Failure reports (keys under
        the same namespace's ``abort/``) stay: ranks still stopping read the root cause there;
        a clean run writes none.
        """
        if self._closed:
            return
        self._closed = True
        self.waiter.close(timeout_s)
        self._wait_store = None
        if self.store is None or not self._runs:
            return
        last = self._runs - 1
        try:
            for seq in range(max(last - 1, 0), last + 1):
                if seq != self._unread_row and not self._failed:
                    self.store.delete_key(row_key(self._plan_prefix, seq, self.global_rank))
        except Exception:  # noqa: BLE001 - the store may be gone with its host at shutdown
            pass

    def __enter__(self) -> "Executor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _guard(self, fn) -> None:
        """Run a step of the peer plan check; a failed exchange is a failure like any transfer's."""
        try:
            fn()
        except ExecutorError as e:
            self._fail(e, primary=False)
            raise

    def _accept(self, plan: Union[ExecutionPlan, bytes], where: str, loss_tokens: Optional[int]):
        """The plan, its start/finish pairing, the loss normaliser (tokens) and ``None``; or
        ``None, None, None`` and why this rank refuses the plan (before anything is sent, so
        the peers refuse with it instead of failing mid-iteration)."""
        try:
            plan, tokens = accept_plan(plan, self.handlers, stage=self.comm.rank, num_stages=self.comm.size,
                                       replica=self.replica, loss_tokens=loss_tokens)
            return plan, pair_starts(plan), tokens, None
        except PlanError as e:
            return None, None, None, f"{where}: {e}"

    # ---- the instruction loop ----------------------------------------------------------
    def _execute(self, plan: ExecutionPlan, start_of: dict, batches: dict,
                 check: Optional[PeerPlanCheck], loss_tokens: int) -> IterationResult:
        run = RunState(plan, {m.mb: m for m in plan.micro_batches}, start_of, batches,
                       {(x.mb, x.chunk): x.tensors for x in plan.instructions if isinstance(x, SendActivationStart)},
                       {(x.mb, x.chunk): x.tensors for x in plan.instructions if isinstance(x, SendGradStart)},
                       buffers=BufferTable(meter=self.meter), check=check, loss_tokens=loss_tokens,
                       backward=any(isinstance(x, BackwardPass) for x in plan.instructions))
        trace = ExecTrace(plan.stage, plan.replica, plan.iteration) if self.config.trace else None
        self._clock = self._device_clock if trace is not None else None
        posted0 = self.comm.posted
        if self._clock is not None:
            self._clock.begin()
        t_begin = now_us()
        try:
            self._instructions(plan, run, trace)
            if self._device_done is not None:
                # Wait for the device here, watching for a peer's failure, rather than in the
                # first read of a loss.
                wait_for_device(self._device_done(), self.abort, lambda: self._remote_failure(plan),
                                check_every_s=self.config.poll_s)
        except BaseException:
            # A refused or failed iteration must not leave its buffers counted by the meter:
            # the executor stays usable, and the next iteration measures what it holds.
            run.buffers.clear()
            raise
        wall_ms = (now_us() - t_begin) / 1000.0
        if self._clock is not None:
            self._clock.resolve(trace)
        unfreed = run.buffers.clear()
        loss = sum(float(v) for v in run.losses.values()) / run.loss_tokens if run.losses else 0.0
        return IterationResult(plan.iteration, loss, {k: float(v) for k, v in run.losses.items()}, wall_ms,
                               run.buffers.peak_bytes, run.released, self.comm.posted - posted0, trace, unfreed)

    def _instructions(self, plan: ExecutionPlan, run: RunState, trace: Optional[ExecTrace]) -> None:
        """Run every instruction of ``plan`` (deferred send waits where they are due), then make
        sure no other rank failed meanwhile."""
        n = len(plan.instructions)
        for i, ins in enumerate(plan.instructions):
            if run.check is not None and isinstance(ins, TRANSFERS):
                self._settle(run)  # nothing is sent before every rank accepted its plan
            if run.deferred:
                if isinstance(ins, (ForwardPass, BackwardPass)):
                    if any(d.overlapped for d in run.deferred):
                        self._step(i, ins, run, trace, self._flush_overlapped)
                    for d in run.deferred:
                        d.overlapped = True  # this op overlaps them; the next one waits
                elif isinstance(ins, FreeBuffer) and any(d.ins.buffer == ins.buffer for d in run.deferred):
                    self._step(i, ins, run, trace, self._free_once_sent)
                    continue
            self._step(i, ins, run, trace, self._dispatch)
        if run.deferred:
            self._step(n - 1, plan.instructions[-1], run, trace, self._flush_sends)
        if run.check is not None:
            self._settle(run)
        if self.abort is not None and self.abort.count():
            raise RemoteFailure(self._remote_failure(plan))

    def _record_done(self) -> "torch.cuda.Event":
        """An event recorded now on this executor's device's current stream."""
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        return done

    def _step(self, i: int, ins: Instruction, run: RunState, trace: Optional[ExecTrace], op) -> None:
        """Run ``op`` for instruction ``i``, timing it when tracing; every failure is reported."""
        where = Where(self, i, ins)
        t0 = now_us() if trace is not None else 0.0
        start = self._clock.mark() if self._clock is not None else None
        try:
            op(i, ins, run, where)
        except Exception as e:  # noqa: BLE001 - any handler error stops every rank
            if run.check is not None:
                # Until every rank has accepted its plan, an error may come of a plan the peer
                # check refuses: then the refusal is the error, on every rank alike.
                self._settle(run)
            if isinstance(e, ExecutorError):
                self._fail(e, primary=not isinstance(e, (CommFailure, RemoteFailure)))
                raise
            if isinstance(ins, TRANSFERS) and isinstance(e, RuntimeError) and not isinstance(e, _OUT_OF_MEMORY):
                # Posting a transfer to a peer that already failed raises at once on some
                # builds (not at the wait; gloo's "Connection closed by peer" is a plain
                # RuntimeError, DistError a subclass): a consequence, named with the peer's report.
                # Running out of memory for a receive buffer is this rank's own failure.
                err = self.waiter.failure(e, str(where))
                self._fail(err, primary=False)
                raise err from e
            err = HandlerFailure(f"{where}: {type(e).__name__}: {e}\n{traceback.format_exc()}")
            self._fail(err, primary=True)
            raise err from e
        if trace is not None:
            dur, note = now_us() - t0, None
            if op == self._dispatch or op == self._free_once_sent:  # the instruction itself
                name, cat, kind, shape = describe(ins, run.mbs.get(ins.mb))
                opcode = ins.OPCODE
                if kind and self._trace_note is not None:
                    note = self._trace_note(ins)
            else:
                name, cat, kind, shape, opcode = WAIT_SENDS, "comm", "", None, "wait_sends"
            if start is not None:
                self._clock.add(len(trace.events), len(trace.memory), start, self._clock.mark())
            trace.events.append(ExecEvent(i, opcode, ins.mb, name, cat, t0, dur, kind, shape, ins.chunk, note))
            trace.memory.append((t0, run.buffers.live_bytes))

    def _settle(self, run: RunState) -> None:
        """Finish the peer plan check started in :meth:`run` (raises :class:`PlanError` on a refusal)."""
        check, run.check = run.check, None
        self._guard(lambda: check.settle(self.waiter))

    def _where(self, i: int, ins: Instruction) -> str:
        text = (f"pipeline rank {self.comm.rank} (global rank {self.global_rank}), instruction {i} "
                f"({ins.OPCODE} mb {ins.mb})")
        peer = getattr(ins, "peer", -1)
        if 0 <= peer < self.comm.size:
            text += f", peer pipeline rank {peer} (global rank {self.comm.global_rank(peer)})"
        return text

    def _dispatch(self, i: int, ins: Instruction, run: RunState, where: Where) -> None:
        op = self._ops.get(type(ins))
        if op is None:
            raise ExecutorError(f"{where}: no handler for instruction {type(ins).__name__}.")
        op(i, ins, run, where)

    def _free(self, i: int, ins: FreeBuffer, run: RunState, where: Where) -> None:
        if ins.buffer in run.inflight:
            raise ExecutorError(f"{where}: buffer {ins.buffer!r} is freed while its transfer is in flight.")
        run.buffers.free(ins.buffer, i, where)
