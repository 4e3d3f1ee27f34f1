"""Placements with virtual-pipeline chunks: every rank holds ``v`` chunks of layers.

An interleaved pipeline of ``P`` ranks is a pipeline of ``V = v * P`` virtual stages
(virtual stage ``k`` is chunk ``k // P`` of rank ``k % P``), so its split is the
contiguous split of the model over ``V`` stages that
:func:`~dynapipe.cost.placement.plan_placement` already finds: the one whose slowest
virtual stage is fastest. For T5 that balances encoder against decoder work per virtual
stage instead of putting the encoder in chunk 0 and the decoder in chunk 1 by fiat.
Memory is not priced here: a rank stores activations of several chunks, in the amounts
interleaved 1F1B's warm-up decides, which the schedule simulator measures (the schedule
search then picks the recompute level that fits). Pure Python + numpy; ms and MiB.
"""
from __future__ import annotations

import copy
from typing import Optional

from dynapipe.cost.base import CostModel, stage_layouts
from dynapipe.cost.placement import PlacementSample, StagePlacement, plan_placement
from dynapipe.errors import DynaPipeError


def even_chunked_placement(cost_model: CostModel, chunks: int = 2) -> StagePlacement:
    """Megatron's even split over the ``chunks * P`` virtual stages (T5-11B on 8 ranks, 2
    chunks: the encoder as chunk 0, the decoder as chunk 1, 3 layers each)."""
    return StagePlacement.even(cost_model.model, cost_model.num_stages, chunks).validate(cost_model.model)


def virtual_pipeline_cost_model(cost_model: CostModel, chunks: int) -> CostModel:
    """A copy of ``cost_model`` for ``chunks * P`` consecutive stages (even split), whose
    stage costs are the virtual stages' costs."""
    out = copy.copy(cost_model)
    out.num_stages = chunks * cost_model.num_stages
    out._set_layouts(stage_layouts(cost_model.model, out.num_stages))
    out._chunked = None
    return out


def plan_chunked_placement(cost_model: CostModel, sample: PlacementSample, chunks: int = 2, *,
                           recompute: Optional[str] = None) -> StagePlacement:
    """The ``chunks``-chunk placement whose slowest virtual stage is fastest on ``sample``
    (forward + backward ms at ``recompute``, default none), most balanced among those.
    Raises :class:`DynaPipeError` when the model has fewer layers than virtual stages."""
    model, P = cost_model.model, cost_model.num_stages
    if chunks < 2 or chunks * P > model.total_layers:
        raise DynaPipeError(f"{chunks} chunks on {P} stages need at least {chunks * P} layers; model "
                            f"{model.name!r} has {model.total_layers}. Use fewer chunks or stages.")
    vcm = virtual_pipeline_cost_model(cost_model, chunks)
    choice = plan_placement(vcm, sample, chunks * P, recompute=recompute)
    return StagePlacement(choice.placement.encoder_layers, choice.placement.decoder_layers, chunks).validate(model)
