"""The training loop's cleanup: closing after a failure never replaces the failure."""
import io
import time

import pytest
import torch

from dynapipe.errors import DynaPipeError
from megatron_integration.arguments import parse_training_args
from megatron_integration.initialize import RankInfo
from megatron_integration.training_loop import LoopParts, TrainingRun, run_iterations

BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 128 --micro-batch-size 2 "
        "--global-batch-size 8 --lr 1e-3 --mock-data --train-iters 3")


class FailingStepper:
    """Fails its first step; its close fails too (as a trace directory that cannot be written)."""

    def __init__(self):
        self.closed = 0

    def step(self, iteration):
        raise DynaPipeError(f"iteration {iteration + 1}: the loss is NaN")

    def close(self):
        self.closed += 1
        raise OSError("No space left on device: 'traces/rank000.json'")


def test_a_failure_survives_a_cleanup_that_fails_too():
    cfg = parse_training_args(BASE.split(), 1, cuda=False)
    info = RankInfo(rank=0, world_size=1, pp_rank=0, pp_size=1, dp_rank=0, dp_size=1, tp_rank=0, tp_size=1,
                    device=torch.device("cpu"))
    stepper, out = FailingStepper(), io.StringIO()
    parts = LoopParts(cfg=cfg, info=info, optimizer=None, stepper=stepper, save=lambda *a: None,
                      make_evaluator=lambda: None, started_s=time.time())
    with pytest.raises(DynaPipeError, match="iteration 1: the loss is NaN"):
        run_iterations(parts, TrainingRun(), out)
    assert stepper.closed == 1
    assert "closing the stepper after the failure failed too: OSError: No space left" in out.getvalue()


class SteadyStepper:
    """Steps that succeed: a fixed loss and batch."""

    def step(self, iteration):
        from megatron_integration.baseline_step import StepResult

        return StepResult(loss=2.0, loss_tokens=100, real_tokens=100, padded_tokens=120, iteration_ms=5.0,
                          consumed_samples=8 * (iteration + 1))

    def close(self):
        pass


class ConstantScaleOptimizer:
    param_groups = [{"lr": 1e-3}]

    def get_loss_scale(self):
        return 1.0


@pytest.mark.parametrize("device, dp_rank, interval, reports", [
    ("cuda", 0, 1, [1, 2]),  # the first interval ends at the first iteration: the second reports too
    ("cuda", 0, 2, [2]),
    ("cuda", 1, 1, []),      # only the first replica reports, as Megatron-LM's report_memory
    ("cpu", 0, 1, []),       # no allocator to report
])
def test_the_gpu_memory_report_comes_where_megatron_prints_it(monkeypatch, device, dp_rank, interval, reports):
    import megatron_integration.training_loop as loop

    memory = {"allocated": 10.0, "max_allocated": 30.0, "reserved": 40.0, "max_reserved": 40.0, "device_usage": None}
    monkeypatch.setattr(loop, "cuda_memory_mib", lambda dev: memory)
    monkeypatch.setattr(loop, "reset_cuda_peaks", lambda dev: None)
    cfg = parse_training_args((BASE + f" --log-interval {interval}").split(), 2, cuda=False)
    info = RankInfo(rank=dp_rank, world_size=2, pp_rank=0, pp_size=1, dp_rank=dp_rank, dp_size=2, tp_rank=0,
                    tp_size=1, device=torch.device(device))
    out = io.StringIO()
    parts = LoopParts(cfg=cfg, info=info, optimizer=ConstantScaleOptimizer(), stepper=SteadyStepper(),
                      save=lambda *a: None, make_evaluator=lambda: None, started_s=time.time())
    run = run_iterations(parts, TrainingRun(), out)
    lines = [line for line in out.getvalue().splitlines() if "memory (MB)" in line]
    assert lines == [f"[Rank {dp_rank}] (after {i} iterations) memory (MB) | allocated: 10.0 | max allocated: 30.0 | "
                     f"reserved: 40.0 | max reserved: 40.0" for i in reports]
    assert run.cuda_memory_mib == (memory if device == "cuda" else None)


class RecordingEvaluator:
    """Records when the loop evaluates: after iterations, and at the end of training."""

    def __init__(self):
        self.calls, self.batch_fn, self.batches_run = [], None, 0

    def after_iteration(self, done, *args):
        self.calls.append(("iteration", done))

    def after_training(self, stop, *args):
        self.calls.append(("end", stop))


class SignallingStepper(SteadyStepper):
    """Steady steps; sends this process ``sig`` during step ``at`` (0-based)."""

    def __init__(self, sig, at):
        self.sig, self.at = sig, at

    def step(self, iteration):
        import os

        if iteration == self.at:
            os.kill(os.getpid(), self.sig)
        return super().step(iteration)


def test_the_exit_signal_stops_after_the_iterations_evaluation_and_saves_once(tmp_path):
    import signal

    # --train-iters 3, a save and an evaluation every iteration; the signal in the last one: its
    # evaluation runs, then the run saves at 3 once (not the interval's save and the final one),
    # prints the line and skips the evaluation at the end of training.
    cfg = parse_training_args((BASE + f" --exit-signal-handler --exit-signal SIGUSR1 --save {tmp_path} "
                               "--save-interval 1").split(), 1, cuda=False)
    info = RankInfo(rank=0, world_size=1, pp_rank=0, pp_size=1, dp_rank=0, dp_size=1, tp_rank=0, tp_size=1,
                    device=torch.device("cpu"))
    saves, evaluator, out = [], RecordingEvaluator(), io.StringIO()
    before = signal.getsignal(signal.SIGUSR1)
    parts = LoopParts(cfg=cfg, info=info, optimizer=ConstantScaleOptimizer(), stepper=SignallingStepper(
        signal.SIGUSR1, 2), save=lambda it, *a: saves.append(it), make_evaluator=lambda: evaluator,
        started_s=time.time())
    run = run_iterations(parts, TrainingRun(), out)
    assert len(run.results) == 3 and saves == [1, 2, 3]
    assert evaluator.calls == [("iteration", 1), ("iteration", 2), ("iteration", 3)]
    assert "exiting program after receiving SIGUSR1, after iteration 3" in out.getvalue()
    assert signal.getsignal(signal.SIGUSR1) is before  # the handler released
    # Signalled in the first of three: it stops there, and the interval's save is the only one.
    saves.clear()
    parts.stepper = SignallingStepper(signal.SIGUSR1, 0)
    run = run_iterations(parts, TrainingRun(), io.StringIO())
    assert len(run.results) == 1 and saves == [1]


def test_the_exit_signal_handler_is_released_when_the_loop_fails():
    import signal

    cfg = parse_training_args((BASE + " --exit-signal-handler --exit-signal SIGUSR2").split(), 1, cuda=False)
    info = RankInfo(rank=0, world_size=1, pp_rank=0, pp_size=1, dp_rank=0, dp_size=1, tp_rank=0, tp_size=1,
                    device=torch.device("cpu"))
    before = signal.getsignal(signal.SIGUSR2)
    parts = LoopParts(cfg=cfg, info=info, optimizer=None, stepper=FailingStepper(), save=lambda *a: None,
                      make_evaluator=lambda: None, started_s=time.time())
    with pytest.raises(DynaPipeError, match="iteration 1: the loss is NaN"):
        run_iterations(parts, TrainingRun(), io.StringIO())
    assert signal.getsignal(signal.SIGUSR2) is before


def test_non_persistent_saves_fall_between_the_persistent_ones_and_never_on_the_last(tmp_path):
    cfg = parse_training_args((BASE + f" --train-iters 5 --save {tmp_path} --save-interval 2 "
                               "--non-persistent-save-interval 1 --non-persistent-ckpt-type global").split(), 1,
                              cuda=False)
    info = RankInfo(rank=0, world_size=1, pp_rank=0, pp_size=1, dp_rank=0, dp_size=1, tp_rank=0, tp_size=1,
                    device=torch.device("cpu"))
    saves = []
    parts = LoopParts(cfg=cfg, info=info, optimizer=ConstantScaleOptimizer(), stepper=SteadyStepper(),
                      save=lambda it, c, f, persistent=True: saves.append((it, persistent)),
                      make_evaluator=lambda: None, started_s=time.time())
    run_iterations(parts, TrainingRun(), io.StringIO())
    assert saves == [(1, False), (2, True), (3, False), (4, True), (5, True)]
