"""``python -m dynapipe profile``: real megatron-core measurements the profile cost model reads."""
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from dynapipe.config import load_model_config
from dynapipe.cost import build_cost_model
from dynapipe.cost.profile import ProfileCostModel
from megatron_integration.profiler import MIB, LiveMemoryTracker, measure_op


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("profile") / "tiny.json"
    cmd = [sys.executable, "-m", "dynapipe", "profile", "--output", str(path), "--model", "gpt-tiny",
           "--mbs", "1,2", "--seqlens", "32,64,128", "--repeats", "1", "--threads", "1"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    return path


def test_profile_loads_in_the_cost_model(profile_path):
    data = json.loads(profile_path.read_text())
    assert data["format"] == "dynapipe-profile" and data["version"] == 1
    assert data["mbs"] == [1, 2] and data["seqlen"] == [32, 64, 128]
    assert data["layer_spec"] == "local" and data["device"] == "cpu"
    tiny = load_model_config("gpt-tiny")
    model = build_cost_model(tiny, None, num_stages=2, profile=str(profile_path))
    assert isinstance(model, ProfileCostModel)
    cost = model.stage_cost([1, 2], [64, 100])
    assert np.all(cost.fw_ms > 0) and np.all(cost.bw_ms > 0) and np.all(cost.stored_mib > 0)


def test_measured_memory_scales_as_activations_do(profile_path):
    layer = json.loads(profile_path.read_text())["ops"]["layer"]
    stored = np.array(layer["stored_mib"])
    # Twice the samples store twice the activations; longer sequences store more.
    assert stored[1] == pytest.approx(2 * stored[0], rel=0.05)
    assert np.all(np.diff(stored, axis=1) > 0)
    # A [s, b, h] fp32 layer input alone is s*b*h*4 bytes; a layer stores several such tensors.
    assert stored[0][0] > 32 * 1 * 64 * 4 * 4 / MIB


def test_live_memory_tracker_counts_what_is_alive():
    x = torch.randn(1024, 256, requires_grad=True)  # 1 MiB
    w = torch.randn(256, 1024, requires_grad=True)  # 1 MiB
    with LiveMemoryTracker() as tracker:
        y = x @ w  # 4 MiB
        z = torch.relu(y)  # 4 MiB, saved for the backward
        del y
        assert tracker.live == pytest.approx(4 * MIB, rel=0.01)
        assert tracker.peak == pytest.approx(8 * MIB, rel=0.01)
        z.sum().backward()
        del z
    # What survives: the two parameter gradients.
    assert tracker.live == pytest.approx(2 * MIB, rel=0.01)


def test_measure_op_reports_saved_tensors_not_parameters():
    lin = torch.nn.Linear(64, 64)
    x = torch.randn(128, 64, requires_grad=True)
    m = measure_op(lambda: torch.nn.functional.gelu(lin(x)), list(lin.parameters()), torch.device("cpu"),
                   repeats=1, warmup=0)
    # Saved: x (for the weight gradient) and the linear output (for gelu); never the weight.
    assert m.stored_mib == pytest.approx(2 * 128 * 64 * 4 / MIB, rel=0.01)
    assert m.fw_ms > 0 and m.bw_ms > 0 and m.peak_mib >= 0


def test_bad_grid_is_refused(tmp_path):
    cmd = [sys.executable, "-m", "dynapipe", "profile", "--output", str(tmp_path / "p.json"), "--model", "gpt-tiny",
           "--seqlens", "64,32"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "--seqlens '64,32'" in result.stderr
