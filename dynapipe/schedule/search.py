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
turns the shortcuts off so every candidate gets its exact figures.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import numpy as np

from dynapipe.batching.types import MicroBatch
from dynapipe.config import ClusterConfig
from dynapipe.cost.base import RECOMPUTE_LEVELS, CostModel, check_recompute
from dynapipe.errors import DynaPipeError, NoScheduleFits, real_number, whole_number
from dynapipe.schedule import _kernels as K
from dynapipe.schedule.adaptive import adaptive_arrays, schedule_from_arrays
from dynapipe.schedule.costs import StageTimes, stage_times_per_replica
from dynapipe.schedule.interleaved import (INTERLEAVED, chunk_count, chunked_inputs,
                                           chunked_split_kernel, interleaved_arrays, schedule_from_chunked_arrays,
                                           virtual_stage_times_per_replica)
from dynapipe.schedule.interleaved_adaptive import INTERLEAVED_ADAPTIVE, interleaved_adaptive_orders
from dynapipe.schedule.interleaved_zb import INTERLEAVED_ZB, interleaved_zb_arrays, max_delay_cap
from dynapipe.schedule.one_f_one_b import one_f_one_b, one_f_one_b_arrays
from dynapipe.schedule.orders import ORDERS
from dynapipe.schedule.recompute_policy import per_stage_policies
from dynapipe.schedule.simulator import Timeline, kernel_inputs, simulate, split_inputs
from dynapipe.schedule.types import CHUNKED_SCHEDULE_NAMES, SCHEDULE_NAMES, SPLIT_BACKWARD_SCHEDULE_NAMES, Schedule
from dynapipe.schedule.zero_bubble import ZB_H1, zb_h1, zb_h1_arrays

# Every --schedule value. ``auto`` tries SCHEDULE_NAMES and, where the run can split the
# backward, the split-backward schedules (on chunked placements: the chunked ones, of which
# interleaved-zb splits the backward).
SCHEDULE_CHOICES = SCHEDULE_NAMES + SPLIT_BACKWARD_SCHEDULE_NAMES + CHUNKED_SCHEDULE_NAMES + ("auto",)
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
            "padding": "a smaller --micro-batch-size", "padding-mb": "a smaller --micro-batch-size",
            "packing": "a smaller --micro-batch-size (fewer rows)",
            "packing-per-sample": "a smaller --micro-batch-size (fewer rows)",
            "token-budget": "a smaller --max-tokens",
            None: "a lower memory limit for batching, a smaller --micro-batch-size or --max-tokens"}


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
    if schedule not in SCHEDULE_CHOICES:
        raise DynaPipeError(f"--schedule {schedule!r} is not known; use one of {', '.join(SCHEDULE_CHOICES)}.")
    if not split_backward and schedule in (ZB_H1, INTERLEAVED_ZB):
        raise DynaPipeError(f"--schedule {schedule} splits every backward, and the stages cannot split theirs "
                            f"(--no-split-backward, split_backward=False); drop one of them (auto then searches "
                            f"the other schedules).")
    chunks = chunk_count(cost_model)
    # On a chunked placement 1F1B is Megatron's interleaved 1F1B, adaptive the adaptive
    # interleaved order and zb-h1 interleaved-zb, as training's --dynapipe-schedule reads them.
    if chunks == 1 and schedule in CHUNKED_SCHEDULE_NAMES:
        use = ", ".join(CHUNKED_SCHEDULE_NAMES) if chunks > 1 else "1f1b, adaptive or zb-h1"
        raise DynaPipeError(f"--schedule {schedule}: placement {cost_model.placement} has {chunks} chunk(s) per "
                            f"stage; use --schedule {use} or auto.")
    if chunks > 1:
        auto = [INTERLEAVED, INTERLEAVED_ADAPTIVE] + ([INTERLEAVED_ZB] if split_backward else [])
        names = {"auto": auto, INTERLEAVED_ADAPTIVE: [INTERLEAVED_ADAPTIVE], "adaptive": [INTERLEAVED_ADAPTIVE],
                 INTERLEAVED_ZB: [INTERLEAVED_ZB], ZB_H1: [INTERLEAVED_ZB]}.get(schedule, [INTERLEAVED])
    elif schedule == "auto":
        names = list(SCHEDULE_NAMES) + (list(SPLIT_BACKWARD_SCHEDULE_NAMES) if split_backward else [])
    else:
        names = [schedule]
    order_names = list(orders) if orders else (list(ORDERS) if schedule == "auto" else ["planned"])
    for o in order_names:
        if o not in ORDERS:
            raise DynaPipeError(f"micro-batch order {o!r} is not known; use one of {sorted(ORDERS)}.")
    if recompute is None:
        levels = list(RECOMPUTE_LEVELS)
    elif isinstance(recompute, str):
        levels = [check_recompute(recompute)]
    else:
        levels = [check_recompute(r) for r in recompute]
        if not levels:
            raise DynaPipeError("no recompute level to try; give at least one of none, selective, full.")
    shape_hint = "give one list of micro-batches per data-parallel replica ([[mb, ...], ...]; one replica: " \
                 "[micro_batches])"
    try:
        if isinstance(replicas, (str, bytes)):
            raise TypeError
        # Materialised before any check: one that iterates an iterator of replicas consumes it.
        replicas = list(replicas)
        if any(isinstance(r, (MicroBatch, str, bytes)) for r in replicas):
            raise TypeError
        replicas = [list(r) for r in replicas]
    except TypeError:  # not a list of lists (a flat list of micro-batches, a number)
        raise DynaPipeError(f"replicas: {shape_hint}.") from None
    odd = next((x for r in replicas for x in r if not isinstance(x, MicroBatch)), None)
    if odd is not None:
        raise DynaPipeError(f"replicas: {type(odd).__name__} {odd!r:.40} is not a MicroBatch; {shape_hint}.")
    if not any(replicas):
        raise DynaPipeError("there are no micro-batches to schedule.")
    if dp is not None and whole_number("dp", dp) != len(replicas):
        raise DynaPipeError(f"dp {dp}: {len(replicas)} replica list(s) were given; give one list per replica.")
    dp = dp or len(replicas)
    whole_number("tp", tp)
    if cluster is not None:
        if not isinstance(cluster, ClusterConfig):
            raise DynaPipeError(f"cluster {cluster!r}: give a ClusterConfig "
                                f"(dynapipe.config.load_cluster_config(name)).")
        cluster.validate(f"cluster {cluster.name!r}")
    if capacity_mib is not None:
        real_number("capacity_mib", capacity_mib, unlimited=True)
    if must_beat_ms is not None:
        real_number("must_beat_ms", must_beat_ms, unlimited=True)
    per_stage = (schedule == "auto") if per_stage is None else per_stage
    S = cost_model.num_stages
    cap_mib = np.inf if capacity_mib is None else float(capacity_mib)
    capacity = np.full(S, cap_mib)

    candidates: list[Candidate] = []
    best: Optional[tuple] = None
    to_beat = np.inf if must_beat_ms is None or explain else float(must_beat_ms)

    def bar_ms() -> float:
        """The makespan (ms) a candidate must beat: the best so far, else ``must_beat_ms``."""
        return best[0].makespan_ms if best is not None else to_beat

    def evaluate(name, level, mix, o, permuted, abort_ms, abort_mib):
        if name not in _DELAYED:
            return evaluate_once(name, level, mix, o, permuted, abort_ms, abort_mib)
        # Pending weight parts hold memory, and the cap on the weight delays also reorders ops:
        # a smaller cap can both fit and run faster than a larger one, so every cap is tried,
        # the largest first (it leaves the schedule's own delays; k = 0 holds what (interleaved)
        # 1F1B holds, but for full recompute's weight stashes: there it may not fit where 1F1B
        # does). The fastest that fits is kept, ties to the larger cap; each try after one that
        # fits need only beat it, so most stop early. Nothing fitting: the last refusal.
        kept = slower = last = None
        for k in range((max_delay_cap(S) if name == INTERLEAVED_ZB else S - 1), -1, -1):
            bar = abort_ms if kept is None else min(abort_ms, kept[0].makespan_ms)
            last = evaluate_once(name, level, mix, o, permuted, bar, abort_mib, k)
            if last[0].status == FITS and (kept is None or last[0].makespan_ms < kept[0].makespan_ms):
                kept = last
            elif kept is None and last[0].status == SLOWER:
                slower = last
        return kept or slower or last

    def evaluate_once(name, level, mix, o, permuted, abort_ms, abort_mib, max_delay=None):
        # The makespan is the slowest replica's, so one replica that aborts (slower than
        # the best candidate, or over memory) decides the candidate: the heaviest replicas
        # run first and the rest are not simulated. A candidate both slower and over memory
        # is labelled by whichever its first aborting replica hit.
        runs = [None] * len(permuted)
        for i in heavy_first(permuted):
            runs[i] = _run(name, permuted[i], capacity, abort_ms, abort_mib, max_delay)
            if runs[i][0] == K.OVER:
                return Candidate(name, o, level, OVER_MEMORY, np.nan, stage_recompute=mix, max_delay=max_delay), runs
            if runs[i][0] == K.SLOW:
                return Candidate(name, o, level, SLOWER, np.nan, stage_recompute=mix, max_delay=max_delay), runs
        makespan = max(float(r[5].max()) if r[5].size else 0.0 for r in runs)
        peak = tuple(float(max(r[7][s] for r in runs)) for s in range(S))
        busy = sum(float(r[6].sum()) for r in runs)
        bubble = 1.0 - busy / (len(runs) * S * makespan) if makespan > 0 else 0.0
        status = FITS if max(peak) <= cap_mib else OVER_MEMORY
        return Candidate(name, o, level, status, makespan, bubble, peak, mix, max_delay), runs

    evaluated = []
    pricer = virtual_stage_times_per_replica if chunks > 1 else stage_times_per_replica
    level_times = {lv: pricer(cost_model, replicas, recompute=lv, cluster=cluster, dp=dp, tp=tp, zero=zero)
                   for lv in levels}
    weights = [(t.fw_ms + t.bw_ms).sum(axis=0) for t in level_times[levels[0]]]
    for o in order_names:
        perms = [tuple(ORDERS[o](w)) for w in weights]
        by_level = {lv: [t.permuted(p) for t, p in zip(level_times[lv], perms)] for lv in levels}
        # One level per virtual stage (chunk-major, k = c * P + s), per-chunk mixes and uniform alike.
        policies = [(lv, (lv,) * (S * chunks), by_level[lv], names) for lv in levels]
        if per_stage and len(levels) > 1 and capacity_mib is not None:
            policies[1:1] = per_stage_policies(by_level, levels, cap_mib, names, chunks, len(replicas))
        for label, mix, permuted, policy_names in policies:
            bound = max(t.work_lower_bound_ms() for t in permuted)
            if not explain and bound >= bar_ms():
                candidates.extend(Candidate(n, o, label, SKIPPED, bound, stage_recompute=mix) for n in policy_names)
                continue
            for name in policy_names:
                abort_ms = np.inf if explain else bar_ms()
                cand, runs = evaluate(name, label, mix, o, permuted, abort_ms, np.inf if explain else cap_mib)
                candidates.append(cand)
                evaluated.append((name, label, mix, o, permuted))
                if cand.fits and faster(cand.makespan_ms, bar_ms()):
                    best = (cand, runs, permuted, perms)
    if best is None and np.isfinite(to_beat):
        raise NoScheduleFits(f"no schedule of these micro-batches fits and runs faster than {to_beat:.1f} ms.")
    if best is None:
        # Nothing fits: simulate every candidate in full to name the closest one.
        full = [evaluate(n, lv, mix, o, pm, np.inf, np.inf)[0] for n, lv, mix, o, pm in evaluated]
        c = min(full, key=lambda x: max(x.peak_mib))
        worst = int(np.argmax(c.peak_mib))
        raise NoScheduleFits(
            f"no schedule fits in {cap_mib:.0f} MiB per stage: the closest candidate ({c.schedule}, {c.order} "
            f"order, recompute {c.recompute}) needs {c.peak_mib[worst]:.0f} MiB on stage {worst}, "
            f"{c.peak_mib[worst] - cap_mib:.0f} MiB over the limit. Raise --memory-limit-mb, use more pipeline "
            f"stages, or plan smaller micro-batches ({_SMALLER.get(batching, _SMALLER[None])}).")
    cand, runs, permuted, perms = best
    schedules, timelines = [], []
    for r, t, p in zip(runs, permuted, perms):
        if cand.schedule in _CHUNKED:
            # The run's op arrays are the schedule's ops, whichever chunked order made them.
            meta = {} if cand.max_delay is None else {"max_delay": int(cand.max_delay)}
            sched = schedule_from_chunked_arrays(cand.schedule, r[1], r[2], r[8], r[3], chunks=chunks,
                                                 recompute=cand.recompute, order=cand.order, mb_order=p,
                                                 stage_recompute=cand.stage_recompute, meta=meta)
            schedules.append(sched)
            timelines.append(simulate(sched, t, record_memory=True, arrays=(r[1], r[2], r[8], r[3])))
            continue
        if cand.schedule in _FIXED_ORDERS:
            kwargs = {"max_delay": cand.max_delay} if cand.schedule == ZB_H1 else {}
            build = zb_h1 if cand.schedule == ZB_H1 else one_f_one_b
            sched = build(S, t.num_micro_batches, recompute=cand.recompute, order=cand.order, mb_order=p,
                          stage_recompute=cand.stage_recompute, **kwargs)
        else:
            sched = schedule_from_arrays(cand.schedule, r[1], r[2], r[3], recompute=cand.recompute,
                                         order=cand.order, mb_order=p, stage_recompute=cand.stage_recompute)
        schedules.append(sched)
        # The run's op arrays are the schedule's ops (it was built from them), so the
        # timeline is re-simulated without reading the ops back.
        timelines.append(simulate(sched, t, record_memory=True, arrays=(r[1], r[2], r[3])))
    ordered = [[replicas[r][i] for i in p] for r, p in enumerate(perms)]
    return SearchResult(cand, schedules, ordered, timelines, permuted, candidates)
