"""Encoder-decoder length limits of each side: ``seq_length=(input, target)`` truncates and pads
each side at its own limit, as Megatron's ``--encoder-seq-length`` / ``--decoder-seq-length``."""
from __future__ import annotations

import numpy as np
import pytest

from dynapipe.batching import plan_micro_batches
from dynapipe.config import load_device_config, load_model_config
from dynapipe.cost import build_cost_model
from dynapipe.errors import DynaPipeError
from dynapipe.pipeline_planner import plan_iteration
from megatron_integration.t5_batches import pack_pairs

H100 = load_device_config("h100-80gb")
T5 = build_cost_model(load_model_config("t5-11b"), H100, 8)
GPT = build_cost_model(load_model_config("gpt-7b"), H100, 8)
# Targets of 97..100 tokens: rounding to a multiple of 8 would pad them to 104, past a 100 limit.
PAIRS = np.array([[300, 40], [120, 97], [500, 130], [64, 8], [20, 99], [256, 100]])


def test_each_side_is_truncated_at_its_own_limit():
    plan = plan_micro_batches(PAIRS, T5, seq_length=(256, 100))
    assert plan.extra["seq_length"] == 256 and plan.extra["dec_seq_length"] == 100
    assert plan.extra["truncated_samples"] == 2  # (300, 40) on its input, (500, 130) on both sides
    real = np.minimum(PAIRS, [256, 100]).sum()
    assert sum(mb.real_tokens for mb in plan.micro_batches) == real


@pytest.mark.parametrize("method", ["dynapipe", "padding-mb", "token-budget"])
def test_padding_stops_at_each_side_limit(method):
    kw = {} if method == "dynapipe" else {"micro_batch_size": 2}
    plan = plan_micro_batches(PAIRS, T5, method=method, seq_length=(256, 100), **kw)
    assert max(mb.dec_seqlen for mb in plan.micro_batches) == 100
    assert max(mb.seqlen for mb in plan.micro_batches) == 256
    # One limit for both sides keeps padding targets to a multiple of 8 up to it.
    one = plan_micro_batches(PAIRS, T5, method=method, seq_length=256, **kw)
    assert max(mb.dec_seqlen for mb in one.micro_batches) == 136


def test_padding_and_packing_pad_targets_to_the_given_target_limit():
    pad = plan_micro_batches(PAIRS, T5, method="padding", micro_batch_size=2, seq_length=(256, 128))
    assert {(mb.seqlen, mb.dec_seqlen) for mb in pad.micro_batches} == {(256, 128)}
    # Without a target limit of its own the decoder side is padded to the longest target.
    pad_one = plan_micro_batches(np.minimum(PAIRS, 128), T5, method="padding", micro_batch_size=2, seq_length=256)
    assert {mb.dec_seqlen for mb in pad_one.micro_batches} == {128}
    short = plan_micro_batches(PAIRS[:2], T5, method="padding", micro_batch_size=2, seq_length=256)
    assert short.micro_batches[0].dec_seqlen == 104
    pack = plan_micro_batches(PAIRS, T5, method="packing", micro_batch_size=1, seq_length=(320, 104))
    assert {(mb.seqlen, mb.dec_seqlen) for mb in pack.micro_batches} == {(320, 104)}


def test_packing_rows_hold_each_side_limit_and_match_the_training_baseline():
    rng = np.random.default_rng(3)
    pairs = np.stack([rng.integers(1, 400, 200), rng.integers(1, 120, 200)], axis=1)
    plan = plan_micro_batches(pairs, T5, method="packing", micro_batch_size=1, seq_length=(400, 120))
    rows = [r for mb in plan.micro_batches for r in mb.rows]
    assert sorted(i for r in rows for i in r) == list(range(200))
    assert all(pairs[r, 0].sum() <= 400 and pairs[r, 1].sum() <= 120 for r in rows)
    # The training script's packing (scripts/pretrain_t5.py) forms the same rows.
    assert sorted(rows) == sorted(pack_pairs(pairs, 400, 120))
    # A target side of its own packs more rows than targets at the input's capacity would.
    wide = plan_micro_batches(pairs, T5, method="packing", micro_batch_size=1, seq_length=400)
    assert len(rows) > len([r for mb in wide.micro_batches for r in mb.rows])


def test_a_side_without_a_limit_must_fit_the_model():
    over = np.array([[100, T5.model.max_seq_length + 1]])
    with pytest.raises(DynaPipeError, match=r"pass seq_length\[1\]=4096"):
        plan_micro_batches(over, T5, seq_length=(256, None))
    plan = plan_micro_batches(np.array([[600, 30]]), T5, seq_length=(None, 16))
    assert (plan.micro_batches[0].seqlen, plan.micro_batches[0].dec_seqlen) == (600, 16)


@pytest.mark.parametrize("limit, match", [((256, 0), r"seq_length\[1\]=0"),
                                          ((10 ** 6, 64), r"seq_length\[0\]=1000000 exceeds"),
                                          ((256, 64, 8), "pair of limits")])
def test_bad_limits_are_refused_by_name(limit, match):
    with pytest.raises(DynaPipeError, match=match):
        plan_micro_batches(PAIRS, T5, seq_length=limit)


def test_a_pair_is_refused_for_a_decoder_only_model():
    with pytest.raises(DynaPipeError, match="encoder-decoder models"):
        plan_micro_batches(np.array([100, 200]), GPT, seq_length=(256, 128))


def test_loss_tokens_count_targets_at_their_own_limit():
    it = plan_iteration(PAIRS, T5, seq_length=(256, 100), schedule="1f1b")
    loss = sum(mb.loss_tokens for mb in it.batch_plan.micro_batches)
    assert loss == int(np.minimum(PAIRS[:, 1], 100).sum())
