"""scripts/gpu_check.py on a machine without CUDA: it stops with one line; the parts that
need no GPU (THD packing layout, the report, the whole flow at a tiny shape) are checked here."""
import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from dynapipe.data.samples import Sample
from megatron_integration.gpu_check_report import best_of, checks, failed, loss_spread, markdown
from megatron_integration.thd_packing import thd_micro_batch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import gpu_check  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only path")
def test_without_cuda_it_stops_with_one_line(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gpu_check.py"), "--output",
                           str(tmp_path / "out")], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: gpu_check needs a CUDA GPU") and proc.stderr.count("\n") == 1
    assert not (tmp_path / "out").exists()  # nothing written


@pytest.mark.parametrize("argv, message", [
    (["--baseline-mbs", "1,x"], "--baseline-mbs '1,x': expected positive whole numbers"),
    (["--baseline-mbs", "0,2"], "--baseline-mbs '0,2': expected positive whole numbers"),
    (["--baseline-mbs", "3"], "3 does not divide the global batch of 64 samples"),
    (["--profile-mbs", "zz"], "--profile-mbs 'zz': expected positive whole numbers"),
    (["--timeout-s", "-5"], "--timeout-s -5.0: must be a positive number of seconds"),
    (["--baseline-mbs", "2,2"], "--baseline-mbs 2,2: a size is given twice"),
    # The output folder is checked before the GPU too (a file there ended in a traceback).
    (["--output", "FILE"], "is a file, not a directory"),
    (["--output", ""], "--output '': an empty path"),
])
def test_bad_flags_are_refused_before_anything_runs(tmp_path, capsys, argv, message):
    # Checked before the GPU is even looked for: GPU time is too scarce to learn of them from a
    # failed job.
    (tmp_path / "FILE").write_text("a file where the output folder would go")
    argv = [str(tmp_path / "FILE") if a == "FILE" else a for a in argv]
    assert gpu_check.main(["--output", str(tmp_path / "out"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


def test_a_profile_that_does_not_finish_is_killed_at_the_timeout():
    from dynapipe.errors import DynaPipeError

    with pytest.raises(DynaPipeError, match="did not finish within 0 s"):
        gpu_check.run_profile(["--help"], 0.01)


def _sample(n_in, n_tg, start):
    return Sample(input_ids=np.arange(start, start + n_in), target_ids=np.arange(start + 100, start + 100 + n_tg))


def test_thd_micro_batch_marks_sample_boundaries():
    mb = thd_micro_batch([_sample(3, 2, 10), _sample(0, 4, 50)])
    assert mb["cu_seqlens"].tolist() == [0, 5, 9] and mb["cu_seqlens"].dtype == np.int32
    assert mb["max_seqlen"] == 5
    assert mb["tokens"].shape == (1, 9)
    assert mb["position_ids"][0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3]  # restart per sample
    # The loss never reaches across a boundary: a sample's last token predicts nothing.
    assert mb["loss_mask"][0].tolist() == [0, 0, 1, 1, 0, 1, 1, 1, 0]
    assert mb["labels"][0, 4] == 0 and mb["labels"][0, 3] == 111


def test_report_table_and_loss_spread():
    r = lambda tps, loss, planned: {"real_tokens_per_s": tps, "iteration_ms": 100.0, "losses": loss,  # noqa: E731
                                     "activation_measured_mib": 900.0, "activation_planned_mib": planned}
    results = {"dynapipe (none)": {**r(3000.0, [2.0, 1.0], 1000.0), "max_allocated_mib": 5120.4,
                                   "max_reserved_mib": 6200.0},
               "padding (mbs 1)": r(800.0, [2.0, 1.02], None),
               "padding (mbs 2)": r(1000.0, [2.0, 1.01], None), "packing (thd)": r(1500.0, [2.0, 1.0], None),
               "dynapipe (full)": {"error": "RankFailed: rank 0 ran out of memory\ntraceback ...\nlast line"}}
    assert best_of(results, "padding") == "padding (mbs 2)"  # the tuned baseline
    spread = loss_spread(results)
    assert spread == pytest.approx(0.01 / 1.01)  # against the best padding run; the failed phase skipped
    table = markdown(results, spread)
    # The allocator's maxima where the run recorded them (GPUs), "-" where not.
    assert "| dynapipe (none) | 3,000 | 3.00x | 2.00x | 100 | 900 / 1000 (0.90) | 5,120 / 6,200 |" in table
    assert "| padding (mbs 2) | 1,000 | 1.00x | 0.67x | 100 | 900 / - | - |" in table
    assert "| padding (mbs 1) | 800 | 0.80x | 0.53x | 100 | 900 / - | - |" in table
    assert "- dynapipe (full) failed: last line" in table and "padding (mbs 2)'s: 9.90e-03" in table
    assert loss_spread({"packing (thd)": results["packing (thd)"]}) is None
    # A loss 1% off the best padding run's fails the check, as a peak 10% over the plan's would.
    verdict = checks(results)
    assert not verdict["losses"]["ok"] and verdict["activation_peak"]["ok"]
    assert verdict["activation_peak"]["measured_over_planned"] == {"dynapipe (none)": 0.9}
    assert failed({"methods": {k: v for k, v in results.items() if "error" not in v}})
    assert "- check failed: losses differ by 9.90e-03 (relative), over 0.001" in table
    close = {k: {**v, "losses": [2.0, 1.0]} for k, v in results.items() if "error" not in v}
    assert not failed({"methods": close})
    close["dynapipe (none)"]["activation_measured_mib"] = 1200.0
    assert failed({"methods": close})
    # A NaN in a later run is no agreement (Python's max would have kept the finite spread before it).
    late_nan = {k: {**v, "activation_measured_mib": 900.0} for k, v in close.items()}
    late_nan["dynapipe (none)"]["losses"] = [2.0, float("nan")]
    assert loss_spread(late_nan) == float("inf") and failed({"methods": late_nan})
    assert "dynapipe (none) measured 1.20x its planned activation peak" in markdown(close, 0.0)
    assert gpu_check.device_config("NVIDIA H200", 143771) == "h200"
    assert gpu_check.device_config("NVIDIA A100-SXM4-40GB", 40960) == "a100-40gb"
    # A GPU no shipped config describes is named by none: a named one would make every DynaPipe
    # run refuse the profile measured on this GPU as another model's.
    assert gpu_check.device_config("NVIDIA L40S", 46068) is None
    assert gpu_check.device_config("NVIDIA A100-SXM4-80GB", 81920) is None


# The check's own flow at a tiny shape, on CPU (it has to work the first time it meets a GPU):
# the profile, every method in its own job, the report written after each phase.
TINY = gpu_check.CheckShape(
    model_args=tuple(("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 256 "
                      "--seq-length 256 --max-position-embeddings 256 --vocab-size 512 --position-embedding-type rope "
                      "--hidden-dropout 0 --attention-dropout 0").split()),
    train_args=tuple(("--micro-batch-size 1 --global-batch-size 16 --train-iters 2 --lr 1e-4 --mock-data "
                      "--log-interval 1 --seed 1234").split()),
    profile_grid=("--mbs", "1,2", "--seqlens", "64,256", "--repeats", "1", "--no-progress"),
    baseline_mbs=(1, 2), unfused_profile_mbs=None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU rehearsal")
def test_the_whole_check_runs_at_a_tiny_shape_on_cpu(tmp_path):
    before = dict(os.environ)
    report = gpu_check.run(str(tmp_path), 240, TINY)
    assert dict(os.environ) == before  # the profile ran in its own process: no process group left here
    methods = report["methods"]
    assert list(methods) == ["dynapipe (none)", "padding (mbs 1)", "packing (masked rows, mbs 1)",
                             "packing (masked rows, mbs 2)", "dynapipe (selective)", "dynapipe (full)",
                             "padding (mbs 2)", "dynapipe (none, distributed optimizer)", "dynapipe (none, traced)"]
    # The distributed optimizer is GPU-only: refused here, recorded, and the check went on.
    assert "--use-distributed-optimizer needs GPUs" in methods.pop("dynapipe (none, distributed optimizer)")["error"]
    assert all("error" not in r for r in methods.values()), methods
    assert not failed({"profile": report["profile"], "methods": methods})
    assert report["cost_model"].endswith("profile.json") and report["packing_path"] == "masked rows"
    # The analytic model's stored memory of a layer against the profile's, at every grid point:
    # dropout 0 and rotary positions in fp32 local layers, counted within 10% (the rotary
    # angles' cosines and sines are the part it leaves out).
    analytic = report["analytic_memory"]
    assert analytic["fused_attention"] is False and len(analytic["points"]) == 4
    for point in analytic["points"]:
        for level in ("none", "selective"):
            assert 0.9 <= point[level]["analytic_over_measured"] <= 1.1, point
    # Same global batches, same model, fp32: every method's losses agree.
    assert report["max_relative_loss_difference"] < 1e-5
    for name, r in methods.items():
        assert r["real_tokens_per_s"] > 0 and len(r["losses"]) == 2
        assert (r["activation_planned_mib"] is not None) == name.startswith("dynapipe"), name
        assert r["max_reserved_mib"] is None  # the CUDA allocator's figure: none on CPUs
    saved = json.loads((tmp_path / "gpu_check.json").read_text())
    assert saved["methods"].keys() == report["methods"].keys() | {"dynapipe (none, distributed optimizer)"}
    assert "| dynapipe (full) |" in (tmp_path / "gpu_check.md").read_text()
    assert (tmp_path / "trace" / "rank000.json").exists()  # the traced DynaPipe run's executor trace


def test_a_failed_profile_leaves_the_dynapipe_runs_to_the_analytic_model(tmp_path, monkeypatch):
    import megatron_integration.jobs as jobs

    seen, profiled = [], []
    monkeypatch.setattr(gpu_check, "run_profile", lambda argv, timeout_s: profiled.append(argv) or 1)  # it fails
    monkeypatch.setattr(jobs, "run_training", lambda argv, *a, **k: seen.append(list(argv)) or [{
        "iteration_ms": [10.0, 10.0], "real_tokens": [100, 100], "losses": [2.0, 1.0],
        "activation_measured_mib": [1.0, 1.0], "activation_planned_mib": [None, None]}])
    report = gpu_check.run(str(tmp_path), 10, TINY)
    assert "profiling failed" in report["profile"]["error"] and report["cost_model"] == "analytic"
    assert failed(report) and "analytic cost model" in (tmp_path / "gpu_check.md").read_text()
    planned = [a for a in seen if "--use-dynapipe" in a]
    assert len(planned) == 5 and all(a[a.index("--dynapipe-cost-model") + 1] == "analytic" for a in planned)
    # The baselines ran at each of the micro-batch sizes asked for.
    sizes = sorted(a[a.index("--micro-batch-size") + 1] for a in seen if "--use-dynapipe" not in a)
    assert sizes == ["1", "1", "2", "2"]
    # Without Transformer Engine (here) the profile stops at the unfused sizes, unless told.
    assert profiled[0][profiled[0].index("--mbs") + 1] == "1,2"
    gpu_check.run(str(tmp_path), 10, dataclasses.replace(TINY, unfused_profile_mbs="1"))
    assert profiled[1][profiled[1].index("--mbs") + 1] == "1"
