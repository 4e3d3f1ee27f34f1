"""Evaluation without processes: forward-only plans, Megatron's validation lines and flags.

The PP2 runs (DynaPipe and padding validation losses equal, training untouched) are in
tests/test_megatron_dynapipe.py, sharing that module's spawned jobs.
"""
import re

import numpy as np
import pytest

from dynapipe.config import load_device_config, load_model_config
from dynapipe.cost import build_cost_model
from dynapipe.errors import DynaPipeError
from dynapipe.plan import compile_plans, serialize_plan, deserialize_plan
from dynapipe.plan.forward_only import forward_only
from dynapipe.plan.instructions import (BackwardPass, ForwardPass, FreeBuffer, RecvActivationStart, RecvGradStart,
                                        SendActivationStart, SendGradStart)
from dynapipe.plan.validate import validate_plans
from dynapipe.runtime.plan_check import check_plan_locally
from megatron_integration.arguments import UNSUPPORTED_MEGATRON_FLAGS, parse_training_args
from megatron_integration.evaluation import EvalResult, valid_first_batch, validation_lines
from plan_helpers import chunked_micro_batches

BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --micro-batch-size 2 "
        "--global-batch-size 8 --train-iters 10 --lr 1e-3 --mock-data")


@pytest.mark.parametrize("schedule", ["1f1b", "adaptive"])
def test_forward_only_plans_keep_forwards_and_activation_order(schedule):
    model = load_model_config("gpt-tiny")
    lengths = np.random.default_rng(3).integers(8, 200, size=23)
    mbs = chunked_micro_batches(lengths, 3)
    cm = build_cost_model(model, load_device_config("cpu"), 3)
    train = compile_plans(schedule, mbs, model, num_stages=3, cost_model=cm)
    plans = [forward_only(p) for p in train]
    validate_plans(plans)  # send/receive pairing, per-pair order, buffers, symbolic deadlock-free run
    for s, (p, t) in enumerate(zip(plans, train)):
        check_plan_locally(p, stage=s, num_stages=3)
        assert p.meta["forward_only"] and not any(
            isinstance(x, (BackwardPass, SendGradStart, RecvGradStart)) for x in p.instructions)
        assert not any(isinstance(x, FreeBuffer) and x.buffer.startswith("grad") for x in p.instructions)
        # Every forward and activation transfer of the training plan, in the same order.
        keep = (ForwardPass, SendActivationStart, RecvActivationStart)
        assert [x for x in p.instructions if isinstance(x, keep)] == [x for x in t.instructions if isinstance(x, keep)]
        assert sum(isinstance(x, ForwardPass) for x in p.instructions) == len(mbs)
        assert deserialize_plan(serialize_plan(p)).instructions == p.instructions


def test_validation_lines_are_megatrons():
    lines = validation_lines("iteration 10", EvalResult(5.123456789, 100))
    assert lines[1] == " validation loss at iteration 10 | lm loss value: 5.123457E+00 | lm loss PPL: 1.679148E+02 | "
    assert lines[0] == lines[2] == "-" * (len(lines[1]) + 1)
    assert EvalResult(30.0, 1).ppl == pytest.approx(np.exp(20.0))  # Megatron caps the exponent at 20
    assert validation_lines("iteration 7 on test set", EvalResult(1.0, 1))[1].startswith(
        " validation loss at iteration 7 on test set | ")


def test_validation_stream_position():
    # Periodic evaluations at 2, 4, 6 read batches 0-2, 3-5, 6-8; the final one after 7 goes on at 9.
    assert [valid_first_batch(i, 2, 3) for i in (2, 4, 6)] == [0, 3, 6]
    assert valid_first_batch(7, 2, 3, final=True) == 9 and valid_first_batch(6, 2, 3, final=True) == 9
    assert valid_first_batch(7, None, 3, final=True) == 0


def test_eval_flags_megatron_defaults_and_errors():
    cfg = parse_training_args(BASE.split(), 1, cuda=False)
    assert (cfg.evaluation.eval_iters, cfg.evaluation.eval_interval) == (100, None)
    cfg = parse_training_args(f"{BASE} --split 80,10,10 --eval-iters 5 --eval-interval 3".split(), 1, cuda=False)
    assert (cfg.evaluation.eval_iters, cfg.evaluation.eval_interval) == (5, 3)
    # Evaluation flags for a run with nothing to evaluate on are refused, not dropped.
    for extra, needle in (("--eval-interval 3", "--eval-interval 3: this run has no validation set to evaluate "
                                                "(--mock-data without --split"),
                          ("--eval-iters 5", "--eval-iters 5: this run has no validation or test set"),
                          ("--split 90,0,10 --eval-interval 3", "--split '90,0,10' leaves it no share")):
        with pytest.raises(DynaPipeError, match=re.escape(needle)):
            parse_training_args(f"{BASE} {extra}".split(), 1, cuda=False)
    assert parse_training_args(f"{BASE} --split 90,0,10 --eval-iters 3".split(), 1, cuda=False).evaluation.eval_iters == 3
    assert parse_training_args(f"{BASE} --eval-iters 0".split(), 1, cuda=False).evaluation.eval_iters == 0
    # An interval with evaluation off would be dropped without a word (as Megatron-LM drops it).
    with pytest.raises(DynaPipeError, match=r"--eval-interval 1 with --eval-iters 0: evaluation is off"):
        parse_training_args(f"{BASE} --split 80,10,10 --eval-iters 0 --eval-interval 1".split(), 1, cuda=False)
    for extra, needle in (("--eval-iters -1", "--eval-iters -1"), ("--eval-interval 0", "--eval-interval 0")):
        with pytest.raises(DynaPipeError, match=needle):
            parse_training_args(f"{BASE} {extra}".split(), 1, cuda=False)
    assert "--eval-iters" not in UNSUPPORTED_MEGATRON_FLAGS and "--eval-interval" not in UNSUPPORTED_MEGATRON_FLAGS


def test_eval_interval_without_a_validation_set_asks_for_one_even_with_a_test_set(tmp_path):
    # Only the validation set is evaluated during training: a --test-data-path does not help.
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    for p in (a, b):
        p.write_text('{"text": "one two three"}\n' * 4)
    argv = BASE.replace("--mock-data", f"--train-data-path {a} --test-data-path {b}").split()
    with pytest.raises(DynaPipeError, match=re.escape("--eval-interval 2: this run has no validation set to evaluate "
                                                      "(--train-data-path without --valid-data-path); add "
                                                      "--valid-data-path or drop --eval-interval")):
        parse_training_args(argv + ["--eval-interval", "2"], 1, cuda=False)
    assert parse_training_args(argv + ["--eval-iters", "2"], 1, cuda=False).evaluation.eval_iters == 2
