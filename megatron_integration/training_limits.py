"""Megatron-LM's wall-clock limit and memory housekeeping of a training run.

- ``--exit-duration-in-mins N``: after every iteration each rank compares the minutes since
  training started with N, and a MAX all-reduce over all ranks makes every rank take the same
  decision, however their clocks differ; past the limit the run saves a checkpoint (with
  ``--save``, unless it saved at this iteration already) and stops, as Megatron-LM does, so a
  job under a scheduler's time limit ends with a checkpoint instead of being killed mid-step.
- ``--empty-unused-memory-level``: 1 returns the CUDA caching allocator's unused blocks to
  the device after each forward-backward, 2 also after each optimizer step. A CPU has no such
  cache (freed tensors go back to the host allocator), so on CPU the level changes nothing.
"""
from __future__ import annotations

import time
from typing import Optional

import torch

from dynapipe.errors import DynaPipeError


def check_exit_duration(minutes: Optional[int]) -> Optional[int]:
    """``--exit-duration-in-mins``, validated (None or 0: no limit, as in Megatron-LM)."""
    if minutes is not None and minutes < 0:
        raise DynaPipeError(f"--exit-duration-in-mins {minutes}: must be a number of minutes >= 0 (0: no limit).")
    return minutes or None


def exit_duration_reached(minutes: Optional[int], started_s: float, device: torch.device,
                          now_s: Optional[float] = None) -> bool:
    """Whether any rank has trained longer than ``minutes`` since ``started_s`` (``time.time()``
    seconds; ``now_s`` defaults to now). Collective over the default process group when one is
    up: every rank must call it at the same iteration."""
    if not minutes:
        return False
    elapsed_min = ((time.time() if now_s is None else now_s) - started_s) / 60.0
    flag = torch.tensor([1 if elapsed_min > minutes else 0], dtype=torch.int32, device=device)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return bool(flag.item())


def exit_duration_line(minutes: int, started_s: float, iteration: int) -> str:
    """The line a run stopped by ``--exit-duration-in-mins`` prints."""
    elapsed = (time.time() - started_s) / 60.0
    return (f"exiting program after {elapsed:.2f} minutes (--exit-duration-in-mins {minutes}), after iteration "
            f"{iteration}")


def empty_unused_memory(level: int, device: torch.device, after_optimizer: bool) -> None:
    """Megatron's ``--empty-unused-memory-level`` at one of its two points: after the
    forward-backward (level 1 and 2) or after the optimizer step (level 2)."""
    if device.type == "cuda" and level >= (2 if after_optimizer else 1):
        torch.cuda.empty_cache()
