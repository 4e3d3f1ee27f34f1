"""``bench --model t5``: the stage placement every method runs with, and what it changes in simulation.

The bench chooses the placement once, as ``--dynapipe-placement auto`` would on every rank
(:func:`megatron_integration.t5_placement.choose_t5_placement` on the run's first global
batches), and passes it to every run written out, so DynaPipe and the baselines build the
same stages. Beside it, DynaPipe's plans of the timed global batches are simulated with the
planner's cost model under Megatron's even split and under the chosen placement: the
before and after of the pipeline bubble. Pure Python (no torch); times in ms.
"""
from __future__ import annotations

import statistics
from typing import Optional, Sequence

import numpy as np


def _simulate(batches, cost_model, cfg, pp: int, dp: int) -> dict:
    """Mean bubble fraction and summed simulated ms of DynaPipe's plans of ``batches``."""
    from dynapipe.config import load_cluster_config
    from dynapipe.pipeline_planner import plan_iteration

    d = cfg.base.dynapipe
    plans = [plan_iteration(lengths, cost_model, stages=pp, dp=dp, method="dynapipe", schedule=d.schedule,
                            memory_limit_mib=d.memory_limit_mb, cluster=load_cluster_config(d.cluster),
                            recompute=d.recompute, seq_length=cfg.planner_seq_length,
                            zero=cfg.base.optimizer.distributed) for lengths in batches]
    return {"placement": str(cost_model.placement),
            "bubble_fraction": round(statistics.fmean(p.bubble_fraction for p in plans), 4),
            "simulated_ms": round(sum(p.simulated_ms for p in plans), 1),
            "micro_batches": sum(len(p.batch_plan.micro_batches) for p in plans)}


def baseline_splits(cfg, pp: int, dp: int, batches, baselines: Sequence[tuple[str, int]]) -> dict:
    """``{"method@mbsN": split}``: for each fixed-shape baseline at each micro-batch size of
    ``baselines``, the contiguous split with the least bottleneck stage time on its own
    micro-batches of ``batches`` (the sample ``auto`` chooses DynaPipe's placement from), so
    that a baseline is not confined to splits chosen for DynaPipe's micro-batches."""
    from dynapipe.schedule.placement import place_micro_batches
    from megatron_integration.bench_sim import planned_as
    from megatron_integration.t5_batches import baseline_micro_batches
    from megatron_integration.t5_placement import planner_cost_model

    cost_model = planner_cost_model(cfg, pp)
    level = cfg.base.recompute.granularity or "none"
    out = {}
    for method, size in baselines:
        mbs = [_priced_as(method, mb, lengths) for lengths in batches for rank in range(dp)
               for mb in baseline_micro_batches(planned_as(method), lengths, cfg.encoder_seq_length,
                                                cfg.decoder_seq_length,
                                                size, dp, rank)[0]]
        choice = place_micro_batches(mbs, cost_model, dp=dp, memory_limit_mib=cfg.base.dynapipe.memory_limit_mb,
                                     zero=cfg.base.optimizer.distributed, recompute=level)
        out[f"{method}@mbs{size}"] = str(choice.placement)
    return out


def _priced_as(method: str, mb, lengths):
    """``mb`` as ``method`` computes it: per-sample packing's rows carry their attention density
    (the attention between samples is not computed), so its split is chosen on what it runs."""
    from dynapipe.method_compare import METHOD_SPECS

    if METHOD_SPECS.get(method, (method,))[0] != "packing-per-sample" or not mb.rows:
        return mb
    from dataclasses import replace

    from dynapipe.cost.attention_density import packed_density

    pairs = np.asarray(lengths, dtype=np.int64).reshape(-1, 2)
    return replace(mb, attention=packed_density(pairs, mb.rows, mb.seqlen, mb.dec_seqlen))


def t5_bench_placement(cfg, nproc: int, warmup_iters: int, given: Optional[str] = None,
                       baselines: Sequence[tuple[str, int]] = ()) -> dict:
    """The placement the bench runs (``given``: the user's ``--dynapipe-placement``, else the
    one ``auto`` chooses) and DynaPipe's simulated plans of the timed batches under the
    even split and under it (``simulated.even`` / ``simulated.placed``); with ``baselines``
    ((method, micro-batch size) pairs) and no split given, each one's own best contiguous
    split (``baselines``, :func:`baseline_splits`)."""
    from dynapipe.cost.placement import StagePlacement
    from megatron_integration.t5_placement import (AUTO_SAMPLE_BATCHES, choose_t5_placement, first_global_batches,
                                                   planner_cost_model)

    pp = cfg.base.parallel.pipeline_model_parallel_size
    dp = cfg.base.parallel.data_parallel_size  # nproc over PP x TP: the TP ranks of a stage share one plan
    batches = first_global_batches(cfg, cfg.base.train_iters)
    search = choose_t5_placement(cfg, pp, dp, batches=batches[:AUTO_SAMPLE_BATCHES])
    placement = search.chosen.placement if given in (None, "auto") else cfg.stage_placement()
    even_cm = planner_cost_model(cfg, pp)
    timed = batches[min(warmup_iters, len(batches) - 1):]
    even = _simulate(timed, even_cm, cfg, pp, dp)
    placed = even if placement == StagePlacement.even(even_cm.model, pp) \
        else _simulate(timed, even_cm.with_placement(placement), cfg, pp, dp)
    out = {"placement": str(placement), "source": "auto" if given in (None, "auto") else "--dynapipe-placement",
           "search": search.to_json(), "simulated": {"even": even, "placed": placed}}
    if given in (None, "auto") and baselines:
        out["baselines"] = baseline_splits(cfg, pp, dp, batches[:AUTO_SAMPLE_BATCHES], baselines)
    return out
