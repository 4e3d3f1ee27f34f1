"""The stage-placement dynamic program as first written (one stage layout at a time).

Kept as the reference the vectorised passes of :mod:`dynapipe.cost.placement` must
reproduce split for split and objective for objective.
"""
from __future__ import annotations

import numpy as np

from dynapipe.cost.placement import _segment


def loop_dp(pricer, S: int, L: int, enc_total: int, cap_ms: float, state_cap: float) -> tuple[float, list[int]]:
    """``(objective, cuts)`` of the split of ``L`` layers into ``S`` stages (``cap_ms`` inf:
    least bottleneck ms; else least sum of squared ms with every stage within ``cap_ms``),
    each stage's states at most ``state_cap`` MiB."""
    minimax = not np.isfinite(cap_ms)
    best = np.full((S + 1, L + 1), np.inf)
    arg = np.zeros((S + 1, L + 1), dtype=np.int64)
    best[0, 0] = 0.0
    for s in range(S):
        for p in range(s, L - (S - s) + 1):
            prev = best[s, p]
            if not np.isfinite(prev):
                continue
            for q in range(p + 1, L - (S - s - 1) + 1):
                layout = _segment(s, S, p, q, enc_total)
                if pricer.state_mib(layout) > state_cap:
                    break  # states only grow with more layers
                ms = pricer.price(layout, state_cap)[0]
                if ms > cap_ms:
                    continue
                val = max(prev, ms) if minimax else prev + ms * ms
                if val < best[s + 1, q]:
                    best[s + 1, q], arg[s + 1, q] = val, p
    if not np.isfinite(best[S, L]):
        return np.inf, []
    cuts, q = [], L
    for s in range(S, 0, -1):
        p = int(arg[s, q])
        cuts.append(p)
        q = p
    return float(best[S, L]), cuts[::-1]
