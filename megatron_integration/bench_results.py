"""One bench method's figures, from what its ranks reported.

:func:`summarise` turns every rank's summary of one run into a :class:`MethodResult`
(timed iterations only), :func:`median_result` combines the rounds of one method:

* ``real_tokens_per_s``: non-pad tokens (input + target) trained per second;
* ``padding_efficiency``: those tokens / tokens computed (padding included);
* ``iteration_ms``: mean wall time of an iteration (the slowest rank's);
* ``plan_wait_ms``: mean time the training loop waited for its plan, the longest wait of any
  rank in each iteration (0 for the baselines);
* ``schedules``: how many timed iterations ran each pipeline schedule (``auto``'s choices
  under DynaPipe; megatron-core's own for the baselines it schedules);
* ``activation_peak_mib``: per pipeline stage, the highest measured activation peak and
  the highest the plans promised (``planned`` is None for the baselines), over replicas
  and timed iterations (:func:`stage_activation_peaks`).
"""
from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Optional, Sequence

from megatron_integration.bench_report import timed_indices


@dataclass
class MethodResult:
    """One method's figures over the timed iterations of one run (or medians over runs).

    ``real_tokens_per_s``: non-pad tokens (input + target) per second of iteration wall
    time; ``real_tokens``: those tokens of one iteration (the global batch, every replica;
    mean over the timed iterations); ``padding_efficiency``: real / computed tokens; ``iteration_ms``: mean wall
    time of an iteration (the slowest rank's); ``plan_wait_ms``: mean time the training
    loop waited for its plan (each iteration's longest wait over the ranks); ``planner_cpu_ms``: CPU ms of the processes the ranks
    started (DynaPipe's planner workers, summed over ranks) during the timed iterations, per
    plan queued during them (one plan an iteration in a long run);
    ``rank_cpu_ms``: mean CPU ms per iteration of the ranks themselves, summed;
    ``minor_faults`` and ``system_ms``: the ranks' minor page faults and system CPU ms per
    iteration, summed (:func:`memory_faults`; None where the ranks did not record them);
    ``pretouch_s``: the slowest rank's seconds writing its ``--dynapipe-cpu-pretouch-mb``.
    """

    real_tokens_per_s: float
    padding_efficiency: float
    iteration_ms: float
    plan_wait_ms: float
    losses: list[float] = field(default_factory=list)
    timed_iterations: int = 0
    layer_spec: str = ""
    activation_peak_mib: list = field(default_factory=list)  # per stage {"measured", "planned"}
    planner_cpu_ms: Optional[float] = None
    rank_cpu_ms: float = 0.0
    real_tokens: int = 0
    rounds: int = 1
    schedules: dict = field(default_factory=dict)  # schedule -> timed iterations that ran it (all rounds)
    minor_faults: Optional[float] = None
    system_ms: Optional[float] = None
    pretouch_s: Optional[float] = None

    @property
    def planning_overhead(self) -> float:
        """(plan wait + planner CPU) / iteration time: the planning cost inside the timed window,
        counted as if every planner CPU millisecond delayed the iteration."""
        if not self.iteration_ms:
            return 0.0
        return (self.plan_wait_ms + (self.planner_cpu_ms or 0.0)) / self.iteration_ms

    def to_json(self) -> dict:
        return {"real_tokens_per_s": round(self.real_tokens_per_s, 2),
                "padding_efficiency": round(self.padding_efficiency, 4),
                "iteration_ms": round(self.iteration_ms, 2), "plan_wait_ms": round(self.plan_wait_ms, 3),
                "plan_wait_fraction": round(self.plan_wait_ms / self.iteration_ms, 5) if self.iteration_ms else 0.0,
                "planner_cpu_ms": None if self.planner_cpu_ms is None else round(self.planner_cpu_ms, 2),
                "rank_cpu_ms": round(self.rank_cpu_ms, 2),
                "planning_overhead_fraction": round(self.planning_overhead, 5),
                "real_tokens_per_iteration": self.real_tokens, "timed_iterations": self.timed_iterations,
                "rounds": self.rounds, "schedules": self.schedules, "lm_loss": self.losses,
                "layer_spec": self.layer_spec,
                "activation_peak_mib": self.activation_peak_mib,
                "minor_faults": None if self.minor_faults is None else round(self.minor_faults, 1),
                "system_ms": None if self.system_ms is None else round(self.system_ms, 1),
                "pretouch_s": None if self.pretouch_s is None else round(self.pretouch_s, 3)}


def plans_queued_in(keep: Sequence[int], prefetch: int, iterations: int) -> int:
    """Plans the loader queued while the iterations ``keep`` (consecutive, 0-based, of a run of
    ``iterations``) trained: ``prefetch`` ahead of each, none past the run's end, so the last
    ``prefetch - 1`` iterations of a run plan nothing beside them."""
    from dynapipe.runtime.loader import queued_through

    if not keep:
        return 0
    # Prefetch 0 plans each iteration when it is asked for: one plan an iteration, as prefetch 1.
    prefetch = max(prefetch, 1)
    before = queued_through(keep[0] - 1, prefetch, iterations) if keep[0] > 0 else 0
    return queued_through(keep[-1], prefetch, iterations) - before


def memory_faults(ranks: list[dict], keep: Sequence[int]) -> tuple[Optional[float], Optional[float]]:
    """Minor page faults and system CPU ms per iteration of ``keep``, summed over the ranks
    (means over the iterations): where a run pays for memory it touches for the first time.
    ``(None, None)`` where a rank's summary lacks them."""
    if not keep or not all(r.get("minor_faults") and r.get("system_ms") for r in ranks):
        return None, None
    faults = statistics.fmean(sum(r["minor_faults"][i] for r in ranks) for i in keep)
    return faults, statistics.fmean(sum(r["system_ms"][i] for r in ranks) for i in keep)


def summarise(ranks: list[dict], warmup_iters: int, prefetch: int) -> MethodResult:
    """Figures of one method from every rank's summary, iterations after the warm-up;
    ``prefetch``: the loader's ``--dynapipe-prefetch``, which decides how many plans were made
    during them (the planner CPU is reported per plan)."""
    keep = timed_indices(ranks, warmup_iters)
    # An iteration lasts as long as its slowest rank.
    iter_ms = [max(r["iteration_ms"][i] for r in ranks) for i in keep]
    wait_ms = [max(r["plan_wait_ms"][i] for r in ranks) for i in keep]
    real = sum(ranks[0]["real_tokens"][i] for i in keep)
    padded = sum(ranks[0]["padded_tokens"][i] for i in keep)
    children = [r.get("children_cpu_ms") for r in ranks]
    planner = None
    plans = plans_queued_in(keep, prefetch, len(ranks[0]["iteration_ms"]))
    if plans and all(c and all(c[i] is not None for i in keep) for c in children):
        # Per plan, not per timed iteration: the run's last iterations have nothing left to plan
        # beside them, which a mean over iterations would count as free planning.
        planner = sum(c[i] for c in children for i in keep) / plans
    rank_cpu = statistics.fmean(sum(r["cpu_ms"][i] for r in ranks) for i in keep) if "cpu_ms" in ranks[0] else 0.0
    faults, system = memory_faults(ranks, keep)
    return MethodResult(real_tokens_per_s=real / (sum(iter_ms) / 1e3), padding_efficiency=real / max(padded, 1),
                        iteration_ms=statistics.fmean(iter_ms), plan_wait_ms=statistics.fmean(wait_ms),
                        losses=ranks[0]["losses"], timed_iterations=len(keep), layer_spec=ranks[0]["layer_spec"],
                        planner_cpu_ms=planner, rank_cpu_ms=rank_cpu, real_tokens=real // max(len(keep), 1),
                        activation_peak_mib=stage_activation_peaks(ranks, keep),
                        schedules=schedule_counts(ranks[0].get("schedules"), keep), minor_faults=faults,
                        system_ms=system, pretouch_s=pretouch_seconds(ranks))


def pretouch_seconds(ranks: list[dict]) -> Optional[float]:
    """The slowest rank's seconds writing its pre-touched heap (``pretouch_s`` of the rank
    summaries); None where a rank did not record it."""
    seconds = [r.get("pretouch_s") for r in ranks]
    return None if not seconds or None in seconds else max(seconds)


def format_memory_faults(figures: dict, pretouch_mb: int) -> str:
    """One line: each method's minor page faults and system CPU ms per timed iteration (all
    ranks) and the heap its ranks pre-touched at start-up (``--dynapipe-cpu-pretouch-mb``, MiB,
    and the slowest rank's seconds). ``figures``: method -> ``(faults, system_ms, pretouch_s)``;
    methods without faults recorded are left out."""
    parts = []
    for m, (faults, system, seconds) in figures.items():
        if faults is None:
            continue
        heap = "" if not pretouch_mb else (", heap not pre-touched" if not seconds else f", pre-touch {seconds:.2f} s")
        parts.append(f"{m} {faults:,.0f} faults, {system:.0f} ms{heap}")
    if not parts:
        return "memory first touched in the timed iterations: not recorded"
    heap = f"each rank pre-touched {pretouch_mb} MiB of heap at start-up" if pretouch_mb else "no heap pre-touched"
    return (f"memory first touched in the timed iterations (minor page faults and system CPU ms an iteration, all "
            f"ranks; {heap}): " + "; ".join(parts))


def schedule_counts(schedules: Optional[Sequence[str]], keep: Sequence[int]) -> dict[str, int]:
    """``{schedule: iterations}`` over the iterations ``keep`` of one rank's ``schedules``
    (every rank of a run ran the same); empty where the run did not report them."""
    return _most_first(Counter(schedules[i] for i in keep if schedules[i]) if schedules else Counter())


def median_result(runs: list[MethodResult]) -> MethodResult:
    """One method over several rounds: the median of every timing figure (throughput and
    iteration time each on their own), the rest from the first round."""
    if len(runs) == 1:
        return runs[0]
    med = statistics.median
    waits = [r.planner_cpu_ms for r in runs]
    faults, system = [r.minor_faults for r in runs], [r.system_ms for r in runs]
    touched = [r.pretouch_s for r in runs]
    return replace(runs[0], real_tokens_per_s=med(r.real_tokens_per_s for r in runs),
                   iteration_ms=med(r.iteration_ms for r in runs), plan_wait_ms=med(r.plan_wait_ms for r in runs),
                   planner_cpu_ms=None if None in waits else med(waits),
                   rank_cpu_ms=med(r.rank_cpu_ms for r in runs), rounds=len(runs),
                   minor_faults=None if None in faults else med(faults),
                   system_ms=None if None in system else med(system),
                   pretouch_s=None if None in touched else max(touched),
                   schedules=_sum_counts(r.schedules for r in runs))


def _sum_counts(counts) -> dict[str, int]:
    return _most_first(sum((Counter(c) for c in counts), Counter()))


def _most_first(counts: Counter) -> dict[str, int]:
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def stage_activation_peaks(ranks: list[dict], keep: Sequence[int]) -> list[dict]:
    """Per pipeline stage: the highest measured and planned activation peak (MiB) over its
    ranks and the iterations ``keep``; ``planned`` None where no plan promised one."""
    stages: dict[int, dict] = {}
    for r in ranks:
        if "activation_measured_mib" not in r:
            continue
        entry = stages.setdefault(r.get("pp_rank", 0), {"measured": 0.0, "planned": None})
        entry["measured"] = max(entry["measured"], max(r["activation_measured_mib"][i] for i in keep))
        planned = [r["activation_planned_mib"][i] for i in keep if r["activation_planned_mib"][i] is not None]
        if planned:
            entry["planned"] = max(entry["planned"] or 0.0, max(planned))
    return [{"stage": s, "measured": round(e["measured"], 3),
             "planned": None if e["planned"] is None else round(e["planned"], 3)} for s, e in sorted(stages.items())]
