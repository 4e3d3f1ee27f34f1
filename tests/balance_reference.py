"""The original pure-Python replica balancing, kept as the reference the numpy one must reproduce exactly.

Every replica runs its own micro-batches through its own pipeline and the replicas meet
at the gradient all-reduce, so the iteration waits for the most loaded one. The
micro-batch times are split into ``dp`` parts of near-equal sum with the Karmarkar-Karp
largest-differencing method, then improved by moves and swaps between the heaviest and
lightest parts while that lowers the heaviest.
"""
from __future__ import annotations

import heapq
from typing import Sequence


def karmarkar_karp(weights: Sequence[float], parts: int) -> list[int]:
    """Assign each weight to one of ``parts`` parts with the largest differencing method.

    Each item starts as a partial partition (itself in one part, the others empty).
    Repeatedly the two partial partitions with the largest spread are merged, the
    heaviest part of one joining the lightest of the other, until one remains.
    Returns the part of each weight; parts are numbered by descending sum.
    """
    if parts < 1:
        raise ValueError(f"parts={parts} must be at least 1")
    n = len(weights)
    if parts == 1 or n == 0:
        return [0] * n
    # (negative spread, tie-break, sums descending, item lists)
    heap = []
    for i, w in enumerate(weights):
        sums = [float(w)] + [0.0] * (parts - 1)
        heap.append((-float(w), i, sums, [[i]] + [[] for _ in range(parts - 1)]))
    heapq.heapify(heap)
    counter = n
    while len(heap) > 1:
        _, _, sa, ia = heapq.heappop(heap)
        _, _, sb, ib = heapq.heappop(heap)
        merged = sorted(((sa[p] + sb[parts - 1 - p], ia[p] + ib[parts - 1 - p]) for p in range(parts)),
                        key=lambda x: -x[0])
        sums = [m[0] for m in merged]
        heapq.heappush(heap, (-(sums[0] - sums[-1]), counter, sums, [m[1] for m in merged]))
        counter += 1
    assignment = [0] * n
    for p, items in enumerate(heap[0][3]):
        for i in items:
            assignment[i] = p
    return assignment


def _improve(weights: Sequence[float], assignment: list[int], parts: int, max_rounds: int = 64,
             max_pairs: int = 40_000) -> list[int]:
    """Move or swap items between the heaviest and lightest parts while the heaviest drops.

    Each step strictly lowers the sum of squared part sums, so it terminates; the rounds
    and the pairs a swap search may try are capped to bound the time on large batches.
    """
    sums = [0.0] * parts
    for i, p in enumerate(assignment):
        sums[p] += weights[i]
    for _ in range(max_rounds):
        hi = max(range(parts), key=lambda p: sums[p])
        lo = min(range(parts), key=lambda p: sums[p])
        gap = sums[hi] - sums[lo]
        if gap <= 0:
            break
        heavy = [i for i, p in enumerate(assignment) if p == hi]
        light = [i for i, p in enumerate(assignment) if p == lo]
        # Moving d from hi to lo lowers the pair's maximum iff 0 < d < gap; best is d nearest gap / 2.
        best, best_move = gap, None
        for i in heavy:
            d = weights[i]
            if 0 < d < gap and abs(gap - 2 * d) < best:
                best, best_move = abs(gap - 2 * d), (i, None)
            for k in (light if len(heavy) * len(light) <= max_pairs else ()):
                d2 = weights[i] - weights[k]
                if 0 < d2 < gap and abs(gap - 2 * d2) < best:
                    best, best_move = abs(gap - 2 * d2), (i, k)
        if best_move is None:
            break
        i, k = best_move
        assignment[i] = lo
        sums[hi] -= weights[i]
        sums[lo] += weights[i]
        if k is not None:
            assignment[k] = hi
            sums[lo] -= weights[k]
            sums[hi] += weights[k]
    return assignment


def balance_replicas(times_ms: Sequence[float], dp: int) -> list[int]:
    """The replica (0..dp-1) of each micro-batch, balancing the summed ``times_ms`` per replica."""
    weights = [float(t) for t in times_ms]
    assignment = karmarkar_karp(weights, dp)
    return _improve(weights, assignment, dp) if dp > 1 else assignment


def replica_times(times_ms: Sequence[float], assignment: Sequence[int], dp: int) -> list[float]:
    """Summed time in ms of the micro-batches of each replica."""
    sums = [0.0] * dp
    for t, r in zip(times_ms, assignment):
        sums[r] += float(t)
    return sums
