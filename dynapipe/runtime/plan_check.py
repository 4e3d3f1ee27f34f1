"""What a rank checks of execution plans before anything runs.

:func:`check_plan_locally` (from :mod:`dynapipe.runtime.local_plan_check`): one rank's own
plan (its stage, micro-batches, transfers, buffer lifetimes). :func:`pair_starts`: every
``*Finish`` has its ``*Start``, and which starts are posted together. :class:`PeerPlanCheck`: all pipeline ranks compare the
digests of the messages they send and expect (:func:`message_digests`) and refuse the
iteration together when any plan is bad, so nothing is sent and the group stays usable.
The full cross-rank validation (deadlock freedom included) is
:func:`dynapipe.plan.validate_plans`, run where every rank's plan is at hand.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import numbers
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from dynapipe.errors import PlanError, arg, iteration_name
from dynapipe.plan.instructions import (FINISHES, SEND_STARTS, STARTS, BackwardPass, ExecutionPlan, ForwardPass,
                                        RecvActivationFinish, RecvActivationStart, RecvGradFinish, RecvGradStart,
                                        SendActivationFinish, SendActivationStart, SendGradFinish, SendGradStart,
                                        is_last_virtual, virtual_stage)
from dynapipe.plan.serialize import deserialize_plan
from dynapipe.runtime.local_plan_check import check_plan_locally
from dynapipe.runtime.p2p import CommFailure, Pending, PeerComm, Waiter


def accept_plan(plan: Union[ExecutionPlan, bytes], handlers: Any, *, stage: int, num_stages: int,
                replica: Optional[int] = None, loss_tokens: Optional[int] = None) -> tuple[ExecutionPlan, int]:
    """What the executor checks of a plan before running it: ``(plan, loss normaliser in
    tokens)``, the plan decoded from its bytes when given bytes. Beyond
    :func:`check_plan_locally`: a plan that splits the backward needs ``handlers`` that can
    split it, and the last stage a whole, positive normaliser (``loss_tokens``, the run's own,
    or the plan's ``global_loss_tokens``). Raises :class:`PlanError`."""
    if isinstance(plan, (bytes, bytearray, memoryview)):
        plan = deserialize_plan(bytes(plan))
    if not isinstance(plan, ExecutionPlan):
        raise PlanError(f"expected an ExecutionPlan or its bytes, got {type(plan).__name__}.")
    # A run's own normaliser stands in for the plan's (checked below).
    check_plan_locally(plan, stage=stage, num_stages=num_stages, replica=replica, loss_tokens=loss_tokens)
    missing = [name for name in ("backward", "backward_weight") if not callable(getattr(handlers, name, None))]
    if missing and any(isinstance(x, BackwardPass) and x.part != "full" for x in plan.instructions):
        raise PlanError(f"the plan splits the backward (a zero-bubble schedule), but this stage's handlers "
                        f"have no {' and no '.join(missing)} (the input part needs a backward that defers "
                        f"the weight gradients, the weight part backward_weight); use a schedule without "
                        f"the split (plan with split_backward=False, or {arg('schedule')} 1f1b / adaptive).")
    tokens = plan.global_loss_tokens if loss_tokens is None else loss_tokens
    if isinstance(tokens, bool) or not isinstance(tokens, numbers.Integral):
        raise PlanError(f"loss_tokens {tokens!r}: expected a whole number of tokens.")
    if tokens <= 0 and any(isinstance(x, ForwardPass) and is_last_virtual(plan, x.chunk) for x in plan.instructions):
        raise PlanError(f"the loss normaliser is {tokens} tokens (run(loss_tokens=...) or the plan's "
                        f"global_loss_tokens); pass the global batch's loss-token count, at least 1.")
    return plan, int(tokens)


_FINISH_OF = {SendActivationStart: SendActivationFinish, RecvActivationStart: RecvActivationFinish,
              SendGradStart: SendGradFinish, RecvGradStart: RecvGradFinish}


def pair_starts(plan: ExecutionPlan) -> tuple[dict[int, int], dict[int, list[int]]]:
    """Match every Finish with its Start and find the batches of grouped Starts.

    Returns ``finish index -> start index`` and ``first start index -> indices posted
    together`` (adjacent starts sharing a ``group`` id >= 0). Raises :class:`PlanError`
    naming the instruction when a Finish has no Start or a Start is never finished.
    """
    open_starts: dict[tuple, list[int]] = {}
    start_of: dict[int, int] = {}
    batches: dict[int, list[int]] = {}
    batch: list[int] = []
    ins = plan.instructions
    for i, x in enumerate(ins):
        if isinstance(x, STARTS):
            open_starts.setdefault((_FINISH_OF[type(x)], x.peer, x.buffer), []).append(i)
            if x.group >= 0 and batch and batch[-1] == i - 1 and ins[i - 1].group == x.group:
                batch.append(i)
            else:
                batch = batches[i] = [i]
        elif isinstance(x, FINISHES):
            waiting = open_starts.get((type(x), x.peer, x.buffer))
            if not waiting:
                raise PlanError(f"pipeline rank {plan.stage}, instruction {i} ({x.OPCODE} {x.buffer!r}, "
                                f"peer {x.peer}): no earlier start for this transfer.")
            j = waiting.pop(0)
            if ins[j].tensors != x.tensors:
                raise PlanError(f"pipeline rank {plan.stage}, instruction {i} ({x.OPCODE} {x.buffer!r}): its "
                                f"tensors differ from those of its start, instruction {j}.")
            start_of[i] = j
    for key, left in open_starts.items():
        if left:
            j = left[0]
            raise PlanError(f"pipeline rank {plan.stage}, instruction {j} ({ins[j].OPCODE} {ins[j].buffer!r}, "
                            f"peer {ins[j].peer}): the transfer is started but never finished.")
    return start_of, batches


def _posting(plan: ExecutionPlan) -> dict[int, tuple[int, int]]:
    """``start index -> (position, size)`` of the batch each grouped start is posted in, as the
    executor posts them (:func:`pair_starts`' batches of two or more); a start posted alone, a
    one-start group included, is absent. A plan whose starts do not pair gets none: its rank
    refuses it anyway (:func:`check_plan_locally`)."""
    try:
        _, batches = pair_starts(plan)
    except PlanError:
        return {}
    return {j: (k, len(members)) for members in batches.values() if len(members) > 1
            for k, j in enumerate(members)}


def message_digests(plan: ExecutionPlan, grouping: bool = False) -> tuple[list[int], list[int]]:
    """Per peer, a 63-bit digest of the messages this plan sends to it and receives from it,
    in order: what a peer's plan must agree with (same micro-batches, shapes, dtypes, order).
    ``grouping`` (NCCL): how each transfer is posted counts too (alone, or its place in a batch of
    two or more grouped starts): NCCL runs a batch on the group's communicator and a lone
    transfer on the pair's, so two ends that post a message differently never meet (gloo pairs
    them one by one; the plan validator refuses such plans)."""
    sends = [hashlib.blake2b(digest_size=8) for _ in range(plan.num_stages)]
    recvs = [hashlib.blake2b(digest_size=8) for _ in range(plan.num_stages)]
    posted = _posting(plan) if grouping else {}
    for i, x in enumerate(plan.instructions):
        if not isinstance(x, STARTS) or not 0 <= x.peer < plan.num_stages:
            continue
        act = isinstance(x, (SendActivationStart, RecvActivationStart))
        # Sender and receiver name a message by the virtual stage that sends it: with chunks
        # the two ends' chunk numbers differ where the ring wraps (last rank -> rank 0).
        k = virtual_stage(plan, x.chunk)
        if not isinstance(x, SEND_STARTS):
            k += -1 if act else 1
        h = (sends if isinstance(x, SEND_STARTS) else recvs)[x.peer]
        key = ("act" if act else "grad", x.mb, k, [(t.name, tuple(t.shape), t.dtype) for t in x.tensors])
        h.update(repr(key + ((posted.get(i),) if grouping else ())).encode())
    as_int = [int.from_bytes(h.digest(), "big") >> 1 for h in sends + recvs]
    return as_int[:plan.num_stages], as_int[plan.num_stages:]


def row_key(prefix: str, seq: int, global_rank: int) -> str:
    """The store key of one rank's plan-check row for exchange ``seq`` of one executor
    (``prefix``: that executor's namespace, see :func:`executor_prefix`)."""
    return f"{prefix}/{seq}/{global_rank}"


def executor_prefix(store: dist.Store, global_rank: int) -> str:
    """A fresh store namespace for the plan-check rows of a new executor on this rank.

    Each rank counts its own executors in the store, so the n-th executor of every rank of
    a pipeline shares the namespace ``dynapipe/plan/n`` and never reads a row an earlier
    executor left behind (ranks must create their executors in the same order)."""
    return f"dynapipe/plan/{int(store.add(f'dynapipe/plan/executors/{global_rank}', 1))}"


class PeerPlanCheck:
    """Every pipeline rank compares its plan with every other's before anything is sent.

    Each rank publishes its verdict on its own plan (and why it refuses it), the
    iteration, and the digests of the messages it sends to and expects from every peer;
    then every rank judges the whole table the same way, so a bad plan on one rank is
    refused on every rank and the process group stays usable. With a key-value store the
    rows go through it (a few store round trips on the helper thread, so the wait notices
    another rank's failure); without one, through an all-gather on the pipeline group.
    :meth:`start` publishes and :meth:`settle` judges, so the exchange can overlap the work
    that comes before the first transfer; through a store it does only where the waiter runs
    helper threads (``watch_failures``, the default): without them :meth:`start` exchanges
    the rows at once, blocking until every rank has published.
    """

    def __init__(self, comm: PeerComm, plan: Optional[ExecutionPlan], refusal: Optional[str], seq: int,
                 prefix: str = "dynapipe/plan/0"):
        self.comm, self.refusal, self.seq, self.prefix = comm, refusal, seq, prefix
        self.row = [0] * (4 + 2 * comm.size)
        if refusal is None and plan is not None:
            # A CUDA pipeline talks NCCL (gloo sends no CUDA tensor point to point).
            sends, recvs = message_digests(plan, grouping=comm.device.type == "cuda")
            self.row = [1, plan.iteration, plan.num_stages, plan.stage] + sends + recvs

    def start(self, waiter: Waiter, store: Optional[dist.Store], where,
              wait_store: Optional[dist.Store] = None) -> None:
        """Publish this rank's row and start gathering everyone's (without blocking, except
        through a store with a waiter that runs no helper thread: see the class docstring).

        ``wait_store``: a second client of ``store`` for the exchange, so the abort channel
        stays usable while it waits."""
        self.where = f"{where} (exchanging plan digests)"
        self.job, self.docs = None, None
        if store is None:
            # On the executor's device: an NCCL pipeline group gathers CUDA tensors only.
            mine = torch.tensor(self.row, dtype=torch.int64, device=self.comm.device)
            self.rows = [torch.zeros_like(mine) for _ in range(self.comm.size)]
            self.pending = Pending([dist.all_gather(self.rows, mine, group=self.comm.group, async_op=True)], [mine])
        else:
            client, timeout_s = wait_store or store, waiter.timeout_s
            self.job = waiter.submit(lambda: self._store_rows(client, timeout_s))

    def _store_rows(self, store: dist.Store, timeout_s: float) -> None:
        try:
            self._exchange_rows(store, timeout_s)
        except CommFailure:
            raise
        except Exception as e:  # noqa: BLE001 - the store's own errors (DistNetworkError, ...)
            # The store's host is gone (torchrun's store lives in global rank 0's process): the
            # cause is in that rank's log, not in this rank's traceback.
            first = " ".join(str(e).splitlines()[0].split()) if str(e) else ""
            raise CommFailure(f"{self.where}: the job's key-value store stopped answering ({type(e).__name__}: "
                              f"{first[:200]}); the process that hosts it (global rank 0 under torchrun) has "
                              f"probably died or exited: its own log holds the cause") from None

    def _exchange_rows(self, store: dist.Store, timeout_s: float) -> None:
        me = self.comm.global_rank(self.comm.rank)
        store.set(row_key(self.prefix, self.seq, me), json.dumps({"row": self.row, "reason": self.refusal}))
        if self.seq >= 2:  # every peer has read it: each has reached this iteration's exchange
            store.delete_key(row_key(self.prefix, self.seq - 2, me))
        keys = [row_key(self.prefix, self.seq, g) for g in self.comm.global_ranks]
        try:
            store.wait(keys, datetime.timedelta(seconds=timeout_s))
        except Exception as e:  # noqa: BLE001 - the store's timeout error has no class of its own
            missing = [p for p, k in enumerate(keys) if not store.check([k])]
            raise CommFailure(f"{self.where}: pipeline ranks {missing} did not publish their plans within the "
                              f"{timeout_s:g} s timeout (stuck, dead, not running this iteration, or on "
                              f"another executor: every rank must create its executors in the same order) "
                              f"[{type(e).__name__}]") from None
        self.docs = [json.loads(v) for v in store.multi_get(keys)]

    def settle(self, waiter: Waiter) -> None:
        """Wait for every rank's row and judge: raise :class:`PlanError` naming the ranks and
        what differs, or a failure if a rank never answers."""
        if self.job is None:
            waiter.wait(self.pending, self.where)
            self._judge([r.tolist() for r in self.rows], [None] * len(self.rows))
        else:
            waiter.join(self.job, self.where)
            self._judge([d["row"] for d in self.docs], [d["reason"] for d in self.docs])

    def _judge(self, table: list[list[int]], reasons: list[Optional[str]]) -> None:
        size = self.comm.size
        for r, row in enumerate(table):
            if not row[0]:
                reason = self.refusal if r == self.comm.rank else reasons[r] or "see that rank's log"
                raise PlanError(f"pipeline rank {r} refused its plan, so every rank refuses this iteration "
                                f"before sending anything: {reason}")
        iters = [t[1] for t in table]
        if len(set(iters)) > 1 or any(t[2] != size for t in table) or any(t[3] != r for r, t in enumerate(table)):
            raise PlanError(f"the pipeline ranks hold plans of different iterations or layouts: iteration per "
                            f"rank {[i + 1 for i in iters]}, stages {[t[2] for t in table]}, stage index {[t[3] for t in table]}; "
                            f"each rank must run the plan compiled for its stage of the same iteration.")
        for a in range(size):
            for b in range(size):
                if a != b and table[a][4 + b] != table[b][4 + size + a]:
                    raise PlanError(f"{iteration_name(iters[0])}: the messages pipeline rank {a} sends to rank {b} "
                                    f"differ from those rank {b} expects from rank {a} (micro-batch, shape, dtype, "
                                    f"order, or under NCCL grouped on one end only); the plans were not compiled together. Check them with "
                                    f"validate_plans before running.")
