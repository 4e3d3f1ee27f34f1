"""Evaluation under ``--use-dynapipe``: validation batches through forward-only DynaPipe plans.

Each evaluation global batch is planned with the run's planner settings (the same
micro-batching, schedule search and cost model as training), on every rank alike: planning
is deterministic in the lengths, and an evaluation batch is planned once, so no plan store
or worker is needed. This rank's plan is made forward only
(:func:`dynapipe.plan.forward_only.forward_only`) and run by the training executor, with
the stage's handlers, in eval mode and under ``torch.no_grad`` (set by
:class:`~megatron_integration.evaluation.Evaluator`).
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import numpy as np
import torch

from dynapipe.data.collate import TensorRequest, collate, loss_tokens
from dynapipe.data.samples import Sample
from dynapipe.plan.forward_only import forward_only
from dynapipe.plan.instructions import ExecutionPlan, LoadInput
from megatron_integration.baseline_step import holds_loss, reduce_loss

# Plan iteration numbers of evaluation batches: apart from training iterations in traces.
EVAL_ITERATION_BASE = 1 << 40


def rank_tensors(plan: ExecutionPlan, samples: Sequence[Sample], pad_id: int, eod_id: int,
                 encoder_decoder: bool = False) -> dict[int, dict[str, torch.Tensor]]:
    """The tensors this rank's plan loads, by micro-batch and name (samples indexed by the
    plan's sample positions)."""
    infos = {m.mb: m for m in plan.micro_batches}
    out: dict[int, dict[str, torch.Tensor]] = {}
    for ins in plan.instructions:
        if not isinstance(ins, LoadInput) or not ins.tensors:
            continue
        info = infos[ins.mb]
        rows = [[samples[p] for p in row] for row in (info.rows or tuple((s,) for s in info.samples))]
        reqs = [TensorRequest(t.name, tuple(t.shape), t.dtype) for t in ins.tensors]
        arrays = collate(rows, reqs, info.seqlen, info.dec_seqlen, encoder_decoder, pad_id, eod_id)
        out.setdefault(ins.mb, {}).update({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in arrays.items()})
    return out


def keep_eval_trace(traces: Optional[list], result, k: int) -> None:
    """Add evaluation batch ``k``'s executor trace to the run's ``traces`` (None: not tracing),
    labelled so that ``--dynapipe-trace-dir`` shows it apart from the training iterations."""
    if traces is not None and result.trace is not None:
        traces.append(dataclasses.replace(result.trace, label=f"evaluation batch {k}"))


class DynaPipeEvalRunner:
    """``batch_fn`` of the evaluator: one evaluation global batch through a forward-only plan."""

    def __init__(self, cfg, info, stepper):
        self.cfg, self.info, self.stepper = cfg, info, stepper
        self._planner = None
        self.plans_run = 0

    def _plan(self, lengths: np.ndarray, k: int) -> ExecutionPlan:
        if self._planner is None:
            from dynapipe.runtime.plan_source import IterationPlanner
            from megatron_integration.dynapipe_step import planner_settings

            self._planner = IterationPlanner(planner_settings(self.cfg, self.info))
        grid = self._planner.plan(np.asarray(lengths), EVAL_ITERATION_BASE + k)
        return forward_only(grid[self.info.dp_rank][self.info.pp_rank])

    def __call__(self, samples: Sequence[Sample], lengths: np.ndarray, k: int, dataset) -> tuple[float, int]:
        """Plan evaluation batch ``k`` (``samples`` of ``lengths`` tokens from ``dataset``), run this
        rank's forward-only plan; the global (loss sum, loss tokens), known on every rank."""
        plan = self._plan(lengths, k)
        global_loss_tokens = sum(loss_tokens(s, dataset.encoder_decoder) for s in samples)
        handlers = self.stepper.handlers
        handlers.begin(rank_tensors(plan, samples, dataset.pad_id, dataset.eod_id, dataset.encoder_decoder),
                       global_loss_tokens)
        result = self.stepper.executor.run(plan, loss_tokens=global_loss_tokens)
        keep_eval_trace(self.stepper.traces, result, k)
        self.plans_run += 1
        return reduce_loss(float(handlers.loss_sum), int(handlers.loss_tokens), holds_loss(self.info),
                           self.info.device)
