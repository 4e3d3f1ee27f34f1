"""Simulated method comparison: tuned baselines, lightest recompute, attention share, batches by tokens."""
import numpy as np
import pytest

from dynapipe.config import load_cluster_config, load_device_config, load_model_config
from dynapipe.cost import build_cost_model
from dynapipe.errors import DynaPipeError
from dynapipe.cost.attention_share import attention_share
from dynapipe.method_compare import (METHODS, compare_methods, global_batch_of_tokens,
                                     micro_batch_size_candidates, simulate_method, tune_baseline)


@pytest.fixture(scope="module")
def gpt7b():
    return build_cost_model(load_model_config("gpt-7b"), load_device_config("a100-40gb"), 4)


@pytest.fixture(scope="module")
def batch():
    return global_batch_of_tokens(16384, 3, 2048)


def test_global_batch_stops_before_the_token_budget():
    lengths = global_batch_of_tokens(20000, 5, 1024)
    assert lengths.max() <= 1024 and lengths.sum() <= 20000
    # It stops only when one more sample (at most 1,024 tokens) could cross the budget.
    assert lengths.sum() > 20000 - 1024
    assert np.array_equal(lengths, global_batch_of_tokens(20000, 5, 1024))
    t5 = global_batch_of_tokens(8000, 1, 512, encoder_decoder=True)
    assert t5.ndim == 2 and t5.sum() <= 8000


def test_attention_share_matches_hand_computed_gpt7b():
    m = load_model_config("gpt-7b")
    # Per token: core 4*s*h, linear 8h^2 + 4h*4h = 24h^2; at s = h the share is 4 / 28.
    assert attention_share(m, [(1, 4096)]) == pytest.approx(1 / 7)
    assert attention_share(m, [(3, 4096), (8, 4096)]) == pytest.approx(1 / 7)
    short = attention_share(m, [(16, 256)])
    assert short == pytest.approx(4 * 256 / (4 * 256 + 24 * 4096))
    # Mixed shapes weigh by FLOPs, so the long micro-batch dominates.
    assert short < attention_share(m, [(16, 256), (1, 4096)]) < 1 / 7
    t5 = load_model_config("t5-11b")
    assert 0 < attention_share(t5, [(2, 512, 64)]) < attention_share(t5, [(2, 2048, 256)]) < 1
    # Equal encoder and decoder lengths s, L layers each (attention width a, hidden h, MLP f), per
    # token and layer pair: encoder core 4sa; decoder self- and cross-attention cores 4sa each;
    # linear: two layers' projections and MLPs 2(8ha + 4hf), plus cross-attention's query/output
    # (4ha) and key/value projections of the encoder's tokens (4ha). Share 12sa / (12sa + 24ha + 8hf).
    assert t5.encoder_layers == t5.decoder_layers
    h, a, f = t5.hidden_size, t5.attention_dim, t5.ffn_hidden_size
    for s in (128, 512):
        assert attention_share(t5, [(2, s, s)]) == pytest.approx(12 * s * a / (12 * s * a + 24 * h * a + 8 * h * f))


def test_tune_baseline_keeps_the_fastest_fitting_size(gpt7b, batch):
    c = load_cluster_config("a100-8x")
    tuned = tune_baseline(batch, "packing", gpt7b, seq_length=2048, cluster=c, dp=2)
    fits = [r for r in tuned.sweep if r["fits"]]
    assert len(fits) >= 2, tuned.sweep
    best_row = max(fits, key=lambda r: r["real_tokens_per_s"])
    assert tuned.best.micro_batch_size == best_row["micro_batch_size"]
    assert tuned.best.real_tokens_per_s == pytest.approx(max(r["real_tokens_per_s"] for r in fits), rel=1e-3)
    # Each row is what simulate_method gives for that size alone.
    for row in fits:
        again = simulate_method(batch, "packing", gpt7b, micro_batch_size=row["micro_batch_size"],
                                seq_length=2048, cluster=c, dp=2)
        assert again.iteration_ms == pytest.approx(row["iteration_ms"], abs=1e-2)
    sizes = [r["micro_batch_size"] for r in tuned.sweep]
    assert sizes == sorted(sizes) and sizes[0] == 1
    # The sweep stops at the first size that fits at no recompute level.
    assert all(r["fits"] for r in tuned.sweep[:-1])
    if not tuned.sweep[-1]["fits"]:
        assert "recompute" in tuned.sweep[-1]["reason"]


def test_baseline_takes_the_lightest_recompute_that_fits(gpt7b, batch):
    sim = simulate_method(batch, "padding", gpt7b, micro_batch_size=2, seq_length=2048)
    assert sim.schedule == "1f1b" and len(set(sim.stage_recompute)) == 1
    from dynapipe.cost.base import RECOMPUTE_LEVELS
    from dynapipe.pipeline_planner import plan_iteration

    for lighter in RECOMPUTE_LEVELS[:RECOMPUTE_LEVELS.index(sim.recompute)]:
        with pytest.raises(DynaPipeError):
            plan_iteration(batch, gpt7b, method="padding", schedule="1f1b", recompute=lighter,
                           micro_batch_size=2, seq_length=2048)
    capacity = 40536 - 2048
    assert max(sim.stage_peak_mib) <= capacity


def test_compare_methods_figures(gpt7b, batch):
    res = compare_methods(batch, gpt7b, seq_length=2048, cluster=load_cluster_config("a100-8x"))
    assert list(res) == list(METHODS)
    real = int(np.minimum(batch, 2048).sum())
    for name, tuned in res.items():
        b = tuned.best
        assert b.real_tokens == real and b.padded_tokens >= real
        assert b.real_tokens_per_s == pytest.approx(real / (b.iteration_ms / 1e3))
        assert 0 <= b.bubble_fraction < 1 and len(b.stage_peak_mib) == 4 and b.planning_ms > 0
        assert (b.micro_batch_size is None) == name.startswith("dynapipe")
        assert b.to_json()["method"] == name
    # The search includes 1F1B on the same micro-batches, so it can only be as fast or faster.
    assert res["dynapipe"].best.iteration_ms <= res["dynapipe-1f1b"].best.iteration_ms + 1e-6
    assert res["packing-search"].best.iteration_ms <= res["packing"].best.iteration_ms + 1e-6
    assert res["dynapipe-1f1b"].best.schedule == "1f1b" and res["packing"].best.schedule == "1f1b"
    # Padding to the full length computes the most pad tokens and the largest attention share.
    assert res["padding"].best.padding_efficiency < res["dynapipe"].best.padding_efficiency
    assert res["padding"].best.attention_share > res["dynapipe"].best.attention_share


def test_bad_requests_are_refused(gpt7b, batch):
    with pytest.raises(DynaPipeError, match="zero-bubble"):
        simulate_method(batch, "zero-bubble", gpt7b)
    with pytest.raises(DynaPipeError, match="micro-batch size"):
        simulate_method(batch, "packing", gpt7b)
    with pytest.raises(DynaPipeError, match="no micro-batch size to tune"):
        tune_baseline(batch, "dynapipe", gpt7b)
    with pytest.raises(DynaPipeError, match="no micro-batch size in"):
        tune_baseline(batch, "padding", gpt7b, micro_batch_sizes=[1], seq_length=2048, memory_limit_mib=1000)
    assert micro_batch_size_candidates(batch, "padding") == [2 ** k for k in range(len(batch).bit_length())]
    # Bad input is named as such, not reported as a size that fits in no memory.
    with pytest.raises(DynaPipeError, match="^micro_batch_size=0: must be a whole number"):
        tune_baseline(batch, "padding", gpt7b, micro_batch_sizes=[0, 1, 2], seq_length=2048)
    with pytest.raises(DynaPipeError, match="^seq_length=-5: must be a whole number"):
        simulate_method(batch, "padding", gpt7b, micro_batch_size=1, seq_length=-5)
    with pytest.raises(DynaPipeError, match="reads no micro_batch_size"):
        simulate_method(batch, "dynapipe", gpt7b, micro_batch_size=8)


def test_one_size_is_tuned_for_all_batches(gpt7b):
    from dynapipe.method_compare import compare_over_batches

    batches = [global_batch_of_tokens(16384, s, 2048) for s in (1, 2)]
    res = compare_over_batches(batches, "padding-mb", gpt7b, seq_length=2048)
    fits = [r for r in res.sweep if r["fits"]]
    assert len(fits) >= 2 and len({r.micro_batch_size for r in res.runs}) == 1
    assert res.micro_batch_size == max(fits, key=lambda r: r["real_tokens_per_s"])["micro_batch_size"]
    real = sum(int(np.minimum(b, 2048).sum()) for b in batches)
    assert res.real_tokens_per_s == pytest.approx(real / (sum(r.iteration_ms for r in res.runs) / 1e3))
    single = [simulate_method(b, "padding-mb", gpt7b, micro_batch_size=res.micro_batch_size, seq_length=2048)
              for b in batches]
    assert [r.iteration_ms for r in res.runs] == pytest.approx([s.iteration_ms for s in single])
    dyn = compare_over_batches(batches, "dynapipe", gpt7b, seq_length=2048)
    assert dyn.sweep == [] and len(dyn.runs) == 2 and dyn.summary()["batches"] == 2


def test_the_planning_api_refuses_numbers_it_cannot_use_by_name(gpt7b, batch):
    # Each of these used to give a silently wrong figure (negative model-state MiB at dp -1, a
    # size 0 run as 1 and then chosen as the best) or a long stall (NaN tokens drew 134M samples).
    import time

    from dynapipe.advise import sample_batches
    from dynapipe.schedule.placement import choose_placement_kind

    for dp in (0, -1, 1.5, True):
        with pytest.raises(DynaPipeError, match=f"dp={dp!r}: must be a whole number of at least 1"):
            gpt7b.model_state_mib(dp=dp, zero=True)
    assert gpt7b.model_state_mib(dp=2, zero=True) < gpt7b.model_state_mib(dp=1, zero=True)
    with pytest.raises(DynaPipeError, match="micro_batch_size=0: must be a whole number"):
        simulate_method(batch, "padding", gpt7b, micro_batch_size=0, seq_length=2048)
    with pytest.raises(DynaPipeError, match="micro_batch_size=0: must be a whole number"):
        tune_baseline(batch, "padding", gpt7b, micro_batch_sizes=[0, 2], seq_length=2048)
    start = time.monotonic()
    for tokens in (float("nan"), 1.5, 0):
        with pytest.raises(DynaPipeError, match="tokens=.*: must be a whole number"):
            global_batch_of_tokens(tokens, 0, 2048)
        with pytest.raises(DynaPipeError, match="tokens=.*: must be a whole number"):
            sample_batches(tokens, 1, 0, 2048)
    assert time.monotonic() - start < 5
    with pytest.raises(DynaPipeError, match="schedule 'bogus' is not known"):
        choose_placement_kind([batch], gpt7b, schedule="bogus")
