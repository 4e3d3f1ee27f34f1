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
  flight + the largest transient peak among them) within the limit; a rank with nothing
  in flight always admits one, and when memory blocks every rank the earliest ready op
  runs anyway, so the schedule never deadlocks (its peak may then exceed the limit, and the
  search discards it as over memory).

The op orders are then fixed into a chunked :class:`~dynapipe.schedule.types.Schedule`
and priced by :func:`~dynapipe.schedule.interleaved.chunked_kernel` like any other, so it
compiles into plans (:func:`~dynapipe.plan.compile_chunked.compile_chunked_plans`) and runs
on the executor unchanged. The schedule search tries it beside interleaved 1F1B and keeps
the faster that fits: list scheduling without look-ahead loses to the fixed pattern on
deep pipelines of uniform work, and wins where work is uneven (T5, 2 ranks: 4-8% less
simulated time). The loop is a kernel compiled with numba like the simulator's
(:mod:`dynapipe.schedule._kernels`), so trying it costs the search little. Numpy; ms and MiB.
"""
from __future__ import annotations

import numpy as np

from dynapipe.errors import DynaPipeError
from dynapipe.schedule import _kernels as K
from dynapipe.schedule.costs import StageTimes

INTERLEAVED_ADAPTIVE = "interleaved-adaptive"


def interleaved_adaptive_orders(times: StageTimes, num_ranks: int, capacity_mib: float = np.inf) -> tuple:
    """Every rank's op order ``(kind, mb, chunk, nops)`` as ``[P, 2 v M]`` arrays (kind
    ``K.F``/``K.B``) for ``times`` of ``V = v * P`` virtual stages (``state_mib`` per rank);
    ``capacity_mib``: memory one rank may use (MiB), model states included."""
    f64 = lambda a: np.ascontiguousarray(a, dtype=np.float64)  # noqa: E731
    V, M = times.num_stages, times.num_micro_batches
    if num_ranks < 1 or V % num_ranks or len(times.state_mib) != num_ranks:
        raise DynaPipeError(f"interleaved-adaptive: {V} virtual stages and model states of {len(times.state_mib)} "
                            f"ranks do not make whole chunks on {num_ranks} ranks.")
    comm = np.zeros((max(V - 1, 1), M))
    ac = f64(times.act_comm_ms) if V > 1 else comm
    gc = f64(times.grad_comm_ms) if V > 1 else comm
    return _orders_kernel(f64(times.fw_ms), f64(times.bw_ms), f64(times.stored_mib), f64(times.peak_mib), ac, gc,
                          f64(times.state_mib), int(num_ranks), float(capacity_mib))


@K._jit
def _earliest(s, memory, P, v, M, free, stored, inflight, f_next, f_arr, b_arr, b_done, st, pk, state, capacity):
    """Rank ``s``'s next op at its earliest start: ``(start ms, kind, virtual stage, mb)``,
    kind -1 when it has none. A backward whose gradient arrived first (the earliest
    arrival), then the deepest forward whose input arrived and (``memory``) fits: the
    rank's model states, stored activations and the new forward's, and the largest
    transient peak of any op in flight (a later backward runs on top of them all)."""
    best_t, best_kind, best_k, best_m = np.inf, -1, -1, -1
    # The earliest-arriving backward of the rank (ties: lower virtual stage, then mb), and
    # the largest transient peak among its micro-batches in flight.
    b_t, b_k, b_m = np.inf, -1, -1
    high = 0.0
    for c in range(v):
        k = c * P + s
        for m in range(M):
            if m < f_next[s, c] and not b_done[k, m] and pk[k, m] > high:
                high = pk[k, m]
            if not b_done[k, m] and b_arr[k, m] < b_t:
                b_t, b_k, b_m = b_arr[k, m], k, m
    if b_k >= 0:
        best_t, best_kind, best_k, best_m = max(free[s], b_t), K.B, b_k, b_m
    for c in range(v - 1, -1, -1):  # deepest chunk first: it wins ties
        k = c * P + s
        m = f_next[s, c]
        if m >= M or f_arr[k, m] == np.inf:
            continue
        if memory and inflight[s] > 0 and state[s] + stored[s] + st[k, m] + max(pk[k, m], high) > capacity:
            continue
        t = max(free[s], f_arr[k, m])
        if t < best_t:  # a backward starting at the same time goes first
            best_t, best_kind, best_k, best_m = t, K.F, k, m
    return best_t, best_kind, best_k, best_m


@K._jit
def _orders_kernel(fw, bw, st, pk, ac, gc, state, P, capacity):
    V, M = fw.shape[0], fw.shape[1]
    v = V // P
    free = np.zeros(P)
    stored = np.zeros(P)
    inflight = np.zeros(P, np.int64)
    f_next = np.zeros((P, v), np.int64)  # each chunk's next forward, in micro-batch order
    f_arr = np.full((V, M), np.inf)  # when a forward's input arrives (ms)
    b_arr = np.full((V, M), np.inf)  # when a backward's gradient arrives (ms)
    b_done = np.zeros((V, M), np.bool_)
    for m in range(M):
        f_arr[0, m] = 0.0
    L = max(2 * v * M, 1)
    kind = np.zeros((P, L), np.int64)
    mb = np.zeros((P, L), np.int64)
    ch = np.zeros((P, L), np.int64)
    nops = np.zeros(P, np.int64)
    # Each rank's next op, recomputed only when something changed for it (it ran an op, or
    # an input or a gradient arrived for it).
    c_t = np.full(P, np.inf)
    c_kind = np.full(P, -1, np.int64)
    c_k = np.zeros(P, np.int64)
    c_m = np.zeros(P, np.int64)
    for s in range(P):
        c_t[s], c_kind[s], c_k[s], c_m[s] = _earliest(s, True, P, v, M, free, stored, inflight, f_next, f_arr,
                                                     b_arr, b_done, st, pk, state, capacity)
    for _ in range(2 * V * M):
        # The rank that can start something earliest decides next: nothing another rank
        # does later makes work ready for it sooner. When memory blocks every rank, the
        # earliest ready op runs regardless of memory (the search then judges the peak).
        s = -1
        for r in range(P):
            if c_kind[r] >= 0 and (s < 0 or c_t[r] < c_t[s]):
                s = r
        if s < 0:
            best, pick_kind, pick_k, pick_m = np.inf, -1, 0, 0
            for r in range(P):
                t, kd, k, m = _earliest(r, False, P, v, M, free, stored, inflight, f_next, f_arr, b_arr, b_done,
                                        st, pk, state, capacity)
                if kd >= 0 and t < best:
                    best, s, pick_kind, pick_k, pick_m = t, r, kd, k, m
            c_t[s], c_kind[s], c_k[s], c_m[s] = best, pick_kind, pick_k, pick_m
        t, k, m = c_t[s], c_k[s], c_m[s]
        j = nops[s]
        kind[s, j], mb[s, j], ch[s, j] = c_kind[s], m, k // P
        nops[s] += 1
        if c_kind[s] == K.B:
            end = t + bw[k, m]
            b_done[k, m] = True
            stored[s] -= st[k, m]
            inflight[s] -= 1
            if k > 0:
                b_arr[k - 1, m] = end + gc[k - 1, m]
        else:
            end = t + fw[k, m]
            stored[s] += st[k, m]
            inflight[s] += 1
            f_next[s, k // P] += 1
            f_arr[k, m] = np.inf
            if k < V - 1:
                f_arr[k + 1, m] = end + ac[k, m]
            else:
                b_arr[k, m] = end
        free[s] = end
        for r in (s, (k + 1) % P, (k - 1 + P) % P):
            c_t[r], c_kind[r], c_k[r], c_m[r] = _earliest(r, True, P, v, M, free, stored, inflight, f_next, f_arr,
                                                         b_arr, b_done, st, pk, state, capacity)
    return kind, mb, ch, nops
