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
