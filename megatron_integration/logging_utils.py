"""Megatron-format training log lines, and TensorBoard scalars when asked for.

One line every ``--log-interval`` iterations, printed by the last pipeline stage of the
first replica (where Megatron-LM prints), averaged over the interval::

     [2026-12-03 23:54:52.123456] iteration       10/      50 | consumed samples:          640 |
     elapsed time per iteration (ms): 812.3 |
     learning rate: 1.000000E-03 | global batch size:    64 | lm loss: 5.912345E+00 | loss scale: 1.0 |
     grad norm: 0.812 |
     real tokens/s: 12345.6 | padding efficiency: 0.912 | plan wait (ms): 0.04 |
     activation peak (MiB): 812.4/790.2 | number of skipped iterations:   0 | number of nan iterations:   0 |

``activation peak (MiB)``: this stage's measured peak / the peak its plan promised
(``-`` for the fixed-shape baselines, which have no plan), highest over the interval.

With ``--log-throughput`` the line also carries Megatron-LM's ``throughput per GPU
(TFLOP/s/GPU)`` after the iteration time: the model FLOPs of the shapes the interval executed
(every row at its padded length, as Megatron-LM counts a batch of that layout) over the
elapsed time and the world size, and ``real-token throughput per GPU (TFLOP/s/GPU)``: the same
for the samples at their own lengths, the work any batching must do
(:mod:`dynapipe.cost.model_flops`). One rank a "GPU" on CPU.
"""
from __future__ import annotations

import math
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Optional, TextIO

from dynapipe.config import ModelConfig
from dynapipe.cost.model_flops import model_flops, tflops_per_device
from megatron_integration.baseline_step import StepResult
from megatron_integration.train_config import TensorBoardArgs
from megatron_integration.run_report import write_line


@dataclass
class IntervalStats:
    """Sums over the iterations since the last log line."""

    iterations: int = 0
    # Megatron-LM's interval loss: the mean of the non-skipped iterations' losses (each already
    # a mean over its tokens), not a token-weighted one.
    loss_sum: float = 0.0
    loss_iterations: int = 0
    loss_tokens: int = 0
    paused_s: float = 0.0  # evaluation and checkpoints inside the interval, not iteration time
    nan_iterations: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0
    plan_wait_ms: float = 0.0
    grad_norm: Optional[float] = None  # the last iteration's; None when it was skipped (fp16 overflow)
    skipped: int = 0
    truncated: int = 0
    activation_measured_mib: float = 0.0  # highest over the interval
    activation_planned_mib: Optional[float] = None
    num_zeros_in_grad: Optional[int] = None  # the last iteration's, as Megatron-LM logs them
    loss_scale: float = 1.0
    params_norm: Optional[float] = None
    # Model FLOPs of the interval (--log-throughput): executed shapes, and the samples' own.
    executed_flops: float = 0.0
    real_flops: float = 0.0
    started: float = field(default_factory=time.perf_counter)

    def add(self, r: StepResult, flops_model: Optional[ModelConfig] = None) -> None:
        if flops_model is not None:
            if r.executed_work is None or r.real_work is None:
                raise ValueError("--log-throughput: this method's step results carry no token work to price")
            self.executed_flops += model_flops(flops_model, r.executed_work)
            self.real_flops += model_flops(flops_model, r.real_work)
        self.iterations += 1
        if not r.skipped:
            self.loss_sum += r.loss
            self.loss_iterations += 1
        elif not math.isfinite(r.loss):  # Megatron-LM counts the skipped steps whose loss was NaN/Inf
            self.nan_iterations += 1
        self.loss_tokens += r.loss_tokens
        self.real_tokens += r.real_tokens
        self.padded_tokens += r.padded_tokens
        self.plan_wait_ms += r.plan_wait_ms
        self.grad_norm = None if r.skipped else r.grad_norm
        self.num_zeros_in_grad, self.params_norm, self.loss_scale = r.num_zeros_in_grad, r.params_norm, r.loss_scale
        self.skipped += int(r.skipped)
        self.truncated += r.truncated
        self.activation_measured_mib = max(self.activation_measured_mib, r.activation_measured_mib)
        if r.activation_planned_mib is not None:
            self.activation_planned_mib = max(self.activation_planned_mib or 0.0, r.activation_planned_mib)


def _tflops(value: float) -> str:
    """Megatron-LM's one decimal, with three significant digits below 10 (a CPU rank's figure
    would otherwise print as 0.0)."""
    return f"{value:.1f}" if value >= 10 else f"{value:.3g}"


def format_log_line(iteration: int, train_iters: int, consumed_samples: int, stats: IntervalStats, elapsed_s: float,
                    lr: float, global_batch_size: int, world_size: Optional[int] = None,
                    skipped_samples: int = 0) -> str:
    """The Megatron-style line for one logging interval (``world_size``: the ranks the
    throughput is divided over, given with ``--log-throughput``; ``skipped_samples``: those
    ``--iterations-to-skip`` consumed untrained so far, printed when there are any)."""
    n = max(stats.iterations, 1)
    ms_per_iter = elapsed_s * 1e3 / n
    # Megatron-LM's line starts with the wall-clock time: ' [2026-12-03 23:54:52.123456] iteration ...'.
    parts = [
        f" [{datetime.now().strftime('%Y-%m-%d %H:%M:%S.%f')}] iteration {iteration:8d}/{train_iters:8d}",
        f"consumed samples: {consumed_samples:12d}",
    ]
    if skipped_samples:
        parts.append(f"skipped samples: {skipped_samples:12d}")
    parts += [
        f"elapsed time per iteration (ms): {ms_per_iter:.1f}",
    ]
    if world_size is not None:
        parts += [f"throughput per GPU (TFLOP/s/GPU): "
                  f"{_tflops(tflops_per_device(stats.executed_flops, elapsed_s, world_size))}",
                  f"real-token throughput per GPU (TFLOP/s/GPU): "
                  f"{_tflops(tflops_per_device(stats.real_flops, elapsed_s, world_size))}"]
    parts += [
        f"learning rate: {lr:.6E}",
        f"global batch size: {global_batch_size:5d}",
    ]
    if stats.loss_iterations:  # Megatron-LM prints no loss for an interval of skipped steps only
        parts.append(f"lm loss: {stats.loss_sum / stats.loss_iterations:.6E}")
    parts.append(f"loss scale: {stats.loss_scale:.1f}")
    if stats.grad_norm is not None:  # Megatron-LM leaves it out after a skipped (overflowed) step
        parts.append(f"grad norm: {stats.grad_norm:.3f}")
    # Megatron-LM's --log-num-zeros-in-grad and --log-params-norm fields, where it prints them.
    if stats.num_zeros_in_grad is not None:
        parts.append(f"num zeros: {stats.num_zeros_in_grad}")
    if stats.params_norm is not None:
        parts.append(f"params norm: {stats.params_norm:.3f}")
    parts += [
        f"real tokens/s: {stats.real_tokens / max(elapsed_s, 1e-9):.1f}",
        f"padding efficiency: {stats.real_tokens / max(stats.padded_tokens, 1):.3f}",
        f"plan wait (ms): {stats.plan_wait_ms / n:.2f}",
        f"activation peak (MiB): {stats.activation_measured_mib:.1f}/"
        + ("-" if stats.activation_planned_mib is None else f"{stats.activation_planned_mib:.1f}"),
        f"number of skipped iterations: {stats.skipped:3d}",
        f"number of nan iterations: {stats.nan_iterations:3d}",
    ]
    if stats.truncated:
        parts.append(f"truncated samples: {stats.truncated}")
    return " | ".join(parts) + " |"


def memory_report_line(rank: int, iteration: int, memory_mib: dict) -> str:
    """Megatron-LM's GPU memory report (its ``report_memory``), which it prints after the first
    logging interval (and the next, when the first ended at the run's first iteration) on every
    rank of the first data-parallel replica: ``memory_mib`` as
    :func:`dynapipe.runtime.activation_meter.cuda_memory_mib` gives it (MiB, Megatron's "MB")."""
    m = memory_mib
    line = (f"[Rank {rank}] (after {iteration} iterations) memory (MB) | allocated: {m['allocated']} | "
            f"max allocated: {m['max_allocated']} | reserved: {m['reserved']} | max reserved: {m['max_reserved']}")
    # Megatron-LM adds the device's own count where torch can read it.
    return line if m.get("device_usage") is None else f"{line} | device usage: {m['device_usage']}"


class TrainingLogger:
    """Collects step results and prints (and writes to TensorBoard) every ``log_interval``."""

    def __init__(self, train_iters: int, global_batch_size: int, log_interval: int, is_logging_rank: bool,
                 tensorboard_dir: Optional[str] = None, stream: TextIO = sys.stdout,
                 flops_model: Optional[ModelConfig] = None, world_size: int = 1,
                 tensorboard: Optional[TensorBoardArgs] = None, consumed_samples: int = 0):
        # global_batch_size: the configured one, printed until an iteration says its own
        # (a token budget, --dynapipe-tokens-per-global-batch, makes it vary iteration by
        # iteration; Megatron-LM prints the current one). consumed_samples: where the run starts.
        self.train_iters, self.global_batch_size = train_iters, global_batch_size
        self._consumed = consumed_samples
        self.skipped_samples = 0  # consumed untrained (--iterations-to-skip), in this run
        self._last_recorded = None  # (1-based iteration, consumed samples) of the last record()
        self.flops_model, self.world_size = flops_model, world_size
        self.tensorboard = tensorboard or TensorBoardArgs()
        self.log_interval = log_interval
        self.is_logging_rank = is_logging_rank
        self.stream = stream
        self.stats = IntervalStats()
        # Evaluation and checkpoint time over the whole run (paused()), which the end-of-run
        # summary leaves out of training time as every interval's line does.
        self.paused_total_s = 0.0
        self.writer = None
        self.lines: list[str] = []
        if tensorboard_dir and is_logging_rank:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except Exception as e:  # tensorboard is an optional extra
                print(f"warning: --tensorboard-dir given but TensorBoard is unavailable ({e}); "
                      f"install it with `pip install tensorboard`.", file=sys.stderr)
            else:
                self.writer = SummaryWriter(log_dir=tensorboard_dir, max_queue=self.tensorboard.queue_size)

    def record(self, iteration: int, consumed_samples: int, result: StepResult, lr: float) -> Optional[str]:
        """Add one iteration (1-based ``iteration``; ``consumed_samples`` after it, counted
        from the start of training); returns the log line when one is due."""
        self.stats.add(result, self.flops_model)
        self._last_recorded = (iteration, consumed_samples)
        if consumed_samples > self._consumed:
            self.global_batch_size = consumed_samples - self._consumed
        self._consumed = consumed_samples
        if self.writer is not None and iteration % self.tensorboard.log_interval == 0:
            w = self.writer
            w.add_scalar("lm loss", result.loss, iteration)
            w.add_scalar("lm loss vs samples", result.loss, consumed_samples)
            w.add_scalar("iteration-time (ms)", result.iteration_ms, iteration)
            w.add_scalar("real tokens per second", result.real_tokens / max(result.iteration_ms / 1e3, 1e-9), iteration)
            w.add_scalar("padding efficiency", result.padding_efficiency, iteration)
            w.add_scalar("plan wait (ms)", result.plan_wait_ms, iteration)
            w.add_scalar("learning-rate", lr, iteration)
            if not result.skipped:
                w.add_scalar("grad-norm", result.grad_norm, iteration)
            if self.tensorboard.log_loss_scale:  # off with Megatron's --no-log-loss-scale-to-tensorboard
                w.add_scalar("loss-scale", result.loss_scale, iteration)
            if self.tensorboard.log_world_size:
                w.add_scalar("world-size", self.world_size, iteration)
            if result.num_zeros_in_grad is not None:
                w.add_scalar("num-zeros", result.num_zeros_in_grad, iteration)
            if result.params_norm is not None:
                w.add_scalar("params-norm", result.params_norm, iteration)
            if self.tensorboard.log_timers:  # Megatron's --log-timers-to-tensorboard: the measured split
                for key, ms in sorted(result.breakdown_ms.items()):
                    if key.endswith("_ms") and isinstance(ms, (int, float)):
                        w.add_scalar(f"{key.removesuffix('_ms')}-time (ms)", ms, iteration)
        if self.writer is not None and self.skipped_samples and iteration % self.tensorboard.log_interval == 0:
            self.writer.add_scalar("skipped-train-samples", self.skipped_samples, iteration)
        if iteration % self.log_interval and iteration != self.train_iters:
            return None
        return self._line(iteration, consumed_samples, lr)

    def flush(self, lr: float) -> Optional[str]:
        """The line of an interval the run ended in without logging (its last iterations skipped
        by ``--iterations-to-skip``), at the last trained iteration; None when there is none."""
        if not self.stats.iterations or self._last_recorded is None:
            return None
        return self._line(*self._last_recorded, lr)

    def _line(self, iteration: int, consumed_samples: int, lr: float) -> str:
        elapsed = time.perf_counter() - self.stats.started - self.stats.paused_s
        line = format_log_line(iteration, self.train_iters, consumed_samples, self.stats, elapsed, lr,
                               self.global_batch_size, None if self.flops_model is None else self.world_size,
                               self.skipped_samples)
        if self.writer is not None and self.flops_model is not None:
            self.writer.add_scalar("throughput (TFLOP/s/GPU)",
                                   tflops_per_device(self.stats.executed_flops, elapsed, self.world_size), iteration)
            self.writer.add_scalar("real-token throughput (TFLOP/s/GPU)",
                                   tflops_per_device(self.stats.real_flops, elapsed, self.world_size), iteration)
        self.stats = IntervalStats()
        self.lines.append(line)
        if self.is_logging_rank:
            write_line(self.stream, line)
        return line

    def skip(self, consumed_samples: int) -> None:
        """An iteration consumed untrained (``--iterations-to-skip``), ``consumed_samples`` after
        it: no line, and the next line's global batch is the next iteration's, not both."""
        self.skipped_samples += consumed_samples - self._consumed
        self._consumed = consumed_samples

    @contextmanager
    def paused(self):
        """Within the block (evaluation, a checkpoint) the interval's clock stops, as
        Megatron-LM stops its interval timer: the log line's time per iteration is training."""
        start = time.perf_counter()
        try:
            yield
        finally:
            paused = time.perf_counter() - start
            self.stats.paused_s += paused
            self.paused_total_s += paused

    def close(self) -> None:
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
