"""Baselines: padded token counts, packing rows and crossing pairs, token budgets, shared pricing."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynapipe.batching import plan_micro_batches
from dynapipe.batching.baselines import cross_sample_attention_pairs
from dynapipe.config import load_device_config, load_model_config
from dynapipe.cost import build_cost_model
from dynapipe.errors import DynaPipeError

A100 = load_device_config("a100-40gb")
CM = build_cost_model(load_model_config("gpt-7b"), A100, 8)
T5 = build_cost_model(load_model_config("t5-11b"), A100, 8)
LENGTHS = np.array([100, 7, 2048, 513, 64, 1000, 9, 300, 1500])


def _padded(plan):
    return sum(mb.padded_tokens for mb in plan.micro_batches)


def _round8(x):
    return -(-int(x) // 8) * 8


def test_padding_pads_every_sample_to_seq_length():
    plan = plan_micro_batches(LENGTHS, CM, method="padding", micro_batch_size=4, seq_length=2048)
    assert [mb.samples for mb in plan.micro_batches] == [[0, 1, 2, 3], [4, 5, 6, 7], [8]]
    assert all(mb.seqlen == 2048 for mb in plan.micro_batches)
    assert _padded(plan) == 9 * 2048
    assert plan.padding_efficiency == pytest.approx(LENGTHS.sum() / (9 * 2048))


def test_padding_mb_pads_to_each_micro_batch_longest():
    plan = plan_micro_batches(LENGTHS, CM, method="padding-mb", micro_batch_size=3, seq_length=2048)
    expect = [3 * _round8(LENGTHS[s:s + 3].max()) for s in range(0, 9, 3)]
    assert [mb.padded_tokens for mb in plan.micro_batches] == expect
    assert [mb.seqlen for mb in plan.micro_batches] == [2048, 1000, 1504]


def test_padding_never_exceeds_seq_length_when_rounding():
    plan = plan_micro_batches([1001, 5], CM, method="padding-mb", micro_batch_size=2, seq_length=1001)
    assert plan.micro_batches[0].seqlen == 1001


def test_packing_rows_fit_and_hold_every_sample_once():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 2049, size=300)
    plan = plan_micro_batches(lengths, CM, method="packing", micro_batch_size=2, seq_length=2048)
    rows = [r for mb in plan.micro_batches for r in mb.rows]
    assert sorted(i for r in rows for i in r) == list(range(300))
    assert all(lengths[r].sum() <= 2048 for r in rows)
    assert all(len(mb.rows) <= 2 and mb.seqlen == 2048 for mb in plan.micro_batches)
    assert _padded(plan) == len(rows) * 2048
    # Best-fit decreasing needs no more rows than twice the lower bound.
    assert len(rows) <= 2 * np.ceil(lengths.sum() / 2048)
    assert plan.extra["cross_sample_attention_pairs"] == cross_sample_attention_pairs(lengths, rows)


def test_packing_json_lists_rows():
    plan = plan_micro_batches([1000, 1000, 48], CM, method="packing", micro_batch_size=1, seq_length=2048)
    js = [mb.to_json()["samples"] for mb in plan.micro_batches]
    assert js == [[[0, 1, 2]]]


def test_cross_sample_pairs_by_hand():
    # One row holding samples of 3 and 5 tokens (causal): the 5 later tokens each see 3 earlier ones.
    assert cross_sample_attention_pairs(np.array([3, 5]), [[0, 1]]) == 15
    assert cross_sample_attention_pairs(np.array([3, 5, 2]), [[0, 1, 2]]) == 3 * 5 + 3 * 2 + 5 * 2
    assert cross_sample_attention_pairs(np.array([3, 5]), [[0], [1]]) == 0
    # Encoder-decoder: bidirectional on inputs (both directions), causal on targets, and each
    # target token's cross-attention over the other sample's inputs (1 x 5 + 2 x 3).
    assert cross_sample_attention_pairs(np.array([[3, 1], [5, 2]]), [[0, 1]]) == 2 * 15 + 2 + 1 * 5 + 2 * 3
    assert cross_sample_attention_pairs(np.array([[3, 1], [5, 2]]), [[0], [1]]) == 0


@settings(max_examples=30, deadline=None)
@given(lengths=st.lists(st.integers(1, 2048), min_size=1, max_size=60), budget=st.sampled_from([2048, 4096, 8192]))
def test_token_budget_respects_budget_and_order(lengths, budget):
    lengths = np.array(lengths)
    plan = plan_micro_batches(lengths, CM, method="token-budget", max_tokens=budget, seq_length=2048)
    assert all(mb.padded_tokens <= budget for mb in plan.micro_batches)
    seen = [i for mb in plan.micro_batches for i in mb.samples]
    assert sorted(seen) == list(range(len(lengths)))
    assert list(lengths[seen]) == sorted(lengths)  # sorted, cut greedily
    for a, b in zip(plan.micro_batches, plan.micro_batches[1:]):  # greedy: the next sample did not fit
        assert (len(a.samples) + 1) * max(a.seqlen, _round8(lengths[b.samples[0]])) > budget


def test_token_budget_default_is_micro_batch_size_times_seq_length():
    plan = plan_micro_batches(LENGTHS, CM, method="token-budget", micro_batch_size=2, seq_length=2048)
    assert plan.extra["max_tokens"] == 4096


def test_token_budget_too_small_names_the_sample():
    with pytest.raises(DynaPipeError, match=r"sample 2 .*2048.*max_tokens=1024"):
        plan_micro_batches(LENGTHS, CM, method="token-budget", max_tokens=1024, seq_length=2048)


def test_baselines_priced_by_the_same_cost_model_and_flag_memory():
    plan = plan_micro_batches(LENGTHS, CM, method="padding", micro_batch_size=8, seq_length=2048,
                              memory_limit_mib=A100.memory_mib, reserved_mib=A100.reserved_mib)
    c = CM.stage_cost(8, 2048)
    assert plan.micro_batches[0].time_ms == pytest.approx(float(c.time_ms))
    assert float(c.stored_mib + c.peak_mib) > plan.extra["activation_budget_mib"]
    assert plan.extra["over_memory_micro_batches"] == 1  # 8 x 2048 tokens do not fit; the last, 1 sample, does
    small = plan_micro_batches(LENGTHS, CM, method="padding", micro_batch_size=1, seq_length=2048,
                               memory_limit_mib=A100.memory_mib, reserved_mib=A100.reserved_mib)
    assert small.extra["over_memory_micro_batches"] == 0


def test_dynapipe_beats_or_ties_every_baseline_on_its_objective():
    rng = np.random.default_rng(5)
    lengths = np.minimum(rng.lognormal(5.5, 1.0, size=256).astype(int) + 1, 2048)
    kw = dict(memory_limit_mib=A100.memory_mib, reserved_mib=A100.reserved_mib, seq_length=2048, dp=2)
    dyn = plan_micro_batches(lengths, CM, **kw).objective_ms
    for method in ("padding", "padding-mb", "packing", "token-budget"):
        # Packing changes the samples' shapes (rows), so only compare methods that keep samples whole.
        plan = plan_micro_batches(lengths, CM, method=method, **kw)
        if method != "packing":
            assert dyn <= plan.objective_ms * (1 + 1e-12), method


def test_encoder_decoder_baselines():
    pairs = np.array([[100, 5], [900, 30], [40, 200], [1024, 1]])
    pad = plan_micro_batches(pairs, T5, method="padding", micro_batch_size=2, seq_length=1024)
    assert all(mb.seqlen == 1024 and mb.dec_seqlen == 200 for mb in pad.micro_batches)
    assert _padded(pad) == 4 * (1024 + 200)
    pmb = plan_micro_batches(pairs, T5, method="padding-mb", micro_batch_size=2, seq_length=1024)
    assert [(mb.seqlen, mb.dec_seqlen) for mb in pmb.micro_batches] == [(904, 32), (1024, 200)]
    pack = plan_micro_batches(pairs, T5, method="packing", micro_batch_size=4, seq_length=1024)
    rows = pack.micro_batches[0].rows
    assert all(pairs[r, 0].sum() <= 1024 and pairs[r, 1].sum() <= 1024 for r in rows)
    assert sorted(i for r in rows for i in r) == [0, 1, 2, 3]
    tb = plan_micro_batches(pairs, T5, method="token-budget", max_tokens=2400, seq_length=1024)
    assert all(mb.padded_tokens <= 2400 for mb in tb.micro_batches)
    # Without --max-tokens a micro-batch of one sample holds both its sides: micro-batch size 1
    # takes the pair of 1,024 input and one target token (an input-side-only default refused it).
    one = plan_micro_batches(pairs, T5, method="token-budget", micro_batch_size=1, seq_length=1024)
    assert one.extra["max_tokens"] == 2048 and all(mb.padded_tokens <= 2048 for mb in one.micro_batches)
    assert sorted(i for mb in one.micro_batches for i in mb.samples) == [0, 1, 2, 3]
