"""Schedule options of ``python -m dynapipe plan``: search, simulate, compile, write plans.

The plan command calls :func:`add_schedule_arguments` on its parser and merges
:func:`schedule_json`'s dict into its JSON output.
"""
from __future__ import annotations

import argparse
import time
from typing import Optional

from dynapipe.batching import BatchPlan
from dynapipe.output_paths import check_output_dir
from dynapipe.config import ClusterConfig, load_cluster_config
from dynapipe.cost.base import RECOMPUTE_LEVELS, CostModel
from dynapipe.errors import DynaPipeError
from dynapipe.pipeline_planner import IterationPlan, schedule_batch_plan
from dynapipe.plan.files import write_plan_dir
from dynapipe.schedule.search import SCHEDULE_CHOICES



def add_schedule_arguments(p: argparse.ArgumentParser) -> None:
    """``--schedule``, ``--cluster``, ``--plan-out``, ``--explain``."""
    p.add_argument("--schedule", choices=SCHEDULE_CHOICES, default="auto",
                   help="pipeline schedule: 1f1b, adaptive, zb-h1 (zero-bubble: each backward split into its "
                        "input and weight parts), interleaved, interleaved-adaptive or interleaved-zb (chunked "
                        "placements, where 1f1b and zb-h1 mean interleaved and interleaved-zb), or auto (search "
                        "1f1b, adaptive and zb-h1, or the interleaved ones, x micro-batch orders x recompute "
                        "levels from --recompute up; default auto)")
    add_split_backward_argument(p)
    p.add_argument("--cluster", default=None,
                   help="cluster config (links between stages): a YAML path or a shipped name such as a100-8x "
                        "(default: chosen by device)")
    p.add_argument("--plan-out", default=None, metavar="DIR",
                   help="write one serialized execution plan per rank into DIR; plan files an earlier run "
                        "left there for other ranks are removed, other files are kept")
    p.add_argument("--explain", action="store_true",
                   help="list every schedule candidate with its simulated time and peak memory")


def check_schedule_flags(args: argparse.Namespace) -> None:
    """Refuse, before any planning, schedule options this command line would not read:
    ``--no-split-backward`` with a named schedule that never splits a backward (it only takes
    the split schedules out of ``auto``), ``--cluster`` with one stage and no tensor
    parallelism (its links are those between stages and inside a TP group)."""
    from dynapipe.schedule.types import SPLITTING_SCHEDULE_NAMES

    if getattr(args, "recompute", None) == "auto":  # the default, as training's --dynapipe-recompute auto
        args.recompute = None

    schedule = getattr(args, "schedule", "auto")
    if getattr(args, "no_split_backward", False) and schedule not in ("auto",) + SPLITTING_SCHEDULE_NAMES:
        raise DynaPipeError(f"--no-split-backward takes {' and '.join(SPLITTING_SCHEDULE_NAMES)} out of "
                            f"--schedule auto; "
                            f"--schedule {schedule} never splits a backward: drop one of them.")
    cluster = getattr(args, "cluster", None)
    if cluster is not None and getattr(args, "stages", 2) == 1 and getattr(args, "tp", 1) == 1:
        raise DynaPipeError(f"--cluster {cluster} prices the links between pipeline stages and inside a "
                            f"tensor-parallel group; --stages 1 with --tp 1 has neither (data-parallel traffic is not "
                            f"simulated): drop it.")


def check_plan_out(directory: Optional[str]) -> None:
    """Refuse a ``--plan-out`` that is an existing file or cannot be created, before any
    planning is spent."""
    if directory is not None:
        check_output_dir(directory, "--plan-out")


def write_plan_files(plans, directory: str) -> list[str]:
    """``--plan-out DIR``: write the plan set and remove the plan files an earlier run left
    there for ranks this set does not have (so ``validate DIR`` sees one layout); files not
    named like plan files stay. Returns the paths written."""
    check_plan_out(directory)
    try:
        return write_plan_dir(plans, directory, replace=True)
    except OSError as e:
        where = e.filename or directory
        raise DynaPipeError(f"--plan-out {directory!r}: cannot write {where!r} ({e.strerror}); give a "
                            f"writable directory.") from None


def resolve_cluster(name: Optional[str], device_name: Optional[str]) -> ClusterConfig:
    """``--cluster`` as given, else the shipped cluster of the device
    (:func:`~dynapipe.cost.profile_device.shipped_cluster_for_device`), else defaults."""
    from dynapipe.cost.profile_device import shipped_cluster_for_device

    if name:
        return load_cluster_config(name, flag="--cluster")
    shipped = shipped_cluster_for_device(device_name) if device_name else None
    return load_cluster_config(shipped) if shipped else ClusterConfig(name="default")


def levels_from(recompute: Optional[str]) -> list[str]:
    """The recompute levels the search tries: from the batching level up (all when unset)."""
    if recompute in (None, "auto"):
        return list(RECOMPUTE_LEVELS)
    if recompute not in RECOMPUTE_LEVELS:
        raise DynaPipeError(f"--recompute {recompute!r}: use one of {RECOMPUTE_LEVELS}.")
    return list(RECOMPUTE_LEVELS[RECOMPUTE_LEVELS.index(recompute):])


def escalate_recompute(plan_at, recompute: Optional[str]):
    """``(plan_at(level), level)`` for the lightest level that plans, trying ``recompute``
    alone when given, else none, then selective, then full (as ``plan_iteration`` does).

    Only a batch that fits at no level is an error: the heaviest level's, which names the
    sample and the memory it needs.
    """
    levels = [recompute] if recompute not in (None, "auto") else list(RECOMPUTE_LEVELS)
    error = None
    for level in levels:
        try:
            return plan_at(level), level
        except DynaPipeError as e:  # a sample too large at this level may fit with more recompute
            error = e
    raise error


def recompute_label(levels, num_stages: int) -> str:
    """The chosen recompute for a summary line: one level, or the levels joined "by stage"
    (``by virtual stage`` where there are more levels than pipeline stages: a chunked placement)."""
    levels = [levels] if isinstance(levels, str) else list(levels)
    if len(set(levels)) == 1:
        return levels[0]
    return "/".join(levels) + (" by virtual stage" if len(levels) > num_stages else " by stage")


def add_split_backward_argument(p: argparse.ArgumentParser) -> None:
    """``--no-split-backward``: plan for stages that cannot split their backward."""
    p.add_argument("--no-split-backward", action="store_true",
                   help="the stages cannot split their backward (Transformer Engine layers, executor handlers "
                        "without a weight part): auto leaves zb-h1 and interleaved-zb out")


def split_backward(args: argparse.Namespace) -> bool:
    """Whether the schedule search may split backwards (``--no-split-backward`` not given; the
    search refuses a split schedule asked for by name without it)."""
    return not getattr(args, "no_split_backward", False)


def add_recompute_default(p: argparse.ArgumentParser) -> None:
    """Make ``--recompute`` default to trying every level, lightest first; ``auto`` (training's
    ``--dynapipe-recompute`` default) names that default (:func:`check_schedule_flags` reads it)."""
    p.set_defaults(recompute=None)
    for action in p._actions:
        if action.dest == "recompute":
            action.choices = ("auto", *action.choices)
            action.help = ("activation recomputation level; default (auto): none, then selective, then full, "
                           "the lightest under which every sample fits (the schedule search may mix levels "
                           "per stage from there up)")


def plan_schedule(args: argparse.Namespace, batch_plan: BatchPlan, cost_model: CostModel, *,
                  memory_limit_mib: Optional[float] = None, reserved_mib: Optional[float] = None,
                  lengths=None, iteration: int = 0) -> IterationPlan:
    """Run the schedule search and compile the plans as the arguments say."""
    device = getattr(cost_model, "device", None)
    cluster = resolve_cluster(getattr(args, "cluster", None), device.name if device is not None else None)
    return schedule_batch_plan(batch_plan, cost_model, schedule=getattr(args, "schedule", "auto"),
                               memory_limit_mib=memory_limit_mib, reserved_mib=reserved_mib, cluster=cluster,
                               recompute=levels_from(getattr(args, "recompute", None)), iteration=iteration,
                               explain=bool(getattr(args, "explain", False)), lengths=lengths,
                               split_backward=split_backward(args))


def schedule_json(args: argparse.Namespace, batch_plan: BatchPlan, cost_model: CostModel, *,
                  memory_limit_mib: Optional[float] = None, reserved_mib: Optional[float] = None,
                  lengths=None, iteration: int = 0) -> dict:
    """The plan command's extra JSON fields.

    ``schedule`` (the one chosen), ``recompute``, ``order`` (micro-batch order),
    ``simulated_ms`` (makespan), ``bubble_fraction``, ``stage_peak_mib`` (one per stage,
    model states included), ``schedule_planning_ms`` (search + compilation, to add to
    ``planning_ms``), ``candidates`` with ``--explain``, and ``plan_files`` with
    ``--plan-out DIR`` (one serialized plan per rank written there).
    """
    start = time.perf_counter()
    it = plan_schedule(args, batch_plan, cost_model, memory_limit_mib=memory_limit_mib,
                       reserved_mib=reserved_mib, lengths=lengths, iteration=iteration)
    out = it.schedule_json(explain=bool(getattr(args, "explain", False)))
    out["schedule_planning_ms"] = round((time.perf_counter() - start) * 1e3, 3)
    if getattr(args, "plan_out", None):
        out["plan_files"] = write_plan_files(it.all_plans(), args.plan_out)
    return out
