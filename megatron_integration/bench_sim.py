"""The bench's planning-side figures: the baselines' micro-batch-size sweep, attention shares, compute floor.

:class:`BenchSimulation` re-creates the global batches a bench run trains on (the same
dataset, sampler and seed as the ranks) and plans them with the same planner and cost
model (the measured profile), so that without running anything it can say which
micro-batch sizes fit memory and how fast each is predicted to be, and what shapes
every method computes (for the attention share of the layer FLOPs). Nothing here
touches torch; the figures it gives are simulated and labelled so.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from dynapipe.batching import plan_micro_batches
from dynapipe.cost.compute_floor import floor_over_batches, shapes_compute_ms
from dynapipe.config import load_cluster_config, load_device_config, load_model_config
from dynapipe.cost import build_cost_model
from dynapipe.cost.attention_share import attention_share
from dynapipe.method_compare import (METHOD_SPECS, SIZED_METHODS, compare_over_batches, global_batch_of_tokens,
                                     simulate_method)
from dynapipe.pipeline_planner import plan_iteration
from dynapipe.runtime.plan_source import tensor_parallel_of
from megatron_integration.bench_presets import EXECUTOR_METHODS, METHOD_FLAGS

# What each method's iteration_ms covers (the JSON's setup.timed_regions).
TIMED_REGIONS = {
    "dynapipe": "from asking the data loader for the iteration (waiting for the plan and tensors the planner "
                "workers prepared) to the end of the optimizer step and the loss all-reduce: executor (forward, "
                "backward, point-to-point), gradient finaliser, optimizer. Planner workers plan later iterations "
                "meanwhile, on the same cores; their CPU ms are reported as planner_cpu_ms.",
    "dynapipe-1f1b": "as dynapipe, with the planner restricted to the 1F1B schedule",
    "dynapipe-zb": "as dynapipe, with the planner restricted to the zb-h1 schedule (split backwards)",
    "dynapipe-per-sample": "as dynapipe, each row's attention computed on its sample alone (the padding tail "
                           "skipped) and the cut priced so",
    "padding": "megatron-core forward_backward (1F1B, p2p, gradient finaliser), optimizer step and the loss "
               "all-reduce; building the micro-batch tensors from the samples is outside the timed region",
    "padding-mb": "as padding; megatron-core exchanges each activation's shape before it (variable_seq_lengths)",
    "packing": "as padding, with block-diagonal attention masks built outside the timed region",
    "packing-per-sample": "as packing, each sample's attention computed alone (no mask; segment boundaries "
                          "found outside the timed region)",
    "packing-search": "as dynapipe (the DynaPipe executor, planner workers, optimizer step), the planner packing "
                      "rows as packing does and searching their schedule, each sample's attention computed alone",
}

# Bench methods whose rows the T5 batch builders form as another's: per-sample attention changes
# what a packed row computes (the planner prices it as packing-per-sample), not which rows are formed.
PLANNED_AS = {"packing-per-sample": "packing", "packing-search": "packing"}


def planned_as(method: str) -> str:
    """The T5 batch builders' method forming the rows of bench method ``method``."""
    return PLANNED_AS.get(method, method)


class BenchSimulation:
    """The planner's view of one bench configuration (``cfg``: a parsed DynaPipe training
    config; ``profile``: the measured cost profile, or None for the analytic model)."""

    def __init__(self, cfg, nproc: int, profile: Optional[str], warmup_iters: int):
        from megatron_integration.data import GlobalBatches

        self.cfg = cfg
        self.pp = cfg.parallel.pipeline_model_parallel_size
        self.dp = max(nproc // (self.pp * cfg.parallel.tensor_model_parallel_size), 1)
        self.seq_length = cfg.model.seq_length
        self.model = cfg.model.to_model_config("bench")
        self.cluster = load_cluster_config(cfg.dynapipe.cluster)
        # Per tensor-parallel rank, as the run's planner prices it (priced at TP1, a TP2 x PP2
        # bench's sweep and simulated columns were another layout's).
        tp = tensor_parallel_of(cfg.parallel.tensor_model_parallel_size, cfg.parallel.sequence_parallel, self.cluster)
        self.cost = build_cost_model(self.model, load_device_config(cfg.dynapipe.device), self.pp, profile, tp)
        stream = GlobalBatches.create(cfg, 0, 0)
        first = min(warmup_iters, cfg.train_iters - 1)
        self.batches = [np.asarray(stream.lengths(stream.batch(i))) for i in range(first, cfg.train_iters)]

    def _kwargs(self, method: Optional[str] = None) -> dict:
        """The simulation's arguments; for a method the DynaPipe executor runs under the run's
        own schedule and recompute flags (not fixed by the method's), those too, so it is simulated
        as it will run."""
        out = dict(dp=self.dp, seq_length=self.seq_length, cluster=self.cluster,
                   memory_limit_mib=self.cfg.dynapipe.memory_limit_mb, zero=self.cfg.optimizer.distributed)
        if method in EXECUTOR_METHODS and "--dynapipe-schedule" not in METHOD_FLAGS.get(method, ()):
            d = self.cfg.dynapipe
            if d.schedule != "auto":
                out["schedule"] = d.schedule
            if d.recompute is not None:
                out["recompute"] = d.recompute
        return out

    def candidate_sizes(self, method: str) -> list[int]:
        """Powers of two that divide the global batch over the replicas (Megatron's rule),
        for packing also at most the packed rows a replica gets."""
        gbs = self.cfg.global_batch_size
        limit = gbs // self.dp
        if method.startswith("packing"):
            from dynapipe.batching.baselines import packing

            rows = min(len(packing(b, 1, self.seq_length)[0]) for b in self.batches)
            limit = min(limit, max(rows // self.dp, 1))
        out, m = [], 1
        while m <= limit:
            if gbs % (m * self.dp) == 0:
                out.append(m)
            m *= 2
        return out

    def sweep(self, method: str) -> list[dict]:
        """Simulated figures of every candidate size of a baseline over the timed batches
        (``fits``: within the memory limit without recompute, which the megatron-core
        baseline runs here do not use)."""
        res = compare_over_batches(self.batches, method, self.cost,
                                   micro_batch_sizes=self.candidate_sizes(method), **self._kwargs(method))
        rows = []
        for row in res.sweep:
            row = dict(row)
            if row["fits"] and row["recompute"] != ["none"] and method not in EXECUTOR_METHODS:
                row["fits"] = False
                row["reason"] = f"needs recompute {row['recompute']}, which the megatron-core baseline does not run"
            row["simulated"] = True
            rows.append(row)
        return rows

    @staticmethod
    def sweep_with_measured(rows: Sequence[dict], measured: dict, method: str) -> list[dict]:
        """The sweep rows with the measured median real tokens/s of the sizes that ran."""
        out = []
        for row in rows:
            label = f"{method}@mbs{row['micro_batch_size']}"
            r = measured.get(label)
            out.append({**row, "measured_real_tokens_per_s": None if r is None else round(r.real_tokens_per_s, 2)})
        ran = [r for r in out if r["measured_real_tokens_per_s"] is not None]
        best = max(ran, key=lambda r: r["measured_real_tokens_per_s"], default=None)
        for r in out:
            r["chosen"] = r is best
        return out

    def simulated(self, method: str, micro_batch_size: Optional[int] = None) -> dict:
        """``method`` planned and simulated with this cost model over the timed batches: mean
        iteration (ms; the pipeline's makespan, without the optimizer step and the executor's
        bookkeeping between ops), bubble fraction and micro-batches; what the bench compares with
        the measured iteration to show where the cost model is wrong, per method."""
        runs = [simulate_method(b, method, self.cost, micro_batch_size=micro_batch_size,
                                **self._kwargs(method)) for b in self.batches]
        return {"iteration_ms": round(float(np.mean([r.iteration_ms for r in runs])), 1),
                "bubble_fraction": round(float(np.mean([r.bubble_fraction for r in runs])), 4),
                "micro_batches": round(float(np.mean([r.micro_batches for r in runs])), 2),
                "real_tokens_per_s": round(sum(r.real_tokens for r in runs) /
                                           (sum(r.iteration_ms for r in runs) / 1e3), 1)}

    def micro_batches(self, method: str, lengths: np.ndarray, micro_batch_size: Optional[int]) -> list:
        """Every micro-batch ``method`` computes for one global batch (all replicas), as the
        planner's :class:`~dynapipe.batching.types.MicroBatch`: the baselines' as their batch
        builders make them (padding and packing rows are --seq-length long; packing's are masked,
        not shortened; per-sample packing's carry their attention density), DynaPipe's as planned."""
        if not method.startswith("dynapipe"):
            # The planner's batching of the method (packing-search: the per-sample rows).
            batching = METHOD_SPECS[method][0] if method in METHOD_SPECS else method
            plan = plan_micro_batches(lengths, self.cost, method=batching, seq_length=self.seq_length,
                                      micro_batch_size=micro_batch_size or self.cfg.micro_batch_size)
            return plan.micro_batches
        schedule = {"dynapipe-1f1b": "1f1b", "dynapipe-zb": "zb-h1"}.get(method, self.cfg.dynapipe.schedule)
        plan = plan_iteration(lengths, self.cost, stages=self.pp, method=METHOD_SPECS[method][0], schedule=schedule,
                              **self._kwargs())
        return plan.batch_plan.micro_batches

    def compute_floor(self, sizes: dict) -> dict:
        """The compute floor of the timed batches (:mod:`dynapipe.cost.compute_floor`) and each
        method's predicted compute over it (``sizes``: method -> micro-batch size, None for
        DynaPipe); ms an iteration per data-parallel replica, summed over the stages."""
        floor = floor_over_batches(self.cost, self.batches) / self.dp

        def computed(m, b, size):
            mbs = self.micro_batches(m, b, size)
            return shapes_compute_ms(self.cost, _shapes(mbs), attention=[mb.attention for mb in mbs])

        predicted = {m: float(np.mean([computed(m, b, size) for b in self.batches])) / self.dp
                     for m, size in sizes.items()}
        return {"floor_ms": round(floor, 1), "iterations": len(self.batches),
                "predicted_ms": {m: round(v, 1) for m, v in predicted.items()},
                "over_floor": {m: round(v / floor, 3) for m, v in predicted.items()}}

    def attention_share(self, method: str, micro_batch_size: Optional[int] = None) -> float:
        """Mean attention share of the layer FLOPs over the timed batches, at ``method``'s shapes
        (per-sample packing: its rows' GEMMs, each sample's own attention)."""
        def share(b):
            mbs = self.micro_batches(method, b, micro_batch_size)
            return attention_share(self.model, _shapes(mbs), [mb.attention for mb in mbs])

        return float(np.mean([share(b) for b in self.batches]))


def _shapes(micro_batches) -> list[tuple]:
    """``(rows, seqlen)`` of each micro-batch (decoder-only)."""
    return [(mb.mbs, mb.seqlen) for mb in micro_batches]


def gpt7b_attention_shares(methods: Sequence[str], seq_length: int, tokens: int = 65536) -> dict[str, float]:
    """GPT-7B's attention share of the layer FLOPs under each method, simulated on one
    global batch of the mixture at ``seq_length`` (PP4 x DP2, a100-40gb with the distributed
    optimizer, as the cluster simulation's case; baselines at their best micro-batch size): the
    reference the representative preset matches."""
    model = load_model_config("gpt-7b")
    cost = build_cost_model(model, load_device_config("a100-40gb"), 4)
    batch = global_batch_of_tokens(tokens, 0, seq_length)
    kw = dict(dp=2, seq_length=seq_length, cluster=load_cluster_config("a100-8x"), zero=True)
    out = {}
    for m in methods:
        if m in SIZED_METHODS:
            out[m] = round(compare_over_batches([batch], m, cost, **kw).runs[0].attention_share, 4)
        else:
            out[m] = round(simulate_method(batch, m, cost, **kw).attention_share, 4)
    return out
