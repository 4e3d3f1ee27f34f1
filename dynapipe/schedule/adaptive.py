"""The adaptive schedule: wait-free, memory-bounded list scheduling.

Every stage, whenever it is free, runs work that is ready instead of waiting for the
op a fixed pattern would dictate: a backward whose gradient has arrived (earliest
arrival first: it releases memory and feeds the stages upstream), otherwise the next
forward in micro-batch order if its activation has arrived and admitting it keeps the
stage's memory (model states + stored activations of every micro-batch in flight + the
largest transient peak among them) within the limit. The resulting per-stage op order
is fixed into a :class:`Schedule`, so it runs (and compiles) like any other; simulated
on the same costs it reproduces the timeline built here exactly.

A stage with nothing in flight always admits the next forward, so the schedule never
deadlocks; whether a single micro-batch fits at all is for the caller to check against
the returned peaks.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from dynapipe.errors import DynaPipeError
from dynapipe.schedule import _kernels as K
from dynapipe.schedule.costs import StageTimes
from dynapipe.schedule.simulator import Timeline, kernel_inputs, timeline_from_arrays
from dynapipe.schedule.types import Op, Schedule


def adaptive_arrays(times: StageTimes, capacity_mib: Optional[Sequence[float]] = None, *,
                    max_in_flight: Optional[Sequence[int]] = None, prefer: str = "B",
                    abort_ms: float = np.inf, abort_mib: float = np.inf) -> tuple:
    """The raw kernel result ``(status, kind, mb, starts, ends, busy, peak)``; see
    :func:`adaptive_schedule` for the arguments. ``abort_ms``/``abort_mib`` stop early
    (status ``SLOW``/``OVER``) once an op ends later or a stage needs more."""
    S, M = times.num_stages, times.num_micro_batches
    state = np.asarray(times.state_mib, dtype=np.float64)
    if capacity_mib is not None:
        capacity = np.asarray(capacity_mib, dtype=np.float64)
        # inf: no limit on that stage; NaN would compare false everywhere and serialise the stages.
        if capacity.shape != (S,) or np.any(np.isnan(capacity)) or np.any(capacity < 0):
            raise DynaPipeError(f"capacity_mib {capacity_mib!r}: give one limit per stage ({S}), MiB, 0 or more "
                                f"(inf: none).")
    if max_in_flight is not None:
        flight = np.asarray(max_in_flight)
        if flight.shape != (S,) or flight.dtype.kind not in "iu" or np.any(flight < 1):
            raise DynaPipeError(f"max_in_flight {max_in_flight!r}: give one whole number of micro-batches per "
                                f"stage ({S}), at least 1.")
    budget = np.full(S, np.inf) if capacity_mib is None else capacity - state
    cap = np.full(S, max(M, 1), dtype=np.int64) if max_in_flight is None else flight.astype(np.int64)
    if prefer not in ("B", "F"):
        raise DynaPipeError(f"prefer={prefer!r}: use 'B' (backward first) or 'F' (forward first).")
    return K.adaptive_kernel(*kernel_inputs(times)[:6], state, budget, cap, prefer == "B",
                             float(abort_ms), float(abort_mib))


def schedule_from_arrays(name: str, kind: np.ndarray, mb: np.ndarray, nops: Sequence[int], *,
                         recompute: str, order: str, mb_order: tuple[int, ...],
                         stage_recompute: tuple[str, ...] = ()) -> Schedule:
    """A :class:`Schedule` from ``[S, L]`` kind (0 = F, 1 = B) and micro-batch arrays."""
    ops_of = {}
    stage_ops = []
    for s in range(kind.shape[0]):
        row = []
        for k, m in zip(kind[s, :nops[s]].tolist(), mb[s, :nops[s]].tolist()):
            op = ops_of.get((k, m))
            if op is None:
                op = ops_of[(k, m)] = Op("F" if k == K.F else "B", m)
            row.append(op)
        stage_ops.append(tuple(row))
    return Schedule(name, kind.shape[0], tuple(stage_ops), recompute=recompute, order=order, mb_order=mb_order,
                    stage_recompute=tuple(stage_recompute))


def adaptive_schedule(times: StageTimes, capacity_mib: Optional[Sequence[float]] = None, *,
                      order: str = "planned", mb_order: tuple[int, ...] = (),
                      max_in_flight: Optional[Sequence[int]] = None, prefer: str = "B",
                      record_memory: bool = False) -> tuple[Schedule, Timeline]:
    """Build the adaptive schedule for ``times`` and return it with its timeline.

    ``capacity_mib[s]``: memory stage ``s`` may use, model states included (MiB; None:
    unbounded). ``max_in_flight[s]``: optional cap on micro-batches between forward and
    backward. ``prefer="F"`` runs an admissible forward before a ready backward.
    """
    S, M = times.num_stages, times.num_micro_batches
    status, kind, mb, starts, ends, busy, peak = adaptive_arrays(times, capacity_mib, max_in_flight=max_in_flight,
                                                                 prefer=prefer)
    if status != K.OK:
        raise DynaPipeError(f"the adaptive schedule stalled (status {status}; internal error, please report).")
    sched = schedule_from_arrays("adaptive", kind, mb, [2 * M] * S, recompute=times.recompute, order=order,
                                 mb_order=mb_order or tuple(range(M)))
    return sched, timeline_from_arrays(sched, times, starts, ends, busy, peak, record_memory,
                                       (kind, mb, np.full(S, 2 * M, dtype=np.int64)))
