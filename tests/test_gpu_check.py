"""scripts/gpu_check.py on a machine without CUDA: it stops with one line; the parts that
need no GPU (THD packing layout, the report) are checked here."""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from dynapipe.data.samples import Sample

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


def _sample(n_in, n_tg, start):
    return Sample(input_ids=np.arange(start, start + n_in), target_ids=np.arange(start + 100, start + 100 + n_tg))


def test_thd_micro_batch_marks_sample_boundaries():
    mb = gpu_check.thd_micro_batch([_sample(3, 2, 10), _sample(0, 4, 50)])
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
    results = {"dynapipe (none)": r(3000.0, [2.0, 1.0], 1000.0), "padding": r(1000.0, [2.0, 1.01], None),
               "packing": r(1500.0, [2.0, 1.0], None)}
    spread = gpu_check.loss_spread(results)
    assert spread == pytest.approx(0.01 / 1.01)
    table = gpu_check.markdown(results, spread)
    assert "| dynapipe (none) | 3,000 | 3.00x | 2.00x | 100 | 900 / 1000 (0.90) |" in table
    assert "| padding | 1,000 | 1.00x | 0.67x | 100 | 900 / - |" in table
    assert gpu_check.device_config("NVIDIA H200") == "h200"
    assert gpu_check.device_config("NVIDIA A100-SXM4-40GB") == "a100-40gb"
