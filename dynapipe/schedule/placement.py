"""Stage placement from a sample of global batches: cut, price, choose, repeat once.

The layers a stage should hold depend on the micro-batches it will run, and the
micro-batches the planner cuts depend (through the bottleneck stage's cost and memory)
on the placement. :func:`choose_placement` cuts the sample's micro-batches under the
current placement, lets :func:`dynapipe.cost.placement.plan_placement` choose the split,
and repeats until the split stops changing (at most ``rounds`` times). Times in ms,
memory in MiB.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from dynapipe.batching import plan_micro_batches
from dynapipe.cost.base import RECOMPUTE_LEVELS, CostModel
from dynapipe.cost.placement import PlacementChoice, PlacementSample, plan_placement, price_placement
from dynapipe.errors import DynaPipeError


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

    def to_json(self) -> dict:
        """``placement`` (layers per stage), both splits' per-stage sample times and levels."""
        return {"placement": self.chosen.placement.to_json(), "chosen": self.chosen.to_json(),
                "before": self.before.to_json(), "rounds": self.rounds}


def _cut(batches: Sequence, cost_model: CostModel, *, dp: int, memory_limit_mib: Optional[float],
         reserved_mib: float, seq_length: Optional[int], zero: bool, recompute: Optional[str]) -> list:
    """The DynaPipe micro-batches of every batch, at the lightest level that plans."""
    levels = [recompute] if recompute is not None else list(RECOMPUTE_LEVELS)
    out = []
    for lengths in batches:
        error = None
        for level in levels:
            try:
                out.extend(plan_micro_batches(lengths, cost_model, dp=dp, memory_limit_mib=memory_limit_mib,
                                              reserved_mib=reserved_mib, seq_length=seq_length, recompute=level,
                                              zero=zero).micro_batches)
                break
            except DynaPipeError as e:  # a sample too large at this level may fit with more recompute
                error = e
        else:
            raise error
    return out


def choose_placement(batches: Sequence, cost_model: CostModel, *, dp: int = 1,
                     memory_limit_mib: Optional[float] = None, reserved_mib: Optional[float] = None,
                     seq_length: Optional[int] = None, zero: bool = False, recompute: Optional[str] = None,
                     rounds: int = 3) -> PlacementPlan:
    """Choose the layers of every stage for global batches like ``batches`` (each an array
    of lengths in tokens, ``(n, 2)`` for encoder-decoder models).

    The sample's DynaPipe micro-batches are cut under the current placement (first the
    cost model's own) and the placement with the least bottleneck stage time on them is
    chosen (:func:`plan_placement`); repeated until it stops changing, at most ``rounds``
    times. Memory: ``memory_limit_mib`` minus ``reserved_mib`` per device (default: the
    cost model's device config); ``dp``/``zero`` size model states as the planner does.
    """
    if not len(batches):
        raise DynaPipeError("stage placement needs at least one global batch of lengths.")
    device = getattr(cost_model, "device", None)
    if memory_limit_mib is None and device is not None:
        memory_limit_mib = device.memory_mib
    if reserved_mib is None:
        reserved_mib = device.reserved_mib if device is not None else 0.0
    capacity = None if memory_limit_mib is None else memory_limit_mib - reserved_mib
    kw = dict(capacity_mib=capacity, dp=dp, zero=zero, recompute=recompute)
    current, seen, first_sample = cost_model, {cost_model.placement}, None
    chosen = None
    for r in range(1, max(rounds, 1) + 1):
        mbs = _cut(batches, current, dp=dp, memory_limit_mib=memory_limit_mib, reserved_mib=reserved_mib,
                   seq_length=seq_length, zero=zero, recompute=recompute)
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
