"""Compile a schedule and one replica's micro-batches into one plan per pipeline rank.

Every rank's instructions follow its op order in the schedule. Around each op:

- before a forward: ``LoadInput`` on the stages that read data (first stage: tokens and
  position ids; last stage: labels and loss mask), and the ``*Finish`` of the receives
  the op needs;
- after a backward: ``FreeBuffer`` of the micro-batch's input, received activation,
  produced activation and received gradient; a produced gradient is freed once its send
  has finished.

Communication is posted in one global order of transfers, by the simulated time the
data is ready (ties broken by kind, micro-batch and stage), and each rank posts its
share of that order: a send right after the op that produces it, a receive in the gap
between ops where its data becomes ready on the peer (so it is queued before the op
that consumes it). Every wait that precedes a post concerns an earlier transfer, so
the plans complete under NCCL's in-order, tagless point-to-point model; each send is
waited for before the rank's next op. :func:`dynapipe.plan.validate.validate_plans`
checks this, and every other invariant, on the result.
"""
from __future__ import annotations

import bisect
import functools
from typing import Optional, Sequence, Union

import numpy as np

from dynapipe.batching.types import MicroBatch
from dynapipe.config import ModelConfig
from dynapipe.cost.base import CostModel, stage_layouts
from dynapipe.errors import DynaPipeError
from dynapipe.plan.instructions import (BackwardPass, ExecutionPlan, ForwardPass, FreeBuffer, LoadInput,
                                        MicroBatchInfo, RecvActivationFinish, RecvActivationStart,
                                        RecvGradFinish, RecvGradStart, SendActivationFinish,
                                        SendActivationStart, SendGradFinish, SendGradStart, TensorSpec)
from dynapipe.plan._fast import gc_paused, maker as _maker
from dynapipe.schedule.adaptive import adaptive_schedule
from dynapipe.schedule.comm import message_shapes
from dynapipe.schedule.costs import MIN_OP_MS, StageTimes, stage_times
from dynapipe.schedule.one_f_one_b import one_f_one_b
from dynapipe.schedule.simulator import Timeline, simulate
from dynapipe.schedule.types import Schedule


@functools.lru_cache(maxsize=64)
def _layouts(model: ModelConfig, num_stages: int):
    return tuple(stage_layouts(model, num_stages))


def message_specs(model: ModelConfig, src_stage: int, num_stages: int, mbs: int, seqlen: int,
                  dec_seqlen: int = 0) -> tuple[TensorSpec, ...]:
    """Tensors of the activation message ``src_stage -> src_stage + 1`` (and of the
    gradient message back): ``[seqlen, mbs, hidden]`` in the model dtype; for
    encoder-decoder decoder stages also the encoder output."""
    layouts = _layouts(model, num_stages)
    return tuple(TensorSpec(name, shape, model.torch_dtype_name)
                 for name, shape in message_shapes(model, layouts, src_stage, mbs, seqlen, dec_seqlen))


def input_specs(model: ModelConfig, stage: int, num_stages: int, mbs: int, seqlen: int,
                dec_seqlen: int = 0) -> tuple[TensorSpec, ...]:
    """What ``LoadInput`` brings in on ``stage`` (empty: the stage loads nothing).

    Decoder-only: the first stage loads ``tokens`` and ``position_ids`` ``[mbs, seqlen]``
    int64 (position ids restart per packed sample); the last stage ``labels`` int64 and
    ``loss_mask`` float32 ``[mbs, seqlen]``. Encoder-decoder: the first stage loads the
    encoder ``tokens``, the first stage holding decoder layers ``dec_tokens``
    ``[mbs, dec_seqlen]``, and labels and loss mask are ``[mbs, dec_seqlen]``.
    """
    layouts = _layouts(model, num_stages)
    last = num_stages - 1
    specs = []
    if model.is_encoder_decoder:
        if stage == 0:
            specs.append(TensorSpec("tokens", (mbs, seqlen), "int64"))
        first_dec = next(s for s, l in enumerate(layouts) if l.decoder_layers > 0)
        if stage == first_dec:
            specs.append(TensorSpec("dec_tokens", (mbs, dec_seqlen), "int64"))
        target = dec_seqlen
    else:
        if stage == 0:
            specs += [TensorSpec("tokens", (mbs, seqlen), "int64"), TensorSpec("position_ids", (mbs, seqlen), "int64")]
        target = seqlen
    if stage == last:
        specs += [TensorSpec("labels", (mbs, target), "int64"), TensorSpec("loss_mask", (mbs, target), "float32")]
    return tuple(specs)


def _proxy_times(micro_batches: Sequence[MicroBatch], num_stages: int) -> StageTimes:
    """Stand-in costs proportional to padded tokens, for compiling without a cost model."""
    tokens = np.array([max(mb.padded_tokens, 1) for mb in micro_batches], dtype=np.float64) * 1e-3
    fw = np.tile(np.maximum(tokens, MIN_OP_MS), (num_stages, 1))
    zeros = np.zeros_like(fw)
    comm = np.zeros((max(num_stages - 1, 0), len(micro_batches)))
    return StageTimes(fw, 2 * fw, zeros, zeros.copy(), comm, comm.copy(), np.zeros(num_stages))


_SendActStart, _SendActFinish = _maker(SendActivationStart), _maker(SendActivationFinish)
_RecvActStart, _RecvActFinish = _maker(RecvActivationStart), _maker(RecvActivationFinish)
_SendGradStart, _SendGradFinish = _maker(SendGradStart), _maker(SendGradFinish)
_RecvGradStart, _RecvGradFinish = _maker(RecvGradStart), _maker(RecvGradFinish)
_Free, _Load, _Forward, _Backward = _maker(FreeBuffer), _maker(LoadInput), _maker(ForwardPass), _maker(BackwardPass)


def _info(i: int, mb: MicroBatch) -> MicroBatchInfo:
    rows = tuple(tuple(int(x) for x in r) for r in mb.rows) if mb.rows is not None else ()
    return MicroBatchInfo(mb=i, samples=tuple(int(x) for x in mb.samples), mbs=mb.mbs, seqlen=int(mb.seqlen),
                          dec_seqlen=int(mb.dec_seqlen), real_tokens=int(mb.real_tokens), rows=rows)


def compile_plans(schedule: Union[Schedule, str], micro_batches: Sequence[MicroBatch], model: ModelConfig, *,
                  num_stages: Optional[int] = None, timeline: Optional[Timeline] = None,
                  cost_model: Optional[CostModel] = None, replica: int = 0, num_replicas: int = 1,
                  iteration: int = 0, global_real_tokens: Optional[int] = None,
                  recompute: Optional[str] = None) -> list[ExecutionPlan]:
    """One :class:`ExecutionPlan` per pipeline stage (list index = stage) for one replica.

    ``schedule``: a :class:`Schedule` whose ``Op.mb`` index ``micro_batches``, or the name
    ``"1f1b"``/``"adaptive"`` to build one here (needs ``num_stages``; the adaptive one is
    then unbounded in memory). ``micro_batches``: this replica's micro-batches in the
    order the schedule indexes them. ``timeline``: the schedule's simulated timeline,
    which orders communication; without one it is simulated on ``cost_model``'s costs,
    or on costs proportional to padded tokens. ``global_real_tokens``: real tokens of the
    whole global batch over all replicas (needed when ``num_replicas > 1``).
    ``recompute`` overrides the schedule's level(s) in the plans; otherwise each rank's
    plan (and its forward/backward instructions) carries its stage's level.
    """
    mbs_list = list(micro_batches)
    if isinstance(schedule, str):
        if not num_stages:
            raise DynaPipeError(f"compile_plans(schedule={schedule!r}) needs num_stages.")
        times = (stage_times(cost_model, mbs_list) if cost_model is not None
                 else _proxy_times(mbs_list, num_stages))
        if schedule == "1f1b":
            schedule = one_f_one_b(num_stages, len(mbs_list))
        elif schedule == "adaptive":
            schedule, timeline = adaptive_schedule(times)
        else:
            raise DynaPipeError(f"schedule {schedule!r} is not known; use '1f1b', 'adaptive' or a Schedule.")
        if timeline is None:
            timeline = simulate(schedule, times, record_memory=False)
    S = schedule.num_stages
    if num_stages is not None and num_stages != S:
        raise DynaPipeError(f"num_stages={num_stages} but the schedule has {S} stages.")
    schedule.check()
    M = len(mbs_list)
    if schedule.num_micro_batches != M:
        raise DynaPipeError(f"schedule {schedule.name!r} runs {schedule.num_micro_batches} micro-batches, "
                            f"{M} were given.")
    if timeline is None:
        times = stage_times(cost_model, mbs_list) if cost_model is not None else _proxy_times(mbs_list, S)
        timeline = simulate(schedule, times, record_memory=False)
    if timeline.schedule.stage_ops != schedule.stage_ops:
        raise DynaPipeError("the timeline given to compile_plans belongs to a different schedule.")
    infos = tuple(_info(i, mb) for i, mb in enumerate(mbs_list))
    real = sum(i.real_tokens for i in infos)
    if global_real_tokens is None:
        if num_replicas > 1:
            raise DynaPipeError("compile_plans with num_replicas > 1 needs global_real_tokens "
                                "(real tokens of the whole global batch).")
        global_real_tokens = real
    # Message tensors of every boundary and micro-batch, shared by the two ranks of a transfer.
    msgs = [[message_specs(model, b, S, mb.mbs, mb.seqlen, mb.dec_seqlen) for mb in mbs_list]
            for b in range(S - 1)]
    ends_of = [{(op.kind, op.mb): timeline.ends[s][i] for i, op in enumerate(schedule.stage_ops[s])}
               for s in range(S)]
    plans = []
    for s in range(S):
        level = recompute or schedule.recompute_of(s)
        with gc_paused():
            instructions = _rank_instructions(s, S, schedule, timeline, ends_of, msgs, infos, model, level)
        plans.append(ExecutionPlan(
            iteration=iteration, stage=s, num_stages=S, replica=replica, num_replicas=num_replicas,
            schedule=schedule.name, recompute=level, micro_batches=infos, instructions=tuple(instructions),
            real_tokens=real, global_real_tokens=int(global_real_tokens),
            meta={"order": schedule.order, "mb_order": [int(x) for x in schedule.mb_order],
                  "simulated_ms": round(float(timeline.makespan_ms), 6)}))
    return plans


def _rank_instructions(s: int, S: int, schedule: Schedule, timeline: Timeline, ends_of: list[dict],
                       msgs: list, infos: tuple, model: ModelConfig, level: str) -> list:
    ops = schedule.stage_ops[s]
    ends = timeline.ends[s]
    index = {(op.kind, op.mb): i for i, op in enumerate(ops)}
    # Posts as (gap, key, instruction): gap g = after op g (-1: before the first op); key
    # = the transfer's place in the global order (ready time, kind, micro-batch, boundary).
    posts: list = []
    after: dict[int, list] = {}       # op index -> send finishes (and frees) before the next op
    before: dict[int, list] = {}      # op index -> receive finishes the op waits for

    def recv_gap(ready_ms: float, consumer: int) -> int:
        return min(bisect.bisect_right(ends, ready_ms) - 1, consumer - 1)

    for info in infos:
        i = info.mb
        if s < S - 1:
            specs = msgs[s][i]
            t = ends_of[s][("F", i)]
            g = index[("F", i)]
            buf = f"act_out:{i}:0"
            posts.append((g, t, 0, i, s, _SendActStart(mb=i, peer=s + 1, buffer=buf, tensors=specs)))
            after.setdefault(g, []).append(_SendActFinish(mb=i, peer=s + 1, buffer=buf, tensors=specs))
            t = ends_of[s + 1][("B", i)]
            c = index[("B", i)]
            buf = f"grad_in:{i}:0"
            posts.append((recv_gap(t, c), t, 1, i, s, _RecvGradStart(mb=i, peer=s + 1, buffer=buf, tensors=specs)))
            before.setdefault(c, []).append(_RecvGradFinish(mb=i, peer=s + 1, buffer=buf, tensors=specs))
        if s > 0:
            specs = msgs[s - 1][i]
            t = ends_of[s - 1][("F", i)]
            c = index[("F", i)]
            buf = f"act_in:{i}:0"
            posts.append((recv_gap(t, c), t, 0, i, s - 1,
                          _RecvActStart(mb=i, peer=s - 1, buffer=buf, tensors=specs)))
            before.setdefault(c, []).append(_RecvActFinish(mb=i, peer=s - 1, buffer=buf, tensors=specs))
            t = ends_of[s][("B", i)]
            g = index[("B", i)]
            buf = f"grad_out:{i}:0"
            posts.append((g, t, 1, i, s - 1, _SendGradStart(mb=i, peer=s - 1, buffer=buf, tensors=specs)))
            after.setdefault(g, []).extend((_SendGradFinish(mb=i, peer=s - 1, buffer=buf, tensors=specs),
                                            _Free(mb=i, buffer=buf)))
    posts.sort(key=lambda p: p[:5])
    by_gap: dict[int, list] = {}
    for p in posts:
        by_gap.setdefault(p[0], []).append(p[5])

    loads = {info.mb: input_specs(model, s, S, info.mbs, info.seqlen, info.dec_seqlen) for info in infos}
    frees = [kind for kind, present in (("input", None), ("act_in", s > 0), ("act_out", s < S - 1),
                                        ("grad_in", s < S - 1)) if present is not False]
    out: list = list(by_gap.get(-1, ()))
    for g, op in enumerate(ops):
        mb = op.mb
        info = infos[mb]
        if op.kind == "F" and loads[mb]:
            out.append(_Load(mb=mb, tensors=loads[mb]))
        out.extend(before.get(g, ()))
        if op.kind == "F":
            out.append(_Forward(mb=mb, mbs=info.mbs, seqlen=info.seqlen, dec_seqlen=info.dec_seqlen,
                                   recompute=level))
        else:
            out.append(_Backward(mb=mb, mbs=info.mbs, seqlen=info.seqlen, dec_seqlen=info.dec_seqlen,
                                    recompute=level))
            out.extend(_Free(mb=mb, buffer=f"{kind}:{mb}:0") for kind in frees
                       if kind != "input" or loads[mb])
        out.extend(by_gap.get(g, ()))
        out.extend(after.get(g, ()))
    return out
