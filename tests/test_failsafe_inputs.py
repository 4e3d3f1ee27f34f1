"""Fail-safety battery, inputs: hundreds of bad values and files given to the planning commands.

Integer and number flags, lengths files, model/device/cluster/mixture/profile files and each
command's own values. Every case must end in one clear line (``error: ...``) and exit status 2:
no traceback, nothing silently accepted. The cases call the command lines in-process, so that
hundreds of them stay cheap; the last few run the real command lines as processes, since only a
process shows exactly what a user sees (exit status, stderr).
"""
from __future__ import annotations

import json
import os
import subprocess

import pytest

from failsafe_common import PY, ROOT, TRAIN_BASE, fill_paths, one_line_error, run_cli
from failsafe_common import files  # noqa: F401  (a fixture: pytest finds it in this module)


# ---- integer and number parsing on every planning command -------------------------------------

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


@pytest.mark.parametrize("value", BAD_INTS, ids=ascii)
@pytest.mark.parametrize("command,base,flag", INT_FLAGS, ids=lambda x: x if isinstance(x, str) else None)
def test_integer_flags_take_ascii_digits_only(capsys, files, command, base, flag, value):
    rc, _, err = run_cli(capsys, [command, *fill_paths(base, files), flag, value])
    one_line_error(rc, err, flag)


@pytest.mark.parametrize("value", BAD_FLOATS, ids=ascii)
@pytest.mark.parametrize("command,base,flag", FLOAT_FLAGS, ids=lambda x: x if isinstance(x, str) else None)
def test_number_flags_take_finite_decimals_only(capsys, files, command, base, flag, value):
    rc, _, err = run_cli(capsys, [command, *fill_paths(base, files), flag, value])
    one_line_error(rc, err, flag)


# ---- lengths files ----------------------------------------------------------------------------

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


# ---- model, device, cluster, mixture and profile files ------------------------------------------

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
                      "sigma_target: 1, colour: red}]\n", "task 'a' has unknown key(s) ['colour']"),
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


# ---- command-specific values --------------------------------------------------------------------

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
    rc, _, err = run_cli(capsys, ["synth", *fill_paths(args, files)])
    one_line_error(rc, err, needle)


SHAPES = [("1,99999", "max_seq_length"), ("1,1025", "max_seq_length"), ("0,128", "positive"), ("-1,128", "--shape"),
          ("1", "MBS,SEQLEN"), ("1,2,3", "MBS,SEQLEN"), ("a,b", "integers"), ("1_0,128", "integers"),
          ("\u0661,128", "integers"), ("1,128,", "integers"), ("", "integers"), (",", "integers"),
          ("1.5,128", "integers"), ("1,1e3", "integers"), ("99999999999999999999,64", "more than 12 digits")]


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
    (["--stages", "2", "--plan-out", "{under_file}"], "is a file, not a folder"),
    (["--stages", "2", "--plan-out", "{binary}"], "binary"),
]


@pytest.mark.parametrize("args,needle", PLAN, ids=lambda x: " ".join(x) if isinstance(x, list) else None)
def test_plan_bad_values(capsys, files, args, needle):
    rc, _, err = run_cli(capsys, ["plan", "--lengths", files["good_lengths"], "--model", "gpt-tiny", "--device", "cpu",
                                  *fill_paths(args, files)])
    one_line_error(rc, err, needle)


@pytest.mark.parametrize("argv", [["frobnicate"], ["plan"], ["cost", "--model"], ["--colour"],
                                  ["synth", "--samples", "5", "--samples"]], ids=" ".join)
def test_bad_command_lines(capsys, argv):
    rc, _, err = run_cli(capsys, argv)
    one_line_error(rc, err)


# ---- the real command lines, as processes -----------------------------------------------------------

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


@pytest.mark.parametrize("out, png, needle", [("b.json", "b.txt", "--png 'DIR/b.txt' does not end in .png"),
                                              ("b.png", "b.png", "--output and --png name the same file")])
def test_bench_png_that_cannot_be_written_is_refused_before_any_run(capsys, tmp_path, out, png, needle):
    # The picture is saved after every run: a name it cannot take must not cost the runs first.
    rc, _, err = run_cli(capsys, ["bench", "--output", tmp_path / out, "--png", tmp_path / png])
    one_line_error(rc, err, needle.replace("DIR", str(tmp_path)))
    assert not os.listdir(tmp_path)


def test_bench_png_without_matplotlib_is_refused_before_any_run(capsys, tmp_path, monkeypatch):
    # The picture is drawn after every run: a missing matplotlib must not cost the runs first.
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    rc, _, err = run_cli(capsys, ["bench", "--output", tmp_path / "b.json", "--png", tmp_path / "b.png"])
    one_line_error(rc, err, "--png needs matplotlib")
    assert not (tmp_path / "b.json").exists()
