"""Megatron-LM's ``--deterministic-mode``: bit-reproducible execution, as Megatron-LM sets it up.

Before the process group exists: the environment variables NCCL, cuBLAS and Transformer Engine
read at their first use (``NCCL_ALGO=Ring``, ``CUBLAS_WORKSPACE_CONFIG=:4096:8``,
``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0``; a value already set must be one of the deterministic
ones, else the run stops naming it), then ``torch.use_deterministic_algorithms(True)``;
megatron-core's ``TransformerConfig.deterministic_mode`` is set where the config is built.
A job that trains several runs in one process turns torch's switch off again between runs
(:func:`end_deterministic_run`).
"""
from __future__ import annotations

import os
from typing import MutableMapping

from dynapipe.errors import DynaPipeError

# What each variable must hold (the first value is the one set when it is unset).
DETERMINISTIC_ENV = {
    "NCCL_ALGO": ("Ring", "CollnetDirect", "CollnetChain", "^NVLS"),
    "CUBLAS_WORKSPACE_CONFIG": (":4096:8", ":16:8"),
    "NVTE_ALLOW_NONDETERMINISTIC_ALGO": ("0",),
}


def deterministic_env(env: MutableMapping[str, str]) -> dict:
    """Check ``env`` for settings that break bit-reproducibility and fill in the unset ones
    (``NCCL_ALGO`` may list several accepted algorithms, comma-separated); returns what was set."""
    for name, accepted in DETERMINISTIC_ENV.items():
        value = env.get(name)
        if value is None:
            continue
        parts = [p.strip() for p in value.split(",")] if name == "NCCL_ALGO" else [value]
        if not all(p in accepted for p in parts if p) or not any(parts):
            raise DynaPipeError(f"--deterministic-mode with {name}={value!r}: not a deterministic setting; unset it "
                                f"or use one of {', '.join(accepted)}.")
    added = {name: accepted[0] for name, accepted in DETERMINISTIC_ENV.items() if name not in env}
    env.update(added)
    return added


def start_deterministic_run(enabled: bool) -> None:
    """Apply ``--deterministic-mode`` to this process (before its process group is created)."""
    if not enabled:
        return
    import torch

    deterministic_env(os.environ)
    torch.use_deterministic_algorithms(True)


def end_deterministic_run() -> None:
    """Turn torch's deterministic-algorithms switch off again (between the runs of one job)."""
    import torch

    torch.use_deterministic_algorithms(False)
