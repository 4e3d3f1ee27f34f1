"""Compile an interleaved (chunked) schedule into one plan per pipeline rank.

Rank ``s`` runs chunk ``c`` as virtual stage ``k = c * P + s``; its instructions carry
``chunk = c`` and its buffers are ``<kind>:<mb>:<c>``. A forward of virtual stage ``k``
sends its activation to rank ``(s + 1) % P`` (chunk ``c + 1`` on rank 0 after the last
rank), a backward its input gradient to rank ``(s - 1) % P``; each message holds the
tensors :func:`~dynapipe.plan.specs.message_specs` gives for the virtual stages'
layers (for T5 the encoder output joins at the first decoder layer and travels on).

Communication follows the rule of :mod:`dynapipe.plan.compile`: one global order of
transfers by simulated ready time (ties by kind, micro-batch, virtual stage); every rank
posts its share in that order, a send right after the op that produces it and waited
for before the rank's next op, a receive as soon as every earlier transfer of the rank
is posted, and its finish just before the op that reads it. A split backward
(``interleaved-zb``) compiles as :mod:`dynapipe.plan.compile` compiles it: its ``BI`` into
``BackwardPass(part="input")`` with exactly a backward's transfers and frees, its ``BW``
into ``BackwardPass(part="weight")`` with none. The plans are instruction
objects (the compiled instruction tables are for unchunked plans), so
:func:`~dynapipe.plan.validate.validate_plans` checks them on its object path.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from dynapipe.batching.types import MicroBatch
from dynapipe.config import ModelConfig
from dynapipe.cost.base import StageLayout
from dynapipe.errors import DynaPipeError, whole_number
from dynapipe.plan.compile_checks import check_micro_batches, check_sequence_shards, tensor_parallel_layout
from dynapipe.plan.instructions import (BackwardPass, ExecutionPlan, ForwardPass, FreeBuffer, LoadInput,
                                        MicroBatchInfo, RecvActivationFinish, RecvActivationStart, RecvGradFinish,
                                        RecvGradStart, SendActivationFinish, SendActivationStart, SendGradFinish,
                                        SendGradStart, buffer_name)
from dynapipe.schedule.simulator import Timeline
from dynapipe.schedule.types import Schedule


def _info(i: int, mb: MicroBatch) -> MicroBatchInfo:
    rows = tuple(tuple(map(int, r)) for r in mb.rows) if mb.rows is not None else ()
    return MicroBatchInfo(mb=i, samples=tuple(map(int, mb.samples)), mbs=mb.mbs, seqlen=int(mb.seqlen),
                          dec_seqlen=int(mb.dec_seqlen), loss_tokens=int(mb.planned_loss_tokens), rows=rows)


def compile_chunked_plans(schedule: Schedule, micro_batches: Sequence[MicroBatch], model: ModelConfig,
                          timeline: Timeline, virtual_layouts: Sequence[StageLayout], *, replica: int = 0,
                          num_replicas: int = 1, iteration: int = 0,
                          global_loss_tokens: Optional[int] = None, tp: int = 1,
                          sequence_parallel: bool = False) -> list[ExecutionPlan]:
    """One :class:`ExecutionPlan` per rank of a chunked ``schedule`` (``num_chunks > 1``) and
    its simulated ``timeline``; ``virtual_layouts``: the layers of every virtual stage
    (:meth:`~dynapipe.cost.placement.StagePlacement.virtual_layouts`). ``tp`` /
    ``sequence_parallel``: as for :func:`~dynapipe.plan.compile.compile_plans` (recorded in
    ``meta``; under sequence parallelism messages are sequence shards)."""
    from dynapipe.plan.specs import input_specs, message_specs

    shards, tp_meta = tensor_parallel_layout("compile_chunked_plans", tp, sequence_parallel)
    P, v = schedule.num_stages, schedule.num_chunks
    V = P * v
    if len(virtual_layouts) != V:
        raise DynaPipeError(f"compile_chunked_plans: {len(virtual_layouts)} virtual stage layouts for {P} ranks x "
                            f"{v} chunks.")
    if P < 2:
        raise DynaPipeError("an interleaved plan needs at least 2 pipeline ranks.")
    if timeline.schedule.stage_ops != schedule.stage_ops:
        raise DynaPipeError("the timeline given to compile_chunked_plans belongs to a different schedule.")
    mbs_list = list(micro_batches)
    check_micro_batches("compile_chunked_plans", mbs_list, model)
    # As compile_plans checks: too few ended in an IndexError, too many compiled micro-batches
    # no op runs (their loss tokens counted, their data loaded for nothing).
    M = len(mbs_list)
    runs = {op.mb for ops in schedule.stage_ops for op in ops}
    if runs != set(range(len(runs))) or len(runs) != M:
        raise DynaPipeError(f"schedule {schedule.name!r} runs {len(runs)} micro-batches, {M} were given.")
    whole_number("compile_chunked_plans: iteration", iteration, at_least=0)
    infos = tuple(_info(i, mb) for i, mb in enumerate(mbs_list))
    check_sequence_shards(infos, shards)
    loss = sum(i.loss_tokens for i in infos)
    if global_loss_tokens is None:
        if num_replicas > 1:
            raise DynaPipeError("compile_chunked_plans with num_replicas > 1 needs global_loss_tokens.")
        global_loss_tokens = loss
    layouts = tuple(virtual_layouts)
    packed = {i.mb: bool(i.rows) for i in infos}
    msg = {}

    def message(k: int, m: int):
        key = (k, m)
        if key not in msg:
            i = infos[m]
            msg[key] = message_specs(model, k, V, i.mbs, i.seqlen, i.dec_seqlen, layouts, shards=shards)
        return msg[key]

    # Every transfer: (ready ms, kind 0 act / 1 grad, mb, sending virtual stage), sender, receiver.
    transfers = []
    for s, ops in enumerate(schedule.stage_ops):
        for j, op in enumerate(ops):
            k = op.chunk * P + s
            if op.kind == "F" and k < V - 1:
                transfers.append(((timeline.ends[s][j], 0, op.mb, k), s, (k + 1) % P))
            elif op.kind in ("B", "BI") and k > 0:
                transfers.append(((timeline.ends[s][j], 1, op.mb, k), s, (k - 1) % P))
    transfers.sort(key=lambda t: t[0])
    plans = []
    for s in range(P):
        plans.append(_rank_plan(s, P, v, schedule, infos, transfers, message, packed, model, layouts, input_specs))
    out = []
    for s, instructions in enumerate(plans):
        levels = [schedule.recompute_of(c * P + s) if len(schedule.stage_recompute) == V
                  else schedule.recompute_of(s) for c in range(v)]
        out.append(ExecutionPlan(
            iteration=iteration, stage=s, num_stages=P, replica=replica, num_replicas=num_replicas,
            schedule=schedule.name, recompute=levels[0], micro_batches=infos, instructions=tuple(instructions),
            loss_tokens=loss, global_loss_tokens=int(global_loss_tokens),
            meta={"order": schedule.order, "mb_order": list(map(int, schedule.mb_order)), "chunks": v,
                  "chunk_recompute": levels, "simulated_ms": round(float(timeline.makespan_ms), 6)} | tp_meta))
    return out


def _level(schedule: Schedule, k: int, s: int, V: int) -> str:
    return schedule.recompute_of(k) if len(schedule.stage_recompute) == V else schedule.recompute_of(s)


def _rank_plan(s, P, v, schedule, infos, transfers, message, packed, model, layouts, input_specs) -> list:
    """Rank ``s``'s instructions (see the module docstring)."""
    V = P * v
    mine = [(key, src, dst) for key, src, dst in transfers if s in (src, dst)]
    ops = schedule.stage_ops[s]
    # A backward's input gradient comes from its B or its BI (the weight part sends nothing).
    op_index = {("B" if op.kind == "BI" else op.kind, op.mb, op.chunk): j for j, op in enumerate(ops)}
    out: list = []
    pending_send_finish: list = []
    ptr = 0

    def post_until(done: int) -> None:
        """Post this rank's transfers in global order while each one can be posted now:
        a receive always, a send once its producing op (index < ``done``) has run."""
        nonlocal ptr
        while ptr < len(mine):
            (t, kind, m, k), src, dst = mine[ptr]
            chunk = k // P
            if src == s:
                producer = op_index[("F" if kind == 0 else "B", m, chunk)]
                if producer >= done:
                    return
                cls_s, cls_f, buf = ((SendActivationStart, SendActivationFinish, "act_out") if kind == 0
                                     else (SendGradStart, SendGradFinish, "grad_out"))
                name = buffer_name(buf, m, chunk)
                tensors = message(k, m) if kind == 0 else message(k - 1, m)
                out.append(cls_s(mb=m, chunk=chunk, peer=dst, buffer=name, tensors=tensors))
                pending_send_finish.append(cls_f(mb=m, chunk=chunk, peer=dst, buffer=name, tensors=tensors))
                if kind == 1:
                    pending_send_finish.append(FreeBuffer(mb=m, chunk=chunk, buffer=name))
            else:
                rk = k + 1 if kind == 0 else k - 1  # the receiving virtual stage
                rchunk = rk // P
                cls_s, buf = (RecvActivationStart, "act_in") if kind == 0 else (RecvGradStart, "grad_in")
                tensors = message(k, m) if kind == 0 else message(rk, m)
                out.append(cls_s(mb=m, chunk=rchunk, peer=src, buffer=buffer_name(buf, m, rchunk), tensors=tensors))
            ptr += 1

    for j, op in enumerate(ops):
        post_until(j)
        out.extend(pending_send_finish)
        pending_send_finish.clear()
        k = op.chunk * P + s
        info = infos[op.mb]
        c, m = op.chunk, op.mb
        level = _level(schedule, k, s, V)
        shape = dict(mbs=info.mbs, seqlen=info.seqlen, dec_seqlen=info.dec_seqlen, recompute=level)
        if op.kind == "BW":
            out.append(BackwardPass(mb=m, chunk=c, part="weight", **shape))
        elif op.kind == "F":
            loads = input_specs(model, k, V, info.mbs, info.seqlen, info.dec_seqlen, packed[m], layouts)
            if loads:
                out.append(LoadInput(mb=m, chunk=c, tensors=loads))
            if k > 0:
                out.append(RecvActivationFinish(mb=m, chunk=c, peer=(s - 1) % P, buffer=buffer_name("act_in", m, c),
                                                tensors=message(k - 1, m)))
            out.append(ForwardPass(mb=m, chunk=c, **shape))
        else:
            if k < V - 1:
                out.append(RecvGradFinish(mb=m, chunk=c, peer=(s + 1) % P, buffer=buffer_name("grad_in", m, c),
                                          tensors=message(k, m)))
            out.append(BackwardPass(mb=m, chunk=c, part="input" if op.kind == "BI" else "full", **shape))
            loads = input_specs(model, k, V, info.mbs, info.seqlen, info.dec_seqlen, packed[m], layouts)
            frees = (["input"] if loads else []) + (["act_in"] if k > 0 else []) + \
                (["act_out", "grad_in"] if k < V - 1 else [])
            out.extend(FreeBuffer(mb=m, chunk=c, buffer=buffer_name(b, m, c)) for b in frees)
    post_until(len(ops))
    out.extend(pending_send_finish)
    if ptr != len(mine):
        raise DynaPipeError(f"rank {s}: {len(mine) - ptr} transfers could not be placed in the rank's order "
                            f"(internal error, please report).")
    return out


def compile_interleaved_1f1b(micro_batches: Sequence[MicroBatch], model: ModelConfig,
                             virtual_layouts: Sequence[StageLayout], num_stages: int, *, replica: int = 0,
                             num_replicas: int = 1, iteration: int = 0, global_loss_tokens: Optional[int] = None,
                             recompute: str = "none", tp: int = 1,
                             sequence_parallel: bool = False) -> list[ExecutionPlan]:
    """Plans of Megatron's interleaved 1F1B for fixed-shape micro-batches (the baselines on an
    interleaved placement), one per rank, every op at ``recompute``. Transfers are ordered
    by a simulation on costs proportional to padded tokens, as
    :func:`~dynapipe.plan.compile.compile_plans` orders a schedule given by name."""
    from dataclasses import replace

    from dynapipe.plan.compile import _proxy_times
    from dynapipe.schedule.interleaved import interleaved_1f1b, simulate_chunked

    V = len(virtual_layouts)
    if num_stages < 2 or V % num_stages:
        raise DynaPipeError(f"an interleaved plan needs at least 2 pipeline ranks and whole chunks per rank; "
                            f"got {V} virtual stages on {num_stages} ranks.")
    mbs_list = list(micro_batches)
    schedule = interleaved_1f1b(num_stages, V // num_stages, len(mbs_list), recompute=recompute)
    # Per virtual stage, with model states per rank as the chunked simulator takes them.
    times = replace(_proxy_times(mbs_list, V), state_mib=np.zeros(num_stages))
    timeline = simulate_chunked(schedule, times, record_memory=False)
    return compile_chunked_plans(schedule, mbs_list, model, timeline, virtual_layouts, replica=replica,
                                 num_replicas=num_replicas, iteration=iteration,
                                 global_loss_tokens=global_loss_tokens, tp=tp, sequence_parallel=sequence_parallel)
