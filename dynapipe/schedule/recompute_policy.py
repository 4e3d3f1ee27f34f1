"""Per-stage recompute policies for the schedule search.

A stage that holds fewer micro-batches in flight can afford to recompute less: these helpers
pick, for a schedule's op order, the lightest recompute level that fits each stage (or each
virtual stage of a chunked placement) on every data-parallel replica, and turn the distinct
mixes into candidates for :func:`dynapipe.schedule.search.search_schedules`.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from dynapipe.schedule import _kernels as K
from dynapipe.schedule.costs import StageTimes
from dynapipe.schedule.interleaved import chunk_levels
from dynapipe.schedule.one_f_one_b import one_f_one_b_arrays
from dynapipe.schedule.simulator import kernel_inputs, split_inputs
from dynapipe.schedule.zero_bubble import ZB_H1, zb_h1_arrays

# The recompute label of a candidate whose stages recompute at different levels.
PER_STAGE = "per-stage"
# Op orders a mix is sized for, by schedule name (every other schedule: 1F1B's).
_ORDER_ARRAYS = {"1f1b": one_f_one_b_arrays, ZB_H1: zb_h1_arrays}


def per_stage_levels(by_level: dict, levels: Sequence[str], cap_mib: float,
                     schedule: str = "1f1b") -> tuple[str, ...]:
    """For every stage, the lightest level in ``levels`` (ordered light to heavy) under
    which ``schedule``'s op order (1F1B unless ``zb-h1``, whose pending weight parts
    hold memory longer) fits that stage on every replica (the heaviest if none does)."""
    arrays_of = _ORDER_ARRAYS.get(schedule, one_f_one_b_arrays)
    peaks = {}
    for lv in levels:
        per_rep = []
        for t in by_level[lv]:
            kind, mb, nops = arrays_of(t.num_stages, t.num_micro_batches)
            per_rep.append(K.simulate_split_kernel(kind, mb, nops, *kernel_inputs(t), *split_inputs(t),
                                                   np.inf, np.inf)[4])
        peaks[lv] = np.max(per_rep, axis=0)
    S = len(peaks[levels[0]])
    return tuple(next((lv for lv in levels if peaks[lv][s] <= cap_mib), levels[-1]) for s in range(S))


def per_stage_policies(by_level: dict, levels: Sequence[str], cap_mib: float, names: Sequence[str], chunks: int,
                        replicas: int) -> list[tuple]:
    """The search's per-stage recompute policies, ``(PER_STAGE, mix, stage times, names)``:
    one per distinct mix over ``names`` (schedules whose op orders hold the same micro-batches
    in flight share one); a mix of one level everywhere is already a uniform policy."""
    by_order: dict[str, list[tuple[str, ...]]] = {}
    by_mix: dict[tuple[str, ...], list[str]] = {}
    for name in names:
        order = ZB_H1 if name == ZB_H1 else "1f1b"  # the op order whose memory the mix is sized for
        if order not in by_order:
            if chunks > 1:
                # One level per virtual stage (chunk), so one rank's chunks may differ; sized for
                # the spread groups and, where some replica's M is not a multiple of P, for
                # Megatron's groups too, which interleaved 1F1B falls back to when the spread do not fit.
                P = len(by_level[levels[0]][0].state_mib)
                uneven = any(t.num_micro_batches % P for t in by_level[levels[0]])
                by_order[order] = [chunk_levels(by_level, levels, cap_mib, spread)
                                   for spread in ((True, False) if uneven else (True,))]
            else:
                by_order[order] = [per_stage_levels(by_level, levels, cap_mib, order)]
        for mix in by_order[order]:
            if name not in by_mix.setdefault(mix, []):
                by_mix[mix].append(name)
    out = []
    for mix, mix_names in by_mix.items():
        if len(set(mix)) > 1:
            mixed = [StageTimes.mixed([by_level[mix[k]][r] for k in range(len(mix))]) for r in range(replicas)]
            out.append((PER_STAGE, mix, mixed, mix_names))
    return out
