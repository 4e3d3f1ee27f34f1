"""The simulation loops, compiled with numba when it is installed.

The kernels are plain loops over numpy arrays, written once: with numba they run
compiled (``cache=True`` keeps the machine code between processes), without it they run
as ordinary Python and give identical results, only slower. They take and return
arrays only; :mod:`dynapipe.schedule.simulator`, :mod:`dynapipe.schedule.adaptive` and
:mod:`dynapipe.schedule.interleaved` (the chunked kernels: op ``p`` of rank ``s`` runs
virtual stage ``chunk * P + s``) wrap them into schedules and timelines.

Op kinds are encoded ``0`` (forward), ``1`` (backward), and for a split backward ``2``
(its input-gradient part) and ``3`` (its weight-gradient part). Status codes: ``OK``;
``SLOW``: some op ended after ``abort_ms`` (the candidate cannot beat the best one);
``OVER``: a stage's memory exceeded ``abort_mib``; ``STUCK``: the op order cannot run.
"""
from __future__ import annotations

import numpy as np

try:  # optional: the same loops, compiled
    import numba as _numba
except ImportError:  # pragma: no cover - exercised where numba is not installed
    _numba = None

OK, SLOW, OVER, STUCK = 0, 1, 2, 3
F, B, BI, BW = 0, 1, 2, 3


def _jit(fn):
    if _numba is None:
        return fn
    return _numba.njit(cache=True, nogil=True)(fn)


def compiled() -> bool:
    """Whether the kernels run compiled (numba is installed)."""
    return _numba is not None


@_jit
def simulate_split_kernel(kind, mb, nops, fw, bw, st, pk, ac, gc, state, bww, ws, abort_ms, abort_mib):
    """Simulate fixed per-stage op orders of kinds F, B, BI and BW (``kind``/``mb``:
    ``[S, L]``, ``nops[s]`` used).

    ``bww[s, m]``: the weight-gradient part of ``bw[s, m]`` (ms): BI lasts ``bw - bww``,
    waits and signals like B; BW lasts ``bww`` and waits only for its own stage.
    ``ws[s, m]``: what the weight part keeps (MiB): BI releases ``st - ws`` (negative
    when the input part rematerialises more than was stored), BW releases ``ws``; a BW
    adds no transient peak (not modelled: its weight-sized gradient, and under sequence
    parallelism the gathered layer input; its gradients accumulate into
    the model states' buffers). Returns ``(status, starts, ends, busy, peak, stuck_stage)``;
    times in ms, memory in MiB with model states (``state``) included.
    """
    return chunked_split_kernel(kind, mb, np.zeros_like(kind), nops, fw, bw, st, pk, ac, gc, state, bww, ws,
                                abort_ms, abort_mib)


@_jit
def chunked_kernel(kind, mb, ch, nops, fw, bw, st, pk, ac, gc, state, abort_ms, abort_mib):
    """Simulate fixed per-rank op orders of kinds F and B over ``V`` virtual stages (``fw``...
    ``[V, M]``, ``state`` ``[P]``): :func:`chunked_split_kernel` with no weight parts.
    Returns ``(status, starts, ends, busy, peak, stuck_rank)``."""
    none = np.zeros_like(fw)
    return chunked_split_kernel(kind, mb, ch, nops, fw, bw, st, pk, ac, gc, state, none, none, abort_ms, abort_mib)


@_jit
def chunked_split_kernel(kind, mb, ch, nops, fw, bw, st, pk, ac, gc, state, bww, ws, abort_ms, abort_mib):
    """Simulate fixed per-rank op orders of kinds F, B, BI and BW over ``V`` virtual stages
    (``fw``... ``[V, M]``, ``state`` ``[P]``); op ``p`` of rank ``s`` runs virtual stage
    ``ch[s, p] * P + s`` (all zeros and ``V = P``: the plain pipeline of
    :func:`simulate_split_kernel`). Costs and memory per op as that function describes.
    Returns ``(status, starts, ends, busy, peak, stuck_rank)``.

    A rank runs ops while their inputs have arrived, then waits; a rank that made progress
    wakes its neighbours (the ranks its transfers reach: ``s - 1`` and ``s + 1``, around the
    ring between chunks), so every op is visited a bounded number of times.
    """
    P = kind.shape[0]
    V = fw.shape[0]
    M = fw.shape[1]
    L = kind.shape[1]
    ring = V > P
    f_end = np.full((V, M), -1.0)
    # When the gradient of micro-batch m leaves virtual stage k (the end of its B or BI).
    b_end = np.full((V, M), -1.0)
    starts = np.zeros((P, L))
    ends = np.zeros((P, L))
    busy = np.zeros(P)
    peak = state.copy()
    stored = np.zeros(P)
    ptr = np.zeros(P, np.int64)
    free = np.zeros(P)
    queued = np.ones(P, np.bool_)
    pending = np.empty(P + 2, np.int64)
    npend = 0
    for s in range(P - 1, -1, -1):
        pending[npend] = s
        npend += 1
    while npend > 0:
        npend -= 1
        s = pending[npend]
        queued[s] = False
        p = ptr[s]
        t = free[s]
        p0 = p
        while p < nops[s]:
            m = mb[s, p]
            k = ch[s, p] * P + s
            op = kind[s, p]
            if op == F:
                if k > 0:
                    dep = f_end[k - 1, m]
                    if dep < 0.0:
                        break
                    ready = dep + ac[k - 1, m]
                    if ready > t:
                        t = ready
                end = t + fw[k, m]
                f_end[k, m] = end
                high = stored[s] + st[k, m] + pk[k, m]
                stored[s] += st[k, m]
            elif op == BW:
                if b_end[k, m] < 0.0:
                    break  # its input part has not run: the order is broken
                end = t + bww[k, m]
                high = stored[s]
                stored[s] -= ws[k, m]
            else:
                if k < V - 1:
                    dep = b_end[k + 1, m]
                    if dep < 0.0:
                        break
                    ready = dep + gc[k, m]
                else:
                    ready = f_end[k, m]
                    if ready < 0.0:
                        break
                if ready > t:
                    t = ready
                high = stored[s] + pk[k, m]
                if op == B:
                    end = t + bw[k, m]
                    stored[s] -= st[k, m]
                else:
                    end = t + (bw[k, m] - bww[k, m])
                    stored[s] -= st[k, m] - ws[k, m]
                    # What the weight part keeps may exceed what was stored (full recompute), and
                    # the input part builds it up layer by layer: the last layer it rematerialises
                    # does so on top of the others' stashes (bounded by all of them).
                    if stored[s] + pk[k, m] > high:
                        high = stored[s] + pk[k, m]
                b_end[k, m] = end
            if high + state[s] > peak[s]:
                peak[s] = high + state[s]
                if peak[s] > abort_mib:
                    return OVER, starts, ends, busy, peak, s
            if end > abort_ms:
                return SLOW, starts, ends, busy, peak, s
            starts[s, p] = t
            ends[s, p] = end
            busy[s] += end - t
            t = end
            p += 1
        ptr[s] = p
        free[s] = t
        if p > p0:
            for nb in (s - 1, s + 1):
                if ring:
                    nb = nb % P
                if nb >= 0 and nb < P and not queued[nb] and ptr[nb] < nops[nb]:
                    queued[nb] = True
                    pending[npend] = nb
                    npend += 1
    for s in range(P):
        if ptr[s] < nops[s]:
            return STUCK, starts, ends, busy, peak, s
    return OK, starts, ends, busy, peak, -1


@_jit
def adaptive_kernel(fw, bw, st, pk, ac, gc, state, act_budget, max_in_flight, prefer_b, abort_ms, abort_mib):
    """Build the adaptive schedule (see :mod:`dynapipe.schedule.adaptive`).

    The stage with the earliest decision time acts next (ties: lowest stage), so every
    arrival up to that time is known: ops last more than zero, so anything still to be
    dispatched arrives later. Returns ``(status, kind, mb, starts, ends, busy, peak)``
    with ``[S, 2M]`` op arrays in execution order.
    """
    S = fw.shape[0]
    M = fw.shape[1]
    L = 2 * M
    inf = np.inf
    kind = np.zeros((S, L), np.int64)
    mbo = np.zeros((S, L), np.int64)
    starts = np.zeros((S, L))
    ends = np.zeros((S, L))
    busy = np.zeros(S)
    peak = state.copy()
    stored = np.zeros(S)
    f_arr = np.full((S, M), inf)
    for m in range(M):
        f_arr[0, m] = 0.0
    b_arr = np.full((S, M), inf)
    f_next = np.zeros(S, np.int64)
    free = np.zeros(S)
    count = np.zeros(S, np.int64)
    infl = np.zeros((S, M), np.int64)
    ninfl = np.zeros(S, np.int64)
    last = S - 1
    done = 0
    while done < S * L:
        best_t = inf
        best_s = -1
        best_b = -1
        best_f = -1
        for s in range(S):
            if count[s] == L:
                continue
            # Earliest arrived-or-arriving backward among this stage's in-flight micro-batches.
            tb = inf
            cand_b = -1
            for j in range(ninfl[s]):
                m = infl[s, j]
                a = b_arr[s, m]
                if a < tb or (a == tb and cand_b >= 0 and m < cand_b):
                    tb = a
                    cand_b = m
            tf = inf
            cand_f = -1
            i = f_next[s]
            if i < M and f_arr[s, i] < inf:
                ok = ninfl[s] == 0
                if not ok and ninfl[s] < max_in_flight[s]:
                    worst = pk[s, i]
                    for j in range(ninfl[s]):
                        if pk[s, infl[s, j]] > worst:
                            worst = pk[s, infl[s, j]]
                    ok = stored[s] + st[s, i] + worst <= act_budget[s]
                if ok:
                    tf = f_arr[s, i]
                    cand_f = i
            first = tb if tb < tf else tf
            if first == inf:
                continue
            t = free[s] if free[s] > first else first
            use_b = cand_b >= 0 and tb <= t
            use_f = cand_f >= 0 and tf <= t
            if use_b and use_f:
                if prefer_b:
                    use_f = False
                else:
                    use_b = False
            if t < best_t:
                best_t = t
                best_s = s
                best_b = cand_b if use_b else -1
                best_f = cand_f if use_f else -1
        if best_s < 0:
            return STUCK, kind, mbo, starts, ends, busy, peak
        s = best_s
        t = best_t
        c = count[s]
        if best_b >= 0:
            m = best_b
            end = t + bw[s, m]
            high = stored[s] + pk[s, m]
            stored[s] -= st[s, m]
            for j in range(ninfl[s]):
                if infl[s, j] == m:
                    infl[s, j] = infl[s, ninfl[s] - 1]
                    break
            ninfl[s] -= 1
            kind[s, c] = B
            if s > 0:
                b_arr[s - 1, m] = end + gc[s - 1, m]
        else:
            m = best_f
            end = t + fw[s, m]
            high = stored[s] + st[s, m] + pk[s, m]
            stored[s] += st[s, m]
            infl[s, ninfl[s]] = m
            ninfl[s] += 1
            f_next[s] += 1
            kind[s, c] = F
            if s < last:
                f_arr[s + 1, m] = end + ac[s, m]
            else:
                b_arr[s, m] = end
        if high + state[s] > peak[s]:
            peak[s] = high + state[s]
            if peak[s] > abort_mib:
                return OVER, kind, mbo, starts, ends, busy, peak
        if end > abort_ms:
            return SLOW, kind, mbo, starts, ends, busy, peak
        mbo[s, c] = m
        starts[s, c] = t
        ends[s, c] = end
        busy[s] += end - t
        free[s] = end
        count[s] = c + 1
        done += 1
    return OK, kind, mbo, starts, ends, busy, peak
