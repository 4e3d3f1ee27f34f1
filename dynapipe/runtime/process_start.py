"""How local rank processes start: forked from a server that has imported torch once.

A freshly spawned rank imports torch and megatron-core before it does anything, about 8 to 11
seconds of CPU each on a 2-core host, and a test suite or bench starts hundreds of ranks. With
multiprocessing's ``forkserver`` the imports happen once, in a server process, and every rank
is forked from it. The server forks while single-threaded (importing torch starts no thread
pool; no tensor work runs there), and each child gets the parent's ``sys.path`` and working
directory as a spawned one would. Environment variables are the server's, from when it
started: a rank sets its own (``RANK``, ``MASTER_PORT``, ...) before it touches torch.distributed.

With CUDA the ranks are spawned as before: a module imported in the server could initialise
CUDA, which a forked child cannot use.
"""
from __future__ import annotations

import threading

import torch
import torch.multiprocessing as mp

# Imported once in the server; a module that is not installed is skipped by multiprocessing.
# Higher layers add the modules their ranks run (add_preload) when they are imported.
PRELOAD = ["torch", "torch.distributed", "numpy", "dynapipe.runtime.executor", "dynapipe.runtime.loader",
           "dynapipe.runtime.preload_kernels"]


def add_preload(*modules: str) -> None:
    """Have the server import ``modules`` too: effective only until this process first asks for
    a start method (:func:`rank_start_method`, :func:`rank_context`, :func:`helper_context`),
    which fixes the server's preload, so call it at import time."""
    PRELOAD.extend(m for m in modules if m not in PRELOAD)


# What a helper's forkserver imports: planner workers need the planner (its compiled kernels
# loaded: preload_kernels) and torch's store client, never megatron-core or CUDA.
HELPER_PRELOAD = ["torch", "numpy", "dynapipe.runtime.planner_workers", "dynapipe.runtime.preload_kernels"]

# Imported after the preload: freezes the garbage collector's view of what the imports made.
FREEZE = "dynapipe.runtime.preload_freeze"

# The preload this process's forkserver started with (None: not started by this module yet). A
# process has one forkserver; whichever of rank_context / helper_context asks first sets it.
_server_preload: list[str] | None = None


def _forkserver(preload: list[str]):
    global _server_preload
    ctx = mp.get_context("forkserver")
    if _server_preload is None:
        _server_preload = list(preload)
        # FREEZE last: it freezes what the modules before it created.
        ctx.set_forkserver_preload(_server_preload + [FREEZE])  # takes effect when the server starts (the first child)
    return ctx


def rank_start_method() -> str:
    """``forkserver`` (with :data:`PRELOAD`) where it is available and CUDA is not, else ``spawn``."""
    if "forkserver" not in mp.get_all_start_methods() or torch.cuda.is_available():
        return "spawn"
    _forkserver(PRELOAD)
    return "forkserver"


def rank_context():
    """The multiprocessing context to start local ranks with (see :func:`rank_start_method`)."""
    return mp.get_context(rank_start_method())


def helper_context():
    """The context to start helper processes with (planner workers): ``forkserver`` wherever it
    is available, CUDA or not, since helpers never touch the device.

    Why: a spawned helper imports torch (for the store client) and the planner, about 3-4 s of
    CPU on a 2-core host, on the critical path of a run's first plan. Started from a rank, the
    forkserver is that rank's own (a fresh interpreter with :data:`HELPER_PRELOAD`), so it is
    paid once a rank process however many runs or workers follow; a process that starts ranks
    first reuses the ranks' server (which has imported more). A helper forked from it gets the
    rank's ``sys.path``, and :func:`multiprocessing.parent_process` is still the rank.
    """
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    return _forkserver(HELPER_PRELOAD)


def start_helper_server() -> threading.Thread:
    """Start this process's helper forkserver (:func:`helper_context`) now, in a daemon thread;
    the thread is returned. A planner rank calls it before building its model, so the server's
    start (a fresh interpreter importing torch and the planner: seconds, more on a cluster's
    shared file system) overlaps the model build and the checkpoint load instead of delaying
    the first plan. Nothing is raised here: a start that fails fails again, reported, when the
    planner workers start."""
    def start() -> None:
        try:
            if helper_context().get_start_method() == "forkserver":
                from multiprocessing import forkserver

                forkserver.ensure_running()
        except Exception:  # noqa: BLE001 - see the docstring
            pass

    thread = threading.Thread(target=start, daemon=True, name="dynapipe-helper-server-start")
    thread.start()
    return thread
