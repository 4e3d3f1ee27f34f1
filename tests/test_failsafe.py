"""Fail-safety battery: hundreds of bad inputs and injected faults.

Every case must end in one clear line (``error: ...``) and a non-zero exit, or, for a
fault the job is meant to survive, in exactly what an undisturbed run gives. No
traceback, no hang, nothing silently accepted. Most cases call the command lines
in-process; a few go through real subprocesses, the training faults share one spawned
two-rank job, and the Redis cases use a real ``redis-server`` started on a free port.
Plan files (through ``validate``) and store payloads are attacked byte region by byte
region at the end; the format's own tests (``test_plan_bytes.py``) cover each mechanism.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from functools import partial

import numpy as np
import pytest

from dynapipe.cli import main as dynapipe_main
from dynapipe.errors import DynaPipeError

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
PY = sys.executable


def one_line_error(rc, err: str, *needles: str) -> str:
    """The single error line of a failed command; asserts status 2 and no traceback."""
    assert rc == 2, f"exit status {rc}, stderr: {err!r}"
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one line, got {len(lines)}: {err!r}"
    assert lines[0].startswith("error: "), lines[0]
    for needle in needles:
        assert needle in lines[0], f"{needle!r} not in {lines[0]!r}"
    return lines[0]


def run_cli(capsys, argv):
    rc = dynapipe_main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


# ---- files the cases point at -----------------------------------------------------------------

@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Named bad (and a few good) input files."""
    d = tmp_path_factory.mktemp("inputs")
    f = {}

    def text(name, content):
        p = d / name
        p.write_text(content, encoding="utf-8")
        f[name] = str(p)

    def raw(name, content: bytes):
        p = d / name
        p.write_bytes(content)
        f[name] = str(p)

    raw("binary", bytes(range(256)) * 8)
    raw("empty", b"")
    (d / "a_dir").mkdir()
    f["a_dir"] = str(d / "a_dir")
    f["missing"] = str(d / "no-such-file")
    f["under_file"] = str(d / "binary" / "x")
    text("good_lengths", "100\n200\n50\n")
    text("deep.yaml", "a: " + "[" * 800 + "]" * 800 + "\n")
    text("deep.json", "[" * 100000 + "]" * 100000)
    return f


# ---- A. integer and number parsing on every planning command ----------------------------------

BAD_INTS = ["1_000", "\u0661\u0662", "\uff11\uff12", "\u00b2", "12.0", "1e3", "0x10", "abc", "", " 12", "12a",
            "1 000", "+-1", "--", "\u0967"]
BAD_FLOATS = ["nan", "NaN", "inf", "-inf", "Infinity", "1_0", "1e999", "abc", "", "0x1p3", "\u0661", "1e"]

INT_FLAGS = [
    ("synth", ["--samples", "5"], "--samples"),
    ("synth", ["--samples", "5"], "--seed"),
    ("synth", ["--samples", "5"], "--seq-length"),
    ("plan", ["--lengths", "{good_lengths}", "--model", "gpt-tiny", "--device", "cpu", "--stages", "2"], "--dp"),
    ("plan", ["--lengths", "{good_lengths}", "--model", "gpt-tiny", "--device", "cpu", "--stages", "2"],
     "--micro-batch-size"),
    ("plan", ["--lengths", "{good_lengths}", "--model", "gpt-tiny", "--device", "cpu", "--stages", "2"], "--max-tokens"),
    ("plan", ["--lengths", "{good_lengths}", "--model", "gpt-tiny", "--device", "cpu"], "--stages"),
    ("cost", ["--model", "gpt-tiny", "--device", "cpu", "--shape", "1,64"], "--stages"),
    ("cost", ["--model", "gpt-tiny", "--device", "cpu", "--stages", "2", "--shape", "1,64"], "--stage"),
]
FLOAT_FLAGS = [
    ("plan", ["--lengths", "{good_lengths}", "--model", "gpt-tiny", "--device", "cpu", "--stages", "2"],
     "--memory-limit-mb"),
]


def _fill(args, files):
    return [a.format(**files) if "{" in a else a for a in args]


@pytest.mark.parametrize("value", BAD_INTS, ids=ascii)
@pytest.mark.parametrize("command,base,flag", INT_FLAGS, ids=lambda x: x if isinstance(x, str) else None)
def test_integer_flags_take_ascii_digits_only(capsys, files, command, base, flag, value):
    rc, _, err = run_cli(capsys, [command, *_fill(base, files), flag, value])
    one_line_error(rc, err, flag)


@pytest.mark.parametrize("value", BAD_FLOATS, ids=ascii)
@pytest.mark.parametrize("command,base,flag", FLOAT_FLAGS, ids=lambda x: x if isinstance(x, str) else None)
def test_number_flags_take_finite_decimals_only(capsys, files, command, base, flag, value):
    rc, _, err = run_cli(capsys, [command, *_fill(base, files), flag, value])
    one_line_error(rc, err, flag)


# ---- B. lengths files -------------------------------------------------------------------------

LENGTHS = {
    "zero": ("0\n", "must be a positive"),
    "negative": ("5\n-5\n", "line 2"),
    "underscore": ("1_000\n", "not an integer"),
    "arabic_digits": ("\u0661\u0662\n", "not an integer"),
    "fullwidth_digits": ("\uff11\uff12\n", "not an integer"),
    "decimal": ("12.5\n", "not an integer"),
    "exponent": ("1e3\n", "not an integer"),
    "hex": ("0x10\n", "not an integer"),
    "word": ("abc\n", "not an integer"),
    "three_columns": ("1 2 3\n", "3 values"),
    "mixed_columns": ("1\n2 3\n", "line 2"),
    "too_large": ("99999999999999999999999\n", "above"),
    "above_int64": (str(2**63) + "\n", "above"),
    "just_above_limit": (str(2**31) + "\n", "above"),
    "only_comments": ("# nothing\n\n", "empty"),
    "nul_bytes": ("\x00\x01\n", "not an integer"),
    "lone_surrogate_escape": ("\\ud800\n", "not an integer"),
}


@pytest.mark.parametrize("name", sorted(LENGTHS))
def test_bad_lengths_files(capsys, tmp_path, name):
    content, needle = LENGTHS[name]
    p = tmp_path / "lengths.txt"
    p.write_text(content, encoding="utf-8")
    rc, _, err = run_cli(capsys, ["plan", "--lengths", p, "--model", "gpt-tiny", "--device", "cpu", "--stages", "2"])
    one_line_error(rc, err, str(p), needle)


@pytest.mark.parametrize("which,needle", [("binary", "not a text file"), ("a_dir", "directory"),
                                          ("missing", "does not exist"), ("empty", "empty"),
                                          ("under_file", "lengths file")])
def test_lengths_file_paths(capsys, files, which, needle):
    rc, _, err = run_cli(capsys, ["plan", "--lengths", files[which], "--model", "gpt-tiny", "--device", "cpu",
                                  "--stages", "2"])
    one_line_error(rc, err, needle)


# ---- C. model, device, cluster, mixture and profile files ---------------------------------------

MODEL_YAML = {
    "list": ("- 1\n- 2\n", "mapping"),
    "scalar": ("42\n", "mapping"),
    "bad_yaml": ("a: [1, 2\n", "not valid YAML"),
    "tabs": ("name: x\n\tarch: gpt\n", "not valid YAML"),
    "unknown_key": ("name: x\nnum_layers: 2\nhidden_size: 64\nnum_attention_heads: 4\nwings: 2\n", "unknown key"),
    "string_int": ("name: x\nnum_layers: two\nhidden_size: 64\nnum_attention_heads: 4\n", "num_layers"),
    "bool_int": ("name: x\nnum_layers: true\nhidden_size: 64\nnum_attention_heads: 4\n", "num_layers"),
    "float_int": ("name: x\nnum_layers: 2.5\nhidden_size: 64\nnum_attention_heads: 4\n", "num_layers"),
    "zero_layers": ("name: x\nnum_layers: 0\nhidden_size: 64\nnum_attention_heads: 4\n", "num_layers"),
    "negative_hidden": ("name: x\nnum_layers: 2\nhidden_size: -64\nnum_attention_heads: 4\n", "hidden_size"),
    "indivisible_heads": ("name: x\nnum_layers: 2\nhidden_size: 64\nnum_attention_heads: 5\n", "divisible"),
    "bad_arch": ("name: x\narch: rnn\nnum_layers: 2\nhidden_size: 64\nnum_attention_heads: 4\n", "arch"),
    "bad_dtype": ("name: x\ndtype: fp8\nnum_layers: 2\nhidden_size: 64\nnum_attention_heads: 4\n", "dtype"),
    "t5_no_layers": ("name: x\narch: t5\nhidden_size: 64\nnum_attention_heads: 4\n", "encoder_layers"),
    "huge_exponent": ("name: x\nnum_layers: 2\nhidden_size: 64\nnum_attention_heads: 4\nmax_seq_length: 1e400\n",
                      "max_seq_length"),
}
DEVICE_YAML = {
    "nan_tflops": ("name: d\npeak_tflops: .nan\nmemory_mib: 100\n", "finite"),
    "inf_memory": ("name: d\npeak_tflops: 1\nmemory_mib: .inf\n", "finite"),
    "zero_tflops": ("name: d\npeak_tflops: 0\nmemory_mib: 100\n", "peak_tflops"),
    "fraction_above_one": ("name: d\npeak_tflops: 1\nmemory_mib: 100\nachievable_fraction: 2\n", "achievable_fraction"),
    "reserved_above_memory": ("name: d\npeak_tflops: 1\nmemory_mib: 100\nreserved_mib: 200\n", "reserved_mib"),
    "negative_overhead": ("name: d\npeak_tflops: 1\nmemory_mib: 100\nop_overhead_ms: -1\n", "op_overhead_ms"),
    "string_memory": ("name: d\npeak_tflops: 1\nmemory_mib: lots\n", "memory_mib"),
    "missing_tflops": ("name: d\nmemory_mib: 100\n", "peak_tflops"),
    "list": ("[1, 2]\n", "mapping"),
}
CLUSTER_YAML = {
    "link_not_mapping": ("name: c\nintra_node: fast\n", "mapping"),
    "link_unknown_key": ("name: c\nintra_node: {speed: 1}\n", "unknown key"),
    "link_string": ("name: c\nintra_node: {bandwidth_gbps: fast}\n", "bandwidth_gbps"),
    "link_nan": ("name: c\ninter_node: {bandwidth_gbps: .nan}\n", "finite"),
    "gpus_string": ("name: c\ngpus_per_node: eight\n", "gpus_per_node"),
    "list": ("- a\n", "mapping"),
}
SHARED_BAD_FILES = {"binary": "not UTF-8", "a_dir": "directory", "missing": "does not exist",
                    "empty": "mapping", "deep.yaml": "nested too deeply"}


def _cost_argv(model="gpt-tiny", device="cpu", cluster=None):
    return ["cost", "--model", model, "--device", device, "--stages", "2", "--shape", "1,64"]


@pytest.mark.parametrize("name", sorted(MODEL_YAML))
def test_bad_model_configs(capsys, tmp_path, name):
    content, needle = MODEL_YAML[name]
    p = tmp_path / "model.yaml"
    p.write_text(content)
    rc, _, err = run_cli(capsys, _cost_argv(model=str(p)))
    one_line_error(rc, err, str(p), needle)


@pytest.mark.parametrize("name", sorted(DEVICE_YAML))
def test_bad_device_configs(capsys, tmp_path, name):
    content, needle = DEVICE_YAML[name]
    p = tmp_path / "device.yaml"
    p.write_text(content)
    rc, _, err = run_cli(capsys, _cost_argv(device=str(p)))
    one_line_error(rc, err, str(p), needle)


@pytest.mark.parametrize("name", sorted(CLUSTER_YAML))
def test_bad_cluster_configs(capsys, tmp_path, files, name):
    content, needle = CLUSTER_YAML[name]
    p = tmp_path / "cluster.yaml"
    p.write_text(content)
    rc, _, err = run_cli(capsys, ["plan", "--lengths", files["good_lengths"], "--model", "gpt-tiny", "--device",
                                  "cpu", "--stages", "2", "--cluster", p])
    one_line_error(rc, err, needle)


@pytest.mark.parametrize("which", sorted(SHARED_BAD_FILES))
@pytest.mark.parametrize("role", ["--model", "--device", "--cluster"])
def test_unreadable_config_files(capsys, files, role, which):
    argv = ["plan", "--lengths", files["good_lengths"], "--model", "gpt-tiny", "--device", "cpu", "--stages", "2"]
    if role == "--cluster":
        argv += ["--cluster", files[which]]
    else:
        argv[argv.index(role) + 1] = files[which]
    rc, _, err = run_cli(capsys, argv)
    one_line_error(rc, err, SHARED_BAD_FILES[which])


PROFILES = {
    "not_json": ("{", "not valid JSON"),
    "list": ("[]", "profile"),
    "no_ops": (json.dumps({"format": "dynapipe-profile", "version": 1, "mbs": [1], "seqlen": [64]}), "profile"),
    "nan_table": ("NaN", "profile"),
}


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_bad_profiles(capsys, tmp_path, name):
    content, needle = PROFILES[name]
    p = tmp_path / "profile.json"
    p.write_text(content)
    rc, _, err = run_cli(capsys, [*_cost_argv(), "--profile", p])
    one_line_error(rc, err, needle)


@pytest.mark.parametrize("which,needle", [("binary", "not UTF-8"), ("a_dir", "directory"), ("missing", "does not exist"),
                                          ("empty", "not valid JSON"), ("deep.json", "nested too deeply")])
def test_unreadable_profiles(capsys, files, which, needle):
    rc, _, err = run_cli(capsys, [*_cost_argv(), "--profile", files[which]])
    one_line_error(rc, err, needle)


MIXTURES = {
    "no_tasks": ("other: 1\n", "tasks"),
    "tasks_not_list": ("tasks: 3\n", "tasks"),
    "task_not_mapping": ("tasks: [3]\n", "task 0"),
    "unknown_field": ("tasks: [{name: a, weight: 1, median_input: 5, sigma_input: 1, median_target: 5, "
                      "sigma_target: 1, colour: red}]\n", "task 0"),
    "string_weight": ("tasks: [{name: a, weight: heavy, median_input: 5, sigma_input: 1, median_target: 5, "
                      "sigma_target: 1}]\n", "weight"),
    "nan_weight": ("tasks: [{name: a, weight: .nan, median_input: 5, sigma_input: 1, median_target: 5, "
                   "sigma_target: 1}]\n", "weight"),
    "zero_weight": ("tasks: [{name: a, weight: 0, median_input: 5, sigma_input: 1, median_target: 5, "
                    "sigma_target: 1}]\n", "weight"),
    "negative_sigma": ("tasks: [{name: a, weight: 1, median_input: 5, sigma_input: -1, median_target: 5, "
                       "sigma_target: 1}]\n", "sigma"),
}


@pytest.mark.parametrize("name", sorted(MIXTURES))
def test_bad_mixtures(capsys, tmp_path, name):
    content, needle = MIXTURES[name]
    p = tmp_path / "mixture.yaml"
    p.write_text(content)
    rc, _, err = run_cli(capsys, ["synth", "--samples", "5", "--mixture", p])
    one_line_error(rc, err, needle)


@pytest.mark.parametrize("which,needle", [("binary", "not UTF-8"), ("a_dir", "directory"), ("missing", "does not exist"),
                                          ("empty", "mapping"), ("deep.yaml", "nested too deeply")])
def test_unreadable_mixtures(capsys, files, which, needle):
    rc, _, err = run_cli(capsys, ["synth", "--samples", "5", "--mixture", files[which]])
    one_line_error(rc, err, needle)


# ---- D. command-specific values -----------------------------------------------------------------

SYNTH = [
    (["--samples", "0"], "--samples 0"),
    (["--samples", "-3"], "--samples -3"),
    (["--samples", "1000000000"], "at most"),
    (["--samples", "5", "--seed", "-1"], "--seed -1"),
    (["--samples", "5", "--seq-length", "1"], "--seq-length 1"),
    (["--samples", "5", "--seq-length", "-4"], "--seq-length"),
    (["--samples", "5", "--output", "{a_dir}"], "--output"),
    (["--samples", "5", "--output", "{under_file}"], "--output"),
    (["--samples", "5", "--output", "/proc/version"], "--output"),
    (["--samples"], "--samples"),
    ([], "--samples"),
    (["--samples", "5", "--colour", "red"], "unrecognized"),
]


@pytest.mark.parametrize("args,needle", SYNTH, ids=lambda x: " ".join(x) if isinstance(x, list) else None)
def test_synth_bad_values(capsys, files, args, needle):
    rc, _, err = run_cli(capsys, ["synth", *_fill(args, files)])
    one_line_error(rc, err, needle)


SHAPES = [("1,99999", "max_seq_length"), ("1,1025", "max_seq_length"), ("0,128", "positive"), ("-1,128", "--shape"),
          ("1", "MBS,SEQLEN"), ("1,2,3", "MBS,SEQLEN"), ("a,b", "integers"), ("1_0,128", "integers"),
          ("\u0661,128", "integers"), ("1,128,", "integers"), ("", "integers"), (",", "integers"),
          ("1.5,128", "integers"), ("1,1e3", "integers"), ("99999999999999999999,64", "integers")]


@pytest.mark.parametrize("shape,needle", SHAPES, ids=ascii)
def test_cost_bad_shapes(capsys, shape, needle):
    rc, _, err = run_cli(capsys, ["cost", "--model", "gpt-tiny", "--device", "cpu", "--stages", "2", "--shape", shape])
    one_line_error(rc, err, "--shape", needle)


PLAN = [
    (["--stages", "0"], "stages"),
    (["--stages", "-2"], "stages"),
    (["--stages", "99"], "layers"),
    (["--stages", "2", "--dp", "0"], "--dp"),
    (["--stages", "2", "--memory-limit-mb", "0"], "--memory-limit-mb"),
    (["--stages", "2", "--memory-limit-mb", "-5"], "--memory-limit-mb"),
    (["--stages", "2", "--memory-limit-mb", "0.001"], "--memory-limit-mb"),
    (["--stages", "2", "--batching", "nonsense"], "--batching"),
    (["--stages", "2", "--schedule", "zigzag"], "--schedule"),
    (["--stages", "2", "--recompute", "some"], "--recompute"),
    (["--stages", "2", "--output", "{a_dir}"], "--output"),
    (["--stages", "2", "--output", "{under_file}"], "--output"),
    (["--stages", "2", "--plan-out", "{under_file}"], "Not a directory"),
    (["--stages", "2", "--plan-out", "{binary}"], "binary"),
]


@pytest.mark.parametrize("args,needle", PLAN, ids=lambda x: " ".join(x) if isinstance(x, list) else None)
def test_plan_bad_values(capsys, files, args, needle):
    rc, _, err = run_cli(capsys, ["plan", "--lengths", files["good_lengths"], "--model", "gpt-tiny", "--device", "cpu",
                                  *_fill(args, files)])
    one_line_error(rc, err, needle)


@pytest.mark.parametrize("argv", [["frobnicate"], ["plan"], ["cost", "--model"], ["--colour"],
                                  ["synth", "--samples", "5", "--samples"]], ids=" ".join)
def test_bad_command_lines(capsys, argv):
    rc, _, err = run_cli(capsys, argv)
    one_line_error(rc, err)


# ---- E. Megatron training arguments (validated before any process group starts) ------------------

TRAIN_BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --micro-batch-size 2 "
              "--global-batch-size 4 --train-iters 2 --lr 1e-3 --mock-data").split()
TRAIN_INT_FLAGS = ["--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length", "--micro-batch-size",
                   "--global-batch-size", "--train-iters", "--seed", "--vocab-size", "--pipeline-model-parallel-size",
                   "--log-interval", "--dynapipe-prefetch", "--dynapipe-redis-port", "--dynapipe-planner-workers"]
TRAIN_FLOAT_FLAGS = ["--lr", "--min-lr", "--weight-decay", "--clip-grad", "--adam-eps", "--adam-beta1",
                     "--hidden-dropout", "--init-method-std", "--dynapipe-timeout-s", "--dynapipe-memory-limit-mb",
                     "--dynapipe-store-retry-s"]
TRAIN_INVALID = [
    (["--global-batch-size", "5"], "--global-batch-size 5"),
    (["--fp16", "--bf16"], "--fp16"),
    (["--bf16"], "--bf16"),
    (["--hidden-size", "66"], "divisible"),
    (["--seq-length", "128", "--max-position-embeddings", "64"], "--max-position-embeddings"),
    (["--lr", "-1"], "--lr"),
    (["--train-iters", "0"], "--train-iters"),
    (["--hidden-dropout", "1.5"], "--hidden-dropout"),
    (["--pipeline-model-parallel-size", "2"], "world size"),
    (["--dynapipe-store-retry-s", "-1"], "--dynapipe-store-retry-s"),
    (["--dynapipe-redis-port", "0"], "--dynapipe-redis-port"),
    (["--dynapipe-redis-port", "70000"], "--dynapipe-redis-port"),
    (["--save", "{binary}"], "--save"),
    (["--save", "{under_file}"], "--save"),
    (["--save", "/proc/self"], "--save"),
    (["--load", "{missing}"], "--load"),
    (["--load", "{binary}"], "--load"),
    (["--save-interval", "1"], "--save-interval"),
    (["--dynapipe-cost-model", "{missing}"], "--dynapipe-cost-model"),
    (["--dynapipe-cost-model", "{a_dir}"], "--dynapipe-cost-model"),
    (["--dynapipe-mixture", "{a_dir}"], "--dynapipe-mixture"),
    (["--dynapipe-batching", "token-budget", "--use-dynapipe"], "--dynapipe-max-tokens"),
    (["--dynapipe-batching", "dynapipe"], "--use-dynapipe"),
    (["--reset-position-ids"], "packing"),
    (["--dynapipe-overlong", "drop"], "--dynapipe-overlong"),
    (["--position-embedding-type", "alibi"], "--position-embedding-type"),
    (["--use-distributed-optimizer"], "GPU"),
    (["--data-path", "{missing}"], "--data-path"),
    (["--colour", "red"], "unrecognized"),
    (["--lr"], "--lr"),
]


def _pretrain_main():
    spec = importlib.util.spec_from_file_location("pretrain_gpt_script", os.path.join(ROOT, "scripts", "pretrain_gpt.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


@pytest.fixture(scope="module")
def pretrain_main():
    import megatron_integration.training  # noqa: F401  (megatron's import-time notices go out here, not in a case)

    return _pretrain_main()


def run_pretrain(capsys, pretrain_main, argv):
    try:
        rc = pretrain_main([str(a) for a in argv])
    except SystemExit as e:  # argparse's exit, as the script's own process would see it
        rc = e.code
    out, err = capsys.readouterr()
    return rc, err


@pytest.mark.parametrize("value", ["1_000", "\u0661\u0662", "12.0", "abc", "0x10", "\uff18"], ids=ascii)
@pytest.mark.parametrize("flag", TRAIN_INT_FLAGS)
def test_training_integer_flags(capsys, pretrain_main, flag, value):
    rc, err = run_pretrain(capsys, pretrain_main, [*TRAIN_BASE, flag, value])
    one_line_error(rc, err, flag)


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1_0", "1e999"], ids=ascii)
@pytest.mark.parametrize("flag", TRAIN_FLOAT_FLAGS)
def test_training_number_flags(capsys, pretrain_main, flag, value):
    rc, err = run_pretrain(capsys, pretrain_main, [*TRAIN_BASE, flag, value])
    one_line_error(rc, err, flag)


@pytest.mark.parametrize("args,needle", TRAIN_INVALID, ids=lambda x: " ".join(x) if isinstance(x, list) else None)
def test_training_invalid_arguments(capsys, pretrain_main, files, args, needle):
    argv = list(TRAIN_BASE)
    if "--data-path" in args:
        argv.remove("--mock-data")
    rc, err = run_pretrain(capsys, pretrain_main, [*argv, *_fill(args, files)])
    one_line_error(rc, err, needle)


RUN_CONFIGS = {
    "bad_yaml": ("args: [1\n", "not valid YAML"),
    "unknown_top": ("launch: {}\nargs: {}\nextra: 1\n", "unexpected"),
    "args_list": ("args: [1, 2]\n", "args"),
    "world_mismatch": ("launch: {nnodes: 1, nproc_per_node: 8}\nargs: {}\n", "8 ranks"),
}


@pytest.mark.parametrize("name", sorted(RUN_CONFIGS))
def test_bad_run_configs(capsys, pretrain_main, tmp_path, name):
    content, needle = RUN_CONFIGS[name]
    p = tmp_path / "run.yaml"
    p.write_text(content)
    rc, err = run_pretrain(capsys, pretrain_main, ["--run-config", p, *TRAIN_BASE])
    one_line_error(rc, err, needle)


@pytest.mark.parametrize("which,needle", [("binary", "not UTF-8"), ("a_dir", "directory"), ("missing", "no such file"),
                                          ("deep.yaml", "nested too deeply")])
def test_unreadable_run_configs(capsys, pretrain_main, files, which, needle):
    rc, err = run_pretrain(capsys, pretrain_main, ["--run-config", files[which], *TRAIN_BASE])
    one_line_error(rc, err, needle)


# ---- F. data: checked where it enters, naming the file and the document --------------------------

def _indexed(path, seqs, dtype=np.int32):
    from dynapipe.data.indexed import write_indexed_dataset

    write_indexed_dataset(str(path), [np.asarray(s) for s in seqs], dtype=dtype)
    return str(path)


def _truncate(path, size):
    with open(path, "r+b") as f:
        f.truncate(size if size >= 0 else os.path.getsize(path) + size)


def _idx_case(tmp_path, name):
    p = tmp_path / "data"
    good = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    if name == "id_at_vocab":
        return _indexed(p, [[5, 6], [7, 100]]), ("data.bin", "sequence 1", "id 100")
    if name == "id_far_above":
        return _indexed(p, [[5, 6], [7, 8], [2**30]]), ("data.bin", "sequence 2", "outside the vocabulary")
    if name == "negative_id":
        return _indexed(p, [[5, -1], [7, 8]]), ("data.bin", "sequence 0", "id -1")
    if name == "uint16_above":
        return _indexed(p, [[5, 6], [60000]], np.uint16), ("data.bin", "sequence 1", "id 60000")
    if name == "empty_sequence":
        return _indexed(p, [[5, 6], [], [7]]), ("data.idx", "sequence 1", "no tokens")
    if name == "all_empty":
        return _indexed(p, [[], []]), ("data.idx", "sequence 0", "no tokens")
    prefix = _indexed(p, good)
    if name == "bin_truncated":
        _truncate(prefix + ".bin", -3)
        return prefix, ("data.bin", "truncated")
    if name == "bin_empty":
        _truncate(prefix + ".bin", 0)
        return prefix, ("data.bin", "empty")
    if name == "idx_truncated_tail":
        _truncate(prefix + ".idx", -5)
        return prefix, ("data.idx", "truncated")
    if name == "idx_truncated_header":
        _truncate(prefix + ".idx", 12)
        return prefix, ("data.idx", "truncated")
    if name == "idx_empty":
        _truncate(prefix + ".idx", 0)
        return prefix, ("data.idx", "truncated")
    if name == "idx_garbage":
        with open(prefix + ".idx", "wb") as f:
            f.write(os.urandom(200))
        return prefix, ("data.idx", "not a Megatron index")
    if name in ("idx_bad_version", "idx_bad_dtype"):
        with open(prefix + ".idx", "r+b") as f:
            f.seek(9 if name == "idx_bad_version" else 17)
            f.write(b"\x63")
        return prefix, ("data.idx", "not a Megatron index")
    if name == "idx_negative_length":
        with open(prefix + ".idx", "r+b") as f:
            f.seek(34 + 4)
            f.write(np.int32(-2).tobytes())
        return prefix, ("data.idx", "negative length")
    if name == "idx_bad_pointer":
        with open(prefix + ".idx", "r+b") as f:
            f.seek(34 + 3 * 4 + 8)
            f.write(np.int64(4).tobytes())
        return prefix, ("data.idx", "sequence 1")
    if name == "bin_is_dir":
        os.remove(prefix + ".bin")
        os.mkdir(prefix + ".bin")
        return prefix, ("data.bin", "not a regular file")
    raise KeyError(name)


IDX_CASES = ["id_at_vocab", "id_far_above", "negative_id", "uint16_above", "empty_sequence", "all_empty",
             "bin_truncated", "bin_empty", "idx_truncated_tail", "idx_truncated_header", "idx_empty", "idx_garbage",
             "idx_bad_version", "idx_bad_dtype", "idx_negative_length", "idx_bad_pointer", "bin_is_dir"]


@pytest.mark.parametrize("name", IDX_CASES)
def test_indexed_data_is_checked_where_it_enters(tmp_path, name):
    from dynapipe.data.config import DatasetConfig

    prefix, needles = _idx_case(tmp_path, name)
    with pytest.raises(DynaPipeError) as e:
        DatasetConfig(kind="indexed", seq_length=64, paths=(prefix,), vocab_size=100).build()
    text = str(e.value)
    assert "\n" not in text
    for needle in needles:
        assert needle in text


def test_token_check_runs_once_per_dataset_and_is_vectorised(tmp_path, monkeypatch):
    from dynapipe.data import indexed
    from dynapipe.data.config import DatasetConfig

    prefix = _indexed(tmp_path / "ok", [list(range(2, 48)) + ([49] if i == 38 else []) for i in range(40)])
    calls = []
    real = indexed.first_bad_token
    monkeypatch.setattr(indexed, "first_bad_token", lambda *a: calls.append(a) or real(*a))
    monkeypatch.setattr(indexed, "_CHECK_CHUNK", 100)  # several chunks: the bad id is in a later one
    ds = DatasetConfig(kind="indexed", seq_length=64, paths=(prefix,), vocab_size=100).build()
    ds.validate_tokens(100)
    ds.validate_tokens(100)
    assert len(calls) == 1
    with pytest.raises(DynaPipeError, match="sequence 38, token 46 has id 49"):
        ds.validate_tokens(49)
    import pickle

    assert pickle.loads(pickle.dumps(ds))._tokens_valid_below == 100  # travels into planner workers


JSONL = {
    "lone_surrogate": ('{"text": "ab\\ud800cd"}\n', ":1", "lone surrogate"),
    "lone_surrogate_target": ('{"text": "ok"}\n{"input": "a", "target": "\\udfff"}\n', ":2", "surrogate"),
    "not_json": ('{"text": "a"\n', ":1", "not a valid JSON"),
    "not_object": ('[1, 2]\n', ":1", "JSON object"),
    "no_fields": ('{"body": "a"}\n', ":1", "'text'"),
    "input_only": ('{"input": "a"}\n', ":1", "both"),
    "text_not_string": ('{"text": 5}\n', ":1", "must be a string"),
    "empty_text_no_eod": None,
    "task_list": ('{"text": "a", "task": [1]}\n', ":1", "task"),
    "deep": ('{"text": ' + "[" * 100000 + "]" * 100000 + '}\n', ":1", "nested too deeply"),
    "invalid_utf8": (b'{"text": "\xff\xfe"}\n', ":1", "JSON"),
    "no_samples": ("\n\n", "hold no samples", "no samples"),
}


@pytest.mark.parametrize("name", sorted(k for k, v in JSONL.items() if v is not None))
def test_bad_jsonl(tmp_path, name):
    from dynapipe.data.config import DatasetConfig

    content, *needles = JSONL[name]
    p = tmp_path / "data.jsonl"
    p.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))
    with pytest.raises(DynaPipeError) as e:
        DatasetConfig(kind="jsonl", seq_length=64, paths=(str(p),), vocab_size=384).build()
    text = str(e.value)
    assert "\n" not in text
    for needle in needles:
        assert needle in text


def test_jsonl_ids_above_the_vocabulary_name_the_line(tmp_path):
    from dynapipe.data.config import DatasetConfig

    class Wide:
        vocab_size, eod, pad = 100, 1, 0

        def tokenize(self, text):
            return [ord(c) for c in text]

    p = tmp_path / "data.jsonl"
    p.write_text('{"text": "AB"}\n\n{"text": "Ab"}\n')  # 'b' is 98 + eod... fine; 'A'..; id 98 < 100
    DatasetConfig(kind="jsonl", seq_length=64, paths=(str(p),), vocab_size=100, tokenizer=Wide()).build()
    p.write_text('{"text": "AB"}\n\n{"text": "Az"}\n')  # 'z' is 122
    with pytest.raises(DynaPipeError, match=r"data.jsonl:3: token id 122 is outside the vocabulary \[0, 100\)"):
        DatasetConfig(kind="jsonl", seq_length=64, paths=(str(p),), vocab_size=100, tokenizer=Wide()).build()


@pytest.mark.parametrize("vocab", [1, 100, 258])
def test_tokenizer_larger_than_the_model_vocabulary_is_refused(tmp_path, vocab):
    from dynapipe.data.config import DatasetConfig

    p = tmp_path / "data.jsonl"
    p.write_text('{"text": "hello"}\n')
    with pytest.raises(DynaPipeError, match=f"259 ids but --vocab-size is {vocab}"):
        DatasetConfig(kind="jsonl", seq_length=64, paths=(str(p),), vocab_size=vocab).build()


def test_overlong_error_names_the_real_flag(tmp_path):
    from dynapipe.data.config import DatasetConfig
    from megatron_integration.arguments import build_parser

    p = tmp_path / "data.jsonl"
    p.write_text('{"text": "' + "x" * 100 + '"}\n')
    with pytest.raises(DynaPipeError) as e:
        DatasetConfig(kind="jsonl", seq_length=64, paths=(str(p),), overlong="reject", vocab_size=384).build()
    flags = [f.rstrip(",.;:)") for f in str(e.value).split() if f.startswith("--")]
    known = {s for a in build_parser()._actions for s in a.option_strings}
    assert flags and all(f in known for f in flags), flags


# ---- G. checkpoint files ---------------------------------------------------------------------

def _checkpoint_file(tmp_path, payload_bytes=4096):
    import torch

    from megatron_integration.checkpoint_files import save_with_checksum

    path = str(tmp_path / "model_optim_rng.pt")
    obj = {"w": torch.arange(payload_bytes // 4, dtype=torch.float32), "iteration": 3}
    save_with_checksum(lambda p: torch.save(obj, p), path)
    return path


def _load(path):
    import torch

    from megatron_integration.checkpoint_files import load_verified

    return load_verified(lambda p: torch.load(p, weights_only=True), path)


CORRUPTIONS = {
    "flip_first_byte": lambda p: _flip(p, 0),
    "flip_middle_byte": lambda p: _flip(p, os.path.getsize(p) // 2),
    "flip_last_byte": lambda p: _flip(p, os.path.getsize(p) - 1),
    "flip_one_bit": lambda p: _flip(p, os.path.getsize(p) // 3, 0x01),
    "flip_exponent_byte": lambda p: _flip(p, os.path.getsize(p) - 700, 0x40),
    "truncate_half": lambda p: _truncate(p, os.path.getsize(p) // 2),
    "truncate_one": lambda p: _truncate(p, -1),
    "truncate_to_one": lambda p: _truncate(p, 1),
    "empty": lambda p: _truncate(p, 0),
    "append": lambda p: open(p, "ab").write(b"\0"),
    "sidecar_missing": lambda p: os.remove(p + ".sha256"),
    "sidecar_garbage": lambda p: open(p + ".sha256", "w").write("zzz"),
    "sidecar_empty": lambda p: open(p + ".sha256", "w").close(),
    "sidecar_binary": lambda p: open(p + ".sha256", "wb").write(bytes(range(256))),
    "file_missing": lambda p: os.remove(p),
    "file_is_dir": lambda p: (os.remove(p), os.mkdir(p)),
    "replaced_by_other_checkpoint": lambda p: _replace_with_other(p),
}
CORRUPTION_NEEDLES = {"truncate_half": "truncated", "truncate_one": "truncated", "truncate_to_one": "truncated",
                      "empty": "empty", "append": "longer", "sidecar_missing": "no checksum",
                      "sidecar_garbage": "checksum file", "sidecar_empty": "checksum file",
                      "sidecar_binary": "checksum file", "file_missing": "missing", "file_is_dir": "directory"}


def _flip(path, offset, mask=0xFF):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([b ^ mask]))


def _strip_checksums_and_cut_common(iter_dir):
    from megatron_integration.checkpoint_dist import common_state_file

    for name in os.listdir(iter_dir):
        if name.endswith(".sha256"):
            os.remove(os.path.join(iter_dir, name))
    _truncate(common_state_file(iter_dir), 100)  # common.pt (megatron-core 0.16) or rank 0's shards (0.19)


def _replace_with_other(path):
    import torch

    torch.save({"w": torch.zeros(3)}, path)


@pytest.mark.parametrize("name", sorted(CORRUPTIONS))
def test_corrupted_checkpoint_files_are_refused(tmp_path, name):
    path = _checkpoint_file(tmp_path)
    _load(path)  # intact: loads
    CORRUPTIONS[name](path)
    with pytest.raises(DynaPipeError) as e:
        _load(path)
    text = str(e.value)
    assert "\n" not in text and path in text
    assert CORRUPTION_NEEDLES.get(name, "corrupted") in text


LATEST = {"empty": b"", "word": b"abc", "negative": b"-1", "fullwidth": "\uff11\uff12".encode(), "binary": b"\xff\x00",
          "float": b"2.0", "underscore": b"1_0"}


@pytest.mark.parametrize("name", sorted(LATEST))
def test_corrupted_latest_iteration_file(tmp_path, name):
    from megatron_integration.checkpoint import LATEST as LATEST_NAME, latest_iteration

    (tmp_path / LATEST_NAME).write_bytes(LATEST[name])
    with pytest.raises(DynaPipeError, match="corrupted"):
        latest_iteration(str(tmp_path))


def test_latest_iteration_file_that_is_a_directory(tmp_path):
    from megatron_integration.checkpoint import LATEST as LATEST_NAME, latest_iteration

    (tmp_path / LATEST_NAME).mkdir()
    with pytest.raises(DynaPipeError, match="cannot be read"):
        latest_iteration(str(tmp_path))


def test_save_dir_is_checked_at_start_up(tmp_path):
    from megatron_integration.checkpoint_files import check_save_dir

    check_save_dir(str(tmp_path / "new" / "dir"))
    assert os.path.isdir(tmp_path / "new" / "dir") and os.listdir(tmp_path / "new" / "dir") == []
    (tmp_path / "f").write_text("x")
    for bad in (tmp_path / "f", tmp_path / "f" / "sub"):
        with pytest.raises(DynaPipeError, match="--save"):
            check_save_dir(str(bad))


# ---- H. training faults: one spawned two-rank job runs them all ---------------------------------

TINY = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 128 --seq-length 64 "
        "--max-position-embeddings 64 --vocab-size 128 --micro-batch-size 2 --global-batch-size 4 "
        "--log-interval 1 --seed 7 --pipeline-model-parallel-size 2 --hidden-dropout 0 --attention-dropout 0")
MOCK = " --mock-data --dynapipe-mock-samples 64"


def fault_job(steps: list) -> list:
    """Rank body: run ``steps`` in order in one process group; each step's outcome.

    ``("train", argv)`` trains (a DynaPipeError is an outcome, not a failure of the job);
    ``("train", argv, (iteration, marker))`` also pauses rank 0 after that iteration until
    the test removes the file ``marker`` it creates (a fault is injected meanwhile);
    ``("rank0", fn, args)`` runs a file operation on rank 0 between runs.
    """
    import io

    import torch.distributed as dist

    from megatron_integration.arguments import parse_training_args
    from megatron_integration.initialize import destroy
    from megatron_integration.training import pretrain

    world = int(os.environ["WORLD_SIZE"])
    out = []
    try:
        for step in steps:
            if step[0] == "rank0":
                if dist.get_rank() == 0:
                    step[1](*step[2])
                dist.barrier()
                out.append(None)
                continue
            cfg = parse_training_args(step[1].split(), world)
            hook = None
            if len(step) > 2 and dist.get_rank() == 0:
                hook = partial(_pause_at, *step[2])
            try:
                run = pretrain(cfg, stream=io.StringIO(), on_iteration=hook)
                out.append({"losses": run.losses, "skipped": [r.skipped for r in run.results],
                            "start": run.start_iteration})
            except DynaPipeError as e:
                out.append({"error": str(e)})
            if not dist.is_initialized():
                break
    finally:
        destroy()
    return out


def _pause_at(iteration, marker, it, result):
    if it != iteration:
        return
    open(marker, "w").close()
    deadline = time.monotonic() + 60
    while os.path.exists(marker) and time.monotonic() < deadline:
        time.sleep(0.02)


def _restart_on_marker(marker, procs, port, stop, seen):
    """Test-side thread: when rank 0 pauses and a payload waits unread on the server, kill
    Redis, bring it back empty, and let rank 0 go on."""
    from dynapipe.runtime.kv_store import KVStoreSpec

    probe = KVStoreSpec("redis", "127.0.0.1", port, connect_timeout_s=10.0).connect()
    while not stop.is_set():
        if os.path.exists(marker):
            deadline = time.monotonic() + 30
            while not any(k.endswith("/it5/r0/s0") for k in probe.keys("")) and time.monotonic() < deadline:
                time.sleep(0.02)
            seen.append(any(k.endswith("/it5/r0/s0") for k in probe.keys("")))
            probe.close()
            _restart(procs, port, 0.5)
            os.remove(marker)
            return
        time.sleep(0.02)
    probe.close()


@pytest.fixture(scope="module")
def fault_outcomes(tmp_path_factory):
    """Every training fault of this module, in one spawned job of two pipeline stages."""
    from megatron_integration.launch import spawn

    d = tmp_path_factory.mktemp("faults")
    save, nan_save, data = str(d / "ckpt"), str(d / "nan-ckpt"), d / "data"
    dist_save = str(d / "dist-ckpt")
    data.mkdir()
    out_of_vocab = _indexed(data / "vocab", [[5, 6, 7, 8]] * 6 + [[5, 200, 7]] + [[9, 10]] * 5)
    good = _indexed(data / "good", [list(range(5, 9 + 3 * (i % 7))) for i in range(32)])
    steps = {
        "nan_padding": ("train", f"{TINY}{MOCK} --train-iters 3 --lr 1e20 --save {nan_save}"),
        # Indexed data through the planner workers: the data checks pass, then the loss diverges.
        "nan_dynapipe": ("train", f"{TINY} --data-path {good} --train-iters 3 --lr 1e20 --use-dynapipe"),
        "nan_unchecked": ("train", f"{TINY}{MOCK} --train-iters 3 --lr 1e20 --no-check-for-nan-in-loss-and-grad"),
        # The resumed runs are longer than the saved ones: they take their own learning-rate schedule.
        "saved": ("train", f"{TINY}{MOCK} --train-iters 2 --lr 1e-3 --save {save} --ckpt-format dynapipe"),
        "resumed": ("train", f"{TINY}{MOCK} --train-iters 3 --lr 1e-3 --load {save} "
                           "--override-opt_param-scheduler"),
        "flip_rank1_rng": ("rank0", _flip, (os.path.join(save, "iter_0000002", "mp_rank_00_001", "rng_dp_000.pt"), 99)),
        "load_flipped_rng": ("train", f"{TINY}{MOCK} --train-iters 3 --lr 1e-3 --load {save} "
                           "--override-opt_param-scheduler"),
        "truncate_rank0_model": ("rank0", _truncate, (os.path.join(save, "iter_0000002", "mp_rank_00_000",
                                                                   "model_optim_rng.pt"), -10)),
        "load_truncated": ("train", f"{TINY}{MOCK} --train-iters 3 --lr 1e-3 --load {save} "
                           "--override-opt_param-scheduler --no-load-rng"),
        # torch_dist: a shard cut short is named by its checksum; without checksums (as Megatron-LM
        # writes them) dist_checkpointing's own error comes back as one line naming the file.
        "saved_dist": ("train", f"{TINY}{MOCK} --train-iters 1 --lr 1e-3 --save {dist_save}"),
        "truncate_dist_shard": ("rank0", _truncate, (os.path.join(dist_save, "iter_0000001", "__1_0.distcp"), -7)),
        "load_truncated_dist": ("train", f"{TINY}{MOCK} --train-iters 2 --lr 1e-3 --load {dist_save} "
                                  "--override-opt_param-scheduler"),
        "unverified_and_broken": ("rank0", _strip_checksums_and_cut_common, (os.path.join(dist_save, "iter_0000001"),)),
        "load_unverified_broken": ("train", f"{TINY}{MOCK} --train-iters 2 --lr 1e-3 --load {dist_save} "
                                  "--override-opt_param-scheduler"),
        "data_padding": ("train", f"{TINY} --data-path {out_of_vocab} --train-iters 1 --lr 1e-3"),
        "data_dynapipe": ("train", f"{TINY} --data-path {out_of_vocab} --train-iters 1 --lr 1e-3 --use-dynapipe"),
        "good_data": ("train", f"{TINY} --data-path {good} --train-iters 1 --lr 1e-3"),
    }
    from megatron_integration.launch import free_port

    port = free_port()
    procs = [_redis_start(port)]
    marker = str(d / "paused")
    # Six iterations planned ahead: when rank 0 pauses after iteration 1, its payload of
    # iteration 5 waits unread on the server (its fetch thread holds 2 and 3 queued and 4 in
    # hand) and is lost.
    redis = (f" --use-dynapipe --dynapipe-kv-backend redis --dynapipe-redis-port {port} --dynapipe-store-retry-s 20"
             f" --dynapipe-prefetch 6")
    steps["redis_undisturbed"] = ("train", f"{TINY}{MOCK} --train-iters 7 --lr 1e-3{redis}")
    steps["redis_restarted"] = ("train", f"{TINY}{MOCK} --train-iters 7 --lr 1e-3{redis}", (1, marker))
    stop, lost_unread = threading.Event(), []
    restarter = threading.Thread(target=_restart_on_marker, args=(marker, procs, port, stop, lost_unread),
                                 daemon=True)
    restarter.start()
    try:
        results = spawn(fault_job, 2, (list(steps.values()),), timeout_s=300, threads_per_rank=1)
    finally:
        stop.set()
        restarter.join(10)
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    outcomes = {name: [r[i] for r in results] for i, name in enumerate(steps)}
    return outcomes, {"save": save, "nan_save": nan_save, "redis_restarts": len(procs) - 1,
                      "lost_unread": lost_unread, "dist_save": dist_save}


@pytest.mark.parametrize("name", ["nan_padding", "nan_dynapipe"])
def test_nan_stops_every_rank_before_the_step(fault_outcomes, name):
    outcomes, _ = fault_outcomes
    per_rank = outcomes[name]
    texts = [o["error"] for o in per_rank]
    assert texts[0] == texts[1]  # the same line on every rank
    assert texts[0].startswith("iteration 2: ") and "rank 1" in texts[0] and "\n" not in texts[0]
    assert "--no-check-for-nan-in-loss-and-grad" in texts[0]


def test_nan_run_saves_nothing(fault_outcomes):
    _, paths = fault_outcomes
    assert not os.path.exists(os.path.join(paths["nan_save"], "latest_checkpointed_iteration.txt"))
    assert not any(n.startswith("iter_") for n in os.listdir(paths["nan_save"]))


def test_nan_check_can_be_disabled(fault_outcomes):
    outcomes, _ = fault_outcomes
    losses = outcomes["nan_unchecked"][0]["losses"]
    assert len(losses) == 3 and np.isfinite(losses[0]) and not np.isfinite(losses[1])


def test_healthy_runs_are_untouched_by_the_checks(fault_outcomes):
    outcomes, _ = fault_outcomes
    saved, resumed = outcomes["saved"][0], outcomes["resumed"][0]
    assert len(saved["losses"]) == 2 and all(np.isfinite(saved["losses"]))
    assert resumed["start"] == 2 and len(resumed["losses"]) == 1 and not any(saved["skipped"])
    good = outcomes["good_data"][0]
    assert len(good["losses"]) == 1 and np.isfinite(good["losses"][0])


def test_a_corrupted_file_of_one_rank_stops_every_rank(fault_outcomes):
    outcomes, _ = fault_outcomes
    for name, kind in (("load_flipped_rng", "corrupted"), ("load_truncated", "truncated")):
        texts = [o["error"] for o in outcomes[name]]
        assert texts[0] == texts[1]
        assert kind in texts[0] and ".pt" in texts[0] and "\n" not in texts[0]
    assert "rank 1: " in outcomes["load_flipped_rng"][0]["error"]
    assert "rank 0: " in outcomes["load_truncated"][0]["error"]


def test_a_broken_torch_dist_checkpoint_stops_every_rank_with_one_line(fault_outcomes):
    from megatron_integration.checkpoint_dist import common_state_file

    outcomes, paths = fault_outcomes
    assert outcomes["saved_dist"][0]["losses"]
    truncated = [o["error"] for o in outcomes["load_truncated_dist"]]
    assert truncated[0] == truncated[1] and "\n" not in truncated[0]
    assert "__1_0.distcp is truncated" in truncated[0]
    broken = [o["error"] for o in outcomes["load_unverified_broken"]]
    assert broken[0] == broken[1] and "\n" not in broken[0]
    common = common_state_file(os.path.join(paths["dist_save"], "iter_0000001"))
    assert os.path.basename(common) in ("common.pt", "__0_0.distcp")
    assert f"checkpoint {common} cannot be loaded" in broken[0], broken[0]


@pytest.mark.parametrize("name", ["data_padding", "data_dynapipe"])
def test_out_of_vocabulary_ids_stop_every_batching_path(fault_outcomes, name):
    outcomes, _ = fault_outcomes
    for o in outcomes[name]:
        assert "vocab.bin: sequence 6, token 1 has id 200" in o["error"], o


def test_training_survives_a_redis_restart_with_the_same_losses(fault_outcomes):
    outcomes, paths = fault_outcomes
    assert paths["redis_restarts"] == 1 and paths["lost_unread"] == [True]  # a payload was lost unread
    undisturbed, restarted = outcomes["redis_undisturbed"][0], outcomes["redis_restarted"][0]
    assert "error" not in restarted, restarted
    assert len(restarted["losses"]) == 7
    assert restarted["losses"] == undisturbed["losses"]


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="fp16 loss scaling needs a GPU")
def test_fp16_overflow_is_a_skipped_step_not_an_error():
    from megatron_integration.jobs import run_training

    # A loss scale of 2**32 (megatron-core's initial) overflows fp16 gradients at once.
    r = run_training(f"{TINY.replace('--pipeline-model-parallel-size 2', '')}{MOCK} --train-iters 3 --lr 1e-3 "
                     f"--fp16".split(), 1, timeout_s=240)[0]
    assert len(r["losses"]) == 3 and all(np.isfinite(r["losses"]))
    skipped = [int(line.split("number of skipped iterations:")[1].split("|")[0]) for line in r["log_lines"]]
    assert len(skipped) == 3 and sum(skipped) >= 1, r["log_lines"]


# ---- I. the Redis store: a restart within the window costs a pause, not the job -------------------

def _redis_start(port):
    exe = shutil.which("redis-server")
    if exe is None:
        if os.environ.get("DYNAPIPE_REQUIRE_REDIS") == "1":
            pytest.fail("redis-server is not installed but DYNAPIPE_REQUIRE_REDIS=1 requires the Redis tests")
        pytest.skip("redis-server binary not found")
    from dynapipe.runtime.kv_store import KVStoreSpec

    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    spec = KVStoreSpec("redis", "127.0.0.1", port, connect_timeout_s=10.0)
    spec.connect().close()
    return proc


@pytest.fixture
def redis_port():
    from megatron_integration.launch import free_port

    port = free_port()
    procs = [_redis_start(port)]
    yield port, procs
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(10)


def _restart(procs, port, down_s):
    procs[-1].kill()
    procs[-1].wait(10)
    time.sleep(down_s)
    procs.append(_redis_start(port))


def test_loader_survives_a_redis_restart_with_the_same_data(redis_port):
    from test_loader import make_loader, reference_iterations, summarize

    from dynapipe.runtime.kv_store import KVStoreSpec

    port, procs = redis_port
    spec = KVStoreSpec("redis", "127.0.0.1", port, connect_timeout_s=10.0)
    iterations = 7
    got = []
    probe = spec.connect()
    with make_loader(kv_backend="redis", redis=spec, train_iters=iterations, store_retry_s=20, prefetch=6) as dl:
        for i, d in enumerate(dl):
            got.append(summarize(d))
            if i == 1:
                # Iterations up to 6 are planned; the fetch thread holds 2 and 3 queued and 4
                # in hand, so 5 waits on the server: the restart loses it, which only planning
                # again recovers.
                deadline = time.monotonic() + 60
                while probe.get(dl.keys.payload(5, 0, 0)) is None and time.monotonic() < deadline:
                    time.sleep(0.02)
                _restart(procs, port, 0.5)
                deadline = time.monotonic() + 10
                while dl._watcher.restarts == 0 and time.monotonic() < deadline:
                    time.sleep(0.02)
        assert dl._watcher.restarts == 1
    probe.close()
    ref = reference_iterations(iterations)
    assert [g["plan"] for g in got] == [r["plan"] for r in ref]
    assert [g["tensors"] for g in got] == [r["tensors"] for r in ref]


def test_store_calls_wait_through_a_restart_within_the_window(redis_port):
    from dynapipe.runtime.kv_store import KVStoreSpec

    port, procs = redis_port
    kv = KVStoreSpec("redis", "127.0.0.1", port, connect_timeout_s=5.0, retry_s=10.0).connect()
    kv.set("k", b"v")
    before = kv.server_id()
    restarter = threading.Thread(target=_restart, args=(procs, port, 1.0))
    restarter.start()
    time.sleep(0.2)
    t0 = time.monotonic()
    kv.set("k2", b"v2")  # the server is down: waits for it, then succeeds
    restarter.join()
    assert time.monotonic() - t0 >= 0.5
    assert kv.get("k2") == b"v2" and kv.get("k") is None  # the restarted server lost the old key
    assert kv.server_id() != before
    kv.close()


def test_store_gives_up_after_the_window_with_one_line(redis_port):
    from dynapipe.runtime.kv_store import KVStoreSpec, StoreUnreachableError

    port, procs = redis_port
    kv = KVStoreSpec("redis", "127.0.0.1", port, connect_timeout_s=5.0, retry_s=0.8).connect()
    procs[-1].kill()
    procs[-1].wait(10)
    t0 = time.monotonic()
    with pytest.raises(StoreUnreachableError, match="--dynapipe-store-retry-s 0.8") as e:
        kv.get("k")
    assert 0.7 <= time.monotonic() - t0 < 5.0
    assert "\n" not in str(e.value)
    kv.close()


# ---- J. the real command lines, as processes --------------------------------------------------------

@pytest.mark.parametrize("argv,needle", [
    (["-m", "dynapipe", "synth", "--samples", "1_000"], "--samples"),
    (["-m", "dynapipe", "cost", "--model", "/bin/sh", "--device", "cpu", "--stages", "2", "--shape", "1,64"],
     "not UTF-8"),
    ([os.path.join(ROOT, "scripts", "pretrain_gpt.py"), *TRAIN_BASE, "--lr", "nan"], "--lr"),
], ids=["synth", "cost", "pretrain"])
def test_processes_exit_2_with_one_line(argv, needle):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([PY, *argv], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    one_line_error(p.returncode, p.stderr, needle)


# ---- plan files and store payloads ------------------------------------------------------------
# The plan format's own tests (test_plan_bytes.py) cover each mechanism; here every byte region
# of real plan files and payloads is attacked through the paths a user or a rank takes.

@pytest.fixture(scope="module")
def plan_set(tmp_path_factory):
    """A complete plan set (2 replicas x 2 stages, gpt-tiny) written by ``plan --plan-out``."""
    d = tmp_path_factory.mktemp("plans")
    lengths = d / "lengths.txt"
    lengths.write_text("\n".join(str(n) for n in (37, 120, 64, 250, 18, 90, 300, 75, 140, 33, 61, 210)) + "\n")
    out = d / "set"
    assert dynapipe_main(["plan", "--lengths", str(lengths), "--model", "gpt-tiny", "--device", "cpu",
                          "--stages", "2", "--dp", "2", "--plan-out", str(out), "--output", str(d / "plan.json")]) == 0
    names = sorted(os.listdir(out))
    assert len(names) == 4
    return out, names


def _validate_copy(capsys, plan_set, tmp_path, mutate):
    src, names = plan_set
    dst = tmp_path / "set"
    shutil.copytree(src, dst)
    mutate(dst, names)
    capsys.readouterr()
    rc = dynapipe_main(["validate", str(dst)])
    _, err = capsys.readouterr()
    return rc, err


def _flip_plan_byte(fraction):
    def mutate(d, names):
        path = d / names[-1]
        data = bytearray(path.read_bytes())
        data[min(int(len(data) * fraction), len(data) - 1)] ^= 0x10
        path.write_bytes(bytes(data))
    return mutate


def _cut_plan(fraction):
    def mutate(d, names):
        path = d / names[0]
        data = path.read_bytes()
        path.write_bytes(data[:int(len(data) * fraction)])
    return mutate


@pytest.mark.parametrize("fraction", [i / 24 for i in range(24)] + [0.999], ids=lambda f: f"at{f:.3f}")
def test_a_flipped_plan_file_bit_is_refused(capsys, plan_set, tmp_path, fraction):
    one_line_error(*_validate_copy(capsys, plan_set, tmp_path, _flip_plan_byte(fraction)))


@pytest.mark.parametrize("fraction", [0.0, 0.01, 0.05, 0.2, 0.5, 0.8, 0.95, 0.999])
def test_a_truncated_plan_file_is_refused(capsys, plan_set, tmp_path, fraction):
    one_line_error(*_validate_copy(capsys, plan_set, tmp_path, _cut_plan(fraction)))


@pytest.mark.parametrize("index", range(4))
def test_a_plan_set_missing_a_rank_is_refused(capsys, plan_set, tmp_path, index):
    rc, err = _validate_copy(capsys, plan_set, tmp_path, lambda d, names: os.remove(d / names[index]))
    one_line_error(rc, err)


@pytest.mark.parametrize("pair", [(0, 1), (0, 2), (1, 3), (2, 3)])
def test_swapped_plan_files_are_refused(capsys, plan_set, tmp_path, pair):
    def mutate(d, names):
        a, b = (d / names[i] for i in pair)
        da, db = a.read_bytes(), b.read_bytes()
        a.write_bytes(db)
        b.write_bytes(da)
    one_line_error(*_validate_copy(capsys, plan_set, tmp_path, mutate), "belongs in")


@pytest.mark.parametrize("kind", ["directory", "appended", "prepended", "other-set"])
def test_foreign_plan_files_are_refused(capsys, plan_set, tmp_path, kind):
    def mutate(d, names):
        path = d / names[1]
        if kind == "directory":
            path.unlink()
            path.mkdir()
        elif kind == "appended":
            path.write_bytes(path.read_bytes() + b"\0" * 7)
        elif kind == "prepended":
            path.write_bytes(b"#" + path.read_bytes())
        else:  # a plan of another layout in place of this one
            (d / "replica002-stage000.plan").write_bytes((d / names[0]).read_bytes())
    one_line_error(*_validate_copy(capsys, plan_set, tmp_path, mutate))


@pytest.fixture(scope="module")
def payload_bytes(plan_set):
    from dynapipe.runtime.plan_payload import encode_payload

    src, names = plan_set
    plan_bytes = (src / names[0]).read_bytes()
    tensors = {0: {"tokens": np.arange(96, dtype=np.int64).reshape(4, 24),
                   "loss_mask": np.ones((4, 24), np.float32)}}
    return encode_payload(0, 0, 0, plan_bytes, tensors, {"global_loss_tokens": 96})


@pytest.mark.parametrize("fraction", [i / 32 for i in range(32)] + [0.999], ids=lambda f: f"at{f:.3f}")
def test_a_flipped_payload_bit_is_refused(payload_bytes, fraction):
    from dynapipe.runtime.plan_payload import decode_payload

    bad = bytearray(payload_bytes)
    bad[min(int(len(bad) * fraction), len(bad) - 1)] ^= 0x04
    with pytest.raises(DynaPipeError) as e:
        decode_payload(bytes(bad))
    assert str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("fraction", [0.0, 0.001, 0.01, 0.1, 0.3, 0.5, 0.7, 0.9, 0.99])
def test_a_truncated_payload_is_refused(payload_bytes, fraction):
    from dynapipe.runtime.plan_payload import decode_payload

    with pytest.raises(DynaPipeError) as e:
        decode_payload(payload_bytes[:int(len(payload_bytes) * fraction)])
    assert str(e.value) and "\n" not in str(e.value)
