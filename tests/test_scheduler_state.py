"""Resuming with another learning-rate schedule: refused as Megatron-LM refuses it, unless a flag says
which schedule wins (megatron-core's OptimizerParamScheduler, this project's one-line error)."""
import pytest
import torch

from dynapipe.errors import DynaPipeError
from megatron_integration.arguments import parse_training_args
from megatron_integration.scheduler_state import load_scheduler_state

BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 128 --micro-batch-size 2 "
        "--global-batch-size 8 --lr 1e-3 --mock-data")


def _scheduler(decay_steps: int, **flags):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)
    return OptimizerParamScheduler(opt, init_lr=0.0, max_lr=1e-3, min_lr=1e-4, lr_warmup_steps=0,
                                   lr_decay_steps=decay_steps, lr_decay_style="linear", start_wd=0.01, end_wd=0.01,
                                   wd_incr_steps=decay_steps, wd_incr_style="constant", **flags)


def test_a_different_schedule_is_refused_unless_a_flag_picks_one():
    saved = _scheduler(10).state_dict()
    with pytest.raises(DynaPipeError, match=r"ckpt/iter_0000002: the checkpoint's learning-rate schedule differs "
                                            r".*20 and checkpoint value 10.*--override-opt_param-scheduler"):
        load_scheduler_state(_scheduler(20, override_opt_param_scheduler=False,
                                        use_checkpoint_opt_param_scheduler=False), saved, "ckpt/iter_0000002")
    same = _scheduler(10, override_opt_param_scheduler=False, use_checkpoint_opt_param_scheduler=False)
    load_scheduler_state(same, saved, "ckpt")  # the same schedule loads
    ours = _scheduler(20, override_opt_param_scheduler=True, use_checkpoint_opt_param_scheduler=False)
    load_scheduler_state(ours, saved, "ckpt")
    assert ours.lr_decay_steps == 20
    theirs = _scheduler(20, override_opt_param_scheduler=False, use_checkpoint_opt_param_scheduler=True)
    load_scheduler_state(theirs, saved, "ckpt")
    assert theirs.lr_decay_steps == 10


def test_scheduler_flags_reach_the_optimizer_config():
    o = parse_training_args(f"{BASE} --train-iters 4".split(), 1).optimizer
    assert (o.override_scheduler, o.use_checkpoint_scheduler) == (False, False)  # Megatron-LM's defaults
    o = parse_training_args(f"{BASE} --train-iters 4 --override-opt_param-scheduler".split(), 1).optimizer
    assert o.override_scheduler and not o.use_checkpoint_scheduler
    with pytest.raises(DynaPipeError, match="contradict each other"):
        parse_training_args(f"{BASE} --train-iters 4 --override-opt_param-scheduler "
                            f"--use-checkpoint-opt_param-scheduler".split(), 1)
