"""A plan set on disk: one serialized plan file per rank in a directory."""
from __future__ import annotations

import errno
import os
import re
from typing import Sequence

from dynapipe.errors import PlanError
from dynapipe.plan.instructions import ExecutionPlan
from dynapipe.plan.serialize import HEADER_BYTES, MAX_BODY_BYTES, deserialize_plan, serialize_plan

SUFFIX = ".plan"


def plan_file_name(replica: int, stage: int) -> str:
    """File name of the plan of ``replica``'s pipeline rank ``stage``."""
    return f"replica{replica:03d}-stage{stage:03d}{SUFFIX}"


# Exactly the names plan_file_name writes; only these are ever removed from a directory.
_PLAN_NAME = re.compile(r"replica\d{3,}-stage\d{3,}" + re.escape(SUFFIX))


def write_plan_dir(plans: Sequence[ExecutionPlan], directory: str, replace: bool = False) -> list[str]:
    """Write one file per plan into ``directory`` (created if needed); returns the paths.

    ``replace``: the directory then holds this plan set alone. Plan files of an earlier set
    that these plans do not overwrite (another layout's ranks, which would make the
    directory fail validation) are removed after the new files are written; only regular
    files named as :func:`plan_file_name` names them are touched, never any other file.
    """
    os.makedirs(directory, exist_ok=True)
    names = [plan_file_name(p.replica, p.stage) for p in plans]
    paths = [os.path.join(directory, name) for name in names]
    for path in paths:
        if os.path.lexists(path) and not os.path.isfile(path):  # a folder (or a dangling link) in the way
            raise OSError(errno.EEXIST, "a folder or link is in the way of the plan file; remove it", path)
    # Every file is written beside its name first and all are renamed over their names after:
    # a failed write (a full disk) leaves neither a truncated plan nor a set half old, half new.
    tmps = [os.path.join(directory, f".{name}.{os.getpid()}.tmp") for name in names]
    try:
        for p, tmp in zip(plans, tmps):
            with open(tmp, "wb") as f:
                f.write(serialize_plan(p))
        for tmp, path in zip(tmps, paths):
            os.replace(tmp, path)
    finally:
        for tmp in tmps:
            if os.path.exists(tmp):
                os.remove(tmp)
    if replace:
        written = {os.path.basename(path) for path in paths}
        for name in os.listdir(directory):
            path = os.path.join(directory, name)
            if name not in written and _PLAN_NAME.fullmatch(name) and os.path.isfile(path) \
                    and not os.path.islink(path):
                os.remove(path)
    return paths


def read_plan_dir(directory: str) -> list[ExecutionPlan]:
    """Read every ``*.plan`` file of ``directory``; errors name the file."""
    if os.path.isfile(directory):
        raise PlanError(f"plan directory {directory!r} is a file, not a directory; give the directory "
                        f"`python -m dynapipe plan ... --plan-out DIR` wrote.")
    if not os.path.isdir(directory):
        raise PlanError(f"plan directory {directory!r} does not exist.")
    names = sorted(n for n in os.listdir(directory) if n.endswith(SUFFIX))
    if not names:
        raise PlanError(f"plan directory {directory!r} holds no *{SUFFIX} files; write some with "
                        f"`python -m dynapipe plan ... --plan-out {directory}`.")
    plans = []
    for n in names:
        path = os.path.join(directory, n)
        if not os.path.isfile(path):
            raise PlanError(f"{path}: not a regular file; a plan directory holds only plan files.")
        size = os.path.getsize(path)
        if size > HEADER_BYTES + MAX_BODY_BYTES:
            raise PlanError(f"{path}: {size} bytes is larger than any plan ({HEADER_BYTES + MAX_BODY_BYTES} "
                            f"bytes at most); not a plan file.")
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as e:
            raise PlanError(f"{path}: cannot be read ({e.strerror}).") from None
        try:
            plan = deserialize_plan(data)
        except PlanError as e:
            raise PlanError(f"{path}: {e}") from None
        if n != plan_file_name(plan.replica, plan.stage):
            raise PlanError(f"{path}: holds the plan of replica {plan.replica} stage {plan.stage}, which belongs "
                            f"in {plan_file_name(plan.replica, plan.stage)}; the file was renamed or copied.")
        plans.append(plan)
    return plans


# Header fields every plan of one planning run shares: a plan set whose files disagree on
# one was put together from several runs.
_RUN_FIELDS = ("num_stages", "num_replicas", "iteration", "global_loss_tokens")


def check_one_run(plans: Sequence[ExecutionPlan], directory: str) -> None:
    """Refuse a plan set whose files come from different planning runs (their layouts,
    iterations or loss normalisations differ, or a replica's ranks disagree on its
    micro-batches), naming the two files and the fix."""
    def path(p: ExecutionPlan) -> str:
        return os.path.join(directory, plan_file_name(p.replica, p.stage))

    def refuse(p: ExecutionPlan, q: ExecutionPlan, what: str) -> None:
        raise PlanError(f"{path(p)}: {what} {path(q)}, so the files come from different planning runs; re-run "
                        f"`python -m dynapipe plan ... --plan-out {directory}` so that every rank's plan comes "
                        f"from one run.")

    if not plans:
        return
    first = plans[0]
    heads: dict[int, ExecutionPlan] = {}
    for p in plans:
        for name in _RUN_FIELDS:
            if getattr(p, name) != getattr(first, name):
                refuse(p, first, f"{name}={getattr(p, name)} differs from {name}={getattr(first, name)} of")
        head = heads.setdefault(p.replica, p)
        if p.micro_batches != head.micro_batches:
            refuse(p, head, "its micro-batch list differs from that of")
