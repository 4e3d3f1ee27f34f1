"""Named training runs (``configs/runs/*.yaml``): launch shape and Megatron-style arguments."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from dynapipe.errors import DynaPipeError

@dataclass(frozen=True)
class RunConfig:
    """A named training run: how to launch it and its Megatron-style arguments."""

    path: str
    argv: tuple[str, ...]
    nnodes: Optional[int] = None
    nproc_per_node: Optional[int] = None

    @property
    def world_size(self) -> Optional[int]:
        if self.nnodes is None or self.nproc_per_node is None:
            return None
        return self.nnodes * self.nproc_per_node


def load_run_config(path: str) -> RunConfig:
    """Read a run config: ``launch: {nnodes, nproc_per_node}`` and ``args: {flag: value}``
    (``true`` for a bare flag, a list for several values; names without the ``--``)."""
    import yaml

    from dynapipe.config import CONFIG_DIR

    if not os.path.exists(path):
        shipped = os.path.join(CONFIG_DIR, "runs", path if path.endswith(".yaml") else path + ".yaml")
        if not os.path.exists(shipped):
            raise DynaPipeError(f"--run-config {path!r}: no such file (nor a shipped run in configs/runs/).")
        path = shipped
    with open(path) as f:
        try:
            data = yaml.safe_load(f) or {}
        except yaml.YAMLError as e:
            raise DynaPipeError(f"{path}: not valid YAML: {e}") from None
    unknown = sorted(set(data) - {"launch", "args", "description"})
    if unknown or not isinstance(data.get("args", {}), dict):
        raise DynaPipeError(f"{path}: a run config holds 'description', 'launch' and an 'args' mapping; "
                            f"unexpected: {unknown or type(data.get('args')).__name__}.")
    argv: list[str] = []
    for key, value in data.get("args", {}).items():
        flag = "--" + str(key)
        if value is True:
            argv.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, list):
            argv += [flag] + [str(v) for v in value]
        else:
            argv += [flag, str(value)]
    launch = data.get("launch", {}) or {}
    return RunConfig(path, tuple(argv), launch.get("nnodes"), launch.get("nproc_per_node"))
