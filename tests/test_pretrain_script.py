"""``torchrun scripts/pretrain_gpt.py``: Megatron-format logs, run configs, clear errors."""
import os
import re
import subprocess
import sys

from megatron_integration.launch import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "pretrain_gpt.py")


def torchrun(nproc: int, *args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-port", str(free_port()), SCRIPT, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_tiny_cpu_run_logs_in_megatron_format(tmp_path):
    # Megatron's manual garbage collection too: the collector off, a collection after every iteration.
    result = torchrun(2, "--run-config", "configs/runs/gpt-tiny-cpu-pp2.yaml", "--train-iters", "2",
                      "--seq-length", "128", "--global-batch-size", "8", "--save", str(tmp_path / "ckpt"),
                      "--manual-gc", "--manual-gc-interval", "1")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [l for l in result.stdout.splitlines() if "iteration" in l and "lm loss" in l]
    assert len(lines) == 2  # --log-interval 1, printed once (by the last stage)
    pattern = (r"iteration\s+2/\s+2 \| consumed samples:\s+16 \| elapsed time per iteration \(ms\): [\d.]+ \| "
               r".*lm loss: \d\.\d{6}E[+-]\d\d \|.*real tokens/s: [\d.]+ \| padding efficiency: [\d.]+ \| "
               r"plan wait \(ms\): [\d.]+ \|")
    assert re.search(pattern, lines[1]), lines[1]
    assert os.path.exists(tmp_path / "ckpt" / "latest_checkpointed_iteration.txt")


def test_bad_arguments_fail_with_one_line():
    result = subprocess.run([sys.executable, SCRIPT, "--num-layers", "2", "--hidden-size", "64",
                             "--num-attention-heads", "4", "--seq-length", "64", "--global-batch-size", "4",
                             "--micro-batch-size", "2", "--train-iters", "1", "--lr", "1e-3", "--mock-data",
                             "--fp16", "--bf16"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 2
    assert "error: --fp16 and --bf16 were both given" in result.stderr
    assert "Traceback" not in result.stderr


def test_run_config_world_size_is_checked():
    result = subprocess.run([sys.executable, SCRIPT, "--run-config", "configs/runs/gpt-tiny-cpu-pp2.yaml"],
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 2
    assert "torchrun --nnodes 1 --nproc-per-node 2" in result.stderr
