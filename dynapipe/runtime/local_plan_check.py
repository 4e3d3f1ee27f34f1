"""What one rank checks of its own plan before anything is sent: :func:`check_plan_locally`.

The checks, in order: the plan's layout (chunks, stage, replica) is this rank's; its
micro-batch indices are distinct; then, instruction by instruction, each is a known
instruction of a known micro-batch and chunk, its transfer (if any) names a neighbouring
stage and valid tensors, and it fills, reads and frees buffers and runs forwards and
backwards in a valid order; finally every micro-batch ran, every split backward's weight
part ran, and the last stage has a loss normaliser. Pure Python: no torch needed.
:mod:`dynapipe.runtime.plan_check` re-exports it beside the checks across ranks.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from dynapipe.errors import PlanError
from dynapipe.plan.instructions import (DTYPES, INSTRUCTION_TYPES, BackwardPass, CommInstruction, ExecutionPlan,
                                        ForwardPass, FreeBuffer, Instruction, LoadInput, RecvActivationFinish,
                                        RecvActivationStart, RecvGradFinish, RecvGradStart, SendActivationFinish,
                                        SendActivationStart, SendGradFinish, SendGradStart, buffer_name, plan_chunks)
from dynapipe.plan.validate_transfers import START_ROLES, neighbour_error


@dataclass
class _Walk:
    """One rank's walk through its plan: the layout it checks against, the micro-batches
    that send activations/gradients, and what the instructions so far did to buffers and
    to each ``(micro-batch, chunk)``'s forward and backward."""

    plan: ExecutionPlan
    stage: int
    num_stages: int
    chunks: int
    last_chunk: int  # the chunk ending the model, if this rank holds it (else -1)
    sends: set = field(default_factory=set)
    grads: set = field(default_factory=set)
    live: set[str] = field(default_factory=set)
    inflight: set[str] = field(default_factory=set)
    sending: set[str] = field(default_factory=set)  # buffers with a send started and not yet finished
    used: set[str] = field(default_factory=set)
    fw: set = field(default_factory=set)
    bw: set = field(default_factory=set)
    split: set = field(default_factory=set)  # micro-batches whose backward is split; their weight parts seen in weighed
    weighed: set = field(default_factory=set)


def _bad(w: _Walk, i: int, x, why: str) -> PlanError:
    """The error for instruction ``i`` (``x``) of the plan, saying ``why``."""
    return PlanError(f"pipeline rank {w.plan.stage}, instruction {i} ({x.OPCODE} mb {x.mb}): {why}")


def _check_layout(plan: ExecutionPlan, stage: int, num_stages: int, replica: Optional[int]) -> int:
    """The plan's chunks are a positive integer (several only on 2 or more stages) and it is
    for this rank's stage, pipeline size and replica (when given); returns the chunks."""
    chunks = plan_chunks(plan)
    if not chunks:
        raise PlanError(f"pipeline rank {stage}: the plan's meta['chunks'] is {(plan.meta or {}).get('chunks')!r}; "
                        f"it must be the number of virtual-pipeline chunks per rank, an integer >= 1.")
    if chunks > 1 and num_stages < 2:
        raise PlanError(f"the plan runs {chunks} virtual-pipeline chunks on a 1-stage pipeline; interleaving needs "
                        f"at least 2 pipeline ranks.")
    if plan.num_stages != num_stages or plan.stage != stage:
        raise PlanError(f"the plan is for stage {plan.stage} of {plan.num_stages}, but this rank is pipeline rank "
                        f"{stage} of {num_stages}; give each rank the plan of its own stage.")
    if replica is not None and plan.replica != replica:
        raise PlanError(f"the plan is for replica {plan.replica}, but this rank is in replica {replica}.")
    return chunks


def _known_micro_batches(plan: ExecutionPlan, stage: int) -> set:
    """The plan's micro-batch indices, which must not repeat."""
    known = {m.mb for m in plan.micro_batches}
    if len(known) != len(plan.micro_batches):
        raise PlanError(f"pipeline rank {stage}: micro-batch indices repeat in the plan's micro-batch list.")
    return known


def _start_walk(plan: ExecutionPlan, stage: int, num_stages: int, chunks: int) -> _Walk:
    """A walk with nothing run yet, knowing which micro-batches' chunks send activations and gradients."""
    last_chunk = chunks - 1 if stage == num_stages - 1 else -1
    sends = {(x.mb, x.chunk) for x in plan.instructions if isinstance(x, SendActivationStart)}
    grads = {(x.mb, x.chunk) for x in plan.instructions if isinstance(x, SendGradStart)}
    return _Walk(plan, stage, num_stages, chunks, last_chunk, sends, grads)


def _fill(w: _Walk, i: int, x, name: str) -> None:
    """Instruction ``i`` fills buffer ``name``, which no earlier instruction filled."""
    if name in w.used:
        raise _bad(w, i, x, f"buffer {name!r} is filled a second time.")
    w.used.add(name)
    w.live.add(name)


def _need(w: _Walk, i: int, x, name: str) -> None:
    """Instruction ``i`` reads buffer ``name``: filled, not freed, its receive finished."""
    if name not in w.live:
        raise _bad(w, i, x, f"buffer {name!r} is " + ("used after it was freed." if name in w.used
                                                       else "used before anything filled it."))
    if name in w.inflight:
        raise _bad(w, i, x, f"buffer {name!r} is used before its receive finished.")


def _check_identity(w: _Walk, i: int, x, known: set) -> None:
    """Instruction ``i`` is a known instruction type, of a micro-batch in the plan and one of its chunks."""
    if not isinstance(x, Instruction) or type(x) not in INSTRUCTION_TYPES.values():
        raise PlanError(f"pipeline rank {w.stage}, instruction {i}: {type(x).__name__} is not an instruction.")
    if x.mb not in known:
        raise _bad(w, i, x, f"micro-batch {x.mb} is not in the plan's micro-batch list {sorted(known)}.")
    if not 0 <= x.chunk < w.chunks:
        raise _bad(w, i, x, f"chunk {x.chunk} is not one of this plan's {w.chunks} virtual-pipeline chunk(s).")


def _check_transfer(w: _Walk, i: int, x) -> None:
    """A transfer names another stage (a start: the neighbouring virtual stage) and tensors
    of plan dtypes with positive sizes."""
    if not 0 <= x.peer < w.num_stages or x.peer == w.stage:
        raise _bad(w, i, x, f"peer {x.peer} is not another stage of this {w.num_stages}-stage pipeline.")
    wrong = neighbour_error(x, w.stage, w.num_stages, w.chunks) if type(x) in START_ROLES else ""
    if wrong:
        raise _bad(w, i, x, wrong)
    for t in x.tensors:
        if t.dtype not in DTYPES or not t.shape or any(int(d) <= 0 for d in t.shape):
            raise _bad(w, i, x, f"tensor {t.name!r} {list(t.shape)} {t.dtype} is not a valid transfer.")


def _run_forward(w: _Walk, i: int, x, key: tuple) -> None:
    """A forward runs once; every virtual stage but the first reads its received input, and
    one that sends fills its ``act_out``."""
    if key in w.fw:
        raise _bad(w, i, x, "the forward of this micro-batch runs twice.")
    w.fw.add(key)
    if w.stage > 0 or x.chunk > 0:  # every virtual stage but the first receives its input
        _need(w, i, x, buffer_name("act_in", *key))
    if key in w.sends:
        _fill(w, i, x, buffer_name("act_out", *key))


def _run_weight_part(w: _Walk, i: int, x, key: tuple) -> None:
    """The weight part of a split backward: after its input part, once, no buffers."""
    if key not in w.split or key in w.weighed:
        raise _bad(w, i, x, "the weight part of the backward runs " +
                   ("twice." if key in w.weighed else "before its input part."))
    w.weighed.add(key)


def _run_backward(w: _Walk, i: int, x, key: tuple) -> None:
    """A full backward or an input part: once, after the forward; all but the model's last
    chunk read the received ``grad_in``, and one that sends fills its ``grad_out``."""
    if x.part not in ("full", "input"):
        raise _bad(w, i, x, f"backward part {x.part!r} is not one of full, input, weight.")
    if key not in w.fw or key in w.bw:
        raise _bad(w, i, x, "the backward runs " + ("twice." if key in w.bw else "before the forward."))
    w.bw.add(key)
    if x.part == "input":
        w.split.add(key)
    if x.chunk != w.last_chunk:
        _need(w, i, x, buffer_name("grad_in", *key))
    if key in w.grads:
        _fill(w, i, x, buffer_name("grad_out", *key))


def _run_instruction(w: _Walk, i: int, x) -> None:
    """What instruction ``i`` does to buffers and to its micro-batch's forward and backward."""
    key = (x.mb, x.chunk)
    if isinstance(x, LoadInput):
        _fill(w, i, x, buffer_name("input", *key))
    elif isinstance(x, (RecvActivationStart, RecvGradStart)):
        _fill(w, i, x, x.buffer)
        w.inflight.add(x.buffer)
    elif isinstance(x, (RecvActivationFinish, RecvGradFinish)):
        w.inflight.discard(x.buffer)
    elif isinstance(x, (SendActivationStart, SendGradStart)):
        _need(w, i, x, x.buffer)
        w.sending.add(x.buffer)
    elif isinstance(x, (SendActivationFinish, SendGradFinish)):
        w.sending.discard(x.buffer)
    elif isinstance(x, ForwardPass):
        _run_forward(w, i, x, key)
    elif isinstance(x, BackwardPass) and x.part == "weight":
        _run_weight_part(w, i, x, key)
    elif isinstance(x, BackwardPass):
        _run_backward(w, i, x, key)
    elif isinstance(x, FreeBuffer):
        _need(w, i, x, x.buffer)
        if x.buffer in w.sending:
            raise _bad(w, i, x, f"buffer {x.buffer!r} is freed while its send is still in flight.")
        w.live.discard(x.buffer)


def _check_every_micro_batch_ran(w: _Walk, known: set) -> None:
    """Every micro-batch ran its forward on every chunk and, unless the plan is forward-only,
    its backward; every split backward ran its weight part."""
    every = {(mb, c) for mb in known for c in range(w.chunks)}
    trains = not (w.plan.meta or {}).get("forward_only", False)
    for done, what in ((w.fw, "forward"), (w.bw, "backward")):
        if (what == "forward" or trains) and every - done:
            mb, chunk = min(every - done)
            raise PlanError(f"pipeline rank {w.stage}: micro-batch {mb} (chunk {chunk}) is in the plan but never runs "
                            f"its {what}; its samples would not be trained. Recompile the plan.")
    if w.split - w.weighed:
        mb, chunk = min(w.split - w.weighed)
        raise PlanError(f"pipeline rank {w.stage}: the backward of micro-batch {mb} (chunk {chunk}) is split, but "
                        f"its weight part never runs; its weight gradients would be lost.")


def _check_loss_normaliser(w: _Walk, loss_tokens: Optional[int]) -> None:
    """The last stage, if it runs a forward, has a positive loss normaliser (tokens): the
    run's ``loss_tokens`` or the plan's ``global_loss_tokens``."""
    if w.last_chunk >= 0 and w.fw and loss_tokens is None and w.plan.global_loss_tokens <= 0:
        raise PlanError(f"pipeline rank {w.stage} (last stage): global_loss_tokens is {w.plan.global_loss_tokens}; "
                        f"the loss cannot be normalised by the global batch's loss tokens.")


def check_plan_locally(plan: ExecutionPlan, *, stage: int, num_stages: int, replica: Optional[int] = None,
                       loss_tokens: Optional[int] = None) -> None:
    """What one rank can check of its own plan before anything is sent.

    The plan is for this stage of a pipeline of this size (and this replica when given);
    every instruction names a known micro-batch; transfers name another stage and tensors
    of plan dtypes with positive sizes; each micro-batch's forward runs once and before its
    backward, and both run (a split backward: the input part, then the weight part, each
    once; a forward-only plan runs no backward); every
    buffer is filled before it is used, used only after its receive finished, and freed
    once while live. Agreement with the other ranks' plans is checked
    by :class:`~dynapipe.runtime.plan_check.PeerPlanCheck`. The last stage needs a positive
    loss normaliser: the plan's ``global_loss_tokens``, or ``loss_tokens`` (tokens) where the
    run passes its own. Raises :class:`PlanError` naming the instruction.
    """
    chunks = _check_layout(plan, stage, num_stages, replica)
    known = _known_micro_batches(plan, stage)
    w = _start_walk(plan, stage, num_stages, chunks)
    for i, x in enumerate(plan.instructions):
        _check_identity(w, i, x, known)
        if isinstance(x, CommInstruction):
            _check_transfer(w, i, x)
        _run_instruction(w, i, x)
    _check_every_micro_batch_ran(w, known)
    _check_loss_normaliser(w, loss_tokens)
