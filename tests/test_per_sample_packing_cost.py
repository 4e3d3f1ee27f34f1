"""Packed rows run with per-sample attention, priced: attention densities, the analytic and
profile cost models at a density, the ``packing-per-sample`` batching, and the simulated
comparison that takes it as the strongest packing."""
import json
import subprocess
import sys

import numpy as np
import pytest

from dynapipe.batching import plan_micro_batches
from dynapipe.config import load_cluster_config, load_device_config, load_model_config
from dynapipe.cost import build_cost_model
from dynapipe.cost.analytic import AnalyticCostModel
from dynapipe.cost.attention_density import DENSE, AttentionDensity, packed_density, stack, thin
from dynapipe.cost.base import StageLayout
from dynapipe.cost.profile import ProfileCostModel
from dynapipe.errors import DynaPipeError
from dynapipe.cost.attention_share import attention_share
from dynapipe.method_compare import compare_methods

from test_profile_fixes import _profile
from test_profile_t5 import T5 as T5_TINY
from test_profile_t5 import t5_profile

A100 = load_device_config("a100-40gb")
GPT7B = load_model_config("gpt-7b")
T5_11B = load_model_config("t5-11b")
MIDDLE = StageLayout(1, 0, 4, False, False)
LEVELS = ("none", "selective", "full")


def test_packed_density_counts_the_pairs_inside_samples():
    # Two rows of 8 tokens: [3, 5] and [8]; pairs inside samples 9 + 25 + 64 of 2 x 64.
    d = packed_density(np.array([3, 5, 8]), [[0, 1], [2]], 8)
    assert d.input == pytest.approx((9 + 25 + 64) / 128) and d.target == 1.0 and d.cross == 1.0
    # One sample filling its row is dense.
    assert packed_density(np.array([8]), [[0]], 8).input == 1.0
    # Encoder-decoder: inputs [3, 5] with targets [2, 4] in one row of 8 input and 6 target tokens.
    pairs = np.array([[3, 2], [5, 4]])
    e = packed_density(pairs, [[0, 1]], 8, 6)
    assert (e.input, e.target, e.cross) == pytest.approx(((9 + 25) / 64, (4 + 16) / 36, (6 + 20) / 48))


def test_bad_densities_are_refused_by_name():
    for bad in (0.0, 1.5, float("nan"), -0.1):
        with pytest.raises(DynaPipeError, match="attention density input"):
            AttentionDensity(input=bad)
    with pytest.raises(DynaPipeError, match="truncate samples to the row length"):
        packed_density(np.array([9]), [[0]], 8)
    with pytest.raises(DynaPipeError, match="decoder length"):
        packed_density(np.array([[3, 2]]), [[0]], 8)


def test_stack_fills_dense_micro_batches_and_keeps_none_for_all_dense():
    assert stack([None, None]) is None and stack([]) is None
    s = stack([None, AttentionDensity(0.5, 0.25, 0.125)])
    assert s.input.tolist() == [1.0, 0.5] and s.target.tolist() == [1.0, 0.25] and s.cross.tolist() == [1.0, 0.125]


def test_thin_scales_only_the_attention_share():
    total, share = thin(10.0, 0.4, 0.25)
    assert total == pytest.approx(10 * (0.6 + 0.1)) and share == pytest.approx(1.0 / 7.0)
    assert thin(10.0, 0.4, 1.0)[0] == pytest.approx(10.0)


@pytest.mark.parametrize("level", LEVELS)
def test_analytic_gpt_prices_the_attention_core_and_scores_at_the_density(level):
    cm = AnalyticCostModel(GPT7B, A100, 8)
    b, s = np.float64(2), np.float64(4096)
    dense = cm.layout_cost(MIDDLE, b, s, None, level)
    same = cm.layout_cost(MIDDLE, b, s, None, level, attention=DENSE)
    for f in ("fw_ms", "bw_ms", "stored_mib", "peak_mib"):
        assert float(getattr(same, f)) == pytest.approx(float(getattr(dense, f)))
    half, quarter = (cm.layout_cost(MIDDLE, b, s, None, level, attention=AttentionDensity(r)) for r in (0.5, 0.25))
    # The forward's attention-core time, 4 layers x 4 b s^2 a_d FLOPs at the device's rate and
    # efficiency, falls with the pairs it computes; the linear layers' does not.
    core_ms = 4 * 4 * b * s * s * GPT7B.attention_dim / A100.effective_flops_per_ms / A100.efficiency(b * s)
    assert float(dense.fw_ms - half.fw_ms) == pytest.approx(0.5 * core_ms, rel=1e-9)
    assert float(half.fw_ms - quarter.fw_ms) == pytest.approx(0.25 * core_ms, rel=1e-9)
    if level == "none":
        # 4 layers' stored scores (5 bytes a score at dropout 0.1, n heads) scale alike.
        scores_mib = 4 * 5 * GPT7B.num_attention_heads * b * s * s / 2**20
        assert float(dense.stored_mib - half.stored_mib) == pytest.approx(0.5 * scores_mib, rel=1e-9)
    else:  # no scores stored at these levels
        assert float(half.stored_mib) == pytest.approx(float(dense.stored_mib))


def test_analytic_t5_prices_each_attention_kind_at_its_own_density():
    cm = AnalyticCostModel(T5_11B, A100, 8)
    enc, dec = StageLayout(0, 3, 0, True, False), StageLayout(7, 0, 3, False, True)
    b, s, t = np.float64(1), np.float64(2048), np.float64(512)
    dense = {k: cm.layout_cost(l, b, s, t, "none") for k, l in (("enc", enc), ("dec", dec))}
    target_only = AttentionDensity(input=1.0, target=0.5, cross=1.0)
    # The decoder's self-attention density leaves encoder stages alone, and its input density decoder ones.
    assert float(cm.layout_cost(enc, b, s, t, "none", attention=target_only).fw_ms) == \
        pytest.approx(float(dense["enc"].fw_ms))
    assert float(cm.layout_cost(dec, b, s, t, "none", attention=AttentionDensity(input=0.5)).fw_ms) == \
        pytest.approx(float(dense["dec"].fw_ms))
    ad, rate = T5_11B.attention_dim, A100.effective_flops_per_ms
    self_ms = 3 * 4 * b * t * t * ad / rate / A100.efficiency(b * t)
    cross_ms = 3 * 4 * b * t * s * ad / rate / A100.efficiency(b * t)
    got = dense["dec"].fw_ms - cm.layout_cost(dec, b, s, t, "none", attention=target_only).fw_ms
    assert float(got) == pytest.approx(0.5 * self_ms, rel=1e-9)
    got = dense["dec"].fw_ms - cm.layout_cost(dec, b, s, t, "none", attention=AttentionDensity(cross=0.25)).fw_ms
    assert float(got) == pytest.approx(0.75 * cross_ms, rel=1e-9)


@pytest.mark.parametrize("level", LEVELS)
def test_a_profile_thins_its_measured_layer_by_the_analytic_shares(level):
    tiny = load_model_config("gpt-tiny")
    cm = ProfileCostModel(tiny, _profile(), 2)
    layout = StageLayout(0, 0, 1, False, False)
    b, s = np.float64(2), np.float64(256)
    dense = cm.layout_cost(layout, b, s, None, level)
    same = cm.layout_cost(layout, b, s, None, level, attention=DENSE)
    assert float(same.fw_ms) == pytest.approx(float(dense.fw_ms))
    assert float(same.stored_mib) == pytest.approx(float(dense.stored_mib))
    core_share, score_share = cm._shares(s)
    half = cm.layout_cost(layout, b, s, None, level, attention=AttentionDensity(0.5))
    assert float(half.fw_ms) == pytest.approx(float(dense.fw_ms) * (1 - 0.5 * float(core_share)))
    assert float(half.bw_ms) < float(dense.bw_ms)
    if level == "none":
        assert float(half.stored_mib) == pytest.approx(float(dense.stored_mib) * (1 - 0.5 * float(score_share)))
    else:
        assert float(half.stored_mib) == pytest.approx(float(dense.stored_mib))
    assert float(half.peak_mib) <= float(dense.peak_mib) + 1e-12


def test_a_t5_profile_thins_encoder_and_decoder_layers():
    cm = ProfileCostModel(T5_TINY, t5_profile(), 2)
    enc, dec = StageLayout(0, 2, 0, True, False), StageLayout(1, 0, 2, False, True)
    b, s, t = np.float64(2), np.float64(256), np.float64(64)
    for layout in (enc, dec):
        dense = cm.layout_cost(layout, b, s, t, "none")
        assert float(cm.layout_cost(layout, b, s, t, "none", attention=DENSE).fw_ms) == \
            pytest.approx(float(dense.fw_ms))
        thin_all = cm.layout_cost(layout, b, s, t, "none", attention=AttentionDensity(0.3, 0.3, 0.3))
        assert float(thin_all.fw_ms) < float(dense.fw_ms) and float(thin_all.stored_mib) < float(dense.stored_mib)
    # The encoder's density does not touch decoder layers; the decoder's does not touch the encoder's.
    assert float(cm.layout_cost(dec, b, s, t, "none", attention=AttentionDensity(input=0.3)).fw_ms) == \
        pytest.approx(float(cm.layout_cost(dec, b, s, t, "none").fw_ms))
    assert float(cm.layout_cost(enc, b, s, t, "none", attention=AttentionDensity(1.0, 0.3, 0.3)).fw_ms) == \
        pytest.approx(float(cm.layout_cost(enc, b, s, t, "none").fw_ms))


def test_a_cost_model_that_prices_dense_rows_only_refuses_a_density():
    from test_batching_dp import ToyCost

    from dynapipe.method_compare import compare_over_batches, simulate_method, tune_baseline

    toy = ToyCost(0.0, 0.0, 2)
    with pytest.raises(DynaPipeError, match="dense attention only"):
        toy.stage_cost(1, 128, attention=AttentionDensity(0.5))
    batch = np.array([10, 20, 30, 40, 50, 60, 70, 80])
    assert compare_over_batches([batch], "packing", toy, seq_length=128).real_tokens_per_s > 0
    # Refused by name before any sweep, not reported as a size that does not fit.
    for method in ("packing-per-sample", "packing-search"):
        for call in (lambda: compare_over_batches([batch], method, toy, seq_length=128),
                     lambda: tune_baseline(batch, method, toy, seq_length=128),
                     lambda: simulate_method(batch, method, toy, micro_batch_size=1, seq_length=128)):
            with pytest.raises(DynaPipeError, match="cannot price") as e:
                call()
            assert "fits" not in str(e.value)


@pytest.mark.parametrize("model_name,lengths", [
    ("gpt-7b", np.array([100, 7, 2048, 513, 64, 1000, 9, 300, 1500, 40, 700])),
    ("t5-11b", np.array([[100, 20], [7, 3], [1800, 400], [513, 90], [64, 64], [1000, 10], [300, 120]])),
])
def test_packing_per_sample_forms_packings_rows_and_prices_them_lighter(model_name, lengths):
    cm = build_cost_model(load_model_config(model_name), A100, 8)
    kw = dict(micro_batch_size=2, seq_length=2048)
    masked = plan_micro_batches(lengths, cm, method="packing", **kw)
    per_sample = plan_micro_batches(lengths, cm, method="packing-per-sample", **kw)
    assert per_sample.batching == "packing-per-sample"
    assert [mb.rows for mb in per_sample.micro_batches] == [mb.rows for mb in masked.micro_batches]
    for a, b in zip(masked.micro_batches, per_sample.micro_batches):
        assert a.attention is None
        assert b.attention == packed_density(lengths, b.rows, b.seqlen, b.dec_seqlen)
        assert b.time_ms < a.time_ms and b.stored_mib < a.stored_mib
        assert b.to_json()["attention_density"] == b.attention.to_json()
    # A micro-batch whose rows each hold one sample filling the row is dense, and priced as packing.
    full = np.array([2048, 2048]) if model_name == "gpt-7b" else np.array([[2048, 2048], [2048, 2048]])
    one = plan_micro_batches(full, cm, method="packing-per-sample", micro_batch_size=1, seq_length=2048)
    ref = plan_micro_batches(full, cm, method="packing", micro_batch_size=1, seq_length=2048)
    assert [mb.time_ms for mb in one.micro_batches] == pytest.approx([mb.time_ms for mb in ref.micro_batches])


def test_the_simulated_comparison_prices_per_sample_packing_and_searches_it():
    from dynapipe.method_compare import global_batch_of_tokens

    cm = build_cost_model(GPT7B, A100, 4)
    batch = global_batch_of_tokens(32768, 0, 4096)
    res = compare_methods(batch, cm, methods=("packing", "packing-per-sample", "packing-search"), seq_length=4096,
                          cluster=load_cluster_config("a100-8x"), dp=2, zero=True)
    masked, per_sample, searched = (res[m].best for m in ("packing", "packing-per-sample", "packing-search"))
    assert per_sample.real_tokens_per_s > masked.real_tokens_per_s
    assert searched.iteration_ms <= per_sample.iteration_ms + 1e-6
    # Per-sample rows compute only the samples' own attention: the share is the samples' alone.
    assert per_sample.attention_share < masked.attention_share
    assert searched.attention_share == pytest.approx(per_sample.attention_share)
    plan = plan_micro_batches(batch, cm, method="packing-per-sample", micro_batch_size=per_sample.micro_batch_size,
                              seq_length=4096)
    dens = [mb.attention for mb in plan.micro_batches]
    assert per_sample.attention_share == pytest.approx(attention_share(GPT7B, [(mb.mbs, mb.seqlen) for mb in
                                                                                plan.micro_batches], dens))
    one_each = [(1, int(n)) for n in np.minimum(batch, 4096)]
    core_alone = attention_share(GPT7B, one_each)  # the samples' own attention over their own GEMMs
    assert per_sample.attention_share < core_alone


def test_plan_prints_that_per_sample_rows_compute_no_cross_pairs(tmp_path):
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(str(n) for n in [100, 7, 900, 513, 64, 1000, 9, 300]))
    out = tmp_path / "plan.json"
    r = subprocess.run([sys.executable, "-m", "dynapipe", "plan", "--model", "gpt-7b", "--device", "a100-40gb",
                        "--stages", "4", "--lengths", str(lengths), "--batching", "packing-per-sample",
                        "--micro-batch-size", "2", "--seq-length", "1024", "--output", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "not computed: attention runs per sample" in r.stderr
    plan = json.loads(out.read_text())
    assert plan["batching"] == "packing-per-sample"
    assert all(0 < mb["attention_density"]["input"] <= 1 for mb in plan["micro_batches"])


def test_a_stage_placement_is_priced_on_what_per_sample_rows_compute():
    from dynapipe.cost.placement import PlacementSample, StagePlacement, price_placement

    cm = build_cost_model(T5_11B, A100, 4)
    lengths = np.array([[100, 20], [7, 3], [1800, 400], [513, 90], [64, 64], [1000, 10], [300, 120], [40, 9]])
    plan = plan_micro_batches(lengths, cm, method="packing-per-sample", micro_batch_size=1, seq_length=2048)
    sample = PlacementSample.of(plan.micro_batches)
    assert sample.attention is not None and len(sample.attention.input) == len(plan.micro_batches)
    dense = PlacementSample(sample.mbs, sample.seqlen, sample.dec_seqlen)
    even = StagePlacement.even(T5_11B, 4)
    light, heavy = (price_placement(cm, even, s, capacity_mib=1e9) for s in (sample, dense))
    assert all(a < b for a, b in zip(light.stage_ms, heavy.stage_ms))
    # A packing plan's sample is dense: nothing to scale.
    masked = plan_micro_batches(lengths, cm, method="packing", micro_batch_size=1, seq_length=2048)
    assert PlacementSample.of(masked.micro_batches).attention is None


def test_the_weight_part_of_a_split_backward_grows_as_attention_thins():
    from dynapipe.cost.backward_split import backward_split

    for model, layout, dec in ((GPT7B, MIDDLE, None), (T5_11B, StageLayout(7, 0, 3, False, False), 512.0)):
        dense, _ = backward_split(model, layout, 2.0, 2048.0, dec)
        same, _ = backward_split(model, layout, 2.0, 2048.0, dec, attention=DENSE)
        thinned, stash = backward_split(model, layout, 2.0, 2048.0, dec, attention=AttentionDensity(0.25, 0.25, 0.25))
        # The weight GEMMs are the same; the backward around them shrinks with the attention cores.
        assert float(same) == pytest.approx(float(dense)) and float(thinned) > float(dense)
        assert float(stash) == pytest.approx(float(backward_split(model, layout, 2.0, 2048.0, dec)[1]))


@pytest.mark.parametrize("level", ["selective", "full"])
def test_a_measured_recompute_table_thins_as_the_derived_level_does(level):
    """A profile's measured ``layer_selective``/``layer_full`` table equal to the level derived
    from ``layer`` prices a density as the derived level does: the recomputing backward's
    attention part is the cores' backward and their forward again."""
    tiny = load_model_config("gpt-tiny")
    derived = ProfileCostModel(tiny, _profile(), 2)
    layout = StageLayout(0, 0, 1, False, False)
    from test_profile_fixes import MBS, SEQ

    b, s = (np.asarray(v, dtype=np.float64) for v in np.meshgrid(MBS, SEQ, indexing="ij"))
    at = derived.layout_cost(layout, b, s, None, level)
    prof = _profile()
    prof["ops"][f"layer_{level}"] = {k: np.asarray(getattr(at, k)).tolist()
                                     for k in ("fw_ms", "bw_ms", "stored_mib", "peak_mib")}
    measured = ProfileCostModel(tiny, prof, 2)
    for d in (1.0, 0.25, 0.05):
        x, y = (cm.layout_cost(layout, np.float64(2), np.float64(256), None, level, attention=AttentionDensity(d))
                for cm in (derived, measured))
        assert float(y.bw_ms) == pytest.approx(float(x.bw_ms), rel=1e-9)
        assert float(y.fw_ms) == pytest.approx(float(x.fw_ms), rel=1e-9)


@pytest.mark.parametrize("model_name,lengths", [
    ("gpt-7b", np.array([100, 7, 900, 513, 64, 1000, 9, 300, 35])),
    ("t5-11b", np.array([[100, 20], [7, 3], [900, 400], [513, 90], [64, 64], [1000, 10], [300, 120]])),
])
def test_rounding_for_sequence_parallelism_keeps_the_densities_true_to_the_rows(model_name, lengths):
    from dynapipe.pipeline_planner import round_for_sequence_parallel

    cm = build_cost_model(load_model_config(model_name), A100, 4)
    plan = plan_micro_batches(lengths, cm, method="packing-per-sample", micro_batch_size=1, seq_length=1000)
    rounded = round_for_sequence_parallel(plan, 3, 4096)
    for mb in rounded.micro_batches:
        assert (mb.seqlen, mb.dec_seqlen % 3) == (1002, 0)
        assert mb.attention.to_json() == packed_density(lengths, mb.rows, mb.seqlen, mb.dec_seqlen).to_json()


def test_a_placement_sample_refuses_densities_of_another_length():
    from dynapipe.cost.placement import PlacementSample

    with pytest.raises(DynaPipeError, match=r"attention.input has shape \[2\] for 3 micro-batches"):
        PlacementSample(np.ones(3), np.full(3, 128.0), np.zeros(3), AttentionDensity(np.array([0.5, 0.5])))
    assert PlacementSample(np.ones(3), np.full(3, 128.0), np.zeros(3), AttentionDensity(0.5)).attention.input == 0.5


def test_a_run_that_fixes_schedule_or_recompute_is_simulated_so():
    from dynapipe.method_compare import global_batch_of_tokens, simulate_method

    cm = build_cost_model(GPT7B, A100, 4)
    batch = global_batch_of_tokens(32768, 0, 2048)
    kw = dict(micro_batch_size=1, seq_length=2048, dp=2, zero=True, cluster=load_cluster_config("a100-8x"))
    searched = simulate_method(batch, "packing-search", cm, **kw)
    fixed = simulate_method(batch, "packing-search", cm, schedule="1f1b", recompute="full", **kw)
    assert fixed.schedule == "1f1b" and fixed.recompute == "full"
    assert fixed.iteration_ms >= searched.iteration_ms - 1e-6
    with pytest.raises(DynaPipeError, match="recompute"):
        simulate_method(batch, "packing-search", cm, recompute="most", **kw)


def test_the_bench_judges_per_sample_ops_at_the_density_they_ran(tmp_path):
    from megatron_integration.bench_calibrate import executed_ops

    tiny = load_model_config("gpt-tiny")
    cm = ProfileCostModel(tiny, _profile(), 2)
    events = [{"ph": "X", "cat": "forward", "tid": 0, "ts": 0.0, "dur": 1e3,
               "args": {"iteration": 1, "mb": m, "mbs": 2, "seqlen": 256, **extra}}
              for m, extra in enumerate(({}, {"attention": {"input": 0.25}}))]
    (tmp_path / "rank000.json").write_text(json.dumps({"traceEvents": events, "otherData": {"origin_us": 0.0}}))
    ops = executed_ops(str(tmp_path), cm, [1], "none")
    fixed = float(getattr(cm, "stage_overhead_ms", 0.0))
    dense = float(cm.stage_cost(2, 256, stage=0).fw_ms) - fixed
    thinned = float(cm.stage_cost(2, 256, stage=0, attention=AttentionDensity(0.25)).fw_ms) - fixed
    assert ops.predicted_ms.tolist() == pytest.approx([dense, thinned]) and thinned < dense


def test_per_sample_calls_are_counted_a_sample_and_priced_a_core():
    # The calls: one a sample with keys, whatever the rows hold.
    assert packed_density(np.array([3, 5, 8]), [[0, 1], [2]], 8).calls == 3
    assert packed_density(np.array([[3, 2], [5, 4]]), [[0, 1]], 8, 6).calls == 2
    assert stack([None, AttentionDensity(0.5, calls=4)]).calls.tolist() == [0.0, 4.0]
    assert AttentionDensity(0.5, calls=4).padded_to(8, 0, 16, 0).calls == 4
    assert AttentionDensity(0.5, calls=4).to_json() == {"input": 0.5, "target": 1.0, "cross": 1.0, "calls": 4}
    with pytest.raises(DynaPipeError, match="attention calls=-1"):
        AttentionDensity(0.5, calls=-1)
    fw_call, bw_call = 0.2, 0.15
    gpt = ProfileCostModel(load_model_config("gpt-tiny"), {**_profile(), "attention_call_ms": {"fw": fw_call,
                                                                                              "bw": bw_call}}, 2)
    assert gpt.attention_call_ms == (fw_call, bw_call)
    two_layers = StageLayout(0, 0, 2, False, False)
    for level, again in (("none", 0.0), ("selective", fw_call), ("full", fw_call)):
        none = gpt.priced_layout_cost(two_layers, 2.0, 256.0, None, level, AttentionDensity(0.5))
        one = gpt.priced_layout_cost(two_layers, 2.0, 256.0, None, level, AttentionDensity(0.5, calls=1))
        five = gpt.priced_layout_cost(two_layers, 2.0, 256.0, None, level, AttentionDensity(0.5, calls=5))
        # The measured layer holds one call: 4 more on each of 2 layers; a recomputing backward
        # runs their forward again.
        assert float(one.fw_ms) == float(none.fw_ms) and float(one.bw_ms) == float(none.bw_ms)
        assert float(five.fw_ms - none.fw_ms) == pytest.approx(8 * fw_call)
        assert float(five.bw_ms - none.bw_ms) == pytest.approx(8 * (bw_call + again))
        assert float(five.stored_mib) == float(none.stored_mib)
    # Dense rows make no per-sample calls; a profile without the figure prices none.
    assert float(gpt.stage_cost(2, 256, stage=0).fw_ms) == float(
        ProfileCostModel(load_model_config("gpt-tiny"), _profile(), 2).stage_cost(2, 256, stage=0).fw_ms)
    assert ProfileCostModel(load_model_config("gpt-tiny"), _profile(), 2).attention_call_ms == (0.0, 0.0)
    # T5: one core an encoder layer, two a decoder layer (self- and cross-attention).
    t5 = ProfileCostModel(T5_TINY, {**t5_profile(), "attention_call_ms": {"fw": fw_call, "bw": bw_call}}, 2)
    for layout, cores in ((StageLayout(0, 2, 0, True, False), 2), (StageLayout(1, 0, 2, False, True), 4)):
        d0 = t5.priced_layout_cost(layout, 2.0, 256.0, 64.0, "none", AttentionDensity(0.5, 0.5, 0.5))
        d3 = t5.priced_layout_cost(layout, 2.0, 256.0, 64.0, "none", AttentionDensity(0.5, 0.5, 0.5, calls=3))
        assert float(d3.fw_ms - d0.fw_ms) == pytest.approx(2 * cores * fw_call)
    for bad in ({"fw": -1}, {"fw": float("nan")}, {"forward": 1.0}, [0.1, 0.1], {"bw": True}):
        with pytest.raises(DynaPipeError, match="'attention_call_ms'"):
            ProfileCostModel(load_model_config("gpt-tiny"), {**_profile(), "attention_call_ms": bad}, 2)


def test_a_candidate_of_per_sample_rows_makes_a_call_a_sample():
    from dynapipe.batching.candidates import _range_density

    density = _range_density(np.array([4, 6, 8, 8]))
    d = density(np.array([4, 3]), np.array([4, 2]), np.array([8, 8]), None)
    assert d.calls.tolist() == [4.0, 2.0]
