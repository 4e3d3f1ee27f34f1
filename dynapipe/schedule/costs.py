"""Per-stage, per-micro-batch times and memory: the simulator's input.

:func:`stage_times` prices every micro-batch on every stage with the cost model (one
vectorised call per distinct stage layout) and every boundary transfer with the
cluster's links; the split of each backward into its input and weight parts, for
zero-bubble schedules, is the cost model's measurement where it has one (a profile that
timed the two parts) and :func:`dynapipe.cost.backward_split.backward_split`'s FLOPs
estimate otherwise; the weight part's memory is always that estimate. Units: ms and MiB.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from dynapipe.batching.types import MicroBatch
from dynapipe.config import ClusterConfig
from dynapipe.cost.attention_density import stack
from dynapipe.cost.backward_split import backward_split
from dynapipe.cost.base import RECOMPUTE_LEVELS, CostModel, weight_share_of
from dynapipe.errors import DynaPipeError
from dynapipe.schedule.comm import boundary_links, message_bytes, sequence_shards_of

# Every op lasts at least this long (ms), so a simulated timeline strictly orders an
# op's inputs before its outputs even when a cost model prices something at zero.
MIN_OP_MS = 1e-6


@dataclass(frozen=True)
class StageTimes:
    """Costs of ``M`` micro-batches on ``S`` stages.

    ``fw_ms``/``bw_ms``/``stored_mib``/``peak_mib``: arrays ``[S, M]``.
    ``act_comm_ms``/``grad_comm_ms``: ``[S - 1, M]``, the activation transfer from stage
    ``s`` to ``s + 1`` and the gradient transfer back. ``state_mib``: ``[S]`` model
    states (parameters, gradients, optimizer) held throughout.

    For schedules that split the backward (``BI``/``BW`` ops), ``[S, M]`` too:
    ``bw_weight_ms``, the weight-gradient part of ``bw_ms`` (a ``BI`` lasts ``bw_ms -
    bw_weight_ms``), and ``weight_stash_mib``, what the weight part keeps from the end of
    ``BI`` to the end of ``BW`` (more than ``stored_mib`` under full recompute, whose input
    part rematerialises the layers). Both default to zeros (no split).
    """

    fw_ms: np.ndarray
    bw_ms: np.ndarray
    stored_mib: np.ndarray
    peak_mib: np.ndarray
    act_comm_ms: np.ndarray
    grad_comm_ms: np.ndarray
    state_mib: np.ndarray
    recompute: str = "none"
    bw_weight_ms: Optional[np.ndarray] = None
    weight_stash_mib: Optional[np.ndarray] = None

    def __post_init__(self) -> None:
        fw = np.asarray(self.fw_ms, dtype=np.float64)
        if fw.ndim != 2:
            raise DynaPipeError(f"StageTimes.fw_ms has shape {list(fw.shape)}; it needs two dimensions, "
                                f"stages x micro-batches.")
        stages, mbs = fw.shape
        for name in ("bw_weight_ms", "weight_stash_mib"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, np.zeros((stages, mbs)))
        shapes = {"fw_ms": (stages, mbs), "bw_ms": (stages, mbs), "stored_mib": (stages, mbs),
                  "peak_mib": (stages, mbs), "act_comm_ms": (max(stages - 1, 0), mbs),
                  "grad_comm_ms": (max(stages - 1, 0), mbs),
                  "bw_weight_ms": (stages, mbs), "weight_stash_mib": (stages, mbs)}
        for name, shape in shapes.items():
            try:
                value = np.asarray(getattr(self, name), dtype=np.float64)
            except (TypeError, ValueError):
                raise DynaPipeError(f"StageTimes.{name} is not an array of numbers: "
                                    f"{getattr(self, name)!r:.80}.") from None
            if value.shape != shape:
                what = "stage boundaries x micro-batches" if "comm" in name else "stages x micro-batches"
                raise DynaPipeError(f"StageTimes.{name} has shape {list(value.shape)}; it needs "
                                    f"{list(shape)} ({what}, as fw_ms is {list(fw.shape)}).")
            if not np.all(np.isfinite(value)) or np.any(value < 0):
                unit = "ms" if name.endswith("_ms") else "MiB"
                raise DynaPipeError(f"StageTimes.{name} holds negative or non-finite values; give {unit}, 0 or more.")
            object.__setattr__(self, name, value)
        state = np.asarray(self.state_mib, dtype=np.float64)
        # One entry per stage, or per rank when the stages are virtual (chunks of an interleaved
        # placement, ``stages`` a multiple of the ranks).
        if state.ndim != 1 or not len(state) or stages % len(state):
            raise DynaPipeError(f"StageTimes.state_mib has shape {list(state.shape)}; it needs one entry per "
                                f"stage ({stages}), or per rank when the {stages} stages are virtual.")
        if not np.all(np.isfinite(state)) or np.any(state < 0):
            raise DynaPipeError("StageTimes.state_mib holds negative or non-finite values; give MiB, 0 or more.")
        object.__setattr__(self, "state_mib", state)
        if np.any(self.bw_weight_ms > self.bw_ms):
            raise DynaPipeError("StageTimes.bw_weight_ms exceeds bw_ms; the weight-gradient part is a share of "
                                "the backward, at most all of it.")
        if self.recompute not in RECOMPUTE_LEVELS + ("per-stage",):
            raise DynaPipeError(f"StageTimes.recompute {self.recompute!r} is not one of "
                                f"{RECOMPUTE_LEVELS + ('per-stage',)}.")
        for name in ("fw_ms", "bw_ms"):
            # A zero-length op would tie with its own inputs in the timeline, and the plan compiled
            # from it could order a receive before the send it waits for (a deadlock).
            object.__setattr__(self, name, np.maximum(getattr(self, name), MIN_OP_MS * (2 if name == "bw_ms" else 1)))

    @property
    def num_stages(self) -> int:
        return self.fw_ms.shape[0]

    @property
    def num_micro_batches(self) -> int:
        return self.fw_ms.shape[1]

    @classmethod
    def _derived(cls, *fields) -> "StageTimes":
        """Costs rearranged from checked ones (every field, in declaration order): the schedule
        search derives a few hundred per iteration, and their values were checked at the source."""
        out = object.__new__(cls)
        for f, value in zip(dataclasses.fields(cls), fields):
            object.__setattr__(out, f.name, value)
        return out

    def permuted(self, order: Sequence[int]) -> "StageTimes":
        """The same costs for the micro-batches taken in ``order`` (new index i is old ``order[i]``)."""
        idx = np.asarray(order, dtype=np.int64)
        return StageTimes._derived(self.fw_ms[:, idx], self.bw_ms[:, idx], self.stored_mib[:, idx],
                                   self.peak_mib[:, idx], self.act_comm_ms[:, idx], self.grad_comm_ms[:, idx],
                                   self.state_mib, self.recompute, self.bw_weight_ms[:, idx],
                                   self.weight_stash_mib[:, idx])

    @staticmethod
    def mixed(rows: Sequence["StageTimes"]) -> "StageTimes":
        """Stage ``s`` priced as in ``rows[s]`` (e.g. a different recompute level per stage)."""
        pick = lambda f: np.stack([getattr(t, f)[s] for s, t in enumerate(rows)])
        return StageTimes._derived(pick("fw_ms"), pick("bw_ms"), pick("stored_mib"), pick("peak_mib"),
                                   rows[0].act_comm_ms, rows[0].grad_comm_ms, rows[0].state_mib, "per-stage",
                                   pick("bw_weight_ms"), pick("weight_stash_mib"))

    def work_lower_bound_ms(self) -> float:
        """No schedule finishes sooner than its busiest stage's total compute (ms)."""
        if self.num_micro_batches == 0:
            return 0.0
        return float((self.fw_ms + self.bw_ms).sum(axis=1).max())


def stage_times(cost_model: CostModel, micro_batches: Sequence[MicroBatch], *, recompute: str = "none",
                cluster: Optional[ClusterConfig] = None, dp: int = 1, tp: int = 1,
                zero: bool = False, replica: int = 0) -> StageTimes:
    """Price ``micro_batches`` on every stage of ``cost_model``'s pipeline.

    Communication: message bytes (:func:`dynapipe.schedule.comm.message_bytes`) over the
    link between the stages' devices of data-parallel replica ``replica`` in ``cluster``
    (none: free). ``dp`` and ``zero`` size the model states (Megatron's distributed
    optimizer shards them over ``dp``).
    """
    S = cost_model.num_stages
    model = cost_model.model
    M = len(micro_batches)
    mbs = np.array([mb.mbs for mb in micro_batches], dtype=np.float64)
    seq = np.array([mb.seqlen for mb in micro_batches], dtype=np.float64)
    dec = np.array([mb.dec_seqlen for mb in micro_batches], dtype=np.float64) if model.is_encoder_decoder else None
    if model.is_encoder_decoder and M and np.any(dec <= 0):
        bad = int(np.argmax(dec <= 0))
        raise DynaPipeError(f"micro-batch {bad} has dec_seqlen={micro_batches[bad].dec_seqlen}: an "
                            f"encoder-decoder model needs a positive decoder length.")
    attention = stack([mb.attention for mb in micro_batches])  # None: every micro-batch dense
    fields = {k: np.zeros((S, M)) for k in ("fw_ms", "bw_ms", "stored_mib", "peak_mib")}
    share, stash = np.zeros((S, M)), np.zeros((S, M))
    by_layout: dict = {}
    for s in range(S):
        layout = cost_model.layouts[s]
        key = cost_model._key(layout)
        if key not in by_layout:
            flops_share, stash_mib = backward_split(model, layout, mbs, seq, dec, recompute=recompute,
                                                    tp=cost_model.tp, attention=attention)
            cost = cost_model.stage_cost(mbs, seq, dec, recompute=recompute, stage=s, attention=attention)
            # A measured weight part, over the backward just priced (not priced a second time).
            measured = cost_model.weight_ms(layout, mbs, seq, dec, recompute)
            by_layout[key] = (cost, (flops_share if measured is None else weight_share_of(measured, cost.bw_ms),
                                     stash_mib))
        c, split = by_layout[key]
        for k in fields:
            fields[k][s] = np.broadcast_to(np.asarray(getattr(c, k), dtype=np.float64), (M,))
        share[s], stash[s] = split
    # StageTimes floors fw_ms and bw_ms at MIN_OP_MS (its __post_init__). The input part keeps at
    # least MIN_OP_MS, so a BI still orders its gradient after its input.
    bw_weight = np.clip(fields["bw_ms"] * share, 0.0, np.maximum(fields["bw_ms"] - MIN_OP_MS, 0.0))
    # Not capped at stored_mib: under full recompute the weight part keeps recomputed
    # tensors the stage never stored, and a BI then raises the memory the stage holds.
    weight_stash = stash
    comm = _comm_ms(cost_model, micro_batches, boundary_links(cluster, S, dp=dp, tp=tp, replica=replica))
    state = np.array([cost_model.model_state_mib(s, dp=dp, zero=zero) for s in range(S)])
    return StageTimes(act_comm_ms=comm, grad_comm_ms=comm.copy(), state_mib=state, recompute=recompute,
                      bw_weight_ms=bw_weight, weight_stash_mib=np.maximum(weight_stash, 0.0), **fields)


def _comm_ms(cost_model: CostModel, micro_batches: Sequence[MicroBatch], links) -> np.ndarray:
    """``[S - 1, M]`` ms of each micro-batch's message over each boundary's link (0 where None),
    as one TP rank sends it (a slice of the sequence under sequence parallelism)."""
    M = len(micro_batches)
    comm = np.zeros((max(cost_model.num_stages - 1, 0), M))
    if not M:
        return comm
    mbs = np.array([mb.mbs for mb in micro_batches], dtype=np.float64)
    seq = np.array([mb.seqlen for mb in micro_batches], dtype=np.float64)
    dec = np.array([mb.dec_seqlen for mb in micro_batches], dtype=np.float64)
    shards = sequence_shards_of(cost_model)
    for s, link in enumerate(links):
        if link is not None:
            comm[s] = link.transfer_ms(message_bytes(cost_model.model, cost_model.layouts, s, mbs, seq, dec, shards))
    return comm


def stage_times_per_replica(cost_model: CostModel, replicas: Sequence[Sequence[MicroBatch]], *,
                            recompute: str = "none", cluster: Optional[ClusterConfig] = None, dp: int = 1,
                            tp: int = 1, zero: bool = False) -> list[StageTimes]:
    """:func:`stage_times` of each replica's micro-batches, priced in one call.

    Every cost is elementwise in the micro-batch, so pricing the replicas' micro-batches
    side by side and cutting the columns apart gives each replica exactly the arrays
    :func:`stage_times` gives it alone, at one cost-model call instead of ``len(replicas)``.
    """
    reps = [list(r) for r in replicas]
    if cost_model.model.is_encoder_decoder and any(mb.dec_seqlen <= 0 for r in reps for mb in r):
        # Let the per-replica path name the offending micro-batch by its index in its replica.
        return [stage_times(cost_model, r, recompute=recompute, cluster=cluster, dp=dp, tp=tp, zero=zero,
                            replica=i) for i, r in enumerate(reps)]
    allt = stage_times(cost_model, [mb for r in reps for mb in r], recompute=recompute, cluster=cluster,
                       dp=dp, tp=tp, zero=zero)
    out, lo = [], 0
    first = boundary_links(cluster, cost_model.num_stages, dp=dp, tp=tp)
    for i, r in enumerate(reps):
        hi = lo + len(r)
        cut = lambda a: np.ascontiguousarray(a[:, lo:hi])  # noqa: E731
        act, grad = cut(allt.act_comm_ms), cut(allt.grad_comm_ms)
        links = boundary_links(cluster, cost_model.num_stages, dp=dp, tp=tp, replica=i)
        if links != first:  # priced above over replica 0's links
            act = _comm_ms(cost_model, r, links)
            grad = act.copy()
        out.append(StageTimes(cut(allt.fw_ms), cut(allt.bw_ms), cut(allt.stored_mib), cut(allt.peak_mib),
                              act, grad, allt.state_mib.copy(), recompute,
                              cut(allt.bw_weight_ms), cut(allt.weight_stash_mib)))
        lo = hi
    return out
