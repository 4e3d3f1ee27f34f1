"""Compile a schedule and one replica's micro-batches into one plan per pipeline rank.

Every rank's instructions follow its op order in the schedule. Around each op:

- before a forward: ``LoadInput`` on the stages that read data (first stage: tokens and
  position ids; last stage: labels and loss mask; every stage, for packed rows, the
  per-token sample ids that its attention mask is built from), and the ``*Finish`` of
  the receives the op needs;
- after a backward: ``FreeBuffer`` of the micro-batch's input, received activation,
  produced activation and received gradient; a produced gradient is freed once its send
  has finished.

A split backward (zero-bubble schedules) compiles its ``BI`` op into
``BackwardPass(part="input")`` with exactly a backward's transfers and frees, and its
``BW`` op into ``BackwardPass(part="weight")`` with none: what the weight part needs (the
linear layers' inputs and output gradients) the executor keeps from the input part.

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

from typing import Optional, Sequence, Union

import numpy as np

from dynapipe.batching.types import MicroBatch
from dynapipe.config import ModelConfig
from dynapipe.cost.base import CostModel, StageLayout, check_recompute
from dynapipe.errors import DynaPipeError, whole_number
from dynapipe.plan._fast import maker
from dynapipe.plan.compile_checks import check_micro_batches, check_sequence_shards, tensor_parallel_layout
from dynapipe.plan.instructions import ExecutionPlan, MicroBatchInfo
from dynapipe.plan.specs import key_specs
from dynapipe.plan.rank_table import (backward_positions, op_positions, positions_from_arrays, rank_table,
                                      split_positions_from_arrays)
from dynapipe.schedule.adaptive import adaptive_schedule
from dynapipe.schedule.costs import MIN_OP_MS, StageTimes, stage_times
from dynapipe.schedule.one_f_one_b import one_f_one_b
from dynapipe.schedule.simulator import Timeline, simulate
from dynapipe.schedule._kernels import BI as KIND_BI
from dynapipe.schedule.types import Schedule
from dynapipe.schedule.zero_bubble import ZB_H1, zb_h1


def _proxy_times(micro_batches: Sequence[MicroBatch], num_stages: int) -> StageTimes:
    """Stand-in costs proportional to padded tokens, for compiling without a cost model."""
    tokens = np.array([max(mb.padded_tokens, 1) for mb in micro_batches], dtype=np.float64) * 1e-3
    fw = np.tile(np.maximum(tokens, MIN_OP_MS), (num_stages, 1))
    zeros = np.zeros_like(fw)
    comm = np.zeros((max(num_stages - 1, 0), len(micro_batches)))
    # A split backward: half input gradient, half weight gradient.
    return StageTimes(fw, 2 * fw, zeros, zeros.copy(), comm, comm.copy(), np.zeros(num_stages),
                      bw_weight_ms=fw.copy())


_make_info = maker(MicroBatchInfo)


def _info(i: int, mb: MicroBatch) -> MicroBatchInfo:
    rows = tuple(tuple(map(int, r)) for r in mb.rows) if mb.rows is not None else ()
    return _make_info(mb=i, samples=tuple(map(int, mb.samples)), mbs=mb.mbs, seqlen=int(mb.seqlen),
                      dec_seqlen=int(mb.dec_seqlen), loss_tokens=int(mb.planned_loss_tokens), rows=rows)


def _checked_arguments(recompute: Optional[str], micro_batches: Sequence[MicroBatch], model: ModelConfig,
                       num_stages: Optional[int], iteration: int) -> list[MicroBatch]:
    """The micro-batches as a list, after checking the recompute override, every micro-batch
    (:func:`check_micro_batches`), ``num_stages`` and ``iteration``."""
    if recompute is not None:
        check_recompute(recompute)
    mbs_list = list(micro_batches)
    check_micro_batches("compile_plans", mbs_list, model)
    if num_stages is not None:
        whole_number("compile_plans: num_stages", num_stages)
    whole_number("compile_plans: iteration", iteration, at_least=0)
    return mbs_list


def _named_schedule(name: str, mbs_list: list[MicroBatch], num_stages: Optional[int],
                    cost_model: Optional[CostModel], timeline: Optional[Timeline]) -> tuple[Schedule, Timeline]:
    """The schedule ``name`` (``1f1b``, ``adaptive`` or ``zb-h1``) built for ``num_stages``
    stages, and its timeline: ``timeline`` when given (except for ``adaptive``, whose build
    simulates it), else simulated on ``cost_model``'s costs or on costs proportional to padded
    tokens (ms)."""
    if not num_stages:
        raise DynaPipeError(f"compile_plans(schedule={name!r}) needs num_stages.")
    times = stage_times(cost_model, mbs_list) if cost_model is not None else _proxy_times(mbs_list, num_stages)
    if name == "1f1b":
        schedule = one_f_one_b(num_stages, len(mbs_list))
    elif name == ZB_H1:
        schedule = zb_h1(num_stages, len(mbs_list))
    elif name == "adaptive":
        schedule, timeline = adaptive_schedule(times)
    else:
        raise DynaPipeError(f"schedule {name!r} is not known; use '1f1b', 'adaptive', 'zb-h1' or a Schedule.")
    if timeline is None:
        timeline = simulate(schedule, times, record_memory=False)
    return schedule, timeline


def _checked_schedule(schedule: Schedule, num_stages: Optional[int], timeline: Optional[Timeline],
                      M: int) -> tuple[Optional[tuple], bool]:
    """``(arrays, split)``: the simulation's op arrays ``(kind, mb, nops, ends ms)`` when ``timeline``
    kept them for this very schedule (they are the ops it ran; else None), and whether the schedule
    splits its backwards. Refuses a chunked schedule, one of another stage count than ``num_stages``
    or with an op list missing, and one that runs another number of micro-batches than ``M``."""
    if schedule.num_chunks > 1:
        raise DynaPipeError(f"compile_plans: schedule {schedule.name!r} runs {schedule.num_chunks} virtual-pipeline "
                            f"chunks per stage; compile them with "
                            f"dynapipe.plan.compile_chunked.compile_chunked_plans.")
    S = schedule.num_stages
    if num_stages is not None and num_stages != S:
        raise DynaPipeError(f"num_stages={num_stages} but the schedule has {S} stages.")
    if len(schedule.stage_ops) != S:
        raise DynaPipeError(f"schedule {schedule.name!r}: {len(schedule.stage_ops)} op lists for {S} stages.")
    arrays = timeline.op_arrays if timeline is not None and timeline.schedule is schedule else None
    split = bool((arrays[0] >= KIND_BI).any()) if arrays is not None else schedule.split_backward
    n_fw = (sum(op.kind == "F" for op in schedule.stage_ops[0]) if split
            else len(schedule.stage_ops[0]) // 2) if S else 0
    if S and (n_fw != M or (not split and len(schedule.stage_ops[0]) != 2 * M)):
        raise DynaPipeError(f"schedule {schedule.name!r} runs {n_fw} micro-batches, {M} were given.")
    return arrays, split


def _op_positions(schedule: Schedule, arrays: Optional[tuple], split: bool, M: int) -> tuple[list, list, list, bool]:
    """``(f_idx, b_idx, w_idx, from_arrays)``: per stage, the op index of each micro-batch's forward,
    backward (its input part when split) and weight part (``w_idx[s]`` None on a stage that does not
    split), and whether they were read from the simulation's ``arrays`` (else from the ops). Every stage
    must run F(i) once, then B(i) (or BI(i) then BW(i)); one that splits only some backwards is refused."""
    S = schedule.num_stages
    w_idx = [None] * S
    if split:
        pos = split_positions_from_arrays(*arrays[:3], M) if arrays is not None else None
        if pos is None:
            positions = [backward_positions(schedule.name, s, schedule.stage_ops[s], M) for s in range(S)]
            f_idx, b_idx, w_all = [p[0] for p in positions], [p[1] for p in positions], [p[2] for p in positions]
        else:
            f_idx, b_idx, w_all = list(pos[0]), list(pos[1]), list(pos[2])
        for s, w in enumerate(w_all):
            if (w >= 0).all():
                w_idx[s] = w
            elif (w >= 0).any():
                raise DynaPipeError(f"schedule {schedule.name!r}: stage {s} splits the backward of "
                                    f"{int((w >= 0).sum())} of its {M} micro-batches; the plan compiler needs a "
                                    f"stage to split every backward (BI then BW) or none.")
    else:
        pos = positions_from_arrays(*arrays[:3], M) if arrays is not None else None
        if pos is None:
            positions = [op_positions(schedule.name, s, schedule.stage_ops[s], M) for s in range(S)]
            f_idx, b_idx = [p[0] for p in positions], [p[1] for p in positions]
        else:
            f_idx, b_idx = list(pos[0]), list(pos[1])
    return f_idx, b_idx, w_idx, pos is not None


def _timeline_ends(schedule: Schedule, timeline: Optional[Timeline], cost_model: Optional[CostModel],
                   mbs_list: list[MicroBatch], arrays: Optional[tuple]) -> tuple[Timeline, list[np.ndarray]]:
    """The schedule's timeline (when none is given, simulated on ``cost_model``'s costs or on
    costs proportional to padded tokens) and every stage's op end times (ms), read from
    ``arrays`` (the simulation's op arrays) when given, else from the timeline. Refuses a
    timeline of another schedule."""
    if timeline is None:
        times = (stage_times(cost_model, mbs_list) if cost_model is not None
                 else _proxy_times(mbs_list, schedule.num_stages))
        timeline = simulate(schedule, times, record_memory=False)
    if timeline.schedule is not schedule and timeline.schedule.stage_ops != schedule.stage_ops:
        raise DynaPipeError("the timeline given to compile_plans belongs to a different schedule.")
    if arrays is not None:
        return timeline, [e[:n] for e, n in zip(arrays[3], arrays[2].tolist())]
    return timeline, [np.asarray(e, dtype=np.float64) for e in timeline.ends]


def _loss_tokens(infos: Sequence[MicroBatchInfo], global_loss_tokens: Optional[int],
                 num_replicas: int) -> tuple[int, int]:
    """``(loss, global)``: this replica's loss tokens and the global batch's (given; else this
    replica's, refused when there are several replicas)."""
    loss = sum(i.loss_tokens for i in infos)
    if global_loss_tokens is None:
        if num_replicas > 1:
            raise DynaPipeError("compile_plans with num_replicas > 1 needs global_loss_tokens "
                                "(loss tokens of the whole global batch).")
        global_loss_tokens = loss
    return loss, global_loss_tokens


def _micro_batch_keys(model: ModelConfig, infos: Sequence[MicroBatchInfo],
                      S: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(shape, keys, key_of)``: every micro-batch's ``(mbs, seqlen, dec_seqlen)`` (``[M, 3]``),
    the distinct ``(mbs, seqlen, dec_seqlen, packed)`` keys its messages and loads depend on,
    and each micro-batch's key index. Refuses a plan that packs some micro-batches only."""
    M = len(infos)
    shape = np.array([(i.mbs, i.seqlen, i.dec_seqlen) for i in infos], dtype=np.int64).reshape(M, 3)
    # Packed rows load their sample ids on every stage: part of the load key, not of the messages.
    packed = np.array([len(i.rows) > 0 for i in infos], dtype=np.int64)
    if S > 2 and 0 < packed.sum() < M and not model.is_encoder_decoder:
        # A middle stage would load for some micro-batches only; its instruction table
        # (and the validator) have one load slot for all or none.
        raise DynaPipeError(f"compile_plans: {int(packed.sum())} of {M} micro-batches are packed rows; a plan "
                            f"packs all of its micro-batches or none (use one batching method per iteration).")
    key_arr = np.concatenate([shape, packed[:, None]], axis=1)
    uniq, inv = np.unique(key_arr, axis=0, return_inverse=True) if M else (key_arr, np.zeros(0, np.int64))
    return shape, uniq, inv.reshape(-1)


def _numbered_tensor_lists(specs: list, S: int) -> tuple[list, np.ndarray]:
    """``(lists, ids)``: every distinct tensor list of ``specs`` (per key: each boundary's message, each
    stage's loads), numbered in order of first use, boundary by boundary then stage by stage (an object
    met again keeps its number), and ``ids[row, key]`` its number (rows: the ``S - 1`` boundaries, then
    the ``S`` stages; -1: a stage that loads nothing)."""
    K = len(specs)
    seq = [sp[0][b] for b in range(S - 1) for sp in specs] + [sp[1][s] for s in range(S) for sp in specs]
    empty = np.fromiter(map(len, seq), dtype=np.int64, count=len(seq)) == 0
    empty[:(S - 1) * K] = False
    ident = np.fromiter(map(id, seq), dtype=np.int64, count=len(seq))
    ident[empty] = -1
    _, first, which = np.unique(ident, return_index=True, return_inverse=True)
    number = np.full(len(first), -1, np.int64)
    kept = ident[first] != -1
    by_first = np.argsort(first[kept], kind="stable")
    number[np.flatnonzero(kept)[by_first]] = np.arange(int(kept.sum()))
    ids = number[which.reshape(-1)].reshape(2 * S - 1, K) if K else np.zeros((2 * S - 1, 0), np.int64)
    lists = [None] * int(kept.sum())
    for n, j in zip(number[kept].tolist(), first[kept].tolist()):
        lists[n] = seq[j]
    return lists, ids


def _tensor_lists(model: ModelConfig, infos: Sequence[MicroBatchInfo], S: int,
                  layouts: Optional[tuple[StageLayout, ...]], shards: int) -> tuple[np.ndarray, list, list, list]:
    """``(shape, lists, msg_ids, load_ids)``: every micro-batch's ``(mbs, seqlen, dec_seqlen)``,
    the tensor lists of every boundary's message and every rank's loads, each distinct one
    numbered once (shapes repeat across micro-batches) and shared by every rank's table, and
    per boundary / per stage each micro-batch's list number (-1: loads nothing)."""
    shape, uniq, inv = _micro_batch_keys(model, infos, S)
    specs = [key_specs(model, S, k, layouts, shards) for k in map(tuple, uniq.tolist())]
    lists, ids = _numbered_tensor_lists(specs, S)
    return shape, lists, [ids[b][inv] for b in range(S - 1)], [ids[S - 1 + s][inv] for s in range(S)]


def _rank_strings(level: str, w_idx: Optional[np.ndarray]) -> tuple[tuple[str, ...], dict]:
    """A rank's string table (its recompute level, ``full``, and on a stage that splits its
    backwards the parts ``input`` and ``weight``) and :func:`rank_table`'s split-backward
    arguments (none on a stage that does not split)."""
    strings = (level, "full") if level != "full" else ("full",)
    parts = {}
    if w_idx is not None:
        strings += ("input", "weight")
        parts = dict(w_idx=w_idx, input_sid=strings.index("input"), weight_sid=strings.index("weight"))
    return strings, parts


def _rank_tensor_lists(s: int, M: int, msg_ids: list, load_ids: list, lists: list) -> tuple[list, np.ndarray, tuple]:
    """``(rank_msgs, rank_loads, tensor_lists)`` of stage ``s``: only the tensor lists it uses,
    renumbered; its message numbers per boundary (None on boundaries it does not touch) and
    its load numbers, per micro-batch (-1, loads nothing, stays -1)."""
    S = len(load_ids)
    mine = [a for a in (msg_ids[s - 1] if s > 0 else None, msg_ids[s] if s < S - 1 else None, load_ids[s])
            if a is not None]
    used, inverse = np.unique(np.concatenate(mine), return_inverse=True)
    offset = int(used.size > 0 and used[0] < 0)   # -1 (loads nothing) stays -1
    remap = (inverse - offset).reshape(len(mine), M)
    rank_msgs = [None] * (S - 1)
    k = 0
    if s > 0:
        rank_msgs[s - 1], k = remap[0], 1
    if s < S - 1:
        rank_msgs[s], k = remap[k], k + 1
    return rank_msgs, remap[k], tuple(map(lists.__getitem__, used[offset:].tolist()))


def compile_plans(schedule: Union[Schedule, str], micro_batches: Sequence[MicroBatch], model: ModelConfig, *,
                  num_stages: Optional[int] = None, timeline: Optional[Timeline] = None,
                  cost_model: Optional[CostModel] = None, replica: int = 0, num_replicas: int = 1,
                  iteration: int = 0, global_loss_tokens: Optional[int] = None,
                  recompute: Optional[str] = None,
                  layouts: Optional[Sequence[StageLayout]] = None, tp: int = 1,
                  sequence_parallel: bool = False) -> list[ExecutionPlan]:
    """One :class:`ExecutionPlan` per pipeline stage (list index = stage) for one replica.

    ``schedule``: a :class:`Schedule` whose ``Op.mb`` index ``micro_batches``, or the name
    ``"1f1b"``/``"adaptive"``/``"zb-h1"`` to build one here (needs ``num_stages``; the
    adaptive one is then unbounded in memory). A schedule that splits backwards (``BI``/``BW``)
    must split every backward of a stage or none of them. ``micro_batches``: this replica's micro-batches in the
    order the schedule indexes them. ``timeline``: the schedule's simulated timeline,
    which orders communication; without one it is simulated on ``cost_model``'s costs,
    or on costs proportional to padded tokens. ``global_loss_tokens``: loss tokens of the
    whole global batch over all replicas, the plans' default loss normaliser (see
    :class:`ExecutionPlan`; needed when ``num_replicas > 1``). Each micro-batch's loss
    tokens are its :attr:`MicroBatch.planned_loss_tokens`.
    ``recompute`` overrides the schedule's level(s) in the plans; otherwise each rank's
    plan (and its forward/backward instructions) carries its stage's level.
    ``layouts``: the layers of every stage, which decide the messages of encoder-decoder
    models (default: ``cost_model``'s, else Megatron's even split).
    ``tp``: tensor-parallel ranks per stage (every one runs the same plan; recorded in
    ``meta["tp"]``); with ``sequence_parallel`` messages are ``[seqlen / tp, mbs, hidden]``
    and every micro-batch's lengths must be multiples of ``tp``.
    """
    shards, tp_meta = tensor_parallel_layout("compile_plans", tp, sequence_parallel)
    mbs_list = _checked_arguments(recompute, micro_batches, model, num_stages, iteration)
    if layouts is None and cost_model is not None:
        layouts = cost_model.layouts
    layouts = tuple(layouts) if layouts is not None else None
    if isinstance(schedule, str):
        schedule, timeline = _named_schedule(schedule, mbs_list, num_stages, cost_model, timeline)
    M = len(mbs_list)
    arrays, split = _checked_schedule(schedule, num_stages, timeline, M)
    f_idx, b_idx, w_idx, from_arrays = _op_positions(schedule, arrays, split, M)
    timeline, ends = _timeline_ends(schedule, timeline, cost_model, mbs_list, arrays if from_arrays else None)
    infos = tuple(_info(i, mb) for i, mb in enumerate(mbs_list))
    check_sequence_shards(infos, shards)
    loss, global_loss_tokens = _loss_tokens(infos, global_loss_tokens, num_replicas)
    S = schedule.num_stages
    shape, lists, msg_ids, load_ids = _tensor_lists(model, infos, S, layouts, shards)
    mb_order = list(map(int, schedule.mb_order))
    plans = []
    for s in range(S):
        level = recompute or schedule.recompute_of(s)
        strings, parts = _rank_strings(level, w_idx[s])
        rank_msgs, rank_loads, tensor_lists = _rank_tensor_lists(s, M, msg_ids, load_ids, lists)
        instructions = rank_table(s, S, M, f_idx, b_idx, ends, shape, rank_msgs, rank_loads, strings,
                                  tensor_lists, 0, strings.index("full"), **parts)
        plans.append(ExecutionPlan(
            iteration=iteration, stage=s, num_stages=S, replica=replica, num_replicas=num_replicas,
            schedule=schedule.name, recompute=level, micro_batches=infos, instructions=instructions,
            loss_tokens=loss, global_loss_tokens=int(global_loss_tokens),
            meta={"order": schedule.order, "mb_order": list(mb_order),
                  "simulated_ms": round(float(timeline.makespan_ms), 6), **tp_meta}))
    return plans
