"""The per-shape refit of a cost profile from executed ops (pure numpy, no processes)."""
import json

import numpy as np
import pytest

from megatron_integration.bench_calibrate import fit_stage_overhead
from megatron_integration.bench_refit import (ExecutedOps, grid_weights, refit_factors, refit_profile, shape_errors,
                                              size_class, total_error)
from profile_widths import TINY_WIDTHS

MBS = [1, 2, 4]
SEQ = [32, 64, 128, 256, 512]


def _profile(fw_per_token_ms=0.01):
    b, s = np.meshgrid(MBS, SEQ, indexing="ij")
    fw = fw_per_token_ms * b * s
    tables = {"fw_ms": fw.tolist(), "bw_ms": (2 * fw).tolist(), "stored_mib": (1e-3 * b * s).tolist(),
              "peak_mib": (1e-3 * b * s).tolist()}
    return {"format": "dynapipe-profile", "version": 1, "mbs": MBS, "seqlen": SEQ, "model": dict(TINY_WIDTHS),
            "ops": {op: json.loads(json.dumps(tables)) for op in ("layer", "embedding", "output")}}


def _true_factor(b, s):
    # What the executed run pays over the profile: a fixed cost that dominates small ops, plus a
    # rise at long rows (attention that no longer fits the shared cache): U-shaped in tokens.
    tokens = np.asarray(b) * np.asarray(s)
    return 1.2 + 1.0 * np.exp(-tokens / 60.0) + 0.3 * (np.asarray(s) >= 512)


def _ops(rng, n, predicted_of, outliers=0):
    b = rng.choice(MBS, n)
    s = rng.choice(SEQ, n)
    back = rng.random(n) < 0.5
    pred = predicted_of(b, s) * np.where(back, 2.0, 1.0)
    meas = pred * _true_factor(b, s) * np.exp(rng.normal(0.0, 0.03, n))
    meas[:outliers] *= 3.0  # a few ops slowed by another process on the machine
    return ExecutedOps(b, s, np.zeros(n, int), back, meas, pred)


def test_refit_recovers_a_known_cost_curve_where_the_line_fit_cannot():
    rng = np.random.default_rng(0)
    ops = _ops(rng, 400, lambda b, s: 0.01 * b * s, outliers=12)
    refit = refit_factors(ops, MBS, SEQ)
    truth = _true_factor(*np.meshgrid(MBS, SEQ, indexing="ij"))
    assert refit.ops == 400
    np.testing.assert_allclose(refit.fw, truth, rtol=0.05)
    np.testing.assert_allclose(refit.bw, truth, rtol=0.05)
    # The refitted profile predicts the executed ops, per size class, within a few percent.
    after = ExecutedOps(ops.mbs, ops.seqlen, ops.stage, ops.backward, ops.measured_ms,
                        ops.predicted_ms * refit.factor(ops.mbs, ops.seqlen, ops.backward))
    clean = np.arange(len(ops)) >= 12
    ratios = after.measured_ms[clean] / after.predicted_ms[clean]
    assert np.abs(ratios - 1).max() < 0.15 and abs(np.median(ratios) - 1) < 0.02
    before_rows, after_rows = shape_errors(ops), shape_errors(after)
    assert {r["tokens"] for r in before_rows} == {r["tokens"] for r in after_rows}
    assert max(r["mean_abs_error"] for r in after_rows) < 0.25 < min(r["mean_abs_error"] for r in before_rows)
    assert total_error(after)["mean_abs_error"] < 0.1 < total_error(ops)["mean_abs_error"]
    # One line through the same ops: long rows cost more per token than mid-sized ones, so the
    # line gets a slope above the mid-sized ops' factor and a negative intercept, and prices the
    # smallest ops (which cost the most per token) far below what they cost.
    line = fit_stage_overhead(ops.predicted_ms[clean], ops.measured_ms[clean], 0.0)
    assert line.intercept_ms < 0 and line.slope > 1.3
    small = clean & (ops.mbs == 1) & (ops.seqlen == 32)
    assert (line.slope * ops.predicted_ms[small] + line.intercept_ms < 0.7 * ops.measured_ms[small]).all()


def test_cells_without_ops_take_the_typical_slowdown():
    rng = np.random.default_rng(1)
    ops = _ops(rng, 200, lambda b, s: 0.01 * b * s)
    only_long = ops.select((ops.mbs == 1) & (ops.seqlen >= 256))
    refit = refit_factors(only_long, MBS, SEQ)
    # mbs 4 rows saw no op: pulled to the median ratio of what ran, not left at 1.
    fw = only_long.select(~only_long.backward)
    median = float(np.median(fw.measured_ms / fw.predicted_ms))
    np.testing.assert_allclose(refit.fw[2], median, rtol=0.05)
    empty = refit_factors(ExecutedOps.from_rows([]), MBS, SEQ)
    assert empty.ops == 0 and np.allclose(empty.fw, 1.0) and np.allclose(empty.bw, 1.0)


def test_grid_weights_blend_neighbours_and_clamp_outside():
    w = grid_weights(MBS, SEQ, [1, 3, 8], [48, 512, 1024]).reshape(3, len(MBS), len(SEQ))
    assert w[0, 0, 0] == pytest.approx(0.5) and w[0, 0, 1] == pytest.approx(0.5)
    assert w[1, 1, 4] == pytest.approx(0.5) and w[1, 2, 4] == pytest.approx(0.5)
    assert w[2, 2, 4] == pytest.approx(1.0)
    assert np.allclose(w.sum(axis=(1, 2)), 1.0)
    assert size_class(64) == "1-64" and size_class(512) == "512" and size_class(400) == "385-511"


def test_refitted_profile_prices_every_table_and_the_executor(tmp_path):
    from dynapipe.config import load_model_config
    from dynapipe.cost.profile import ProfileCostModel

    profile = _profile()
    profile["ops"]["layer_full"] = json.loads(json.dumps(profile["ops"]["layer"]))
    rng = np.random.default_rng(2)
    refit = refit_factors(_ops(rng, 300, lambda b, s: 0.01 * b * s), MBS, SEQ)
    out = refit_profile(profile, refit, stage_overhead_ms=0.7)
    for op in ("layer", "embedding", "output", "layer_full"):
        np.testing.assert_allclose(out["ops"][op]["fw_ms"], np.asarray(profile["ops"][op]["fw_ms"]) * refit.fw,
                                   rtol=1e-5)
        np.testing.assert_allclose(out["ops"][op]["bw_ms"], np.asarray(profile["ops"][op]["bw_ms"]) * refit.bw,
                                   rtol=1e-5)
        assert out["ops"][op]["stored_mib"] == profile["ops"][op]["stored_mib"]
    src, dst = tmp_path / "p.json", tmp_path / "p.refit.json"
    src.write_text(json.dumps(profile))
    dst.write_text(json.dumps(out))
    model = load_model_config("gpt-tiny")
    plain = ProfileCostModel.from_file(model, str(src), 2).stage_cost(2, 128, stage=1)
    paid = ProfileCostModel.from_file(model, str(dst), 2).stage_cost(2, 128, stage=1)
    # Stage 1 of 2 holds layers and the output: every part scaled by the cell's factor, plus the executor.
    assert float(paid.fw_ms) == pytest.approx(float(plain.fw_ms) * refit.fw[1, 2] + 0.7, rel=1e-4)
    assert float(paid.bw_ms) == pytest.approx(float(plain.bw_ms) * refit.bw[1, 2] + 0.7, rel=1e-4)
    # A per-sample attention call, timed in the same loop, slows by the factors' median.
    calls = refit_profile({**profile, "attention_call_ms": {"fw": 0.2, "bw": 0.1}}, refit, 0.0)["attention_call_ms"]
    assert calls == pytest.approx({"fw": 0.2 * np.median(refit.fw), "bw": 0.1 * np.median(refit.bw)}, rel=1e-4)
    assert "attention_call_ms" not in out
    with pytest.raises(ValueError):
        refit_profile({**profile, "seqlen": SEQ[:-1]}, refit, 0.0)
    # A cell timed while the machine was quieter (2 x 512 below 1 x 512) is raised: a larger shape
    # never costs less, else the planner would merge samples into it.
    noisy = json.loads(json.dumps(profile))
    noisy["ops"]["layer"]["fw_ms"][1][4] = 0.5 * noisy["ops"]["layer"]["fw_ms"][0][4]
    fixed = np.asarray(refit_profile(noisy, refit, 0.0)["ops"]["layer"]["fw_ms"])
    assert fixed[1, 4] == pytest.approx(fixed[0, 4]) and fixed[1, 4] >= fixed[1, 3]
    assert (np.diff(fixed, axis=0) >= 0).all() and (np.diff(fixed, axis=1) >= 0).all()


def test_dp_cuts_larger_micro_batches_when_small_ones_are_priced_less_efficient(tmp_path):
    from dynapipe.config import load_model_config
    from dynapipe.cost.profile import ProfileCostModel
    from dynapipe.batching.planner import plan_micro_batches

    profile = _profile()
    rng = np.random.default_rng(3)
    refit = refit_factors(_ops(rng, 400, lambda b, s: 0.01 * b * s), MBS, SEQ)
    model = load_model_config("gpt-tiny")
    lengths = np.random.default_rng(4).integers(20, 120, 32)
    counts = {}
    for name, data in (("profiled", profile), ("refitted", refit_profile(profile, refit, 0.0))):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(data))
        cost = ProfileCostModel.from_file(model, str(path), 2)
        mbs = plan_micro_batches(lengths, cost, method="dynapipe", seq_length=128).micro_batches
        assert sorted(i for mb in mbs for i in mb.samples) == list(range(32))
        counts[name] = len(mbs)
    # Flat cost per token: many small micro-batches shrink the pipeline's fill and drain. Small
    # ones priced as executed (a fixed cost per op): fewer, larger micro-batches.
    assert counts["refitted"] < counts["profiled"]


def test_refit_scales_a_weight_part_with_its_backward():
    profile = _profile()
    bw = np.asarray(profile["ops"]["layer"]["bw_ms"])
    profile["ops"]["layer"]["bw_weight_ms"] = (0.3 * bw).tolist()
    refit = refit_factors(_ops(np.random.default_rng(3), 300, lambda b, s: 0.01 * b * s), MBS, SEQ)
    out = refit_profile(profile, refit, 0.0)["ops"]["layer"]
    np.testing.assert_allclose(np.asarray(out["bw_weight_ms"]), 0.3 * np.asarray(out["bw_ms"]), rtol=1e-4)
    assert "bw_weight_ms" not in refit_profile(profile, refit, 0.0)["ops"]["output"]


def test_executed_split_backwards_count_as_one_backward(tmp_path):
    # Zero-bubble plans trace a backward as its input and weight parts; the cost model prices the
    # backward whole, so the calibration compares their sum.
    from dynapipe.config import load_device_config, load_model_config
    from dynapipe.cost import build_cost_model
    from megatron_integration.bench_calibrate import executed_ops

    def op(cat, mb, dur_ms):
        return {"ph": "X", "cat": cat, "tid": 0, "ts": 0, "dur": dur_ms * 1e3,
                "args": {"iteration": 1, "mb": mb, "mbs": 2, "seqlen": 128}}

    events = [op("forward", 0, 1.0), op("forward", 1, 1.5), op("backward-input", 0, 2.0), op("backward-input", 1, 2.5),
              op("backward-weight", 0, 0.5), op("backward-weight", 1, 0.75), op("comm", 0, 9.0)]
    (tmp_path / "rank000.json").write_text(json.dumps({"traceEvents": events}))
    cost = build_cost_model(load_model_config("gpt-tiny"), load_device_config("cpu"), 2)
    ops = executed_ops(str(tmp_path), cost, [1])
    assert sorted(zip(ops.backward.tolist(), ops.measured_ms.tolist())) == [
        (False, 1.0), (False, 1.5), (True, 2.5), (True, 3.25)]
    whole = float(cost.stage_cost(2, 128, stage=0).bw_ms)
    assert ops.predicted_ms[ops.backward] == pytest.approx([whole, whole])
