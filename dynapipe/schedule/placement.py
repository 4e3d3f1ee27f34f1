"""Stage placement from a sample of global batches: cut, price, choose, repeat once.

The layers a stage should hold depend on the micro-batches it will run, and the
micro-batches the planner cuts depend (through the bottleneck stage's cost and memory)
on the placement. :func:`choose_placement` cuts the sample's micro-batches under the
current placement, lets :func:`dynapipe.cost.placement.plan_placement` choose the split,
and repeats until the split stops changing (at most ``rounds`` times). Times in ms,
memory in MiB.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from dynapipe.batching import plan_micro_batches
from dynapipe.batching.types import LengthLimit
from dynapipe.cost.base import RECOMPUTE_LEVELS, CostModel
from dynapipe.cost.placement import PlacementChoice, PlacementSample, plan_placement, price_placement
from dynapipe.errors import DynaPipeError


@dataclass(frozen=True)
class Cut:
    """How a run cuts its global batches into micro-batches, which its placement is chosen on:
    ``method``, one of the planner's batchings (``dynapipe``, ``dynapipe-per-sample``,
    ``packing``, ``packing-per-sample``, ...), with ``micro_batch_size`` (samples, or rows for
    packing) and ``max_tokens`` (``token-budget``'s padded tokens a micro-batch) as
    :func:`~dynapipe.batching.plan_micro_batches` takes them. Default: DynaPipe's cut."""

    method: str = "dynapipe"
    micro_batch_size: int = 1
    max_tokens: Optional[int] = None


DYNAPIPE_CUT = Cut()


@dataclass(frozen=True)
class PlacementPlan:
    """The chosen placement and the one it replaces (the input cost model's, Megatron's
    even split unless one was given), priced on the same sample.

    ``cost_model``: the input cost model with the chosen placement. ``rounds``: cut and
    choose rounds run.
    """

    chosen: PlacementChoice
    before: PlacementChoice
    cost_model: CostModel
    rounds: int
    # Simulated ms over the sample of each kind of placement compared (choose_placement_kind).
    compared: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        """``placement`` (layers per stage), both splits' per-stage sample times and levels
        (and ``compared``: simulated ms of every kind of placement tried, when compared)."""
        out = {"placement": self.chosen.placement.to_json(), "chosen": self.chosen.to_json(),
               "before": self.before.to_json(), "rounds": self.rounds}
        if self.compared:
            out["compared"] = self.compared
        return out


def _cut(batches: Sequence, cost_model: CostModel, *, dp: int, memory_limit_mib: Optional[float],
         reserved_mib: float, seq_length: Optional[LengthLimit], zero: bool, recompute: Optional[str],
         cut: Cut = DYNAPIPE_CUT) -> list:
    """The micro-batches ``cut`` makes of every batch (DynaPipe's by default), at the lightest
    level that plans."""
    levels = [recompute] if recompute is not None else list(RECOMPUTE_LEVELS)
    out = []
    for lengths in batches:
        error = None
        for level in levels:
            try:
                out.extend(plan_micro_batches(lengths, cost_model, dp=dp, memory_limit_mib=memory_limit_mib,
                                              reserved_mib=reserved_mib, seq_length=seq_length, recompute=level,
                                              zero=zero, method=cut.method, micro_batch_size=cut.micro_batch_size,
                                              max_tokens=cut.max_tokens).micro_batches)
                break
            except DynaPipeError as e:  # a sample too large at this level may fit with more recompute
                error = e
        else:
            raise error
    return out


def choose_placement(batches: Sequence, cost_model: CostModel, *, dp: int = 1,
                     memory_limit_mib: Optional[float] = None, reserved_mib: Optional[float] = None,
                     seq_length: Optional[LengthLimit] = None, zero: bool = False, recompute: Optional[str] = None,
                     rounds: int = 3, cut: Cut = DYNAPIPE_CUT) -> PlacementPlan:
    """Choose the layers of every stage for global batches like ``batches`` (each an array
    of lengths in tokens, ``(n, 2)`` for encoder-decoder models).

    The sample's DynaPipe micro-batches are cut under the current placement (first the
    cost model's own) and the placement with the least bottleneck stage time on them is
    chosen (:func:`plan_placement`); repeated until it stops changing, at most ``rounds``
    times. Memory: ``memory_limit_mib`` minus ``reserved_mib`` per device (default: the
    cost model's device config); ``dp``/``zero`` size model states as the planner does;
    ``cut``: how the run cuts its batches (:class:`Cut`: DynaPipe's by default; a fixed-shape
    batching's micro-batches do not depend on the placement, only its balance does).
    """
    if not len(batches):
        raise DynaPipeError("stage placement needs at least one global batch of lengths.")
    memory_limit_mib, reserved_mib = _memory(cost_model, memory_limit_mib, reserved_mib)
    capacity = None if memory_limit_mib is None else memory_limit_mib - reserved_mib
    kw = dict(capacity_mib=capacity, dp=dp, zero=zero, recompute=recompute)
    current, seen, first_sample = cost_model, {cost_model.placement}, None
    chosen = None
    for r in range(1, max(rounds, 1) + 1):
        mbs = _cut(batches, current, dp=dp, memory_limit_mib=memory_limit_mib, reserved_mib=reserved_mib,
                   seq_length=seq_length, zero=zero, recompute=recompute, cut=cut)
        sample = PlacementSample.of(mbs)
        first_sample = first_sample or sample
        chosen = plan_placement(current, sample, **kw)
        done = chosen.placement == current.placement or chosen.placement in seen
        current = current.with_placement(chosen.placement)
        seen.add(chosen.placement)
        if done:
            break
    # Both splits priced on the micro-batches the input placement cuts: the before and
    # after of one sample.
    before = price_placement(cost_model, cost_model.placement, first_sample, **kw)
    final = price_placement(cost_model, chosen.placement, first_sample, **kw)
    return PlacementPlan(final, before, current, r)


def place_micro_batches(micro_batches: Sequence, cost_model: CostModel, *, dp: int = 1,
                        memory_limit_mib: Optional[float] = None, reserved_mib: Optional[float] = None,
                        zero: bool = False, recompute: Optional[str] = None) -> PlacementChoice:
    """The contiguous placement with the least bottleneck stage time on ``micro_batches``
    themselves (say a fixed-shape baseline's, which do not depend on the placement, so no
    re-cut is needed): :func:`~dynapipe.cost.placement.plan_placement` on their shapes.
    Memory as for :func:`choose_placement` (MiB per device, defaults from the cost model's
    device)."""
    memory_limit_mib, reserved_mib = _memory(cost_model, memory_limit_mib, reserved_mib)
    capacity = None if memory_limit_mib is None else memory_limit_mib - reserved_mib
    return plan_placement(cost_model, PlacementSample.of(micro_batches), capacity_mib=capacity, dp=dp, zero=zero,
                          recompute=recompute)


def simulated_ms(batches: Sequence, cost_model: CostModel, *, dp: int, memory_limit_mib: Optional[float],
                 reserved_mib: float, seq_length: Optional[LengthLimit], zero: bool, recompute: Optional[str],
                 cluster=None, split_backward: bool = True, schedule: str = "auto",
                 cut: Cut = DYNAPIPE_CUT) -> float:
    """Summed simulated iteration time (ms) of the plans of ``batches`` (``cut``'s micro-batches) on
    ``cost_model``'s placement: the cut, then the schedule search under the memory limit
    (``inf`` when nothing fits; ``split_backward``: whether ``auto`` may try ``zb-h1`` or,
    on a chunked placement, ``interleaved-zb``; ``schedule``: the one the run will take, on
    chunks in its interleaved form; ``cut``: the run's cut, as :func:`choose_placement`)."""
    from dynapipe.schedule.search import search_schedules
    from dynapipe.schedule.types import schedule_on_chunks

    schedule = schedule_on_chunks(schedule, cost_model.placement.chunks)

    capacity = None if memory_limit_mib is None else memory_limit_mib - reserved_mib
    # A stage of TP ranks spans that many GPUs of a node, which decides the links it sends over.
    tp = getattr(getattr(cost_model, "tp", None), "size", 1)
    total = 0.0
    for lengths in batches:
        try:
            mbs = _cut([lengths], cost_model, dp=dp, memory_limit_mib=memory_limit_mib, reserved_mib=reserved_mib,
                       seq_length=seq_length, zero=zero, recompute=recompute, cut=cut)
            reps = [[mb for mb in mbs if mb.replica == r] for r in range(dp)]
            total += search_schedules(reps, cost_model, schedule=schedule, recompute=recompute, capacity_mib=capacity,
                                      cluster=cluster, dp=dp, tp=tp, zero=zero,
                                      split_backward=split_backward).makespan_ms
        except DynaPipeError:
            return float(np.inf)
    return total


def choose_chunked_placement(batches: Sequence, cost_model: CostModel, chunks: int, *, dp: int = 1,
                             memory_limit_mib: Optional[float] = None, reserved_mib: Optional[float] = None,
                             seq_length: Optional[LengthLimit] = None, zero: bool = False,
                             recompute: Optional[str] = None, cut: Cut = DYNAPIPE_CUT) -> PlacementPlan:
    """The ``chunks``-chunk interleaved split for global batches like ``batches``
    (:func:`~dynapipe.cost.chunked_placement.plan_chunked_placement` on the micro-batches cut
    under the even chunked split, which is ``before``); :class:`DynaPipeError` when the model
    has too few layers for the chunks or nothing plans. Memory and ``cut`` as
    :func:`choose_placement`."""
    from dynapipe.cost.chunked_placement import even_chunked_placement, plan_chunked_placement

    memory_limit_mib, reserved_mib = _memory(cost_model, memory_limit_mib, reserved_mib)
    even = cost_model.with_placement(even_chunked_placement(cost_model, chunks))
    sample = PlacementSample.of(_cut(batches, even, dp=dp, memory_limit_mib=memory_limit_mib,
                                     reserved_mib=reserved_mib, seq_length=seq_length, zero=zero,
                                     recompute=recompute, cut=cut))
    placement = plan_chunked_placement(cost_model, sample, chunks)
    capacity = None if memory_limit_mib is None else memory_limit_mib - reserved_mib
    kw = dict(capacity_mib=capacity, dp=dp, zero=zero, recompute=recompute)
    return PlacementPlan(price_placement(cost_model, placement, sample, **kw),
                         price_placement(cost_model, even.placement, sample, **kw),
                         cost_model.with_placement(placement), 1)


def _memory(cost_model: CostModel, memory_limit_mib: Optional[float],
            reserved_mib: Optional[float]) -> tuple[Optional[float], float]:
    """The memory limit and reserved MiB per device, defaulting to the cost model's device config."""
    device = getattr(cost_model, "device", None)
    if memory_limit_mib is None and device is not None:
        memory_limit_mib = device.memory_mib
    if reserved_mib is None:
        reserved_mib = device.reserved_mib if device is not None else 0.0
    return memory_limit_mib, reserved_mib


def choose_placement_kind(batches: Sequence, cost_model: CostModel, *, dp: int = 1,
                          memory_limit_mib: Optional[float] = None, reserved_mib: Optional[float] = None,
                          seq_length: Optional[LengthLimit] = None, zero: bool = False, recompute: Optional[str] = None,
                          cluster=None, chunks: int = 2, split_backward: bool = True,
                          contiguous_allowed: bool = True, schedule: str = "auto",
                          cut: Cut = DYNAPIPE_CUT) -> PlacementPlan:
    """The fastest of the contiguous placement (:func:`choose_placement`), the ``chunks``-chunk
    interleaved one (:func:`choose_chunked_placement`) and the even interleaved one, by
    DynaPipe's simulated time on ``batches`` (ms, summed; schedules searched under the memory
    limit). ``compared`` of the result holds every split tried and its time
    (``contiguous``/``contiguous_ms``, ``interleaved``/``interleaved_ms``,
    ``interleaved_even``/``interleaved_even_ms`` where the even split is not the planned one).
    ``chunks`` below 2: the contiguous one only
    (for stages that cannot interleave, or a schedule without chunks); ``contiguous_allowed``
    False: the interleaved ones only (a chunked schedule; their errors raised). ``split_backward``:
    whether the stages can split their backward (the search may then try ``zb-h1`` on the
    contiguous placement and ``interleaved-zb`` on the interleaved one). ``schedule``: the one
    the run takes (default ``auto``), which every split is simulated under; ``cut``: how the
    run cuts its batches (:class:`Cut`, as :func:`choose_placement`)."""
    from dynapipe.schedule.search import SCHEDULE_CHOICES

    if schedule not in SCHEDULE_CHOICES:  # a misspelt one would price both kinds at inf
        raise DynaPipeError(f"schedule {schedule!r} is not known; use one of {', '.join(SCHEDULE_CHOICES)}.")
    memory_limit_mib, reserved_mib = _memory(cost_model, memory_limit_mib, reserved_mib)
    kw = dict(dp=dp, memory_limit_mib=memory_limit_mib, reserved_mib=reserved_mib, seq_length=seq_length,
              zero=zero, recompute=recompute, cut=cut)
    if not contiguous_allowed:
        chunked = choose_chunked_placement(batches, cost_model, chunks, **kw)
        compared = {}
        candidates = _interleaved_candidates(batches, cost_model, chunked, compared, cluster=cluster,
                                             split_backward=split_backward, schedule=schedule, **kw)
        best = min(candidates, key=lambda c: c[0])
        return PlacementPlan(best[1], chunked.before, best[2], chunked.rounds, compared)
    contiguous = choose_placement(batches, cost_model, rounds=3, **kw)
    compared = {"contiguous": str(contiguous.chosen.placement),
                "contiguous_ms": simulated_ms(batches, contiguous.cost_model, cluster=cluster,
                                              split_backward=split_backward, schedule=schedule, **kw)}
    candidates = [(compared["contiguous_ms"], contiguous.chosen, contiguous.cost_model)]
    if chunks >= 2:
        try:
            chunked = choose_chunked_placement(batches, cost_model, chunks, **kw)
        except DynaPipeError as e:  # too few layers for the chunks, or nothing plans
            compared["interleaved_error"] = str(e)
        else:
            candidates += _interleaved_candidates(batches, cost_model, chunked, compared, cluster=cluster,
                                                  split_backward=split_backward, schedule=schedule, **kw)
    # Ties go to the earlier candidate: contiguous before interleaved, planned before even.
    best = min(candidates, key=lambda c: c[0])
    return PlacementPlan(best[1], contiguous.before, best[2], contiguous.rounds, compared)


def _interleaved_candidates(batches: Sequence, cost_model: CostModel, chunked: PlacementPlan, compared: dict, *,
                            cluster, split_backward: bool, schedule: str, **kw) -> list:
    """``(simulated ms, choice, cost model)`` of the planned interleaved split and, where it is
    another, of the even one, recorded in ``compared`` (``interleaved``, ``interleaved_even``).
    The planned split balances per-stage sample time, which the schedule does not always
    reward: the even one can simulate faster (say where the planned split's heavier stages
    leave less memory for micro-batches in flight), so both are simulated."""
    sim = dict(cluster=cluster, split_backward=split_backward, schedule=schedule, **kw)
    compared.update({"interleaved": str(chunked.chosen.placement),
                     "interleaved_ms": simulated_ms(batches, chunked.cost_model, **sim)})
    out = [(compared["interleaved_ms"], chunked.chosen, chunked.cost_model)]
    even = chunked.before
    if even.placement != chunked.chosen.placement:
        even_cost = cost_model.with_placement(even.placement)
        compared.update({"interleaved_even": str(even.placement),
                         "interleaved_even_ms": simulated_ms(batches, even_cost, **sim)})
        out.append((compared["interleaved_even_ms"], even, even_cost))
    return out
