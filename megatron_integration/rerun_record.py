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

RECORD_FILE = "rerun_state.json"


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


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


def load_record(root: str, iteration: int, mode: str, rank: int, log: Callable[[str], None]) -> Optional[dict]:
    """The rerun record of the checkpoint of ``iteration`` under ``root`` (None: it has none),
    read and verified by rank 0 and sent to every rank; collective. Under a mode other than
    ``validate_results`` the record is not read: it is said to be ignored and None returned."""
    from megatron_integration.agreement import attempt, same_error_everywhere
    from megatron_integration.checkpoint import _iter_dir
    from megatron_integration.checkpoint_files import verify_file

    path = os.path.join(_iter_dir(root, iteration), RECORD_FILE)

    def read() -> Optional[dict]:
        if not os.path.exists(path):
            return None
        if mode != "validate_results":
            return {}  # not read: a damaged record must not stop a run told to go past it
        verify_file(path)
        with open(path) as f:
            record = json.load(f)
        if not isinstance(record, dict) or not {"iteration", "rejected", "values", "places"} <= set(record):
            raise DynaPipeError(f"{path} is not a rerun record this version wrote; remove it to resume without "
                                f"the diagnosis, or resume with --rerun-mode disabled.")
        return record
    record, error = attempt(read, f"reading {path}") if rank == 0 else (None, None)
    same_error_everywhere(error)
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [record]
        dist.broadcast_object_list(box, src=0)
        record = box[0]
    if record is None:
        return None
    if mode != "validate_results":
        log(f"ignoring {path} under --rerun-mode {mode}: training goes on past the rejected result it records")
        return None
    world = dist.get_world_size() if dist.is_initialized() else 1
    if len(record["places"]) != world:
        raise DynaPipeError(f"{path}: the result of iteration {record['iteration']} was rejected in a job of "
                            f"{len(record['places'])} ranks, and this one has {world}: its diagnosis compares rank by "
                            f"rank. Resume with the ranks it was saved with, or with --rerun-mode disabled to train "
                            f"past it.")
    log(f"{path}: the result of iteration {record['iteration']} was rejected on "
        f"{_ranks(record['rejected'])} and reproduced in place; computing it again on this run's devices")
    return record
