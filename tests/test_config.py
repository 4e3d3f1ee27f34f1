"""Config loading: shipped names, files, and errors that name the file and the key."""
from __future__ import annotations

import pytest

from dynapipe.config import (LinkConfig, load_cluster_config, load_device_config, load_model_config,
                             model_config_from_dict)
from dynapipe.errors import DynaPipeError


@pytest.mark.parametrize("name, layers, hidden", [("gpt-tiny", 4, 64), ("gpt-7b", 32, 4096),
                                                  ("gpt-13b", 40, 5120), ("t5-11b", 48, 1024)])
def test_shipped_models(name, layers, hidden):
    m = load_model_config(name)
    assert m.total_layers == layers and m.hidden_size == hidden
    assert m.is_encoder_decoder == (name == "t5-11b")


def test_t5_shape():
    m = load_model_config("t5-11b")
    assert (m.encoder_layers, m.decoder_layers, m.attention_dim, m.num_layers) == (24, 24, 128 * 128, 48)


@pytest.mark.parametrize("name", ["cpu", "a100-40gb", "h100-80gb", "h200"])
def test_shipped_devices(name):
    d = load_device_config(name)
    assert d.peak_tflops > 0 and 0 < d.achievable_fraction <= 1 and d.memory_mib > d.reserved_mib >= 0


def test_cluster_links():
    c = load_cluster_config("a100-8x")
    assert c.link(0, 7) is c.intra_node and c.link(7, 8) is c.inter_node
    assert LinkConfig(bandwidth_gbps=100.0, latency_ms=0.01).transfer_ms(1e9) == pytest.approx(10.01)


def test_loads_a_path_and_defaults_ffn(tmp_path):
    p = tmp_path / "m.yaml"
    p.write_text("name: m\nnum_layers: 2\nhidden_size: 32\nnum_attention_heads: 4\n")
    m = load_model_config(str(p))
    assert m.ffn_hidden_size == 128 and m.arch == "gpt" and m.dtype_bytes == 2


def _write(tmp_path, text, name="c.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


@pytest.mark.parametrize("text, message", [
    ("name: m\nnum_layers: 2\nhidden_size: 32\nnum_attention_heads: 4\nhiden: 3\n", r"unknown key\(s\) \['hiden'\]"),
    ("name: m\nnum_layers: 2\nhidden_size: 30\nnum_attention_heads: 4\n", "not divisible"),
    ("name: m\nnum_layers: 0\nhidden_size: 32\nnum_attention_heads: 4\n", "num_layers=0"),
    ("name: m\narch: bert\nnum_layers: 2\nhidden_size: 32\nnum_attention_heads: 4\n", "arch='bert'"),
    ("name: m\nnum_layers: 2\nhidden_size: 32\nnum_attention_heads: 4\ndtype: fp8\n", "dtype='fp8'"),
    ("name: m\narch: t5\nhidden_size: 32\nnum_attention_heads: 4\n", "encoder_layers, decoder_layers missing"),
    ("name: m\nnum_layers: 2\nhidden_size: big\nnum_attention_heads: 4\n", "hidden_size='big'"),
    ("name: m\nnum_layers: 2.5\nhidden_size: 32\nnum_attention_heads: 4\n", "num_layers=2.5"),
    ("- 1\n- 2\n", "mapping"),
    ("name: [unclosed\n", "not valid YAML"),
    # A key given twice (the plain YAML loader kept the second silently).
    ("name: m\nnum_layers: 4\nhidden_size: 32\nnum_attention_heads: 4\nnum_layers: 8\n",
     "key 'num_layers' is given twice"),
    ("name: m\nnum_layers: 2\nhidden_size: 32\nnum_attention_heads: 4\nencoder_layers: 2\n",
     "encoder_layers=2 / decoder_layers=0 describe a t5; a gpt counts its layers in num_layers"),
    ("name: m\nnum_layers: 2\nhidden_size: 32\nnum_attention_heads: 4\nmax_seq_length: 1024\n"
     "max_position_embeddings: 10\n", "max_position_embeddings=10 is below max_seq_length=1024"),
])
def test_bad_model_configs(tmp_path, text, message):
    path = _write(tmp_path, text)
    with pytest.raises(DynaPipeError, match=message) as e:
        load_model_config(path)
    assert path in str(e.value)


@pytest.mark.parametrize("text, message", [
    ("name: d\npeak_tflops: 0\nmemory_mib: 10\n", "peak_tflops=0"),
    ("name: d\npeak_tflops: 1\nmemory_mib: 10\nachievable_fraction: 1.5\n", "achievable_fraction=1.5"),
    ("name: d\npeak_tflops: 1\n", "memory_mib missing"),  # not "memory_mib=0", a value never given
    ("name: d\npeak_tflops: 1\nmemory_mib: 0\n", "memory_mib=0"),
    ("name: d\npeak_tflops: 1\nmemory_mib: 10\nop_overhead_ms: -1\n", "op_overhead_ms=-1"),
    ("name: d\npeak_tflops: 1\nmemory_mib: 10\nreserved_mib: 20\n", "reserved_mib=20"),
    ("name: d\npeak_tflops: fast\nmemory_mib: 10\n", "peak_tflops='fast'"),
    ("peak_tflops: 1\nmemory_mib: 10\n", "^[^ ]*c.yaml: name missing; see the shipped configs"),  # not a TypeError
    ("name: d\npeak_tflops: 1\nmemory_mib: 10\ndropout_mask_bytes: 1000\n",
     r"dropout_mask_bytes=1000 must be 1 \(a bool mask, as on CUDA\), 2 or 4"),
    ("name: d\npeak_tflops: 1e2\nmemory_mib: 10\n", r"peak_tflops='1e2' must be a number \(YAML reads 1e2 as text"),
    ("name: d\npeak_tflops: 1\nmemory_mib: 4e4\n", r"memory_mib='4e4' must be a number .* as in 4.0e\+4\)"),
])
def test_bad_device_configs(tmp_path, text, message):
    with pytest.raises(DynaPipeError, match=message):
        load_device_config(_write(tmp_path, text))


def test_missing_config_names_the_path():
    with pytest.raises(DynaPipeError, match="'gpt-404' does not exist"):
        load_model_config("gpt-404")


def test_missing_config_lists_the_shipped_names_of_its_kind():
    with pytest.raises(DynaPipeError, match=r"^--model: config file 'gpt-404' does not exist; give a YAML path or a "
                                            r"shipped model name: gpt-13b, gpt-7b, gpt-tiny, t5-11b\.$"):
        load_model_config("gpt-404", flag="--model")
    with pytest.raises(DynaPipeError, match=r"^config file 'h200' does not exist \('h200' is a shipped device config, "
                                            r"not a cluster one\); give a YAML path or a shipped cluster name: "
                                            r"a100-8x, cpu-local, h100-8x, h200-8x\.$"):
        load_cluster_config("h200")
    assert load_cluster_config("h200-8x.yaml").gpus_per_node == load_cluster_config("h200-8x").gpus_per_node


def test_a_file_named_like_a_shipped_config_is_refused_as_ambiguous(tmp_path, monkeypatch):
    from dynapipe.data.synthetic import load_mixture

    monkeypatch.chdir(tmp_path)
    (tmp_path / "flan-mixture").write_text("{}\n")  # what `advise --output flan-mixture` would leave here
    with pytest.raises(DynaPipeError, match=r"^--mixture: 'flan-mixture' names both a file in the working directory "
                                            r"and a shipped mixture config; give \./flan-mixture for the file or "):
        load_mixture("flan-mixture", flag="--mixture")
    with pytest.raises(DynaPipeError, match="a mixture needs a non-empty 'tasks' list"):
        load_mixture("./flan-mixture", flag="--mixture")  # the file, asked for as a path
    assert load_mixture("flan-mixture.yaml").tasks  # the shipped one by its file name
    (tmp_path / "my-mixture").write_text("{}\n")  # a bare name that is no shipped config stays a path
    with pytest.raises(DynaPipeError, match="my-mixture: a mixture needs"):
        load_mixture("my-mixture")


def test_a_folder_named_like_a_shipped_config_is_no_config(tmp_path, monkeypatch):
    # An output folder called gpt-tiny in the working directory: the shipped model is meant.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "gpt-tiny").mkdir()
    assert load_model_config("gpt-tiny").name == "gpt-tiny"
    with pytest.raises(DynaPipeError, match="'elsewhere' is a directory; give a model config YAML file"):
        (tmp_path / "elsewhere").mkdir()
        load_model_config("elsewhere")
    # inf is text to YAML 1.1 too, and no spelling makes it a number a config takes.
    p = _write(tmp_path, "name: d\npeak_tflops: inf\nmemory_mib: 10\n")
    with pytest.raises(DynaPipeError, match=r"peak_tflops='inf' must be a number\.$"):
        load_device_config(p)


def test_bad_cluster_link(tmp_path):
    with pytest.raises(DynaPipeError, match="intra_node"):
        load_cluster_config(_write(tmp_path, "name: c\nintra_node: {bandwidth: 3}\n"))


def test_model_from_dict_validates():
    with pytest.raises(DynaPipeError, match="num_attention_heads=0"):
        model_config_from_dict({"name": "x", "num_layers": 1, "hidden_size": 8, "num_attention_heads": 0})
    # A key left out is named as missing, not as its default of 0.
    with pytest.raises(DynaPipeError, match="m.yaml: hidden_size, num_layers missing; a model config gives"):
        model_config_from_dict({"name": "x", "num_attention_heads": 2}, "m.yaml")
    with pytest.raises(DynaPipeError, match="m.yaml: decoder_layers missing"):
        model_config_from_dict({"name": "x", "arch": "t5", "encoder_layers": 2, "hidden_size": 8,
                                "num_attention_heads": 2}, "m.yaml")


_LINKS = "intra_node: {bandwidth_gbps: 150.0, latency_ms: 0.01}\ninter_node: {bandwidth_gbps: 25.0, latency_ms: 0.02}\n"


@pytest.mark.parametrize("text, message", [
    ("name: c\n" + _LINKS.replace("150.0", "0"), r"intra_node: bandwidth_gbps=0 must be > 0"),
    ("name: c\n" + _LINKS.replace("25.0", "-5"), r"inter_node: bandwidth_gbps=-5 must be > 0"),
    ("name: c\n" + _LINKS.replace("0.02", "-1"), r"inter_node: latency_ms=-1 must be >= 0"),
    ("name: c\ngpus_per_node: 0\n" + _LINKS, r"gpus_per_node=0 must be a whole number, at least 1"),
    ("name: c\ngpus_per_node: -8\n" + _LINKS, r"gpus_per_node=-8 must be a whole number, at least 1"),
    ("name: c\nintra_node: {bandwidth_gbps: .nan}\n", r"bandwidth_gbps=nan must be a finite number"),
    # A link left out is not priced at a default nobody gave.
    ("name: c\n" + _LINKS.splitlines()[0] + "\n", r"inter_node missing; a cluster config gives both links"),
    ("name: c\ngpus_per_node: 8\n", r"intra_node and inter_node missing"),
    # YAML 1.1 reads an exponent without a dot and a sign as text: the fix is named.
    ("name: c\n" + _LINKS.replace("25.0", "2.5e1"),
     r"bandwidth_gbps='2.5e1' must be a number \(YAML reads 2.5e1 as text: a number with an exponent needs a dot "
     r"and a signed exponent, as in 2.5e\+1\)"),
    ("name: c\n" + _LINKS.replace("0.02", "2e-2"), r"latency_ms='2e-2' must be a number .* as in 2.0e-2\)"),
])
def test_cluster_values_are_range_checked(tmp_path, text, message):
    path = _write(tmp_path, text)
    with pytest.raises(DynaPipeError, match=message) as e:
        load_cluster_config(path)
    assert path in str(e.value)


def test_negative_kv_channels_refused():
    with pytest.raises(DynaPipeError, match="kv_channels=-1"):
        model_config_from_dict({"name": "x", "num_layers": 1, "hidden_size": 8, "num_attention_heads": 2,
                                "kv_channels": -1})
