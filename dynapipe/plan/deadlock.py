"""The deadlock check: a symbolic run of every rank's plan under in-order point-to-point.

Model (conservative, as NCCL behaves at worst): each rank's communication ops run in
posting order on one stream; an op completes only when its peer's matching op is at the
head of the peer's stream too; ops posted together in one group (adjacent Starts with
the same ``group >= 0``) complete together, and only if every op of the group can; a
``*Finish`` blocks its rank until its op has completed; compute never blocks. Plans that
finish under this model also finish under gloo, whose sends may complete earlier.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from dynapipe.errors import PlanError
from dynapipe.plan.instructions import CommInstruction, ExecutionPlan


@dataclass
class Transfer:
    """One transfer op (a Start and its Finish) of one rank, in posting order."""

    rank: int
    index: int          # instruction index of the Start
    inst: CommInstruction
    direction: str      # "send" | "recv"
    kind: str           # "act" | "grad"
    post_group: int     # ops with equal post_group on a rank are posted together
    finish: int = -1    # instruction index of the Finish
    partner: "Transfer | None" = None
    done: bool = False
    # The sender's chunk (interleaved plans: a receive's own chunk differs where the
    # message crosses from the last rank to the first); -1: the instruction's chunk.
    sender_chunk: int = -1

    @property
    def key(self) -> tuple:
        return (self.kind, self.inst.mb, self.inst.chunk if self.sender_chunk < 0 else self.sender_chunk)

    def describe(self) -> str:
        arrow = "to" if self.direction == "send" else "from"
        return (f"instruction {self.index} ({self.inst.OPCODE} micro-batch {self.inst.mb} "
                f"{arrow} rank {self.inst.peer})")


def where(plan: ExecutionPlan, index: int, inst=None) -> str:
    """``[replica R ]rank S instruction K (opcode micro-batch M)``: where an error is (a negative
    ``index``: the plan as a whole, no instruction)."""
    rep = f"replica {plan.replica} " if plan.num_replicas > 1 else ""
    if index < 0:
        return f"{rep}rank {plan.stage}"
    what = f" ({inst.OPCODE} micro-batch {inst.mb})" if inst is not None else ""
    return f"{rep}rank {plan.stage} instruction {index}{what}"


def symbolic_run(plans: list[ExecutionPlan], comms: list[list[Transfer]]) -> None:
    """Run every rank's list under the conservative NCCL model; raise on deadlock."""
    S = len(plans)
    by_start = [{c.index: c for c in cs} for cs in comms]
    by_finish = [{c.finish: c for c in cs} for cs in comms]
    pc = [0] * S
    streams: list[deque] = [deque() for _ in range(S)]
    while True:
        progressed = False
        for r in range(S):
            insts, start, finish = plans[r].instructions, by_start[r], by_finish[r]
            stream = streams[r]
            k = pc[r]
            while k < len(insts):
                c = start.get(k)
                if c is not None:
                    if stream and stream[-1][0].post_group == c.post_group:
                        stream[-1].append(c)
                    else:
                        stream.append([c])
                else:
                    c = finish.get(k)
                    if c is not None and not c.done:
                        break
                k += 1
            if k != pc[r]:
                progressed = True
                pc[r] = k
        heads = {r: streams[r][0] for r in range(S) if streams[r]}
        alive = set(heads)
        changed = True
        while changed:
            changed = False
            for r in list(alive):
                for c in heads[r]:
                    p = c.partner.rank
                    if p not in alive or not any(x is c.partner for x in heads[p]):
                        alive.discard(r)
                        changed = True
                        break
        for r in alive:
            for c in streams[r].popleft():
                c.done = True
        if not alive and not progressed:
            break
    blocked = [r for r in range(S) if pc[r] < len(plans[r].instructions)]
    if not blocked:
        return
    reasons = []
    for r in blocked:
        plan = plans[r]
        waiting = by_finish[r][pc[r]]
        head = streams[r][0][0] if streams[r] else None
        why = f"{where(plan, pc[r], plan.instructions[pc[r]])} waits for {waiting.describe()}"
        if head is not None and head is not waiting:
            why += f", queued behind {head.describe()}"
        if head is not None:
            p = head.partner
            if pc[p.rank] <= p.index:
                why += (f"; rank {p.rank} posts the matching op only at instruction {p.index}, after it blocks at "
                        f"instruction {pc[p.rank]}")
            else:
                why += (f"; rank {p.rank}'s matching op ({p.describe()}) is queued behind "
                        f"{streams[p.rank][0][0].describe()}")
        reasons.append(why)
    raise PlanError("deadlock under in-order point-to-point semantics: " + "; and ".join(reasons))
