"""Event-driven simulation of a pipeline schedule: timeline, idle time and memory.

Each stage runs its ops in the schedule's order, one at a time. An op starts when the
stage is free and its inputs have arrived: the forward of micro-batch ``i`` on stage
``s`` needs the forward on ``s - 1`` plus the activation transfer; the backward needs
the backward on ``s + 1`` plus the gradient transfer (the last stage: its own forward).

A split backward (zero-bubble schedules) runs as two ops: ``BI`` (input gradient) waits
and signals exactly as a backward does and lasts ``bw - bw_weight``; ``BW`` (weight
gradient) lasts ``bw_weight`` and waits only for its own stage's ``BI``.

Memory of a stage = model states + stored activations of the micro-batches between
their forward and their backward + the transient peak of the running op: a forward
holds ``stored + peak`` of its micro-batch on top of what is already stored, a backward
``peak`` on top of what is stored (its own micro-batch included), and the backward's
end releases the micro-batch's stored activations. A ``BI`` releases all but
``weight_stash``, which its ``BW`` releases (a ``BW`` adds no transient), and holds
``peak`` on top of the higher of what is stored before and after it (under full recompute
its last rematerialised layer runs on top of the others' stashes). Units: ms, MiB.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional
import numpy as np

from dynapipe.errors import DynaPipeError
from dynapipe.schedule import _kernels as K
from dynapipe.schedule.costs import MIN_OP_MS, StageTimes
from dynapipe.schedule.types import Op, Schedule

_KIND_CODE = {"F": K.F, "B": K.B, "BI": K.BI, "BW": K.BW}


@dataclass(frozen=True)
class Event:
    """One op as it ran in the simulation (ms)."""

    stage: int
    op: Op
    start_ms: float
    end_ms: float


@dataclass
class Timeline:
    """The result of a simulation.

    ``starts[s][i]``/``ends[s][i]``: start and end (ms) of stage ``s``'s ``i``-th op in
    ``schedule.stage_ops[s]``. ``peak_mib[s]``: stage ``s``'s highest memory, model states
    included. ``memory[s]``: ``(time ms, MiB)`` steps (when recorded; built on first
    access, since only traces read them). ``op_arrays``: the schedule's ``(kind, mb,
    nops)`` as :func:`schedule_arrays` gives them and ``ends`` as an ``[S, L]`` array,
    when the simulation had them (the plan compiler reads them instead of the ops).
    """

    schedule: Schedule
    makespan_ms: float
    starts: list[list[float]]
    ends: list[list[float]]
    busy_ms: list[float]
    peak_mib: list[float]
    # The memory steps, or a function that builds them.
    _memory: Any = field(default=None, repr=False, compare=False)
    op_arrays: Optional[tuple] = field(default=None, repr=False, compare=False)

    @property
    def memory(self) -> list[list[tuple[float, float]]]:
        if callable(self._memory):
            self._memory = self._memory()
        return self._memory if self._memory is not None else []

    @property
    def num_stages(self) -> int:
        return self.schedule.num_stages

    @property
    def idle_ms(self) -> list[float]:
        """Per stage, the time it is not computing before the iteration ends (ms)."""
        return [self.makespan_ms - b for b in self.busy_ms]

    @property
    def bubble_fraction(self) -> float:
        """``1 - sum(busy) / (S x makespan)``: the share of stage time spent idle."""
        if self.makespan_ms <= 0:
            return 0.0
        return 1.0 - sum(self.busy_ms) / (self.num_stages * self.makespan_ms)

    def events(self) -> list[Event]:
        """Every op with its stage and times, stage by stage in execution order."""
        return [Event(s, op, self.starts[s][i], self.ends[s][i])
                for s, ops in enumerate(self.schedule.stage_ops) for i, op in enumerate(ops)]


def kernel_inputs(times: StageTimes) -> tuple:
    """The cost arrays in the layout the kernels take (contiguous float64)."""
    M = times.num_micro_batches
    c = lambda a: np.ascontiguousarray(a, dtype=np.float64)
    ac = times.act_comm_ms if times.act_comm_ms.size else np.zeros((1, M))
    gc = times.grad_comm_ms if times.grad_comm_ms.size else np.zeros((1, M))
    return (c(times.fw_ms), c(times.bw_ms), c(times.stored_mib), c(times.peak_mib), c(ac), c(gc),
            c(times.state_mib))


def split_inputs(times: StageTimes) -> tuple:
    """``(bw_weight_ms, weight_stash_mib)`` as :func:`~dynapipe.schedule._kernels.simulate_split_kernel`
    takes them after :func:`kernel_inputs` (contiguous float64)."""
    c = lambda a: np.ascontiguousarray(a, dtype=np.float64)
    # Both parts of a split backward (BI, BW) last at least MIN_OP_MS: a zero-length part ties
    # with its neighbours, and plans compiled from such ties can deadlock.
    weight = np.clip(times.bw_weight_ms, MIN_OP_MS, times.bw_ms - MIN_OP_MS)
    return c(weight), c(times.weight_stash_mib)


def schedule_arrays(schedule: Schedule, num_micro_batches: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(kind, mb, nops)``: the schedule's op orders as ``[S, L]`` integer arrays."""
    S = schedule.num_stages
    nops = np.array([len(ops) for ops in schedule.stage_ops], dtype=np.int64)
    L = int(nops.max()) if S else 0
    kind = np.zeros((S, max(L, 1)), dtype=np.int64)
    mb = np.zeros((S, max(L, 1)), dtype=np.int64)
    for s, ops in enumerate(schedule.stage_ops):
        n = len(ops)
        if not n:
            continue
        codes = [_KIND_CODE.get(op.kind, -1) for op in ops]
        mbs = [op.mb for op in ops]
        chunks = [op.chunk for op in ops]
        bad = [i for i in range(n) if codes[i] < 0 or chunks[i] != 0 or not 0 <= mbs[i] < num_micro_batches]
        if bad:
            op = ops[bad[0]]
            raise DynaPipeError(f"schedule {schedule.name!r}: op {op} cannot be simulated (kinds F, B, BI, BW, "
                                f"chunk 0, micro-batches 0..{num_micro_batches - 1} are supported).")
        kind[s, :n] = codes
        mb[s, :n] = mbs
        check_each_once(schedule.name, s, kind[s, :n], mb[s, :n], num_micro_batches)
    return kind, mb, nops


def check_each_once(name: str, stage: int, kind: np.ndarray, mb: np.ndarray, num_micro_batches: int,
                    chunk: Optional[np.ndarray] = None, num_chunks: int = 1) -> None:
    """Every micro-batch's forward once on ``stage`` (per chunk, with ``chunk``), and its
    backward once (whole, or as one input part and one weight part): a schedule missing or
    repeating an op would simulate to a plausible but wrong timeline."""
    slot = mb if chunk is None else chunk * num_micro_batches + mb

    def count(code: int) -> np.ndarray:
        return np.bincount(slot[kind == code], minlength=num_chunks * num_micro_batches)

    f, b, bi, bw = count(K.F), count(K.B), count(K.BI), count(K.BW)
    wrong = (f != 1) | ~(((b == 1) & (bi == 0) & (bw == 0)) | ((b == 0) & (bi == 1) & (bw == 1)))
    if wrong.any():
        k = int(np.argmax(wrong))
        what = f"micro-batch {k % num_micro_batches}" + (f" of chunk {k // num_micro_batches}" if chunk is not None else "")
        raise DynaPipeError(f"schedule {name!r}: stage {stage} runs {what}'s forward {f[k]} time(s) and its backward "
                            f"as B x{b[k]}, BI x{bi[k]}, BW x{bw[k]}; every micro-batch needs one forward and one "
                            f"backward (B, or BI and BW) on every stage.")


def memory_steps(schedule: Schedule, times: StageTimes, starts: list[list[float]],
                 ends: list[list[float]], arrays: Optional[tuple[np.ndarray, np.ndarray]] = None
                 ) -> list[list[tuple[float, float]]]:
    """Per stage, ``(time ms, MiB)`` points of memory over time (model states included).

    ``arrays``: the schedule's ``(kind, mb)`` from :func:`schedule_arrays`, when the
    caller has them (saves reading the ops again).
    """
    out = []
    for s, ops in enumerate(schedule.stage_ops):
        state = float(times.state_mib[s])
        steps = [(0.0, state)]
        if ops:
            st, pk = np.asarray(times.stored_mib[s]), np.asarray(times.peak_mib[s])
            if arrays is not None:
                idx, code = arrays[1][s, :len(ops)], arrays[0][s, :len(ops)]
            else:
                idx = np.fromiter((op.mb for op in ops), dtype=np.int64, count=len(ops))
                code = np.fromiter((_KIND_CODE.get(op.kind, K.B) for op in ops), dtype=np.int64, count=len(ops))
            fw = code == K.F
            # A running sum adds left to right, so ``stored`` takes the same float values
            # as adding and subtracting op by op; a forward's high mark is the new
            # ``stored`` plus its peak, a backward's the old one plus its peak.
            delta = np.where(fw, st[idx], -st[idx])
            rise = pk[idx]
            if (code >= K.BI).any():
                ws = np.asarray(times.weight_stash_mib[s])[idx]
                delta = np.where(code == K.BI, ws - st[idx], np.where(code == K.BW, -ws, delta))
                rise = np.where(code == K.BW, 0.0, rise)
            stored = np.cumsum(delta)
            before = np.concatenate(([0.0], stored[:-1]))
            # An input part (BI) peaks on whichever is higher, what it started or ended with: its
            # last rematerialised layer runs on top of the stashes the others left.
            high = np.where(fw, stored, np.where(code == K.BI, np.maximum(before, stored), before)) + rise
            lo = (state + stored.astype(np.float64)).tolist()
            hi = (state + high.astype(np.float64)).tolist()
            n = len(ops)
            when, mib = [0.0] * (2 * n), [0.0] * (2 * n)
            when[0::2], when[1::2] = starts[s][:n], ends[s][:n]
            mib[0::2], mib[1::2] = hi, lo
            steps.extend(zip(when, mib))
        out.append(steps)
    return out


def timeline_from_arrays(schedule: Schedule, times: StageTimes, starts: np.ndarray, ends: np.ndarray,
                         busy: np.ndarray, peak: np.ndarray, record_memory: bool,
                         arrays: Optional[tuple[np.ndarray, np.ndarray]] = None) -> Timeline:
    """Wrap kernel outputs (``[S, L]`` arrays aligned with ``schedule.stage_ops``);
    ``arrays``: the schedule's ``(kind, mb)`` or ``(kind, mb, nops)`` when known (see
    :func:`memory_steps`; with ``nops`` they are kept as the timeline's ``op_arrays``)."""
    n = [len(ops) for ops in schedule.stage_ops]
    st = [starts[s, :n[s]].tolist() for s in range(len(n))]
    en = [ends[s, :n[s]].tolist() for s in range(len(n))]
    makespan = max((e[-1] for e in en if e), default=0.0)
    mem = None
    if record_memory:
        steps = memory_steps  # bound now: the steps are built on first access
        mem = lambda: steps(schedule, times, st, en, arrays)  # noqa: E731
    op_arrays = None
    if arrays is not None and len(arrays) == 3:
        op_arrays = (arrays[0], arrays[1], arrays[2], ends)
    return Timeline(schedule, makespan, st, en, busy.tolist(), peak.tolist(), mem, op_arrays)


def simulate(schedule: Schedule, times: StageTimes, *, record_memory: bool = True,
             arrays: Optional[tuple[np.ndarray, np.ndarray, np.ndarray]] = None) -> Timeline:
    """Run ``schedule`` on ``times`` and return its :class:`Timeline`.

    Raises :class:`DynaPipeError` if the schedule's order cannot run (an op waits on
    one that its own stage or a neighbour only runs later). ``arrays``: the schedule's
    ``(kind, mb, nops)`` as :func:`schedule_arrays` gives them, when the caller already
    holds them (the search's own runs of the chosen candidate).
    """
    if schedule.num_chunks > 1:
        from dynapipe.schedule.interleaved import simulate_chunked

        return simulate_chunked(schedule, times, record_memory=record_memory, arrays=arrays)
    if times.num_stages != schedule.num_stages:
        raise DynaPipeError(f"schedule {schedule.name!r} has {schedule.num_stages} stages, the costs "
                            f"{times.num_stages}.")
    if len(times.state_mib) != times.num_stages:
        raise DynaPipeError(f"schedule {schedule.name!r}: the costs hold state_mib for {len(times.state_mib)} of "
                            f"{times.num_stages} stages; an unchunked schedule needs one per stage.")
    kind, mb, nops = schedule_arrays(schedule, times.num_micro_batches) if arrays is None else arrays
    status, starts, ends, busy, peak, stage = K.simulate_split_kernel(kind, mb, nops, *kernel_inputs(times),
                                                                      *split_inputs(times), np.inf, np.inf)
    if status == K.STUCK:
        raise DynaPipeError(f"schedule {schedule.name!r} cannot run: stage {stage} waits forever on an op whose "
                            f"input its neighbour produces only later in its own order.")
    return timeline_from_arrays(schedule, times, starts, ends, busy, peak, record_memory, (kind, mb, nops))
