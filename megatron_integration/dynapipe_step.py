"""The DynaPipe training step: planned variable-shape micro-batches through the executor.

Per iteration, on every rank:

1. the :class:`~dynapipe.runtime.loader.DynaPipeDataLoader` yields this rank's execution
   plan and the micro-batch tensors its plan loads (planned ahead in worker processes);
2. the :class:`~dynapipe.runtime.executor.Executor` runs the plan; its handlers
   (:class:`MegatronStageHandlers`) call this rank's megatron-core ``GPTModel`` stage
   for load, forward and backward, and it moves activations and gradients
   between stages point-to-point with the shapes the plan carries; the handlers run each
   micro-batch at the recompute level its instruction carries
   (:func:`~megatron_integration.model.set_recompute_level`), in the forward and again
   before its backward, so the level may change from one micro-batch to the next;
3. megatron-core's ``finalize_model_grads`` sums the gradients over data-parallel
   replicas (DDP, ``calculate_per_token_loss``: no averaging) and over the tied
   embedding copies, and megatron-core's optimizer steps.

Loss normalisation: the last stage returns each micro-batch's summed token loss over
its loss tokens, and the executor divides it by the data loader's ``global_loss_tokens``
(the loss tokens of the whole global batch, every replica; passed as
``Executor.run(..., loss_tokens=)``), the normaliser the fixed-shape baselines use too:
the gradient is that of the mean loss per loss token of the global batch, whatever the
micro-batching.

Activation memory: every iteration each rank measures its activation peak
(:func:`dynapipe.runtime.activation_meter.measure_activations`: the CUDA allocator's peak
above the model states, or on CPU what autograd saves plus the executor's buffers) and
computes what its plan promised from the same cost model the planner used
(:func:`dynapipe.runtime.activation_plan.planned_activation_peak_mib`).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from dynapipe.cost.model_flops import TokenWork
from dynapipe.errors import DynaPipeError, iteration_name
from dynapipe.plan.instructions import ForwardPass, MicroBatchInfo
from dynapipe.runtime.activation_meter import ActivationMeter, measure_activations
from dynapipe.runtime.activation_plan import planned_activation_peak_mib
from megatron_integration.train_config import DynaPipeTrainingConfig
from megatron_integration.initialize import RankInfo
from megatron_integration.baseline_step import StepResult, holds_loss, reduce_loss, split_point, step_split_ms
from megatron_integration.model import Stage, finalize_grads_func, set_recompute_level
from megatron_integration.rerun import ResultValidator
from megatron_integration.segment_attention import segment_table, table_calls, table_density
from megatron_integration.stage_handlers import ModelStageHandlers
from megatron_integration.tensor_parallel import check_plan_tensor_parallel, check_tp_plans_agree
from megatron_integration.training_limits import empty_unused_memory


def packed_attention_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """Block-diagonal causal mask ``[mbs, 1, s, s]`` bool (True = masked, as megatron-core's
    local attention takes it) from per-token sample ids ``[mbs, s]`` (0 on padding).

    Built on the device from the ``mbs x s`` ids the plan loads, so no ``s x s`` tensor
    crosses the store. A token attends to the earlier tokens of its own sample; a padding
    token to itself only, so no softmax row is empty (its loss is masked anyway). This is
    the mask megatron's ``--reset-attention-mask`` baseline builds on the host.
    """
    s = segment_ids.shape[1]
    q, k = segment_ids[:, :, None], segment_ids[:, None, :]
    causal = torch.ones((s, s), dtype=torch.bool, device=segment_ids.device).tril_()
    keep = (q == k) & (q > 0) & causal
    keep |= torch.eye(s, dtype=torch.bool, device=segment_ids.device)
    return (~keep).unsqueeze(1)


# Every method stops on such a batch, before any weight moves (see training.py for the baselines).
NO_LOSS_TOKENS = ("the global batch has no loss tokens: each of its samples is input only, or a document of one "
                  "token (an end-of-document token alone, as preprocess_data.py --append-eod writes for an empty "
                  "text) with no next token to predict; the loss cannot be normalised: drop such documents from "
                  "the data.")


class MegatronStageHandlers(ModelStageHandlers):
    """Executor handlers that run one megatron-core GPT stage (see the module docstring)."""

    no_loss_tokens = NO_LOSS_TOKENS

    def __init__(self, stage: Stage, device: torch.device, split_backward: bool = False,
                 per_sample_attention: bool = False):
        super().__init__(stage, device, split_backward)
        # Packed rows with each sample's attention computed alone: the stage's layers read
        # segment tables where the mask goes (megatron_integration.segment_attention).
        self.per_sample_attention = per_sample_attention
        # (micro-batch, chunk) -> the share of the rows' dense attention pairs its tables computed
        # ("input") and the attention calls they made ("calls").
        self.density: dict[tuple[int, int], dict] = {}

    def begin(self, micro_batch_tensors: dict, global_loss_tokens: int, plan=None) -> None:
        super().begin(micro_batch_tensors, global_loss_tokens, plan)
        self.density = {}

    def trace_note(self, op) -> Optional[dict]:
        """The base note (``recompute``), and with per-sample attention ``attention``: the share
        of the rows' dense pairs the op's segment table computed, and its calls."""
        note = dict(super().trace_note(op) or {})
        density = self.density.get((op.mb, getattr(op, "chunk", 0)))
        if density is not None:
            note["attention"] = density
        return note or None

    def _level(self, op) -> None:
        if op is not None and self.stage.gpt is not None:
            chunk = self.stage.gpts[getattr(op, "chunk", 0)]
            set_recompute_level(chunk, self.stage.config, op.recompute)

    def forward(self, mb: MicroBatchInfo, inputs: dict[str, torch.Tensor], op: ForwardPass):
        st = self.stage
        self._level(op)
        c = getattr(op, "chunk", 0)  # the model chunk the op runs (interleaved pipeline)
        gpt, module = st.gpts[c], st.modules[c]
        if not gpt.pre_process:
            gpt.set_input_tensor(inputs["hidden_states"])
        seg = inputs.get("segment_ids")
        if seg is not None and self.per_sample_attention:
            host = (self.tensors.get(mb.mb) or {}).get("segment_ids")  # read on the host, no device sync
            attn_mask = torch.from_numpy(segment_table(np.asarray(seg.cpu() if host is None else host)))
            rows, s = seg.shape[0], seg.shape[1]
            self.density[(op.mb, c)] = {"input": table_density(attn_mask, rows, s, s), "calls": table_calls(attn_mask)}
        else:
            attn_mask = None if seg is None else packed_attention_mask(seg)
        out = module(inputs.get("tokens"), inputs.get("position_ids"), attn_mask, labels=inputs.get("labels"))
        if not gpt.post_process:
            return out
        return self._sum_loss(out, inputs["loss_mask"])


def planner_settings(cfg: DynaPipeTrainingConfig, info: RankInfo):
    """What the planner workers need to plan this run's iterations."""
    from dynapipe.config import load_cluster_config, load_device_config
    from dynapipe.runtime.plan_source import PlannerSettings
    from dynapipe.schedule.types import schedule_on_chunks

    d = cfg.dynapipe
    placement = gpt_placement(cfg, info)
    return PlannerSettings(
        model=cfg.model.to_model_config("megatron-gpt"), device=load_device_config(d.device),
        num_stages=info.pp_size, dp=info.dp_size, method=planned_batching(cfg),
        schedule=schedule_on_chunks(d.schedule, placement.chunks if placement is not None else 1),
        memory_limit_mib=d.memory_limit_mb, cost_profile=None if d.cost_model == "analytic" else d.cost_model,
        micro_batch_size=cfg.micro_batch_size, seq_length=cfg.model.seq_length, max_tokens=d.max_tokens or 0,
        cluster=load_cluster_config(d.cluster), zero=cfg.optimizer.distributed, recompute=d.recompute,
        tp=info.tp_size, sequence_parallel=cfg.parallel.sequence_parallel, placement=placement,
        split_backward=d.split_backward)


def planned_batching(cfg: DynaPipeTrainingConfig) -> str:
    """The planner's batching method of the run: rows that run attention per sample
    (``--dynapipe-packed-attention`` / ``--dynapipe-padded-attention per-sample``) are priced at
    the attention they compute."""
    d = cfg.dynapipe
    if cfg.per_sample_attention and d.batching in ("packing", "dynapipe"):
        return f"{d.batching}-per-sample"
    return d.batching


def gpt_placement(cfg: DynaPipeTrainingConfig, info: RankInfo):
    """The planner's :class:`~dynapipe.cost.placement.StagePlacement` of the stages megatron-core
    builds: the uneven split Megatron's flags gave (``ParallelArgs.stage_layers``), or the even
    interleaved one (every virtual stage an equal share), or None (the even split, one chunk a rank)."""
    from dynapipe.cost.placement import StagePlacement

    chunks = cfg.parallel.virtual_pipeline_model_parallel_size
    model = cfg.model.to_model_config("megatron-gpt")
    layers = cfg.parallel.stage_layers
    if layers is not None:
        return StagePlacement((0,) * len(layers), tuple(layers), chunks or 1).validate(model)
    if not chunks:
        return None
    return StagePlacement.even(model, info.pp_size, chunks)


def close_quietly(*things) -> None:
    """Close each of ``things`` (None skipped) while another error propagates: a failing
    close must neither replace that error nor keep the next one from closing."""
    for thing in things:
        if thing is not None:
            try:
                thing.close()
            except Exception:  # noqa: BLE001 - the error being raised is the one to report
                pass


def next_planned(loader, iteration: int):
    """The DynaPipe loader's next planned iteration, which must be ``iteration`` (0-based): the
    loader yields them in order, a trained or a skipped one alike."""
    data = next(loader)
    if data.iteration != iteration:
        raise DynaPipeError(f"the data loader yielded {iteration_name(data.iteration)} for "
                            f"{iteration_name(iteration)}.")
    return data


def publish_failure(executor, loader, rank: int, exc: BaseException, where: str) -> Optional[BaseException]:
    """A stepper's ``report_failure``: ``exc`` (of global rank ``rank``, during ``where``) goes to
    the executors' abort channel, then, through ``loader`` (None: the method plans nothing), to
    the ranks awaiting this node's plans, unless it is a planner failure read from the store
    (already every rank's). Returns what to raise instead (see ``Executor.report_outside``)."""
    from dynapipe.runtime.planner_workers import PlannerWorkerError

    instead = executor.report_outside(exc, where)
    if loader is not None and not isinstance(exc, PlannerWorkerError):
        loader.report_failure(f"{where}, global rank {rank}: {type(exc).__name__}: {exc}")
    return instead


@dataclass
class DynaPipeStepper:
    """Runs DynaPipe iterations: loader -> executor (megatron-core stage) -> finalize -> optimizer."""

    cfg: DynaPipeTrainingConfig
    info: RankInfo
    stage: Stage
    optimizer: object
    scheduler: object
    loader: object
    executor: object
    handlers: MegatronStageHandlers
    cost_model: object  # the planner's, to price what this rank's plan promises
    meter: ActivationMeter
    traces: Optional[list] = None
    # What a rejected loss or gradient norm leads to (--rerun-mode); set by pretrain, built from
    # the config when not.
    validator: Optional[ResultValidator] = None

    @classmethod
    def create(cls, cfg: DynaPipeTrainingConfig, info: RankInfo, stage: Stage, optimizer, scheduler,
               start_iteration: int, consumed_samples: int) -> "DynaPipeStepper":
        from megatron.core import parallel_state

        from dynapipe.runtime.executor import Executor, ExecutorConfig
        from dynapipe.runtime.kv_store import job_tcp_store
        from megatron_integration.dynapipe_loader import make_loader

        from dynapipe.cost import build_cost_model
        from dynapipe.runtime.plan_source import tensor_parallel_config

        handlers = MegatronStageHandlers(stage, info.device, split_backward=cfg.dynapipe.split_backward,
                                         per_sample_attention=cfg.per_sample_attention)
        meter = ActivationMeter()
        handlers.weight_grads.meter = meter  # what pending weight parts keep is activation memory
        # megatron's pipeline group links the same TP rank of every stage, so each transfer
        # goes between matching TP ranks (under sequence parallelism: their sequence shards).
        executor = Executor(handlers, group=parallel_state.get_pipeline_model_parallel_group(), device=info.device,
                            store=job_tcp_store(), meter=meter,
                            config=ExecutorConfig(timeout_s=cfg.dynapipe.timeout_s,
                                                  trace=cfg.dynapipe.trace_dir is not None, ring=stage.chunked),
                            replica=info.dp_rank)
        loader = None
        try:  # a store not reached, planners not started: the executor's threads (and the planners) go too
            loader = make_loader(cfg, info, start_iteration, consumed_samples)
            loader.failure_watch = executor.failure_elsewhere
            s = planner_settings(cfg, info)
            cost_model = build_cost_model(s.model, s.device, s.num_stages, s.cost_profile, tensor_parallel_config(s))
            if s.placement is not None:
                cost_model = cost_model.with_placement(s.placement)
        except BaseException:
            close_quietly(loader, executor)
            raise
        return cls(cfg, info, stage, optimizer, scheduler, loader, executor, handlers, cost_model, meter,
                   [] if cfg.dynapipe.trace_dir else None)

    def step(self, iteration: int) -> StepResult:
        """Train iteration ``iteration``. A failure anywhere in it is published to every rank
        (:meth:`Executor.report_outside`), so none waits for this one until a timeout."""
        # Numbered from 1, as the log and the training loop number iterations.
        return self.executor.reporting(f"iteration {iteration + 1}", lambda: self._step(iteration))

    def _step(self, iteration: int) -> StepResult:
        start = time.perf_counter()
        data = next_planned(self.loader, iteration)
        meta = data.meta
        # Every TP rank of a stage must run the same payload; then the plan must be for this layout.
        check_tp_plans_agree(iteration, data.digest, self.info)
        check_plan_tensor_parallel(data.plan, self.info.tp_size, self.cfg.parallel.sequence_parallel)
        t_run = time.perf_counter()
        ran = {}

        def forward_backward():
            self.handlers.begin(data.micro_batches, meta.global_loss_tokens, data.plan)
            for module in self.stage.modules:
                module.zero_grad_buffer()
            self.optimizer.zero_grad()
            with measure_activations(self.stage.module, self.info.device, self.meter) as activations:
                ran["result"] = self.executor.run(data.plan, loss_tokens=meta.global_loss_tokens)
            ran["activations"] = activations
            self.handlers.syncs.start_unreduced()
            ran["t_grads"] = split_point(self.info.device)
            # DP sum of gradients and tied-embedding all-reduce; the executor already divided the
            # loss by the global token count, so no further scaling (num_tokens=None).
            finalize_grads_func()(self.stage.modules, None)
            return self.handlers.loss_sum if self.info.is_last_stage else None

        verdict = self._validator().run(iteration, forward_backward)
        if verdict is not None:
            return StepResult.stopped(verdict)
        result, activations, t_grads = ran["result"], ran["activations"], ran["t_grads"]
        empty_unused_memory(self.cfg.empty_unused_memory_level, self.info.device, after_optimizer=False)
        t_opt = split_point(self.info.device)
        ok, grad_norm, num_zeros = self.optimizer.step()
        if ok:
            self.scheduler.step(increment=1)
        empty_unused_memory(self.cfg.empty_unused_memory_level, self.info.device, after_optimizer=True)
        loss_sum, loss_tokens = reduce_loss(float(self.handlers.loss_sum), int(self.handlers.loss_tokens),
                                            holds_loss(self.info), self.info.device)
        if loss_tokens != meta.global_loss_tokens:
            raise DynaPipeError(f"{iteration_name(iteration)}: the executed micro-batches hold {loss_tokens} loss tokens, "
                                f"the plan's global batch {meta.global_loss_tokens}; plan and data disagree.")
        if self.info.device.type == "cuda":
            torch.cuda.synchronize()
        if self.traces is not None and result.trace is not None:
            self.traces.append(result.trace)
        return StepResult(loss=loss_sum / max(loss_tokens, 1), loss_tokens=loss_tokens,
                          real_tokens=meta.global_real_tokens, padded_tokens=meta.global_padded_tokens,
                          iteration_ms=(time.perf_counter() - start) * 1e3, grad_norm=float(grad_norm or 0.0),
                          plan_wait_ms=meta.wait_ms, skipped=not ok, consumed_samples=meta.consumed_samples,
                          truncated=meta.truncated_samples, activation_measured_mib=activations["peak_mib"],
                          activation_planned_mib=planned_activation_peak_mib(
                              data.plan, self.cost_model, transient=self.info.device.type == "cuda"),
                          executed_work=TokenWork.from_json(meta.global_executed_work),
                          real_work=TokenWork.from_json(meta.global_real_work),
                          num_zeros_in_grad=None if num_zeros is None else int(num_zeros),
                          breakdown_ms=step_split_ms(t_run, t_grads, t_opt), schedule=data.plan.schedule)

    def skip(self, iteration: int) -> int:
        """Consume iteration ``iteration``'s plan and global batch untrained
        (``--iterations-to-skip``); the consumed samples after it."""
        return self.executor.reporting(f"iteration {iteration + 1}",
                                       lambda: next_planned(self.loader, iteration).meta.consumed_samples)

    def _validator(self) -> ResultValidator:
        if self.validator is None:
            self.validator = ResultValidator.of(self.cfg, self.stage.module, self.info.device)
        return self.validator

    def report_failure(self, exc: BaseException, where: str) -> Optional[BaseException]:
        """Publish a failure of this rank between steps (:func:`report_failure`): to the
        executors' abort channel, and, where this node plans, to the ranks awaiting its plans
        (not for a planner failure read from the store: that is already every rank's)."""
        return publish_failure(self.executor, self.loader, self.info.rank, exc, where)

    def close(self) -> None:
        try:
            self.loader.close()
        finally:
            self.executor.close()  # its helper threads and store keys go whatever else fails
        if self.traces and self.cfg.dynapipe.trace_dir:
            from dynapipe.runtime.exec_trace import write_chrome_trace

            os.makedirs(self.cfg.dynapipe.trace_dir, exist_ok=True)
            path = os.path.join(self.cfg.dynapipe.trace_dir, f"rank{self.info.rank:03d}.json")
            write_chrome_trace(path, self.traces)
