"""The rerun state machine's numbers: how two results of one iteration compare, when a value is
unexpectedly large (``--check-for-spiky-loss``, ``--check-for-large-grads``), and the
determinism statistics of ``--rerun-mode report_stats``, as Megatron-LM computes them.
:mod:`megatron_integration.rerun` drives them.
"""
from __future__ import annotations

import math

# Megatron-LM's tolerances (relative): none for the loss, 0.1% for gradient norms (reductions
# whose order is not fixed, such as flash attention's backward, change them slightly).
LOSS_TOLERANCE = 0.0
GRAD_NORM_TOLERANCE = 1e-3
STATS_SAMPLES = 100_000  # differing samples report_stats keeps, as Megatron-LM's QuickStats
# Megatron-LM's spike checks: a value is unexpectedly large at SPIKE_FACTOR times the largest of
# the first LARGE_VALUE_SAMPLES values (10 and 100 in its pretrain_gpt.py and megatron-core's DDP).
SPIKE_FACTOR = 10.0
LARGE_VALUE_SAMPLES = 100


def compare(a: float, b: float) -> float:
    """The relative difference of two results (0: the same, inf: one is NaN or infinite and the
    other is not), as Megatron-LM compares them."""
    if a == b or (math.isnan(a) and math.isnan(b)):
        return 0.0
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs((a - b) / (a + b) * 2) if a + b else math.inf


class LargeValues:
    """Megatron-LM's ``is_unexpectedly_large`` for one quantity of every rank: the first
    :data:`LARGE_VALUE_SAMPLES` finite values of a rank set its scale (their largest magnitude),
    later ones of :data:`SPIKE_FACTOR` times that or more are unexpectedly large. NaN and Inf are
    the NaN check's, not counted here."""

    def __init__(self):
        self.count: dict[int, int] = {}
        self.largest: dict[int, float] = {}

    def large(self, rank: int, value: float) -> bool:
        """Whether ``value`` of ``rank`` is unexpectedly large (while the scale is set: never)."""
        v = abs(value)
        if not math.isfinite(v):
            return False
        if self.count.get(rank, 0) < LARGE_VALUE_SAMPLES:
            self.count[rank] = self.count.get(rank, 0) + 1
            self.largest[rank] = max(self.largest.get(rank, 0.0), v)
            return False
        return v >= self.largest[rank] * SPIKE_FACTOR


class QuickStats:
    """Relative differences between runs of the same iteration (``report_stats``): the identical
    ones counted, the others kept (the newest :data:`STATS_SAMPLES`, as Megatron-LM keeps them)."""

    def __init__(self):
        self.samples: list[float] = []
        self.identical = 0
        self.seen = 0  # differing samples recorded, kept or not
        self.max = 0.0  # of every sample recorded, kept or not (Megatron-LM's all-time maximum)

    def record(self, diff: float) -> None:
        """Add one relative difference (0: identical)."""
        if diff == 0.0:
            self.identical += 1
            return
        self.max = max(self.max, diff)
        if len(self.samples) < STATS_SAMPLES:
            self.samples.append(diff)
        else:
            self.samples[self.seen % STATS_SAMPLES] = diff
        self.seen += 1

    def line(self) -> str:
        """Megatron-LM's summary: counts, mean, percentiles and maximum of the kept samples."""
        total = self.identical + len(self.samples)
        if not self.samples:
            return f"{total:,} samples, all identical"
        s = sorted(self.samples)

        def pct(p: float) -> str:
            i = int(total * p) - self.identical
            return f"{s[i]:.3E}" if i >= 0 else "0.0"
        return (f"{total:,}/{self.identical:,} total/identical samples, rel. variability: avg= "
                f"{sum(s) / total:.3E}, p50= {pct(0.5)}, p90= {pct(0.9)}, p99= {pct(0.99)}, "
                f"p99.9= {pct(0.999)}, max: {self.max:.3E}")
