"""A measured cost profile prices only a model of the shape it was measured on: hidden size,
heads, FFN width, per-head width and norm are compared where the profile records them."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from dynapipe.cli import main
from dynapipe.config import load_device_config, load_model_config
from dynapipe.cost import build_cost_model
from dynapipe.cost.profile import ProfileCostModel
from dynapipe.errors import DynaPipeError
from profile_widths import TINY_WIDTHS

TINY = load_model_config("gpt-tiny")  # hidden 64, 4 heads, FFN 256, fp32
# What `python -m dynapipe profile --model gpt-tiny` records of the model it measured.
TINY_RECORD = {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "ffn_hidden_size": 256,
               "kv_channels": 16, "vocab_size": 512, "gated_linear_unit": False, "num_query_groups": 0,
               "add_bias_linear": True, "add_qkv_bias": False, "qk_layernorm": False, "normalization": "LayerNorm"}


def _profile(model: dict, dtype: str = "fp32") -> dict:
    table = {k: [[0.5, 1.0], [1.0, 2.0]] for k in ("fw_ms", "bw_ms", "stored_mib", "peak_mib")}
    return {"format": "dynapipe-profile", "version": 2, "kind": "decoder-only", "dtype": dtype, "mbs": [1, 2],
            "seqlen": [64, 128], "model": model, "ops": {"layer": table, "embedding": table, "output": table}}


def _ops_apart(profile: dict) -> dict:
    """``profile`` with its ops' tables scaled apart (layer x1, embedding x10, output x100), so a
    stage's price shows which ops, and how many layers, it was made of."""
    for scale, op in ((1, "layer"), (10, "embedding"), (100, "output")):
        profile["ops"][op] = {f: [[scale * v for v in row] for row in table] for f, table in profile["ops"][op].items()}
    return profile


def _measured(model, profile: dict) -> list:
    """What ``profile`` says each of 2 stages of ``model`` costs at its grid point (mbs 2, seqlen
    128), (fw, bw, stored, peak): its layers' values, plus the embedding's on the first stage and
    the output layer's on the last."""
    def at(op, field):
        return profile["ops"][op][field][1][1]

    n = model.num_layers // 2
    return [[n * at("layer", f) + at(end, f) for f in ("fw_ms", "bw_ms", "stored_mib")]
            + [max(at("layer", "peak_mib"), at(end, "peak_mib"))] for end in ("embedding", "output")]


def _priced(cost_model: ProfileCostModel, recompute: str = "none") -> list:
    return [[float(v) for v in (c.fw_ms, c.bw_ms, c.stored_mib, c.peak_mib)]
            for c in (cost_model.stage_cost(2, 128, recompute=recompute, stage=s) for s in range(2))]


def test_a_profile_of_the_same_shape_prices_the_model():
    profile = _ops_apart(_profile(TINY_RECORD))
    assert _priced(ProfileCostModel(TINY, profile, 2)) == _measured(TINY, profile) == [[24.0, 24.0, 24.0, 20.0],
                                                                                     [204.0, 204.0, 204.0, 200.0]]
    # Layer count and vocabulary are not layer shape: another depth is priced from the same layer.
    deeper = dataclasses.replace(TINY, num_layers=8)
    assert _priced(ProfileCostModel(deeper, profile, 2)) == _measured(deeper, profile)


@pytest.mark.parametrize("change, record", [
    ({"hidden_size": 128, "ffn_hidden_size": 256}, "hidden_size=64 but model 'gpt-tiny' has hidden_size=128"),
    ({"num_attention_heads": 2}, "num_attention_heads=4 but model 'gpt-tiny' has num_attention_heads=2"),
    ({"ffn_hidden_size": 512}, "ffn_hidden_size=256 but model 'gpt-tiny' has ffn_hidden_size=512"),
    ({"kv_channels": 32}, "kv_channels=16 but model 'gpt-tiny' has kv_channels=32"),
    ({"normalization": "RMSNorm"}, "normalization='LayerNorm' but model 'gpt-tiny' has normalization='RMSNorm'"),
])
def test_a_profile_of_another_shape_is_refused(change, record):
    model = dataclasses.replace(TINY, **change)
    with pytest.raises(DynaPipeError, match="the profile was measured on a layer with " + record) as e:
        ProfileCostModel(model, _profile(TINY_RECORD), 2, source="p.json")
    assert str(e.value).startswith("p.json: ") and "\n" not in str(e.value)


def test_kv_channels_compare_as_the_per_head_width_in_effect():
    # kv_channels 0 in a model config means hidden / heads, which is what profiles record.
    assert TINY.kv_channels == 0 and TINY.head_dim == 16
    explicit = ProfileCostModel(dataclasses.replace(TINY, kv_channels=16), _ops_apart(_profile(TINY_RECORD)), 2)
    implied = ProfileCostModel(TINY, _ops_apart(_profile(TINY_RECORD)), 2)
    assert _priced(explicit) == _measured(TINY, explicit.profile)
    # The same width in effect: the same analytic attention shares where a level is derived.
    assert _priced(explicit, "selective") == _priced(implied, "selective")


def test_a_profile_without_the_measured_widths_is_refused_not_trusted():
    # With nothing to compare, a profile stripped of its widths would price any model as measured,
    # however wide: refused, naming what is missing.
    wide = dataclasses.replace(TINY, hidden_size=128)
    for profile, missing in ((_ops_apart(_profile({})), "records no hidden_size, num_attention_heads, ffn_hidden_size"),
                             ({**_ops_apart(_profile({})), "model": None}, "has no 'model'")):
        with pytest.raises(DynaPipeError, match=missing):
            ProfileCostModel(wide, profile, 2)
    # The widths alone are enough: the layer-shape switches a profile does not record keep their defaults.
    narrow = {**_ops_apart(_profile({})), "model": dict(TINY_WIDTHS)}
    assert _priced(ProfileCostModel(TINY, narrow, 2)) == _measured(TINY, narrow)


def test_plan_refuses_a_tiny_models_profile_for_gpt_7b(tmp_path, capsys):
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(_profile(TINY_RECORD, dtype="bf16")))  # precision alone would not tell
    lengths = tmp_path / "l.txt"
    lengths.write_text("100\n200\n")
    rc = main(["plan", "--lengths", str(lengths), "--model", "gpt-7b", "--device", "a100-40gb", "--stages", "4",
               "--profile", str(path)])
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    assert f"{path}: the profile was measured on a layer with hidden_size=64 but model 'gpt-7b' has " \
           "hidden_size=4096" in err
    # Every caller that builds a cost model from the file (training included) gets the check.
    with pytest.raises(DynaPipeError, match="hidden_size=64 but model 'gpt-7b'"):
        build_cost_model(load_model_config("gpt-7b"), None, 4, profile=str(path))


def test_profile_of_a_model_config_records_its_layer_kind(tmp_path):
    """`profile --model CONFIG` measures the config's layer kind (norm, MLP, biases, query
    groups, dropout, positions), so the planner takes the profile for that config."""
    pytest.importorskip("megatron.core")
    config = tmp_path / "rms.yaml"
    config.write_text("name: rms-tiny\narch: gpt\nnum_layers: 2\nhidden_size: 64\nnum_attention_heads: 4\n"
                      "ffn_hidden_size: 128\nvocab_size: 512\nmax_seq_length: 128\ndtype: fp32\n"
                      "normalization: RMSNorm\ngated_linear_unit: true\nadd_bias_linear: false\nnum_query_groups: 2\n"
                      "hidden_dropout: 0.0\nposition_embedding_type: rope\n")
    out = tmp_path / "rms.json"
    # Its own process: a measurement starts a process group.
    result = subprocess.run([sys.executable, "-m", "dynapipe", "profile", "--output", str(out), "--model", str(config),
                             "--mbs", "1", "--seqlens", "32,64", "--repeats", "1", "--warmup", "0", "--threads", "1",
                             "--no-progress"], capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    recorded = json.loads(out.read_text())["model"]
    assert (recorded["normalization"], recorded["gated_linear_unit"], recorded["add_bias_linear"],
            recorded["num_query_groups"]) == ("RMSNorm", True, False, 2)
    # Dropout and positions too (where the command line leaves Megatron's defaults).
    assert (recorded["hidden_dropout"], recorded["attention_dropout"], recorded["position_embedding_type"]) == (
        0.0, 0.1, "rope")
    model = load_model_config(str(config))
    ProfileCostModel(model, json.loads(out.read_text()), 1)


def test_a_profile_prices_only_the_kind_of_device_it_was_measured_on(tmp_path, capsys):
    # The profilers record "cpu" or the CUDA device name; --device still sets the memory.
    paths = {}
    for name, device in (("cpu", "cpu"), ("a100", "NVIDIA A100-SXM4-40GB"), ("h200", "NVIDIA H200")):
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps({**_profile(TINY_RECORD), "device": device}))
    cost = ["cost", "--model", "gpt-tiny", "--stages", "2", "--shape", "4,512"]
    for device, profile, message in (
            ("a100-40gb", "cpu", "the profile was measured on 'cpu', a CPU, but --device a100-40gb is a GPU"),
            ("cpu", "a100", "the profile was measured on 'NVIDIA A100-SXM4-40GB', a GPU, but --device cpu is a CPU"),
            ("h100-80gb", "a100", "the profile was measured on 'NVIDIA A100-SXM4-40GB' (GPU model a100) but "
                                  "--device h100-80gb is GPU model h100")):
        assert main(cost + ["--device", device, "--profile", str(paths[profile])]) == 2
        out, err = capsys.readouterr()
        assert out == "" and f"{paths[profile]}: {message}" in err and err.count("\n") == 1, err
    for device, profile in (("cpu", "cpu"), ("a100-40gb", "a100"), ("h200", "h200")):
        assert main(cost + ["--device", device, "--profile", str(paths[profile])]) == 0, capsys.readouterr().err
    capsys.readouterr()
    # Every caller that builds the cost model gets the CPU/GPU check; the GPU model is compared
    # only for a device config the user named (a default one stands for any GPU).
    h100 = load_device_config("h100-80gb")
    with pytest.raises(DynaPipeError, match="a CPU, but the device config 'h100-80gb' is a GPU"):
        build_cost_model(TINY, h100, 2, profile=str(paths["cpu"]))
    build_cost_model(TINY, h100, 2, profile=str(paths["a100"]))
    build_cost_model(TINY, None, 2, profile=str(paths["cpu"]))
    # Profiles that do not record a device, and device configs whose name says neither, are not compared.
    build_cost_model(TINY, load_device_config("a100-40gb"), 2, profile=str(_write(tmp_path, _profile(TINY_RECORD))))


def test_training_refuses_a_profile_of_another_kind_of_device_at_start_up(tmp_path, gpu_with_te):
    from megatron_integration.arguments import parse_training_args

    path = tmp_path / "cpu.json"
    path.write_text(json.dumps({**_profile(TINY_RECORD), "device": "cpu"}))
    argv = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 128 --vocab-size 512 --micro-batch-size 1 "
            f"--global-batch-size 4 --train-iters 1 --lr 1e-3 --mock-data --use-dynapipe "
            f"--dynapipe-cost-model {path}").split()
    assert parse_training_args(argv, 1, cuda=False).dynapipe.cost_model == str(path)
    with pytest.raises(DynaPipeError, match=f"--dynapipe-cost-model {path}: .* a CPU, but the default "
                                            f"--dynapipe-device h100-80gb is a GPU"):
        parse_training_args(argv, 1, cuda=True)
    # A GPU's device config on CPU ranks is refused for itself, profile or not.
    with pytest.raises(DynaPipeError, match="--dynapipe-device a100-40gb: its dropout_mask_bytes 1 is CUDA's .* these "
                                            "ranks train on CPUs.*; use --dynapipe-device cpu"):
        parse_training_args(argv + ["--dynapipe-device", "a100-40gb"], 1, cuda=False)


def _write(tmp_path, profile: dict):
    path = tmp_path / "plain.json"
    path.write_text(json.dumps(profile))
    return path
