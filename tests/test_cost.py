"""Cost models: analytic sanity against the published formulas, and a hand-made profile."""
from __future__ import annotations

import copy
import dataclasses
import json

import numpy as np
import pytest

from dynapipe.config import load_device_config, load_model_config, model_config_from_dict
from dynapipe.cost import ProfileCostModel, build_cost_model, stage_layouts
from dynapipe.cost.base import MIB
from dynapipe.errors import DynaPipeError
from profile_widths import widths

# The FLOP-formula checks below use a flat efficiency curve; the curve has its own test.
A100 = dataclasses.replace(load_device_config("a100-40gb"), half_efficiency_tokens=0.0)
GPT7B = load_model_config("gpt-7b")
T5 = load_model_config("t5-11b")
MIDDLE = 3  # of 8 stages: 4 layers, no embedding, no output layer


@pytest.fixture(scope="module")
def cm():
    return build_cost_model(GPT7B, A100, 8)


def _compute_ms(cm, field, b, s, stage=MIDDLE, recompute="none"):
    """Time of one op without its fixed overhead."""
    c = cm.stage_cost(b, s, stage=stage, recompute=recompute)
    return float(getattr(c, field)) - A100.op_overhead_ms


def test_forward_flops_match_the_transformer_formula(cm):
    # Per layer forward: 24 b s h^2 + 4 b s^2 h (a_d = h, ffn = 4h), 4 layers on a middle stage.
    h, b, s = GPT7B.hidden_size, 2, 1024
    flops = 4 * (24 * b * s * h * h + 4 * b * s * s * h)
    assert _compute_ms(cm, "fw_ms", b, s) == pytest.approx(flops / A100.effective_flops_per_ms, rel=1e-12)


def test_efficiency_curve_slows_thin_micro_batches():
    curved = load_device_config("a100-40gb")
    k = curved.half_efficiency_tokens
    assert k > 0
    flat_cm, curved_cm = build_cost_model(GPT7B, A100, 8), build_cost_model(GPT7B, curved, 8)
    for b, s in ((1, 64), (2, 512), (8, 2048)):
        flat = float(flat_cm.stage_cost(b, s, stage=MIDDLE).fw_ms) - A100.op_overhead_ms
        slow = float(curved_cm.stage_cost(b, s, stage=MIDDLE).fw_ms) - curved.op_overhead_ms
        assert slow == pytest.approx(flat * (b * s + k) / (b * s), rel=1e-12)
    # Per token, one 64-token sample now costs more than a 4096-token micro-batch.
    per_token = lambda b, s: float(curved_cm.stage_cost(b, s, stage=MIDDLE).fw_ms) / (b * s)
    assert per_token(1, 64) > 2 * per_token(8, 512)


def test_attention_term_is_quadratic(cm):
    t1, t2, t4 = (_compute_ms(cm, "fw_ms", 1, s) for s in (512, 1024, 2048))
    # t(s) = a s + c s^2: second differences isolate c, and they grow 4x per doubling.
    assert t2 > 2 * t1 and t4 > 2 * t2
    assert (t4 - 2 * t2) == pytest.approx(4 * (t2 - 2 * t1), rel=1e-9)


def test_time_and_memory_scale_linearly_in_samples(cm):
    for field in ("fw_ms", "bw_ms"):
        assert _compute_ms(cm, field, 6, 512) == pytest.approx(3 * _compute_ms(cm, field, 2, 512), rel=1e-12)
    c2, c6 = cm.stage_cost(2, 512), cm.stage_cost(6, 512)
    assert float(c6.stored_mib) == pytest.approx(3 * float(c2.stored_mib))


def test_stored_activations_follow_korthikanti(cm):
    # sbh(34 + 5 a s / h) bytes per layer for 2-byte activations, times b samples and 4 layers,
    # plus the two LayerNorms' fp32 mean and 1/std (16 bytes a token), which the paper leaves out.
    h, a, b, s = GPT7B.hidden_size, GPT7B.num_attention_heads, 3, 2048
    expect = 4 * b * s * (h * (34 + 5 * a * s / h) + 16) / MIB
    assert float(cm.stage_cost(b, s, stage=MIDDLE).stored_mib) == pytest.approx(expect, rel=1e-12)


@pytest.mark.parametrize("model", [GPT7B, T5])
def test_recompute_levels_trade_memory_for_time(model):
    cm = build_cost_model(model, A100, 8)
    dec = 128 if model.is_encoder_decoder else None
    c = {r: cm.stage_cost([1, 4], [512, 2048], None if dec is None else [dec, dec], recompute=r)
         for r in ("none", "selective", "full")}
    assert np.all(c["none"].stored_mib > c["selective"].stored_mib)
    assert np.all(c["selective"].stored_mib > c["full"].stored_mib)
    assert np.all(c["full"].bw_ms > c["selective"].bw_ms) and np.all(c["selective"].bw_ms > c["none"].bw_ms)
    assert np.allclose(c["none"].fw_ms, c["full"].fw_ms)
    for r in c.values():
        assert np.all(r.bw_ms >= r.fw_ms) and np.all(r.peak_mib > 0)


def test_bottleneck_is_the_elementwise_maximum(cm):
    b, s = np.array([1, 8]), np.array([2048, 128])
    worst = cm.stage_cost(b, s)
    for stage in range(8):
        c = cm.stage_cost(b, s, stage=stage)
        for f in ("fw_ms", "bw_ms", "stored_mib", "peak_mib"):
            assert np.all(getattr(worst, f) >= getattr(c, f))
    assert np.allclose(worst.fw_ms, np.max([cm.stage_cost(b, s, stage=k).fw_ms for k in range(8)], axis=0))


def test_model_states(cm):
    # 7B on 8 stages: mixed precision keeps 18 bytes a parameter; the first/last stage adds the embedding.
    per_stage_layers = 4 * (12 * 4096 ** 2 + 13 * 4096)
    assert cm.model_state_mib() > per_stage_layers * 18 / MIB
    assert cm.model_state_mib(MIDDLE) == pytest.approx(per_stage_layers * 18 / MIB, rel=1e-12)
    assert cm.model_state_mib(dp=8, zero=True) < cm.model_state_mib()
    fp32 = build_cost_model(load_model_config("gpt-tiny"), load_device_config("cpu"), 2)
    n = fp32.layout_param_count(fp32.layouts[0])
    assert fp32.model_state_mib(0) == pytest.approx(n * 16 / MIB)


@pytest.mark.parametrize("dtype, plain, sharded", [("bf16", 18, 6 + 12 / 8), ("fp16", 20, 4 + 16 / 8),
                                                    ("fp32", 16, 8 + 8 / 8)])
def test_model_state_bytes_a_parameter_as_megatron_lists_them(dtype, plain, sharded):
    """Megatron-LM's table of bytes a parameter: fp16 keeps fp16 gradients and an fp32 copy of
    them in the optimizer (20; distributed 4 + 16/d), bf16 fp32 main gradients (18; 6 + 12/d)."""
    model = build_cost_model(dataclasses.replace(GPT7B, dtype=dtype), A100, 8)
    n = model.layout_param_count(model.layouts[MIDDLE])
    assert model.model_state_mib(MIDDLE) == pytest.approx(n * plain / MIB, rel=1e-12)
    assert model.model_state_mib(MIDDLE, dp=8, zero=True) == pytest.approx(n * sharded / MIB, rel=1e-12)


def test_stage_layouts_cover_every_layer_once():
    for model, stages in ((GPT7B, 8), (GPT7B, 5), (T5, 8), (T5, 3)):
        layouts = stage_layouts(model, stages)
        assert sum(l.encoder_layers + l.decoder_layers for l in layouts) == model.total_layers
        assert layouts[0].has_embedding and layouts[-1].has_output
        assert max(l.encoder_layers + l.decoder_layers for l in layouts) - \
            min(l.encoder_layers + l.decoder_layers for l in layouts) <= 1
    with pytest.raises(DynaPipeError, match="num_stages=33 exceeds the 32 layers"):
        stage_layouts(GPT7B, 33)
    with pytest.raises(DynaPipeError, match="at least 1"):
        stage_layouts(GPT7B, 0)


def test_bad_cost_queries(cm):
    with pytest.raises(DynaPipeError, match="stage=9"):
        cm.stage_cost(1, 64, stage=9)
    with pytest.raises(DynaPipeError, match="recompute='most'"):
        cm.stage_cost(1, 64, recompute="most")
    with pytest.raises(DynaPipeError, match="decoder length"):
        build_cost_model(T5, A100, 8).stage_cost(1, 64)


# ---- profile-based model -------------------------------------------------------------------
TINY = model_config_from_dict(dict(name="tiny", num_layers=4, hidden_size=64, num_attention_heads=4,
                                   ffn_hidden_size=256, vocab_size=512, max_seq_length=1024, dtype="fp32"))
MBS, SEQ = [1, 2, 4], [64, 128, 256]


def _grid(fn):
    return [[fn(b, s) for s in SEQ] for b in MBS]


def _profile():
    layer = {"fw_ms": _grid(lambda b, s: 0.01 * b * s + 1e-5 * b * s * s), "bw_ms": _grid(lambda b, s: 0.02 * b * s),
             "stored_mib": _grid(lambda b, s: 0.001 * b * s), "peak_mib": _grid(lambda b, s: 0.0005 * b * s)}
    small = {k: _grid(lambda b, s: 0.001 * b * s) for k in ("fw_ms", "bw_ms", "stored_mib", "peak_mib")}
    return {"format": "dynapipe-profile", "version": 1, "device": "cpu", "dtype": "fp32", "mbs": MBS, "seqlen": SEQ,
            "model": widths(TINY), "ops": {"layer": layer, "embedding": small, "output": small}}


@pytest.fixture()
def prof():
    return ProfileCostModel(TINY, _profile(), num_stages=2)


def test_profile_is_exact_at_grid_points(prof):
    layer = _profile()["ops"]["layer"]
    # Stage 0 of 2 holds 2 layers and the embedding.
    for i, b in enumerate(MBS):
        for j, s in enumerate(SEQ):
            c = prof.stage_cost(b, s, stage=0)
            assert float(c.fw_ms) == pytest.approx(2 * layer["fw_ms"][i][j] + 0.001 * b * s)
            assert float(c.stored_mib) == pytest.approx(2 * layer["stored_mib"][i][j] + 0.001 * b * s)


def test_profile_interpolates_bilinearly(prof):
    fw = np.array(_profile()["ops"]["layer"]["fw_ms"])
    # b=3 is halfway between rows 2 and 4; s=96 halfway between columns 64 and 128.
    expect = fw[1:3, 0:2].mean()
    emb = (0.001 * 2 * 64 + 0.001 * 4 * 64 + 0.001 * 2 * 128 + 0.001 * 4 * 128) / 4
    assert float(prof.stage_cost(3, 96, stage=0).fw_ms) == pytest.approx(2 * expect + emb)


def test_profile_extrapolation_rules(prof):
    bw = np.array(_profile()["ops"]["layer"]["bw_ms"])
    fw = np.array(_profile()["ops"]["layer"]["fw_ms"])
    stage1 = prof.layouts[1]
    lay = lambda b, s: prof.layout_cost(stage1, np.float64(b), np.float64(s), None, "none")  # noqa: E731
    out = lambda b, s: 0.001 * b * s  # noqa: E731 (the output op is linear, so extrapolates exactly)
    # mbs above the grid: the slope of the last two rows (linear here, so proportional too).
    assert float(lay(8, 128).bw_ms) == pytest.approx(2 * bw[2, 1] * 2 + out(8, 128))
    # seqlen above the grid: the parabola through the last three columns, exact on this
    # quadratic fw, where the power law through the last two columns fell short.
    assert float(lay(1, 512).fw_ms) == pytest.approx(2 * (0.01 * 512 + 1e-5 * 512 ** 2) + out(1, 512), rel=1e-9)
    p = np.log(fw[0, 2] / fw[0, 1]) / np.log(256 / 128)
    assert 2 * fw[0, 2] * 2 ** p < 0.97 * 2 * (0.01 * 512 + 1e-5 * 512 ** 2)
    # seqlen below the grid: the first column.
    assert float(lay(1, 16).fw_ms) == pytest.approx(2 * fw[0, 0] + 0.001 * 64)


def test_times_beyond_the_largest_profiled_mbs_keep_the_fixed_cost_fixed():
    # A GPU's small shapes are launch-bound: every micro-batch pays a fixed cost. Scaled
    # proportionally from the largest measured size, 16 samples would pay it four times and look
    # no cheaper per sample than 4 (on an H200 the planner then cut 15 small micro-batches).
    data = _profile()
    fixed = lambda per_token: _grid(lambda b, s: 5.0 + per_token * b * s)  # noqa: E731
    data["ops"]["layer"].update(fw_ms=fixed(0.01), bw_ms=fixed(0.02))
    cm = ProfileCostModel(TINY, data, num_stages=1)
    ends = 2 * 0.001 * 16 * 128  # embedding and output: linear, so exact either way
    c = cm.stage_cost(16, 128, stage=0)
    assert float(c.fw_ms) == pytest.approx(4 * (5.0 + 0.01 * 16 * 128) + ends)  # 4 layers, each 5 ms once
    assert float(c.bw_ms) == pytest.approx(4 * (5.0 + 0.02 * 16 * 128) + ends)
    # Memory stays proportional: activations are per sample.
    assert float(c.stored_mib) == pytest.approx(4 * 0.001 * 16 * 128 + ends)
    # A slope the last two rows do not show is not invented: a flat top stays flat.
    data["ops"]["layer"]["fw_ms"] = _grid(lambda b, s: 9.0 if b >= 2 else 8.0)
    flat = ProfileCostModel(TINY, data, num_stages=1)
    assert float(flat.stage_cost(16, 128, stage=0).fw_ms) == pytest.approx(4 * 9.0 + ends)


def test_extrapolated_times_never_fall_with_length_or_below_the_last_row():
    # Launch-bound small shapes measure noisy steps. Here, from 2 to 4 samples, the 64-token
    # column falls 1 ms (noise), the 128-token one rises 1 ms and the 256-token one 0.5 ms; read
    # column by column, 32 samples of 64 tokens would cost less than the 4 measured and 32 of
    # 256 tokens less than 32 of 128.
    data = _profile()
    rows = {1: [10.0, 10.0, 10.5], 2: [13.0, 11.0, 12.0], 4: [12.0, 12.0, 12.5]}
    data["ops"]["layer"]["fw_ms"] = [rows[b] for b in MBS]
    cm = ProfileCostModel(TINY, data, num_stages=1)
    def layer(b, s):  # one layer: the stage less its (linear) ends, over 4 layers
        stage = cm.layout_cost(cm.layouts[0], np.float64(b), np.float64(s), None, "none")
        return float(stage.fw_ms - 2 * 0.001 * b * s) / 4
    assert layer(32, 64) == pytest.approx(12.0)  # a falling step adds nothing, and takes nothing
    assert layer(32, 128) == pytest.approx(12.0 + 28 * 0.5)
    assert layer(32, 256) == pytest.approx(12.5 + 28 * 0.5)  # 128's step, not 256's 0.25
    at_32 = [layer(32, s) for s in (64, 96, 128, 192, 256, 512)]
    assert all(b >= a * (1 - 1e-12) for a, b in zip(at_32, at_32[1:])), at_32  # up to rounding


def test_profile_recompute_and_file_loading(tmp_path, prof):
    none, full = prof.stage_cost(2, 128, recompute="none"), prof.stage_cost(2, 128, recompute="full")
    sel = prof.stage_cost(2, 128, recompute="selective")
    assert float(full.stored_mib) < float(sel.stored_mib) < float(none.stored_mib)
    assert float(full.bw_ms) > float(sel.bw_ms) > float(none.bw_ms)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(_profile()))
    loaded = build_cost_model(TINY, load_device_config("cpu"), 2, profile=str(path))
    assert float(loaded.stage_cost(2, 128).fw_ms) == float(prof.stage_cost(2, 128).fw_ms)


def _broken(edit):
    p = copy.deepcopy(_profile())
    edit(p)
    return p


@pytest.mark.parametrize("edit, message", [
    (lambda p: p.update(format="other"), "not a DynaPipe profile"),
    (lambda p: p.update(version=3), "version 3 is not supported"),
    (lambda p: p.update(mbs=[2, 1, 4]), "strictly ascending"),
    (lambda p: p.update(seqlen=[]), "non-empty list"),
    (lambda p: p["ops"].pop("output"), "ops.output is missing"),
    (lambda p: p["ops"]["layer"].update(fw_ms=[[1.0, 2.0]]), r"ops.layer.fw_ms must be a 3x3 table"),
    (lambda p: p["ops"]["layer"]["bw_ms"][0].__setitem__(0, -1.0), "negative or non-finite"),
    (lambda p: p["ops"].update(layer=[1, 2]), "ops.layer must be"),
    (lambda p: p.update(ops=[]), "'ops' must be"),
    (lambda p: p["ops"]["layer"].update(fw_ms=[["a", 1, 2]] * 3), r"ops.layer.fw_ms holds a value that is not a number"),
])
def test_bad_profiles(edit, message):
    with pytest.raises(DynaPipeError, match=message):
        ProfileCostModel(TINY, _broken(edit), num_stages=2)


def test_bad_profile_files(tmp_path):
    with pytest.raises(DynaPipeError, match="does not exist"):
        ProfileCostModel.from_file(TINY, str(tmp_path / "none.json"), 2)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(DynaPipeError, match="not valid JSON"):
        ProfileCostModel.from_file(TINY, str(bad), 2)
    bad.write_text("[1, 2]")
    with pytest.raises(DynaPipeError, match="not a DynaPipe profile"):
        ProfileCostModel.from_file(TINY, str(bad), 2)
    with pytest.raises(DynaPipeError, match="encoder-decoder"):
        ProfileCostModel(T5, _profile(), 8)


def test_t5_cross_attention_parameters_follow_the_bias_and_norm_switches():
    from dynapipe.config import ModelConfig
    from dynapipe.cost.base import StageLayout, stage_param_count

    kw = dict(name="t", arch="t5", encoder_layers=1, decoder_layers=1, num_layers=2, hidden_size=64,
              num_attention_heads=4, ffn_hidden_size=256, vocab_size=512)
    enc, dec = StageLayout(0, 1, 0, False, False), StageLayout(0, 0, 1, False, False)
    h = 64
    for extra, cross in (({}, 4 * h * h + 3 * h + h + 2 * h),
                         ({"add_bias_linear": False, "normalization": "RMSNorm"}, 4 * h * h + h)):
        m = ModelConfig(**kw, **extra).validate()
        assert stage_param_count(m, dec) - stage_param_count(m, enc) == cross, extra
