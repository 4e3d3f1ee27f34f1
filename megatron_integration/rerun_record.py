"""The record a reproduced rejection leaves in its checkpoint (``iter_N/rerun_state.json``), for
the resumed run's diagnosis (:mod:`megatron_integration.rerun`): written by rank 0 with its
checksum, read and verified by rank 0 and sent to every rank.
"""
from __future__ import annotations

import json
import os
from typing import Callable, Optional

import torch.distributed as dist

from dynapipe.errors import DynaPipeError
from megatron_integration.nan_guard import ranks_text

RECORD_FILE = "rerun_state.json"


def write_record(root: str, iteration: int, record: dict, rank: int) -> str:
    """Rank 0 writes ``record`` (a :class:`Verdict`'s) into the checkpoint of ``iteration``
    (iterations done) under ``root``, with its checksum; collective: every rank returns the
    path once it is written, or raises the same error."""
    from megatron_integration.agreement import attempt, same_error_everywhere
    from megatron_integration.checkpoint import _iter_dir
    from megatron_integration.checkpoint_files import write_checksum, write_text_synced

    path = os.path.join(_iter_dir(root, iteration), RECORD_FILE)

    def write() -> None:
        write_text_synced(path, json.dumps(record, indent=1))
        write_checksum(path)
    same_error_everywhere(attempt(write, f"writing {path}")[1] if rank == 0 else None)
    return path


def load_record(root: str, iteration: int, mode: str, log: Callable[[str], None], check: bool = True,
                layout: Optional[dict] = None, skipped: bool = False) -> Optional[dict]:
    """The rerun record of the checkpoint of ``iteration`` under ``root`` (None: it has none),
    read and verified by rank 0 and sent to every rank; collective. Under a mode other than
    ``validate_results``, with the NaN check off (``check`` False), or when the iteration it records
    is ``skipped`` (``--iterations-to-skip``), the record is not read: it is said to be ignored and
    None returned. A record of another ``layout`` (parallel sizes, method, micro-batch size, stage
    split) is refused: its diagnosis compares rank by rank."""
    from megatron_integration.agreement import from_rank_0
    from megatron_integration.checkpoint import _iter_dir
    from megatron_integration.checkpoint_files import verify_file

    path = os.path.join(_iter_dir(root, iteration), RECORD_FILE)

    def read() -> Optional[dict]:
        if not os.path.exists(path):
            return None
        if mode != "validate_results" or not check or skipped:
            return {}  # not read: a damaged record must not stop a run told to go past it
        verify_file(path)
        with open(path) as f:
            record = json.load(f)
        if not isinstance(record, dict) or not {"iteration", "rejected", "values", "places"} <= set(record):
            raise DynaPipeError(f"{path} is not a rerun record this version wrote; remove it to resume without "
                                f"the diagnosis, or resume with --rerun-mode disabled.")
        return record
    record = from_rank_0(read, f"reading {path}")
    if record is None:
        return None
    if skipped:
        log(f"ignoring {path}: --iterations-to-skip {iteration + 1} skips the iteration it records")
        return None
    if mode != "validate_results" or not check:
        why = f"--rerun-mode {mode}" if mode != "validate_results" else "--no-check-for-nan-in-loss-and-grad"
        log(f"ignoring {path} under {why}: training goes on past the rejected result it records")
        return None
    world = dist.get_world_size() if dist.is_initialized() else 1
    if len(record["places"]) != world:
        raise DynaPipeError(f"{path}: the result of iteration {record['iteration']} was rejected in a job of "
                            f"{len(record['places'])} ranks, and this one has {world}: its diagnosis compares rank by "
                            f"rank. Resume with the ranks it was saved with, or with --rerun-mode disabled to train "
                            f"past it.")
    saved = record.get("layout")
    if layout is not None and saved is not None and saved != layout:
        def shown(v: dict) -> str:
            return ", ".join(f"{k} {v.get(k)}" for k in sorted(set(saved) | set(layout)))
        raise DynaPipeError(f"{path}: the result of iteration {record['iteration']} was rejected in a job of "
                            f"{shown(saved)}, and this one is {shown(layout)}: its diagnosis compares rank by rank. "
                            f"Resume with the layout it was saved with, or with --rerun-mode disabled to train past "
                            f"it.")
    log(f"{path}: the result of iteration {record['iteration']} was rejected on "
        f"{ranks_text(record['rejected'])} and reproduced in place; computing it again on this run's devices")
    return record
