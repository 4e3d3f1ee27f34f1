"""Where a pipeline iteration's time went on each rank, from what the run recorded.

An iteration of one rank is split into (ms):

* ``compute``: forward and backward passes;
* ``bubble``: blocked on a point-to-point transfer whose peer had not posted its side
  yet (the neighbouring stage was still busy: the pipeline bubble), and, after the rank's
  pipeline part, waiting for the job's last rank to finish its own (the pipeline drain:
  the gradient all-reduces and the grad-norm reduction of the optimizer step wait for it);
* ``comm``: blocked on a transfer after both sides had posted it (the transfer itself,
  gloo/NCCL handshakes, megatron-core's shape exchange), plus posting transfers;
* ``overhead``: the schedule's own time inside the pipeline part of the iteration:
  the executor's input loading, buffer frees and the gaps between its instructions, or
  megatron-core's schedule bookkeeping outside compute and transfers (a fixed cost per
  micro-batch, also given per micro-batch);
* ``optimizer_and_grads``: gradient finaliser, optimizer step and the loss reduction
  (for DynaPipe everything of the iteration outside the executor and the plan wait), less
  the drain counted as bubble;
* ``plan_wait``: the training loop waiting for its plan (DynaPipe only);
* ``unattributed``: iteration time minus all of the above (signed: a negative value
  means the parts overlap, which the timers should never let happen).

Bubble and communication are told apart by matching every transfer with its peer's:
per ordered pair of stages the n-th send is the n-th receive (FIFO, as the plans are
validated and as megatron-core's schedule sends). A rank blocked from ``t0`` to ``t1``
is waiting for the pipeline until the latest moment in that window at which a peer
posted the matching side of one of this rank's transfers, and communicating after it.
All times are wall-clock microseconds of one host, comparable between ranks.
"""
from __future__ import annotations

import re
import statistics
from dataclasses import dataclass, field
from typing import Optional, Sequence

PARTS = ("compute", "bubble", "comm", "overhead", "optimizer_and_grads", "plan_wait")
_PEER = re.compile(r" peer (\d+) ")


@dataclass(frozen=True)
class Transfer:
    """One send or receive of a rank: to/from pipeline stage ``peer``, posted at ``post_us``."""

    send: bool
    peer: int
    post_us: float


@dataclass
class RankTimeline:
    """One rank's recorded iteration (ms unless named ``_us``): compute time, its transfers,
    the windows it was blocked on transfers (wall-clock us), time spent posting transfers,
    the schedule's own overhead and the time outside the pipeline part."""

    replica: int
    stage: int
    iteration_ms: float
    compute_ms: float
    micro_batches: int
    transfers: list[Transfer] = field(default_factory=list)
    blocked_us: list[tuple[float, float]] = field(default_factory=list)
    posting_ms: float = 0.0
    overhead_ms: float = 0.0
    optimizer_and_grads_ms: float = 0.0
    plan_wait_ms: float = 0.0
    # Wall clock (us) at the end of the rank's pipeline part (None: not recorded).
    pipeline_end_us: Optional[float] = None


def _peer_posts(timelines: Sequence[RankTimeline]) -> dict[int, list[float]]:
    """For every timeline (by index), the post time of the peer's side of each of its
    transfers (same order as its ``transfers``; NaN where the peer recorded none)."""
    by_stage = {(t.replica, t.stage): t for t in timelines}
    # (replica, src, dst, is_send) -> post times in order
    sides: dict[tuple, list[float]] = {}
    for t in timelines:
        for x in t.transfers:
            src, dst = (t.stage, x.peer) if x.send else (x.peer, t.stage)
            sides.setdefault((t.replica, src, dst, x.send), []).append(x.post_us)
    out: dict[int, list[float]] = {}
    for k, t in enumerate(timelines):
        seen: dict[tuple, int] = {}
        posts = []
        for x in t.transfers:
            src, dst = (t.stage, x.peer) if x.send else (x.peer, t.stage)
            key = (t.replica, src, dst, not x.send)
            n = seen.get(key, 0)
            seen[key] = n + 1
            other = sides.get(key, []) if (t.replica, x.peer) in by_stage else []
            posts.append(other[n] if n < len(other) else float("nan"))
        out[k] = posts
    return out


def split_blocked(timelines: Sequence[RankTimeline]) -> list[tuple[float, float]]:
    """``(bubble_ms, comm_ms)`` of every timeline's blocked windows (see the module doc);
    the timelines are one iteration of all ranks (peers are looked up among them)."""
    posts = _peer_posts(timelines)
    out = []
    for k, t in enumerate(timelines):
        own = [(x.post_us, p) for x, p in zip(t.transfers, posts[k]) if p == p]  # drop NaN
        bubble = comm = 0.0
        for t0, t1 in t.blocked_us:
            ready = max((p for mine, p in own if mine <= t1 and t0 < p <= t1), default=t0)
            bubble += ready - t0
            comm += t1 - ready
        out.append((bubble / 1e3, comm / 1e3))
    return out


def megatron_timeline(summary: dict, i: int, replica: int) -> Optional[RankTimeline]:
    """Iteration ``i`` of a megatron-core baseline rank (its job summary, whose
    ``breakdown_ms`` comes from :mod:`megatron_integration.schedule_timing`)."""
    b = (summary.get("breakdown_ms") or [None] * (i + 1))[i]
    if not b or "p2p_calls" not in b:
        return None
    stage = summary.get("pp_rank", 0)
    transfers, blocked = [], []
    for t0, t1, send_next, send_prev, recv_prev, recv_next in b["p2p_calls"]:
        # One exchange posts all its sides at its start and blocks until all are done.
        for on, send, peer in ((send_next, True, stage + 1), (send_prev, True, stage - 1),
                               (recv_prev, False, stage - 1), (recv_next, False, stage + 1)):
            if on:
                transfers.append(Transfer(send, peer, t0))
        blocked.append((t0, t1))
    compute = b["forward_ms"] + b["backward_ms"]
    p2p = sum(t1 - t0 for t0, t1 in blocked) / 1e3
    return RankTimeline(replica, stage, summary["iteration_ms"][i], compute, b.get("micro_batches", 0),
                        transfers, blocked, 0.0, max(b["schedule_ms"] - compute - p2p - b["finalize_ms"], 0.0),
                        b["finalize_ms"] + b["optimizer_ms"], 0.0, b.get("pipeline_end_us") or None)


def executor_timeline(events: Sequence[dict], origin_us: float, summary: dict, i: int) -> RankTimeline:
    """Iteration ``i`` of a DynaPipe rank from its executor's Chrome trace events of that
    iteration (``origin_us``: the trace's wall-clock origin)."""
    compute = posting = comm_events = 0.0
    transfers, blocked, mbs = [], [], set()
    start, end = float("inf"), float("-inf")
    replica = stage = 0
    for e in events:
        ts, dur = e["ts"] + origin_us, e["dur"]
        start, end = min(start, ts), max(end, ts + dur)
        replica, stage = e.get("pid", 0), e.get("tid", 0)
        cat = e.get("cat")
        if cat in ("forward", "backward", "backward-input", "backward-weight"):
            compute += dur
            if cat == "forward":
                mbs.add(e.get("args", {}).get("mb"))
        elif cat == "comm":
            comm_events += dur
            name = e["name"]
            opcode = name.split(" ", 1)[0]
            if opcode.endswith("_start"):
                posting += dur
                peer = _PEER.search(name)
                if peer:
                    transfers.append(Transfer(opcode.startswith("send"), int(peer.group(1)), ts))
            else:  # a finish, or the deferred sends' wait: blocked until the transfers complete
                blocked.append((ts, ts + dur))
    span = (end - start) / 1e3 if events else 0.0
    wait = summary["plan_wait_ms"][i]
    it_ms = summary["iteration_ms"][i]
    split = (summary.get("breakdown_ms") or [None] * (i + 1))[i] or {}
    return RankTimeline(replica, stage, it_ms, compute / 1e3, len(mbs), transfers, blocked, posting / 1e3,
                        max(span - comm_events / 1e3 - compute / 1e3, 0.0), max(it_ms - span - wait, 0.0), wait,
                        split.get("pipeline_end_us"))


def drain_ms(timelines: Sequence[RankTimeline]) -> list[float]:
    """How long each timeline's rank waited, after its pipeline part, for the job's last rank to
    finish its own (ms; bounded by its time outside the pipeline part, 0 where not recorded).
    The gradient all-reduces (data-parallel, tied embeddings) and the optimizer's grad-norm
    reduction over the model-parallel group make every rank wait for it."""
    ends = [t.pipeline_end_us for t in timelines if t.pipeline_end_us is not None]
    last = max(ends, default=None)
    return [0.0 if last is None or t.pipeline_end_us is None
            else min(max(last - t.pipeline_end_us, 0.0) / 1e3, t.optimizer_and_grads_ms) for t in timelines]


def rows(timelines: Sequence[RankTimeline]) -> list[dict]:
    """One row of ms per timeline (one iteration of all ranks): the parts of
    :data:`PARTS`, ``iteration``, ``unattributed``, ``overhead_per_mb`` and ``stage``."""
    out = []
    for t, (bubble, comm), drain in zip(timelines, split_blocked(timelines), drain_ms(timelines)):
        parts = {"compute": t.compute_ms, "bubble": bubble + drain, "comm": comm + t.posting_ms,
                 "overhead": t.overhead_ms, "optimizer_and_grads": t.optimizer_and_grads_ms - drain,
                 "plan_wait": t.plan_wait_ms}
        out.append({"iteration": t.iteration_ms, **parts,
                    "unattributed": t.iteration_ms - sum(parts.values()),
                    "overhead_per_mb": t.overhead_ms / t.micro_batches if t.micro_batches else 0.0,
                    "micro_batches": t.micro_batches, "stage": t.stage, "replica": t.replica})
    return out


def mean_rows(per_iteration: Sequence[Sequence[dict]]) -> list[dict]:
    """Per rank (same position in every iteration's list), the mean of every figure."""
    if not per_iteration:
        return []
    out = []
    for k in range(len(per_iteration[0])):
        its = [it[k] for it in per_iteration]
        row = {key: round(statistics.fmean(r[key] for r in its), 3) for key in its[0]
               if key not in ("stage", "replica")}
        out.append({**row, "stage": its[0]["stage"], "replica": its[0]["replica"]})
    return out
