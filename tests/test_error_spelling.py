"""Errors name what the caller gave: Python parameters from Python, the command's flags under
``python -m dynapipe``, Megatron's flags under a training job; and bad arguments to the documented
API functions are refused in one line instead of raising from deep inside."""
import numpy as np
import pytest

from dynapipe.advise import enumerate_layouts
from dynapipe.batching import plan_micro_batches
from dynapipe.cli.spelling import CLI_SPELLING
from dynapipe.config import load_cluster_config, load_device_config, load_model_config
from dynapipe.cost import StagePlacement, build_cost_model, plan_placement
from dynapipe.errors import DynaPipeError, PlanError, arg, given, spelled_as, spelling
from dynapipe.pipeline_planner import plan_iteration
from dynapipe.plan import serialize_plan
from dynapipe.runtime.loader import LoaderConfig
from dynapipe.runtime.plan_source import PlannerSettings, check_planner_settings
from megatron_integration.flag_spelling import MEGATRON_SPELLING

GPT = load_model_config("gpt-tiny")
GPT7 = load_model_config("gpt-7b")
CPU = load_device_config("cpu")
CM = build_cost_model(GPT, CPU, 2)
LENS = np.arange(16, 48)

# (call, Python's wording, the command line's, a training job's)
CASES = [
    (lambda: plan_micro_batches(LENS, CM, dp=0), "dp=0 must be a positive integer", "--dp 0 must", None),
    (lambda: plan_micro_batches(LENS, CM, method="foo"), "method='foo' is not a batching method",
     "--batching foo is not", "--dynapipe-batching foo is not"),
    (lambda: plan_micro_batches(LENS, CM, method="packing", micro_batch_size=0), "micro_batch_size=0 must be",
     "--micro-batch-size 0 must", "--micro-batch-size 0 must"),
    (lambda: plan_iteration(LENS, CM, schedule="foo"), "schedule='foo' is not known", "--schedule foo is not",
     "--dynapipe-schedule foo is not"),
    (lambda: build_cost_model(GPT, CPU, 100), "num_stages=100 exceeds the 4 layers", "--stages 100 exceeds",
     "--pipeline-model-parallel-size 100 exceeds"),
    (lambda: enumerate_layouts(GPT7, 0, load_cluster_config("a100-8x")), "gpus=0: need a whole number",
     "--gpus 0: need", None),
    (lambda: enumerate_layouts(GPT7, 16, load_cluster_config("a100-8x"), tp_sizes=[]),
     "tp_sizes=[]: no tensor-parallel size to try", "--tp-sizes []", None),
    (lambda: StagePlacement.parse("1,1,2", GPT, 2), "names 3 stages; num_stages is 2",
     "names 3 stages; --stages is 2", "names 3 stages; --pipeline-model-parallel-size is 2"),
    (lambda: LoaderConfig(num_workers=0).validate(), "num_workers=0: must be at least 1",
     None, "--dynapipe-planner-workers 0: must"),
    (lambda: LoaderConfig(kv_backend="memcached").validate(), "kv_backend='memcached': use one of",
     None, "--dynapipe-kv-backend memcached:"),
]


@pytest.mark.parametrize("call,python,cli,megatron", CASES)
def test_errors_name_the_callers_spelling(call, python, cli, megatron):
    with pytest.raises(DynaPipeError) as e:
        call()
    assert python in str(e.value) and "--" not in str(e.value).split(";")[0], str(e.value)
    for names, want in ((CLI_SPELLING, cli), (MEGATRON_SPELLING, megatron)):
        if want is None:
            continue
        with spelled_as(names):
            with pytest.raises(DynaPipeError) as e:
                call()
        assert want in str(e.value), (want, str(e.value))
        assert python.split("=")[0] + "=" not in str(e.value), str(e.value)


def test_a_spelling_holds_inside_its_block_only():
    assert spelling() == {}
    with spelled_as({"num_stages": "--pp"}):
        with spelled_as({"dp": "--data-parallel"}):
            assert arg("num_stages") == "--pp" and given("dp", 2) == "--data-parallel 2"
        assert given("dp", 2) == "dp=2" and given("method", "x") == "method='x'"
        assert given("memory_limit_mib", np.float64(1000)) == "memory_limit_mib=1000.0"
    with pytest.raises(RuntimeError):
        with spelled_as({"dp": "--dp"}):
            raise RuntimeError("restored even so")
    assert spelling() == {} and arg("num_stages") == "num_stages"


@pytest.mark.parametrize("call,error,text", [
    (lambda: load_model_config(5), DynaPipeError, "model config 5: give a YAML file's path or the name"),
    (lambda: load_device_config(None), DynaPipeError, "device config None: give a YAML file's path"),
    (lambda: plan_placement(CM, [1, 2, 3]), DynaPipeError, "sample [1, 2, 3]: give a PlacementSample"),
    (lambda: serialize_plan(None), PlanError, "serialize_plan takes an ExecutionPlan, got NoneType"),
    (lambda: build_cost_model(CPU, GPT, 2), DynaPipeError, "model DeviceConfig(name='cpu', ...): give a ModelConfig"),
    (lambda: LoaderConfig(global_batch_size="8").validate(), DynaPipeError,
     "LoaderConfig: global_batch_size='8' must be an integer"),
    (lambda: check_planner_settings(PlannerSettings(GPT, CPU, 2, 1, method="foo")), DynaPipeError,
     "method='foo' is not a batching method"),
    (lambda: check_planner_settings(PlannerSettings(GPT, CPU, 2, 1, schedule="1F1B")), DynaPipeError,
     "schedule='1F1B' is not known"),
    (lambda: check_planner_settings(PlannerSettings(GPT, CPU, 2, 1, max_tokens=1024)), DynaPipeError,
     "max_tokens=1024: method='dynapipe' does not read it"),
])
def test_bad_arguments_to_the_api_are_refused_in_one_line(call, error, text):
    with pytest.raises(error) as e:
        call()
    assert text in str(e.value), str(e.value)


def test_trace_refuses_output_and_out_naming_two_paths(tmp_path, capsys):
    from dynapipe.cli import main

    rc = main(["trace", "--model", "gpt-tiny", "--device", "cpu", "--stages", "2", "--samples", "8",
               "--output", str(tmp_path / "a.json"), "--out", str(tmp_path / "b.json")])
    err = capsys.readouterr().err
    assert rc == 2 and "--output and --out are one flag" in err, err
    assert not (tmp_path / "a.json").exists() and not (tmp_path / "b.json").exists()


def test_a_refused_profile_prints_its_error_alone(tmp_path, capsys):
    # The two-length note used to come before the refusal of a later flag.
    from dynapipe.cli import main

    rc = main(["profile", "--output", str(tmp_path / "p.json"), "--model", "gpt-tiny", "--seqlens", "32,64",
               "--mbs", "1", "--repeats", "0"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--repeats 0" in err[0], err


def test_a_size_the_method_would_not_read_is_refused():
    # The command line refused these; from Python they were planned as if not given.
    with pytest.raises(DynaPipeError, match=r"micro_batch_size=2: method='dynapipe' sizes every micro-batch itself"):
        plan_micro_batches(LENS, CM, micro_batch_size=2)
    with pytest.raises(DynaPipeError, match=r"max_tokens=1000: method='dynapipe' does not read it"):
        plan_iteration(LENS, CM, max_tokens=1000)
    with pytest.raises(DynaPipeError, match=r"max_tokens=1000: method='packing' does not read it"):
        plan_micro_batches(LENS, CM, method="packing", max_tokens=1000)
    assert plan_micro_batches(LENS, CM, method="token-budget", max_tokens=1000).micro_batches
    assert plan_micro_batches(LENS, CM, method="packing", micro_batch_size=2).micro_batches


def test_advise_names_only_its_own_flags(capsys):
    # advise has no --stages or --recompute: its fixes must not send the user to them.
    from dynapipe.cli import main

    rc = main(["advise", "--model", "gpt-tiny", "--device", "a100-40gb", "--cluster", "a100-8x", "--gpus", "2",
               "--mixture", "flan-mixture", "--tokens-per-iteration", "4096", "--batches", "1", "--no-packing",
               "--no-progress", "--memory-limit-mb", "2060"])
    err = capsys.readouterr().err
    assert rc == 2 and "raise --memory-limit-mb" in err and "add pipeline stages" in err, err
    assert "--stages" not in err and "num_stages" not in err and "--recompute" not in err, err


def _raise_num_stages():
    from dynapipe.errors import DynaPipeError, given

    raise DynaPipeError(f"{given('num_stages', 3)}: refused in a spawned rank")


def test_a_spawned_rank_names_parameters_as_its_parent():
    from megatron_integration.launch import RankUserError, spawn

    with spelled_as(MEGATRON_SPELLING), pytest.raises(RankUserError, match="--pipeline-model-parallel-size 3: refused"):
        spawn(_raise_num_stages, 1, (), timeout_s=60)
    with pytest.raises(RankUserError, match="num_stages=3: refused"):
        spawn(_raise_num_stages, 1, (), timeout_s=60)


def test_the_plan_scale_bench_names_its_flags(capsys):
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "bench_plan_scale.py")
    spec = importlib.util.spec_from_file_location("bench_plan_scale", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--model", "gpt-tiny", "--stages", "100", "--dp", "1", "--samples", "10", "--no-pin"]) == 2
    err = capsys.readouterr().err
    assert "--stages 100 exceeds" in err and "num_stages" not in err, err
    assert spelling() == {}
