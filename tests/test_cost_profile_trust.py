"""What a cost profile must prove before it prices a run: lengths it can extrapolate from, sane
numbers, the run's vocabulary, dropout and positions, and the GPU named; and extrapolation
that never makes a longer micro-batch cheaper."""
from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from dynapipe.config import load_model_config
from dynapipe.cost.profile import ProfileCostModel
from dynapipe.cost.profile_tables import growth_power
from dynapipe.cost.base import StageLayout
from dynapipe.errors import DynaPipeError

TINY = load_model_config("gpt-tiny")
RECORD = {"hidden_size": 64, "num_attention_heads": 4, "ffn_hidden_size": 256, "kv_channels": 16, "vocab_size": 512,
          "hidden_dropout": 0.1, "attention_dropout": 0.1, "position_embedding_type": "learned_absolute"}


def _profile(**changes) -> dict:
    table = {k: [[0.5, 1.0], [1.0, 2.0]] for k in ("fw_ms", "bw_ms", "stored_mib", "peak_mib")}
    data = {"format": "dynapipe-profile", "version": 2, "kind": "decoder-only", "dtype": "fp32", "mbs": [1, 2],
            "seqlen": [64, 128], "model": dict(RECORD), "ops": {"layer": table, "embedding": table, "output": table}}
    data.update(changes)
    return data


def _layer_fw(cm: ProfileCostModel, seqlens) -> np.ndarray:
    return cm.layout_cost(StageLayout(stage=0, encoder_layers=0, decoder_layers=1, has_embedding=False,
                                       has_output=False), np.ones(len(seqlens)), np.asarray(seqlens, float),
                          np.zeros(len(seqlens)), "none").fw_ms


@pytest.mark.parametrize("last_two, top_ratio", [
    ([4.0, 3.5], 1.0),      # noise: the longest point measured faster than the one before it
    ([0.0, 0.5], 16.0),     # a zero before the last point: the power law would reach 10^34
    ([1.0, 8.0], 16.0),     # cubic (8x at twice the length): capped at attention's square, 4^2 at 4x
])
def test_extrapolation_beyond_the_grid_grows_at_most_quadratically_and_never_falls(last_two, top_ratio):
    table = {k: [[0.5, *last_two], [1.0, *(2 * v for v in last_two)]] for k in ("fw_ms", "bw_ms", "stored_mib",
                                                                              "peak_mib")}
    table["fw_ms"] = [[max(v, 0.1) for v in row] for row in table["fw_ms"]]
    table["bw_ms"] = table["fw_ms"]
    data = _profile(seqlen=[32, 64, 128], ops={"layer": table, "embedding": table, "output": table})
    cm = ProfileCostModel(TINY, data, 1)
    lengths = np.asarray([128.0, 256.0, 512.0])
    at = cm.tables["layer"]["fw_ms"](np.ones(3), lengths)
    assert at[0] == pytest.approx(max(last_two[1], 0.1))
    assert np.all(np.diff(at) >= 0) and at[-1] <= max(last_two[1], 0.1) * top_ratio + 1e-9, at
    fw = _layer_fw(cm, [128, 512, 4096])
    assert np.all(np.diff(fw) >= 0), fw
    # Memory never falls either, and never below the time's rule (a wrong-way parabola is not used).
    memory = cm.tables["layer"]["stored_mib"](np.ones(3), lengths)
    assert memory[0] == pytest.approx(last_two[1]) and np.all(np.diff(memory) >= 0), memory
    assert np.all(memory >= last_two[1] * (lengths / 128) ** growth_power(*last_two, 64, 128) - 1e-12)


@pytest.mark.parametrize("fixed, linear, square", [(0.0, 0.01, 0.0), (2.0, 0.01, 0.0), (0.3, 0.004, 5e-5),
                                                   (-0.2, 0.0, 8e-5)])
def test_memory_and_times_beyond_the_grid_are_exact_on_a_quadratic_in_the_length(fixed, linear, square):
    # Activation memory is a quadratic in the length (linear tensors, attention's scores); a
    # peak whose square term overtakes the rest has a negative fixed part on the grid's last
    # points. A power law through the last two points prices 4x the longest length below it.
    seq = np.asarray([64.0, 128.0, 256.0])

    def mib(s):
        return fixed + linear * s + square * s ** 2

    table = {k: [[mib(s) * b for s in seq] for b in (1, 2)] for k in ("stored_mib", "peak_mib")}
    # Times too, where the quadratic's terms are all positive (a time then grows at most as the
    # square of the length, the cap it is held to).
    ms = (lambda s: 0.3 + 0.004 * s + 5e-5 * s ** 2) if fixed >= 0 else mib
    table.update({k: [[ms(s) * b for s in seq] for b in (1, 2)] for k in ("fw_ms", "bw_ms")})
    data = _profile(seqlen=[int(s) for s in seq], ops={"layer": table, "embedding": table, "output": table})
    cm = ProfileCostModel(TINY, data, 1)
    lengths = np.asarray([300.0, 512.0, 1024.0, 4096.0])
    for b in (1.0, 2.0):
        for field in ("stored_mib", "peak_mib"):
            got = cm.tables["layer"][field](np.full(4, b), lengths)
            np.testing.assert_allclose(got, b * mib(lengths), rtol=1e-9)
        if fixed >= 0:
            np.testing.assert_allclose(cm.tables["layer"]["fw_ms"](np.full(4, b), lengths), b * ms(lengths), rtol=1e-9)
    two_point = mib(seq[-1]) * (4.0 ** growth_power(mib(seq[-2]), mib(seq[-1]), 128, 256))
    if fixed or square:
        assert two_point < 0.97 * mib(1024.0)  # what the power law alone would have planned


def test_growth_power_is_kept_between_flat_and_quadratic():
    assert growth_power(2.0, 1.0, 64, 128) == 0.0
    assert growth_power(1.0, 2.0, 64, 128) == pytest.approx(1.0)
    assert growth_power(1.0, 8.0, 64, 128) == 2.0
    assert math.isfinite(growth_power(0.0, 0.0, 64, 128))


@pytest.mark.parametrize("changes, needle", [
    ({"seqlen": [128], "ops": None}, "'seqlen' [128] has one length; a profile needs at least two"),
    ({"stage_overhead_ms": "abc"}, "'stage_overhead_ms' 'abc' must be a finite number of ms, 0 or more."),
    ({"stage_overhead_ms": [1]}, "'stage_overhead_ms' [1] must be a finite number"),
    ({"stage_overhead_ms": float("nan")}, "'stage_overhead_ms' nan must be a finite number"),
    ({"stage_overhead_ms": -50}, "'stage_overhead_ms' -50 must be a finite number of ms, 0 or more."),
    ({"model": "gpt-tiny"}, "has 'model' of type str; a profile records the shape it was measured on"),
    # A profile whose shape was deleted by hand would otherwise price any model.
    ({"no_model": True}, "has no 'model'; a profile records the shape it was measured on as a 'model' object"),
    ({"model": {"hidden_size": 64}}, "'model' records no num_attention_heads, ffn_hidden_size; without the "
                                     "measured layer's widths"),
    ({"zero_fw": True}, "ops.layer.fw_ms holds a time of 0 ms; a measured time is positive"),
    # numpy would read true as 1 ms and "3.0" as 3 ms.
    ({"bool_fw": True}, "ops.layer.fw_ms holds a value that is not a number (true, false or a string)"),
    ({"text_fw": True}, "ops.layer.fw_ms holds a value that is not a number"),
    ({"mbs": [1.5, 2]}, "'mbs' [1.5, 2] must hold whole numbers of samples"),
    ({"attention_call_ms": {"fw": 1}}, "'attention_call_ms' {'fw': 1} must give both \"fw\" and \"bw\""),
    ({"layer_spec": "bogus"}, "'layer_spec' 'bogus' is not one of local, transformer_engine"),
    ({"threads": 0}, "'threads' 0 must be a whole number of CPU threads"),
    ({"threads": "1"}, "'threads' '1' must be a whole number of CPU threads"),
])
def test_a_profile_that_cannot_price_is_refused_in_one_line(changes, needle):
    data = _profile(**{k: v for k, v in changes.items()
                       if k not in ("zero_fw", "bool_fw", "text_fw", "no_model") and v is not None})
    if changes.get("no_model"):
        del data["model"]
    if changes.get("ops", 0) is None:
        one = {k: [[1.0], [2.0]] for k in ("fw_ms", "bw_ms", "stored_mib", "peak_mib")}
        data["ops"] = {"layer": one, "embedding": one, "output": one}
    if changes.get("zero_fw"):
        data["ops"]["layer"] = {**data["ops"]["layer"], "fw_ms": [[0.0, 1.0], [1.0, 2.0]]}
    for key, bad in (("bool_fw", True), ("text_fw", "3.0")):
        if changes.get(key):
            data["ops"]["layer"] = {**data["ops"]["layer"], "fw_ms": [[bad, 1.0], [1.0, 2.0]]}
    with pytest.raises(DynaPipeError) as e:
        ProfileCostModel(TINY, json.loads(json.dumps(data)), 2, source="p.json")
    assert str(e.value).startswith("p.json: ") and needle in str(e.value) and "\n" not in str(e.value)


def test_the_vocabulary_is_compared_as_megatron_pads_it():
    ProfileCostModel(dataclasses.replace(TINY, vocab_size=500), _profile(), 2)  # 500 pads to 512
    with pytest.raises(DynaPipeError, match="measured on an output layer with vocab_size=512 but model 'gpt-tiny' "
                                            "has vocab_size=50304"):
        ProfileCostModel(dataclasses.replace(TINY, vocab_size=50304), _profile(), 2)


@pytest.mark.parametrize("key, value, needle", [
    ("hidden_dropout", 0.0, "measured with --hidden-dropout 0.1, this run trains with --hidden-dropout 0.0"),
    ("position_embedding_type", "rope", "measured with --position-embedding-type learned_absolute, this run "
                                        "trains with --position-embedding-type rope"),
])
def test_the_profile_cost_model_refuses_a_profile_of_other_dropout_or_positions(key, value, needle):
    # `plan --model CONFIG --profile P` as well as a training run: the model config carries them.
    ProfileCostModel(TINY, _profile(), 2)
    with pytest.raises(DynaPipeError, match=needle):
        ProfileCostModel(dataclasses.replace(TINY, **{key: value}), _profile(), 2)


TRAIN = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 128 --vocab-size 512 "
         "--micro-batch-size 1 --global-batch-size 4 --train-iters 1 --lr 1e-3 --mock-data --use-dynapipe")


@pytest.mark.parametrize("flags, needle", [
    ("--hidden-dropout 0", "the profile was measured with --hidden-dropout 0.1, this run trains with "
                           "--hidden-dropout 0.0"),
    ("--attention-dropout 0", "measured with --attention-dropout 0.1, this run trains with --attention-dropout 0.0"),
    ("--position-embedding-type rope", "measured with --position-embedding-type learned_absolute, this run trains "
                                       "with --position-embedding-type rope"),
])
def test_training_refuses_a_profile_of_other_megatron_layer_flags_at_start_up(tmp_path, flags, needle):
    from megatron_integration.arguments import parse_training_args

    path = tmp_path / "p.json"
    path.write_text(json.dumps(_profile(device="cpu")))
    argv = f"{TRAIN} --dynapipe-cost-model {path}".split()
    assert parse_training_args(argv, 1, cuda=False).dynapipe.cost_model == str(path)
    with pytest.raises(DynaPipeError, match=needle) as e:
        parse_training_args(argv + flags.split(), 1, cuda=False)
    assert str(e.value).startswith(f"--dynapipe-cost-model {path}: ") and "--dynapipe-cost-model analytic" in str(e.value)


def test_training_compares_the_gpu_model_when_the_device_is_named(tmp_path):
    from megatron_integration.arguments import parse_training_args

    path = tmp_path / "h100.json"
    path.write_text(json.dumps(_profile(device="NVIDIA H100 80GB HBM3")))
    argv = f"{TRAIN} --dynapipe-cost-model {path} --transformer-impl local".split()
    parse_training_args(argv, 1, cuda=True)  # the default device stands for any GPU
    with pytest.raises(DynaPipeError, match="a100"):
        parse_training_args(argv + ["--dynapipe-device", "a100-40gb"], 1, cuda=True)


@pytest.mark.parametrize("name, model", [("NVIDIA A100-SXM4-40GB", "a100"), ("NVIDIA H100 80GB HBM3", "h100"),
                                         ("Tesla T4", "t4"), ("NVIDIA L4", "l4"), ("NVIDIA GH200 480GB", "gh200"),
                                         ("NVIDIA RTX A6000", "a6000"), ("NVIDIA L40S", "l40s"), ("a100-40gb", "a100"),
                                         ("cpu", None)])
def test_gpu_models_are_read_from_device_names(name, model):
    # One-digit and two-letter models (T4, L4, GH200, A6000) read as none, so a profile of
    # such a GPU priced an A100 unquestioned.
    from dynapipe.config import load_device_config
    from dynapipe.cost.profile_device import check_profile_device, gpu_model

    assert gpu_model(name) == model
    if model not in (None, "a100"):
        with pytest.raises(DynaPipeError, match="a100"):
            check_profile_device({"device": name}, load_device_config("a100-40gb"), "p.json", compare_model=True)


def test_the_profile_command_measures_up_to_the_models_longest_length():
    from dynapipe.cli.profile import DEFAULT_SEQLENS, default_seqlens

    assert default_seqlens(None) == DEFAULT_SEQLENS
    assert default_seqlens("gpt-tiny") == "64,128,256,512,1024"
    assert default_seqlens("gpt-7b").split(",")[-1] == str(load_model_config("gpt-7b").max_seq_length)


@pytest.mark.parametrize("sp", [False, True])
def test_the_derived_selective_share_splits_as_the_analytic_model_does_under_tp(sp):
    # A profile without the recompute-level tables derives selective's stored memory from the
    # attention scores' share; per TP rank that share is the analytic model's.
    from dynapipe.config import TensorParallelConfig, load_device_config
    from dynapipe.cost.analytic import AnalyticCostModel

    tp = TensorParallelConfig(size=2, sequence_parallel=sp)
    cm = ProfileCostModel(TINY, _profile(tp=2, sequence_parallel=sp, device="cpu"), 1, tp=tp)
    layout = StageLayout(stage=0, encoder_layers=0, decoder_layers=1, has_embedding=False, has_output=False)
    b, s = np.ones(1), np.asarray([1024.0])
    kept = (cm.layout_cost(layout, b, s, s, "selective").stored_mib / cm.layout_cost(layout, b, s, s, "none").stored_mib)
    linear, scores = AnalyticCostModel(TINY, load_device_config("cpu"), 1, tp)._layer_act_bytes(1.0, 1024.0)
    assert kept[0] == pytest.approx(linear / (linear + scores), rel=1e-6)


def test_a_run_longer_than_the_profile_is_told_at_start_up(tmp_path):
    from megatron_integration.profile_check import extrapolation_lines

    path = tmp_path / "p.json"
    path.write_text(json.dumps(_profile(dec_seqlen=[32, 64])))
    assert extrapolation_lines(str(path), True, {"seqlen": ("--seq-length", 128)}) == []
    assert extrapolation_lines(str(path), False, {"seqlen": ("--seq-length", 4096)}) == []
    lines = extrapolation_lines(str(path), True, {"seqlen": ("--encoder-seq-length", 4096),
                                                  "dec_seqlen": ("--decoder-seq-length", 64)})
    assert lines == [f" > cost profile {path}: --encoder-seq-length 4096 is beyond its longest measured length 128; "
                     f"longer micro-batches are priced by extrapolation from its last lengths, which can miss their "
                     f"time and activation memory either way (measure up to 4096 with `python -m dynapipe profile "
                     f"--seqlens ...` to price them from measurements)"]
    # A decoder length beyond the grid names the flag that measures decoder lengths.
    assert extrapolation_lines(str(path), True, {"dec_seqlen": ("--decoder-seq-length", 256)}) == [
        f" > cost profile {path}: --decoder-seq-length 256 is beyond its longest measured length 64; longer "
        f"micro-batches are priced by extrapolation from its last lengths, which can miss their time and activation "
        f"memory either way (measure up to 256 with `python -m dynapipe profile --dec-seqlens ...` to price them "
        f"from measurements)"]
    # A T5 profile's fix measures a T5.
    path.write_text(json.dumps(_profile(dec_seqlen=[32, 64], kind="encoder-decoder")))
    assert "`python -m dynapipe profile --t5 --dec-seqlens ...`" in extrapolation_lines(
        str(path), True, {"dec_seqlen": ("--decoder-seq-length", 256)})[0]


def test_a_profile_of_another_tp_layout_is_named_as_such_before_its_widths():
    # Its padded vocabulary differs too; the cause to name is the layout.
    from dynapipe.config import TensorParallelConfig

    data = _profile()
    data["model"]["vocab_size"] = 50257
    with pytest.raises(DynaPipeError, match="measured at tensor-parallel size 1 without sequence parallelism"):
        ProfileCostModel(dataclasses.replace(TINY, vocab_size=50432), data, 2, tp=TensorParallelConfig(size=2))


def test_training_refuses_a_profile_of_other_layers(tmp_path):
    # Transformer Engine's fused layers and megatron-core's local ones differ in time and memory.
    from megatron_integration.arguments import parse_training_args

    path = tmp_path / "p.json"
    argv = f"{TRAIN} --dynapipe-cost-model {path}".split()
    path.write_text(json.dumps(_profile(device="cpu", layer_spec="transformer_engine")))
    with pytest.raises(DynaPipeError, match="the profile was measured on 'transformer_engine' layers, this run "
                                            "builds 'local' ones"):
        parse_training_args(argv, 1, cuda=False)
    path.write_text(json.dumps(_profile(device="cpu", layer_spec="local")))
    parse_training_args(argv, 1, cuda=False)
    # --dynapipe-placement auto prices Megatron's baselines' split with the profile too.
    baseline = (f"{TRAIN.replace(' --use-dynapipe', '')} --pipeline-model-parallel-size 2 --dynapipe-placement auto "
                f"--dynapipe-cost-model {path}").split()
    parse_training_args(baseline, 2, cuda=False)
    path.write_text(json.dumps(_profile(device="cpu", layer_spec="transformer_engine")))
    with pytest.raises(DynaPipeError, match="measured on 'transformer_engine' layers"):
        parse_training_args(baseline, 2, cuda=False)


def test_a_cpu_profile_of_other_threads_is_refused_on_the_ranks(tmp_path):
    # A CPU layer's time depends on its threads (torchrun gives each rank 1 unless told). Checked on
    # the ranks once their threads are set: a bench parses its methods' flags in a parent process.
    import torch

    from megatron_integration.jobs import run_training
    from megatron_integration.launch import RankUserError
    from megatron_integration.profile_check import check_threads_at_start

    mine = torch.get_num_threads()
    path = tmp_path / "p.json"
    path.write_text(json.dumps(_profile(device="cpu", threads=mine + 1)))
    with pytest.raises(DynaPipeError, match=f"measured with {mine + 1} CPU thread\\(s\\), this rank computes with "
                                            f"{mine} .*--threads {mine}.*OMP_NUM_THREADS={mine + 1}"):
        check_threads_at_start(str(path), True)
    check_threads_at_start(str(path), False)  # DynaPipe off: the profile is not read
    check_threads_at_start(str(path), True, on_cpu=False)  # ranks on GPUs: their threads do not price
    for same in (dict(device="cpu", threads=mine), dict(device="NVIDIA H100 80GB HBM3", threads=mine + 1), {}):
        path.write_text(json.dumps(_profile(**same)))
        check_threads_at_start(str(path), True)
    # A count written as text or a float is no count: it was skipped before, unchecked.
    for bad in ("2", 2.0, 0):
        path.write_text(json.dumps(_profile(device="cpu", threads=bad)))
        with pytest.raises(DynaPipeError, match=f"'threads' {bad!r} must be a whole number of CPU threads"):
            check_threads_at_start(str(path), True)
    path.write_text(json.dumps(_profile(device="cpu", threads=2)))
    with pytest.raises(RankUserError, match="rank 0: --dynapipe-cost-model .* measured with 2 CPU thread\\(s\\), "
                                            "this rank computes with 1 "):
        run_training(f"{TRAIN} --dynapipe-cost-model {path}".split(), 1, timeout_s=120, threads_per_rank=1)
    # A baseline whose split --dynapipe-placement auto prices with the profile checks it too.
    baseline = f"{TRAIN.replace(' --use-dynapipe', '')} --pipeline-model-parallel-size 2 --dynapipe-placement auto"
    with pytest.raises(RankUserError, match="measured with 2 CPU thread\\(s\\), this rank computes with 1 "):
        run_training(f"{baseline} --dynapipe-cost-model {path}".split(), 2, timeout_s=120, threads_per_rank=1)


def test_a_local_layer_profile_cannot_price_a_fused_attention_model():
    # Its tables time, and its derived recompute levels count, a score matrix that a fused
    # kernel never builds: `plan --model CONFIG --profile P` with a config saying fused.
    fused = dataclasses.replace(TINY, fused_attention=True)
    ProfileCostModel(fused, _profile(), 2)  # layers not recorded: nothing to compare
    ProfileCostModel(TINY, _profile(layer_spec="local"), 2)
    ProfileCostModel(fused, _profile(layer_spec="transformer_engine"), 2)
    with pytest.raises(DynaPipeError, match="measured on megatron-core's local layers, whose attention keeps its score "
                                            "matrix, but model 'gpt-tiny' has fused_attention: true"):
        ProfileCostModel(fused, _profile(layer_spec="local"), 2)


def test_cost_and_plan_say_when_a_shape_lies_beyond_the_profile_grid(tmp_path, capsys):
    from dynapipe.cli import main

    path = tmp_path / "p.json"
    path.write_text(json.dumps(_profile(device="cpu")))
    base = ["--model", "gpt-tiny", "--device", "cpu", "--stages", "2", "--profile", str(path)]
    assert main(["cost", *base, "--shape", "2,128"]) == 0
    assert "note:" not in capsys.readouterr().err  # inside the grid: measured
    assert main(["cost", *base, "--shape", "4,512"]) == 0
    err = capsys.readouterr().err
    assert "--shape 4,512: micro-batch size 4 (measured up to 2) is beyond the profile's grid" in err
    assert "sequence length 512 (measured up to 128) is beyond the profile's grid" in err
    # Each note names the profile flag that measures its axis, and how far.
    assert "(`python -m dynapipe profile ... --mbs ...` up to 4)" in err
    assert "(`python -m dynapipe profile ... --seqlens ...` up to 512)" in err
    lengths = tmp_path / "l.txt"
    lengths.write_text("40\n100\n500\n")
    assert main(["plan", *base, "--lengths", str(lengths), "--output", str(tmp_path / "plan.json")]) == 0
    err = capsys.readouterr().err
    assert "note: sequence length 504 (measured up to 128) is beyond the profile's grid" in err


@pytest.mark.parametrize("name, total_mib, config, cluster", [
    ("NVIDIA A100-SXM4-40GB", 40_536, "a100-40gb", "a100-8x"),
    ("NVIDIA H100 80GB HBM3", 81_559, "h100-80gb", "h100-8x"),
    ("NVIDIA H200", 143_771, "h200", "h200-8x"),
    ("NVIDIA A100-SXM4-80GB", 81_920, None, "h100-8x"),   # an A100 of 80 GB: no shipped config has its memory
    ("NVIDIA L40S", 46_068, None, "h100-8x"),
])
def test_a_gpu_run_without_a_device_config_takes_the_shipped_one_of_its_gpu(name, total_mib, config, cluster):
    from dynapipe.cost.profile_device import shipped_config_for_gpu
    from megatron_integration.arguments import parse_training_args
    from megatron_integration.device_default import resolve_default_device

    assert shipped_config_for_gpu(name, total_mib) == config
    argv = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 128 --max-position-embeddings 128 "
            "--vocab-size 128 --micro-batch-size 1 --global-batch-size 2 --train-iters 1 --lr 1e-4 --mock-data "
            "--use-dynapipe --transformer-impl local").split()
    dyn = parse_training_args(argv, 1, cuda=True).dynapipe
    assert dyn.device == "h100-80gb" and not dyn.device_given and dyn.memory_limit_mb is None
    got, note = resolve_default_device(dyn, name, total_mib)
    assert got.cluster == cluster  # an A100's links are half an H100's: its own cluster config prices them
    if config is not None:
        assert got.device == config and got.memory_limit_mb is None
        assert (note is None) == (config == "h100-80gb")
        assert note is None or f"the cluster config {cluster} " in note
        # A cluster the command line named stands; the device's own config is chosen alike at parsing.
        named = parse_training_args(argv + ["--dynapipe-cluster", "h200-8x"], 1, cuda=True).dynapipe
        assert resolve_default_device(named, name, total_mib)[0].cluster == "h200-8x"
        assert parse_training_args(argv + ["--dynapipe-device", config], 1, cuda=True).dynapipe.cluster == cluster
    else:  # h100-80gb's figures, within the memory this GPU has
        assert got.device == "h100-80gb" and got.memory_limit_mb == pytest.approx(total_mib)
        assert name in note and "--dynapipe-device" in note
    # What the command line gave stands.
    given = parse_training_args(argv + ["--dynapipe-memory-limit-mb", "30000"], 1, cuda=True).dynapipe
    if config is None:
        assert resolve_default_device(given, name, total_mib) == (given, None)


def test_a_gpu_run_planned_by_the_analytic_model_is_warned_to_profile(tmp_path):
    # The analytic model priced the one GPU's forwards at 0.1-0.4x their time; a profile fixes that.
    import dataclasses
    import torch
    from megatron_integration.arguments import parse_training_args
    from megatron_integration.device_default import analytic_on_gpu_note

    argv = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 128 --max-position-embeddings 128 "
            "--vocab-size 128 --micro-batch-size 1 --global-batch-size 2 --train-iters 1 --lr 1e-4 --mock-data "
            "--transformer-impl local").split()
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    analytic = parse_training_args(argv + ["--use-dynapipe"], 1, cuda=True).dynapipe
    note = analytic_on_gpu_note(analytic, gpu)
    assert "analytic cost model on a GPU" in note and "--dynapipe-cost-model" in note
    assert analytic_on_gpu_note(analytic, cpu) is None  # the CPU's analytic config is fitted to it
    assert analytic_on_gpu_note(parse_training_args(argv, 1, cuda=True).dynapipe, gpu) is None  # no DynaPipe plans
    profiled = dataclasses.replace(analytic, cost_model=str(tmp_path / "profile.json"))
    assert analytic_on_gpu_note(profiled, gpu) is None


def test_a_profile_of_transformer_engine_layers_plans_no_split_backward():
    """Transformer Engine's layers cannot split their backward: a profile measured on them keeps
    the zero-bubble schedules out of auto's search and refuses them by name, as training does."""
    from dynapipe.pipeline_planner import plan_iteration

    lengths = np.array([60, 100, 128, 30, 90, 120, 64, 77])
    local = ProfileCostModel(TINY, _profile(layer_spec="local"), 2)
    te = ProfileCostModel(TINY, _profile(layer_spec="transformer_engine"), 2, source="te.json")
    assert local.unsplit_backward is None and "te.json was measured on Transformer Engine" in te.unsplit_backward
    assert te.with_placement(te.placement).unsplit_backward == te.unsplit_backward
    tried = {c.schedule for c in plan_iteration(lengths, te, seq_length=128, explain=True).search.candidates}
    assert tried and not tried & {"zb-h1", "interleaved-zb"}
    assert "zb-h1" in {c.schedule for c in plan_iteration(lengths, local, seq_length=128,
                                                           explain=True).search.candidates}
    with pytest.raises(DynaPipeError, match="schedule='zb-h1' splits every backward, but te.json was measured on "
                                            "Transformer Engine layers"):
        plan_iteration(lengths, te, seq_length=128, schedule="zb-h1")
