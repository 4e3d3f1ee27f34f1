"""What planning one iteration yields: :class:`IterationPlan`.

:func:`dynapipe.pipeline_planner.plan_iteration` and
:func:`~dynapipe.pipeline_planner.schedule_batch_plan` return it; the loader ships its
per-rank plans and the training step and the command line read its figures.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from dynapipe.batching import BatchPlan
from dynapipe.errors import DynaPipeError
from dynapipe.plan.instructions import ExecutionPlan
from dynapipe.schedule.search import SearchResult
from dynapipe.schedule.simulator import Timeline


@dataclass
class IterationPlan:
    """Everything planned for one iteration.

    ``plans[r][s]``: the plan of replica ``r``'s pipeline rank ``s``. ``timings_ms``: wall
    time of ``batching``, ``schedule`` (search) and ``compile``, and ``validate`` when
    validation ran; ``planning_ms`` is batching + schedule + compile. ``cpu_ms``: the same
    phases in CPU time of the planning process (``time.process_time``), which a loaded
    machine inflates far less than wall time.
    """

    batch_plan: BatchPlan
    search: SearchResult
    plans: list[list[ExecutionPlan]]
    iteration: int = 0
    timings_ms: dict = field(default_factory=dict)
    cpu_ms: dict = field(default_factory=dict)

    @property
    def schedule(self) -> str:
        return self.search.best.schedule

    @property
    def recompute(self) -> str:
        """``none``, ``selective``, ``full`` (every stage), or ``per-stage`` (see :attr:`stage_recompute`)."""
        return self.search.best.recompute

    @property
    def stage_recompute(self) -> list[str]:
        """The recompute level of every stage (on a chunked placement of every virtual stage,
        chunk-major: ``k = c * P + s``)."""
        return list(self.search.best.stage_recompute)

    @property
    def order(self) -> str:
        return self.search.best.order

    @property
    def simulated_ms(self) -> float:
        """Simulated iteration time: the slowest replica's makespan (ms)."""
        return self.search.best.makespan_ms

    @property
    def bubble_fraction(self) -> float:
        """``1 - sum of busy time / (replicas x S x makespan)``."""
        return self.search.best.bubble_fraction

    @property
    def stage_peak_mib(self) -> list[float]:
        """Highest simulated memory of every stage over the replicas, model states included (MiB)."""
        return self.search.stage_peak_mib

    @property
    def timelines(self) -> list[Timeline]:
        return self.search.timelines

    @property
    def planning_ms(self) -> float:
        t = self.timings_ms
        return t.get("batching", 0.0) + t.get("schedule", 0.0) + t.get("compile", 0.0)

    def plan_for(self, replica: int, stage: int) -> ExecutionPlan:
        """The plan of one rank; a replica or stage outside the planned layout is refused
        (a negative index would otherwise pick a plan from the end)."""
        replicas, stages = len(self.plans), self.batch_plan.num_stages
        if not (0 <= replica < replicas and 0 <= stage < stages):
            raise DynaPipeError(f"plan_for({replica}, {stage}): the iteration was planned for replicas 0 to "
                                f"{replicas - 1} and stages 0 to {stages - 1}; ask for a rank in that range.")
        if not self.plans[replica]:  # planned for a subset of the replicas (schedule_batch_plan's replicas)
            held = [r for r, rep in enumerate(self.plans) if rep]
            raise DynaPipeError(f"plan_for({replica}, {stage}): replica {replica} was not compiled here, only "
                                f"replica(s) {held}; ask for one of those or plan every replica.")
        return self.plans[replica][stage]

    def all_plans(self) -> list[ExecutionPlan]:
        """Every rank's plan, replica by replica, stage by stage."""
        return [p for rep in self.plans for p in rep]

    def schedule_json(self, explain: bool = False) -> dict:
        """The schedule fields of the planner's JSON output. ``recompute`` is one level, or
        a list of one level per stage (per virtual stage, chunk-major, on a chunked placement)
        when they differ; ``max_delay`` (split schedules
        only) is how far the chosen schedule's weight parts may trail their input parts."""
        uniform = len(set(self.stage_recompute)) == 1
        out = {"schedule": self.schedule, "recompute": self.stage_recompute[0] if uniform else self.stage_recompute,
               "order": self.order,
               "simulated_ms": round(self.simulated_ms, 3), "bubble_fraction": round(self.bubble_fraction, 4),
               "stage_peak_mib": [round(p, 1) for p in self.stage_peak_mib]}
        if self.search.best.max_delay is not None:  # zb-h1 / interleaved-zb: the cap on the weight delays
            out["max_delay"] = self.search.best.max_delay
        if explain:
            out["candidates"] = [c.to_json() for c in self.search.candidates]
        return out
