"""Fail-safety battery, Megatron training arguments: bad integers and numbers on every flag,
invalid combinations, bad run configs, all given to ``scripts/pretrain_gpt.py``.

Each must end in one clear line (``error: ...``) and exit status 2, validated before any process
group starts: a typo should cost a second, not a cluster allocation. The script's ``main`` is
called in-process (the real process is in ``test_failsafe_inputs.py``).
"""
from __future__ import annotations

import importlib.util
import os

import pytest

from failsafe_common import ROOT, TRAIN_BASE, fill_paths, one_line_error
from failsafe_common import files  # noqa: F401  (a fixture: pytest finds it in this module)


TRAIN_INT_FLAGS = ["--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length", "--micro-batch-size",
                   "--global-batch-size", "--train-iters", "--seed", "--vocab-size", "--pipeline-model-parallel-size",
                   "--log-interval", "--dynapipe-prefetch", "--dynapipe-redis-port", "--dynapipe-planner-workers"]
TRAIN_FLOAT_FLAGS = ["--lr", "--min-lr", "--weight-decay", "--clip-grad", "--adam-eps", "--adam-beta1",
                     "--hidden-dropout", "--init-method-std", "--dynapipe-timeout-s", "--dynapipe-memory-limit-mb",
                     "--dynapipe-store-retry-s"]
TRAIN_INVALID = [
    (["--global-batch-size", "5"], "--global-batch-size 5"),
    (["--fp16", "--bf16"], "--fp16"),
    (["--loss-scale", "1024"], "--loss-scale applies to --fp16 and --bf16"),
    (["--hidden-size", "66"], "divisible"),
    (["--seq-length", "128", "--max-position-embeddings", "64"], "--max-position-embeddings"),
    (["--lr", "-1"], "--lr"),
    (["--train-iters", "0"], "--train-iters"),
    (["--hidden-dropout", "1.5"], "--hidden-dropout"),
    (["--pipeline-model-parallel-size", "2"], "world size"),
    (["--dynapipe-store-retry-s", "-1"], "--dynapipe-store-retry-s"),
    (["--dynapipe-prefetch", "0"], "--dynapipe-prefetch 0"),
    (["--dynapipe-redis-port", "0"], "--dynapipe-redis-port"),
    (["--dynapipe-redis-port", "70000"], "--dynapipe-redis-port"),
    (["--save", "{binary}"], "--save"),
    (["--save", "{under_file}"], "--save"),
    (["--save", "/proc/self"], "--save"),
    (["--tensorboard-dir", "{binary}"], "--tensorboard-dir"),
    (["--tensorboard-dir", "{under_file}"], "--tensorboard-dir"),
    (["--use-dynapipe", "--dynapipe-trace-dir", "{binary}"], "--dynapipe-trace-dir"),
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
    # An empty path (an unset shell variable) is not "not given": the run would write nothing.
    (["--save", ""], "--save '': an empty path"),
    (["--tensorboard-dir", ""], "--tensorboard-dir '': an empty path"),
    (["--run-config", ""], "--run-config '': an empty path"),
    (["--run-config", "{a_dir}"], "is a directory; give a run config YAML file"),
    (["--use-dynapipe", "--dynapipe-cost-model", "{a_dir}"], "is a directory; give the profile JSON file in it"),
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
    rc, err = run_pretrain(capsys, pretrain_main, [*argv, *fill_paths(args, files)])
    one_line_error(rc, err, needle)


RUN_CONFIGS = {
    "bad_yaml": ("args: [1\n", "not valid YAML"),
    "unknown_top": ("launch: {}\nargs: {}\nextra: 1\n", "unexpected"),
    "args_list": ("args: [1, 2]\n", "args"),
    "world_mismatch": ("launch: {nnodes: 1, nproc_per_node: 8}\nargs: {mock-data: true}\n", "8 ranks"),
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


def test_a_model_no_memory_holds_stops_with_its_sizes_named(tmp_path):
    import subprocess
    import sys

    if open("/proc/sys/vm/overcommit_memory").read().strip() == "1":
        pytest.skip("the kernel grants any allocation (vm.overcommit_memory=1): a 256 GB table would be touched")
    # A position table of a billion rows: torch's allocator refused it with a traceback.
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "pretrain_gpt.py"), *TRAIN_BASE,
                        "--max-position-embeddings", "999999999"], capture_output=True, text=True, timeout=240,
                       cwd=str(tmp_path))
    assert r.returncode == 2, r.stderr[-2000:]
    assert "error: building this rank's stage ran out of memory (" in r.stderr
    assert "check the sizes it was built with (--max-position-embeddings, --vocab-size" in r.stderr
    assert "Traceback" not in r.stderr
