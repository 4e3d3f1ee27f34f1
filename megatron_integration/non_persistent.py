"""Megatron-LM's non-persistent checkpoints (``--non-persistent-save-interval`` with
``--non-persistent-ckpt-type global``): frequent saves that keep only the newest, so a job that
dies between its ``--save-interval`` checkpoints loses a few iterations instead of many.

They go to ``--non-persistent-global-ckpt-dir``, by default ``non_persistent`` under ``--save``, in
the run's ``--ckpt-format``, each replacing the ones before (deleted, interrupted saves included,
once the newer is complete, where Megatron-LM deletes the older ones before saving). A job resumed
with ``--load`` and the type loads the newer of ``--load``'s checkpoint and the non-persistent one,
as Megatron-LM does; on a tie ``--load``'s, which alone holds a rerun record
(:mod:`megatron_integration.rerun_record`). ``local`` checkpoints (nvidia-resiliency-ext's
node-local copies) are not built.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Callable, Optional

from dynapipe.errors import DynaPipeError

SUBDIR = "non_persistent"  # Megatron-LM's directory under --save


@dataclass(frozen=True)
class NonPersistentArgs:
    """``--non-persistent-save-interval`` (iterations; None: never), ``--non-persistent-ckpt-type``
    and ``--non-persistent-global-ckpt-dir`` (None: :data:`SUBDIR` under ``--save`` / ``--load``)."""

    save_interval: Optional[int] = None
    ckpt_type: Optional[str] = None
    global_dir: Optional[str] = None


def non_persistent_from_args(args) -> NonPersistentArgs:
    """The flags, checked: an interval needs ``--save`` and the ``global`` type (without them
    Megatron-LM saves nothing, or stops at the first save); ``local`` is refused."""
    interval, kind = args.non_persistent_save_interval, args.non_persistent_ckpt_type
    directory = args.non_persistent_global_ckpt_dir
    if kind == "local":
        raise DynaPipeError("--non-persistent-ckpt-type local: node-local checkpoints (nvidia-resiliency-ext) are not "
                            "built; use global, which saves under --save (or --non-persistent-global-ckpt-dir).")
    if interval == 0:
        interval = None  # off, as Megatron-LM reads it
    if interval is not None:
        if interval < 0:
            raise DynaPipeError(f"--non-persistent-save-interval {interval}: give a number of iterations (0: off).")
        if kind is None:
            raise DynaPipeError(f"--non-persistent-save-interval {interval} needs --non-persistent-ckpt-type global "
                                f"(Megatron-LM stops at the first such save without it).")
        if not args.save:
            raise DynaPipeError(f"--non-persistent-save-interval {interval} saves under --save (or "
                                f"--non-persistent-global-ckpt-dir), and --save is not given; add it.")
    if directory is not None and kind is None:
        raise DynaPipeError(f"--non-persistent-global-ckpt-dir {directory} is read with --non-persistent-ckpt-type "
                            f"global only; add it or drop the directory.")
    for flag in ("save", "load"):
        other = getattr(args, flag, None)
        if directory is not None and other and os.path.abspath(directory) == os.path.abspath(other):
            raise DynaPipeError(f"--non-persistent-global-ckpt-dir {directory} is --{flag} itself: the "
                                f"non-persistent checkpoints would replace its checkpoints; name another directory.")
    return NonPersistentArgs(interval, kind, directory)


def save_root(cfg) -> str:
    """Where ``cfg``'s (a DynaPipeTrainingConfig) non-persistent checkpoints are saved."""
    np = cfg.non_persistent
    return np.global_dir or os.path.join(cfg.save, SUBDIR)


def load_root(cfg) -> Optional[str]:
    """Where a run resumed with ``--load`` looks for a non-persistent checkpoint (None: it does
    not; without ``--load`` nothing is loaded, as in Megatron-LM)."""
    np = cfg.non_persistent
    if np.ckpt_type is None or not cfg.load:
        return None
    return np.global_dir or os.path.join(cfg.load, SUBDIR)


def save_config(cfg):
    """``cfg`` saving to :func:`save_root` (no ``--save-retain-interval`` there: only the newest
    is kept)."""
    return replace(cfg, save=save_root(cfg), save_retain_interval=None)


def newer_load(cfg, log: Callable[[str], None]):
    """``cfg`` loading from the non-persistent checkpoint when it is newer than ``--load``'s
    (said in the log), else ``cfg``. Rank 0 reads the trackers and every rank takes its choice
    (collective), so no two ranks load different directories; a rank that cannot see the chosen
    one stops every rank at the load's own agreement."""
    from megatron_integration.agreement import from_rank_0

    root = load_root(cfg)
    if root is None:
        return cfg
    line, use = from_rank_0(lambda: _choose(cfg, root), f"reading {root}")
    if line:
        log(line)
    return replace(cfg, load=root) if use else cfg


def _choose(cfg, root: str) -> tuple[Optional[str], bool]:
    """(what to log, whether to load ``root``): the non-persistent checkpoint when newer."""
    from megatron_integration.checkpoint import RELEASE, latest_iteration

    mine = latest_iteration(root) if os.path.isdir(root) else None
    if mine is None:
        return None, False
    if mine == RELEASE:
        raise DynaPipeError(f"{root} names a release checkpoint, which non-persistent checkpoints never are; remove "
                            f"the directory or resume without --non-persistent-ckpt-type.")
    persistent = latest_iteration(cfg.load) if os.path.isdir(cfg.load) else None
    shown = "a release" if persistent == RELEASE else f"of iteration {persistent}"
    if persistent is not None and persistent >= mine:
        return (f"the non-persistent checkpoint of iteration {mine} in {root} is not newer than --load's "
                f"({shown}): loading --load's"), False
    return (f"loading the non-persistent checkpoint of iteration {mine} from {root}"
            + (f" (--load's is {shown})" if persistent is not None else "")), True


def other_checkpoints(root: str, newest: int) -> list[str]:
    """The ``iter_*`` directories under ``root`` other than ``newest``'s, interrupted saves
    (``iter_K.saving``) and those of an earlier run included, to delete once ``newest`` is saved."""
    out = []
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else ():
        digits = name[5:].split(".")[0]
        if name.startswith("iter_") and digits.isdigit() and name != f"iter_{newest:07d}":
            out.append(os.path.join(root, name))
    return out
