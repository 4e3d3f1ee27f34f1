"""One T5 training iteration through the DynaPipe executor: plan sources and stepper.

Every method runs through :class:`~dynapipe.runtime.executor.Executor` (megatron-core's
schedules no longer pipeline encoder-decoder models); they differ only in where the plan
and the micro-batch tensors come from:

* ``dynapipe``: the :class:`~dynapipe.runtime.loader.DynaPipeDataLoader` (planner workers,
  variable-shape micro-batches, the schedule search's choice);
* ``padding`` / ``packing``: fixed-shape micro-batches
  (:func:`~megatron_integration.t5_batches.baseline_micro_batches`) compiled on every rank
  into 1F1B plans, at Megatron's ``--recompute-granularity`` level.

The stages run under :class:`~megatron_integration.t5_handlers.T5StageHandlers` (their
masks keep samples apart, so a sample's loss does not depend on how it was padded or packed).
After the executor, megatron-core's DDP sums the gradients over replicas,
:class:`~megatron_integration.t5_model.EmbeddingSync` over the embedding copies, and the loss
is normalised by the global batch's target tokens.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from typing import Optional

import numpy as np
import torch

from dynapipe.cost.model_flops import TokenWork, samples_work
from dynapipe.errors import DynaPipeError, iteration_name
from dynapipe.runtime.activation_meter import ActivationMeter, measure_activations
from dynapipe.runtime.activation_plan import planned_activation_peak_mib
from megatron_integration.initialize import RankInfo
from megatron_integration.baseline_step import StepResult, holds_loss, reduce_loss, split_point, step_split_ms
from megatron_integration.model import Stage
from megatron_integration.rerun import ResultValidator
from megatron_integration.dynapipe_step import next_planned
from megatron_integration.t5_config import T5TrainingConfig
from megatron_integration.t5_handlers import T5StageHandlers
from megatron_integration.t5_model import EmbeddingSync, sum_sequence_parallel_grads
from megatron_integration.t5_placement import check_plan_placement
from megatron_integration.tensor_parallel import check_plan_tensor_parallel, check_tp_plans_agree
from megatron_integration.training_limits import empty_unused_memory


@dataclass
class PlannedIteration:
    """What one iteration runs on this rank: its plan, the tensors it loads, the global figures
    (``loss_tokens``: target tokens; ``real_tokens``: non-pad tokens, input + target)."""

    plan: object
    tensors: dict
    loss_tokens: int
    real_tokens: int
    padded_tokens: int
    consumed_samples: int
    truncated: int = 0
    wait_ms: float = 0.0
    digest: Optional[int] = None  # the planned payload's checksum (DynaPipe plans), compared over TP ranks
    # Over the global batch: its executed shapes and its samples (dynapipe.cost.model_flops).
    executed_work: Optional[TokenWork] = None
    real_work: Optional[TokenWork] = None


class LoaderSource:
    """``dynapipe``: plans and tensors from the DynaPipe data loader (planner workers)."""

    def __init__(self, cfg: T5TrainingConfig, info: RankInfo, start_iteration: int, consumed_samples: int):
        from dynapipe.schedule.types import schedule_on_chunks
        from megatron_integration.dynapipe_loader import make_loader
        from megatron_integration.dynapipe_step import planner_settings

        base = cfg.base
        self.placement, self.model = cfg.stage_placement(), cfg.planner_model()
        settings = replace(planner_settings(base, info), model=self.model, seq_length=cfg.planner_seq_length,
                           placement=self.placement, schedule=schedule_on_chunks(base.dynapipe.schedule, self.placement.chunks))
        self.settings = settings
        self.loader = make_loader(base, info, start_iteration, consumed_samples, dataset=cfg.dataset_config(),
                                  settings=settings)

    def next(self, iteration: int) -> PlannedIteration:
        data = next_planned(self.loader, iteration)
        check_plan_placement(data.plan, self.placement, self.model, iteration)
        m = data.meta
        return PlannedIteration(data.plan, data.micro_batches, m.global_loss_tokens, m.global_real_tokens,
                                m.global_padded_tokens, m.consumed_samples, m.truncated_samples, m.wait_ms,
                                data.digest, TokenWork.from_json(m.global_executed_work),
                                TokenWork.from_json(m.global_real_work))

    def skip(self, iteration: int) -> int:
        """Consume the iteration's plan untrained; the consumed samples after it."""
        return next_planned(self.loader, iteration).meta.consumed_samples

    def close(self) -> None:
        self.loader.close()


class BaselineSource:
    """``padding`` / ``packing``: fixed-shape micro-batches compiled into 1F1B plans on every rank."""

    def __init__(self, cfg: T5TrainingConfig, info: RankInfo, start_iteration: int, consumed_samples: int):
        from dynapipe.data.sampler import GlobalBatchSampler
        from megatron_integration.data import GlobalBatches, sampler_config

        self.cfg, self.info = cfg, info
        self.model = cfg.planner_model()
        config = cfg.dataset_config()
        dataset = config.build()
        sampler = GlobalBatchSampler(dataset.sample_tokens(), sampler_config(cfg.base, config), consumed_samples)
        self.batches = GlobalBatches(dataset, sampler, start_iteration)
        self.level = cfg.base.recompute.granularity or "none"
        self.placement = cfg.stage_placement()
        self.layouts = self.placement.layouts()  # the layers the stages hold decide the messages

    def skip(self, iteration: int) -> int:
        """Consume the iteration's global batch untrained; the consumed samples after it."""
        return self.batches.batch(iteration).consumed_samples

    def next(self, iteration: int) -> PlannedIteration:
        batch = self.batches.batch(iteration)
        ds = self.batches.dataset
        lengths = ds.planner_lengths(batch.indices)
        plan, tensors, executed = self.plan_batch(lengths, [ds[int(i)] for i in batch.indices], iteration,
                                                  ds.pad_id, ds.eod_id)
        return PlannedIteration(plan, tensors, int(lengths[:, 1].sum()), int(lengths.sum()), executed.total_tokens,
                                batch.consumed_samples, int(ds.truncated[batch.indices].sum()),
                                executed_work=executed, real_work=samples_work(lengths))

    def plan_batch(self, lengths: np.ndarray, samples: list, iteration: int, pad_id: int, eod_id: int):
        """This rank's fixed-shape plan of a global batch (``samples`` with their ``(n, 2)``
        ``lengths`` in tokens), its micro-batches' tensors and what the global batch executes
        (:class:`~dynapipe.cost.model_flops.TokenWork`; its ``total_tokens`` are the padded tokens)."""
        from dynapipe.plan.compile import compile_plans
        from megatron_integration.t5_batches import baseline_micro_batches, t5_row_tensors

        cfg, info = self.cfg, self.info
        mbs_list, executed = baseline_micro_batches(cfg.method, lengths, cfg.encoder_seq_length, cfg.decoder_seq_length,
                                                  cfg.base.micro_batch_size, info.dp_size, info.dp_rank)
        loss_tokens = int(lengths[:, 1].sum())
        common = dict(replica=info.dp_rank, num_replicas=info.dp_size, iteration=iteration,
                      global_loss_tokens=loss_tokens, recompute=self.level)
        tp = dict(tp=info.tp_size, sequence_parallel=cfg.base.parallel.sequence_parallel)
        if self.placement.chunks > 1:  # Megatron's interleaved 1F1B on the same chunks as DynaPipe
            from dynapipe.plan.compile_chunked import compile_interleaved_1f1b

            plan = compile_interleaved_1f1b(mbs_list, self.model, self.placement.virtual_layouts(), info.pp_size,
                                            **common, **tp)[info.pp_rank]
        else:
            plan = compile_plans("1f1b", mbs_list, self.model, num_stages=info.pp_size, layouts=self.layouts,
                                 **common, **tp)[info.pp_rank]
        plan.meta["placement"] = self.placement.to_json()
        tensors = {}
        for i, mb in enumerate(mbs_list):
            rows = [[samples[p] for p in row] for row in (mb.rows or [[s] for s in mb.samples])]
            tensors[i] = t5_row_tensors(rows, mb.seqlen, mb.dec_seqlen, pad_id, eod_id)
        return plan, tensors, executed

    def close(self) -> None:
        pass


@dataclass
class T5Stepper:
    """Runs T5 iterations: plan source -> executor (T5 stage) -> gradient sums -> optimizer."""

    cfg: T5TrainingConfig
    info: RankInfo
    stage: Stage
    optimizer: object
    scheduler: object
    source: object
    executor: object
    handlers: T5StageHandlers
    sync: EmbeddingSync
    meter: ActivationMeter
    cost_model: Optional[object] = None  # the planner's, to price what a DynaPipe plan promises
    traces: Optional[list] = None
    # What a rejected loss or gradient norm leads to (--rerun-mode); set by pretrain_t5.
    validator: Optional[ResultValidator] = None

    @classmethod
    def create(cls, cfg: T5TrainingConfig, info: RankInfo, stage: Stage, optimizer, scheduler, sync: EmbeddingSync,
               start_iteration: int, consumed_samples: int) -> "T5Stepper":
        from megatron.core import parallel_state

        from dynapipe.runtime.executor import Executor, ExecutorConfig
        from dynapipe.runtime.kv_store import job_tcp_store

        d = cfg.base.dynapipe
        handlers = T5StageHandlers(stage, info.device, split_backward=d.split_backward,
                                   per_sample_attention=cfg.base.per_sample_attention)
        meter = ActivationMeter()
        handlers.weight_grads.meter = meter  # what pending weight parts keep is activation memory
        executor = Executor(handlers, group=parallel_state.get_pipeline_model_parallel_group(), device=info.device,
                            store=job_tcp_store(), meter=meter,
                            config=ExecutorConfig(timeout_s=d.timeout_s, trace=d.trace_dir is not None,
                                                  ring=cfg.stage_placement().chunks > 1),
                            replica=info.dp_rank)
        from megatron_integration.dynapipe_step import close_quietly

        source_cls = LoaderSource if cfg.method == "dynapipe" else BaselineSource
        source, cost_model = None, None
        try:  # the executor's threads (and the planners) go too when this fails
            source = source_cls(cfg, info, start_iteration, consumed_samples)
            if isinstance(source, LoaderSource):
                from dynapipe.cost import build_cost_model
                from dynapipe.runtime.plan_source import tensor_parallel_config

                source.loader.failure_watch = executor.failure_elsewhere
                s = source.settings
                cost_model = build_cost_model(s.model, s.device, s.num_stages, s.cost_profile,
                                              tensor_parallel_config(s), placement=s.placement)
        except BaseException:
            close_quietly(source, executor)
            raise
        return cls(cfg, info, stage, optimizer, scheduler, source, executor, handlers, sync, meter, cost_model,
                   [] if d.trace_dir else None)

    def step(self, iteration: int) -> StepResult:
        """Train iteration ``iteration``. A failure anywhere in it is published to every rank
        (:meth:`Executor.report_outside`), so none waits for this one until a timeout."""
        return self.executor.reporting(f"iteration {iteration + 1}", lambda: self._step(iteration))

    def _step(self, iteration: int) -> StepResult:
        start = time.perf_counter()
        item = self.source.next(iteration)
        if item.digest is not None:
            # Every TP rank of a stage must run the same payload, planned for this TP layout.
            check_tp_plans_agree(iteration, item.digest, self.info)
            check_plan_tensor_parallel(item.plan, self.info.tp_size, self.cfg.base.parallel.sequence_parallel)
        base = self.cfg.base
        t_run = time.perf_counter()
        ran = {}

        def forward_backward():
            self.handlers.begin(item.tensors, item.loss_tokens, item.plan)
            self.stage.module.zero_grad_buffer()
            self.optimizer.zero_grad()
            with measure_activations(self.stage.module, self.info.device, self.meter) as activations:
                ran["result"] = self.executor.run(item.plan, loss_tokens=item.loss_tokens)
            ran["activations"] = activations
            self.handlers.syncs.start_unreduced()
            ran["t_grads"] = split_point(self.info.device)
            # Replicas' gradients are summed (calculate_per_token_loss: no averaging), then the
            # embedding copies'; the executor already divided the loss by the global target tokens.
            self.stage.module.finish_grad_sync()
            self.sync(self.stage.gpt)
            if base.parallel.sequence_parallel:
                sum_sequence_parallel_grads(self.stage.gpt)
            return self.handlers.loss_sum if self.info.is_last_stage else None

        verdict = self._validator().run(iteration, forward_backward)
        if verdict is not None:
            return StepResult.stopped(verdict)
        result, activations, t_grads = ran["result"], ran["activations"], ran["t_grads"]
        if self.traces is not None and result.trace is not None:
            self.traces.append(result.trace)
        empty_unused_memory(base.empty_unused_memory_level, self.info.device, after_optimizer=False)
        t_opt = split_point(self.info.device)
        ok, grad_norm, num_zeros = self.optimizer.step()
        if ok:
            self.scheduler.step(increment=1)
        empty_unused_memory(base.empty_unused_memory_level, self.info.device, after_optimizer=True)
        loss_sum, loss_tokens = reduce_loss(float(self.handlers.loss_sum), int(self.handlers.loss_tokens),
                                            holds_loss(self.info), self.info.device)
        if loss_tokens != item.loss_tokens:
            raise DynaPipeError(f"{iteration_name(iteration)}: the executed micro-batches hold {loss_tokens} target tokens, "
                                f"the global batch {item.loss_tokens}; plan and data disagree.")
        if self.info.device.type == "cuda":
            torch.cuda.synchronize()
        return StepResult(loss=loss_sum / max(loss_tokens, 1), loss_tokens=loss_tokens, real_tokens=item.real_tokens,
                          padded_tokens=item.padded_tokens, iteration_ms=(time.perf_counter() - start) * 1e3,
                          grad_norm=float(grad_norm or 0.0), plan_wait_ms=item.wait_ms, skipped=not ok,
                          consumed_samples=item.consumed_samples, truncated=item.truncated,
                          activation_measured_mib=activations["peak_mib"],
                          activation_planned_mib=None if self.cost_model is None else planned_activation_peak_mib(
                              item.plan, self.cost_model, transient=self.info.device.type == "cuda"),
                          executed_work=item.executed_work, real_work=item.real_work,
                          num_zeros_in_grad=None if num_zeros is None else int(num_zeros),
                          breakdown_ms=step_split_ms(t_run, t_grads, t_opt), schedule=item.plan.schedule)

    def _validator(self) -> ResultValidator:
        if self.validator is None:
            self.validator = ResultValidator.of(self.cfg.base, self.stage.module, self.info.device)
        return self.validator

    def skip(self, iteration: int) -> int:
        """Consume iteration ``iteration``'s global batch untrained (``--iterations-to-skip``);
        the consumed samples after it."""
        return self.executor.reporting(f"iteration {iteration + 1}", lambda: self.source.skip(iteration))

    def report_failure(self, exc: BaseException, where: str) -> Optional[BaseException]:
        """Publish a failure of this rank between steps (see the GPT stepper's)."""
        from megatron_integration.dynapipe_step import publish_failure

        loader = self.source.loader if isinstance(self.source, LoaderSource) else None
        return publish_failure(self.executor, loader, self.info.rank, exc, where)

    def close(self) -> None:
        try:
            self.source.close()
        finally:
            self.executor.close()
        if self.traces and self.cfg.base.dynapipe.trace_dir:
            from dynapipe.runtime.exec_trace import write_chrome_trace

            os.makedirs(self.cfg.base.dynapipe.trace_dir, exist_ok=True)
            write_chrome_trace(os.path.join(self.cfg.base.dynapipe.trace_dir, f"rank{self.info.rank:03d}.json"),
                               self.traces)
