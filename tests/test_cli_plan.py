"""``python -m dynapipe plan`` and ``cost``: the JSON contract, the summary, and errors."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest

from dynapipe.cli import main
from dynapipe.config import load_device_config, load_model_config
from dynapipe.cost import build_cost_model
from profile_widths import TINY_WIDTHS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = ["--model", "gpt-7b", "--device", "a100-40gb", "--stages", "8"]


def _lengths(tmp_path, text="100\n7\n2048\n513\n64\n1000\n9\n300\n1500\n"):
    p = tmp_path / "lengths.txt"
    p.write_text(text)
    return str(p)


def _plan(capsys, args):
    rc = main(["plan", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_plan_json_contract(tmp_path, capsys):
    rc, out, err = _plan(capsys, ["--lengths", _lengths(tmp_path), *BASE, "--dp", "2"])
    assert rc == 0
    plan = json.loads(out)
    assert plan["batching"] == "dynapipe"
    for key in ("micro_batches", "objective_ms", "padding_efficiency", "planning_ms"):
        assert key in plan
    mbs = plan["micro_batches"]
    for mb in mbs:
        assert set(mb) >= {"samples", "seqlen", "replica", "time_ms", "stored_mib", "peak_mib"}
        assert mb["replica"] in (0, 1)
    assert sorted(i for mb in mbs for i in mb["samples"]) == list(range(9))
    times = [mb["time_ms"] for mb in mbs]
    assert plan["objective_ms"] == pytest.approx(sum(times) / 2 + 7 * max(times))
    real = 100 + 7 + 2048 + 513 + 64 + 1000 + 9 + 300 + 1500
    assert plan["padding_efficiency"] == pytest.approx(real / sum(len(mb["samples"]) * mb["seqlen"] for mb in mbs))
    assert plan["memory_limit_mib"] == 40536  # the device config's default
    assert "dynapipe: 9 samples ->" in err and "objective" in err and "padding efficiency" in err
    # The printed planning times of a one-shot command include loading the compiled loops; it says so.
    from dynapipe.schedule._kernels import compiled

    assert ("a process's first plan includes loading the planner's compiled (numba) kernels" in err) == compiled()


def test_plan_costs_match_the_cost_command(tmp_path, capsys):
    rc, out, _ = _plan(capsys, ["--lengths", _lengths(tmp_path), *BASE])
    mbs = json.loads(out)["micro_batches"]
    shapes = [f"{len(mb['samples'])},{mb['seqlen']}" for mb in mbs]
    assert main(["cost", *BASE, *sum((["--shape", s] for s in shapes), [])]) == 0
    rows = json.loads(capsys.readouterr().out)
    for mb, row in zip(mbs, rows):
        assert mb["time_ms"] == pytest.approx(row["fw_ms"] + row["bw_ms"])
        assert mb["stored_mib"] == pytest.approx(row["stored_mib"]) and mb["peak_mib"] == pytest.approx(row["peak_mib"])


def test_cost_command_fields_and_stage(capsys):
    assert main(["cost", *BASE, "--shape", "2,1024", "--shape", "1,64", "--stage", "0"]) == 0
    rows = json.loads(capsys.readouterr().out)
    cm = build_cost_model(load_model_config("gpt-7b"), load_device_config("a100-40gb"), 8)
    c = cm.stage_cost(2, 1024, stage=0)
    assert rows[0] == {"mbs": 2, "seqlen": 1024, "fw_ms": pytest.approx(float(c.fw_ms)),
                       "bw_ms": pytest.approx(float(c.bw_ms)), "stored_mib": pytest.approx(float(c.stored_mib)),
                       "peak_mib": pytest.approx(float(c.peak_mib))}
    assert len(rows) == 2


def test_cost_command_encoder_decoder(capsys):
    assert main(["cost", "--model", "t5-11b", "--device", "a100-40gb", "--stages", "4", "--shape", "2,512,64"]) == 0
    row = json.loads(capsys.readouterr().out)[0]
    assert row["dec_seqlen"] == 64 and row["bw_ms"] >= row["fw_ms"] > 0


def test_cost_command_prices_the_placement_given(capsys):
    from dynapipe.cost.placement import StagePlacement

    t5 = ["cost", "--model", "t5-11b", "--device", "a100-40gb", "--stages", "4", "--shape", "2,512,64"]
    cm = build_cost_model(load_model_config("t5-11b"), load_device_config("a100-40gb"), 4)
    for spec in ("12+0,12+0,0+12,0+12", "6+0,6+0,6+0,6+0|0+6,0+6,0+6,0+6", "9+0,9+0,6+4,0+20"):
        for stage in ("0", "2"):
            assert main([*t5, "--placement", spec, "--stage", stage]) == 0
            row = json.loads(capsys.readouterr().out)[0]
            c = cm.with_placement(StagePlacement.parse(spec, cm.model, 4)).stage_cost(2, 512, 64, stage=int(stage))
            assert row["fw_ms"] == pytest.approx(float(c.fw_ms)) and row["stored_mib"] == pytest.approx(float(c.stored_mib))
    # `interleaved` is the even chunks; the encoder-heavy first stage of the even split costs more.
    assert main([*t5, "--placement", "interleaved", "--stage", "0"]) == 0
    interleaved = json.loads(capsys.readouterr().out)[0]
    assert main([*t5, "--stage", "0"]) == 0
    even = json.loads(capsys.readouterr().out)[0]
    assert interleaved["fw_ms"] < even["fw_ms"]
    # auto needs a batch; a split for other stages is refused naming it.
    assert main([*t5, "--placement", "auto"]) == 2
    assert "run plan --lengths FILE ... --placement auto and give the split it prints" in capsys.readouterr().err
    assert main([*t5, "--placement", "9+0"]) == 2
    assert "'9+0' names 1 stage; --stages is 4" in capsys.readouterr().err


@pytest.mark.parametrize("method", ["padding", "padding-mb", "packing", "token-budget"])
def test_plan_baselines_via_cli(tmp_path, capsys, method):
    out_file = tmp_path / "plan.json"
    rc, out, err = _plan(capsys, ["--lengths", _lengths(tmp_path), *BASE, "--batching", method,
                                  "--micro-batch-size", "2", "--seq-length", "2048", "--output", str(out_file)])
    assert rc == 0 and out == ""
    plan = json.loads(out_file.read_text())
    assert plan["batching"] == method
    flat = [i for mb in plan["micro_batches"] for i in
            (sum(mb["samples"], []) if method == "packing" else mb["samples"])]
    assert sorted(flat) == list(range(9))
    if method == "packing":
        assert "cross_sample_attention_pairs" in plan["extra"] and "attention pairs" in err


def test_plan_reads_stdin_and_encoder_decoder_pairs(monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO("100 5\n900 30\n40 200\n"))
    rc, out, _ = _plan(capsys, ["--lengths", "-", "--model", "t5-11b", "--device", "a100-40gb", "--stages", "8"])
    assert rc == 0
    mbs = json.loads(out)["micro_batches"]
    # "samples" index the input's lines: each micro-batch is padded to its longest input and
    # its longest target (the second column).
    pairs = [(100, 5), (900, 30), (40, 200)]
    assert sorted(i for mb in mbs for i in mb["samples"]) == [0, 1, 2]
    for mb in mbs:
        assert mb["seqlen"] >= max(pairs[i][0] for i in mb["samples"])
        assert mb["dec_seqlen"] >= max(pairs[i][1] for i in mb["samples"]), mb
        assert mb["real_tokens"] == sum(sum(pairs[i]) for i in mb["samples"]), mb


def test_plan_limits_targets_at_decoder_seq_length(monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO("100 5\n900 30\n40 200\n"))
    rc, out, err = _plan(capsys, ["--lengths", "-", "--model", "t5-11b", "--device", "h100-80gb", "--stages", "8",
                                  "--batching", "padding", "--micro-batch-size", "2", "--seq-length", "512",
                                  "--decoder-seq-length", "100"])
    assert rc == 0 and "2 sample(s) truncated to 512 input / 100 target tokens" in err
    plan = json.loads(out)
    assert plan["extra"]["dec_seq_length"] == 100
    assert {(mb["seqlen"], mb["dec_seqlen"]) for mb in plan["micro_batches"]} == {(512, 100)}


@pytest.mark.parametrize("text, extra, message", [
    ("5\n0\n", [], "line 2: length 0 must be a positive"),
    ("5\nx\n", [], "line 2: 'x' is not an integer"),
    ("", [], "empty"),
    ("100\n4000\n", ["--memory-limit-mb", "30000", "--recompute", "none"], "sample 1 (length 4000 tokens"),
    ("5\n", ["--stages", "64"], "--stages 64 exceeds the 32 layers"),
    ("5\n", ["--memory-limit-mb", "0"], "--memory-limit-mb 0 must be positive"),
    ("5 3\n", [], "decoder-only"),
    ("1 00\n", [], "line 1: length 0 must be a positive number of tokens (the line reads '1 00')"),
    ("5\n", ["--decoder-seq-length", "64"], "--decoder-seq-length 64: model 'gpt-7b' is decoder-only"),
])
def test_plan_errors_exit_2_with_one_line(tmp_path, capsys, text, extra, message):
    rc, out, err = _plan(capsys, ["--lengths", _lengths(tmp_path, text), *BASE, *extra])
    assert rc == 2 and out == ""
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


@pytest.mark.parametrize("shape, message", [("2", "give MBS,SEQLEN"), ("2,abc", "positive integers"),
                                            ("0,5", "positive integer"), ("2,64,8", "decoder-only"),
                                            ("99999999999999999999,512", "a value of more than 12 digits")])
def test_cost_bad_shapes(capsys, shape, message):
    assert main(["cost", *BASE, "--shape", shape]) == 2
    assert message in capsys.readouterr().err


def test_missing_config_is_a_clean_error(tmp_path, capsys):
    rc, _, err = _plan(capsys, ["--lengths", _lengths(tmp_path), "--model", "gpt-99b", "--device", "a100-40gb",
                                "--stages", "2"])
    assert rc == 2 and "gpt-99b" in err and "does not exist" in err


def test_real_process_exit_code_and_no_traceback(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    bad = subprocess.run([sys.executable, "-m", "dynapipe", "plan", "--lengths", _lengths(tmp_path, "7\n-1\n"),
                          *BASE], capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "line 2: length -1" in bad.stderr
    good = subprocess.run([sys.executable, "-m", "dynapipe", "plan", "--lengths", "-", *BASE], input="30\n40\n",
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    assert good.returncode == 0 and json.loads(good.stdout)["batching"] == "dynapipe"


def test_plan_with_a_measured_profile(tmp_path, capsys):
    grid = lambda f: [[f(b, s) for s in (64, 256)] for b in (1, 4)]  # noqa: E731
    op = {"fw_ms": grid(lambda b, s: 1 + 0.01 * b * s), "bw_ms": grid(lambda b, s: 2 + 0.02 * b * s),
          "stored_mib": grid(lambda b, s: 0.01 * b * s), "peak_mib": grid(lambda b, s: 0.001 * b * s)}
    profile = {"format": "dynapipe-profile", "version": 1, "mbs": [1, 4], "seqlen": [64, 256], "model": TINY_WIDTHS,
               "ops": {"layer": op, "embedding": op, "output": op}}
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile))
    rc, out, _ = _plan(capsys, ["--lengths", _lengths(tmp_path, "30\n60\n200\n250\n"), "--model", "gpt-tiny",
                                "--device", "cpu", "--stages", "2", "--profile", str(path)])
    assert rc == 0
    plan = json.loads(out)
    assert plan["cost_model"] == "profile"
    mb = plan["micro_batches"][0]
    assert main(["cost", "--model", "gpt-tiny", "--device", "cpu", "--stages", "2", "--profile", str(path),
                 "--shape", f"{len(mb['samples'])},{mb['seqlen']}"]) == 0
    row = json.loads(capsys.readouterr().out)[0]
    assert mb["time_ms"] == pytest.approx(row["fw_ms"] + row["bw_ms"])


@pytest.mark.parametrize("schedule", ["1f1b", "adaptive", "auto"])
def test_plan_schedule_fields_and_plan_files_validate(tmp_path, capsys, schedule):
    plan_dir = tmp_path / "plans"
    rc, out, err = _plan(capsys, ["--lengths", _lengths(tmp_path), "--model", "gpt-7b", "--device", "a100-40gb",
                                  "--stages", "8", "--dp", "2", "--schedule", schedule,
                                  "--plan-out", str(plan_dir), "--explain"])
    assert rc == 0, err
    plan = json.loads(out)
    assert plan["schedule"] in (("1f1b", "adaptive", "zb-h1") if schedule == "auto" else (schedule,))
    assert len(plan["stage_peak_mib"]) == 8
    assert 0 <= plan["bubble_fraction"] < 1
    assert plan["simulated_ms"] >= plan["objective_ms"] * 0.5
    assert plan["candidates"], "--explain lists the candidates tried"
    assert sorted(os.listdir(plan_dir)) == [f"replica{r:03d}-stage{s:03d}.plan" for r in range(2) for s in range(8)]
    assert main(["validate", str(plan_dir)]) == 0
    assert "valid" in capsys.readouterr().out
    # A corrupted plan file is refused with exit 2 and the validator's message.
    victim = plan_dir / "replica000-stage001.plan"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    assert main(["validate", str(plan_dir)]) == 2
    assert "replica000-stage001" in capsys.readouterr().err


def test_plan_command_leaves_room_in_flight_as_plan_iteration_does(tmp_path, capsys):
    # gpt-7b on 4 stages of a100-40gb: cut to fit alone, the micro-batches need more recompute
    # in flight than they were priced at; the command and the library keep the same faster cut.
    import numpy as np

    from dynapipe.cli.schedule_options import resolve_cluster
    from dynapipe.data.synthetic import sample_lengths
    from dynapipe.pipeline_planner import plan_iteration

    lengths = sample_lengths(160, 5, 4096)
    path = tmp_path / "l.txt"
    path.write_text("\n".join(map(str, lengths)) + "\n")
    rc, out, err = _plan(capsys, ["--lengths", str(path), "--model", "gpt-7b", "--device", "a100-40gb",
                                  "--stages", "4", "--dp", "2"])
    assert rc == 0, err
    plan = json.loads(out)
    cm = build_cost_model(load_model_config("gpt-7b"), load_device_config("a100-40gb"), 4)
    it = plan_iteration(np.asarray(lengths), cm, dp=2, cluster=resolve_cluster(None, "a100-40gb"))
    assert it.batch_plan.extra["micro_batch_share"] < 1.0
    assert plan["extra"]["micro_batch_share"] == it.batch_plan.extra["micro_batch_share"]
    assert plan["simulated_ms"] == pytest.approx(it.simulated_ms, abs=1e-3)  # the JSON keeps 3 decimals
    assert len(plan["micro_batches"]) == len(it.batch_plan.micro_batches)
    # A given --recompute plans exactly what was asked: no other cut is tried.
    rc, out, _ = _plan(capsys, ["--lengths", str(path), "--model", "gpt-7b", "--device", "a100-40gb",
                                "--stages", "4", "--dp", "2", "--recompute", "selective"])
    assert rc == 0 and json.loads(out)["extra"]["micro_batch_share"] == 1.0


def test_commands_quoted_in_docstrings_have_the_flags_they_name():
    # A docstring that quotes ``python -m dynapipe CMD ... --flag`` must name a flag CMD has.
    import ast
    import importlib
    import re

    from dynapipe.cli import COMMANDS
    from dynapipe.cli.argtypes import StrictArgumentParser

    quoted = re.compile(r"``python -m dynapipe (\w+)([^`]*)``")
    checked = 0
    for folder, _, files in os.walk(os.path.join(ROOT, "dynapipe")):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read())
            docs = [ast.get_docstring(n) for n in ast.walk(tree)
                    if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef))]
            for command, rest in (m.groups() for d in docs if d for m in quoted.finditer(d)):
                flags = re.findall(r"--[a-z][\w-]*", rest)
                if command not in COMMANDS or not flags:
                    continue
                parser = StrictArgumentParser()
                try:
                    importlib.import_module(COMMANDS[command][0]).add_arguments(parser)
                except ImportError:  # a command whose arguments need torch/megatron here
                    continue
                for flag in flags:
                    assert flag in parser._option_string_actions, f"{path}: `{command} {flag}` is not a flag"
                    checked += 1
    assert checked  # profile's docstring names plan's --profile


def test_a_baseline_row_over_the_budget_without_recompute_is_a_note_when_the_schedule_fits_it(tmp_path, capsys):
    # Packing's 4,096-token rows exceed gpt-13b TP2 x PP4's activation budget at recompute
    # none; the schedule search then recomputes to fit, so nothing runs out of memory.
    path = _lengths(tmp_path, "\n".join(["1500", "2000", "3000", "4096", "800", "2500"] * 3) + "\n")
    rc = main(["plan", "--lengths", path, "--model", "gpt-13b", "--device", "a100-40gb", "--stages", "4", "--dp", "2",
               "--tp", "2", "--memory-limit-mb", "38500", "--batching", "packing", "--micro-batch-size", "1",
               "--seq-length", "4096", "--output", str(tmp_path / "p.json")])
    err = capsys.readouterr().err
    assert rc == 0 and "would run out of memory" not in err
    assert ("micro-batch(es) exceed the activation budget at recompute none; the schedule below keeps every stage "
            "within the memory limit") in err
    assert json.load(open(tmp_path / "p.json"))["recompute"] != "none"


def test_recompute_auto_names_the_default_as_training_spells_it(tmp_path, capsys):
    # Training's --dynapipe-recompute defaults to auto; plan and trace took only the levels.
    lengths = _lengths(tmp_path)
    outs = []
    for extra in ([], ["--recompute", "auto"]):
        rc, out, err = _plan(capsys, ["--lengths", lengths, *BASE, "--schedule", "1f1b", *extra])
        assert rc == 0, err
        plan = json.loads(out)
        outs.append({k: v for k, v in plan.items() if not k.endswith("_ms")})
        assert "chosen" in err  # not "as given"
    assert outs[0] == outs[1]
    assert main(["trace", "--lengths", lengths, *BASE, "--recompute", "auto", "--output",
                 str(tmp_path / "t.json")]) == 0
    assert main(["cost", *BASE, "--shape", "1,64", "--recompute", "auto"]) == 2  # cost prices one given level
    assert "invalid choice: 'auto'" in capsys.readouterr().err


def test_plan_json_writes_an_infeasible_candidates_time_as_null():
    # auto placement records each candidate's time; one that does not fit is infinite, which
    # JSON cannot hold (Python wrote Infinity, which strict readers refuse).
    import json

    from dynapipe.cli.plan import dumps_plan

    text = dumps_plan({"placement": {"compared": {"contiguous_ms": 12.5, "interleaved_ms": float("inf")}},
                       "micro_batches": [{"time_ms": float("nan")}]})
    parsed = json.loads(text, parse_constant=lambda name: pytest.fail(f"non-standard JSON number {name}"))
    assert parsed["placement"]["compared"] == {"contiguous_ms": 12.5, "interleaved_ms": None}
    assert parsed["micro_batches"] == [{"time_ms": None}]
