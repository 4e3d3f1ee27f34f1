"""Megatron-LM's wall-clock limit and memory housekeeping of a training run.

- ``--exit-duration-in-mins N``: after every iteration each rank compares the minutes since
  training started with N, and a MAX all-reduce over all ranks makes every rank take the same
  decision, however their clocks differ (the line it prints gives the longest time); past the
  limit the run saves a checkpoint (with ``--save``, unless it saved at this iteration already)
  and stops, as Megatron-LM does, so a job under a scheduler's time limit ends with a checkpoint
  instead of being killed mid-step.
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
                          now_s: Optional[float] = None) -> Optional[float]:
    """The longest time any rank has trained, in minutes since its ``started_s`` (``time.time()``
    seconds; ``now_s`` defaults to now), when that is past ``minutes``; None while every rank is
    within the limit (or there is none). Collective over the default process group when one is
    up: every rank must call it at the same iteration, and all get the same answer."""
    if not minutes:
        return None
    elapsed_min = ((time.time() if now_s is None else now_s) - started_s) / 60.0
    # The slowest clock decides, and is the one reported: rank 0's alone could read just under
    # the limit in the line that says the limit was reached.
    longest = torch.tensor([elapsed_min], dtype=torch.float64, device=device)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(longest, op=torch.distributed.ReduceOp.MAX)
    longest_min = float(longest.item())
    return longest_min if longest_min > minutes else None


def exit_duration_line(minutes: int, elapsed_min: float, iteration: int) -> str:
    """The line a run stopped by ``--exit-duration-in-mins`` prints (``elapsed_min``: the
    longest time any rank trained, in minutes, from :func:`exit_duration_reached`)."""
    return (f"exiting program after {elapsed_min:.2f} minutes (--exit-duration-in-mins {minutes}), after "
            f"iteration {iteration}")


def empty_unused_memory(level: int, device: torch.device, after_optimizer: bool) -> None:
    """Megatron's ``--empty-unused-memory-level`` at one of its two points: after the
    forward-backward (level 1 and 2) or after the optimizer step (level 2)."""
    if device.type == "cuda" and level >= (2 if after_optimizer else 1):
        torch.cuda.empty_cache()
