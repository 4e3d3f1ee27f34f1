"""Imported by the fork servers that ranks and planner workers start from
(:mod:`dynapipe.runtime.process_start`): initialises numba's compiler once there, so that no
forked process pays it at its first plan.

Why: the first call of any compiled kernel in a process sets up numba's typing and target
contexts and loads the kernel from numba's on-disk cache, 0.3-0.5 s of CPU on a 2-core host, and
every planner worker is a new process (one a node for each run). One kernel called here, with
arguments of the types the planner passes, does the set-up in the server; the forked processes
inherit it (a first plan then took 80-90 ms instead of 280-460). A warm-up that fails leaves the
cost to the workers: a fork server must not fail to start over it.
"""
try:
    from dynapipe.plan.validate_fast import warm_up

    warm_up()
except Exception:  # noqa: BLE001 - see the docstring
    pass
