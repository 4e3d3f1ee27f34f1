"""The iteration loop every model's training shares (GPT: :mod:`megatron_integration.training`,
T5: :mod:`megatron_integration.t5_training`).

Both build their stage, optimizer, stepper and checkpoint callbacks their own way, then hand
them to :func:`run_iterations`, which runs the iterations as Megatron-LM's ``train()`` does:
a log line every ``--log-interval``, evaluation every ``--eval-interval``, a checkpoint every
``--save-interval`` and at the end, ``--exit-interval`` and ``--exit-duration-in-mins``
(checkpoint first), manual garbage collection, and the end-of-training summary and evaluation.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Optional, Protocol, TextIO

from dynapipe.config import ModelConfig
from dynapipe.cost.model_flops import model_flops
from dynapipe.runtime.activation_meter import cuda_memory_mib, reset_cuda_peaks
from megatron_integration.agreement import peer_lost
from megatron_integration.baseline_step import StepResult
from megatron_integration.exit_signal import ExitSignal, exit_signal_line
from megatron_integration.initialize import RankInfo
from megatron_integration.logging_utils import TrainingLogger, memory_report_line
from megatron_integration.run_report import training_summary_lines, write_line
from megatron_integration.train_config import DynaPipeTrainingConfig
from megatron_integration.training_limits import exit_duration_line, exit_duration_reached


class Stepper(Protocol):
    """Runs one training iteration (forward, backward, optimizer step) of a method."""

    def step(self, iteration: int) -> StepResult: ...

    def skip(self, iteration: int) -> int:
        """Consume the iteration's global batch untrained; the consumed samples after it."""
        ...

    def close(self) -> None: ...


def report_failure(stepper, exc: BaseException, where: str) -> Optional[BaseException]:
    """Publish a failure of this rank outside the stepper's steps (evaluation, a checkpoint,
    logging, a callback) to the ranks waiting on it, when the stepper can (DynaPipe's
    executor and planners: ``report_failure``); the error to raise instead of ``exc`` when
    another rank failed first and ``exc`` is its consequence, else None."""
    report = getattr(stepper, "report_failure", None)
    if report is None:
        return None
    try:
        return report(exc, where)
    except Exception:  # noqa: BLE001 - the store may be what failed; the original error is raised
        return None


@dataclass
class TrainingRun:
    """What a finished run reports (identical on every rank, except the log lines)."""

    results: list[StepResult] = field(default_factory=list)
    log_lines: list[str] = field(default_factory=list)
    start_iteration: int = 0
    consumed_samples: int = 0
    spec_name: str = ""
    # Megatron-format validation / test lines (with their rules of dashes), in order.
    eval_lines: list[str] = field(default_factory=list)
    # How evaluation batches ran: "dynapipe-plans:N" (N forward-only plans through the executor),
    # "megatron-forward-only" (megatron-core's schedule), "" (no evaluation).
    eval_path: str = ""
    # Megatron-LM's checkpoint save/load lines (rank 0).
    checkpoint_lines: list[str] = field(default_factory=list)
    # Parameters this rank's stage holds (every chunk, shared copies once), as Megatron counts them.
    parameters: int = 0
    # Model FLOPs of every iteration trained, a checkpoint's included (Megatron-LM's
    # num_floating_point_operations_so_far): the executed shapes', by Megatron-LM's count.
    flops_so_far: float = 0.0
    # --iterations-to-skip: the iterations (from 1, as the flag and the log name them) consumed untrained.
    skipped_iterations: list[int] = field(default_factory=list)
    # GPUs: this rank's caching-allocator memory at the end of the run, maxima over the run (MiB;
    # dynapipe.runtime.activation_meter.cuda_memory_mib). None on CPUs.
    cuda_memory_mib: Optional[dict] = None

    @property
    def losses(self) -> list[float]:
        return [r.loss for r in self.results]


def current_lr(optimizer) -> float:
    """The learning rate of the first parameter group."""
    return float(optimizer.param_groups[0]["lr"])


def print_rank_0(info: RankInfo, stream: TextIO, lines: list[str], line: str) -> None:
    """Megatron-LM's ``print_rank_0``, also kept in ``lines``."""
    if info.rank == 0:
        write_line(stream, line)
        lines.append(line)


@dataclass
class LoopParts:
    """What :func:`run_iterations` drives; built by the model's own ``pretrain``.

    ``save(iteration, consumed_samples, flops_so_far, persistent=True)`` writes a checkpoint (called
    only with ``--save``; ``persistent=False``: a non-persistent one, ``--non-persistent-save-interval``);
    ``model``: the model whose FLOPs ``TrainingRun.flops_so_far`` counts and ``--log-throughput``
    prices;
    ``make_evaluator()`` returns the run's evaluator or None (called inside the loop's cleanup
    scope, so the stepper's planner workers are stopped even if building it fails);
    ``params_norm``: returns the parameters' L2 norm, on every rank after every step;
    ``weight_hashes(iteration, log)``: checks the data-parallel replicas' weights (collective).
    """

    cfg: DynaPipeTrainingConfig
    info: RankInfo
    optimizer: object
    stepper: Stepper
    save: Callable[[int, int, float], None]
    make_evaluator: Callable[[], object]
    started_s: float  # time.time() at the start of pretrain: --exit-duration-in-mins counts from it
    # --log-params-norm: the model's parameter norm after each step (collective; None: not asked).
    params_norm: Optional[Callable[[], float]] = None
    # --check-weight-hash-across-dp-replicas-interval: compares the replicas' weights after the
    # given iterations, raising when they differ (collective; None: not asked).
    weight_hashes: Optional[Callable[[int, Callable[[str], None]], None]] = None
    model: Optional[ModelConfig] = None


def run_iterations(parts: LoopParts, run: TrainingRun, stream: TextIO,
                   on_iteration: Optional[Callable[[int, StepResult], None]] = None) -> TrainingRun:
    """Train from ``run.start_iteration`` up to ``--train-iters`` (or ``--exit-interval``), filling
    ``run``; closes the stepper whatever happens."""
    cfg, info = parts.cfg, parts.info
    logging_rank = info.is_last_stage and info.dp_rank == 0 and info.tp_rank == 0
    logger = None
    gc_was_enabled = None
    signals = None
    where = "start-up"  # what the loop was doing, for a lost peer's line
    try:
        if cfg.exit_signal is not None:  # --exit-signal-handler
            signals = ExitSignal(cfg.exit_signal, info.device).install()
        evaluator = parts.make_evaluator()
        if evaluator is not None and cfg.exit_duration_in_mins:
            # As Megatron-LM's evaluate(): the limit is checked after every evaluation batch too.
            evaluator.time_up = lambda: exit_duration_reached(cfg.exit_duration_in_mins, parts.started_s,
                                                              info.device) is not None
        logger = TrainingLogger(cfg.train_iters, cfg.global_batch_size, cfg.log_interval,
                                is_logging_rank=logging_rank, tensorboard_dir=cfg.tensorboard_dir, stream=stream,
                                flops_model=parts.model if cfg.log_throughput else None, world_size=info.world_size,
                                tensorboard=cfg.tensorboard,
                                consumed_samples=run.consumed_samples)
        last = cfg.last_iteration(run.start_iteration)
        if run.start_iteration >= cfg.train_iters:
            # Megatron-LM trains no iteration then and still evaluates; so does this loop (the
            # DynaPipe loader was told to plan none).
            print_rank_0(info, stream, run.checkpoint_lines,
                         f"checkpoint at iteration {run.start_iteration} has reached --train-iters "
                         f"{cfg.train_iters}: nothing to train (raise --train-iters to train further)")
        started = time.perf_counter()
        on_gpu = info.device.type == "cuda"
        if on_gpu:
            reset_cuda_peaks(info.device)
        memory_reported = not on_gpu
        gc_was_enabled = cfg.manual_gc.start()
        # A checkpoint past --train-iters trains nothing and stays at its own iteration, which
        # the final evaluation is labelled with and reads the validation stream from (Megatron-LM's
        # loop leaves its iteration there too).
        # exit_line: what rank 0 prints when --exit-duration-in-mins or the exit signal ended the run.
        stop, saved_at, exit_line = max(last, run.start_iteration), None, None
        ended_skipped = False
        hash_log = partial(print_rank_0, info, stream, [])
        if parts.weight_hashes is not None:  # as Megatron-LM: once before the first iteration
            with logger.paused():  # not iteration time, as an evaluation is not
                parts.weight_hashes(run.start_iteration, hash_log)
        for iteration in range(run.start_iteration, last):
            where = f"iteration {iteration + 1}"
            ended_skipped = iteration + 1 in cfg.iterations_to_skip
            if ended_skipped:
                # Megatron-LM's --iterations-to-skip: the batch is consumed, nothing is trained,
                # logged, evaluated or saved at it (its loop continues past all of them).
                run.consumed_samples = parts.stepper.skip(iteration)
                logger.skip(run.consumed_samples)
                run.skipped_iterations.append(iteration + 1)
                continue
            result = parts.stepper.step(iteration)
            if result.stop is not None:
                _end_on_rejected_result(parts, run, iteration, result.stop, saved_at, logger)
            result.loss_scale = float(parts.optimizer.get_loss_scale())
            if parts.params_norm is not None:
                result.params_norm = parts.params_norm()
            run.consumed_samples = result.consumed_samples
            if parts.model is not None and result.executed_work is not None:
                run.flops_so_far += model_flops(parts.model, result.executed_work)
            run.results.append(result)
            line = logger.record(iteration + 1, run.consumed_samples, result, current_lr(parts.optimizer))
            if line is not None:
                run.log_lines.append(line)
                if not memory_reported:
                    # Megatron-LM's report_memory, from the first replica: after the first interval,
                    # and the next when that one ended at the run's first iteration (whose optimizer
                    # step allocates the optimizer's states).
                    memory_reported = iteration + 1 > run.start_iteration + 1
                    if info.dp_rank == 0:
                        write_line(stream, memory_report_line(info.rank, iteration + 1, cuda_memory_mib(info.device)))
            if on_iteration is not None:
                on_iteration(iteration, result)
            done = iteration + 1
            cfg.manual_gc.after_iteration(done)
            # As Megatron-LM's interval timer: evaluation and checkpoints are not iteration time.
            with logger.paused():
                if evaluator is not None:
                    evaluator.after_iteration(done, stream, logging_rank, run.eval_lines, logger.writer,
                                              run.consumed_samples)
                if parts.weight_hashes is not None and done % cfg.weight_hash_interval == 0:
                    parts.weight_hashes(done, hash_log)
                if signals is not None and signals.received():
                    # As Megatron-LM: before the interval's save; the checkpoint is saved below.
                    stop, exit_line = done, exit_signal_line(signals.name, done)
                    break
                np_interval = cfg.non_persistent.save_interval
                if cfg.save and cfg.save_interval and done % cfg.save_interval == 0 and done != last:
                    parts.save(done, run.consumed_samples, run.flops_so_far)
                    saved_at = done
                elif cfg.save and np_interval and done % np_interval == 0 and done != last:
                    # As Megatron-LM: where no persistent save falls; the run's last is persistent.
                    parts.save(done, run.consumed_samples, run.flops_so_far, persistent=False)
            elapsed_min = exit_duration_reached(cfg.exit_duration_in_mins, parts.started_s, info.device)
            if elapsed_min is not None:
                # The time trained, read now; printed after the final save, as Megatron-LM does (a
                # save that fails must not follow a line saying the program is exiting).
                stop, exit_line = done, exit_duration_line(cfg.exit_duration_in_mins, elapsed_min, done)
                break
        where = f"after iteration {stop}"
        if ended_skipped and stop >= cfg.train_iters:
            # --train-iters' iteration, which always logs, was skipped (--iterations-to-skip): the
            # interval it would have closed is logged at the last trained iteration.
            line = logger.flush(current_lr(parts.optimizer))
            if line is not None:
                run.log_lines.append(line)
        if on_gpu:
            run.cuda_memory_mib = cuda_memory_mib(info.device)
        if cfg.save and stop > run.start_iteration and saved_at != stop:
            with logger.paused():
                parts.save(stop, run.consumed_samples, run.flops_so_far)
        if exit_line is not None:
            print_rank_0(info, stream, [], exit_line)
        # Megatron-LM exits at a multiple of --exit-interval, the last iteration included, after
        # --exit-duration-in-mins and on the exit signal: no final evaluation then, and no
        # "training is done".
        exited = exit_line is not None or bool(cfg.exit_interval and stop > run.start_iteration
                                     and stop % cfg.exit_interval == 0 and stop not in cfg.iterations_to_skip)
        if logger.is_logging_rank:  # after its own last iteration line (every rank has the same results)
            # Training time: the evaluations and checkpoints between iterations left out.
            summary = training_summary_lines(run.results, run.start_iteration, run.consumed_samples,
                                             time.perf_counter() - started - logger.paused_total_s, exited=exited,
                                             skipped_iterations=len(run.skipped_iterations),
                                             skipped_samples=logger.skipped_samples)
            stream.write("\n".join(summary[1:] if exit_line is not None else summary) + "\n")
            stream.flush()
        if evaluator is not None and stop >= cfg.train_iters and not exited:
            evaluator.after_training(stop, stream, logging_rank, run.eval_lines, logger.writer, run.consumed_samples)
        if evaluator is not None and evaluator.batches_run:
            # What ran, not what was configured: forward-only plans counted by their runner.
            plans = getattr(evaluator.batch_fn, "plans_run", None)
            run.eval_path = "megatron-forward-only" if plans is None else f"dynapipe-plans:{plans}"
    except BaseException as e:
        # Peers waiting on this rank in their plans (or for its planners' plans) stop now with
        # its cause, not at their timeouts; a step's own failure was published already.
        instead = report_failure(parts.stepper, e, where)
        # Shutting down after a failure must not replace it: a trace or TensorBoard file that
        # cannot be written is told, and the training error (a NaN, a peer's failure) raised.
        _close_quietly(parts.stepper, logger, stream)
        if instead is not None:
            raise instead from e
        # Another rank gone, seen in any collective of the loop (megatron-core's schedule, the
        # parameter norm, evaluation, a checkpoint): one line, not the backend's traceback.
        lost = peer_lost(e, where)
        if lost is not None:
            raise lost from None
        raise
    finally:
        if gc_was_enabled is not None:
            cfg.manual_gc.stop(gc_was_enabled)
        if signals is not None:
            signals.release()
    parts.stepper.close()
    if logger is not None:
        logger.close()
    return run


def _end_on_rejected_result(parts: LoopParts, run: TrainingRun, iteration: int, verdict, saved_at: Optional[int],
                            logger) -> None:
    """End the run on a rejected result (:mod:`megatron_integration.rerun`): save the weights
    from before ``iteration`` (0-based: ``iteration`` iterations done) when the verdict asks and
    ``--save`` is given, with the verdict's record, then raise its :class:`RerunExit`."""
    from megatron_integration.rerun import RerunExit
    from megatron_integration.rerun_record import write_record

    cfg, info = parts.cfg, parts.info
    saved = ""
    if verdict.checkpoint and cfg.save:
        with logger.paused():
            if saved_at != iteration:
                parts.save(iteration, run.consumed_samples, run.flops_so_far)
            saved = f" The weights from before it are saved: --save {cfg.save}, iteration {iteration}"
            if verdict.record is not None:
                saved += f", with the record {write_record(cfg.save, iteration, verdict.record, info.rank)}"
            saved += "."
    elif verdict.checkpoint:
        saved = " No checkpoint holds the weights from before it: --save was not given."
    raise RerunExit(f"{verdict.message}{saved} (exit status {verdict.exit_code})", verdict.exit_code)


def _close_quietly(stepper, logger, stream: TextIO) -> None:
    for what, close in (("the stepper", stepper.close), ("the logger", logger.close if logger else None)):
        if close is None:
            continue
        try:
            close()
        except Exception as e:  # noqa: BLE001 - secondary to the error being raised
            stream.write(f"warning: closing {what} after the failure failed too: {type(e).__name__}: {e}\n")
