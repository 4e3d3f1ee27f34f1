"""The transfer instructions of a plan: post sends and receives, wait for them, release sent data.

:class:`TransferOps` is the part of :class:`~dynapipe.runtime.executor.Executor` that
moves tensors point-to-point where the plan's ``*Start``/``*Finish`` instructions stand
(the waiting rules are in the executor's module docstring).
"""
from __future__ import annotations

from dynapipe.errors import ExecutorError
from dynapipe.plan.instructions import (SEND_STARTS, Instruction, RecvActivationFinish, RecvGradFinish,
                                        SendActivationFinish)
from dynapipe.runtime.p2p import allocate, check_tensor
from dynapipe.runtime.run_state import SEND_FINISHES, DeferredSend, RunState, Where


class TransferOps:
    """Sends, receives and their waits of :class:`~dynapipe.runtime.executor.Executor` (a
    mixin: it uses the executor's ``comm``, ``waiter``, ``device`` and ``config``)."""

    def _start(self, i: int, ins: Instruction, run: RunState, where: Where) -> None:
        if i in run.pending:
            return  # posted with an earlier start of its batch
        ops = []
        members = run.batches.get(i, [i])
        for j in members:
            x = run.plan.instructions[j]
            where = Where(self, j, x)
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
        posted = self.comm.post(ops, batch=len(members) > 1) if ops else {}
        for j in members:
            pending = run.pending[j] = posted.get(j)
            if pending is not None:
                x = run.plan.instructions[j]
                self.waiter.watch(pending, (x.peer, isinstance(x, SEND_STARTS)))

    def _finish(self, i: int, ins: Instruction, run: RunState, where: Where) -> None:
        pending = run.pending.pop(run.start_of[i], None)
        if isinstance(ins, SEND_FINISHES):
            # A send is waited for at the next point this rank blocks anyway (a receive), or
            # at the latest before the second compute op after it: it overlaps the next op, as
            # the simulator prices it (the transfer delays the receiver, not the sender), and
            # a wait on one CUDA stream then no longer holds that op back.
            run.deferred.append(DeferredSend(pending, where, ins))
            return
        # A receive is waited for together with the deferred sends and the receives that
        # directly follow it: the same condition (all complete) for the cost of one wait.
        group = [(d.pending, d.where) for d in run.deferred if d.pending is not None]
        if pending is not None:
            group.append((pending, where))
        for k in range(i + 1, len(run.plan.instructions)):
            nxt = run.plan.instructions[k]
            if not isinstance(nxt, (RecvActivationFinish, RecvGradFinish)):
                break
            p = run.pending.get(run.start_of[k])
            if p is not None:
                group.append((p, Where(self, k, nxt)))
        self.waiter.wait_many(group)
        self._sent(run)
        run.inflight.discard(ins.buffer)

    def _flush_sends(self, i: int, ins: Instruction, run: RunState, where: Where) -> None:
        """Wait for every deferred send (see :meth:`_finish`)."""
        self.waiter.wait_many([(d.pending, d.where) for d in run.deferred if d.pending is not None])
        self._sent(run)

    def _flush_overlapped(self, i: int, ins: Instruction, run: RunState, where: Where) -> None:
        """Before compute op ``ins``: wait for the deferred sends a compute op already overlapped."""
        due = [d for d in run.deferred if d.overlapped]
        self.waiter.wait_many([(d.pending, d.where) for d in due if d.pending is not None])
        self._sent(run, due)

    def _free_once_sent(self, i: int, ins: Instruction, run: RunState, where: Where) -> None:
        """``FreeBuffer`` of a buffer whose send is deferred: freed when the send is waited for."""
        run.free_after_send[ins.buffer] = (i, where)

    def _sent(self, run: RunState, done=None) -> None:
        """Deferred sends (``done``; default all) completed: release the data of the sent
        activations and free the buffers whose ``FreeBuffer`` waited for their send."""
        if done is None:
            done, run.deferred = run.deferred, []
        else:
            run.deferred = [d for d in run.deferred if d not in done]
        for d in done:
            if self.config.release_sent_activations and isinstance(d.ins, SendActivationFinish):
                run.released += run.buffers.release(d.ins.buffer, d.where)
            later = run.free_after_send.pop(d.ins.buffer, None)
            if later is not None:
                run.buffers.free(d.ins.buffer, *later)
