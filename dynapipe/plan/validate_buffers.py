"""Buffer checks of plan validation: buffer lifetimes and compute order of one plan.

:func:`check_buffers` walks one plan's instructions in order (the rules are in
:mod:`dynapipe.plan.validate`'s docstring): every buffer is created once, read only once
it exists and its receive finished, freed exactly once with no transfer of it in flight,
and never used after the free; each micro-batch's forward runs once, its backward (one
full one, or an input part then a weight part) after it, and every instruction's shape
matches its micro-batch's. At the end every buffer is freed and every micro-batch ran.
:func:`dynapipe.plan.validate.validate_plans` runs it after the transfer checks.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from dynapipe.errors import PlanError
from dynapipe.plan.deadlock import where as _where
from dynapipe.plan.instructions import (DTYPES, BackwardPass, ExecutionPlan, ForwardPass, FreeBuffer, LoadInput,
                                        buffer_name)
from dynapipe.plan.validate_transfers import FINISH_OF, START_ROLES, fail, plan_chunks


@dataclass
class _Lifetimes:
    """What one plan's instructions did so far: each buffer's state and the instruction
    indices that created and freed it, the sends of it in flight, and the instruction index
    of each ``(micro-batch, chunk)``'s forward and backward parts."""

    plan: ExecutionPlan
    state: dict[str, str] = field(default_factory=dict)   # buffer -> "pending" | "ready" | "freed"
    born: dict[str, int] = field(default_factory=dict)
    freed_at: dict[str, int] = field(default_factory=dict)
    sending: dict[str, int] = field(default_factory=dict)
    fw_done: dict[tuple, int] = field(default_factory=dict)
    bw_done: dict[tuple, int] = field(default_factory=dict)      # full backwards and input parts
    split_done: dict[tuple, int] = field(default_factory=dict)   # input parts
    weight_done: dict[tuple, int] = field(default_factory=dict)


def _use(life: _Lifetimes, k: int, inst, buf: str, *, need: bool = True) -> None:
    """Instruction ``k`` reads ``buf``: it must not be freed or still receiving, and (with
    ``need``) must exist."""
    st = life.state.get(buf)
    if st == "freed":
        fail(life.plan, k, inst, f"uses buffer {buf!r} after it was freed at instruction {life.freed_at[buf]} "
                                 f"(use after free).")
    if st == "pending":
        fail(life.plan, k, inst, f"reads buffer {buf!r} before the receive into it finished.")
    if st is None and need:
        fail(life.plan, k, inst, f"reads buffer {buf!r}, which no earlier instruction created.")


def _create(life: _Lifetimes, k: int, inst, buf: str, st: str) -> None:
    """Instruction ``k`` creates ``buf`` in state ``st``; a buffer is created once per iteration."""
    if buf in life.state:
        old = "was freed" if life.state[buf] == "freed" else "already exists"
        fail(life.plan, k, inst, f"creates buffer {buf!r}, which {old} (instruction {life.born[buf]}); "
                                 f"each buffer is created once per iteration.")
    life.state[buf], life.born[buf] = st, k


def _check_start(life: _Lifetimes, k: int, inst) -> None:
    """A ``*Start``: a send reads its buffer and puts one more send of it in flight; a
    receive creates its buffer, pending until the ``*Finish``."""
    if START_ROLES[type(inst)][1] == "send":
        _use(life, k, inst, inst.buffer)
        life.sending[inst.buffer] = life.sending.get(inst.buffer, 0) + 1
    else:
        _create(life, k, inst, inst.buffer, "pending")


def _check_finish(life: _Lifetimes, inst) -> None:
    """A ``*Finish``: a send of the buffer is no longer in flight, or the received buffer is ready."""
    if START_ROLES[FINISH_OF[type(inst)]][1] == "send":
        life.sending[inst.buffer] -= 1
    else:
        life.state[inst.buffer] = "ready"


def _check_load(life: _Lifetimes, k: int, inst, info, key: tuple) -> None:
    """A ``LoadInput``: at least one tensor, each of a plan dtype and shaped ``[rows,
    tokens]`` as the micro-batch is (its encoder's or its decoder's tokens); it creates the
    ``input`` buffer."""
    if not inst.tensors:
        fail(life.plan, k, inst, "loads no tensors.")
    lengths = (info.seqlen, info.dec_seqlen) if info.dec_seqlen > 0 else (info.seqlen,)
    for t in inst.tensors:
        if t.dtype not in DTYPES or len(t.shape) != 2 or t.shape[0] != info.mbs or t.shape[1] not in lengths:
            fail(life.plan, k, inst, f"input tensor {t.name} {list(t.shape)} {t.dtype} does not match "
                                     f"micro-batch {inst.mb} of {info.mbs} samples of "
                                     f"{' or '.join(map(str, lengths))} tokens.")
    _create(life, k, inst, buffer_name("input", *key), "ready")


def _check_compute_fields(plan: ExecutionPlan, k: int, inst, info) -> None:
    """A forward or backward pass has its micro-batch's shape and a known recompute level."""
    if (inst.mbs, inst.seqlen, inst.dec_seqlen) != (info.mbs, info.seqlen, info.dec_seqlen):
        fail(plan, k, inst, f"shape mbs={inst.mbs} seqlen={inst.seqlen} dec_seqlen={inst.dec_seqlen} "
                            f"differs from the micro-batch's mbs={info.mbs} seqlen={info.seqlen} "
                            f"dec_seqlen={info.dec_seqlen}.")
    if inst.recompute not in ("none", "selective", "full"):
        fail(plan, k, inst, f"recompute level {inst.recompute!r} is not none, selective or full.")
    # The rank's (chunk's) level is what the plan promises and what its memory was planned at;
    # a pass at another level would store, or recompute, what the plan did not price.
    levels = (plan.meta or {}).get("chunk_recompute")
    want = levels[inst.chunk] if isinstance(levels, list) and 0 <= inst.chunk < len(levels) else plan.recompute
    if inst.recompute != want:
        where = f"chunk {inst.chunk}'s level (meta chunk_recompute)" if isinstance(levels, list) else \
            "the plan's recompute level"
        fail(plan, k, inst, f"recompute level {inst.recompute!r} differs from {where} {want!r}; every forward and "
                            f"backward of a rank runs at its level.")


def _check_forward(life: _Lifetimes, k: int, inst, key: tuple, s: int, S: int) -> None:
    """A ``ForwardPass`` on virtual stage ``s`` of ``S``: once per micro-batch; reads the
    input (required on the first and last stage) and ``act_in`` (``s > 0``), creates
    ``act_out`` (``s < S - 1``)."""
    if key in life.fw_done:
        fail(life.plan, k, inst, f"runs the forward a second time (first at instruction {life.fw_done[key]}).")
    _use(life, k, inst, buffer_name("input", *key), need=s in (0, S - 1))
    if s > 0:
        _use(life, k, inst, buffer_name("act_in", *key))
    if s < S - 1:
        _create(life, k, inst, buffer_name("act_out", *key), "ready")
    life.fw_done[key] = k


def _check_weight_part(life: _Lifetimes, k: int, inst, key: tuple) -> None:
    """The weight part of a split backward: once, after the micro-batch's input part on this
    rank; it reads no buffer."""
    if key not in life.split_done:
        why = ("after a full backward" if key in life.bw_done else "before its input part")
        fail(life.plan, k, inst, f"runs the weight part of the backward {why}; a weight part follows the "
                                 f"micro-batch's part='input' backward on the same rank.")
    if key in life.weight_done:
        fail(life.plan, k, inst, f"runs the weight part a second time (first at instruction "
                                 f"{life.weight_done[key]}).")
    life.weight_done[key] = k


def _check_backward(life: _Lifetimes, k: int, inst, key: tuple, s: int, S: int) -> None:
    """A full backward or the input part of a split one on virtual stage ``s`` of ``S``: after
    the forward, once; reads ``grad_in`` and ``act_out`` (``s < S - 1``) and ``act_in``
    (``s > 0``), creates ``grad_out`` (``s > 0``)."""
    if inst.part not in ("full", "input"):
        fail(life.plan, k, inst, f"backward part {inst.part!r} is not 'full', 'input' or 'weight'.")
    if key not in life.fw_done:
        fail(life.plan, k, inst, "runs the backward before the forward.")
    if key in life.bw_done:
        fail(life.plan, k, inst, f"runs the backward a second time (first at instruction {life.bw_done[key]}); "
                                 f"a micro-batch runs one full backward or one part='input' backward.")
    _use(life, k, inst, buffer_name("input", *key), need=False)
    if s < S - 1:
        _use(life, k, inst, buffer_name("grad_in", *key))
        _use(life, k, inst, buffer_name("act_out", *key))
    if s > 0:
        _use(life, k, inst, buffer_name("act_in", *key))
        _create(life, k, inst, buffer_name("grad_out", *key), "ready")
    life.bw_done[key] = k
    if inst.part == "input":
        life.split_done[key] = k


def _check_free(life: _Lifetimes, k: int, inst) -> None:
    """A ``FreeBuffer``: of a created buffer, once, with no transfer of it in flight."""
    buf = inst.buffer
    st = life.state.get(buf)
    if st is None:
        fail(life.plan, k, inst, f"frees buffer {buf!r}, which was never created.")
    if st == "freed":
        fail(life.plan, k, inst, f"frees buffer {buf!r} a second time (double free; first at instruction "
                                 f"{life.freed_at[buf]}).")
    if st == "pending" or life.sending.get(buf, 0):
        fail(life.plan, k, inst, f"frees buffer {buf!r} while a transfer of it is still in flight.")
    life.state[buf], life.freed_at[buf] = "freed", k


def _check_instruction(life: _Lifetimes, k: int, inst, infos: dict, S: int) -> None:
    """Instruction ``k`` of a plan of ``S`` virtual stages, checked by its type."""
    plan = life.plan
    info = infos[inst.mb]
    key = (inst.mb, inst.chunk)
    s = inst.chunk * plan.num_stages + plan.stage  # the virtual stage (the rank itself without chunks)
    cls = type(inst)
    if cls in START_ROLES:
        _check_start(life, k, inst)
    elif cls in FINISH_OF:
        _check_finish(life, inst)
    elif cls is LoadInput:
        _check_load(life, k, inst, info, key)
    elif cls in (ForwardPass, BackwardPass):
        _check_compute_fields(plan, k, inst, info)
        if cls is ForwardPass:
            _check_forward(life, k, inst, key, s, S)
        elif inst.part == "weight":
            _check_weight_part(life, k, inst, key)
        else:
            _check_backward(life, k, inst, key, s, S)
    elif cls is FreeBuffer:
        _check_free(life, k, inst)
    else:
        fail(plan, k, inst, f"unknown instruction type {cls.__name__}.")


def _check_all_freed(life: _Lifetimes) -> None:
    """At the plan's end every buffer it created is freed."""
    end = len(life.plan.instructions)
    for buf, st in life.state.items():
        if st != "freed":
            raise PlanError(f"{_where(life.plan, life.born[buf])}: buffer {buf!r} created here is never freed "
                            f"(plan ends at instruction {end}).")


def _check_all_ran(life: _Lifetimes, chunks: int) -> None:
    """Every micro-batch ran its forward on each of the ``chunks`` chunks and, unless the plan
    is forward-only, its backward (both parts of a split one)."""
    plan = life.plan
    end = len(plan.instructions)
    # A forward-only (evaluation) plan runs no backward (dynapipe.plan.forward_only).
    needs_backward = not plan.meta.get("forward_only", False)
    fw_done, bw_done, split_done, weight_done = life.fw_done, life.bw_done, life.split_done, life.weight_done
    for m in plan.micro_batches:
        for c in range(chunks):
            key = (m.mb, c)
            if key not in fw_done or (needs_backward and (key not in bw_done or
                                                          (key in split_done and key not in weight_done))):
                missing = ("forward" if key not in fw_done else "backward" if key not in bw_done
                           else "weight part of its split backward")
                of = f" of chunk {c}" if chunks > 1 else ""
                raise PlanError(f"{_where(plan, end)}: micro-batch {m.mb} has no {missing}{of} on this rank.")


def check_buffers(plan: ExecutionPlan) -> None:
    """Buffer lifetimes and compute order of one plan (see the module docstring). With
    ``chunks`` per rank, the first/last-rank rules apply to the virtual stage
    ``chunk * S + stage`` of ``chunks * S``. Raises :class:`PlanError`."""
    chunks = plan_chunks(plan)
    S = plan.num_stages * chunks
    infos = {m.mb: m for m in plan.micro_batches}
    life = _Lifetimes(plan)
    for k, inst in enumerate(plan.instructions):
        _check_instruction(life, k, inst, infos, S)
    _check_all_freed(life)
    _check_all_ran(life, chunks)
