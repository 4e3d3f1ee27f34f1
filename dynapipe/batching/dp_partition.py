"""Exact DP cut of an ordered batch into consecutive micro-batches.

Minimises ``T = sum(t) / dp + (S - 1) * max(t)`` over all cuts of the order into
consecutive candidate micro-batches (see :mod:`dynapipe.batching.candidates`).

For a cap ``v`` on the slowest micro-batch, ``F(v)`` (the least total time of a cut in
which no micro-batch takes longer than ``v``) is a plain shortest-path DP. The optimum
is ``min over v of G(v) = F(v)/dp + (S - 1) v`` with ``v`` ranging over the candidate
times. ``F`` never rises as ``v`` grows, so most caps need no solve:

- solving ``F(v)`` yields a cut whose slowest micro-batch ``m`` may be faster than
  ``v``; then ``F`` is constant on ``[m, v]`` and that whole range is settled;
- every ``v'`` below an evaluated cap ``v_hi`` has ``F(v') >= F(v_hi)``, so over a range
  of candidates ``G >= F(v_hi)/dp + (S - 1) * (the range's smallest v')``; and no ``F``
  is below ``F(largest cap)``, which bounds every ``v`` from above. Ranges whose bound
  is no better than the best cut found so far are pruned;
- ranges are split at their middle candidate and explored best bound first, so the best
  cut tightens early (a dozen solves for thousands of samples in practice).

The DP inner loop runs in a small C extension when it is built, otherwise in numpy;
both perform the same additions in the same order and give identical results.
"""
from __future__ import annotations

import heapq
import warnings
from dataclasses import dataclass
from typing import Optional

import numpy as np

from dynapipe.batching.candidates import CandidateTable
from dynapipe.errors import DynaPipeError

try:  # built by setup.py; optional
    from dynapipe.batching import _dp_kernel
except ImportError:  # pragma: no cover - exercised when the extension is not built
    _dp_kernel = None


def _warn_fallback() -> None:
    """Say once per process that the DP runs its numpy loop, an order of magnitude slower than
    the C one, which misses the planning-time targets (an optional extension that failed to build is
    otherwise silent)."""
    global _fallback_warned
    if not _fallback_warned:
        _fallback_warned = True
        warnings.warn("dynapipe: the planner's C loop (dynapipe.batching._dp_kernel) is not built, so the DP runs "
                      "its numpy loop, an order of magnitude slower; reinstall with a C compiler present "
                      "(pip install -e .).",
                      stacklevel=3)


_fallback_warned = False


def compiled_kernel_available() -> bool:
    """Whether the C inner loop was built (``pip install -e .`` builds it)."""
    return _dp_kernel is not None


def _solve_capped_numpy(table: CandidateTable, cap: float, total: np.ndarray,
                        choice: np.ndarray) -> tuple[float, float]:
    n, t, off, rlen, rows = table.n, table.time_ms, table.offsets, table.row_len, table.row_of_end
    total[0], choice[0] = 0.0, 0
    for j in range(1, n + 1):
        r = rows[j]
        k_max = min(int(rlen[r]), j)
        row = t[off[r]: off[r] + k_max]
        prev = total[j - 1::-1]  # total[j-1], total[j-2], ..., total[0]: prefix before k = 1, 2, ...
        if table.monotone:
            row = row[: int(np.searchsorted(row, cap, side="right"))]
            cost = prev[: len(row)] + row
        else:
            cost = np.where(row <= cap, prev[:k_max] + row, np.inf)
        if len(cost) == 0:
            total[j], choice[j] = np.inf, 0
            continue
        a = int(np.argmin(cost))
        total[j] = cost[a]
        choice[j] = a + 1 if np.isfinite(cost[a]) else 0
    if not np.isfinite(total[n]):
        return float(total[n]), float("inf")
    max_t, j = 0.0, n
    while j > 0:
        max_t = max(max_t, float(t[off[rows[j]] + choice[j] - 1]))
        j -= int(choice[j])
    return float(total[n]), max_t


def solve_capped(table: CandidateTable, cap_ms: float, total: np.ndarray, choice: np.ndarray,
                 use_compiled: Optional[bool] = None) -> tuple[float, float]:
    """``F(cap_ms)`` and the slowest micro-batch (ms) of the cut attaining it.

    Fills ``total[j]`` (least total ms of the first j samples) and ``choice[j]`` (size of
    the last micro-batch of that prefix; 0 where no cut exists). ``use_compiled``:
    ``None`` uses the C loop when built, ``True`` requires it, ``False`` forces numpy.
    """
    if use_compiled is None:
        use_compiled = _dp_kernel is not None
    if use_compiled:
        if _dp_kernel is None:
            raise RuntimeError("the compiled DP kernel is not built; run `pip install -e .`")
        # The kernel reads raw native float64/int64 buffers: inputs of another dtype or byte
        # order are converted (no copy when they already are); the outputs it fills must be.
        f8, i8 = np.dtype(np.float64), np.dtype(np.int64)
        if total.dtype != f8 or choice.dtype != i8:
            raise DynaPipeError(f"solve_capped: total must be native float64 and choice native int64 arrays "
                                f"(given {total.dtype.str} and {choice.dtype.str}).")
        return _dp_kernel.solve_capped(np.ascontiguousarray(table.time_ms, dtype=f8),
                                       np.ascontiguousarray(table.offsets, dtype=i8),
                                       np.ascontiguousarray(table.row_len, dtype=i8),
                                       np.ascontiguousarray(table.row_of_end, dtype=i8),
                                       float(cap_ms), table.monotone, total, choice)
    return _solve_capped_numpy(table, float(cap_ms), total, choice)


# The cut's objective is an estimate from the cost model, whose own error is percents;
# proving the last 0.1% of it optimal costs most of the search at cluster scale (81 of
# 100,000 samples' capped solves at PP8 x DP64 against 24 within 0.1%).
DEFAULT_GAP = 1e-3


@dataclass
class Partition:
    """An optimal cut: micro-batches as (start, end) positions of the order, end exclusive."""

    cuts: list[tuple[int, int]]
    objective_ms: float
    total_ms: float
    max_ms: float
    evaluations: int = 0
    candidates: int = 0
    kernel: str = "numpy"


def cuts_from_choice(choice: np.ndarray, n: int) -> list[tuple[int, int]]:
    """Walk the DP's choices back from position n into (start, end) micro-batches."""
    cuts, j = [], n
    while j > 0:
        k = int(choice[j])
        if k <= 0:
            raise ValueError(f"no cut reaches position {j}")
        cuts.append((j - k, j))
        j -= k
    return cuts[::-1]


def optimal_partition(table: CandidateTable, num_stages: int, dp: int = 1,
                      use_compiled: Optional[bool] = None, gap: float = 0.0) -> Partition:
    """The cut minimising ``sum(t)/dp + (num_stages - 1) * max(t)`` (ms).

    ``gap``: relative optimality gap; the search stops once no candidate cap left can
    beat the best cut found by more than this fraction of it (0: the exact optimum, as
    the tests' brute force checks; the planner uses :data:`DEFAULT_GAP`).
    """
    if not 0.0 <= gap < 1.0:
        raise ValueError(f"gap={gap} must lie in [0, 1)")
    n, w = table.n, float(num_stages - 1)
    if use_compiled is None:
        use_compiled = _dp_kernel is not None
        if not use_compiled:
            _warn_fallback()
    cands = np.sort(table.time_ms[np.isfinite(table.time_ms)])
    total = np.empty(n + 1, dtype=np.float64)
    choice = np.zeros(n + 1, dtype=np.int64)

    def solve(v: float) -> tuple[float, float]:
        return solve_capped(table, v, total, choice, use_compiled)

    f_top, m_top = solve(float(cands[-1]))
    evaluations = 1
    if not np.isfinite(f_top):
        raise ValueError("no cut of the batch fits; every sample should fit alone")
    best, best_choice, best_f, best_m = f_top / dp + w * m_top, choice.copy(), f_top, m_top
    f_floor = f_top  # F at the largest cap: no F is lower

    # Heap of (lower bound, lo, hi, F at a cap above the range): candidates cands[lo:hi].
    heap = [(f_top / dp + w * float(cands[0]), 0, int(np.searchsorted(cands, m_top, "left")), f_top)]
    while heap:
        bound, lo, hi, f_above = heapq.heappop(heap)
        if bound >= best * (1.0 - gap):
            break
        if w > 0:  # G(v) >= F_floor/dp + w v, so only v below this can still win
            hi = min(hi, int(np.searchsorted(cands, (best - f_floor / dp) / w, "left")))
        if hi <= lo:
            continue
        mid = (lo + hi - 1) // 2
        v = float(cands[mid])
        f, m = solve(v)
        evaluations += 1
        right = int(np.searchsorted(cands, v, "right"))
        if right < hi:
            heapq.heappush(heap, (f_above / dp + w * float(cands[right]), right, hi, f_above))
        if not np.isfinite(f):
            continue  # no cut at this cap, nor at any lower one
        obj = f / dp + w * m
        if obj < best:
            best, best_choice, best_f, best_m = obj, choice.copy(), f, m
        left_hi = min(int(np.searchsorted(cands, m, "left")), mid)
        if left_hi > lo:
            heapq.heappush(heap, (f / dp + w * float(cands[lo]), lo, left_hi, f))
    return Partition(cuts=cuts_from_choice(best_choice, n), objective_ms=best, total_ms=best_f, max_ms=best_m,
                     evaluations=evaluations, candidates=len(cands), kernel="c" if use_compiled else "numpy")
