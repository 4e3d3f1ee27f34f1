"""What the executor actually ran: per-instruction timing as a Chrome/Perfetto trace.

The executor records one :class:`ExecEvent` per instruction when asked
(``ExecutorConfig(trace=True)``). :func:`chrome_trace` lays the events of every rank
out like the simulated trace (:mod:`dynapipe.schedule.trace`, whose event builders it
uses): one row per stage, one process per replica, compute ops named by micro-batch and
shape (``F3 2x128``, categories ``forward``/``backward``), transfers and waits named by
what they move, and the bytes of the executor's live buffers as a counter track. Timestamps are
wall-clock microseconds, so ranks on one host line up; the trace starts at the
earliest event of all ranks (``otherData.origin_us``: that start on the wall clock, us).
On CUDA the times are the device's (:class:`DeviceClock`), not the host's launches.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

from dynapipe.plan.instructions import (BackwardPass, CommInstruction, ForwardPass, FreeBuffer, Instruction,
                                        LoadInput, MicroBatchInfo)
from dynapipe.schedule.trace import op_event, track_names
from dynapipe.schedule.trace import op_name as sim_op_name

MIB = float(1 << 20)
# Name of the event of deferred send waits, recorded before the instruction that needed them.
WAIT_SENDS = "wait for sends"


def now_us() -> float:
    """Wall-clock time in microseconds (comparable between processes of one host)."""
    return time.time_ns() / 1000.0


class DeviceClock:
    """Op times on the device's own timeline, for a device whose host runs ahead of it (CUDA):
    the host's clock around an op measures only its launch there. Each op gets a pair of
    timing events (``new_event()``: e.g. ``torch.cuda.Event(enable_timing=True)``, with
    ``record()`` and ``elapsed_time(other)`` in ms), resolved once the iteration is done
    against one event recorded with the wall clock at the start: no synchronisation between
    ops, so the traced run keeps its overlap. ``sync()``: waits for the device."""

    def __init__(self, new_event, sync):
        self._new, self._sync = new_event, sync
        self._origin = None
        self._origin_us = 0.0
        self._pending: list[tuple[int, int, object, object]] = []

    def begin(self) -> None:
        """Start an iteration: the device is idle, the origin event is stamped with the wall clock."""
        self._sync()
        self._origin_us = now_us()
        self._origin = self._new()
        self._origin.record()
        self._pending = []

    def mark(self):
        """A timing event recorded now on the device's stream."""
        ev = self._new()
        ev.record()
        return ev

    def add(self, event_index: int, memory_index: int, start, end) -> None:
        """Time event ``event_index`` (and memory sample ``memory_index``) by ``start`` and ``end``."""
        self._pending.append((event_index, memory_index, start, end))

    def resolve(self, trace: "ExecTrace") -> None:
        """Rewrite the events' start (wall-clock us) and duration (us) from their device events."""
        from dataclasses import replace

        self._sync()
        for k, m, start, end in self._pending:
            t0 = self._origin_us + self._origin.elapsed_time(start) * 1e3
            trace.events[k] = replace(trace.events[k], start_us=t0, dur_us=max(start.elapsed_time(end) * 1e3, 0.0))
            trace.memory[m] = (t0, trace.memory[m][1])
        self._pending = []


@dataclass(frozen=True)
class ExecEvent:
    """One instruction as it ran: ``start_us`` wall clock, ``dur_us`` duration (us);
    ``kind`` ``F``/``B`` for compute ops with their micro-batch ``shape``
    ``(mbs, seqlen, dec_seqlen)``; ``chunk``: the virtual-pipeline chunk it belongs to (0
    without an interleaved placement); ``note``: the handlers' ``trace_note`` of a compute
    op (added to its trace arguments)."""

    index: int
    opcode: str
    mb: int
    name: str
    category: str
    start_us: float
    dur_us: float
    kind: str = ""
    shape: Optional[tuple] = None
    chunk: int = 0
    note: Optional[dict] = None


@dataclass
class ExecTrace:
    """The events of one rank for one iteration, and its live-buffer bytes over time."""

    stage: int
    replica: int
    iteration: int
    events: list[ExecEvent] = field(default_factory=list)
    memory: list[tuple[float, int]] = field(default_factory=list)
    # What ran when it was not a training iteration (e.g. "evaluation batch 3"); shown in its place.
    label: str = ""

    @property
    def span_us(self) -> float:
        """From the first instruction's start to the last one's end (us)."""
        if not self.events:
            return 0.0
        return max(e.start_us + e.dur_us for e in self.events) - self.events[0].start_us

    def busy_us(self, categories: Sequence[str] = ("forward", "backward")) -> float:
        """Time spent in events of ``categories`` (us)."""
        return sum(e.dur_us for e in self.events if e.category in categories)


def describe(ins: Instruction, mb: Optional[MicroBatchInfo]) -> tuple[str, str, str, Optional[tuple]]:
    """Display name, category, op kind (``F``/``B``/``BI``/``BW``/``""``) and micro-batch shape of an
    instruction; compute ops are named as in the simulated trace (``F3 2x128``)."""
    shape = (mb.mbs, mb.seqlen, mb.dec_seqlen) if mb is not None else None
    if isinstance(ins, (ForwardPass, BackwardPass)):
        # A split backward's parts are named as the simulator names them (BI, BW).
        kind = "F" if isinstance(ins, ForwardPass) else {"input": "BI", "weight": "BW"}.get(ins.part, "B")
        name = sim_op_name(kind, ins.mb, *shape) if shape else f"{kind}{ins.mb}"
        return name, "forward" if kind == "F" else "backward", kind, shape
    if isinstance(ins, LoadInput):
        return f"load {ins.mb}", "data", "", shape
    if isinstance(ins, CommInstruction):
        dims = "+".join("x".join(str(d) for d in t.shape) for t in ins.tensors)
        return f"{ins.OPCODE} {ins.mb} peer {ins.peer} [{dims}]", "comm", "", shape
    if isinstance(ins, FreeBuffer):
        return f"free {ins.buffer}", "memory", "", shape
    return ins.OPCODE, "other", "", shape


def chrome_trace(traces: Sequence[ExecTrace], pid_offset: int = 0) -> dict:
    """A Chrome trace (``chrome://tracing``, Perfetto) of several ranks' traces.

    Laid out like :func:`dynapipe.schedule.trace.chrome_trace` (same op names, categories
    and rows); ``pid_offset`` shifts the replica rows so an executed and a simulated trace
    can be loaded into one viewer side by side.
    """
    if not traces:
        return {"traceEvents": [], "displayTimeUnit": "ms"}
    t0 = min((t.events[0].start_us for t in traces if t.events), default=0.0)
    out: list[dict] = []
    stages: dict[int, int] = {}
    for t in traces:
        stages[t.replica] = max(stages.get(t.replica, 0), t.stage + 1)
    for rep, n in sorted(stages.items()):
        rows = track_names(rep + pid_offset, n)
        rows[0]["args"]["name"] = f"executed replica {rep}"
        out.extend(rows)
    for t in traces:
        pid = t.replica + pid_offset
        for e in t.events:
            start_ms, end_ms = (e.start_us - t0) / 1e3, (e.start_us + e.dur_us - t0) / 1e3
            extra = {"instruction": e.index, **({"phase": t.label} if t.label else {"iteration": t.iteration})}
            if e.chunk:
                extra["chunk"] = e.chunk
            if e.note:
                extra.update(e.note)
            if e.kind in ("F", "B", "BI", "BW") and e.shape is not None:
                mbs, seqlen, dec = e.shape
                out.append(op_event(pid, t.stage, e.kind, e.mb, start_ms, end_ms, mbs=mbs, seqlen=seqlen,
                                    dec_seqlen=dec, extra=extra))
            else:
                out.append({"name": e.name, "cat": e.category, "ph": "X", "pid": pid, "tid": t.stage,
                            "ts": round(start_ms * 1e3, 3), "dur": round(e.dur_us, 3),
                            "args": {"mb": e.mb, **extra}})
        for ts, nbytes in t.memory:
            out.append({"name": f"buffers stage {t.stage}", "ph": "C", "pid": pid,
                        "ts": round(ts - t0, 3), "args": {"MiB": round(nbytes / MIB, 4)}})
    # The origin lets traces written by different ranks be laid on one clock again.
    return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": {"origin_us": t0}}


def write_chrome_trace(path: str, traces: Sequence[ExecTrace]) -> None:
    """Write :func:`chrome_trace` of ``traces`` to ``path`` (JSON)."""
    with open(path, "w") as f:
        json.dump(chrome_trace(traces), f)


def gather_traces(trace: ExecTrace, group=None, dst: int = 0) -> Optional[list[ExecTrace]]:
    """Collect every rank's trace of ``group`` on group rank ``dst`` (``None`` elsewhere).

    A collective: every rank of ``group`` must call it.
    """
    import torch.distributed as dist

    rows: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(rows, trace, group=group)
    return list(rows) if dist.get_rank(group) == dst else None
