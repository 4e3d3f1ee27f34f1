"""``--dynapipe-placement auto``: the pipeline split chosen at start-up by DynaPipe's cost model.

Every rank computes the choice itself, before any stage is built, from the run's first global
batches (from iteration 0, so a resumed run chooses what the interrupted one chose) and the
cost model DynaPipe's planner prices the run with; the ranks then compare their choices, so a
disagreement stops the job instead of building stages that do not fit together.

For GPT (:func:`resolve_gpt_split`) the choice is the transformer layers of every virtual stage,
on the chunks a rank the run asks for (one, or ``--num-virtual-stages-per-pipeline-rank``): the
split whose slowest stage is fastest on DynaPipe's micro-batches of those batches, so a heavy
output layer or embedding leaves its stage fewer layers. It becomes ``ParallelArgs.stage_layers``,
exactly as if the same split had been written as ``--pipeline-model-parallel-layout``: megatron-core
builds it, the planner prices it, the baselines run on it, a checkpoint records it. T5's choice
(encoder and decoder layers per stage) is :mod:`megatron_integration.t5_placement`'s.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

import numpy as np

from dynapipe.errors import DynaPipeError

# Global batches ``auto`` chooses from: the run's first ones.
AUTO_SAMPLE_BATCHES = 4


def planner_cost_model(model, base, num_stages: int):
    """The cost model DynaPipe's planner prices ``model`` (a :class:`~dynapipe.config.ModelConfig`)
    with under the run config ``base`` (a ``DynaPipeTrainingConfig``), on the even split: the
    ``--dynapipe-cost-model`` profile or the analytic model of ``--dynapipe-device``, per
    tensor-parallel rank (collectives on the cluster's intra-node link)."""
    from dynapipe.config import load_cluster_config, load_device_config
    from dynapipe.cost import build_cost_model
    from dynapipe.runtime.plan_source import tensor_parallel_of

    d, parallel = base.dynapipe, base.parallel
    tp = tensor_parallel_of(parallel.tensor_model_parallel_size, parallel.sequence_parallel,
                            load_cluster_config(d.cluster))
    return build_cost_model(model, load_device_config(d.device), num_stages,
                            None if d.cost_model == "analytic" else d.cost_model, tp)


def ranks_agree(mine: str, flag: str) -> None:
    """Stop with one line unless every rank of the default process group chose ``mine``
    (nothing to compare without one)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    other = next((r for r, p in enumerate(every) if p != mine), None)
    if other is not None:
        raise DynaPipeError(f"{flag}: rank {dist.get_rank()} chose {mine} but rank {other} chose {every[other]}; "
                            f"give the split explicitly.")


def first_gpt_batches(cfg, count: int = AUTO_SAMPLE_BATCHES) -> list[np.ndarray]:
    """Lengths (tokens) of the first ``count`` global batches of the GPT run ``cfg`` (fewer
    when it has fewer iterations), as every method's sampler draws them."""
    from megatron_integration.data import GlobalBatches

    batches = GlobalBatches.create(cfg, 0, 0)
    n = max(1, min(count, cfg.train_iters))
    return [np.asarray(batches.lengths(batches.batch(i))) for i in range(n)]


def priced_recompute(cfg) -> Optional[str]:
    """The recompute level ``auto`` prices a split at: the planner's with ``--use-dynapipe``
    (None: the schedule search chooses per stage), else the level Megatron's baselines run every
    layer at (``--recompute-granularity``; ``full`` of fewer layers than a stage counts as full)."""
    if cfg.dynapipe.enabled:
        return cfg.dynapipe.recompute
    return cfg.recompute.granularity or "none"


def placement_cut(cfg):
    """The :class:`~dynapipe.schedule.placement.Cut` ``auto`` chooses a split on: with
    ``--use-dynapipe`` the run's own (the batching its planner runs: DynaPipe's cut,
    ``dynapipe-per-sample`` when its rows skip their padding's attention, or the executor's
    fixed-shape rows at ``--micro-batch-size``), else DynaPipe's, which Megatron's baselines'
    split is chosen on."""
    from dynapipe.batching.planner import DP_METHODS
    from dynapipe.schedule.placement import DYNAPIPE_CUT, Cut
    from megatron_integration.dynapipe_step import planned_batching

    if not cfg.dynapipe.enabled:
        return DYNAPIPE_CUT
    batching = planned_batching(cfg)
    # The DP cut sizes its own micro-batches: --micro-batch-size is the fixed-shape rows'.
    sized = 1 if batching in DP_METHODS else cfg.micro_batch_size
    return Cut(batching, sized, cfg.dynapipe.max_tokens or None)


def choose_gpt_split(cfg, batches: Optional[list] = None):
    """The :class:`~dynapipe.schedule.placement.PlacementPlan` ``auto`` takes for the GPT run
    ``cfg``: on one chunk a rank the contiguous split, on ``v`` chunks the ``v``-chunk split,
    whose slowest (virtual) stage is fastest on DynaPipe's micro-batches of ``batches``
    (default: the run's first global batches), under the run's memory limit (MiB), recompute
    level and data-parallel size. Pure and deterministic: the same config gives the same split."""
    from dynapipe.schedule.placement import choose_chunked_placement, choose_placement

    parallel, d = cfg.parallel, cfg.dynapipe
    cost_model = planner_cost_model(cfg.model.to_model_config("megatron-gpt"), cfg,
                                    parallel.pipeline_model_parallel_size)
    batches = first_gpt_batches(cfg) if batches is None else batches
    kw = dict(dp=parallel.data_parallel_size, memory_limit_mib=d.memory_limit_mb, seq_length=cfg.model.seq_length,
              zero=cfg.optimizer.distributed, recompute=priced_recompute(cfg), cut=placement_cut(cfg))
    chunks = parallel.virtual_pipeline_model_parallel_size or 1
    if chunks > 1:
        return choose_chunked_placement(batches, cost_model, chunks, **kw)
    return choose_placement(batches, cost_model, **kw)


def layout_text(stage_layers) -> str:
    """The ``--pipeline-model-parallel-layout`` string of transformer layers per virtual stage
    (embedding first, loss last)."""
    stages = ["t" * n for n in stage_layers]
    stages[0], stages[-1] = "E" + stages[0], stages[-1] + "L"
    return "|".join(stages)


def resolve_gpt_split(cfg):
    """``cfg`` with ``--dynapipe-placement auto`` chosen (``ParallelArgs.stage_layers``; None when
    the choice is Megatron's even split) and a line saying what was chosen, or ``cfg`` unchanged and
    None when the split was given; every rank's choice is compared (collective with
    torch.distributed up)."""
    if not cfg.parallel.auto_split:
        return cfg, None
    chosen = choose_gpt_split(cfg)
    layers = tuple(int(n) for n in chosen.chosen.placement.decoder_layers)
    ranks_agree(",".join(map(str, layers)), "--dynapipe-placement auto")
    even = len(set(layers)) == 1
    line = (f" > pipeline split (transformer layers per virtual stage): {','.join(map(str, layers))} "
            f"(--dynapipe-placement auto{', the even split' if even else ''}; as "
            f"--pipeline-model-parallel-layout {layout_text(layers)}); the slowest stage's compute over the first "
            f"global batches' micro-batches, by the planner's cost model: {chosen.before.bottleneck_ms:.1f} ms on "
            f"the even split, {chosen.chosen.bottleneck_ms:.1f} ms on this one")
    parallel = replace(cfg.parallel, stage_layers=None if even else layers)
    return replace(cfg, parallel=parallel), line
