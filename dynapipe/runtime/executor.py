"""Runs one pipeline rank's execution plan for one iteration, instruction by instruction.

The model integration supplies a :class:`StageHandlers` (load a micro-batch, run this
stage's forward, optionally its backward); the :class:`Executor` owns everything else:
receive buffers allocated from the plan's shapes, point-to-point transfers, gradients
of received activations, buffer lifetimes, loss normalisation, timeouts and failure
reports. The same executor drives a plain torch stage and a megatron-core stage.

The contract with the model integration (handlers, configuration, results) is in
:mod:`dynapipe.runtime.contract`.

Before anything is sent, every pipeline rank's plan is compared with its peers'
(:class:`dynapipe.runtime.plan_check.PeerPlanCheck`); the exchange is started with the
iteration and settled before the first transfer, so it overlaps the first micro-batch's
load and forward on the first stage. An error in that window on a plan the check then
refuses is reported as the refusal, on every rank alike.

Transfers are posted exactly where the plan's ``*Start`` instructions stand. A receive
is waited for at its ``*Finish``; a send's wait is deferred to the next point where the
rank blocks anyway (a receive's ``*Finish``) or at the latest to just before the next
forward, backward or the free of its buffer, and waits standing together are done in
one go. No wait moves past a compute op, so the plan's overlap of transfers and compute
and its memory (sent data is released before the next op) are kept, and delaying a
wait never makes a deadlock-free plan deadlock.
"""
from __future__ import annotations

import traceback
from dataclasses import dataclass, field
from typing import Optional, Union

import torch
import torch.distributed as dist

from dynapipe.errors import ExecutorError, PlanError
from dynapipe.plan.instructions import (RECV_STARTS, SEND_STARTS, BackwardPass, ExecutionPlan, FINISHES,
                                        ForwardPass, FreeBuffer, Instruction, LoadInput, MicroBatchInfo,
                                        RecvActivationFinish, RecvGradFinish, SendActivationFinish,
                                        SendActivationStart, SendGradFinish, SendGradStart, TensorSpec,
                                        buffer_name)
from dynapipe.plan.serialize import deserialize_plan
from dynapipe.runtime.buffers import BufferTable, backward_from, release_data
from dynapipe.runtime.exec_trace import WAIT_SENDS, ExecEvent, ExecTrace, describe, now_us
from dynapipe.runtime.contract import ExecutorConfig, HandlerFailure, IterationResult, StageHandlers
from dynapipe.runtime.p2p import AbortChannel, CommFailure, PeerComm, RemoteFailure, Waiter, allocate, check_tensor
from dynapipe.runtime.plan_check import (PeerPlanCheck, check_plan_locally, executor_prefix, pair_starts,
                                         row_key)

SEND_FINISHES = (SendActivationFinish, SendGradFinish)
TRANSFERS = SEND_STARTS + RECV_STARTS + FINISHES


class _At:
    """Where an instruction runs, as text only when an error message needs it (the
    instruction loop is hot; formatting every location up front would cost more than
    some transfers)."""

    __slots__ = ("ex", "i", "ins", "what")

    def __init__(self, ex: "Executor", i: int, ins: Instruction, what: str = ""):
        self.ex, self.i, self.ins, self.what = ex, i, ins, what

    def also(self, what: str) -> "_At":
        return _At(self.ex, self.i, self.ins, self.what + what)

    def __str__(self) -> str:
        return self.ex._where(self.i, self.ins) + self.what

    def __format__(self, spec: str) -> str:
        return str(self)


@dataclass
class _Run:
    """State of one iteration."""

    plan: ExecutionPlan
    mbs: dict[int, MicroBatchInfo]
    start_of: dict[int, int]
    batches: dict[int, list[int]]
    send_specs: dict[tuple[int, int], tuple[TensorSpec, ...]]
    grad_specs: dict[tuple[int, int], tuple[TensorSpec, ...]]
    buffers: BufferTable = field(default_factory=BufferTable)
    pending: dict = field(default_factory=dict)
    inflight: set = field(default_factory=set)
    roots: dict = field(default_factory=dict)
    act_inputs: dict = field(default_factory=dict)
    losses: dict = field(default_factory=dict)
    loss_tokens: int = 0  # what the summed loss is divided by
    released: int = 0
    deferred: list = field(default_factory=list)  # (pending, where, SendFinish) not yet waited for
    check: Optional[PeerPlanCheck] = None  # the peer plan check, until settled


class Executor:
    """Runs execution plans on one pipeline rank.

    ``group``: the pipeline process group (``None``: the default group); pipeline rank
    ``p`` of a plan is this group's rank ``p``. ``device``: where activations live (CPU ->
    gloo, CUDA -> NCCL). ``store``: a key-value store every rank of the job reaches (e.g.
    the one the process group was initialised with); with it a failure on any rank stops
    every rank promptly with that rank's message, without it ranks stop on a broken
    connection or the timeout. ``replica``: this rank's data-parallel index, checked
    against the plan's when given.

    :meth:`close` (or ``with Executor(...) as ex:``) stops its helper threads and removes
    its store keys. Every rank of a pipeline must create its executors in the same order;
    a new executor on the same store works once the previous one is closed on every rank.
    """

    def __init__(self, handlers: StageHandlers, *, group: Optional[dist.ProcessGroup] = None,
                 device: Union[str, torch.device] = "cpu", store: Optional[dist.Store] = None,
                 config: Optional[ExecutorConfig] = None, replica: Optional[int] = None):
        self.handlers = handlers
        self.config = config or ExecutorConfig()
        self.device = torch.device(device)
        self.comm = PeerComm(group, self.device)
        self.store = store
        self.abort = AbortChannel(store, dist.get_world_size()) if store is not None else None
        # A second store client for blocking waits, so the abort channel stays usable meanwhile.
        self._wait_store = store.clone() if store is not None and hasattr(store, "clone") else None
        self.global_rank = dist.get_rank()
        # This executor's plan-check rows live in their own namespace: an earlier executor's
        # leftovers on the same store can never pass for this one's.
        self._plan_prefix = executor_prefix(store, self.global_rank) if store is not None else ""
        self.waiter = Waiter(self.config.timeout_s, self.abort, self.config.poll_s,
                             stream_ordered=self.device.type == "cuda", watch=self.config.watch_failures)
        self.replica = replica
        self._runs = 0
        self._failed: Optional[str] = None
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
        loss is divided by; default ``plan.global_real_tokens``. Data whose loss covers only
        some tokens (instruction targets) passes its loss-mask count here.

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
        plan_obj, pairing, refusal = self._accept(plan, where)
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
        result = self._execute(plan_obj, *pairing, check,
                               plan_obj.global_real_tokens if loss_tokens is None else int(loss_tokens))
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
        last iteration was refused, or moved nothing between stages); it lies in this
        executor's own namespace, so no later executor reads it. Failure reports (keys
        under ``dynapipe/abort``) stay: ranks still stopping read the root cause there, and
        an executor that failed leaves the job to be restarted; a clean run writes none.
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
                if seq != self._unread_row or self._failed:
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

    def _accept(self, plan: Union[ExecutionPlan, bytes], where: str):
        """The plan, its start/finish pairing and ``None``; or ``None, None`` and why this
        rank refuses the plan."""
        try:
            if isinstance(plan, (bytes, bytearray, memoryview)):
                plan = deserialize_plan(bytes(plan))
            if not isinstance(plan, ExecutionPlan):
                raise PlanError(f"expected an ExecutionPlan or its bytes, got {type(plan).__name__}.")
            check_plan_locally(plan, stage=self.comm.rank, num_stages=self.comm.size, replica=self.replica)
            return plan, pair_starts(plan), None
        except PlanError as e:
            return None, None, f"{where}: {e}"

    # ---- the instruction loop ----------------------------------------------------------
    def _execute(self, plan: ExecutionPlan, start_of: dict, batches: dict,
                 check: Optional[PeerPlanCheck], loss_tokens: int) -> IterationResult:
        run = _Run(plan, {m.mb: m for m in plan.micro_batches}, start_of, batches,
                   {(x.mb, x.chunk): x.tensors for x in plan.instructions if isinstance(x, SendActivationStart)},
                   {(x.mb, x.chunk): x.tensors for x in plan.instructions if isinstance(x, SendGradStart)},
                   check=check, loss_tokens=loss_tokens)
        trace = ExecTrace(plan.stage, plan.replica, plan.iteration) if self.config.trace else None
        posted0 = self.comm.posted
        t_begin = now_us()
        n = len(plan.instructions)
        for i, ins in enumerate(plan.instructions):
            if run.check is not None and isinstance(ins, TRANSFERS):
                self._settle(run)  # nothing is sent before every rank accepted its plan
            if run.deferred and (isinstance(ins, (ForwardPass, BackwardPass)) or (
                    isinstance(ins, FreeBuffer) and any(x.buffer == ins.buffer for _, _, x in run.deferred))):
                self._step(i, ins, run, trace, self._flush_sends)
            self._step(i, ins, run, trace, self._dispatch)
        if run.deferred:
            self._step(n - 1, plan.instructions[-1], run, trace, self._flush_sends)
        if run.check is not None:
            self._settle(run)
        wall_ms = (now_us() - t_begin) / 1000.0
        if self.abort is not None and self.abort.count():
            err = RemoteFailure(f"pipeline rank {plan.stage} (global rank {self.global_rank}) finished its plan "
                                f"but another rank failed; {self.abort.root_cause()}")
            self._failed = str(err).splitlines()[0]
            raise err
        unfreed = run.buffers.clear()
        loss = sum(float(v) for v in run.losses.values()) / run.loss_tokens if run.losses else 0.0
        return IterationResult(plan.iteration, loss, {k: float(v) for k, v in run.losses.items()}, wall_ms,
                               run.buffers.peak_bytes, run.released, self.comm.posted - posted0, trace, unfreed)

    def _step(self, i: int, ins: Instruction, run: _Run, trace: Optional[ExecTrace], op) -> None:
        """Run ``op`` for instruction ``i``, timing it when tracing; every failure is reported."""
        where = _At(self, i, ins)
        t0 = now_us() if trace is not None else 0.0
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
            err = HandlerFailure(f"{where}: {type(e).__name__}: {e}\n{traceback.format_exc()}")
            self._fail(err, primary=True)
            raise err from e
        if trace is not None:
            if op == self._dispatch:
                name, cat, kind, shape = describe(ins, run.mbs.get(ins.mb))
                opcode = ins.OPCODE
            else:
                name, cat, kind, shape, opcode = WAIT_SENDS, "comm", "", None, "wait_sends"
            trace.events.append(ExecEvent(i, opcode, ins.mb, name, cat, t0, now_us() - t0, kind, shape))
            trace.memory.append((t0, run.buffers.live_bytes))

    def _settle(self, run: _Run) -> None:
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

    def _fail(self, err: ExecutorError, primary: bool) -> None:
        self._failed = str(err).splitlines()[0]
        if self.abort is not None:
            self.abort.report(self.global_rank, str(err), primary)

    def _dispatch(self, i: int, ins: Instruction, run: _Run, where: _At) -> None:
        op = self._ops.get(type(ins))
        if op is None:
            raise ExecutorError(f"{where}: no handler for instruction {type(ins).__name__}.")
        op(i, ins, run, where)

    def _free(self, i: int, ins: FreeBuffer, run: _Run, where: _At) -> None:
        if ins.buffer in run.inflight:
            raise ExecutorError(f"{where}: buffer {ins.buffer!r} is freed while its transfer is in flight.")
        run.buffers.free(ins.buffer, i, where)

    # ---- compute -----------------------------------------------------------------------
    def _load(self, i: int, ins: LoadInput, run: _Run, where: _At) -> None:
        data = self.handlers.load(run.mbs[ins.mb], ins.tensors)
        if not isinstance(data, dict) or set(data) != {s.name for s in ins.tensors}:
            got = sorted(data) if isinstance(data, dict) else type(data).__name__
            raise ExecutorError(f"{where}: load returned {got}, the plan expects tensors "
                                f"{[s.name for s in ins.tensors]}.")
        run.buffers.put(buffer_name("input", ins.mb, ins.chunk),
                        {s.name: check_tensor(data[s.name], s, self.device, where.also(" load")) for s in ins.tensors},
                        where)

    def _usable(self, name: str, run: _Run, where: _At) -> dict[str, torch.Tensor]:
        if name in run.inflight:
            raise ExecutorError(f"{where}: buffer {name!r} is used before its receive finished.")
        return run.buffers.get(name, where)

    def _forward(self, i: int, ins: ForwardPass, run: _Run, where: _At) -> None:
        key, plan = (ins.mb, ins.chunk), run.plan
        inputs: dict[str, torch.Tensor] = {}
        received: dict[str, torch.Tensor] = {}
        if plan.stage > 0:
            for name, t in self._usable(buffer_name("act_in", *key), run, where).items():
                if t.is_floating_point():
                    t.requires_grad_(True)
                    received[name] = t
                inputs[name] = t
        loaded = buffer_name("input", *key)
        if run.buffers.has(loaded):
            for name, t in run.buffers.get(loaded, where).items():
                if name in inputs:
                    raise ExecutorError(f"{where}: loaded tensor {name!r} has the name of a received activation.")
                inputs[name] = t
        out = self.handlers.forward(run.mbs[ins.mb], inputs, ins)
        run.act_inputs[key] = received
        if plan.stage == plan.num_stages - 1:
            if not isinstance(out, torch.Tensor) or out.numel() != 1 or not out.is_floating_point():
                raise ExecutorError(f"{where}: the last stage's forward must return the summed token loss as a "
                                    f"scalar float tensor, got {type(out).__name__}"
                                    f"{list(out.shape) if isinstance(out, torch.Tensor) else ''}.")
            if run.loss_tokens <= 0:
                raise ExecutorError(f"{where}: the loss normaliser is {run.loss_tokens} tokens (plan."
                                    f"global_real_tokens or run(loss_tokens=...)); the loss cannot be normalised.")
            run.losses[ins.mb] = out.detach().reshape(())
            scale = run.loss_tokens if self.config.normalise_loss else 1
            run.roots[key] = ([out.reshape(()) / scale], [None])
            return
        specs = run.send_specs.get(key, ())
        if isinstance(out, torch.Tensor):
            if len(specs) != 1:
                raise ExecutorError(f"{where}: forward returned one tensor, the plan sends "
                                    f"{[s.name for s in specs]}; return a dict by name.")
            out = {specs[0].name: out}
        if not isinstance(out, dict) or set(out) != {s.name for s in specs}:
            got = sorted(out) if isinstance(out, dict) else type(out).__name__
            raise ExecutorError(f"{where}: forward returned {got}, the plan sends {[s.name for s in specs]}.")
        outs = {s.name: check_tensor(out[s.name], s, self.device, where.also(" forward output")) for s in specs}
        run.roots[key] = (list(outs.values()), list(outs))
        run.buffers.put(buffer_name("act_out", *key), outs, where)

    def _backward(self, i: int, ins: BackwardPass, run: _Run, where: _At) -> None:
        key, plan = (ins.mb, ins.chunk), run.plan
        if key not in run.roots:
            raise ExecutorError(f"{where}: backward of a micro-batch whose forward did not run on this rank.")
        roots, names = run.roots.pop(key)
        if plan.stage == plan.num_stages - 1:
            grads: list[Optional[torch.Tensor]] = [None]
        else:
            got = self._usable(buffer_name("grad_in", *key), run, where)
            missing = [n for n in names if n not in got]
            if missing:
                raise ExecutorError(f"{where}: received gradients {sorted(got)} lack {missing}.")
            grads = [got[n] for n in names]
        custom = getattr(self.handlers, "backward", None)
        if custom is not None:
            custom(run.mbs[ins.mb], roots, grads, ins)
        else:
            backward_from(roots, grads)
        received = run.act_inputs.pop(key)
        specs = run.grad_specs.get(key)
        if specs is not None:
            grads_out = {}
            for s in specs:
                t = received.get(s.name)
                if t is None:
                    raise ExecutorError(f"{where}: the plan sends a gradient for {s.name!r}, which this stage "
                                        f"did not receive as a float activation.")
                g = t.grad if t.grad is not None else torch.zeros_like(t)
                grads_out[s.name] = check_tensor(g, s, self.device, where.also(" input gradient"))
                t.grad = None
            run.buffers.put(buffer_name("grad_out", *key), grads_out, where)

    # ---- communication -----------------------------------------------------------------
    def _start(self, i: int, ins: Instruction, run: _Run, where: _At) -> None:
        if i in run.pending:
            return  # posted with an earlier start of its batch
        ops = []
        members = run.batches.get(i, [i])
        for j in members:
            x = run.plan.instructions[j]
            where = _At(self, j, x)
            if isinstance(x, SEND_STARTS):
                data = self._usable(x.buffer, run, where)
                for s in x.tensors:
                    if s.name not in data:
                        raise ExecutorError(f"{where}: buffer {x.buffer!r} has no tensor {s.name!r} to send.")
                    ops.append((j, True, check_tensor(data[s.name], s, self.device, where), x.peer))
            else:
                bufs = {s.name: allocate(s, self.device) for s in x.tensors}
                run.buffers.put(x.buffer, bufs, where)
                run.inflight.add(x.buffer)
                ops.extend((j, False, bufs[s.name], x.peer) for s in x.tensors)
        posted = self.comm.post(ops) if ops else {}
        for j in members:
            pending = run.pending[j] = posted.get(j)
            if pending is not None:
                x = run.plan.instructions[j]
                self.waiter.watch(pending, (x.peer, isinstance(x, SEND_STARTS)))

    def _finish(self, i: int, ins: Instruction, run: _Run, where: _At) -> None:
        pending = run.pending.pop(run.start_of[i], None)
        if isinstance(ins, SEND_FINISHES):
            # A send is waited for at the next point this rank blocks anyway (a receive, or
            # before the next compute op or the free of its buffer): the plan's order of
            # transfers and compute is unchanged, one wait serves several transfers, and
            # the sent data is still released before the next op runs.
            run.deferred.append((pending, where, ins))
            return
        # A receive is waited for together with the deferred sends and the receives that
        # directly follow it: the same condition (all complete) for the cost of one wait.
        group = [(p, w) for p, w, _ in run.deferred if p is not None]
        if pending is not None:
            group.append((pending, where))
        for k in range(i + 1, len(run.plan.instructions)):
            nxt = run.plan.instructions[k]
            if not isinstance(nxt, (RecvActivationFinish, RecvGradFinish)):
                break
            p = run.pending.get(run.start_of[k])
            if p is not None:
                group.append((p, _At(self, k, nxt)))
        self.waiter.wait_many(group)
        self._sent(run)
        run.inflight.discard(ins.buffer)

    def _flush_sends(self, i: int, ins: Instruction, run: _Run, where: _At) -> None:
        """Wait for the deferred sends (see :meth:`_finish`)."""
        self.waiter.wait_many([(p, w) for p, w, _ in run.deferred if p is not None])
        self._sent(run)

    def _sent(self, run: _Run) -> None:
        """The deferred sends completed: release the data of the sent activations."""
        done, run.deferred = run.deferred, []
        if not self.config.release_sent_activations:
            return
        for _, where, ins in done:
            if isinstance(ins, SendActivationFinish):
                for t in run.buffers.get(ins.buffer, where).values():
                    n = release_data(t)
                    run.released += n
                    run.buffers.released(n)
