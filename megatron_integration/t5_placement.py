"""Stage placement of a T5 run: how many encoder and decoder layers every pipeline stage builds.

``--dynapipe-placement`` takes ``even`` (Megatron's split, the default), a split written
out (``ENC+DEC`` per stage, chunks separated by ``|``: the syntax of ``python -m dynapipe
plan --placement``), ``interleaved`` (two chunks a rank: the encoder, then the decoder), or
``auto``: the planner chooses it (:func:`dynapipe.schedule.placement.choose_placement_kind`:
the best contiguous split, the planned interleaved one or the even interleaved one, by
simulated time) from the run's first global batches and the planner's cost model, before
the model is built. Every rank computes ``auto`` itself from the same batches and the same
cost model, so every rank gets the same split; the ranks then compare their choices, so a
disagreement stops the job instead of building stages that do not fit together.

The chosen placement is what the stages build, what DynaPipe's planner prices and compiles
messages for (the plans' ``meta["placement"]``, checked when a plan is loaded), what the
baselines' fixed-shape plans use, and what a checkpoint records (a resume with another
placement is refused: its stages hold other layers).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

import numpy as np

from dynapipe.cost.placement import StagePlacement
from dynapipe.errors import DynaPipeError, iteration_name
from megatron_integration import placement_auto
from megatron_integration.flag_spelling import t5_spelled
from megatron_integration.placement_auto import AUTO_SAMPLE_BATCHES, ranks_agree


@t5_spelled
def parse_t5_placement(text: str, model, num_stages: int) -> Optional[StagePlacement]:
    """``--dynapipe-placement`` text for ``model`` (a T5 :class:`~dynapipe.config.ModelConfig`)
    on ``num_stages`` stages: the placement, or None for ``auto`` (chosen at start-up)."""
    text = (text or "even").strip()
    if text == "auto":
        return None
    if text == "even":
        return StagePlacement.even(model, num_stages)
    try:
        placement = StagePlacement.parse(text, model, num_stages, flag="--dynapipe-placement")
    except DynaPipeError as e:
        detail = " ".join(str(e).split())
        others = "even or auto" if text == "interleaved" else "even, interleaved or auto"
        raise DynaPipeError(f"{detail.rstrip('.')}; or use {others}.") from None
    return placement


def first_global_batches(cfg, count: int = AUTO_SAMPLE_BATCHES) -> list[np.ndarray]:
    """``(n, 2)`` input and target lengths (tokens) of the run's first ``count`` global batches
    (fewer when the run has fewer iterations), as every method's sampler draws them."""
    from dynapipe.data.sampler import GlobalBatchSampler
    from megatron_integration.data import sampler_config

    config = cfg.dataset_config()
    dataset = config.build()
    sampler = GlobalBatchSampler(dataset.sample_tokens(), sampler_config(cfg.base, config), 0)
    n = max(1, min(count, cfg.base.train_iters))
    return [np.asarray(dataset.planner_lengths(sampler.batch(i).indices)) for i in range(n)]


def planner_cost_model(cfg, num_stages: int):
    """The cost model DynaPipe's planner prices this T5 run with (even split; see
    :func:`megatron_integration.placement_auto.planner_cost_model`)."""
    return placement_auto.planner_cost_model(cfg.planner_model(), cfg.base, num_stages)


def choose_t5_placement(cfg, num_stages: int, dp: int, batches: Optional[list] = None):
    """The :class:`~dynapipe.schedule.placement.PlacementPlan` ``auto`` takes: the contiguous
    split whose slowest stage is fastest on the DynaPipe micro-batches of ``batches``
    (default: the run's first global batches), or an interleaved one (two chunks a rank, each
    virtual stage balanced, or every virtual stage an equal share of the layers) when DynaPipe's plans of
    ``batches`` simulate faster on it (``compared`` holds every split's time, ms); under the run's memory limit (MiB), recompute level
    and data-parallel size; a split-backward schedule prices the interleaved one under
    ``interleaved-zb``. With ``--overlap-grad-reduce`` (:func:`check_overlap_placement`)
    contiguous splits only. Pure and deterministic: the same config gives the same split."""
    from dynapipe.config import load_cluster_config
    from dynapipe.schedule.placement import choose_placement_kind

    d = cfg.base.dynapipe
    batches = first_global_batches(cfg) if batches is None else batches
    return choose_placement_kind(batches, planner_cost_model(cfg, num_stages), dp=dp,
                                 memory_limit_mib=d.memory_limit_mb, seq_length=cfg.planner_seq_length,
                                 zero=cfg.base.optimizer.distributed,
                                 recompute=placement_auto.priced_recompute(cfg.base),
                                 cluster=load_cluster_config(d.cluster),
                                 chunks=1 if cfg.base.ddp.overlap_grad_reduce else 2,
                                 split_backward=d.split_backward, schedule=d.schedule if d.enabled else "auto",
                                 cut=placement_auto.placement_cut(cfg.base))


def check_overlap_placement(cfg, placement: Optional[StagePlacement]) -> None:
    """Refuse ``--overlap-grad-reduce`` on a placement of several chunks a rank: a T5 rank's
    chunks share one DDP gradient buffer (and, where a chunk embeds, parameters), and the
    overlapped reduction needs each buffer's gradients complete in one last backward."""
    if cfg.base.ddp.overlap_grad_reduce and placement is not None and placement.chunks > 1:
        raise DynaPipeError(f"--overlap-grad-reduce with --dynapipe-placement {cfg.placement_flag} ({placement.chunks} "
                            f"chunks a rank): a T5 rank's chunks share one gradient buffer, which cannot be "
                            f"reduced while another chunk's backward still adds to it; use a contiguous placement "
                            f"(even, auto or one written per stage) or drop --overlap-grad-reduce.")


def resolve_t5_placement(cfg, num_stages: int, dp: int):
    """``cfg`` with its placement decided (``auto`` chosen here), every rank's choice compared
    when torch.distributed is running; one-line error when the ranks disagree."""
    placement = cfg.placement
    if placement is None and cfg.placement_flag == "auto":
        placement = choose_t5_placement(cfg, num_stages, dp).chosen.placement
    elif placement is None:
        placement = cfg.stage_placement()
    ranks_agree(str(placement), f"--dynapipe-placement {cfg.placement_flag}")
    check_overlap_placement(cfg, placement)
    return replace(cfg, placement=placement)


def check_plan_placement(plan, placement: StagePlacement, model, iteration: int) -> None:
    """Refuse a plan priced for other stages than the ones built (``meta["placement"]``; an
    absent key means Megatron's even split)."""
    meta = getattr(plan, "meta", None) or {}
    raw = meta.get("placement")
    planned = StagePlacement.even(model, placement.num_stages) if raw is None else StagePlacement.from_json(raw, model)
    if planned != placement:
        raise DynaPipeError(f"{iteration_name(iteration)}: the plan was made for stage placement {planned} but this run's "
                            f"stages hold {placement}; plan with the run's --dynapipe-placement (a planner or plan "
                            f"store of another run?).")


def checkpoint_record(placement: StagePlacement) -> dict:
    """What a checkpoint records of the placement (its ``extra``)."""
    return {"placement": str(placement)}


def check_checkpoint_placement(extra: dict, placement: StagePlacement, model, path: str) -> None:
    """Refuse to resume stages of ``placement`` from a checkpoint saved with another split
    (a checkpoint without a record was saved by Megatron's even split, the only one then)."""
    saved = (extra or {}).get("placement") or str(StagePlacement.even(model, placement.num_stages))
    if saved != str(placement):
        raise DynaPipeError(f"{path}: saved with stage placement {saved}; this run's stages hold {placement}. "
                            f"Resume with --dynapipe-placement {saved}.")
