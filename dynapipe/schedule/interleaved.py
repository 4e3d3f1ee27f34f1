"""Interleaved (virtual-pipeline) 1F1B for micro-batches of any shape, and its simulator.

With ``v`` chunks per rank a pipeline of ``P`` ranks has ``V = v * P`` virtual stages;
virtual stage ``k`` is chunk ``k // P`` of rank ``k % P``
(:class:`~dynapipe.cost.placement.StagePlacement` with ``chunks = v``). A micro-batch's
forward goes through ranks ``0..P-1`` in chunk 0, then again in chunk 1, and so on; the
activation of chunk ``c`` on rank ``P-1`` goes to chunk ``c+1`` on rank 0, gradients the
reverse way. Every rank therefore idles during fill and drain for about ``1 / v`` of the
non-interleaved time.

The op order is Megatron's interleaved one: micro-batches in groups of ``P`` (the
remainder of ``M / P`` spread over the groups, see :func:`micro_batch_groups`); a rank's
forwards run group by group, each group through chunk 0, then chunk 1, ...; its
backwards likewise with the chunks reversed. Rank ``p`` runs ``2 (P - p - 1) + (v - 1) G``
warm-up forwards (at most all of them), ``G`` the first group's size (``P``, or up to
``2 P - 1`` when the remainder is spread), then one forward one backward, then the
remaining backwards. When ``M`` is not a multiple of ``P`` the last group is smaller, and
for some ``(P, v, M)`` that order would wait in a cycle (Megatron refuses such ``M``);
then every rank takes one more warm-up forward at a time until the orders complete (all
forwards first always does), which the simulator prices in time and memory.

The simulator works as :mod:`dynapipe.schedule.simulator` does, with costs per virtual
stage (``StageTimes`` of ``V`` rows, ``act_comm_ms[k]`` the transfer from virtual stage
``k`` to ``k + 1``) and memory per rank (``state_mib`` of ``P`` rows; stored
activations of every chunk on a rank count together); it prices split backwards
(``BI``/``BW``, :mod:`dynapipe.schedule.interleaved_zb`) as the unchunked simulator does.
Units: ms, MiB.
"""
from __future__ import annotations

import copy
import functools
from typing import Optional, Sequence

import numpy as np

from dynapipe.batching.types import MicroBatch
from dynapipe.config import ClusterConfig
from dynapipe.cost.base import CostModel
from dynapipe.errors import DynaPipeError
from dynapipe.schedule import _kernels as K
from dynapipe.schedule._kernels import chunked_kernel, chunked_split_kernel
from dynapipe.schedule.comm import message_bytes, sequence_shards_of, stage_global_rank
from dynapipe.schedule.costs import StageTimes, stage_times_per_replica
from dynapipe.schedule.types import Op, Schedule

INTERLEAVED = "interleaved"


def chunk_count(cost_model: CostModel) -> int:
    """Virtual-pipeline chunks per rank of ``cost_model``'s placement (1: not interleaved)."""
    return int(getattr(cost_model.placement, "chunks", 1))


def _order(groups: tuple[int, ...], v: int, backward: bool) -> list[tuple[int, int]]:
    """``(micro-batch, chunk)`` in the order every rank runs its forwards (backwards)."""
    out, g = [], 0
    for size in groups:
        group = range(g, g + size)
        for c in (range(v - 1, -1, -1) if backward else range(v)):
            out.extend((m, c) for m in group)
        g += size
    return out


def micro_batch_groups(num_stages: int, num_micro_batches: int, spread: bool = True) -> tuple[int, ...]:
    """Sizes of the micro-batch groups that pass through the chunks together: with
    ``spread`` (the default) the remainder of ``M / P`` spread over the groups (sizes ``P``
    to ``2P - 1``), else ``P`` each and a smaller last group (Megatron's), which drains and
    refills the pipeline once more (uniform 8 ranks x 2 chunks, 17 micro-batches, forwards of
    1 ms and backwards of 2 ms: 150 ms against 123)."""
    P, M = num_stages, num_micro_batches
    if M <= P:
        return (M,) if M else ()
    if not spread:
        return (P,) * (M // P) + ((M % P,) if M % P else ())
    n = M // P
    return tuple(M // n + (1 if i < M % n else 0) for i in range(n))


@functools.lru_cache(maxsize=64)
def interleaved_arrays(num_stages: int, chunks: int, num_micro_batches: int, spread: bool = True) -> tuple:
    """``(kind, mb, chunk, nops)`` of interleaved 1F1B as ``[P, 2 v M]`` arrays
    (kind 0 = F, 1 = B; groups as :func:`micro_batch_groups` makes them). Read-only."""
    P, v, M = num_stages, chunks, num_micro_batches
    n = v * M
    groups = micro_batch_groups(P, M, spread)
    for extra in range(n + 1):
        arrays = _arrays(P, v, groups, extra)
        if n == 0 or _runs(*arrays, P * v):
            break
    for a in arrays:
        a.flags.writeable = False
    return arrays


def _runs(kind, mb, ch, nops, V: int) -> bool:
    """Whether the op orders complete (no cycle of waits): a property of the orders alone."""
    P, M = kind.shape[0], int(mb.max()) + 1
    one = np.ones((V, M))
    zero = np.zeros((V, M))
    comm = np.zeros((max(V - 1, 1), M))
    return chunked_kernel(kind, mb, ch, nops, one, one, zero, zero, comm, comm, np.zeros(P),
                          np.inf, np.inf)[0] == K.OK


def _arrays(P: int, v: int, groups: tuple[int, ...], extra: int) -> tuple:
    """The op orders with ``extra`` more warm-up forwards on every rank than Megatron's."""
    M = sum(groups)
    n = v * M
    fwd, bwd = _order(groups, v, False), _order(groups, v, True)
    kind = np.zeros((P, max(2 * n, 1)), dtype=np.int64)
    mb = np.zeros_like(kind)
    ch = np.zeros_like(kind)
    for p in range(P):
        warm = min(2 * (P - p - 1) + (v - 1) * (groups[0] if groups else P) + extra, n)
        seq = [(K.F, x) for x in fwd[:warm]]
        for i in range(n - warm):
            seq += [(K.F, fwd[warm + i]), (K.B, bwd[i])]
        seq += [(K.B, x) for x in bwd[n - warm:]]
        for j, (k, (m, c)) in enumerate(seq):
            kind[p, j], mb[p, j], ch[p, j] = k, m, c
    return kind, mb, ch, np.full(P, 2 * n, dtype=np.int64)


_KIND_NAMES = {K.F: "F", K.B: "B", K.BI: "BI", K.BW: "BW"}
_KIND_CODES = {v: k for k, v in _KIND_NAMES.items()}


def schedule_from_chunked_arrays(name: str, kind, mb, ch, nops, *, chunks: int, recompute: str = "none",
                                 order: str = "planned", mb_order: tuple[int, ...] = (),
                                 stage_recompute: tuple[str, ...] = (), meta: Optional[dict] = None) -> Schedule:
    """A chunked :class:`Schedule` from ``[P, L]`` kind / micro-batch / chunk arrays."""
    stage_ops = tuple(tuple(Op(_KIND_NAMES[k], m, c)
                            for k, m, c in zip(kind[s, :nops[s]].tolist(), mb[s, :nops[s]].tolist(),
                                               ch[s, :nops[s]].tolist()))
                      for s in range(kind.shape[0]))
    M = len({op.mb for op in stage_ops[0]}) if stage_ops else 0
    return Schedule(name, kind.shape[0], stage_ops, recompute=recompute, order=order,
                    mb_order=mb_order or tuple(range(M)), stage_recompute=tuple(stage_recompute),
                    num_chunks=chunks, meta=dict(meta or {}))


def interleaved_1f1b(num_stages: int, chunks: int, num_micro_batches: int, *, recompute: str = "none",
                     order: str = "planned", mb_order: tuple[int, ...] = (),
                     stage_recompute: tuple[str, ...] = ()) -> Schedule:
    """The interleaved 1F1B op order of every rank for micro-batches ``0..M-1``."""
    if num_stages < 1 or chunks < 1 or num_micro_batches < 0:
        raise DynaPipeError(f"interleaved 1f1b needs at least one stage and chunk, got {num_stages} stages, "
                            f"{chunks} chunks and {num_micro_batches} micro-batches.")
    kind, mb, ch, nops = interleaved_arrays(num_stages, chunks, num_micro_batches)
    return schedule_from_chunked_arrays(INTERLEAVED, kind, mb, ch, nops, chunks=chunks, recompute=recompute,
                                        order=order, mb_order=mb_order or tuple(range(num_micro_batches)),
                                        stage_recompute=stage_recompute)


def virtual_cost_model(cost_model: CostModel) -> CostModel:
    """A copy of ``cost_model`` whose stages are the virtual stages of its chunked placement
    (pricing each chunk on its own)."""
    placement = cost_model.placement
    out = copy.copy(cost_model)
    out.num_stages = placement.num_virtual_stages
    out._set_layouts(placement.virtual_layouts())
    out._chunked = None
    return out


def virtual_stage_times_per_replica(cost_model: CostModel, replicas: Sequence[Sequence[MicroBatch]], *,
                                    recompute: str = "none", cluster: Optional[ClusterConfig] = None,
                                    dp: int = 1, tp: int = 1, zero: bool = False) -> list[StageTimes]:
    """Per replica, ``StageTimes`` of ``V`` virtual stages: compute and stored memory per
    chunk, transfers between consecutive virtual stages over the link between their ranks
    (the last rank to rank 0 between chunks), and model states per rank (``[P]``, every
    chunk's layers)."""
    placement = cost_model.placement
    P, V = placement.num_stages, placement.num_virtual_stages
    vcm = virtual_cost_model(cost_model)
    rows = stage_times_per_replica(vcm, replicas, recompute=recompute, cluster=None, dp=dp, tp=tp, zero=zero)
    state = np.array([cost_model.model_state_mib(s, dp=dp, zero=zero) for s in range(P)])
    out = []
    for i, (r, t) in enumerate(zip(replicas, rows)):
        comm = np.zeros((max(V - 1, 0), len(r)))
        if cluster is not None and len(r):
            model = cost_model.model
            mbs = np.array([mb.mbs for mb in r], dtype=np.float64)
            seq = np.array([mb.seqlen for mb in r], dtype=np.float64)
            dec = np.array([mb.dec_seqlen for mb in r], dtype=np.float64)
            shards = sequence_shards_of(cost_model)
            for k in range(V - 1):
                link = cluster.link(stage_global_rank(k % P, dp=dp, tp=tp, replica=i),
                                    stage_global_rank((k + 1) % P, dp=dp, tp=tp, replica=i))
                comm[k] = link.transfer_ms(message_bytes(model, vcm.layouts, k, mbs, seq, dec, shards))
        out.append(StageTimes(t.fw_ms, t.bw_ms, t.stored_mib, t.peak_mib, comm, comm.copy(), state, recompute,
                              t.bw_weight_ms, t.weight_stash_mib))
    return out


def chunked_inputs(times: StageTimes) -> tuple:
    """The cost arrays as :func:`chunked_split_kernel` takes them, weight parts included."""
    from dynapipe.schedule.simulator import kernel_inputs, split_inputs

    return kernel_inputs(times) + split_inputs(times)


def chunked_schedule_arrays(schedule: Schedule, num_micro_batches: int) -> tuple:
    """``(kind, mb, chunk, nops)`` of a chunked schedule's op orders."""
    from dynapipe.schedule.simulator import check_each_once

    P = schedule.num_stages
    nops = np.array([len(ops) for ops in schedule.stage_ops], dtype=np.int64)
    L = max(int(nops.max()) if P else 0, 1)
    kind, mb, ch = (np.zeros((P, L), dtype=np.int64) for _ in range(3))
    for s, ops in enumerate(schedule.stage_ops):
        for i, op in enumerate(ops):
            if op.kind not in _KIND_CODES or not 0 <= op.chunk < schedule.num_chunks \
                    or not 0 <= op.mb < num_micro_batches:
                raise DynaPipeError(f"schedule {schedule.name!r}: op {op} cannot be simulated (kinds F/B/BI/BW, "
                                    f"chunks 0..{schedule.num_chunks - 1}, micro-batches 0..{num_micro_batches - 1}).")
            kind[s, i], mb[s, i], ch[s, i] = _KIND_CODES[op.kind], op.mb, op.chunk
        n = len(ops)
        if n:
            check_each_once(schedule.name, s, kind[s, :n], mb[s, :n], num_micro_batches, ch[s, :n],
                            schedule.num_chunks)
    return kind, mb, ch, nops


def chunked_memory_steps(schedule: Schedule, times: StageTimes, starts, ends) -> list[list[tuple[float, float]]]:
    """Per rank, ``(time ms, MiB)`` points of memory over time (model states included)."""
    P = schedule.num_stages
    out = []
    for s, ops in enumerate(schedule.stage_ops):
        state = float(times.state_mib[s])
        steps, stored = [(0.0, state)], 0.0
        for i, op in enumerate(ops):
            k = op.chunk * P + s
            st, pk = float(times.stored_mib[k, op.mb]), float(times.peak_mib[k, op.mb])
            ws = float(times.weight_stash_mib[k, op.mb])
            if op.kind == "F":
                stored += st
                high = stored + pk
            elif op.kind == "BW":
                high = stored
                stored -= ws
            else:
                high = stored + pk
                stored -= st if op.kind == "B" else st - ws
                high = max(high, stored + pk) if op.kind == "BI" else high
            steps += [(starts[s][i], state + high), (ends[s][i], state + stored)]
        out.append(steps)
    return out


def simulate_chunked(schedule: Schedule, times: StageTimes, *, record_memory: bool = True, arrays=None):
    """:func:`dynapipe.schedule.simulator.simulate` for a chunked schedule: a
    :class:`~dynapipe.schedule.simulator.Timeline` per rank (``starts``/``ends`` aligned
    with ``schedule.stage_ops``). ``arrays``: the schedule's ``(kind, mb, chunk, nops)``."""
    from dynapipe.schedule.simulator import Timeline

    P, v = schedule.num_stages, schedule.num_chunks
    if times.num_stages != P * v or len(times.state_mib) != P:
        raise DynaPipeError(f"schedule {schedule.name!r} has {P} ranks x {v} chunks; the costs have "
                            f"{times.num_stages} virtual stages and {len(times.state_mib)} ranks.")
    kind, mb, ch, nops = chunked_schedule_arrays(schedule, times.num_micro_batches) if arrays is None else arrays
    status, starts, ends, busy, peak, stage = chunked_split_kernel(kind, mb, ch, nops, *chunked_inputs(times),
                                                                   np.inf, np.inf)
    if status == K.STUCK:
        raise DynaPipeError(f"schedule {schedule.name!r} cannot run: rank {stage} waits forever on an op whose "
                            f"input its neighbour produces only later in its own order.")
    n = [len(ops) for ops in schedule.stage_ops]
    st = [starts[s, :n[s]].tolist() for s in range(P)]
    en = [ends[s, :n[s]].tolist() for s in range(P)]
    makespan = max((e[-1] for e in en if e), default=0.0)
    mem = (lambda: chunked_memory_steps(schedule, times, st, en)) if record_memory else None
    return Timeline(schedule, makespan, st, en, busy.tolist(), peak.tolist(), mem, None)


def _rank_peaks(by_level: dict, mix: Sequence[str], spread: bool = True) -> np.ndarray:
    """Per rank, the highest memory (MiB) over replicas of interleaved 1F1B (micro-batch
    groups as :func:`micro_batch_groups` with ``spread``) with virtual stage ``k`` at level
    ``mix[k]``."""
    reps = len(next(iter(by_level.values())))
    peaks = []
    for r in range(reps):
        t = StageTimes.mixed([by_level[mix[k]][r] for k in range(len(mix))])
        P = len(t.state_mib)
        kind, mb, ch, nops = interleaved_arrays(P, t.num_stages // P, t.num_micro_batches, spread)
        peaks.append(chunked_split_kernel(kind, mb, ch, nops, *chunked_inputs(t), np.inf, np.inf)[4])
    return np.max(peaks, axis=0)


def chunk_levels(by_level: dict, levels: Sequence[str], cap_mib: float, spread: bool = True) -> tuple[str, ...]:
    """A recompute level for every virtual stage (chunk) under interleaved 1F1B.

    Starts from every rank's lightest uniform level that fits (``levels`` ordered light
    to heavy; the heaviest where none does), then lightens one chunk at a time, the chunk
    whose lighter level saves the most ms first, keeping each step whose rank still fits
    ``cap_mib`` (MiB, model states included). A rank's memory depends on both of its
    chunks, so the encoder chunk may store everything while the decoder chunk recomputes.
    ``spread``: size the mix for the spread micro-batch groups or (False) Megatron's groups of
    ``P``, which hold fewer forwards in warm-up and so may fit a lighter mix.
    """
    first = by_level[levels[0]][0]
    V, P = first.num_stages, len(first.state_mib)
    per_level = {lv: _rank_peaks(by_level, (lv,) * V, spread) for lv in levels}
    rank = [next((lv for lv in levels if per_level[lv][s] <= cap_mib), levels[-1]) for s in range(P)]
    mix = [rank[k % P] for k in range(V)]
    work = {lv: sum((t.fw_ms + t.bw_ms).sum(axis=1) for t in by_level[lv]) for lv in levels}
    changed = True
    while changed:
        changed = False
        steps = []
        for k in range(V):
            i = levels.index(mix[k])
            if i > 0:
                steps.append((float(work[mix[k]][k] - work[levels[i - 1]][k]), k, levels[i - 1]))
        for _, k, lighter in sorted(steps, key=lambda x: (-x[0], x[1])):
            trial = list(mix)
            trial[k] = lighter
            if _rank_peaks(by_level, trial, spread)[k % P] <= cap_mib:
                mix, changed = trial, True
    return tuple(mix)
