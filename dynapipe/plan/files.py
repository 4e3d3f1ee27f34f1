"""A plan set on disk: one serialized plan file per rank in a directory."""
from __future__ import annotations

import os
from typing import Sequence

from dynapipe.errors import PlanError
from dynapipe.plan.instructions import ExecutionPlan
from dynapipe.plan.serialize import deserialize_plan, serialize_plan

SUFFIX = ".plan"


def plan_file_name(replica: int, stage: int) -> str:
    """File name of the plan of ``replica``'s pipeline rank ``stage``."""
    return f"replica{replica:03d}-stage{stage:03d}{SUFFIX}"


def write_plan_dir(plans: Sequence[ExecutionPlan], directory: str) -> list[str]:
    """Write one file per plan into ``directory`` (created if needed); returns the paths."""
    os.makedirs(directory, exist_ok=True)
    paths = []
    for p in plans:
        path = os.path.join(directory, plan_file_name(p.replica, p.stage))
        with open(path, "wb") as f:
            f.write(serialize_plan(p))
        paths.append(path)
    return paths


def read_plan_dir(directory: str) -> list[ExecutionPlan]:
    """Read every ``*.plan`` file of ``directory``; errors name the file."""
    if not os.path.isdir(directory):
        raise PlanError(f"plan directory {directory!r} does not exist.")
    names = sorted(n for n in os.listdir(directory) if n.endswith(SUFFIX))
    if not names:
        raise PlanError(f"plan directory {directory!r} holds no *{SUFFIX} files; write some with "
                        f"`python -m dynapipe plan ... --plan-out {directory}`.")
    plans = []
    for n in names:
        with open(os.path.join(directory, n), "rb") as f:
            data = f.read()
        try:
            plans.append(deserialize_plan(data))
        except PlanError as e:
            raise PlanError(f"{os.path.join(directory, n)}: {e}") from None
    return plans
