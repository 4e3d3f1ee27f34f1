"""The fixed-shape baselines: one training iteration through megatron-core's own 1F1B.

``padding`` and ``packing`` micro-batches all have the shape ``[--micro-batch-size,
--seq-length]``; ``padding-mb`` micro-batches are ``--micro-batch-size`` samples in
arrival order padded to their own longest (a multiple of 8), run with megatron-core's
``variable_seq_lengths`` (its p2p exchanges every activation's shape before the
activation). megatron-core's ``get_forward_backward_func`` runs them (1F1B with
PP > 1, no pipelining with PP = 1), DDP and ``finalize_model_grads`` reduce the
gradients and divide them by the global batch's loss-token count
(``calculate_per_token_loss``; the loss is divided by the global loss tokens first, as the
executor divides it, so fp16's loss scale sees an averaged loss), and megatron-core's optimizer steps.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from dynapipe.cost.model_flops import TokenWork, rows_work
from dynapipe.data.samples import Sample
from megatron_integration.batches import (MicroBatchTensors, packing_assignment, padding_assignment,
                                          rows_micro_batch)
from megatron_integration.initialize import RankInfo
from megatron_integration.model import Stage
from megatron_integration.schedule_timing import ScheduleTiming, timed_schedule
from megatron_integration.training_limits import empty_unused_memory

if TYPE_CHECKING:
    from megatron_integration.rerun import Verdict

# Baselines whose micro-batches differ in sequence length (megatron-core's variable_seq_lengths).
VARIABLE_LENGTH_METHODS = ("padding-mb",)


@dataclass
class StepResult:
    """One iteration's outcome, identical on every rank.

    ``loss`` is the global batch's mean loss per loss token (``lm loss``); token counts
    are over the whole global batch: ``loss_tokens`` the sum of its ``loss_mask``,
    ``real_tokens`` its non-pad tokens (input + target), ``padded_tokens`` the tokens
    computed, padding included; times in ms.
    """

    loss: float
    loss_tokens: int
    real_tokens: int
    padded_tokens: int
    iteration_ms: float
    grad_norm: float = 0.0
    plan_wait_ms: float = 0.0
    skipped: bool = False
    consumed_samples: int = 0
    truncated: int = 0
    # This rank's activation peak over the iteration (MiB), and what its plan promised (None: no plan).
    activation_measured_mib: float = 0.0
    activation_planned_mib: Optional[float] = None
    # Where the iteration's time went on this rank (ms), when the step measured it.
    breakdown_ms: dict = field(default_factory=dict)
    # Over the global batch: the shapes it executed (rows at their padded lengths) and its samples
    # at their own lengths; what --log-throughput prices (dynapipe.cost.model_flops).
    executed_work: Optional[TokenWork] = None
    real_work: Optional[TokenWork] = None
    # Megatron's --log-num-zeros-in-grad (the optimizer's count, every stage) and
    # --log-params-norm (after the step); None when not asked for.
    num_zeros_in_grad: Optional[int] = None
    params_norm: Optional[float] = None
    loss_scale: float = 1.0  # the optimizer's loss scale after the step (1.0 when it scales nothing)
    # The pipeline schedule the iteration ran: its plan's (``auto``'s choice under DynaPipe), or
    # megatron-core's own ("1f1b", "interleaved") for the baselines it schedules.
    schedule: str = ""
    # A rejected loss or gradient norm that ends the run before the optimizer step; None for an
    # iteration trained.
    stop: Optional["Verdict"] = None

    @classmethod
    def stopped(cls, verdict) -> "StepResult":
        """The iteration that ends the run on ``verdict``: nothing was trained."""
        return cls(loss=math.nan, loss_tokens=0, real_tokens=0, padded_tokens=0, iteration_ms=0.0, stop=verdict)

    @property
    def padding_efficiency(self) -> float:
        return self.real_tokens / max(self.padded_tokens, 1)


def split_point(device: torch.device) -> float:
    """``time.perf_counter()`` seconds once the device's queued work is done: on CUDA the host
    runs ahead of the kernels, so a split read without synchronising would put the pipeline's
    GPU time into whatever part waits for it next (the gradient all-reduce)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def step_split_ms(t_run: float, t_grads: float, t_opt: float) -> dict:
    """Where an executor-driven iteration went (ms; ``time.perf_counter()`` seconds at the
    executor's start, at its end, and at the optimizer step's start; up to now), and the
    executor's end on the wall clock (``pipeline_end_us``, comparable between the ranks of a
    host: how long this rank then waited for the others is pipeline drain)."""
    now, wall_us = time.perf_counter(), time.time_ns() / 1e3
    return {"executor_ms": round((t_grads - t_run) * 1e3, 3), "grads_ms": round((t_opt - t_grads) * 1e3, 3),
            "optimizer_ms": round((now - t_opt) * 1e3, 3),
            "pipeline_end_us": round(wall_us - (now - t_grads) * 1e6, 1)}


def loss_func(loss_mask: torch.Tensor, output: torch.Tensor, divisor: float = 1.0):
    """Megatron's three-value loss contract: (sum of token losses / ``divisor``, loss tokens,
    report of the undivided sum). See :func:`megatron_train_step` for the divisor."""
    losses = output.float().reshape(-1)
    mask = loss_mask.reshape(-1).float()
    loss_sum = torch.sum(losses * mask)
    tokens = mask.sum()
    return (loss_sum / divisor, tokens.to(torch.int),
            {"lm loss": torch.stack([loss_sum.detach(), tokens.detach()])})


def schedule_inputs(stage: Stage, micro_batches: list) -> tuple[list, object]:
    """megatron-core's ``model`` and ``data_iterator`` arguments: the chunks' DDP modules, and
    one iterator over the micro-batches per chunk under the interleaved pipeline (every chunk
    runs every micro-batch, in order)."""
    if stage.chunked:
        return stage.modules, [iter(micro_batches) for _ in stage.modules]
    return stage.modules, iter(micro_batches)


def schedule_group(stage: Stage) -> int:
    """The multiple megatron-core's schedule needs the micro-batch count to be: the pipeline
    size under the interleaved pipeline (whole groups per chunk), else 1."""
    return stage.info.pp_size if stage.chunked else 1


def forward_step(data_iterator, model, loss_divisor: float = 1.0):
    """megatron-core ``forward_step_func``: run the stage on the next micro-batch."""
    mb: MicroBatchTensors = next(data_iterator)
    output = model(mb.tokens, mb.position_ids, mb.attention_mask, labels=mb.labels)
    return output, partial(loss_func, mb.loss_mask, divisor=loss_divisor)


def _finalize_scaled(finalize: Callable, divisor: float) -> Callable:
    """``finalize_model_grads`` for gradients of losses divided by ``divisor``: it divides them
    by the global token count over ``divisor``, so they end as the per-token mean's."""
    def run(model, num_tokens=None, *args, **kwargs):
        scaled = None if num_tokens is None else num_tokens.to(torch.float32) / divisor
        return finalize(model, scaled, *args, **kwargs)
    return run


def sp_shards(cfg) -> int:
    """The TP size under sequence parallelism (each sequence split over that many ranks), else 1."""
    return cfg.parallel.tensor_model_parallel_size if cfg.parallel.sequence_parallel else 1


def build_micro_batches(method: str, samples: Sequence[Sample], lengths: np.ndarray, seq_length: int, mbs: int,
                        info: RankInfo, reset_position_ids: bool = False, reset_attention_mask: bool = False,
                        mb_multiple: int = 1, sp_shards: int = 1,
                        packed_attention: str = "mask") -> tuple[list[MicroBatchTensors], TokenWork]:
    """This replica's fixed-shape micro-batches and what the global batch executes (every
    replica's rows at their padded length; its ``tokens`` are the padded tokens); ``mb_multiple``:
    packing rounds its micro-batch count up to a multiple of it with empty rows (the interleaved
    schedule's groups; padding's count is checked at start-up); ``sp_shards``: the TP size under
    sequence parallelism, whose multiple every ``padding-mb`` length must also be (the split of
    each sequence over the TP ranks); ``packed_attention``: ``per-sample`` keeps packed samples
    apart by running attention on each alone (``mask``: Megatron's mask over the row)."""
    dp, r = info.dp_size, info.dp_rank
    if method == "padding":
        groups = padding_assignment(len(samples), mbs, dp, r)
        mbs_list = [rows_micro_batch([[samples[i]] for i in g], seq_length) for g in groups]
        executed = rows_work(len(samples), seq_length)
    elif method == "packing":
        groups = packing_assignment(lengths, seq_length, mbs, dp, r, mb_multiple)
        mbs_list = [rows_micro_batch([[samples[i] for i in row] for row in g], seq_length,
                                     reset_position_ids, reset_attention_mask,
                                     per_sample_attention=packed_attention == "per-sample") for g in groups]
        executed = rows_work(len(groups) * mbs * dp, seq_length)
    elif method == "padding-mb":
        from dynapipe.batching.ordering import padded_length

        multiple = math.lcm(8, max(sp_shards, 1))  # --seq-length is a multiple of sp_shards (checked)

        def longest(g: list[int]) -> int:
            return int(padded_length(np.array([int(lengths[g].max())]), seq_length, multiple)[0])

        groups = padding_assignment(len(samples), mbs, dp, r)
        mbs_list = [rows_micro_batch([[samples[i]] for i in g], longest(g)) for g in groups]
        executed = TokenWork()
        for rep in range(dp):
            for g in padding_assignment(len(samples), mbs, dp, rep):
                executed = executed + rows_work(len(g), longest(g))
    else:
        raise ValueError(f"not a fixed-shape method: {method!r}")
    return [m.to(info.device) for m in mbs_list], executed


def holds_loss(info: RankInfo) -> bool:
    """Whether this rank's loss counts in the global sums: the last stage's tensor-parallel
    rank 0 of every replica (every TP rank of the last stage computes the same loss)."""
    return info.is_last_stage and info.tp_rank == 0


def reduce_loss(loss_sum: float, loss_tokens: int, is_last_stage: bool, device: torch.device) -> tuple[float, int]:
    """Global (sum, tokens) from the ranks where ``is_last_stage`` (one rank of the last stage
    of every replica), known on every rank."""
    t = torch.tensor([loss_sum, float(loss_tokens)] if is_last_stage else [0.0, 0.0],
                     dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t[0]), int(round(float(t[1])))


def megatron_train_step(stage: Stage, optimizer, scheduler, micro_batches: list[MicroBatchTensors],
                        seq_length: int, mbs: int, info: RankInfo, real_tokens: int, padded_tokens: int,
                        variable_seq_lengths: bool = False, validate: Optional[Callable] = None,
                        memory_level: int = 0, loss_divisor: float = 1.0) -> StepResult:
    """One iteration of megatron-core 1F1B over the micro-batches, with the optimizer step.

    Micro-batches of different lengths (``padding-mb``) turn on megatron-core's
    ``variable_seq_lengths`` for this call, as does ``variable_seq_lengths=True``: its p2p
    then sends each activation's shape ahead of the activation. ``validate(forward_backward)``
    (:meth:`megatron_integration.rerun.ResultValidator.run` for the iteration) runs the forward
    and backward passes (once, or again as ``--rerun-mode`` says; ``forward_backward()`` returns
    the local loss sum, None on ranks that hold no loss) and returns None, or the verdict that
    ends the run before the optimizer step (the result then says so: ``StepResult.stop``).
    ``memory_level``: Megatron's ``--empty-unused-memory-level``.

    ``loss_divisor`` (the same on every rank: the global batch's loss tokens): the backward
    runs on each micro-batch's loss sum over it, and ``finalize_model_grads`` divides by the
    token count over it, so the gradients are the per-token mean's as before, but what fp16's
    loss scale multiplies is the executor's loss (about the size of Megatron-LM's averaged one),
    not a sum of thousands of token losses that overflows at the scales Megatron-LM uses."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from dynapipe.runtime.activation_meter import measure_activations

    start = time.perf_counter()
    forward_backward = get_forward_backward_func()
    lengths = {int(m.tokens.shape[1]) for m in micro_batches}
    variable_seq_lengths = variable_seq_lengths or len(lengths) > 1
    seq_length = max(lengths) if lengths else seq_length
    ran = {}

    def run_schedule():
        # Timed afresh at every computation: a recomputed iteration (--rerun-mode) reports one.
        ran["timing"] = timing = ScheduleTiming()
        for module in stage.modules:
            module.zero_grad_buffer()
        optimizer.zero_grad()
        saved_variable, saved_finalize = stage.config.variable_seq_lengths, stage.config.finalize_model_grads_func
        stage.config.variable_seq_lengths = variable_seq_lengths or saved_variable
        if saved_finalize is not None and loss_divisor != 1.0:
            stage.config.finalize_model_grads_func = _finalize_scaled(saved_finalize, loss_divisor)
        try:
            with timed_schedule(stage.config, timing), measure_activations(stage.module, info.device) as activations:
                model, data = schedule_inputs(stage, micro_batches)
                ran["reports"] = forward_backward(forward_step_func=partial(forward_step, loss_divisor=loss_divisor),
                                                  data_iterator=data, model=model,
                                                  num_microbatches=len(micro_batches), seq_length=seq_length,
                                                  micro_batch_size=mbs, forward_only=False)
        finally:
            stage.config.variable_seq_lengths, stage.config.finalize_model_grads_func = saved_variable, saved_finalize
        ran["activations"] = activations
        return sum(float(r["lm loss"][0]) for r in ran["reports"]) if info.is_last_stage else None

    if validate is None:
        run_schedule()
    else:
        verdict = validate(run_schedule)
        if verdict is not None:
            return StepResult.stopped(verdict)
    reports, activations, timing = ran["reports"], ran["activations"], ran["timing"]
    t_opt = time.perf_counter()
    empty_unused_memory(memory_level, info.device, after_optimizer=False)
    ok, grad_norm, num_zeros = optimizer.step()
    if ok:
        scheduler.step(increment=1)
    empty_unused_memory(memory_level, info.device, after_optimizer=True)
    loss_sum = sum(float(r["lm loss"][0]) for r in reports) if info.is_last_stage else 0.0
    loss_tokens = sum(int(r["lm loss"][1]) for r in reports) if info.is_last_stage else 0
    # Every TP rank of the last stage holds the same (TP-reduced) loss; TP rank 0 counts it.
    loss_sum, loss_tokens = reduce_loss(loss_sum, loss_tokens, holds_loss(info), info.device)
    if info.device.type == "cuda":
        torch.cuda.synchronize()
    end = time.perf_counter()
    breakdown = timing.to_json()
    breakdown["optimizer_ms"] = round((end - t_opt) * 1e3, 3)
    return StepResult(loss=loss_sum / max(loss_tokens, 1), loss_tokens=loss_tokens, real_tokens=real_tokens,
                      padded_tokens=padded_tokens, iteration_ms=(end - start) * 1e3,
                      grad_norm=float(grad_norm or 0.0), skipped=not ok, breakdown_ms=breakdown,
                      num_zeros_in_grad=None if num_zeros is None else int(num_zeros),
                      activation_measured_mib=activations["peak_mib"],
                      schedule="interleaved" if len(stage.modules) > 1 else "1f1b")
