"""The activation memory a rank's plan promises, from the cost model: what the measurement is checked against.

:func:`planned_activation_peak_mib` walks one rank's instruction list as the executor
runs it and keeps, in MiB:

* the stored activations of every micro-batch between its forward and its backward,
  priced by the cost model at the level the instruction carries (``stored_mib``);
* the buffers the executor holds: loaded inputs, received activations until their
  forward (from then on they are the first layer's stored input), outputs until their
  send is waited for, received gradients and produced input gradients until freed (a
  sent one not before its send is waited for), sized exactly from the plan's tensor specs;
  the executor waits for a send at the next receive, or before the second compute op
  after it;
* during a backward, what that op holds on top: with ``transient=False`` the
  activations the recomputation saves again (:meth:`CostModel.recompute_held_mib`),
  which is what a CPU rank measures; with ``transient=True`` the op's whole transient
  peak (``peak_mib``, during the forward too), as the simulator budgets it and as a
  GPU's allocator measures it.

Pure Python and numpy: no torch.
"""
from __future__ import annotations

from dynapipe.cost.backward_split import backward_split
from dynapipe.cost.base import MIB, CostModel
from dynapipe.errors import DynaPipeError
from dynapipe.plan.instructions import (BackwardPass, ExecutionPlan, FreeBuffer, ForwardPass, LoadInput,
                                        RecvActivationFinish, RecvActivationStart, RecvGradFinish, RecvGradStart,
                                        SendActivationFinish, SendGradFinish, SendGradStart, TensorSpec,
                                        buffer_name, plan_chunks, virtual_stage)

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4, "bool": 1, "uint8": 1}


def message_mib(specs: tuple[TensorSpec, ...]) -> float:
    """MiB of the tensors ``specs`` describe."""
    return sum(s.numel * DTYPE_BYTES[s.dtype] for s in specs) / MIB


def plan_densities(plan: ExecutionPlan) -> dict:
    """mb -> :class:`~dynapipe.cost.attention_density.AttentionDensity` of the micro-batches
    whose rows run per-sample attention (``meta["attention_density"]``, one entry a micro-batch
    of the plan, null for dense ones); empty when the plan records none."""
    from dynapipe.cost.attention_density import AttentionDensity

    recorded = (plan.meta or {}).get("attention_density")
    if recorded is None:
        return {}
    if not isinstance(recorded, list) or len(recorded) != len(plan.micro_batches):
        raise DynaPipeError(f"plan meta attention_density holds "
                            f"{len(recorded) if isinstance(recorded, list) else repr(recorded)} entries for "
                            f"{len(plan.micro_batches)} micro-batches; it needs one a micro-batch.")
    kinds = {"input", "target", "cross", "calls"}
    bad = [d for d in recorded if d is not None and not (isinstance(d, dict) and set(d) <= kinds)]
    if bad:
        raise DynaPipeError(f"plan meta attention_density entry {bad[0]!r}: each is null (dense rows) or an "
                            f"object of the shares {sorted(kinds - {'calls'})} and the calls.")
    return {info.mb: AttentionDensity(**d) for info, d in zip(plan.micro_batches, recorded) if d is not None}


def _mb_costs(plan: ExecutionPlan, cost_model: CostModel) -> dict:
    """(mb, chunk, level) -> (stored, transient, recompute-held, weight stash, recompute-held by a
    split backward's input part) MiB on this plan's stage; with an interleaved placement each
    chunk is priced as its own virtual stage."""
    if plan_chunks(plan) > 1:
        from dynapipe.schedule.interleaved import virtual_cost_model

        if cost_model.placement.chunks != plan_chunks(plan):
            raise DynaPipeError(f"the plan runs {plan_chunks(plan)} chunks per rank; the cost model's placement "
                             f"{cost_model.placement} has {cost_model.placement.chunks}.")
        cost_model = virtual_cost_model(cost_model)
    # Only a split backward's input part is priced with its stash held (a second pricing).
    splits = any(isinstance(x, BackwardPass) and x.part == "input" for x in plan.instructions)
    densities = plan_densities(plan)  # per-sample rows: priced at the attention they compute
    out = {}
    for ins in plan.instructions:
        key = (ins.mb, ins.chunk, getattr(ins, "recompute", None))
        if not isinstance(ins, (ForwardPass, BackwardPass)) or key in out:
            continue
        dec = ins.dec_seqlen if cost_model.model.is_encoder_decoder else None
        stage = virtual_stage(plan, ins.chunk)
        attention = densities.get(ins.mb)
        c = cost_model.stage_cost(ins.mbs, ins.seqlen, dec, recompute=ins.recompute, stage=stage, attention=attention)
        held = cost_model.recompute_held_mib(ins.mbs, ins.seqlen, dec, recompute=ins.recompute, stage=stage,
                                             attention=attention)
        # What a split backward's weight part keeps from the end of the input part (as the
        # simulator's StageTimes.weight_stash_mib prices it).
        _, stash = backward_split(cost_model.model, cost_model.layouts[stage], ins.mbs, ins.seqlen, dec,
                                  recompute=ins.recompute, tp=cost_model.tp, attention=attention)
        held_split = held if not splits else cost_model.recompute_held_mib(
            ins.mbs, ins.seqlen, dec, recompute=ins.recompute, stage=stage, weight_stash_mib=stash,
            attention=attention)
        out[key] = (float(c.stored_mib), float(c.peak_mib), float(held), float(stash), float(held_split))
    return out


class _DeferredSends:
    """The executor's deferred send waits (:mod:`dynapipe.runtime.executor`), as the walk
    sees them: a sent output's data is released, and a sent buffer whose ``FreeBuffer``
    came meanwhile is dropped, only once its send is waited for."""

    def __init__(self, buffers: dict[str, float]):
        self.buffers = buffers
        self.pending: list[list] = []  # [buffer, release its data, overlapped by a compute op]
        self.free_later: set[str] = set()

    def finished(self, buffer: str, release: bool) -> None:
        self.pending.append([buffer, release, False])

    def before_compute(self) -> None:
        self._done([p for p in self.pending if p[2]])
        for p in self.pending:
            p[2] = True

    def wait_all(self) -> None:
        self._done(list(self.pending))

    def free(self, buffer: str) -> None:
        if any(p[0] == buffer for p in self.pending):
            self.free_later.add(buffer)
        else:
            self.buffers.pop(buffer, None)

    def _done(self, done: list) -> None:
        for p in done:
            self.pending.remove(p)
            if p[1] or p[0] in self.free_later:
                self.free_later.discard(p[0])
                self.buffers.pop(p[0], None)


def planned_activation_peak_mib(plan: ExecutionPlan, cost_model: CostModel, *, transient: bool = False) -> float:
    """Highest activation memory of ``plan``'s rank over the iteration, MiB (see the module docstring)."""
    costs = _mb_costs(plan, cost_model)
    send_specs = {ins.buffer: ins.tensors for ins in plan.instructions if isinstance(ins, SendActivationFinish)}
    grad_specs = {ins.buffer: ins.tensors for ins in plan.instructions if isinstance(ins, SendGradStart)}
    buffers: dict[str, float] = {}
    stored_of: dict[tuple[int, int], float] = {}  # (mb, chunk) -> stored MiB
    stash_of: dict[tuple[int, int], float] = {}  # (mb, chunk) -> weight stash MiB, input part to weight part
    stored = peak = 0.0
    sends = _DeferredSends(buffers)
    for ins in plan.instructions:
        high = None
        if isinstance(ins, (ForwardPass, BackwardPass)):
            sends.before_compute()
        if isinstance(ins, LoadInput):
            buffers[buffer_name("input", ins.mb, ins.chunk)] = message_mib(ins.tensors)
        elif isinstance(ins, (RecvActivationStart, RecvGradStart)):
            buffers[ins.buffer] = message_mib(ins.tensors)
        elif isinstance(ins, ForwardPass):
            st, pk, _, _, _ = costs[(ins.mb, ins.chunk, ins.recompute)]
            buffers.pop(buffer_name("act_in", ins.mb, ins.chunk), None)  # now the first layer's stored input
            if transient:
                high = stored + st + pk
            stored += st
            stored_of[(ins.mb, ins.chunk)] = st
            out = buffer_name("act_out", ins.mb, ins.chunk)
            if out in send_specs:
                buffers[out] = message_mib(send_specs[out])
        elif isinstance(ins, BackwardPass) and ins.part == "weight":
            # Runs the deferred GEMMs and releases their stash; no plan buffer, no recompute.
            high = stored
            stored -= stash_of.pop((ins.mb, ins.chunk), 0.0)
        elif isinstance(ins, BackwardPass):
            _, pk, held, ws, held_split = costs[(ins.mb, ins.chunk, ins.recompute)]
            if ins.part == "input":
                held = held_split
            before = stored
            stored -= stored_of.pop((ins.mb, ins.chunk), 0.0)
            if ins.part == "input":  # all but the weight part's stash is released
                stored += ws
                stash_of[(ins.mb, ins.chunk)] = ws
            # An input part peaks on whichever is higher, what it started or ended with (under
            # full recompute its last rematerialised layer runs on top of the others' stashes).
            high = max(before, stored) + (pk if transient else held)
            grad_out = buffer_name("grad_out", ins.mb, ins.chunk)
            if grad_out in grad_specs:
                buffers[grad_out] = message_mib(grad_specs[grad_out])
        elif isinstance(ins, (SendActivationFinish, SendGradFinish)):
            sends.finished(ins.buffer, release=isinstance(ins, SendActivationFinish))
        elif isinstance(ins, (RecvActivationFinish, RecvGradFinish)):
            sends.wait_all()
        elif isinstance(ins, FreeBuffer):
            sends.free(ins.buffer)
        held_buffers = sum(buffers.values())
        if high is not None:
            peak = max(peak, high + held_buffers)
        peak = max(peak, stored + held_buffers)
    return peak
