"""Megatron-LM's manual garbage collection: ``--manual-gc``, ``--manual-gc-interval``,
``--no-manual-gc-eval``.

Python's cyclic collector runs when allocations cross its thresholds, so a full collection
(tens of milliseconds with megatron-core's objects alive) lands in a random op of a random
rank, and every other pipeline stage waits for that rank. With ``--manual-gc`` the collector
is off during training and collects at known points instead, on every rank at once: at the
start, every ``--manual-gc-interval`` iterations (0: never between iterations), and around
each periodic evaluation (all generations before, the youngest after) unless
``--no-manual-gc-eval``. These are Megatron-LM's points and defaults. No torch import.
"""
from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass
from typing import Iterator

from dynapipe.errors import DynaPipeError


@dataclass(frozen=True)
class ManualGC:
    """``enabled``: ``--manual-gc``; ``interval``: ``--manual-gc-interval`` (iterations, 0 =
    none); ``eval``: collect around periodic evaluations (``--no-manual-gc-eval`` clears it)."""

    enabled: bool = False
    interval: int = 0
    eval: bool = True

    def validate(self) -> "ManualGC":
        """``self``, or ``DynaPipeError`` naming the bad interval, or a setting that would do
        nothing without ``--manual-gc`` (Megatron-LM ignores those; this build refuses them)."""
        if not self.enabled and (self.interval or not self.eval):
            flag = f"--manual-gc-interval {self.interval}" if self.interval else "--no-manual-gc-eval"
            raise DynaPipeError(f"{flag} has no effect without --manual-gc: add --manual-gc, or drop it.")
        if self.interval < 0:
            raise DynaPipeError(f"--manual-gc-interval {self.interval}: must be >= 0 iterations "
                                f"(0: no collection between training iterations).")
        return self

    def start(self) -> bool:
        """Before the first training iteration: with ``enabled``, the collector off and one
        full collection. Returns whether the collector was on, for :meth:`stop`."""
        was = gc.isenabled()
        if self.enabled:
            gc.disable()
            gc.collect()
        return was

    def stop(self, was_enabled: bool) -> None:
        """After training: the collector back as :meth:`start` found it (a process may train
        several runs, as the bench's jobs do)."""
        if self.enabled and was_enabled:
            gc.enable()

    def after_iteration(self, iteration: int) -> None:
        """After training iteration ``iteration`` (1-based): a full collection when it is a
        multiple of a non-zero ``interval``."""
        if self.enabled and self.interval and iteration % self.interval == 0:
            gc.collect()

    @contextlib.contextmanager
    def evaluation(self) -> Iterator[None]:
        """Around a periodic evaluation: every generation collected before, the youngest
        (what the evaluation made) after."""
        collect = self.enabled and self.eval
        if collect:
            gc.collect()
        yield
        if collect:
            gc.collect(generation=0)
