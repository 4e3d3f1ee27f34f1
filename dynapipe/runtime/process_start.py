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

import torch
import torch.multiprocessing as mp

# Imported once in the server; a module that is not installed is skipped by multiprocessing.
# Higher layers add the modules their ranks run (add_preload) when they are imported.
PRELOAD = ["torch", "torch.distributed", "numpy", "dynapipe.runtime.executor", "dynapipe.runtime.loader"]


def add_preload(*modules: str) -> None:
    """Have the server import ``modules`` too (effective until the server starts: the first rank)."""
    PRELOAD.extend(m for m in modules if m not in PRELOAD)


def rank_start_method() -> str:
    """``forkserver`` (with :data:`PRELOAD`) where it is available and CUDA is not, else ``spawn``."""
    if "forkserver" not in mp.get_all_start_methods() or torch.cuda.is_available():
        return "spawn"
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))  # takes effect when the server starts (the first rank)
    return "forkserver"


def rank_context():
    """The multiprocessing context to start local ranks with (see :func:`rank_start_method`)."""
    return mp.get_context(rank_start_method())
