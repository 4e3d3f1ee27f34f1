"""The CPU compatibility layer: idempotent, targeted, and what makes megatron run on CPU."""
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the layer is only applied without CUDA")


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)


def test_apply_is_idempotent_and_targeted():
    result = run_python("""
        import torch
        from megatron_integration import cpu_compat
        assert cpu_compat.apply() is True
        from megatron.core import utils, transformer
        from megatron.core.pipeline_parallel import p2p_communication, schedules
        view = schedules.torch
        assert view is not torch and view.cuda.current_device() == torch.device("cpu")
        assert cpu_compat.apply() is True and schedules.torch is view          # idempotent
        t = view.zeros(3, device="cuda")
        assert t.device.type == "cpu" and view.Tensor is torch.Tensor            # real types
        assert view.tensor([1], device=0, pin_memory=True).device.type == "cpu"
        assert torch.cuda.is_available() is False and not hasattr(torch, "_dynapipe_cpu_view")  # global torch untouched
        from megatron.core.transformer.utils import get_default_causal_mask
        m = get_default_causal_mask(4)
        assert m.device.type == "cpu" and m.tolist()[0] == [False, True, True, True]
        # The model-parallel RNG tracker forks and restores the CPU generator.
        from megatron.core import tensor_parallel
        tracker = tensor_parallel.get_cuda_rng_tracker()
        tracker.add("stream", 5)
        torch.manual_seed(0); before = torch.get_rng_state().clone()
        with tracker.fork("stream"):
            a = torch.rand(3)
        assert torch.equal(torch.get_rng_state(), before)
        with tracker.fork("stream"):
            b = torch.rand(3)
        assert not torch.equal(a, b)   # the forked stream advanced
        print("OK")
    """)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "OK" in result.stdout


def test_without_the_layer_megatron_fails_on_cpu():
    # The layer is not decoration: megatron-core's default causal mask needs CUDA.
    result = run_python("""
        from megatron.core.transformer.utils import get_default_causal_mask
        get_default_causal_mask(4)
    """)
    assert result.returncode != 0
    # It fails in torch's CUDA initialisation, not on the way there (an import error, a changed
    # signature). The message differs between a CPU-only build ("Torch not compiled with CUDA
    # enabled") and a CUDA build on a machine without a GPU or driver.
    frames = re.findall(r'File "([^"]+)"', result.stderr)
    assert frames and "torch/cuda/" in frames[-1].replace(os.sep, "/"), result.stderr[-3000:]
    assert re.search(r"CUDA|NVIDIA", result.stderr.strip().splitlines()[-1]), result.stderr[-3000:]


def test_apply_does_nothing_when_cuda_is_available(monkeypatch):
    result = run_python("""
        import torch
        torch.cuda.is_available = lambda: True
        from megatron_integration import cpu_compat
        assert cpu_compat.apply() is False and not cpu_compat.is_applied()
        from megatron.core.pipeline_parallel import schedules
        assert schedules.torch is torch
        print("OK")
    """)
    assert result.returncode == 0, result.stderr[-3000:]


def test_missing_modules_and_attributes_are_skipped(caplog):
    from megatron_integration import cpu_compat

    assert cpu_compat._patch_module("megatron.core.no_such_module_in_any_version") is False
    assert cpu_compat._replace_function("megatron.core.utils", "no_such_function", lambda: None) is False
    assert cpu_compat._wrap_tensor_cuda_method("megatron.core.utils", "NoSuchClass", "method") is False
