"""``python -m dynapipe validate DIR``: check a written plan set before it runs."""
from __future__ import annotations

from dynapipe.plan.files import check_one_run, read_plan_dir
from dynapipe.plan.validate import validate_plans

HELP = "validate a directory of serialized execution plans"


def add_arguments(p) -> None:
    """Add the ``validate`` command's flags to ``p``."""
    p.add_argument("directory", metavar="DIR", help="directory of *.plan files (written by plan --plan-out)")


def run(args) -> int:
    """Run ``validate`` with parsed ``args``; the process exit status (0: done)."""
    plans = read_plan_dir(args.directory)
    check_one_run(plans, args.directory)
    summary = validate_plans(plans)
    print(f"{args.directory}: {summary.line()}")
    return 0
