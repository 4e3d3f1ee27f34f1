"""What a pipeline schedule is: the order of operations on every stage.

A :class:`Schedule` fixes, for each pipeline stage, the sequence of :class:`Op` it runs
for one iteration. Micro-batch indices (``Op.mb``) are positions in the list of
micro-batches the schedule was built for (after any reordering). The formats are open
for what is coming: ``chunk`` names a virtual-pipeline chunk (interleaved stages, see
:mod:`dynapipe.schedule.interleaved`; 0 otherwise). A backward is either one op ``"B"``
or, in a zero-bubble schedule (:mod:`dynapipe.schedule.zero_bubble`,
:mod:`dynapipe.schedule.interleaved_zb`), two: ``"BI"`` (the input-gradient part, which
receives the gradient and sends the input gradient on, as ``B`` does) and ``"BW"`` (the
weight-gradient part, which only this stage waits for, so it can fill a wait).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from dynapipe.errors import DynaPipeError

OP_KINDS = ("F", "B", "BI", "BW")
# Kinds the simulators and the plan compilers run (contiguous and chunked schedules alike).
SUPPORTED_KINDS = OP_KINDS
# Backward ops that receive a gradient and send the input gradient on.
GRADIENT_KINDS = ("B", "BI")
# The schedules ``--schedule auto`` tries on an unchunked placement.
SCHEDULE_NAMES = ("1f1b", "adaptive")
# Schedules that split the backward (BI/BW) on an unchunked placement; ``auto`` tries them
# where the stages can split their backward.
SPLIT_BACKWARD_SCHEDULE_NAMES = ("zb-h1",)
# Schedules of chunked (interleaved) placements; the last one splits the backward.
CHUNKED_SCHEDULE_NAMES = ("interleaved", "interleaved-adaptive", "interleaved-zb")
# Every named schedule that splits a backward, unchunked or chunked.
SPLITTING_SCHEDULE_NAMES = SPLIT_BACKWARD_SCHEDULE_NAMES + CHUNKED_SCHEDULE_NAMES[-1:]


def schedule_on_chunks(schedule: str, chunks: int) -> str:
    """What a training run's ``schedule`` runs as with ``chunks`` per rank: ``adaptive`` as
    ``interleaved-adaptive`` (the search maps ``1f1b``, ``adaptive`` and ``zb-h1`` to their
    interleaved forms itself; this names the choice before a search has run)."""
    return "interleaved-adaptive" if chunks > 1 and schedule == "adaptive" else schedule


@dataclass(frozen=True, order=True)
class Op:
    """One operation of one stage: ``kind`` ``"F"`` (forward), ``"B"`` (backward), or the
    two parts of a split backward, ``"BI"`` (input gradient) and ``"BW"`` (weight
    gradient), of micro-batch ``mb`` (virtual-pipeline ``chunk``)."""

    kind: str
    mb: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.mb}" + (f".{self.chunk}" if self.chunk else "")


@dataclass(frozen=True)
class Schedule:
    """Per-stage op order for one iteration of one pipeline replica.

    ``stage_ops[s]`` is stage ``s``'s op sequence. ``recompute`` is the activation
    recompute level every op uses (``none``, ``selective``, ``full``). ``order`` names
    the micro-batch order the schedule was built for, and ``mb_order`` maps each
    micro-batch index to its position in the planner's original list.
    ``stage_recompute`` (one level per stage) overrides ``recompute`` when given.
    ``num_chunks``: virtual-pipeline chunks per stage (ops carry ``chunk`` in
    ``0..num_chunks-1``; see :mod:`dynapipe.schedule.interleaved`).
    """

    name: str
    num_stages: int
    stage_ops: tuple[tuple[Op, ...], ...]
    recompute: str = "none"
    order: str = "planned"
    mb_order: tuple[int, ...] = ()
    stage_recompute: tuple[str, ...] = ()
    num_chunks: int = 1
    meta: dict = field(default_factory=dict, compare=False, hash=False)

    def recompute_of(self, stage: int) -> str:
        """The recompute level stage ``stage`` runs with."""
        return self.stage_recompute[stage] if self.stage_recompute else self.recompute

    @property
    def num_micro_batches(self) -> int:
        return len({op.mb for ops in self.stage_ops for op in ops})

    @property
    def split_backward(self) -> bool:
        """Whether some backward is split into its input (``BI``) and weight (``BW``) parts."""
        return any(op.kind in ("BI", "BW") for ops in self.stage_ops for op in ops)

    def check(self) -> "Schedule":
        """Raise :class:`DynaPipeError` unless every stage runs, for each micro-batch,
        its forward once and then either its backward ``B`` once or ``BI`` once and then
        ``BW`` once, with supported kinds."""
        if len(self.stage_ops) != self.num_stages:
            raise DynaPipeError(f"schedule {self.name!r}: {len(self.stage_ops)} op lists for "
                                f"{self.num_stages} stages.")
        mbs = None
        for s, ops in enumerate(self.stage_ops):
            seen_f, seen_b, seen_bi, seen_bw = set(), set(), set(), set()
            for i, op in enumerate(ops):
                if op.kind not in SUPPORTED_KINDS:
                    raise DynaPipeError(f"schedule {self.name!r}: stage {s} op {i} has kind {op.kind!r}; "
                                        f"only {SUPPORTED_KINDS} are supported so far.")
                if not 0 <= op.chunk < self.num_chunks:
                    raise DynaPipeError(f"schedule {self.name!r}: stage {s} op {i} ({op}) has chunk {op.chunk}; "
                                        f"the schedule has {self.num_chunks} chunk(s).")
                key = (op.mb, op.chunk)
                if op.kind == "F":
                    if key in seen_f:
                        raise DynaPipeError(f"schedule {self.name!r}: stage {s} runs F{op.mb} twice.")
                    seen_f.add(key)
                elif op.kind == "BW":
                    if key not in seen_bi:
                        raise DynaPipeError(f"schedule {self.name!r}: stage {s} op {i} runs BW{op.mb} without "
                                            f"BI{op.mb} before it; a weight part follows its input part.")
                    if key in seen_bw:
                        raise DynaPipeError(f"schedule {self.name!r}: stage {s} runs BW{op.mb} twice.")
                    seen_bw.add(key)
                else:
                    if key not in seen_f:
                        raise DynaPipeError(f"schedule {self.name!r}: stage {s} op {i} runs {op.kind}{op.mb} "
                                            f"before F{op.mb}.")
                    if key in seen_b:
                        raise DynaPipeError(f"schedule {self.name!r}: stage {s} runs the backward of micro-batch "
                                            f"{op.mb} twice ({op}); run B{op.mb}, or BI{op.mb} then BW{op.mb}.")
                    seen_b.add(key)
                    if op.kind == "BI":
                        seen_bi.add(key)
            if seen_f != seen_b:
                raise DynaPipeError(f"schedule {self.name!r}: stage {s} has forwards without backwards: "
                                    f"{sorted(seen_f - seen_b)}.")
            if seen_bi != seen_bw:
                raise DynaPipeError(f"schedule {self.name!r}: stage {s} runs input parts without their weight "
                                    f"parts (BI without BW): {sorted(seen_bi - seen_bw)}.")
            if mbs is None:
                mbs = seen_f
            elif seen_f != mbs:
                raise DynaPipeError(f"schedule {self.name!r}: stage {s} runs micro-batches "
                                    f"{sorted(seen_f)}, stage 0 runs {sorted(mbs)}.")
        return self
