"""Encoder-decoder (T5) cost profiles: the format, its interpolation, the stage costs it gives,
and real profilings of a tiny T5 through ``python -m dynapipe profile --t5`` (one rank, a TP2 group)."""
import json
import subprocess
import sys

import numpy as np
import pytest

from dynapipe.config import ModelConfig, TensorParallelConfig, load_model_config
from dynapipe.cost import build_cost_model
from dynapipe.cost.placement import StagePlacement
from dynapipe.cost.profile import ProfileCostModel
from dynapipe.errors import DynaPipeError
from profile_widths import TINY_WIDTHS, widths

MBS, ENC, DEC = [1, 2, 4], [64, 128, 256], [32, 64]
T5 = ModelConfig(name="t5-test", arch="t5", num_layers=4, encoder_layers=2, decoder_layers=2, hidden_size=64,
                 num_attention_heads=4, ffn_hidden_size=256, vocab_size=512, max_seq_length=1024,
                 dtype="fp32").validate("t5-test")


def enc_ms(b, s):
    return b * (0.01 * s + 1e-4 * s * s)


def dec_ms(b, d, s):
    return b * (0.02 * d + 2e-4 * d * d + 1e-4 * d * s + 0.001 * s)


def t5_profile(scale_dec: float = 1.0, weights: bool = False, model: dict | None = None) -> dict:
    """A synthetic profile whose tables follow known formulas (ms; MiB = ms / 10); ``weights``:
    the layers' backwards were timed split, their weight part is the forward's ms (half bw_ms);
    ``model``: the widths it records (:data:`T5`'s by default)."""
    def table(values, split=False):
        arr = np.asarray(values, dtype=np.float64)
        return {"fw_ms": arr.tolist(), "bw_ms": (2 * arr).tolist(), "stored_mib": (arr / 10).tolist(),
                "peak_mib": (arr / 20).tolist(), **({"bw_weight_ms": arr.tolist()} if split else {})}

    return {"format": "dynapipe-profile", "version": 2, "kind": "encoder-decoder", "device": "cpu", "dtype": "fp32",
            "mbs": MBS, "seqlen": ENC, "dec_seqlen": DEC,
            "model": {"arch": "t5", **(model or widths(T5))},
            "ops": {"encoder_layer": table([[enc_ms(b, s) for s in ENC] for b in MBS], weights),
                    "decoder_layer": table([[[scale_dec * dec_ms(b, d, s) for s in ENC] for d in DEC] for b in MBS],
                                           weights),
                    "embedding": table([[0.01 * b * s for s in ENC] for b in MBS]),
                    "output": table([[0.05 * b * d for d in DEC] for b in MBS])}}


def test_t5_profile_prices_stages_exactly_on_the_grid():
    cm = ProfileCostModel(T5, t5_profile(), num_stages=2)
    assert str(cm.placement) == str(StagePlacement.even(T5, 2))
    b, s, d = 2, 128, 64
    enc = cm.stage_cost(b, s, d, stage=0)
    assert enc.fw_ms == pytest.approx(2 * enc_ms(b, s) + 0.01 * b * s)
    assert enc.bw_ms == pytest.approx(2 * enc.fw_ms)
    assert enc.stored_mib == pytest.approx(enc.fw_ms / 10)
    dec = cm.stage_cost(b, s, d, stage=1)
    # The first decoder stage embeds the decoder's tokens (the embedding table at d tokens).
    assert dec.fw_ms == pytest.approx(2 * dec_ms(b, d, s) + 0.01 * b * d + 0.05 * b * d)
    # The bottleneck is the elementwise maximum of the two stages.
    both = cm.stage_cost([1, 4], [256, 64], [32, 64])
    per = [cm.stage_cost([1, 4], [256, 64], [32, 64], stage=k).fw_ms for k in (0, 1)]
    assert np.allclose(both.fw_ms, np.maximum(*per))
    # A stage holding the end of the encoder and the decoder pays for both kinds of layers.
    placed = cm.with_placement(StagePlacement.parse("1+0,1+2", T5, 2))
    mixed = placed.stage_cost(b, s, d, stage=1)
    assert mixed.fw_ms == pytest.approx(enc_ms(b, s) + 2 * dec_ms(b, d, s) + 0.01 * b * d + 0.05 * b * d)
    # Stage 0 holding the start of the decoder embeds both token streams; stage 1 none.
    early = cm.with_placement(StagePlacement.parse("2+1,0+1", T5, 2))
    assert early.stage_cost(b, s, d, stage=0).fw_ms == pytest.approx(2 * enc_ms(b, s) + dec_ms(b, d, s)
                                                                     + 0.01 * b * (s + d))
    assert early.stage_cost(b, s, d, stage=1).fw_ms == pytest.approx(dec_ms(b, d, s) + 0.05 * b * d)


def test_t5_profile_interpolates_and_extrapolates_monotonically():
    cm = ProfileCostModel(T5, t5_profile(), num_stages=2)
    # Between grid points along the encoder length the decoder layer is linear.
    mid = cm.stage_cost(1, 192, 32, stage=1).fw_ms
    lo, hi = (cm.stage_cost(1, s, 32, stage=1).fw_ms for s in (128, 256))
    assert mid == pytest.approx((lo + hi) / 2)
    enc = np.linspace(16, 2048, 60)
    for stage in (0, 1):
        along_enc = cm.stage_cost(2, enc, 48, stage=stage).time_ms
        assert np.all(np.diff(along_enc) >= -1e-9)
        along_dec = cm.stage_cost(2, 200, np.linspace(8, 512, 60), stage=stage).time_ms
        assert np.all(np.diff(along_dec) >= -1e-9)
        along_mbs = cm.stage_cost(np.arange(1, 12), 200, 48, stage=stage).time_ms
        assert np.all(np.diff(along_mbs) > 0)
    # Above the grid the power law of the last two points holds the quadratic growth.
    assert cm.stage_cost(1, 512, 32, stage=0).fw_ms > 2 * cm.stage_cost(1, 256, 32, stage=0).fw_ms
    # More samples than the grid scale linearly from its last row.
    assert cm.stage_cost(8, 128, 32, stage=1).fw_ms == pytest.approx(2 * cm.stage_cost(4, 128, 32, stage=1).fw_ms)
    # ... and a fixed cost per micro-batch (3 ms a layer) is paid once: times grow by the last step's slope.
    data = t5_profile()
    for op in ("encoder_layer", "decoder_layer"):
        data["ops"][op]["fw_ms"] = (np.asarray(data["ops"][op]["fw_ms"]) + 3.0).tolist()
    fixed = ProfileCostModel(T5, data, num_stages=2)
    for stage in (0, 1):
        fw = {b: float(fixed.stage_cost(b, 128, 32, stage=stage).fw_ms) for b in (2, 4, 8)}
        assert fw[8] - fw[4] == pytest.approx(2 * (fw[4] - fw[2])), stage


def test_t5_profile_derives_recompute_levels():
    cm = ProfileCostModel(T5, t5_profile(), num_stages=2)
    args = (2, 256, 64)
    none, sel, full = (cm.stage_cost(*args, stage=1, recompute=lv) for lv in ("none", "selective", "full"))
    assert none.bw_ms < sel.bw_ms < full.bw_ms
    assert full.bw_ms == pytest.approx(none.bw_ms + 2 * dec_ms(*args[:1], args[2], args[1]))
    assert full.stored_mib < sel.stored_mib < none.stored_mib
    # Full recompute keeps each decoder layer's input and the encoder output (fp32 bytes).
    b, s, d = args
    assert full.stored_mib == pytest.approx((2 * b * d * 64 * 4 + b * s * 64 * 4) / 2**20 + (0.01 + 0.05) * b * d / 10)


def test_t5_profile_round_trips_through_a_file_and_build_cost_model(tmp_path):
    path = tmp_path / "t5.json"
    path.write_text(json.dumps(t5_profile()))
    cm = build_cost_model(T5, None, 2, profile=str(path), placement=StagePlacement.parse("1+0,1+2", T5, 2))
    ref = ProfileCostModel(T5, t5_profile(), 2).with_placement(StagePlacement.parse("1+0,1+2", T5, 2))
    for stage in (0, 1):
        a, b = cm.stage_cost([1, 3], [100, 300], [40, 70], stage=stage), ref.stage_cost([1, 3], [100, 300], [40, 70],
                                                                                      stage=stage)
        assert np.allclose(a.time_ms, b.time_ms) and np.allclose(a.memory_mib, b.memory_mib)


def test_a_t5_run_takes_only_a_profile_of_its_tensor_parallel_size(tmp_path):
    """A T5 command line at TP2 refuses a profile measured at TP1 (and the reverse), naming both."""
    from megatron_integration.t5_arguments import parse_t5_args
    from t5_job import TINY, TINY_WIDTHS as JOB_WIDTHS

    one, two = tmp_path / "tp1.json", tmp_path / "tp2.json"
    one.write_text(json.dumps(t5_profile(model=JOB_WIDTHS)))
    two.write_text(json.dumps({**t5_profile(model=JOB_WIDTHS), "tp": 2}))
    argv = TINY.split() + ["--use-dynapipe", "--dynapipe-cost-model"]
    assert parse_t5_args(argv + [str(two), "--tensor-model-parallel-size", "2"], 4, cuda=False).base.parallel \
        .tensor_model_parallel_size == 2
    with pytest.raises(DynaPipeError, match="measured at tensor-parallel size 1 without sequence parallelism, but "
                                            "the run uses tensor-parallel size 2"):
        parse_t5_args(argv + [str(one), "--tensor-model-parallel-size", "2"], 4, cuda=False)
    with pytest.raises(DynaPipeError, match="measured at tensor-parallel size 2"):
        parse_t5_args(argv + [str(two)], 2, cuda=False)


def test_auto_placement_follows_the_profile():
    """The split the planner chooses moves with the measured encoder/decoder balance."""
    from dynapipe.schedule.placement import choose_placement

    rng = np.random.default_rng(0)
    batches = [np.stack([rng.integers(64, 256, 8), rng.integers(16, 64, 8)], axis=1)]
    chosen = {}
    for scale in (0.05, 20.0):  # decoder layers far cheaper / far dearer than encoder layers
        cm = ProfileCostModel(T5, t5_profile(scale_dec=scale), 2)
        chosen[scale] = choose_placement(batches, cm, dp=1, memory_limit_mib=1e6, seq_length=256).chosen.placement
    assert chosen[0.05] != chosen[20.0]
    cheap_dec = chosen[0.05].layouts()[1]
    dear_dec = chosen[20.0].layouts()[0]
    assert cheap_dec.encoder_layers >= 1  # the last stage takes encoder work when decoders are cheap
    assert dear_dec.decoder_layers >= 1   # the first stage takes decoder work when decoders are dear


def test_old_and_decoder_only_profiles_still_load_and_kinds_must_match():
    gpt = load_model_config("gpt-tiny")
    table = {"fw_ms": [[1.0, 2.0]], "bw_ms": [[2.0, 4.0]], "stored_mib": [[1.0, 2.0]], "peak_mib": [[1.0, 1.0]]}
    v1 = {"format": "dynapipe-profile", "version": 1, "mbs": [1], "seqlen": [64, 128], "model": TINY_WIDTHS,
          "ops": {op: table for op in ("layer", "embedding", "output")}}
    assert ProfileCostModel(gpt, v1, 2).stage_cost(1, 64).fw_ms > 0
    v2 = {**v1, "version": 2, "kind": "decoder-only"}
    assert ProfileCostModel(gpt, v2, 2).stage_cost(1, 96).fw_ms == ProfileCostModel(gpt, v1, 2).stage_cost(1, 96).fw_ms
    with pytest.raises(DynaPipeError, match="decoder-only and cannot price encoder-decoder"):
        ProfileCostModel(T5, v1, 2)
    with pytest.raises(DynaPipeError, match="encoder-decoder and cannot price decoder-only"):
        ProfileCostModel(gpt, t5_profile(), 2)
    with pytest.raises(DynaPipeError, match="kind 'encoder-decoder'"):
        ProfileCostModel(T5, {**t5_profile(), "version": 1}, 2)
    with pytest.raises(DynaPipeError, match="version 3"):
        ProfileCostModel(T5, {**t5_profile(), "version": 3}, 2)


@pytest.mark.parametrize("edit, needle", [
    (lambda p: p.pop("dec_seqlen"), "'dec_seqlen' must be a non-empty list"),
    (lambda p: p.update(dec_seqlen=[64, 32]), "strictly ascending"),
    (lambda p: p["ops"].pop("decoder_layer"), "ops.decoder_layer is missing"),
    (lambda p: p["ops"]["decoder_layer"].update(fw_ms=[[1.0]]), r"ops.decoder_layer.fw_ms must be a 3x2x3 table"),
    (lambda p: p["ops"]["output"].update(bw_ms=[[-1.0, 1.0]] * 3), "ops.output.bw_ms holds negative"),
])
def test_malformed_t5_profiles_are_refused_in_one_line(edit, needle):
    p = t5_profile()
    edit(p)
    with pytest.raises(DynaPipeError, match=needle) as err:
        ProfileCostModel(T5, p, 2)
    assert "\n" not in str(err.value)


def test_t5_profile_prices_the_measured_weight_part_of_each_stage():
    """With the layers' bw_weight_ms a stage's weight part is its layers' sum, at every recompute
    level; without them (older profiles) the FLOPs estimate applies (None)."""
    from dynapipe.cost.base import StageLayout

    cm = ProfileCostModel(T5, t5_profile(weights=True), num_stages=2)
    b, s, d = 2, 128, 64
    enc, dec = cm.layouts
    assert cm.weight_ms(enc, b, s, d, "none") == pytest.approx(2 * enc_ms(b, s))
    assert cm.weight_ms(dec, b, s, d, "none") == pytest.approx(2 * dec_ms(b, d, s))
    mixed = cm.with_placement(StagePlacement.parse("1+0,1+2", T5, 2))
    assert mixed.weight_ms(mixed.layouts[1], b, s, d, "none") == pytest.approx(enc_ms(b, s) + 2 * dec_ms(b, d, s))
    for layout in cm.layouts:
        for level in ("none", "selective", "full"):
            share = cm.weight_share(layout, b, s, d, level)
            assert 0 < share < 1
            # Recomputation adds to the backward, not to the weight GEMMs.
            assert cm.weight_ms(layout, b, s, d, level) == cm.weight_ms(layout, b, s, d, "none")
    # Off the grid, interpolated and extrapolated, it never exceeds the stage's backward.
    bs, ss, ds = np.meshgrid([1, 3, 16], [16, 200, 4096], [8, 48, 2048], indexing="ij")
    for layout in cm.layouts:
        w = cm.weight_ms(layout, bs, ss, ds, "none")
        assert w.shape == bs.shape and np.all(w > 0)
        assert np.all(w <= cm.layout_cost(layout, bs, ss, ds, "none").bw_ms)
    # A weight part that grows faster than its backward at the grid's end would extrapolate past
    # it: each layer's weight part is capped at that layer's backward.
    steep = t5_profile(weights=True)
    enc_table = steep["ops"]["encoder_layer"]
    enc_table["bw_weight_ms"] = [[0.25 * bw for bw in row[:-1]] + [row[-1]] for row in enc_table["bw_ms"]]
    steep_cm = ProfileCostModel(T5, steep, num_stages=2)
    layer_bw = float(steep_cm.tables["encoder_layer"]["bw_ms"](1, 2048))
    assert float(steep_cm.tables["encoder_layer"]["bw_weight_ms"](1, 2048)) > layer_bw
    assert steep_cm.weight_ms(enc, 1, 2048, 32, "none") == pytest.approx(2 * layer_bw)
    assert cm.weight_ms(StageLayout(0, 0, 0, True, False), b, s, d, "none") is None
    old = ProfileCostModel(T5, t5_profile(), num_stages=2)
    assert all(old.weight_ms(layout, b, s, d, "none") is None for layout in old.layouts)
    assert old.weight_share(old.layouts[0], b, s, d, "none") is None


@pytest.mark.parametrize("op, edit, needle", [
    ("encoder_layer", lambda t: t.update(bw_weight_ms=[[1.0, 2.0]]), "must be a 3x3 table"),
    ("decoder_layer", lambda t: t.update(bw_weight_ms=[[[1.0] * 3] * 2] * 2), "must be a 3x2x3 table"),
    ("encoder_layer", lambda t: t["bw_weight_ms"][1].__setitem__(2, t["bw_ms"][1][2] + 1.0), "from 0 to"),
    ("decoder_layer", lambda t: t["bw_weight_ms"][0][0].__setitem__(0, -0.5), "from 0 to"),
    ("decoder_layer", lambda t: t["bw_weight_ms"][2][1].__setitem__(1, float("nan")), "from 0 to"),
    ("encoder_layer", lambda t: t.update(bw_weight_ms="fast"), "must be a 3x3 table"),
])
def test_malformed_t5_weight_tables_are_refused_in_one_line(op, edit, needle):
    p = t5_profile(weights=True)
    edit(p["ops"][op])
    with pytest.raises(DynaPipeError, match=rf"ops\.{op}\.bw_weight_ms .*{needle}") as err:
        ProfileCostModel(T5, p, 2)
    assert "\n" not in str(err.value)


def test_profile_command_measures_a_tiny_t5_alone_as_a_tensor_parallel_group_and_in_bf16(tmp_path):
    """Real profilings of megatron-core's T5 layers (a tiny grid, one thread a rank): one rank,
    a TP2 group of two spawned gloo ranks with sequence parallelism, and one rank in bf16."""
    paths = {1: tmp_path / "t5-tp1.json", 2: tmp_path / "t5-tp2.json", "bf16": tmp_path / "t5-bf16.json"}
    # The three commands run side by side: most of each is importing torch and megatron-core, and
    # what is checked below (shapes, stored bytes, positive times) does not depend on the load.
    procs = {}
    for key, path in paths.items():
        cmd = [sys.executable, "-m", "dynapipe", "profile", "--t5", "--output", str(path), "--hidden-size", "64",
               "--num-attention-heads", "4", "--ffn-hidden-size", "256", "--vocab-size", "512", "--mbs", "1,2",
               "--seqlens", "32,96", "--dec-seqlens", "16,48", "--threads", "1", "--no-progress",
               "--tensor-model-parallel-size", str(2 if key == 2 else 1)] + (["--bf16"] if key == "bf16" else [])
        # Two passes over the grid: the second times the layers' split backward as later passes do.
        cmd += ["--repeats", "1" if key == "bf16" else "2"]
        cmd += ["--sequence-parallel"] if key == 2 else []
        procs[key] = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    for key, proc in procs.items():
        try:
            _, err = proc.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for p in procs.values():
                p.kill()
            raise
        assert proc.returncode == 0, (key, err[-3000:])
    data = json.loads(paths[1].read_text())
    assert (data["version"], data["kind"], data["layer_spec"], data["tp"]) == (2, "encoder-decoder", "local", 1)
    assert data["dec_seqlen"] == [16, 48] and np.asarray(data["ops"]["decoder_layer"]["fw_ms"]).shape == (2, 2, 2)
    ops = {op: {f: np.asarray(v) for f, v in t.items()} for op, t in data["ops"].items()}
    for op in ("encoder_layer", "decoder_layer", "output"):
        assert np.all(ops[op]["fw_ms"] > 0) and np.all(ops[op]["bw_ms"] > 0)
        # Activations are kept per sample: twice the samples store twice the bytes.
        assert np.allclose(ops[op]["stored_mib"][1], 2 * ops[op]["stored_mib"][0], rtol=0.05)
    # A decoder layer keeps more for a longer encoder output (cross-attention keys, values, scores).
    dec = ops["decoder_layer"]["stored_mib"]
    assert np.all(dec[:, :, 1] > dec[:, :, 0])
    cm = ProfileCostModel(ModelConfig(**{**T5.__dict__, "name": "t"}), data, 2)
    assert np.all(cm.stage_cost([1, 2], [64, 96], [16, 48]).time_ms > 0)
    assert all(v > 0 for v in cm.attention_call_ms) and cm.attention_call_ms == tuple(
        data["attention_call_ms"][k] for k in ("fw", "bw"))
    # The layers' backwards were timed split: a weight part within each backward; the embedding
    # and the LM head keep whole backwards.
    for op in ("encoder_layer", "decoder_layer"):
        weight = ops[op]["bw_weight_ms"]
        assert weight.shape == ops[op]["bw_ms"].shape
        assert np.all(weight > 0) and np.all(weight <= ops[op]["bw_ms"])
    assert "bw_weight_ms" not in data["ops"]["embedding"] and "bw_weight_ms" not in data["ops"]["output"]
    assert all(0 < float(cm.weight_share(layout, 2, 96, 48, "none")) < 1 for layout in cm.layouts)
    # The TP2 group's figures are one rank's: the heads, the MLP and (sequence parallelism) the
    # sequence are split, so a layer keeps less than the whole layer does; the profile says so,
    # and prices only TP2-SP runs.
    tp2 = json.loads(paths[2].read_text())
    assert (tp2["tp"], tp2["sequence_parallel"]) == (2, True)
    for op in ("encoder_layer", "decoder_layer"):
        assert np.all(np.asarray(tp2["ops"][op]["stored_mib"]) < ops[op]["stored_mib"])
        assert np.all(np.asarray(tp2["ops"][op]["fw_ms"]) > 0)
        # Split under sequence parallelism too (the weight part repeats the input's all-gather).
        weight = np.asarray(tp2["ops"][op]["bw_weight_ms"])
        assert np.all(weight > 0) and np.all(weight <= np.asarray(tp2["ops"][op]["bw_ms"]))
    with pytest.raises(DynaPipeError, match="measured at tensor-parallel size 2"):
        ProfileCostModel(ModelConfig(**{**T5.__dict__, "name": "t"}), tp2, 2)
    with pytest.raises(DynaPipeError, match="measured at tensor-parallel size 2 with sequence parallelism"):
        ProfileCostModel(ModelConfig(**{**T5.__dict__, "name": "t"}), tp2, 2, tp=TensorParallelConfig(2))
    assert ProfileCostModel(ModelConfig(**{**T5.__dict__, "name": "t"}), tp2, 2, tp=TensorParallelConfig(2, True))
    # bf16 layers keep half the bytes (masks aside); the profile prices bf16 models only.
    half = json.loads(paths["bf16"].read_text())
    assert half["dtype"] == "bf16"
    # The softmax precision is recorded (Megatron's default here: the run's precision).
    assert half["model"]["attention_softmax_in_fp32"] is False and data["model"]["attention_softmax_in_fp32"] is False
    for op in ("encoder_layer", "decoder_layer"):
        assert np.all(np.asarray(half["ops"][op]["stored_mib"]) < 0.75 * ops[op]["stored_mib"])
    with pytest.raises(DynaPipeError, match="measured in bf16 but the model trains in fp32"):
        ProfileCostModel(ModelConfig(**{**T5.__dict__, "name": "t"}), half, 2)
    assert ProfileCostModel(ModelConfig(**{**T5.__dict__, "name": "t", "dtype": "bf16"}), half, 2)


@pytest.mark.parametrize("extra, needle", [
    (["--model", "gpt-tiny", "--dec-seqlens", "16"], "--dec-seqlens measures T5 decoder lengths; add --t5"),
    (["--t5", "--hidden-size", "64", "--num-attention-heads", "4", "--swiglu"], "--t5 --swiglu: T5 stages are built"),
    (["--t5", "--hidden-size", "64", "--num-attention-heads", "4", "--dec-seqlens", "8,4"],
     "--dec-seqlens '8,4': give strictly ascending"),
    (["--t5", "--hidden-size", "64", "--num-attention-heads", "4", "--sequence-parallel"],
     "--sequence-parallel needs --tensor-model-parallel-size 2 or more"),
    (["--t5", "--hidden-size", "64", "--num-attention-heads", "4", "--tensor-model-parallel-size", "2",
      "--sequence-parallel", "--dec-seqlens", "15,32"], "--dec-seqlens holds 15, not a multiple of 2"),
    (["--t5", "--hidden-size", "64", "--num-attention-heads", "4", "--tensor-model-parallel-size", "3"],
     "--tensor-model-parallel-size 3 does not divide --num-attention-heads 4"),
])
def test_profile_command_refuses_what_a_t5_profile_cannot_measure(tmp_path, capsys, extra, needle):
    from dynapipe.cli import main

    rc = main(["profile", "--output", str(tmp_path / "p.json"), "--seqlens", "64,128", *extra])
    assert rc == 2
    err = capsys.readouterr().err
    assert needle in err and not (tmp_path / "p.json").exists()


def test_bench_profile_grid_covers_the_run_lengths():
    from megatron_integration.bench_t5_profile import profile_grids

    assert profile_grids(1024, 256) == ([1, 2, 4], [64, 128, 256, 512, 1024], [32, 64, 128, 256])
    assert profile_grids(300, 20) == ([1, 2, 4], [64, 128, 256, 300], [20])


def test_bench_stage_check_sets_predicted_against_executed_compute(tmp_path):
    """Per stage, the profile's prediction for the traced ops against their traced time."""
    from megatron_integration.bench_t5_profile import format_stage_check, op_fit, stage_check

    cm = ProfileCostModel(T5, t5_profile(), 2)
    ops = [(0, "forward", 2, 128, 64), (0, "backward", 2, 128, 64), (1, "forward", 2, 128, 64),
           (1, "backward", 2, 128, 64), (0, "forward", 1, 256, 32), (1, "forward", 1, 256, 32)]
    for rank in (0, 1):
        events = []
        for it in (0, 1, 2):
            for stage, cat, b, s, d in ops:
                if stage != rank:
                    continue
                c = cm.stage_cost(b, s, d, stage=stage)
                ms = float(c.fw_ms if cat == "forward" else c.bw_ms)
                # Executed: stage 1 twice as slow as predicted, plus 1 ms per op.
                ms = ms * (1 + stage) + 1.0
                events.append({"ph": "X", "cat": cat, "tid": stage, "ts": 0.0, "dur": ms * 1e3,
                               "args": {"iteration": it, "mbs": b, "seqlen": s, "dec_seqlen": d}})
        (tmp_path / f"rank{rank:03d}.json").write_text(json.dumps({"traceEvents": events,
                                                                    "otherData": {"origin_us": 0.0}}))
    check = stage_check(str(tmp_path), [1, 2], cm)
    pred = [sum(float(getattr(cm.stage_cost(b, s, d, stage=k), "fw_ms" if cat == "forward" else "bw_ms"))
                for st, cat, b, s, d in ops if st == k) for k in (0, 1)]
    s0, s1 = check["stages"]
    assert (s0["layers"], s1["layers"]) == ("2+0", "0+2")
    assert s0["predicted_ms"] == pytest.approx(pred[0], abs=0.05)
    assert s0["executed_ms"] == pytest.approx(pred[0] + 3, abs=0.05)
    assert s1["executed_ms"] == pytest.approx(2 * pred[1] + 3, abs=0.05)
    assert check["first_over_last_predicted"] == pytest.approx(pred[0] / pred[1], rel=1e-2)
    assert "stage 1 (0+2)" in format_stage_check("dynapipe", check)
    fit = op_fit(str(tmp_path), [1, 2], cm)
    assert fit["ops"] == 12 and 1.0 < fit["slope"] < 2.2  # between the two stages' slowdowns


def test_bench_stage_check_prices_interleaved_ops_on_their_virtual_stage(tmp_path):
    """On an interleaved placement each traced op is priced on its chunk's layers, not the rank's."""
    from dynapipe.cost.placement import StagePlacement
    from dynapipe.schedule.interleaved import virtual_cost_model
    from megatron_integration.bench_t5_profile import stage_check

    cm = ProfileCostModel(T5, t5_profile(), 2).with_placement(StagePlacement.parse("interleaved", T5, 2))
    virtual = virtual_cost_model(cm)
    for rank in (0, 1):
        events = [{"ph": "X", "cat": "forward", "tid": rank, "ts": 0.0, "dur": 1e3,
                   "args": {"iteration": 1, "mbs": 2, "seqlen": 128, "dec_seqlen": 64, **({"chunk": c} if c else {})}}
                  for c in (0, 1)]
        (tmp_path / f"rank{rank:03d}.json").write_text(json.dumps({"traceEvents": events,
                                                                    "otherData": {"origin_us": 0.0}}))
    check = stage_check(str(tmp_path), [1], cm)
    for rank, row in enumerate(check["stages"]):
        want = sum(float(virtual.stage_cost(2, 128, 64, stage=c * 2 + rank).fw_ms) for c in (0, 1))
        assert row["predicted_ms"] == pytest.approx(want, abs=0.05)
        whole = 2 * float(cm.stage_cost(2, 128, 64, stage=rank).fw_ms)  # each op priced as the whole rank
        assert row["predicted_ms"] < 0.75 * whole


def test_profiler_removes_interference_spikes_without_inventing_times():
    import torch

    from megatron_integration.profiler import suffix_minimum

    measured = torch.tensor([[[1.0, 2.0], [9.0, 3.0]], [[2.0, 8.0], [3.0, 4.0]]])  # 9 and 8: spikes
    out = suffix_minimum(measured)
    assert out[0, 1, 0] == 3.0 and out[1, 0, 1] == 4.0  # lowered to a larger shape's time
    assert torch.all(out <= measured) and set(out.flatten().tolist()) <= set(measured.flatten().tolist())
    for axis in range(3):
        assert torch.all(out.diff(dim=axis) >= 0)


@pytest.mark.parametrize("extra, needle", [
    (["--calibrate-iters", "1"], "--calibrate-iters 1: give 0 (none) or at least 2"),
    (["--calibrate-iters", "2", "--dynapipe-cost-model", "analytic"], "with --dynapipe-cost-model given there is none"),
])
def test_t5_bench_refuses_a_calibration_it_cannot_run(tmp_path, capsys, extra, needle):
    from dynapipe.cli import main

    assert main(["bench", "--model", "t5", "--output", str(tmp_path / "b.json"), *extra]) == 2
    assert needle in capsys.readouterr().err and not (tmp_path / "b.json").exists()


def test_t5_bench_calibrates_by_the_presets_default_unless_told_or_given_a_model():
    from dynapipe.errors import DynaPipeError
    from megatron_integration.bench_t5 import T5_PRESETS, t5_calibrate_iters

    assert T5_PRESETS["tiny"].calibrate_iters == 4
    assert t5_calibrate_iters(None, "tiny", []) == 4
    assert t5_calibrate_iters(None, "long", []) == T5_PRESETS["long"].calibrate_iters
    assert t5_calibrate_iters(0, "tiny", []) == 0 and t5_calibrate_iters(3, "tiny", []) == 3
    # A given cost model has no measured profile to calibrate: the default steps aside ...
    assert t5_calibrate_iters(None, "tiny", ["--dynapipe-cost-model", "analytic"]) == 0
    assert t5_calibrate_iters(None, "tiny", ["--dynapipe-cost-model=p.json"]) == 0
    assert t5_calibrate_iters(0, "tiny", ["--dynapipe-cost-model", "analytic"]) == 0
    # ... and an explicit request is refused, not dropped.
    with pytest.raises(DynaPipeError, match="--calibrate-iters calibrates the profile"):
        t5_calibrate_iters(2, "tiny", ["--dynapipe-cost-model=p.json"])


def test_more_samples_never_cost_less_beyond_the_profiled_lengths():
    # One sample's row doubles over the last measured step, two samples' grows by a fifth
    # (a launch-bound, noisy row): each row's own power law priced two samples of 1,024 tokens
    # 28% below one.
    gpt = load_model_config("gpt-tiny")
    layer = {k: [[1.0, 2.0], [2.0, 2.4]] for k in ("fw_ms", "bw_ms", "stored_mib", "peak_mib")}
    small = {k: [[0.01, 0.01], [0.01, 0.01]] for k in ("fw_ms", "bw_ms", "stored_mib", "peak_mib")}
    cm = ProfileCostModel(gpt, {"format": "dynapipe-profile", "version": 1, "device": "cpu", "dtype": "fp32",
                                "mbs": [1, 2], "seqlen": [256, 512], "model": TINY_WIDTHS,
                                "ops": {"layer": layer, "embedding": small, "output": small}}, 1)
    for s in (512, 768, 1024, 4096):
        one, two = cm.stage_cost(1, s), cm.stage_cost(2, s)
        assert two.time_ms >= one.time_ms and two.stored_mib >= one.stored_mib, s
    # The decoder layer along the encoder length: one sample's series grows faster than two
    # samples' over the last encoder step (quadratically against a power of about 0.5), and
    # stays below it on the grid.
    data = t5_profile()
    dec = np.asarray(data["ops"]["decoder_layer"]["fw_ms"])
    dec[0, :, -2] *= 0.5
    dec[0, :, -1] *= 1.9
    data["ops"]["decoder_layer"]["fw_ms"] = dec.tolist()
    t5 = ProfileCostModel(T5, data, num_stages=2)
    enc = np.array([128, 256, 512, 1024])
    for b in (1, 2):
        assert np.all(t5.stage_cost(b + 1, enc, 32, stage=1).fw_ms >= t5.stage_cost(b, enc, 32, stage=1).fw_ms), b


def test_derived_recompute_levels_of_a_tensor_parallel_t5_profile_are_per_rank():
    # The tables hold one TP rank's figures; what the derived levels add is worked out per rank
    # too: full recompute keeps each layer's input, sequence-sharded under SP, and selective
    # drops the scores' share of what a rank stores (its heads, over its replicated share).
    def model(tp, sp):
        data = {**t5_profile(), "tp": tp, "sequence_parallel": sp}
        return ProfileCostModel(T5, data, 2, tp=TensorParallelConfig(tp, sp))

    one, tp2, sp2 = model(1, False), model(2, False), model(2, True)
    b, s, d = 2, 128, 32
    row = b * T5.hidden_size * 4 / 2**20  # MiB a token of fp32 activations, per sample
    # Stage 0: two encoder layers' inputs; stage 1: two decoder layers' and the encoder output.
    for stage, inputs in ((0, 2 * s * row), (1, (2 * d + s) * row)):
        full = [float(cm.stage_cost(b, s, d, recompute="full", stage=stage).stored_mib) for cm in (one, tp2, sp2)]
        assert full[1] == pytest.approx(full[0]), stage
        assert full[0] - full[2] == pytest.approx(inputs / 2), stage
    # Selective: the same tables, a smaller score share per rank without SP's sharding (the
    # replicated part weighs more against a rank's heads), a larger one with it.
    sel = [float(cm.stage_cost(b, s, d, recompute="selective", stage=0).stored_mib) for cm in (one, tp2, sp2)]
    assert sel[1] > sel[0] and sel[2] < sel[1]


def test_a_t5_profile_fits_its_defaults_to_the_model(tmp_path, monkeypatch):
    # A model of 128 tokens: the default decoder grid stops there (it reached 256, and the error
    # blamed --dec-seqlens, which nobody typed); a --vocab-file is T5's WordPiece, as
    # pretrain_t5.py reads it (GPT-2's BPE asked for --merge-file).
    import dynapipe.cli.profile as cli

    config = tmp_path / "t5.yaml"
    config.write_text("name: t5-128\narch: t5\nnum_layers: 2\nencoder_layers: 1\ndecoder_layers: 1\n"
                      "hidden_size: 64\nnum_attention_heads: 4\nffn_hidden_size: 256\nvocab_size: 512\n"
                      "max_seq_length: 128\ndtype: fp32\n")
    assert cli.default_dec_seqlens(str(config)) == "32,64,128" and cli.default_dec_seqlens(None) == "32,64,128,256"
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(200)]) + "\n")
    seen = {}

    def measured(args, model, mbs, seqlens, dec_seqlens, notes):
        seen.update(dec=dec_seqlens, tokenizer=args.tokenizer_type, vocab=model.unpadded_vocab_size)
        return 0
    monkeypatch.setattr(cli, "_run_t5", measured)
    from dynapipe.cli import main

    assert main(["profile", "--output", str(tmp_path / "p.json"), "--model", str(config), "--mbs", "1"]) == 0
    assert seen["dec"] == [32, 64, 128]
    assert main(["profile", "--output", str(tmp_path / "p.json"), "--t5", "--hidden-size", "64",
                 "--num-attention-heads", "4", "--vocab-file", str(vocab), "--mbs", "1", "--seqlens", "64,128"]) == 0
    assert seen["tokenizer"] == "BertWordPieceLowerCase" and seen["vocab"] >= 205


@pytest.mark.parametrize("axis, values", [("seqlen", [64, float("nan")]), ("mbs", [1, float("nan")]),
                                          ("seqlen", [64, float("inf")]), ("mbs", [True, 2])])
def test_grid_axes_that_are_not_finite_numbers_are_refused(axis, values):
    data = t5_profile()
    data[axis] = values
    with pytest.raises(DynaPipeError, match=f"'{axis}' must be a non-empty list of .*positive numbers"):
        ProfileCostModel(T5, data, num_stages=2)


def test_a_stage_of_several_decoder_layers_keeps_one_encoder_output():
    # Each measured decoder layer keeps the encoder output its cross-attention reads; two layers
    # of one stage read the same copy (measured on megatron-core's layers: two keep twice one
    # layer's bytes less one encoder output), so the stage was priced one copy too many.
    cm = ProfileCostModel(T5, t5_profile(), num_stages=2)  # even split: stage 1 holds both decoder layers
    b, s, d = 2, 128, 64
    one = cm.with_placement(StagePlacement.parse("2+1,0+1", T5, 2))
    two = cm.stage_cost(b, s, d, stage=1).stored_mib
    single = one.stage_cost(b, s, d, stage=1).stored_mib  # one decoder layer, the output layer
    layer = float(cm.tables["decoder_layer"]["stored_mib"](b, d, s))
    encoder_output = b * s * T5.hidden_size * 4 / 2**20
    # Stage 1 of the even split also embeds the decoder's tokens; 2+1,0+1's stage 1 does not.
    embed = float(cm.tables["embedding"]["stored_mib"](b, d))
    assert two - single == pytest.approx(layer - encoder_output + embed)
    assert cm.stage_cost(b, s, d, stage=1, recompute="full").stored_mib > 0


def test_the_derived_selective_peak_adds_what_the_recomputed_cores_save_again():
    # The derived selective level kept the no-recompute peak, though the backward saves a core's
    # scores again (as GPT profiles derive it, dynapipe.cost.profile_t5.selective_rebuild_mib).
    from dynapipe.cost.base import MIB, StageLayout

    cm = ProfileCostModel(T5, t5_profile(), num_stages=2)
    b, s, d = 2.0, 128.0, 64.0
    for layout, tokens, keys in ((StageLayout(0, 1, 0, False, False), s, s),
                                 (StageLayout(0, 0, 1, False, False), d, max(s, d))):
        none, sel = (cm.layout_cost(layout, b, s, d, lv) for lv in ("none", "selective"))
        # What the level stops storing, one core's output (b x tokens x h, fp32) and the bias of
        # the mask the stage passed ([b, 1, tokens, keys], fp32), which a recomputed core may build again.
        rebuilt = (none.stored_mib - sel.stored_mib) + (b * tokens * 64 * 4 + b * tokens * keys * 4) / MIB
        assert float(sel.stored_mib) < float(none.stored_mib)
        assert sel.peak_mib == pytest.approx(none.peak_mib + rebuilt)


def test_a_decoder_length_beyond_the_profile_names_the_flag_that_measures_it():
    from dynapipe.cli.cost import extrapolation_notes

    cm = ProfileCostModel(T5, t5_profile(), num_stages=2)
    notes = extrapolation_notes(cm, [(1, max(ENC), 2 * max(DEC))])
    assert notes == [f"decoder sequence length {2 * max(DEC)} (measured up to {max(DEC)}) is beyond the profile's "
                     f"grid and priced by extrapolation; measure a profile that covers it (`python -m dynapipe "
                     f"profile ... --dec-seqlens ...` up to {2 * max(DEC)}) to price it from measurements"]
    assert extrapolation_notes(cm, [(1, max(ENC), max(DEC))]) == []
