"""The benches in scripts/ refuse a bad command line as the rest of the project does: one line
on stderr naming the flag, exit status 2, before they spawn a rank, train, plan, pin the
process to a core or create an output folder.

Every script is run in-process through its ``main(argv)`` with the work it would start
replaced by a function that fails the test, so no case can spawn or plan for long."""
import importlib
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))


class Reached(Exception):
    """The expensive work was reached: the command line passed every check."""


def _reached(*args, **kwargs):
    raise Reached()


def _guard(name: str, monkeypatch):
    """The script module ``name`` with everything expensive it starts replaced by :func:`_reached`."""
    mod = importlib.import_module(name)
    if name == "bench_loader":
        monkeypatch.setattr(mod.tmp, "start_processes", _reached)
    elif name == "bench_executor":
        monkeypatch.setattr(mod, "spawn", _reached)
    elif name == "bench_gpt_interleaved":
        import megatron_integration.jobs

        monkeypatch.setattr(megatron_integration.jobs, "run_trainings", _reached)
    elif name == "bench_schedules":
        monkeypatch.setattr(mod, "bench_stage_count", _reached)
    elif name == "bench_planner":
        monkeypatch.setattr(mod, "bench_size", _reached)
    elif name == "bench_plan_scale":
        monkeypatch.setattr(mod, "once", _reached)
    elif name == "bench_cluster":
        monkeypatch.setattr(mod, "run_case", _reached)
    if hasattr(os, "sched_setaffinity"):
        monkeypatch.setattr(os, "sched_setaffinity", _reached)  # pinning is after the checks too
    return mod


def _exit_code(main, argv):
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


# The flag each script writes its output to (None: it writes none).
OUTPUT_FLAG = {"bench_loader": "--output", "bench_executor": "--trace-out", "bench_gpt_interleaved": "--output",
               "bench_schedules": "--output", "bench_planner": "--json", "bench_plan_scale": None,
               "bench_cluster": "--output"}
THROUGH_FILE = "<through a file>"  # stands for an output path under a regular file

CASES = [
    # The warm-up defaults to --prefetch (4), which leaves 3 iterations none to time.
    ("bench_loader", ["--iterations", "3", "--step-ms", "10"], "--iterations"),
    ("bench_loader", ["--iterations", "0"], "--iterations"),
    ("bench_loader", ["--warmup", "5", "--iterations", "5"], "--warmup"),
    ("bench_loader", ["--pp", "2"], "--pp"),  # gpt-7b's states do not fit two a100-40gb stages
    ("bench_loader", ["--model", "nope"], "--model"),
    ("bench_loader", ["--workers", "0"], "--workers"),
    ("bench_loader", ["--schedule", "interleaved"], "--schedule"),
    ("bench_loader", ["--output", THROUGH_FILE], "--output"),
    # The sampler's check, before the spawn (it came after every rank had started).
    ("bench_loader", ["--global-batch-size", "1", "--dp", "2"], "--global-batch-size 1 is smaller than the 2"),
    ("bench_executor", ["--micro-batches", "0"], "--micro-batches"),
    ("bench_executor", ["--mbs", "0"], "--mbs"),
    ("bench_executor", ["--seqlen", "-1"], "--seqlen"),
    ("bench_executor", ["--stages", "1"], "--stages"),
    ("bench_executor", ["--trace-out", THROUGH_FILE], "--trace-out"),
    ("bench_gpt_interleaved", ["--bogus-flag"], "--bogus-flag"),
    ("bench_gpt_interleaved", ["--nproc", "0"], "--nproc"),
    ("bench_gpt_interleaved", ["--nproc", "3"], "--nproc"),  # the tiny preset has 2 stages
    ("bench_gpt_interleaved", ["--chunks", "3"], "--chunks"),  # 2 layers a rank
    ("bench_gpt_interleaved", ["--chunks", "1"], "--chunks"),
    ("bench_gpt_interleaved", ["--output", THROUGH_FILE], "--output"),
    ("bench_schedules", ["--model", "nope"], "--model"),
    ("bench_schedules", ["--batches", "0"], "--batches"),
    ("bench_schedules", ["--samples", "0"], "--samples"),
    ("bench_schedules", ["--stages", "4", "0"], "--stages"),
    ("bench_schedules", ["--seed", "-1"], "--seed"),
    ("bench_schedules", ["--output", THROUGH_FILE], "--output"),
    ("bench_planner", ["--repeats", "0"], "--repeats"),
    ("bench_planner", ["--samples", "256", "0"], "--samples"),
    ("bench_planner", ["--stages", "0"], "--stages"),
    ("bench_planner", ["--device", "nope"], "--device"),
    ("bench_planner", ["--json", THROUGH_FILE], "--json"),
    ("bench_plan_scale", ["--repeats", "0"], "--repeats"),
    ("bench_plan_scale", ["--replicas", "-1"], "--replicas"),
    ("bench_plan_scale", ["--replicas", "65"], "--replicas"),  # more than --dp 64
    ("bench_plan_scale", ["--samples", "0"], "--samples"),
    ("bench_plan_scale", ["--gap", "-1"], "--gap"),
    ("bench_cluster", ["--seed", "-1", "--quick"], "--seed"),
    ("bench_cluster", ["--tokens", "0", "--quick"], "--tokens"),
    ("bench_cluster", ["--batches", "0"], "--batches"),
    ("bench_cluster", ["--methods", "nope"], "--methods"),
    ("bench_cluster", ["--case", "nope"], "--case"),
    ("bench_cluster", ["--cluster", "nope"], "--cluster"),
    ("bench_cluster", ["--output", THROUGH_FILE], "--output"),
]


@pytest.mark.parametrize("name, argv, flag", CASES, ids=[f"{n}:{' '.join(a)}" for n, a, _ in CASES])
def test_bad_input_is_one_line_naming_the_flag_before_any_work(name, argv, flag, tmp_path, monkeypatch, capsys):
    mod = _guard(name, monkeypatch)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    out_dir = tmp_path / "out"
    argv = [str(blocker / "x.json") if a == THROUGH_FILE else a for a in argv]
    out_flag = OUTPUT_FLAG[name]
    if out_flag is not None and out_flag not in argv:
        argv += [out_flag, str(out_dir / "result.json")]
    assert _exit_code(mod.main, argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and err.endswith("\n"), err
    assert flag in err, err
    assert "Traceback" not in err
    assert not out_dir.exists()  # no output folder before the checks pass
    assert os.listdir(tmp_path) == ["a-file"]


def test_the_loader_bench_names_its_own_flags_for_a_model_that_does_not_fit(monkeypatch, capsys):
    # The planner's message names the `plan` command's --stages and --memory-limit-mb.
    mod = _guard("bench_loader", monkeypatch)
    assert mod.main(["--pp", "2"]) == 2
    err = capsys.readouterr().err
    assert "(--pp)" in err and "--stages" not in err and "--memory-limit-mb" not in err


GOOD = {
    "bench_loader": ["--iterations", "5"],
    "bench_executor": ["--no-megatron"],
    "bench_gpt_interleaved": [],
    "bench_schedules": [],
    "bench_planner": ["--no-pin"],
    "bench_plan_scale": ["--no-pin"],
    "bench_cluster": ["--quick"],
}


@pytest.mark.parametrize("name", sorted(GOOD))
def test_good_input_passes_the_checks_and_creates_nothing_early(name, tmp_path, monkeypatch, capsys):
    mod = _guard(name, monkeypatch)
    argv = list(GOOD[name])
    if OUTPUT_FLAG[name] is not None:
        argv += [OUTPUT_FLAG[name], str(tmp_path / "new" / "result.json")]  # a missing folder is fine
    with pytest.raises(Reached):
        mod.main(argv)
    assert "error" not in capsys.readouterr().err
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("name", sorted(GOOD))
def test_help(name, capsys):
    mod = importlib.import_module(name)
    assert _exit_code(mod.main, ["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: ")
    if name == "bench_executor":  # the first paragraph whole, not its first line
        assert "megatron-core's own non-interleaved 1F1B" in " ".join(out.split())
    if name == "bench_planner":
        assert "--memory-limit-mb" not in out  # not a flag of this script


def test_the_cluster_bench_names_its_own_flag_for_batches_smaller_than_the_replicas(tmp_path, monkeypatch, capsys):
    # The planner would name the `plan` command's --dp, which this script does not have.
    mod = importlib.import_module("bench_cluster")
    monkeypatch.setattr(mod, "plan_iteration", _reached)
    out = tmp_path / "out" / "r.json"
    assert _exit_code(mod.main, ["--quick", "--tokens", "100", "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --tokens 100 draws a global batch of 1 sample(s)") and err.count("\n") == 1, err
    assert "--dp" not in err and not out.exists()
