"""The original op-by-op simulator helpers, kept as the reference the numpy ones must reproduce exactly."""
from __future__ import annotations

import numpy as np

from dynapipe.errors import DynaPipeError
from dynapipe.schedule import _kernels as K
from dynapipe.schedule.costs import StageTimes
from dynapipe.schedule.types import Schedule

_KIND_CODE = {"F": K.F, "B": K.B, "BI": K.BI, "BW": K.BW}


def schedule_arrays(schedule: Schedule, num_micro_batches: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(kind, mb, nops)``: the schedule's op orders as ``[S, L]`` integer arrays."""
    S = schedule.num_stages
    nops = np.array([len(ops) for ops in schedule.stage_ops], dtype=np.int64)
    L = int(nops.max()) if S else 0
    kind = np.zeros((S, max(L, 1)), dtype=np.int64)
    mb = np.zeros((S, max(L, 1)), dtype=np.int64)
    for s, ops in enumerate(schedule.stage_ops):
        for i, op in enumerate(ops):
            if op.kind not in _KIND_CODE or op.chunk != 0 or not 0 <= op.mb < num_micro_batches:
                raise DynaPipeError(f"schedule {schedule.name!r}: op {op} cannot be simulated (kinds F, B, BI, BW, "
                                    f"chunk 0, micro-batches 0..{num_micro_batches - 1} are supported).")
            kind[s, i] = _KIND_CODE[op.kind]
            mb[s, i] = op.mb
    return kind, mb, nops


def memory_steps(schedule: Schedule, times: StageTimes, starts: list[list[float]],
                 ends: list[list[float]]) -> list[list[tuple[float, float]]]:
    """Per stage, ``(time ms, MiB)`` points of memory over time (model states included)."""
    out = []
    for s, ops in enumerate(schedule.stage_ops):
        state = float(times.state_mib[s])
        st, pk = times.stored_mib[s], times.peak_mib[s]
        stored = 0.0
        steps = [(0.0, state)]
        for i, op in enumerate(ops):
            if op.kind == "F":
                high = stored + st[op.mb] + pk[op.mb]
                stored += st[op.mb]
            elif op.kind == "BI":  # frees the activation but the weight part's operands
                high = stored + pk[op.mb]
                stored += times.weight_stash_mib[s][op.mb] - st[op.mb]
            elif op.kind == "BW":
                high = stored
                stored -= times.weight_stash_mib[s][op.mb]
            else:
                high = stored + pk[op.mb]
                stored -= st[op.mb]
            steps.append((starts[s][i], state + float(high)))
            steps.append((ends[s][i], state + float(stored)))
        out.append(steps)
    return out


def stage_times_per_replica(cost_model, replicas, **kw):
    """Each replica priced on its own, as the search did before pricing them in one call."""
    from dynapipe.schedule.costs import stage_times
    return [stage_times(cost_model, list(r), **kw) for r in replicas]
