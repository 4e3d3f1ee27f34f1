"""Check a set of execution plans before anything runs.

What each instruction reads and writes on pipeline rank ``s`` of ``S`` (buffers are
``"<kind>:<mb>:<chunk>"``, see :func:`dynapipe.plan.instructions.buffer_name`):

- ``LoadInput`` creates ``input``; ``Recv*Start`` creates ``act_in``/``grad_in``, which
  may be read only after its ``Recv*Finish``;
- ``ForwardPass`` reads ``input`` (if loaded; required on the first and last rank) and
  ``act_in`` (``s > 0``) and creates ``act_out`` (``s < S - 1``);
- ``BackwardPass`` needs the forward done and reads ``grad_in`` and ``act_out``
  (``s < S - 1``) and ``act_in`` (``s > 0``); it creates ``grad_out`` (``s > 0``). A
  split backward's ``part="input"`` does exactly that, and its ``part="weight"`` reads
  no buffer and must follow the input part on the same rank: each micro-batch runs
  either one ``full`` backward or one ``input`` and then one ``weight`` part;
- ``Send*Start`` reads ``act_out``/``grad_out``; ``FreeBuffer`` releases a buffer whose
  transfers have all finished.

Checks, in order: every plan's transfers (each Start finished once, valid peers and
tensors); every send has exactly one receive on its peer with the same micro-batch,
shapes and dtypes, and for each ordered pair of ranks sends and receives come in the
same order (NCCL's point-to-point is tagless and pairs messages first-in first-out;
these two in :mod:`dynapipe.plan.validate_transfers`); buffer lifetimes (created before use, freed exactly once, never used after the free;
:mod:`dynapipe.plan.validate_buffers`); and a symbolic run
of all ranks finishes under a conservative NCCL model: each rank's communication ops
run in posting order on one stream, an op completes only when its peer's matching op
is at the head of the peer's stream too (Starts posted together in one group complete
together), and a ``*Finish`` blocks until its op has completed. Plans that pass also
run under gloo. Errors name the replica, rank, instruction index and reason.

Plans the compiler made (instruction tables) are first offered to
:func:`dynapipe.plan.validate_fast.group_is_valid`, a linear-time check that can only
accept; everything it does not accept is checked here, object by object.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from dynapipe.cost.base import RECOMPUTE_LEVELS
from dynapipe.errors import PlanError, flag, is_whole
from dynapipe.plan.deadlock import symbolic_run, where as _where
from dynapipe.plan.instructions import ExecutionPlan
from dynapipe.plan.table import InstructionTable
from dynapipe.plan.validate_buffers import check_buffers as _check_buffers
from dynapipe.plan.validate_fast import group_is_valid
from dynapipe.plan.validate_transfers import collect_transfers, match_pair


@dataclass(frozen=True)
class ValidationSummary:
    """What a valid plan set holds."""

    replicas: int
    stages: int
    micro_batches: int
    instructions: int
    transfers: int

    def line(self) -> str:
        return (f"valid: {self.replicas * self.stages} plans ({self.replicas} replica(s) x {self.stages} stages), "
                f"{self.micro_batches} micro-batches, {self.instructions} instructions, {self.transfers} transfers")


# Ranks that disagree on what the iteration is were, in practice, planned apart.
_ONE_RUN = "the plans of one iteration must all come from one planning run: plan every rank together."


# What every rank of a replica runs alike: the tensor-parallel layout, the stage placement, the
# chunks and whether the plan trains (the micro-batch order is a record of the planner's).
_SHARED_META = ("tp", "sequence_parallel", "chunks", "placement", "forward_only")


def _check_plan_fields(plan: ExecutionPlan) -> None:
    """The fields an edited plan can get wrong that the instructions do not show: the iteration,
    the tensor-parallel size, the micro-batch order, and each micro-batch's samples and rows."""
    if not is_whole(plan.iteration, 0):
        raise PlanError(f"{_where(plan, -1)}: iteration={plan.iteration!r} is not a whole number from 0.")
    if not is_whole(plan.num_replicas, 1) or not is_whole(plan.replica, 0) or plan.replica >= plan.num_replicas:
        raise PlanError(f"{_where(plan, -1)}: replica={plan.replica!r} of num_replicas={plan.num_replicas!r}; a plan "
                        f"belongs to one of 1 or more data-parallel replicas, numbered from 0.")
    if not is_whole(plan.global_loss_tokens, 0):
        raise PlanError(f"{_where(plan, -1)}: global_loss_tokens={plan.global_loss_tokens!r} is not a whole number "
                        f"from 0 (the loss tokens of every replica).")
    tp = plan.meta.get("tp", 1)
    if not is_whole(tp, 1):
        raise PlanError(f"{_where(plan, -1)}: meta tp={tp!r} is not a whole number of tensor-parallel ranks.")
    if plan.meta.get("sequence_parallel", False) not in (True, False):
        raise PlanError(f"{_where(plan, -1)}: meta sequence_parallel={plan.meta['sequence_parallel']!r} is not "
                        f"true or false.")
    M = len(plan.micro_batches)
    order = plan.meta.get("mb_order") or []
    if not isinstance(order, (list, tuple)) or (len(order) and (not all(is_whole(x, 0) for x in order)
                                                              or sorted(order) != list(range(M)))):
        shown = list(order)[:8] if isinstance(order, (list, tuple)) else order
        raise PlanError(f"{_where(plan, -1)}: meta mb_order={shown!r} is not an order of the plan's {M} "
                        f"micro-batches (each of 0..{M - 1} once).")
    for m in plan.micro_batches:
        if not all(is_whole(x, 0) for x in m.samples):
            raise PlanError(f"{_where(plan, -1)}: micro-batch {m.mb} has samples {list(m.samples)[:8]!r}; samples "
                            f"are indices into the global batch, whole numbers from 0.")
        rows = [x for r in m.rows for x in r]
        if (m.rows and (len(m.rows) != m.mbs or tuple(rows) != tuple(m.samples))) or (
                not m.rows and len(m.samples) != m.mbs):
            raise PlanError(f"{_where(plan, -1)}: micro-batch {m.mb} has {m.mbs} row(s) but "
                            f"{len(m.rows) if m.rows else len(m.samples)} "
                            f"{'packed rows' if m.rows else 'samples'}; a row holds one sample, or the samples "
                            f"packed into it (samples is the rows' concatenation).")


# Loaded inputs the handlers use as indices (token ids, positions, labels): int64, as torch's
# embedding and loss take them.
_INDEX_TENSORS = ("tokens", "dec_tokens", "position_ids", "labels")


def _check_tensors(plan: ExecutionPlan) -> None:
    """Refuse a tensor the plan moves or loads with a dimension below 1 (every dimension is a
    micro-batch's rows, tokens or the hidden size) or an index input that is not int64."""
    ins = plan.instructions
    lists = ins.tensor_lists if isinstance(ins, InstructionTable) else [getattr(i, "tensors", ()) for i in ins]
    for specs in lists:
        for t in specs or ():
            if any(d < 1 for d in t.shape):
                raise PlanError(f"{_where(plan, -1)}: tensor {t.name!r} has shape {list(t.shape)}; every dimension "
                                f"of a tensor a plan moves or loads is at least 1.")
            if t.name in _INDEX_TENSORS and t.dtype != "int64":
                raise PlanError(f"{_where(plan, -1)}: tensor {t.name!r} is {t.dtype}; token ids, positions and "
                                f"labels are int64.")


def _check_group(plans: list[ExecutionPlan]) -> int:
    first = plans[0]
    for p in plans:
        for field in ("num_stages", "num_replicas", "iteration", "global_loss_tokens", "schedule"):
            if getattr(p, field) != getattr(first, field):
                raise PlanError(f"{_where(p, -1)}: {field}={getattr(p, field)} differs from rank {first.stage}'s "
                                f"{getattr(first, field)}; {_ONE_RUN}")
        if p.micro_batches != first.micro_batches:
            raise PlanError(f"{_where(p, -1)}: its micro-batch list differs from rank {first.stage}'s; {_ONE_RUN}")
        for key in _SHARED_META:
            if p.meta.get(key) != first.meta.get(key):
                raise PlanError(f"{_where(p, -1)}: meta {key}={p.meta.get(key)!r} differs from rank {first.stage}'s "
                                f"{first.meta.get(key)!r}; {_ONE_RUN}")
    _check_plan_fields(first)
    for p in plans:
        _check_tensors(p)
        if p.recompute not in RECOMPUTE_LEVELS:
            raise PlanError(f"{_where(p, -1)}: recompute={p.recompute!r} is not one of {RECOMPUTE_LEVELS}.")
        for m in p.micro_batches:
            # Encoder-decoder losses count targets only: the decoder rows bound them.
            row = m.dec_seqlen if m.dec_seqlen > 0 else m.seqlen
            # A micro-batch of packed rows may hold only padding rows (a fixed-shape baseline
            # fills each replica's last micro-batch so); any other holds samples.
            if (not m.samples and not m.rows) or m.loss_tokens < 0 or m.loss_tokens > m.mbs * row:
                raise PlanError(f"{_where(p, -1)}: micro-batch {m.mb} holds {len(m.samples)} sample(s) and "
                                f"{m.loss_tokens} loss tokens, which {m.mbs} x {row} padded "
                                f"{'target ' if m.dec_seqlen > 0 else ''}tokens cannot hold.")
        if p.loss_tokens != sum(m.loss_tokens for m in p.micro_batches):
            raise PlanError(f"{_where(p, -1)}: loss_tokens={p.loss_tokens} is not the sum of its micro-batches' "
                            f"{sum(m.loss_tokens for m in p.micro_batches)}.")
    if group_is_valid(plans):
        return _count_transfers(plans)
    comms = [collect_transfers(p) for p in plans]
    S = len(plans)
    # One pass buckets every transfer by (sender, receiver): linear in the plan size.
    sends: dict[tuple[int, int], list] = {}
    recvs: dict[tuple[int, int], list] = {}
    for a in range(S):
        for c in comms[a]:
            if c.direction == "send":
                sends.setdefault((a, c.inst.peer), []).append(c)
            else:
                recvs.setdefault((c.inst.peer, a), []).append(c)
    for a, b in sorted(set(sends) | set(recvs)):
        match_pair(plans[a], plans[b], sends.get((a, b), []), recvs.get((a, b), []))
    for p in plans:
        _check_buffers(p)
    symbolic_run(plans, comms)
    return sum(len(c) for c in comms) // 2


def _count_transfers(plans: list[ExecutionPlan]) -> int:
    from dynapipe.plan.table import COL, OPCODE_INDEX
    starts = [OPCODE_INDEX[o] for o in ("send_act_start", "send_grad_start")]
    return sum(int(np.isin(p.instructions.rows[:, COL["op"]], starts).sum()) for p in plans)


def validate_plans(plans: Sequence[ExecutionPlan], *, complete: bool = True) -> ValidationSummary:
    """Validate the plans of one or more pipeline replicas; raise :class:`PlanError`.

    ``plans`` holds, for every replica present, exactly one plan per stage. With
    ``complete`` (the default) every replica ``0..num_replicas-1`` of the declared
    layout must be present; ``complete=False`` checks a subset (one planner worker's
    share). When every replica is present, their loss tokens must add up to
    ``global_loss_tokens`` and no sample may appear in two replicas.
    """
    flag("complete", complete)
    if plans is None or isinstance(plans, (str, bytes)):
        raise PlanError(f"plans {plans!r:.60}: give a sequence of ExecutionPlans (read_plan_dir reads a directory).")
    plans = list(plans)
    if not plans:
        raise PlanError("no plans to validate.")
    groups: dict[int, dict[int, ExecutionPlan]] = {}
    for p in plans:
        if not isinstance(p, ExecutionPlan):
            raise PlanError(f"{p!r} is not an ExecutionPlan.")
        if not 0 <= p.stage < p.num_stages or not 0 <= p.replica < p.num_replicas:
            raise PlanError(f"plan of replica {p.replica} rank {p.stage} is outside the "
                            f"{p.num_replicas} x {p.num_stages} layout.")
        if (p.num_stages, p.num_replicas) != (plans[0].num_stages, plans[0].num_replicas):
            raise PlanError(f"plan of replica {p.replica} rank {p.stage} declares a {p.num_replicas} x {p.num_stages} "
                            f"layout, plan of replica {plans[0].replica} rank {plans[0].stage} a "
                            f"{plans[0].num_replicas} x {plans[0].num_stages} one; every plan of a set declares the "
                            f"same layout.")
        g = groups.setdefault(p.replica, {})
        if p.stage in g:
            raise PlanError(f"two plans for replica {p.replica} rank {p.stage}.")
        g[p.stage] = p
    S = plans[0].num_stages
    if complete:
        R = plans[0].num_replicas
        # Listed only up to the ninth missing replica: a layout field read from a damaged
        # file can declare billions.
        missing = [r for r in range(min(R, len(groups) + 9)) if r not in groups]
        if len(groups) < R:
            lost = R - len(groups)
            shown = ", ".join(map(str, missing[:8])) + (f" and {lost - 8} more" if lost > 8 else "")
            raise PlanError(f"the plan set is incomplete: the layout declares {R} replica(s) x {S} stages, but "
                            f"replica(s) {shown} have no plans ({lost * S} of {R * S} plans missing).")
    transfers = insts = 0
    for replica in sorted(groups):
        g = groups[replica]
        if len(g) < S:
            missing = [s for s in range(min(S, len(g) + 9)) if s not in g][:8]
            more = f" and {S - len(g) - len(missing)} more" if S - len(g) > len(missing) else ""
            raise PlanError(f"replica {replica}: no plan for rank(s) {missing}{more} of the {S}-stage pipeline.")
        ordered = [g[s] for s in range(S)]
        transfers += _check_group(ordered)
        insts += sum(len(p.instructions) for p in ordered)
    total_mbs = sum(len(groups[r][0].micro_batches) for r in groups)
    first = plans[0]
    if set(groups) == set(range(first.num_replicas)):
        loss = sum(groups[r][0].loss_tokens for r in groups)
        if loss != first.global_loss_tokens:
            raise PlanError(f"the replicas' loss tokens add up to {loss}, but the plans normalise the loss by "
                            f"global_loss_tokens={first.global_loss_tokens}.")
        every = [x for r in sorted(groups) for m in groups[r][0].micro_batches for x in m.samples]
        unique = np.unique(np.asarray(every, dtype=np.int64))
        if len(unique) == len(every):
            # Samples index the global batch: the set's indices are 0..n-1, each once.
            if len(unique) and unique[-1] != len(unique) - 1:
                gap = int(np.flatnonzero(unique != np.arange(len(unique)))[0])
                raise PlanError(f"the plans train samples {unique[:3].tolist()}...{unique[-2:].tolist()}, but samples index "
                                f"the global batch of {len(unique)} samples: sample {int(unique[-1])} is outside it "
                                f"and sample {gap} is missing.")
            return ValidationSummary(len(groups), S, total_mbs, insts, transfers)
        seen: dict[int, tuple[int, int]] = {}   # a sample repeats: find and name it
        for r in sorted(groups):
            for m in groups[r][0].micro_batches:
                for x in m.samples:
                    if x in seen:
                        raise PlanError(f"sample {x} appears in replica {seen[x][0]} micro-batch {seen[x][1]} and "
                                        f"in replica {r} micro-batch {m.mb}: every sample is trained once.")
                    seen[x] = (r, m.mb)
    return ValidationSummary(len(groups), S, total_mbs, insts, transfers)
