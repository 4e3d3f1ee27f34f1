"""Adaptive interleaved schedule: wait-free, memory-bounded list scheduling over chunks.

Megatron's interleaved 1F1B (:mod:`dynapipe.schedule.interleaved`) fixes every rank's op
order in advance. With micro-batches of different shapes, and chunks as unequal as a
T5's encoder and decoder halves, a rank then waits for the op the pattern names while
other work is ready. Here every rank, whenever it is free, runs what is ready:

* a backward whose gradient has arrived (the earliest arrival; it releases memory and
  feeds the ranks upstream), else
* a forward whose input has arrived, each chunk's forwards in micro-batch order, the
  deepest virtual stage first (it brings its micro-batch closest to its backward), if
  admitting it keeps the rank's memory (model states + stored activations of every op in
  flight + its transient peak) within the limit; a rank with nothing in flight always
  admits one, so the schedule never deadlocks.

The op orders are then fixed into a chunked :class:`~dynapipe.schedule.types.Schedule`
and priced by :func:`~dynapipe.schedule.interleaved.chunked_kernel` like any other, so it
compiles into plans (:func:`~dynapipe.plan.compile_chunked.compile_chunked_plans`) and runs
on the executor unchanged. The schedule search tries it beside interleaved 1F1B and keeps
the faster that fits: list scheduling without look-ahead loses to the fixed pattern on
deep pipelines of uniform work, and wins where work is uneven (T5, 2 ranks: 4-8% less
simulated time). Pure Python + numpy; ms and MiB.
"""
from __future__ import annotations

import heapq

import numpy as np

from dynapipe.schedule import _kernels as K
from dynapipe.schedule.costs import StageTimes

INTERLEAVED_ADAPTIVE = "interleaved-adaptive"


def interleaved_adaptive_orders(times: StageTimes, num_ranks: int, capacity_mib: float = np.inf) -> tuple:
    """Every rank's op order ``(kind, mb, chunk, nops)`` as ``[P, 2 v M]`` arrays (kind
    ``K.F``/``K.B``) for ``times`` of ``V = v * P`` virtual stages (``state_mib`` per rank);
    ``capacity_mib``: memory one rank may use (MiB), model states included."""
    P, V, M = num_ranks, times.num_stages, times.num_micro_batches
    v = V // P
    fw, bw, st, pk = times.fw_ms, times.bw_ms, times.stored_mib, times.peak_mib
    ac, gc = times.act_comm_ms, times.grad_comm_ms
    state = np.asarray(times.state_mib, dtype=np.float64)
    free = np.zeros(P)
    stored = np.zeros(P)
    inflight = np.zeros(P, dtype=np.int64)
    f_next = np.zeros((P, v), dtype=np.int64)  # each chunk's next forward, in micro-batch order
    f_ready: dict = {(0, m): 0.0 for m in range(M)}  # (virtual stage, mb) -> input arrival (ms)
    b_ready: list[list] = [[] for _ in range(P)]  # heaps of (arrival ms, virtual stage, mb)
    orders: list[list] = [[] for _ in range(P)]
    remaining = 2 * V * M

    def options(s: int, memory: bool) -> list:
        """(start ms, 0 for a backward / 1 for a forward, -virtual stage, mb) rank ``s`` can run."""
        out = []
        if b_ready[s]:
            arrival, k, m = b_ready[s][0]
            out.append((max(free[s], arrival), 0, -k, m))
        for c in range(v):
            k, m = c * P + s, int(f_next[s, c])
            if m < M and (k, m) in f_ready and (not memory or inflight[s] == 0
                                                or state[s] + stored[s] + st[k, m] + pk[k, m] <= capacity_mib):
                out.append((max(free[s], f_ready[k, m]), 1, -k, m))
        return out

    while remaining:
        # The rank that can start something earliest decides next (nothing another rank does
        # later makes work ready for it sooner); at that time a backward goes first, then the
        # deepest forward. When memory blocks every rank, the earliest forward runs anyway.
        best = None
        for memory in (True, False):
            for s in range(P):
                opts = options(s, memory)
                if opts:
                    t = min(o[0] for o in opts)
                    pick = min(o for o in opts if o[0] <= t)[1:]
                    if best is None or t < best[0]:
                        best = (t, s, pick)
            if best is not None:
                break
        t, s, (is_fw, neg_k, m) = best
        k = -neg_k
        if not is_fw:
            heapq.heappop(b_ready[s])
            end = t + bw[k, m]
            stored[s] -= st[k, m]
            inflight[s] -= 1
            orders[s].append((K.B, m, k // P))
            if k > 0:
                heapq.heappush(b_ready[(k - 1) % P], (end + gc[k - 1, m], k - 1, m))
        else:
            end = t + fw[k, m]
            stored[s] += st[k, m]
            inflight[s] += 1
            f_next[s, k // P] += 1
            del f_ready[k, m]
            orders[s].append((K.F, m, k // P))
            if k < V - 1:
                f_ready[k + 1, m] = end + ac[k, m]
            else:
                heapq.heappush(b_ready[s], (end, k, m))
        free[s] = end
        remaining -= 1
    L = max(2 * v * M, 1)
    kind, mb, ch = (np.zeros((P, L), dtype=np.int64) for _ in range(3))
    for s, seq in enumerate(orders):
        for j, (a, m, c) in enumerate(seq):
            kind[s, j], mb[s, j], ch[s, j] = a, m, c
    return kind, mb, ch, np.array([len(o) for o in orders], dtype=np.int64)
