"""Transfer checks of plan validation: each plan's transfers, and sends paired with receives.

:func:`collect_transfers` reads one plan's transfers in posting order and checks each on
its own: every Start is finished once by a later Finish of the same transfer, peers are
other ranks of the pipeline, buffer names follow :func:`dynapipe.plan.instructions.buffer_name`,
tensors fit their micro-batch (sequence-sharded under sequence parallelism), and the
Starts of one posting group stand together. :func:`match_pair` then pairs one rank's sends
to another with that rank's receives: every send has exactly one receive with the same
micro-batch, shapes and dtypes, and both come in the same order (NCCL's point-to-point is
tagless and pairs messages first-in first-out). :func:`dynapipe.plan.validate.validate_plans`
runs both before the buffer and deadlock checks.
"""
from __future__ import annotations

from dynapipe.errors import PlanError
from dynapipe.plan.deadlock import Transfer, where as _where
from dynapipe.plan.instructions import (DTYPES, ExecutionPlan, Instruction, RecvActivationFinish, RecvActivationStart,
                                        RecvGradFinish, RecvGradStart, SendActivationFinish, SendActivationStart,
                                        SendGradFinish, SendGradStart, buffer_name, sequence_shards)

# Start class -> (finish class, direction, message kind, buffer kind).
START_ROLES = {
    SendActivationStart: (SendActivationFinish, "send", "act", "act_out"),
    SendGradStart: (SendGradFinish, "send", "grad", "grad_out"),
    RecvActivationStart: (RecvActivationFinish, "recv", "act", "act_in"),
    RecvGradStart: (RecvGradFinish, "recv", "grad", "grad_in"),
}
FINISH_OF = {v[0]: k for k, v in START_ROLES.items()}


def fail(plan: ExecutionPlan, index: int, inst, reason: str) -> None:
    """Raise :class:`PlanError` saying where ``inst`` (instruction ``index`` of ``plan``) is and ``reason``."""
    raise PlanError(f"{_where(plan, index, inst)}: {reason}")


def _shapes(tensors) -> str:
    return "[" + ", ".join(f"{t.name} {list(t.shape)} {t.dtype}" for t in tensors) + "]"


def collect_transfers(plan: ExecutionPlan) -> list[Transfer]:
    """Every transfer of one plan in posting order, with its Finish; checks that each
    Start has one later Finish of the same transfer, peers and buffer names are valid,
    tensors fit the micro-batch, and posting groups stand together."""
    S, s = plan.num_stages, plan.stage
    infos = {m.mb: m for m in plan.micro_batches}
    if len(infos) != len(plan.micro_batches):
        raise PlanError(f"{_where(plan, -1)}: micro-batch indices repeat in the plan's micro-batch list.")
    shards = sequence_shards(plan)
    if shards < 1 or any(m.seqlen % shards or m.dec_seqlen % shards for m in plan.micro_batches):
        raise PlanError(f"{_where(plan, -1)}: sequence parallelism over {plan.meta.get('tp')!r} tensor-parallel "
                        f"ranks needs a positive TP size dividing every micro-batch's sequence length.")
    chunks = plan_chunks(plan)
    open_starts: dict[tuple, Transfer] = {}
    comms: list[Transfer] = []
    groups_seen: dict[int, int] = {}
    post_group = -1
    prev_group = None
    for k, inst in enumerate(plan.instructions):
        if not isinstance(inst, Instruction):
            raise PlanError(f"{_where(plan, k)}: {inst!r} is not an instruction.")
        info = infos.get(inst.mb)
        if info is None:
            fail(plan, k, inst, f"names micro-batch {inst.mb}, which is not in the plan's list "
                                f"({len(infos)} micro-batches).")
        cls = type(inst)
        if not 0 <= inst.chunk < chunks:
            fail(plan, k, inst, f"names chunk {inst.chunk}; the plan runs {chunks} chunk(s) per rank.")
        grouped = cls in START_ROLES and inst.group >= 0
        if not (grouped and prev_group == inst.group):
            post_group += 1
            if grouped:
                if inst.group in groups_seen:
                    fail(plan, k, inst, f"group {inst.group} was already used at instruction "
                                        f"{groups_seen[inst.group]}; a group's starts must stand together.")
                groups_seen[inst.group] = k
        prev_group = inst.group if grouped else None
        if cls in START_ROLES:
            finish_cls, direction, kind, buf_kind = START_ROLES[cls]
            if not 0 <= inst.peer < S or inst.peer == s:
                fail(plan, k, inst, f"peer rank {inst.peer} is not another rank of the {S}-stage pipeline.")
            wrong = neighbour_error(inst, s, S, chunks)
            if wrong:
                fail(plan, k, inst, wrong)
            if inst.buffer != buffer_name(buf_kind, inst.mb, inst.chunk):
                fail(plan, k, inst, f"buffer {inst.buffer!r} should be {buffer_name(buf_kind, inst.mb, inst.chunk)!r}.")
            if not inst.tensors:
                fail(plan, k, inst, "moves no tensors.")
            for t in inst.tensors:
                if t.dtype not in DTYPES:
                    fail(plan, k, inst, f"tensor {t.name!r} has dtype {t.dtype!r}, not one of {DTYPES}.")
                if len(t.shape) != 3 or t.shape[1] != info.mbs or \
                        t.shape[0] not in (info.seqlen // shards, info.dec_seqlen // shards):
                    want = "[seqlen, mbs, hidden]" if shards == 1 else f"[seqlen / {shards}, mbs, hidden]"
                    fail(plan, k, inst, f"tensor {t.name} {list(t.shape)} does not match micro-batch {inst.mb} "
                                        f"(mbs {info.mbs}, seqlen {info.seqlen}); expected {want}.")
            oid = (finish_cls, inst.peer, inst.buffer)
            if oid in open_starts:
                fail(plan, k, inst, f"starts a second transfer of {inst.buffer!r} with rank {inst.peer} before "
                                    f"the first (instruction {open_starts[oid].index}) finished.")
            c = Transfer(s, k, inst, direction, kind, post_group)
            if direction == "recv" and chunks > 1:
                # Virtual stage of the sender: the one before (activation) or after (gradient).
                c.sender_chunk = (inst.chunk * S + s + (-1 if kind == "act" else 1)) // S
            open_starts[oid] = c
            comms.append(c)
        elif cls in FINISH_OF:
            c = open_starts.pop((cls, inst.peer, inst.buffer), None)
            if c is None:
                fail(plan, k, inst, f"finishes a transfer of {inst.buffer!r} with rank {inst.peer} that was "
                                    f"never started.")
            if c.inst.tensors != inst.tensors or c.inst.mb != inst.mb or c.inst.chunk != inst.chunk:
                fail(plan, k, inst, f"does not match its start at instruction {c.index} "
                                    f"({_shapes(c.inst.tensors)} vs {_shapes(inst.tensors)}).")
            c.finish = k
    for c in open_starts.values():
        fail(plan, c.index, c.inst, "is never finished.")
    return comms


def neighbour_error(inst, stage: int, num_stages: int, chunks: int) -> str:
    """Why transfer Start ``inst`` on pipeline rank ``stage`` names the wrong peer ('' when
    right): activations go to the next virtual stage and gradients to the one before (virtual
    stage ``v = chunk x num_stages + rank``, held by rank ``v mod num_stages``); a message to
    any other rank would skip or repeat layers."""
    _, direction, kind, _ = START_ROLES[type(inst)]
    v = inst.chunk * num_stages + stage
    other = v + (1 if (direction == "send") == (kind == "act") else -1)
    side = "next" if other > v else "previous"
    verb, to = ("send", "to") if direction == "send" else ("receive", "from")
    if not 0 <= other < num_stages * chunks:
        return (f"virtual stage {v} (chunk {inst.chunk} of rank {stage}) has no {side} stage to {verb} the "
                f"{kind} of micro-batch {inst.mb} {to}.")
    if inst.peer != other % num_stages:
        return (f"{verb}s the {kind} of micro-batch {inst.mb} {to} rank {inst.peer}, but the {side} stage, "
                f"virtual stage {other}, is rank {other % num_stages}.")
    return ""


def plan_chunks(plan: ExecutionPlan) -> int:
    """Virtual-pipeline chunks per rank (``meta["chunks"]``, 1 when absent)."""
    chunks = (plan.meta or {}).get("chunks", 1)
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
        raise PlanError(f"{_where(plan, -1)}: meta chunks={chunks!r} is not a positive number of chunks.")
    return chunks


def match_pair(a: ExecutionPlan, b: ExecutionPlan, sends: list[Transfer], recvs: list[Transfer]) -> None:
    """Pair rank a's sends to b with b's receives from a, first-in first-out."""
    send_keys = {c.key: c for c in sends}
    recv_keys = {c.key: c for c in recvs}
    for c in sends:
        if c.key not in recv_keys:
            fail(a, c.index, c.inst, f"rank {b.stage} posts no matching receive (missing receive of the "
                                     f"{c.kind} of micro-batch {c.inst.mb} from rank {a.stage}).")
    for c in recvs:
        if c.key not in send_keys:
            fail(b, c.index, c.inst, f"rank {a.stage} never sends the {c.kind} of micro-batch {c.inst.mb} "
                                     f"this receives (missing send).")
    if len(send_keys) != len(sends) or len(recv_keys) != len(recvs):
        dup = next(c for i, c in enumerate(sends + recvs) if c.key in {x.key for x in (sends + recvs)[:i]
                                                                        if x.direction == c.direction})
        fail(a if dup.direction == "send" else b, dup.index, dup.inst, f"transfers the {dup.kind} of "
                                                                       f"micro-batch {dup.inst.mb} twice.")
    for n, (s, r) in enumerate(zip(sends, recvs)):
        if s.key != r.key:
            fail(b, r.index, r.inst,
                 f"message order differs from the sender: rank {a.stage}'s message #{n} to rank {b.stage} is "
                 f"the {s.kind} of micro-batch {s.inst.mb} ({_where(a, s.index)}), but this receive, #{n} "
                 f"from rank {a.stage}, expects the {r.kind} of micro-batch {r.inst.mb}; point-to-point "
                 f"messages pair in posting order (swapped send order).")
        if s.inst.tensors != r.inst.tensors:
            fail(b, r.index, r.inst, f"expects {_shapes(r.inst.tensors)} but {_where(a, s.index)} sends "
                                     f"{_shapes(s.inst.tensors)} (shape mismatch).")
        if (s.inst.group >= 0) != (r.inst.group >= 0):
            # Gloo pairs such messages, but NCCL can hang on batched lists that differ between
            # the two ends (the runtime refuses them under NCCL; no plan should carry one).
            one, other = (s, a) if s.inst.group >= 0 else (r, b)
            fail(other, one.index, one.inst, f"is posted in group {one.inst.group} but its partner "
                                             f"{_where(b if one is s else a, (r if one is s else s).index)} "
                                             f"is posted alone; group both ends of a message or neither.")
        s.partner, r.partner = r, s

