"""Schedule search: simulate candidate schedules and keep the fastest that fits.

Candidates are schedules (``1f1b``, ``adaptive`` and ``zb-h1``, which splits the backward,
unless the run cannot split it; on a placement with virtual-pipeline chunks ``interleaved``,
``interleaved-adaptive`` and, unless the run cannot split its backward, ``interleaved-zb``,
with a recompute level per chunk) x micro-batch orders
(:mod:`dynapipe.schedule.orders`) x recompute levels (none, selective, full, and for
``auto`` a per-stage mix: stages that hold fewer micro-batches in flight recompute less,
worked out for each schedule's op order). Every
data-parallel replica runs the same candidate on its own micro-batches; a candidate's
makespan is the slowest replica's and its peak memory per stage the highest over
replicas. Two shortcuts keep the search fast without changing its answer: a recompute
level whose work lower bound (the busiest stage's total compute) cannot beat the best
fitting candidate found so far is skipped, and a simulation stops as soon as an op ends
later than the best makespan so far or a stage exceeds the capacity. ``explain=True``
turns the shortcuts off so every candidate gets its exact figures. What a search tries, and
the checks of its arguments, are resolved in :mod:`dynapipe.schedule.search_space`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NoReturn, Optional, Sequence, Union

import numpy as np

from dynapipe.batching.types import MicroBatch
from dynapipe.config import ClusterConfig
from dynapipe.cost.base import CostModel
from dynapipe.errors import DynaPipeError, NoScheduleFits, arg, flag, flags
from dynapipe.schedule import _kernels as K
from dynapipe.schedule.adaptive import adaptive_arrays, schedule_from_arrays
from dynapipe.schedule.costs import StageTimes, stage_times_per_replica
from dynapipe.schedule.interleaved import (INTERLEAVED, chunked_inputs, chunked_split_kernel, interleaved_arrays,
                                           schedule_from_chunked_arrays, virtual_stage_times_per_replica)
from dynapipe.schedule.interleaved_adaptive import INTERLEAVED_ADAPTIVE, interleaved_adaptive_orders
from dynapipe.schedule.interleaved_zb import INTERLEAVED_ZB, interleaved_zb_arrays, max_delay_cap
from dynapipe.schedule.one_f_one_b import one_f_one_b, one_f_one_b_arrays
from dynapipe.schedule.orders import ORDERS
from dynapipe.schedule.search_space import (SCHEDULE_CHOICES, SearchSpace, checked_options, checked_replicas,
                                            order_names, recompute_levels, recompute_policies, schedule_names)
from dynapipe.schedule.simulator import Timeline, kernel_inputs, simulate, split_inputs
from dynapipe.schedule.types import Schedule
from dynapipe.schedule.zero_bubble import ZB_H1, zb_h1, zb_h1_arrays

# SCHEDULE_CHOICES (every --schedule value) lives with the argument checks and is read from here.
__all__ = ["SCHEDULE_CHOICES", "Candidate", "SearchResult", "search_schedules", "faster", "heavy_first",
           "TIE_MARGIN", "FITS", "OVER_MEMORY", "SLOWER", "SKIPPED"]
# Fixed op orders the search simulates, by name: (kind, mb, nops) arrays of (stages, micro-batches).
_FIXED_ORDERS = {"1f1b": one_f_one_b_arrays, ZB_H1: zb_h1_arrays}
# Candidate outcomes.
FITS, OVER_MEMORY, SLOWER, SKIPPED = "fits", "over-memory", "slower", "skipped"
# Schedules whose pending weight parts the search caps (max_delay) until they fit.
_DELAYED = (ZB_H1, INTERLEAVED_ZB)
_CHUNKED = (INTERLEAVED, INTERLEAVED_ADAPTIVE, INTERLEAVED_ZB)


@dataclass(frozen=True)
class Candidate:
    """One candidate of the search.

    ``recompute``: a level for every stage, or ``per-stage`` with the levels in
    ``stage_recompute`` (one per stage; on a chunked placement one per virtual stage,
    chunk-major: ``k = c * P + s``). ``status``: ``fits``; ``over-memory`` (a stage exceeds the capacity); ``slower``
    (stopped once it could no longer beat the best); ``skipped`` (its recompute level's
    work lower bound, given as ``makespan_ms``, could not beat the best). Exact figures
    for ``fits`` (and for everything when the search ran with ``explain=True``).
    """

    schedule: str
    order: str
    recompute: str
    status: str
    makespan_ms: float
    bubble_fraction: float = 0.0
    peak_mib: tuple[float, ...] = ()
    stage_recompute: tuple[str, ...] = ()
    max_delay: Optional[int] = None  # zb-h1, interleaved-zb: the cap on the weight delays that fitted

    @property
    def fits(self) -> bool:
        return self.status == FITS

    def to_json(self) -> dict:
        return {"schedule": self.schedule, "order": self.order, "recompute": self.recompute,
                "status": self.status, "simulated_ms": round(self.makespan_ms, 3),
                "bubble_fraction": round(self.bubble_fraction, 4),
                "stage_peak_mib": [round(p, 1) for p in self.peak_mib],
                "stage_recompute": list(self.stage_recompute),
                **({} if self.max_delay is None else {"max_delay": self.max_delay})}


@dataclass
class SearchResult:
    """The chosen candidate, per replica: its schedule, its micro-batches in the order the
    schedule indexes them, and its timeline (with memory over time); every candidate."""

    best: Candidate
    schedules: list[Schedule]
    micro_batches: list[list[MicroBatch]]
    timelines: list[Timeline]
    times: list[StageTimes]
    candidates: list[Candidate] = field(default_factory=list)

    @property
    def makespan_ms(self) -> float:
        return self.best.makespan_ms

    @property
    def stage_peak_mib(self) -> list[float]:
        return list(self.best.peak_mib)


def _interleaved_run(times: StageTimes, P: int, capacity: np.ndarray, abort_ms: float, abort_mib: float):
    """:func:`_run` of interleaved 1F1B: the micro-batch groups with the remainder of ``M / P``
    spread (fewer slots), or, when those do not fit ``capacity`` (MiB a rank), Megatron's
    groups of ``P``, whose warm-up holds fewer forwards (8 ranks x 2 chunks, 15 uniform
    micro-batches: 23 chunk activations at the peak against 30)."""
    V, M = times.num_stages, times.num_micro_batches
    out = None
    for spread in ((True, False) if M % P else (True,)):
        kind, mb, ch, nops = interleaved_arrays(P, V // P, M, spread)
        out = chunked_split_kernel(kind, mb, ch, nops, *chunked_inputs(times), abort_ms, abort_mib)
        if out[0] == K.STUCK:
            raise DynaPipeError(f"{INTERLEAVED} could not be simulated (internal error, please report).")
        if out[0] != K.OVER and not np.any(out[4] > float(np.min(capacity))):
            break
    return (out[0], kind, mb, nops) + tuple(out[1:5]) + (ch,)


def _run(name: str, times: StageTimes, capacity: np.ndarray, abort_ms: float, abort_mib: float,
         max_delay: Optional[int] = None):
    """One replica, one candidate: ``(status, kind, mb, nops, starts, ends, busy, peak, chunk)``
    (``chunk``: the op chunks of an interleaved schedule, else None; ``max_delay``: the cap on
    zb-h1's or interleaved-zb's weight delays)."""
    S, M = times.num_stages, times.num_micro_batches
    if name in _CHUNKED:
        P = len(times.state_mib)
        if name == INTERLEAVED:
            return _interleaved_run(times, P, capacity, abort_ms, abort_mib)
        elif name == INTERLEAVED_ZB:
            kind, mb, ch, nops = interleaved_zb_arrays(P, S // P, M, max_delay)
        else:
            kind, mb, ch, nops = interleaved_adaptive_orders(times, P, float(np.min(capacity)))
        out = chunked_split_kernel(kind, mb, ch, nops, *chunked_inputs(times), abort_ms, abort_mib)
        if out[0] == K.STUCK:
            raise DynaPipeError(f"{name} could not be simulated (internal error, please report).")
        return (out[0], kind, mb, nops) + tuple(out[1:5]) + (ch,)
    if name in _FIXED_ORDERS:
        kind, mb, nops = zb_h1_arrays(S, M, max_delay) if name == ZB_H1 else _FIXED_ORDERS[name](S, M)
        status, starts, ends, busy, peak, _ = K.simulate_split_kernel(kind, mb, nops, *kernel_inputs(times),
                                                                      *split_inputs(times), abort_ms, abort_mib)
        if status == K.STUCK:
            raise DynaPipeError(f"{name} could not be simulated (internal error, please report).")
    else:
        status, kind, mb, starts, ends, busy, peak = adaptive_arrays(times, capacity, abort_ms=abort_ms,
                                                                     abort_mib=abort_mib)
        nops = np.full(S, 2 * M, dtype=np.int64)
        if status == K.STUCK:
            raise DynaPipeError("the adaptive schedule stalled (internal error, please report).")
    return status, kind, mb, nops, starts, ends, busy, peak, None


# Relative margin a later candidate must win by. Equal schedules differ by float rounding of their
# sums (one stage: zb-h1's split backward added up 3e-13 ms below 1F1B's and was chosen, though it
# fills no bubble and costs the executor a second backward call per micro-batch), so a tie keeps the
# candidate searched first: orders outermost (planned first), then recompute policies, then
# schedules (1F1B before adaptive before zb-h1).
TIE_MARGIN = 1e-9


def faster(ms: float, than_ms: float) -> bool:
    """Whether a makespan (ms) beats another by more than rounding (:data:`TIE_MARGIN`)."""
    return ms < than_ms * (1.0 - TIE_MARGIN)


def heavy_first(times: Sequence[StageTimes]) -> list[int]:
    """Replica indices by descending work lower bound (ms), ties in replica order."""
    bounds = np.array([t.work_lower_bound_ms() for t in times])
    return np.argsort(-bounds, kind="stable").tolist()


# How each batching method is told to cut smaller micro-batches (None: method unknown).
_SMALLER = {"dynapipe": "a lower memory limit for batching",
            "dynapipe-per-sample": "a lower memory limit for batching",
            "padding": "a smaller {micro_batch_size}", "padding-mb": "a smaller {micro_batch_size}",
            "packing": "a smaller {micro_batch_size} (fewer rows)",
            "packing-per-sample": "a smaller {micro_batch_size} (fewer rows)",
            "token-budget": "a smaller {max_tokens}",
            None: "a lower memory limit for batching, a smaller {micro_batch_size} or {max_tokens}"}


@dataclass
class _Tally:
    """What the search has met so far: every candidate in search order, what each simulated
    one was (schedule, recompute label, per-stage mix, order, permuted times), and the best
    fitting one as ``(candidate, runs, permuted times, micro-batch orders)``, else None.
    ``to_beat``: the makespan (ms) a candidate must beat before any fits (inf: none)."""

    to_beat: float
    candidates: list[Candidate] = field(default_factory=list)
    evaluated: list[tuple] = field(default_factory=list)
    best: Optional[tuple] = None

    def bar_ms(self) -> float:
        """The makespan (ms) a candidate must beat: the best so far, else ``to_beat``."""
        return self.best[0].makespan_ms if self.best is not None else self.to_beat


def _price(space: SearchSpace, cost_model: CostModel, replicas: list[list[MicroBatch]], *,
           cluster: Optional[ClusterConfig], dp: int, tp: int, zero: bool) -> dict:
    """Every replica's stage times (ms, MiB) under each recompute level of ``space``, by level
    (on a chunked placement one row per virtual stage)."""
    pricer = virtual_stage_times_per_replica if space.chunks > 1 else stage_times_per_replica
    return {lv: pricer(cost_model, replicas, recompute=lv, cluster=cluster, dp=dp, tp=tp, zero=zero)
            for lv in space.levels}


def _simulate_once(space: SearchSpace, name: str, level: str, mix: tuple, order: str, permuted: list,
                   abort_ms: float, abort_mib: float, max_delay: Optional[int] = None) -> tuple:
    """``(candidate, runs)`` of one schedule on every replica's ``permuted`` times: makespan
    (ms) of the slowest replica, peak (MiB) per stage the highest over replicas. A simulation
    stops once an op ends after ``abort_ms`` or a stage exceeds ``abort_mib``."""
    # The makespan is the slowest replica's, so one replica that aborts (slower than
    # the best candidate, or over memory) decides the candidate: the heaviest replicas
    # run first and the rest are not simulated. A candidate both slower and over memory
    # is labelled by whichever its first aborting replica hit.
    S = space.num_stages
    runs = [None] * len(permuted)
    for i in heavy_first(permuted):
        runs[i] = _run(name, permuted[i], space.capacity, abort_ms, abort_mib, max_delay)
        if runs[i][0] == K.OVER:
            return Candidate(name, order, level, OVER_MEMORY, np.nan, stage_recompute=mix, max_delay=max_delay), runs
        if runs[i][0] == K.SLOW:
            return Candidate(name, order, level, SLOWER, np.nan, stage_recompute=mix, max_delay=max_delay), runs
    makespan = max(float(r[5].max()) if r[5].size else 0.0 for r in runs)
    peak = tuple(float(max(r[7][s] for r in runs)) for s in range(S))
    busy = sum(float(r[6].sum()) for r in runs)
    bubble = 1.0 - busy / (len(runs) * S * makespan) if makespan > 0 else 0.0
    status = FITS if max(peak) <= space.cap_mib else OVER_MEMORY
    return Candidate(name, order, level, status, makespan, bubble, peak, mix, max_delay), runs


def _simulate(space: SearchSpace, name: str, level: str, mix: tuple, order: str, permuted: list,
              abort_ms: float, abort_mib: float) -> tuple:
    """``(candidate, runs)`` of one candidate (:func:`_simulate_once`; limits in ms and MiB); for
    zb-h1 and interleaved-zb the fastest cap on the weight delays that fits."""
    if name not in _DELAYED:
        return _simulate_once(space, name, level, mix, order, permuted, abort_ms, abort_mib)
    # Pending weight parts hold memory, and the cap on the weight delays also reorders ops:
    # a smaller cap can both fit and run faster than a larger one, so every cap is tried,
    # the largest first (it leaves the schedule's own delays; k = 0 holds what (interleaved)
    # 1F1B holds, but for full recompute's weight stashes: there it may not fit where 1F1B
    # does). The fastest that fits is kept, ties to the larger cap; each try after one that
    # fits need only beat it, so most stop early. Nothing fitting: the last refusal.
    S = space.num_stages
    kept = slower = last = None
    for k in range((max_delay_cap(S) if name == INTERLEAVED_ZB else S - 1), -1, -1):
        bar = abort_ms if kept is None else min(abort_ms, kept[0].makespan_ms)
        last = _simulate_once(space, name, level, mix, order, permuted, bar, abort_mib, k)
        if last[0].status == FITS and (kept is None or last[0].makespan_ms < kept[0].makespan_ms):
            kept = last
        elif kept is None and last[0].status == SLOWER:
            slower = last
    return kept or slower or last


def _search_order(space: SearchSpace, tally: _Tally, order: str, level_times: dict, weights: list,
                  num_replicas: int) -> None:
    """Try every recompute policy and schedule on one micro-batch order (``weights``: each
    replica's per-micro-batch work, ms, that orders it), recording each candidate in ``tally``
    and keeping the fastest that fits. A policy whose work lower bound (ms) cannot beat the bar
    is skipped unsimulated; a candidate replaces the best only when :func:`faster`."""
    perms = [tuple(ORDERS[order](w)) for w in weights]
    for label, mix, permuted, names in recompute_policies(space, level_times, perms, num_replicas):
        bound = max(t.work_lower_bound_ms() for t in permuted)
        if not space.explain and bound >= tally.bar_ms():
            tally.candidates.extend(Candidate(n, order, label, SKIPPED, bound, stage_recompute=mix) for n in names)
            continue
        for name in names:
            abort_ms = np.inf if space.explain else tally.bar_ms()
            abort_mib = np.inf if space.explain else space.cap_mib
            cand, runs = _simulate(space, name, label, mix, order, permuted, abort_ms, abort_mib)
            tally.candidates.append(cand)
            tally.evaluated.append((name, label, mix, order, permuted))
            if cand.fits and faster(cand.makespan_ms, tally.bar_ms()):
                tally.best = (cand, runs, permuted, perms)


def _refuse(space: SearchSpace, tally: _Tally, batching: Optional[str]) -> NoReturn:
    """Raise :class:`NoScheduleFits` for a search that kept no candidate: none beat
    ``must_beat_ms`` (ms), or none fits the capacity (MiB), naming the closest candidate (every
    simulated one re-simulated in full) and the flag ``batching`` reads to cut smaller ones."""
    if np.isfinite(tally.to_beat):
        raise NoScheduleFits(f"no schedule of these micro-batches fits and runs faster than {tally.to_beat:.1f} ms.")
    # Nothing fits: simulate every candidate in full to name the closest one.
    full = [_simulate(space, n, lv, mix, o, pm, np.inf, np.inf)[0] for n, lv, mix, o, pm in tally.evaluated]
    c = min(full, key=lambda x: max(x.peak_mib))
    worst = int(np.argmax(c.peak_mib))
    cap_mib = space.cap_mib
    smaller = _SMALLER.get(batching, _SMALLER[None]).format(micro_batch_size=arg("micro_batch_size"),
                                                             max_tokens=arg("max_tokens"))
    raise NoScheduleFits(
        f"no schedule fits in {cap_mib:.0f} MiB per stage: the closest candidate ({c.schedule}, {c.order} "
        f"order, recompute {c.recompute}) needs {c.peak_mib[worst]:.0f} MiB on stage {worst}, "
        f"{c.peak_mib[worst] - cap_mib:.0f} MiB over the limit. Raise {arg('memory_limit_mib', 'the memory limit')}, "
        f"use more pipeline stages, or plan smaller micro-batches ({smaller}).")


def _replica_schedule(space: SearchSpace, cand: Candidate, run: tuple, times: StageTimes,
                      mb_order: tuple) -> tuple[Schedule, Timeline]:
    """One replica's schedule of the chosen candidate, built from its run's op arrays (they are
    the schedule's ops), and its timeline (ms, MiB) re-simulated with memory recorded."""
    if cand.schedule in _CHUNKED:
        # The run's op arrays are the schedule's ops, whichever chunked order made them.
        meta = {} if cand.max_delay is None else {"max_delay": int(cand.max_delay)}
        sched = schedule_from_chunked_arrays(cand.schedule, run[1], run[2], run[8], run[3], chunks=space.chunks,
                                             recompute=cand.recompute, order=cand.order, mb_order=mb_order,
                                             stage_recompute=cand.stage_recompute, meta=meta)
        return sched, simulate(sched, times, record_memory=True, arrays=(run[1], run[2], run[8], run[3]))
    if cand.schedule in _FIXED_ORDERS:
        kwargs = {"max_delay": cand.max_delay} if cand.schedule == ZB_H1 else {}
        build = zb_h1 if cand.schedule == ZB_H1 else one_f_one_b
        sched = build(space.num_stages, times.num_micro_batches, recompute=cand.recompute, order=cand.order,
                      mb_order=mb_order, stage_recompute=cand.stage_recompute, **kwargs)
    else:
        sched = schedule_from_arrays(cand.schedule, run[1], run[2], run[3], recompute=cand.recompute,
                                     order=cand.order, mb_order=mb_order, stage_recompute=cand.stage_recompute)
    # The run's op arrays are the schedule's ops (it was built from them), so the
    # timeline is re-simulated without reading the ops back.
    return sched, simulate(sched, times, record_memory=True, arrays=(run[1], run[2], run[3]))


def _result(space: SearchSpace, tally: _Tally, replicas: list[list[MicroBatch]]) -> SearchResult:
    """The :class:`SearchResult` of the best candidate: every replica's schedule, timeline and
    micro-batches in the order the schedule indexes them, with every candidate met."""
    cand, runs, permuted, perms = tally.best
    schedules, timelines = [], []
    for r, t, p in zip(runs, permuted, perms):
        sched, timeline = _replica_schedule(space, cand, r, t, p)
        schedules.append(sched)
        timelines.append(timeline)
    ordered = [[replicas[r][i] for i in p] for r, p in enumerate(perms)]
    return SearchResult(cand, schedules, ordered, timelines, permuted, tally.candidates)


def search_schedules(replicas: Sequence[Sequence[MicroBatch]], cost_model: CostModel, *,
                     schedule: str = "auto", recompute: Optional[Union[str, Sequence[str]]] = None,
                     capacity_mib: Optional[float] = None, cluster: Optional[ClusterConfig] = None,
                     dp: Optional[int] = None, tp: int = 1, zero: bool = False,
                     orders: Optional[Sequence[str]] = None, explain: bool = False,
                     per_stage: Optional[bool] = None, batching: Optional[str] = None,
                     split_backward: bool = True, must_beat_ms: Optional[float] = None) -> SearchResult:
    """Choose a schedule, micro-batch order and recompute level for every replica.

    ``replicas[r]``: replica ``r``'s micro-batches in the planner's order.
    ``schedule``: ``1f1b``, ``adaptive`` or ``zb-h1`` (that schedule, planned order unless
    ``orders`` is given) or ``auto`` (every schedule of ``SCHEDULE_NAMES``, and ``zb-h1``
    unless ``split_backward`` is False, i.e. the stages cannot split their backward; every
    order). On a placement with virtual-pipeline chunks ``1f1b`` is ``interleaved``, ``zb-h1``
    is ``interleaved-zb``, and ``auto`` tries ``interleaved``, ``interleaved-adaptive`` and
    (unless ``split_backward`` is False) ``interleaved-zb``. ``recompute``: a level,
    a list of levels to try, or ``None`` to try every level. ``capacity_mib``: memory a stage may use, model
    states included (MiB; the device limit minus what the framework reserves; None:
    unbounded). ``per_stage`` (default: on for ``auto``) also tries a per-stage
    recompute level: on each stage the lightest level under which that stage fits with
    the micro-batches in flight of the schedule's op order (1F1B's for ``1f1b`` and
    ``adaptive``, zb-h1's own, which holds weight parts longer; a stage's memory depends
    only on its own costs and its op order). Raises :class:`DynaPipeError` when no candidate fits, naming the
    closest one and by how many MiB it exceeds the capacity; ``batching`` (the method that
    cut the micro-batches) makes its advice name the flag that method reads.
    ``must_beat_ms``: only a candidate faster than this makespan (ms) is wanted, so every
    slower one is abandoned as soon as it falls behind, and when none beats it the error says
    so (cheaply: nothing is re-simulated to name the closest candidate); ignored with
    ``explain``, which simulates every candidate in full.
    """
    flags(zero=zero, explain=explain, split_backward=split_backward)
    if per_stage is not None:
        flag("per_stage", per_stage)
    names, chunks = schedule_names(schedule, split_backward, cost_model)
    orders = order_names(schedule, orders)
    levels = recompute_levels(recompute)
    replicas = checked_replicas(replicas)
    dp = checked_options(replicas, dp=dp, tp=tp, cluster=cluster, capacity_mib=capacity_mib,
                         must_beat_ms=must_beat_ms)
    S = cost_model.num_stages
    cap_mib = np.inf if capacity_mib is None else float(capacity_mib)
    space = SearchSpace(names, orders, levels, chunks, S, cap_mib, np.full(S, cap_mib),
                        per_stage=(schedule == "auto") if per_stage is None else per_stage,
                        bounded=capacity_mib is not None, explain=explain)
    tally = _Tally(to_beat=np.inf if must_beat_ms is None or explain else float(must_beat_ms))
    level_times = _price(space, cost_model, replicas, cluster=cluster, dp=dp, tp=tp, zero=zero)
    weights = [(t.fw_ms + t.bw_ms).sum(axis=0) for t in level_times[levels[0]]]
    for order in orders:
        _search_order(space, tally, order, level_times, weights, len(replicas))
    if tally.best is None:
        _refuse(space, tally, batching)
    return _result(space, tally, replicas)
