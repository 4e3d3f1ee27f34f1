"""Bookkeeping of one iteration on one rank: where an instruction runs, and the run's state.

:class:`RunState` holds what the executor keeps between instructions (buffers, posted
transfers, autograd roots, received activations, losses, deferred send waits);
:class:`Where` names an instruction's location, formatted only when an error needs it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from dynapipe.plan.instructions import (RECV_STARTS, SEND_STARTS, ExecutionPlan, FINISHES, Instruction,
                                        MicroBatchInfo, SendActivationFinish, SendGradFinish, TensorSpec)
from dynapipe.runtime.buffers import BufferTable
from dynapipe.runtime.plan_check import PeerPlanCheck

if TYPE_CHECKING:
    from dynapipe.runtime.executor import Executor

SEND_FINISHES = (SendActivationFinish, SendGradFinish)
TRANSFERS = SEND_STARTS + RECV_STARTS + FINISHES


class Where:
    """Where an instruction runs, as text only when an error message needs it (the
    instruction loop is hot; formatting every location up front would cost more than
    some transfers)."""

    __slots__ = ("ex", "i", "ins", "what")

    def __init__(self, ex: "Executor", i: int, ins: Instruction, what: str = ""):
        self.ex, self.i, self.ins, self.what = ex, i, ins, what

    def also(self, what: str) -> "Where":
        return Where(self.ex, self.i, self.ins, self.what + what)

    def __str__(self) -> str:
        return self.ex._where(self.i, self.ins) + self.what

    def __format__(self, spec: str) -> str:
        return str(self)


@dataclass(eq=False)
class DeferredSend:
    """A send whose ``*Finish`` was reached but not yet waited for; ``overlapped``: a compute
    op has run since (the next one waits for it)."""

    pending: object
    where: Where
    ins: Instruction
    overlapped: bool = False


@dataclass
class RunState:
    """State of one iteration."""

    plan: ExecutionPlan
    mbs: dict[int, MicroBatchInfo]
    start_of: dict[int, int]
    batches: dict[int, list[int]]
    send_specs: dict[tuple[int, int], tuple[TensorSpec, ...]]
    grad_specs: dict[tuple[int, int], tuple[TensorSpec, ...]]
    buffers: BufferTable = field(default_factory=BufferTable)
    pending: dict = field(default_factory=dict)
    inflight: set = field(default_factory=set)
    roots: dict = field(default_factory=dict)
    act_inputs: dict = field(default_factory=dict)
    losses: dict = field(default_factory=dict)
    loss_tokens: int = 0  # what the summed loss is divided by
    released: int = 0
    deferred: list = field(default_factory=list)  # DeferredSend: sends not yet waited for
    # Buffers whose FreeBuffer came while their send was deferred: buffer -> (index, where).
    free_after_send: dict = field(default_factory=dict)
    check: Optional[PeerPlanCheck] = None  # the peer plan check, until settled
    # Whether any backward will run: a forward-only plan (evaluation) or a forward under
    # no_grad keeps no graph roots or received inputs, so its frees release the activations.
    backward: bool = True
