"""Balancing micro-batches across data-parallel replicas (multi-way number partitioning).

Every replica runs its own micro-batches through its own pipeline and the replicas meet
at the gradient all-reduce, so the iteration waits for the most loaded one. The
micro-batch times are split into ``dp`` parts of near-equal sum with the Karmarkar-Karp
largest-differencing method, then improved by moves and swaps between the heaviest and
lightest parts while that lowers the heaviest.

Both steps are numpy over the ``dp`` parts (or the heavy x light pairs); they perform
the same float operations in the same order as the one-item-at-a-time formulation kept
in ``tests/balance_reference.py`` and return the same assignment.

When the micro-batches are too few to come out even, :func:`split_to_balance` splits the
slowest replica's micro-batches in two while that shortens the iteration.
"""
from __future__ import annotations

import heapq
from typing import Callable, Optional, Sequence

import numpy as np

from dynapipe.batching import _balance_kernel as _kernel


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
    # Parts are not lists of items but nodes of a merge forest: ids < n are the items,
    # id n is "empty", and merge k creates ids base_k .. base_k + parts - 1 whose two
    # children are recorded in ``left``/``right``. Assignments are read off at the end.
    w = np.asarray([float(x) for x in weights], dtype=np.float64)
    if _kernel.compiled():
        return _kernel.karmarkar_karp_labels(w, parts).tolist()
    empty = n
    init_sums = np.zeros((n, parts))
    init_sums[:, 0] = w
    init_ids = np.full((n, parts), empty, dtype=np.int64)
    init_ids[:, 0] = np.arange(n)
    heap = [(-float(w[i]), i, init_sums[i], init_ids[i]) for i in range(n)]
    heapq.heapify(heap)
    counter = n
    new_ids = np.arange(n + 1, n + 1 + (n - 1) * parts, dtype=np.int64).reshape(max(n - 1, 0), parts)
    lefts, rights = [], []
    while len(heap) > 1:
        _, _, sa, ia = heapq.heappop(heap)
        _, _, sb, ib = heapq.heappop(heap)
        merged = sa + sb[::-1]
        # A stable sort on the negated sums keeps equal sums in part order, as sorted() does.
        order = np.argsort(-merged, kind="stable")
        sums = merged[order]
        lefts.append(ia[order])
        rights.append(ib[::-1][order])
        heapq.heappush(heap, (-(float(sums[0]) - float(sums[-1])), counter, sums, new_ids[counter - n]))
        counter += 1
    next_id = n + 1 + (n - 1) * parts
    label = np.zeros(next_id, dtype=np.int64)
    label[heap[0][3]] = np.arange(parts)
    # Children always have smaller ids than their parent: walk the merges newest first.
    base = next_id
    for left, right in zip(reversed(lefts), reversed(rights)):
        base -= parts
        lab = label[base:base + parts]
        label[left] = lab
        label[right] = lab
    return label[:n].tolist()


def _improve(weights: Sequence[float], assignment: list[int], parts: int, max_rounds: int = 64,
             max_pairs: int = 40_000) -> list[int]:
    """Move or swap items between the heaviest and lightest parts while the heaviest drops.

    Each step strictly lowers the sum of squared part sums, so it terminates; the rounds
    and the pairs a swap search may try are capped to bound the time on large batches.
    Among equally good steps the first in (heavy item, then its move before its swaps
    with the light items) order is taken.
    """
    w = np.asarray(weights, dtype=np.float64)
    assign = np.asarray(assignment, dtype=np.int64)
    sums = [0.0] * parts
    for i, p in enumerate(assignment):
        sums[p] += weights[i]
    for _ in range(max_rounds):
        hi = max(range(parts), key=lambda p: sums[p])
        lo = min(range(parts), key=lambda p: sums[p])
        gap = sums[hi] - sums[lo]
        if gap <= 0:
            break
        heavy = np.flatnonzero(assign == hi)
        light = np.flatnonzero(assign == lo)
        # Moving d from hi to lo lowers the pair's maximum iff 0 < d < gap; best is d nearest gap / 2.
        # Column 0 is moving the heavy item, column 1 + k swapping it with light item k.
        if len(heavy) * len(light) <= max_pairs:
            d = np.empty((len(heavy), 1 + len(light)))
            d[:, 0] = w[heavy]
            d[:, 1:] = w[heavy][:, None] - w[light][None, :]
        else:
            d = w[heavy][:, None]
        score = np.where((d > 0) & (d < gap), np.abs(gap - 2 * d), np.inf)
        if score.size == 0:
            break
        flat = int(np.argmin(score))
        if not score.flat[flat] < gap:
            break
        row, col = divmod(flat, score.shape[1])
        i = int(heavy[row])
        k = int(light[col - 1]) if col > 0 else None
        assign[i] = lo
        sums[hi] -= weights[i]
        sums[lo] += weights[i]
        if k is not None:
            assign[k] = hi
            sums[lo] -= weights[k]
            sums[hi] += weights[k]
    return assign.tolist()


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


def balanced_objective_ms(times_ms: Sequence[float], dp: int, num_stages: int) -> float:
    """The iteration estimate with the micro-batches placed by :func:`balance_replicas`:
    the slowest replica's summed time plus ``(num_stages - 1)`` times the longest
    micro-batch (ms). Equals the DP's ``sum / dp + (S - 1) max`` only when the replicas
    come out even."""
    return _balanced(times_ms, dp, num_stages)[0]


def _balanced(times_ms: Sequence[float], dp: int, num_stages: int) -> tuple[float, list[float], list[int]]:
    if not len(times_ms):
        return 0.0, [0.0] * dp, []
    assign = balance_replicas(times_ms, dp)
    sums = replica_times(times_ms, assign, dp)
    return max(sums) + (num_stages - 1) * max(float(t) for t in times_ms), sums, assign


def _at_max(sums: Sequence[float]) -> int:
    """How many replicas run as long as the slowest (within a relative 1e-9)."""
    top = max(sums)
    return sum(1 for x in sums if x >= top * (1 - 1e-9))


def split_to_balance(cuts: Sequence[tuple[int, int]], time_of: Callable[[int, int], Optional[float]], dp: int,
                     num_stages: int, *, tolerance: float = 1e-2, max_splits: Optional[int] = None,
                     tries: int = 4) -> tuple[list[tuple[int, int]], int, float]:
    """Split micro-batches of the slowest replica in two while that lowers
    :func:`balanced_objective_ms` (or keeps it and leaves fewer replicas tied at the slowest);
    returns the new cuts, the number of splits and that objective (ms).

    The DP's objective divides the summed time by ``dp`` as if any split of it were
    possible; with few micro-batches a replica (``3`` micro-batches on ``2`` replicas, or
    fewer micro-batches than replicas) waits for another the whole iteration. ``cuts`` are
    ``(start, end)`` positions of the ordered samples; ``time_of(start, end)`` prices
    positions ``start .. end - 1`` as one micro-batch (ms), or ``None`` when that is not a
    candidate (every given cut must be one). A micro-batch is split at its middle, the slowest replica's longest first
    (its ``tries`` longest each round). Nothing is tried while the slowest replica runs
    within ``tolerance`` of the objective above the mean, as with many micro-batches a
    replica: each try rebalances every micro-batch. Then, while fewer micro-batches than
    replicas remain (the slowest replica's one sample cannot be split), the longest
    micro-batch of several samples anywhere is split, where the objective grows by at most
    ``tolerance``: with as many micro-batches as replicas, balancing gives every replica one.
    ``max_splits`` bounds the splits (default ``64 + 2 x dp``: a replica left without a
    micro-batch needs one split at least).
    """
    if max_splits is None:
        max_splits = 64 + 2 * max(dp, 1)
    cuts = [(int(s), int(e)) for s, e in cuts]
    times = [float(time_of(s, e)) for s, e in cuts]
    best, sums, assign = _balanced(times, max(dp, 1), num_stages)
    splits = 0

    def first_taken(candidates, accept) -> bool:
        """Split the first of ``candidates`` (micro-batch indices) whose halves are candidates
        and whose balanced objective ``accept(value, replica sums)`` takes; False if none."""
        nonlocal times, best, sums, assign, splits
        for i in candidates:
            s, e = cuts[i]
            mid = (s + e) // 2
            first, second = time_of(s, mid), time_of(mid, e)
            if first is None or second is None:
                continue
            trial = times[:i] + [float(first), float(second)] + times[i + 1:]
            value, trial_sums, trial_assign = _balanced(trial, dp, num_stages)
            if accept(value, trial_sums):
                cuts[i:i + 1] = [(s, mid), (mid, e)]
                times, best, sums, assign, splits = trial, value, trial_sums, trial_assign, splits + 1
                return True
        return False

    while dp > 1 and splits < max_splits and max(sums) - sum(sums) / dp > tolerance * best:
        heavy = max(range(dp), key=lambda r: sums[r])
        order = sorted((i for i, r in enumerate(assign) if r == heavy and cuts[i][1] - cuts[i][0] > 1),
                       key=lambda i: -times[i])[:tries]
        # Better, or as good with fewer replicas at the slowest: where several tie there, one
        # split cannot lower the objective, but it is a step to the split that does.
        if not first_taken(order, lambda value, trial_sums: value < best * (1 - 1e-9) or (
                value <= best * (1 + 1e-9) and _at_max(trial_sums) < _at_max(sums))):
            break  # no split of the slowest replica helps
    # A replica left without a micro-batch (the slowest holds one sample, which cannot be split)
    # idles and, under interleaved chunks with an overlapped gradient reduction, cannot order its
    # chunks' reductions with the others': split elsewhere until every replica has one, where
    # that costs at most ``tolerance`` of the objective (it usually costs nothing: the slowest
    # replica is unchanged).
    while dp > 1 and splits < max_splits and len(cuts) < dp:
        longest = sorted((i for i, (s, e) in enumerate(cuts) if e - s > 1), key=lambda i: -times[i])
        if not first_taken(longest, lambda value, _: value <= best * (1 + tolerance)):
            break  # no micro-batch can be split for it
    return cuts, splits, best
