"""The split backward of zero-bubble plans on megatron-core's linear layers (one spawned rank).

The input part of each micro-batch's backward leaves the linear layers' weight gradients
to the weight part; run later, in any order after their input parts, the parts give the
gradients of the whole backward. Also the store's own refusals.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dynapipe.errors import DynaPipeError
from dynapipe.runtime.weight_grad_store import WeightGradStore
from megatron_integration.launch import spawn

from t5_job import TIMEOUT

ARGS = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
        "--vocab-size 128 --micro-batch-size 1 --global-batch-size 1 --train-iters 1 --lr 1e-4 --mock-data "
        "--hidden-dropout 0 --attention-dropout 0")


def _job() -> dict:
    from megatron_integration.arguments import parse_training_args
    from megatron_integration.initialize import destroy, initialize_megatron
    from megatron_integration.model import build_gpt_stage
    from megatron_integration.split_backward import install_split_backward
    from megatron_integration.train_config import ParallelArgs

    info = initialize_megatron(ParallelArgs(world_size=1, backend="gloo"), seed=3)
    try:
        cfg = parse_training_args(ARGS.split(), 1)
        gpt = build_gpt_stage(cfg, info)
        gen = torch.Generator().manual_seed(0)
        batches = [torch.randint(0, 128, (1, n), generator=gen) for n in (32, 20, 27)]

        def loss(tokens):
            pos = torch.arange(tokens.shape[1]).unsqueeze(0)
            return gpt(tokens, pos, None, labels=tokens).float().sum()

        params = dict(gpt.named_parameters())
        for t in batches:
            loss(t).backward()
        whole = {n: p.grad.clone() for n, p in params.items()}
        gpt.zero_grad(set_to_none=True)

        store = WeightGradStore()
        out = {"layers": install_split_backward([gpt], store)}
        # What megatron-core's DDP sees: its hooks sit on each parameter's gradient accumulator
        # and (with --overlap-grad-reduce) refuse a call without a gradient.
        calls: list[tuple[str, bool]] = []
        accumulators = []
        for n, p in params.items():
            acc = p.expand_as(p).grad_fn.next_functions[0][0]
            acc.register_hook(lambda *_, n=n, p=p: calls.append((n, p.grad is not None)))
            accumulators.append(acc)
        for i, t in enumerate(batches):
            with store.input_part(i):
                loss(t).backward()
        out["after_input"] = {n: p.grad is not None for n, p in params.items()}
        out["input_calls"], calls[:] = list(calls), []
        out["deferred"] = [len(store._pending[i]) for i in range(len(batches))]
        for i in (2, 0, 1):  # weight parts in another order than the input parts
            store.run(i)
        out["weight_calls"] = list(calls)
        del accumulators
        out["close"] = {n: float((p.grad - whole[n]).abs().max()) for n, p in params.items()}
        # Under the activation meter's saved-tensor hooks (every CPU training iteration), with the
        # graph freed after the input part and no DDP keeping the gradient accumulators alive:
        # the weight parts still reach the parameters, and the meter counts what they keep.
        import gc

        from dynapipe.runtime.activation_meter import ActivationMeter

        gpt.zero_grad(set_to_none=True)
        meter = ActivationMeter(exclude=params.values())
        store.meter = meter
        for i, t in enumerate(batches):
            with meter.saving(), store.input_part(i):
                loss(t).backward()
        gc.collect()
        out["meter_pending_mib"] = meter.live_bytes / 2**20
        for i in range(len(batches)):
            store.run(i)
        out["meter_after_mib"] = meter.live_bytes / 2**20
        out["metered_close"] = max(float((p.grad - whole[n]).abs().max()) if p.grad is not None else float("inf")
                                   for n, p in params.items())
        store.meter = None
        # Outside a split backward the layers compute both gradients at once.
        gpt.zero_grad(set_to_none=True)
        for t in batches:
            loss(t).backward()
        out["unsplit"] = {n: bool(torch.equal(p.grad, whole[n])) for n, p in params.items()}
        # An iteration whose plan does not split clears the store's flag: megatron-core's own
        # backward, nothing deferred even inside an input part.
        store.active = False
        gpt.zero_grad(set_to_none=True)
        with store.input_part(9):
            loss(batches[0]).backward()
        out["inactive_deferred"] = store.run(9)
        out["inactive_complete"] = all(p.grad is not None for p in params.values())
        return out
    finally:
        destroy()


@pytest.fixture(scope="module")
def job():
    (res,) = spawn(_job, 1, timeout_s=TIMEOUT, threads_per_rank=1)
    return res


def test_input_part_defers_only_the_linear_weights(job):
    # qkv, proj, fc1, fc2 per layer; the output layer (tied to the word embedding here) keeps
    # its whole backward in the input part.
    assert job["layers"] == 2 * 4
    linear = {n for n in job["after_input"] if n.endswith("weight") and "linear" in n}
    assert len(linear) == 8
    for name, has in job["after_input"].items():
        assert has == (name not in linear), name
    assert job["deferred"] == [8, 8, 8]
    # Each accumulator hook runs once a micro-batch, always with a gradient: the deferred weights'
    # in the weight parts only (never with autograd's empty gradient in the input part).
    input_calls, weight_calls = job["input_calls"], job["weight_calls"]
    assert all(has for _, has in input_calls + weight_calls)
    assert sorted(n for n, _ in input_calls) == sorted([n for n in job["after_input"] if n not in linear] * 3)
    assert sorted(n for n, _ in weight_calls) == sorted(list(linear) * 3)


def test_weight_parts_complete_the_gradients_of_the_whole_backward(job):
    assert max(job["close"].values()) < 1e-6, job["close"]
    assert all(job["unsplit"].values())
    assert job["inactive_deferred"] == 0 and job["inactive_complete"]


def test_weight_parts_reach_the_parameters_under_the_meter_which_counts_what_they_keep(job):
    assert job["metered_close"] < 1e-6
    # Three micro-batches' linear inputs and output gradients (32, 20 and 27 tokens, hidden 64)
    # are held between the parts; nothing after.
    assert job["meter_pending_mib"] > 0.1 and job["meter_after_mib"] == 0


def test_store_refuses_parts_out_of_order():
    store = WeightGradStore()
    with pytest.raises(DynaPipeError, match="before its input part"):
        store.run(0)
    with pytest.raises(DynaPipeError, match="outside a split backward"):
        store.defer(lambda: None)
    ran = []
    with store.input_part(0):
        assert store.deferring
        store.defer(lambda: ran.append(1))
        with pytest.raises(DynaPipeError, match="inside that of 0"):
            with store.input_part(1):
                pass
    with pytest.raises(DynaPipeError, match="ran twice"):
        with store.input_part(0):
            pass
    assert not store.deferring and store.pending == [0]
    assert store.run(0) == 1 and ran == [1] and store.pending == []
    np.testing.assert_equal(store.pending, [])
