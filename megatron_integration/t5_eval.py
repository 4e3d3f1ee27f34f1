"""T5 evaluation: validation and test batches through forward-only plans on the training executor.

Megatron-LM's ``--eval-interval`` / ``--eval-iters`` schedule and log lines come from
:class:`~megatron_integration.evaluation.Evaluator`, as for GPT; this module supplies its
``batch_fn``. Each evaluation global batch is planned as the run's method plans a training
batch, on every rank alike (planning is deterministic in the lengths): DynaPipe with the run's
planner settings and placement, padding and packing as fixed-shape plans (interleaved 1F1B
on an interleaved placement). This rank's plan is made forward only
(:func:`dynapipe.plan.forward_only.forward_only`) and run with the training handlers, in eval
mode and under ``torch.no_grad`` (the evaluator sets both), so no gradient, optimizer state or
training data position changes.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from dynapipe.data.samples import Sample
from dynapipe.plan.forward_only import forward_only
from megatron_integration.baseline_step import holds_loss, reduce_loss
from megatron_integration.dynapipe_eval import EVAL_ITERATION_BASE, keep_eval_trace, rank_tensors


class T5EvalRunner:
    """``batch_fn`` of the evaluator for a T5 run (``stepper``: its
    :class:`~megatron_integration.t5_step.T5Stepper`, whose executor, handlers and plan source
    the evaluation reuses)."""

    def __init__(self, cfg, info, stepper):
        self.cfg, self.info, self.stepper = cfg, info, stepper
        self._planner = None
        self.plans_run = 0

    def _plan(self, lengths: np.ndarray, samples: Sequence[Sample], k: int, dataset):
        """This rank's plan of evaluation batch ``k`` and the tensors it loads."""
        iteration = EVAL_ITERATION_BASE + k
        source = self.stepper.source
        if self.cfg.method == "dynapipe":
            if self._planner is None:
                from dynapipe.runtime.plan_source import IterationPlanner

                self._planner = IterationPlanner(source.settings)
            plan = self._planner.plan(np.asarray(lengths), iteration)[self.info.dp_rank][self.info.pp_rank]
            return plan, rank_tensors(plan, samples, dataset.pad_id, dataset.eod_id, encoder_decoder=True)
        plan, tensors, _ = source.plan_batch(np.asarray(lengths), list(samples), iteration, dataset.pad_id,
                                             dataset.eod_id)
        return plan, tensors

    def __call__(self, samples: Sequence[Sample], lengths: np.ndarray, k: int, dataset) -> tuple[float, int]:
        """Run evaluation batch ``k`` (``samples`` with ``(n, 2)`` input and target ``lengths``,
        tokens) forward only; the global (target-token loss sum, target tokens), on every rank."""
        plan, tensors = self._plan(lengths, samples, k, dataset)
        global_loss_tokens = int(np.asarray(lengths)[:, 1].sum())
        handlers = self.stepper.handlers
        handlers.begin(tensors, global_loss_tokens)
        result = self.stepper.executor.run(forward_only(plan), loss_tokens=global_loss_tokens)
        keep_eval_trace(self.stepper.traces, result, k)
        self.plans_run += 1
        return reduce_loss(float(handlers.loss_sum), int(handlers.loss_tokens), holds_loss(self.info),
                           self.info.device)


def make_t5_evaluator(cfg, info, stage, stepper):
    """The run's :class:`~megatron_integration.evaluation.Evaluator` over its T5 validation and
    test splits (None with ``--eval-iters 0`` or without evaluation data)."""
    from megatron_integration.evaluation import Evaluator

    if cfg.base.evaluation.eval_iters <= 0:
        return None
    evaluator = Evaluator(cfg.base, info, stage, T5EvalRunner(cfg, info, stepper), dataset_fn=cfg.dataset_config)
    return evaluator if evaluator.datasets else None
