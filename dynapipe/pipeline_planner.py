"""Plan one training iteration end to end: micro-batches, schedule, per-rank plans.

:func:`plan_iteration` is the one call the data loader and the training step use:
lengths in, an :class:`IterationPlan` out (the :class:`BatchPlan`, the chosen schedule
with its simulated figures, and one :class:`~dynapipe.plan.instructions.ExecutionPlan`
per (replica, stage)).
:func:`schedule_batch_plan` does the second half for a :class:`BatchPlan` made elsewhere.
:class:`IterationPlan` lives in :mod:`dynapipe.iteration_plan` and is importable from here too.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Optional, Sequence

import numpy as np

from dynapipe.batching import BatchPlan, plan_micro_batches
from dynapipe.batching.dp_partition import DEFAULT_GAP
from dynapipe.batching.planner import DP_METHODS
from dynapipe.batching.types import LengthLimit
from dynapipe.config import ClusterConfig
from dynapipe.cost.base import RECOMPUTE_LEVELS, CostModel, check_recompute, require_cost_model
from dynapipe.cost.placement import StagePlacement
from dynapipe.plan.compile_chunked import compile_chunked_plans
from dynapipe.errors import DynaPipeError, flags, is_whole, real_number, whole_number
from dynapipe.plan._fast import without_gc_pauses
from dynapipe.plan.compile import compile_plans
from dynapipe.plan.validate import validate_plans
from dynapipe.iteration_plan import IterationPlan
from dynapipe.schedule.comm import sequence_shards_of
from dynapipe.schedule.search import SearchResult, search_schedules


def _default_memory(cost_model: CostModel, memory_limit_mib: Optional[float],
                    reserved_mib: Optional[float]) -> tuple[Optional[float], float]:
    device = getattr(cost_model, "device", None)
    if memory_limit_mib is None and device is not None:
        memory_limit_mib = device.memory_mib
    if reserved_mib is None:
        reserved_mib = device.reserved_mib if device is not None else 0.0
    return memory_limit_mib, float(reserved_mib)


def _loss_tokens(batch_plan: BatchPlan, lengths, cost_model: CostModel) -> BatchPlan:
    """Encoder-decoder losses count target tokens: set the micro-batches' ``loss_tokens``
    to their target tokens (``real_tokens`` keeps input + target), as truncated to the plan's
    limits (``seq_length``, and ``dec_seq_length`` where the targets have their own)."""
    if not cost_model.model.is_encoder_decoder or lengths is None:
        return batch_plan
    arr = np.asarray(lengths)
    if arr.ndim != 2:
        return batch_plan
    targets = arr[:, 1]
    cap = batch_plan.extra.get("dec_seq_length", batch_plan.extra.get("seq_length"))
    if cap is not None:
        targets = np.minimum(targets, int(cap))
    mbs = [dataclasses.replace(mb, loss_tokens=int(targets[mb.samples].sum())) for mb in batch_plan.micro_batches]
    return dataclasses.replace(batch_plan, micro_batches=mbs)


def _resolve_tp(tp: Optional[int], cost_model: CostModel) -> int:
    """The tensor-parallel size the plans run at: the cost model's, which ``tp`` (None: not
    given) must equal when given. The stage-to-stage links are priced by where the ranks sit,
    which the TP size decides; another size than the cost model's would price compute and
    links for different layouts."""
    if tp is None:
        return _tp_size(cost_model)
    if not isinstance(tp, (int, np.integer)) or isinstance(tp, bool) or tp < 1:
        raise DynaPipeError(f"tp {tp!r}: the tensor-parallel size is a whole number, 1 or more.")
    if tp != _tp_size(cost_model):
        raise DynaPipeError(f"tp {tp}: the cost model prices tensor-parallel size {_tp_size(cost_model)}; build it "
                            f"at the size the plans run (build_cost_model(..., tp=TensorParallelConfig({tp}))) or "
                            f"leave tp out.")
    return int(tp)


def _tp_size(cost_model: CostModel) -> int:
    tp = getattr(cost_model, "tp", None)
    return tp.size if tp is not None else 1


def round_for_sequence_parallel(batch_plan: BatchPlan, shards: int, max_seq_length: int) -> BatchPlan:
    """``batch_plan`` with every micro-batch's padded lengths rounded up to a multiple of
    ``shards`` (the TP size under sequence parallelism, which splits each sequence evenly
    over the TP ranks). Padding to multiples of 8 already gives this for TP 2, 4 and 8, so
    only odd TP sizes change anything; the schedule search prices the rounded shapes.
    Raises :class:`DynaPipeError` when rounding would pass ``max_seq_length`` tokens."""
    if shards <= 1:
        return batch_plan
    out, changed = [], False
    for i, mb in enumerate(batch_plan.micro_batches):
        seq, dec = -(-mb.seqlen // shards) * shards, -(-mb.dec_seqlen // shards) * shards
        if (seq, dec) != (mb.seqlen, mb.dec_seqlen):
            if max(seq, dec) > max_seq_length:
                raise DynaPipeError(f"micro-batch {i} ({mb.seqlen} tokens) rounded up to a multiple of the "
                                    f"{shards} sequence-parallel ranks exceeds the model's {max_seq_length} "
                                    f"tokens; use a sequence length divisible by {shards}.")
            # Per-sample rows keep their pairs; the longer rows make them a smaller share.
            attention = None if mb.attention is None else \
                mb.attention.padded_to(mb.seqlen, mb.dec_seqlen, seq, dec)
            mb, changed = dataclasses.replace(mb, seqlen=seq, dec_seqlen=dec, attention=attention), True
        out.append(mb)
    return dataclasses.replace(batch_plan, micro_batches=out) if changed else batch_plan


@without_gc_pauses
def schedule_batch_plan(batch_plan: BatchPlan, cost_model: CostModel, *, schedule: str = "auto",
                        memory_limit_mib: Optional[float] = None, reserved_mib: Optional[float] = None,
                        cluster: Optional[ClusterConfig] = None, recompute: Optional[str] = None,
                        iteration: int = 0, tp: Optional[int] = None, zero: bool = False, explain: bool = False,
                        validate: bool = False, lengths=None,
                        replicas: Optional[Sequence[int]] = None, split_backward: bool = True) -> IterationPlan:
    """Search a schedule for ``batch_plan`` and compile every rank's plan.

    ``memory_limit_mib``/``reserved_mib`` default to the cost model's device config; a
    stage may use ``memory_limit_mib - reserved_mib`` MiB, model states included.
    ``recompute``: a level, or ``None`` to let the search choose. ``lengths`` (the
    batch's lengths) lets encoder-decoder plans count target tokens as loss tokens.
    ``validate=True`` runs :func:`validate_plans` on the result (timed separately).
    ``replicas``: compile only these replicas' plans (``plans[r]`` is empty for the
    others), so planner nodes can split a large iteration's compilation by replica;
    every node gets the same micro-batches and schedules, hence the same plans.
    Under sequence parallelism (``cost_model.tp``) micro-batch lengths are rounded up to
    multiples of the TP size (:func:`round_for_sequence_parallel`) and the plans' messages
    are the ``[seqlen / tp, mbs, hidden]`` shards. ``split_backward=False``: the stages cannot
    split their backward, so ``auto`` does not try ``zb-h1``.
    """
    require_cost_model(cost_model)
    if batch_plan.num_stages != cost_model.num_stages:
        raise DynaPipeError(f"the batch plan is for {batch_plan.num_stages} stages, the cost model for "
                            f"{cost_model.num_stages}.")
    flags(zero=zero, explain=explain, validate=validate, split_backward=split_backward)
    whole_number("iteration", iteration, at_least=0)
    if replicas is not None and not all(isinstance(r, (int, np.integer)) for r in replicas):
        raise DynaPipeError(f"replicas {list(replicas)!r}: give data-parallel replica indices (whole numbers).")
    tp = _resolve_tp(tp, cost_model)
    t0, c0 = time.perf_counter(), time.process_time()
    batch_plan, result = _search(batch_plan, cost_model, schedule=schedule, memory_limit_mib=memory_limit_mib,
                                 reserved_mib=reserved_mib, cluster=cluster, recompute=recompute, tp=tp, zero=zero,
                                 explain=explain, lengths=lengths, split_backward=split_backward)
    t1, c1 = time.perf_counter(), time.process_time()
    dp, shards = batch_plan.dp, sequence_shards_of(cost_model)
    total_loss = sum(mb.planned_loss_tokens for mb in batch_plan.micro_batches)
    wanted = set(range(dp)) if replicas is None else {int(r) for r in replicas}
    if not wanted <= set(range(dp)):
        raise DynaPipeError(f"replicas {sorted(wanted - set(range(dp)))} are outside the {dp} data-parallel "
                            f"replicas (0..{dp - 1}).")
    if result.schedules and result.schedules[0].num_chunks > 1:
        vl = cost_model.placement.virtual_layouts()
        plans = [compile_chunked_plans(result.schedules[r], result.micro_batches[r], cost_model.model,
                                       result.timelines[r], vl, replica=r, num_replicas=dp, iteration=iteration,
                                       global_loss_tokens=total_loss, tp=tp,
                                       sequence_parallel=shards > 1) if r in wanted else [] for r in range(dp)]
    else:
            plans = [compile_plans(result.schedules[r], result.micro_batches[r], cost_model.model,
                               timeline=result.timelines[r], replica=r, num_replicas=dp, iteration=iteration,
                               global_loss_tokens=total_loss, layouts=cost_model.layouts,
                               tp=tp, sequence_parallel=shards > 1) if r in wanted else []
                 for r in range(dp)]
    for r, rep in enumerate(plans):
        densities = [None if mb.attention is None else mb.attention.to_json() for mb in result.micro_batches[r]]
        if any(d is not None for d in densities):
            # Per-sample rows: what the executor's activation plan prices them at (a plan's
            # micro-batches are its replica's, in order).
            for p in rep:
                p.meta["attention_density"] = densities
    placement = cost_model.placement
    if placement != StagePlacement.even(cost_model.model, cost_model.num_stages):
        # The model stages must hold the layers the plan was priced for; an absent key
        # means Megatron's even split.
        for p in (p for rep in plans for p in rep):
            p.meta["placement"] = placement.to_json()
    t2, c2 = time.perf_counter(), time.process_time()
    timings = {"batching": batch_plan.planning_ms, "schedule": (t1 - t0) * 1e3, "compile": (t2 - t1) * 1e3}
    cpu = {"schedule": (c1 - c0) * 1e3, "compile": (c2 - c1) * 1e3}
    out = IterationPlan(batch_plan, result, plans, iteration, timings, cpu)
    if validate:
        validate_plans(out.all_plans(), complete=replicas is None)
        timings["validate"] = (time.perf_counter() - t2) * 1e3
        cpu["validate"] = (time.process_time() - c2) * 1e3
    return out


def _search(batch_plan: BatchPlan, cost_model: CostModel, *, schedule: str, memory_limit_mib: Optional[float],
            reserved_mib: Optional[float], cluster: Optional[ClusterConfig], recompute: Optional[str], tp: int,
            zero: bool, explain: bool, lengths, split_backward: bool = True,
            must_beat_ms: Optional[float] = None) -> tuple[BatchPlan, SearchResult]:
    """The schedule search of :func:`schedule_batch_plan`: the batch plan as the executor
    will run it (loss tokens, sequence-parallel rounding) and the search's result
    (``must_beat_ms``: see :func:`search_schedules`)."""
    limit, reserved = _default_memory(cost_model, memory_limit_mib, reserved_mib)
    capacity = None if limit is None or not np.isfinite(limit) else limit - reserved
    batch_plan = _loss_tokens(batch_plan, lengths, cost_model)
    shards = sequence_shards_of(cost_model)
    batch_plan = round_for_sequence_parallel(batch_plan, shards, cost_model.model.max_seq_length)
    dp = batch_plan.dp
    # batch_plan.replica(r) for every r, in one pass over the micro-batches.
    replica_batches: list[list] = [[] for _ in range(dp)]
    for mb in batch_plan.micro_batches:
        if not 0 <= mb.replica < dp:
            # Dropping it would lose its samples and still count its loss tokens in the normaliser.
            raise DynaPipeError(f"micro-batch of samples {list(mb.samples)[:8]} is assigned to replica {mb.replica}, "
                                f"outside 0..{dp - 1} (dp {dp}); assign every micro-batch a replica of the plan.")
        replica_batches[mb.replica].append(mb)
    result = search_schedules(replica_batches, cost_model, schedule=schedule, recompute=recompute,
                              capacity_mib=capacity, cluster=cluster, dp=dp, tp=tp, zero=zero, explain=explain,
                              batching=batch_plan.batching, split_backward=split_backward,
                              must_beat_ms=must_beat_ms)
    return batch_plan, result


@without_gc_pauses
def plan_iteration(lengths, cost_model: CostModel, *, stages: Optional[int] = None, dp: int = 1,
                   method: str = "dynapipe", schedule: str = "auto", memory_limit_mib: Optional[float] = None,
                   reserved_mib: Optional[float] = None, cluster: Optional[ClusterConfig] = None,
                   recompute: Optional[str] = None, iteration: int = 0, micro_batch_size: int = 1,
                   seq_length: Optional[LengthLimit] = None, max_tokens: Optional[int] = None, tp: Optional[int] = None,
                   zero: bool = False, explain: bool = False, validate: bool = False,
                   replicas: Optional[Sequence[int]] = None, gap: float = DEFAULT_GAP,
                   split_backward: bool = True) -> IterationPlan:
    """Plan one iteration of a global batch of sample ``lengths`` (tokens; ``(n, 2)``
    input and target lengths for encoder-decoder models).

    Micro-batching (``method``, see :func:`dynapipe.batching.plan_micro_batches`), then
    the schedule search (``schedule``: ``1f1b``, ``adaptive``, ``zb-h1`` or ``auto``), then one
    execution plan per (replica, stage). ``stages`` must match the cost model.
    ``memory_limit_mib`` (per device) and ``reserved_mib`` default to the device config.
    ``recompute=None`` lets the search choose the level; micro-batches are then cut so
    that each fits alone at the lightest level that lets every sample fit, and, where the
    search then needs full recompute on some stage or the pipeline's fill and drain are long,
    also with room left for the micro-batches in flight (:func:`leave_room_in_flight`); the
    faster cut is kept.
    ``replicas``: compile only these replicas' plans (see :func:`schedule_batch_plan`).
    ``gap``: relative optimality gap of DynaPipe's cut (0: the exact optimum).
    ``split_backward=False``: the stages cannot split their backward (``auto`` then does not
    try ``zb-h1``).
    """
    require_cost_model(cost_model)
    if stages is not None and (not is_whole(stages) or stages != cost_model.num_stages):
        raise DynaPipeError(f"stages {stages!r}: the cost model was built for {cost_model.num_stages} stages; give "
                            f"that whole number or leave stages out.")
    if memory_limit_mib is not None:
        real_number("memory_limit_mib", memory_limit_mib, unlimited=True)
    if reserved_mib is not None:
        real_number("reserved_mib", reserved_mib)
    flags(zero=zero, explain=explain, validate=validate, split_backward=split_backward)
    whole_number("iteration", iteration, at_least=0)
    limit, reserved = _default_memory(cost_model, memory_limit_mib, reserved_mib)
    tp = _resolve_tp(tp, cost_model)
    levels = [check_recompute(recompute)] if recompute is not None else list(RECOMPUTE_LEVELS)
    t0, c0 = time.perf_counter(), time.process_time()
    batch_plan, error = None, None
    cut = dict(method=method, dp=dp, memory_limit_mib=limit, reserved_mib=reserved, micro_batch_size=micro_batch_size,
               seq_length=seq_length, max_tokens=max_tokens, zero=zero, gap=gap)
    for level in levels:
        try:
            batch_plan = plan_micro_batches(lengths, cost_model, recompute=level, **cut)
            break
        except DynaPipeError as e:  # a sample too large at this level may fit with more recompute
            error = e
    if batch_plan is None:
        raise error
    batch_plan.planning_ms = (time.perf_counter() - t0) * 1e3
    batching_cpu_ms = (time.process_time() - c0) * 1e3
    search = dict(schedule=schedule, memory_limit_mib=limit, reserved_mib=reserved, cluster=cluster, tp=tp, zero=zero,
                  split_backward=split_backward)
    compile_kw = dict(search, recompute=recompute, iteration=iteration, explain=explain, validate=validate,
                      lengths=lengths, replicas=replicas)
    out = schedule_batch_plan(batch_plan, cost_model, **compile_kw)
    if recompute is None:
        t1, c1 = time.perf_counter(), time.process_time()
        roomier = leave_room_in_flight(lengths, cost_model, planned=batch_plan, level=level,
                                       simulated_ms=out.simulated_ms, stage_recompute=out.stage_recompute,
                                       cut=cut, search=search)
        retry_ms, retry_cpu_ms = (time.perf_counter() - t1) * 1e3, (time.process_time() - c1) * 1e3
        if roomier is not None:
            # The first cut's search and compilation were spent too.
            retry_ms += out.timings_ms["schedule"] + out.timings_ms["compile"]
            retry_cpu_ms += out.cpu_ms["schedule"] + out.cpu_ms["compile"]
            out = schedule_batch_plan(roomier, cost_model, **compile_kw)
        # The cuts and searches tried count as batching time.
        out.timings_ms["batching"] = out.batch_plan.planning_ms = batch_plan.planning_ms + retry_ms
        batching_cpu_ms += retry_cpu_ms
    out.cpu_ms = {"batching": batching_cpu_ms, **out.cpu_ms}
    return out


# The share of a replica's pipeline that fill and drain take, ``(S - 1) / (M + S - 1)`` with ``M``
# micro-batches a replica, from which smaller micro-batches are tried. Below it the steady state
# dominates, and the two tries can cost more than the plan itself (100,000 samples over PP8 x
# DP64, 152 micro-batches a replica: 1.5 s of planning more, for nothing).
FILL_DRAIN_WORTH_A_TRY = 0.10


def leave_room_in_flight(lengths, cost_model: CostModel, *, planned: BatchPlan, level: str, simulated_ms: float,
                         stage_recompute: Sequence[str], cut: dict, search: dict) -> Optional[BatchPlan]:
    """A DynaPipe cut that the schedule search runs faster than the one it planned
    (``planned``, cut at recompute ``level``, simulated at ``simulated_ms`` recomputing
    ``stage_recompute``), with the micro-batches of several samples held to a share of the
    activation budget; ``None`` if none is, or if nothing needs it.

    The DP prices a cut by ``sum(t) / dp + (S - 1) max(t)`` and fits each micro-batch in
    memory alone, but a pipeline holds several at once (1F1B: up to ``S`` on its first
    stage): under a tight limit the search makes room with recompute the cut was not priced
    for (``level``), or with a schedule that holds fewer micro-batches in flight and idles
    more. Smaller micro-batches then run faster (17% on one gpt-13b PP8 x DP2 batch at cluster
    scale). So where the search fell back to full recompute on some stage, or where the
    pipeline's fill and drain take at least :data:`FILL_DRAIN_WORTH_A_TRY` of it, the shares
    ``1/2`` and ``1/S`` are tried (for ``cut["method"] == "dynapipe"``): each one more DP cut (``cut``:
    :func:`plan_micro_batches`'s arguments) and a search (``search``:
    :func:`schedule_batch_plan`'s ``schedule``, memory, ``cluster``, ``tp``, ``zero``) that
    abandons every candidate as soon as it falls behind the best makespan so far. A share
    that cuts the same micro-batches as ``planned`` (or as the share before) is not searched
    again. ``extra["micro_batch_share"]`` of the result says which share won."""
    stages = cost_model.num_stages
    fell_back = level != "full" and "full" in stage_recompute
    if stages < 2 or cut.get("method", "dynapipe") not in DP_METHODS:
        return None
    per_replica = len(planned.micro_batches) / max(planned.dp, 1)
    if not fell_back and (stages - 1) / (per_replica + stages - 1) < FILL_DRAIN_WORTH_A_TRY:
        return None
    seen = {_cut_key(planned)}
    # Priced on the links schedule_batch_plan priced ``simulated_ms`` on (the cost model's TP size).
    search = {**search, "tp": _tp_size(cost_model)}
    best, best_ms = None, simulated_ms
    for share in sorted({0.5, 1.0 / stages}, reverse=True):
        try:  # a share too small for some sample, or a cut no schedule fits: not a candidate
            candidate = plan_micro_batches(lengths, cost_model, recompute=level, micro_batch_share=share, **cut)
            key = _cut_key(candidate)
            if key in seen:
                continue
            seen.add(key)
            _, result = _search(candidate, cost_model, recompute=None, explain=False, lengths=lengths,
                                must_beat_ms=best_ms, **search)
        except DynaPipeError:
            continue
        if result.best.makespan_ms < best_ms:
            best, best_ms = candidate, result.best.makespan_ms
    return best


def _cut_key(batch_plan: BatchPlan) -> tuple:
    """The micro-batches of a cut as a hashable value (samples and replica of each)."""
    return tuple((mb.replica, tuple(int(i) for i in mb.samples)) for mb in batch_plan.micro_batches)
