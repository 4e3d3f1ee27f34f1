"""``python -m dynapipe bench``: the README's main job, with a tiny iteration count."""
import json
import subprocess
import sys

import pytest


def test_bench_command_runs_every_method(tmp_path):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    cmd = [sys.executable, "-m", "dynapipe", "bench", "--output", str(out), "--png", str(png),
           "--train-iters", "2", "--seq-length", "256", "--max-position-embeddings", "256",
           "--global-batch-size", "16", "--num-layers", "2"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["methods"]) == {"dynapipe", "padding", "packing"}
    for m in report["methods"].values():
        for key in ("real_tokens_per_s", "padding_efficiency", "iteration_ms", "plan_wait_ms"):
            assert m[key] >= 0, key
        assert m["real_tokens_per_s"] > 0 and 0 < m["padding_efficiency"] <= 1
        assert len(m["lm_loss"]) == 2
    methods = report["methods"]
    # Same data, same initial weights: the first iteration's loss is the same for every method.
    assert methods["dynapipe"]["lm_loss"][0] == pytest.approx(methods["padding"]["lm_loss"][0], abs=1e-5)
    assert methods["packing"]["lm_loss"][0] == pytest.approx(methods["padding"]["lm_loss"][0], abs=1e-5)
    assert methods["dynapipe"]["padding_efficiency"] > methods["padding"]["padding_efficiency"]
    assert report["setup"]["cost_model"].endswith(".profile.json")
    assert "vs padding" in result.stdout and "dynapipe" in result.stdout
    assert png.stat().st_size > 1000


def test_bench_rejects_a_method_flag():
    result = subprocess.run([sys.executable, "-m", "dynapipe", "bench", "--output", "x.json", "--use-dynapipe"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "--use-dynapipe" in result.stderr


def test_bench_rejects_unknown_method(tmp_path):
    result = subprocess.run([sys.executable, "-m", "dynapipe", "bench", "--output", str(tmp_path / "x.json"),
                             "--methods", "dynapipe,zero-bubble"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "zero-bubble" in result.stderr
