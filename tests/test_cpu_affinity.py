"""--dynapipe-cpu-affinity: each local rank pinned to its own slice of the host's cores."""
import json
import os
import subprocess
import sys

import pytest

from dynapipe.errors import DynaPipeError
from megatron_integration.cpu_affinity import bench_default, core_slice

GPT = ["--num-layers", "1", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
       "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "1", "--lr", "1e-3",
       "--mock-data", "--vocab-size", "128"]


def _probe(code: str, **env: str):
    """Run ``code`` in a fresh process (pinning is process-wide) and parse its last line."""
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, **env), capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_core_slices_are_equal_and_disjoint():
    assert [core_slice([0, 1, 2, 3], r, 2) for r in (0, 1)] == [[0, 1], [2, 3]]
    assert [core_slice([4, 6, 7], r, 2) for r in (0, 1)] == [[4], [6]]
    with pytest.raises(DynaPipeError, match=r"a core for each of the 3 ranks.*may use 2.*--dynapipe-cpu-affinity none"):
        core_slice([0, 1], 0, 3)
    with pytest.raises(DynaPipeError, match="local rank 2 is outside the 2 ranks"):
        core_slice([0, 1], 2, 2)


def test_flag_reaches_the_parallel_config():
    from megatron_integration.arguments import parse_training_args

    assert parse_training_args(GPT, 1, cuda=False).parallel.cpu_affinity == "none"
    assert parse_training_args(GPT + ["--dynapipe-cpu-affinity", "cores"], 1, cuda=False).parallel.cpu_affinity == "cores"
    with pytest.raises(SystemExit):
        parse_training_args(GPT + ["--dynapipe-cpu-affinity", "numa"], 1, cuda=False)


def test_pretouch_flag_reaches_the_parallel_config_and_is_refused_where_it_cannot_apply(monkeypatch):
    from megatron_integration.arguments import parse_training_args

    assert parse_training_args(GPT, 1, cuda=False).parallel.cpu_pretouch_mb == 0
    assert parse_training_args(GPT + ["--dynapipe-cpu-pretouch-mb", "256"], 1, cuda=False).parallel.cpu_pretouch_mb == 256
    with pytest.raises(DynaPipeError, match="--dynapipe-cpu-pretouch-mb -8: must be non-negative"):
        parse_training_args(GPT + ["--dynapipe-cpu-pretouch-mb", "-8"], 1, cuda=False)
    monkeypatch.setattr("sys.platform", "darwin")
    with pytest.raises(DynaPipeError, match="--dynapipe-cpu-pretouch-mb 256 writes glibc's malloc heap.*darwin"):
        parse_training_args(GPT + ["--dynapipe-cpu-pretouch-mb", "256"], 1, cuda=False)
    monkeypatch.undo()
    gpu = GPT + ["--transformer-impl", "local", "--dynapipe-cpu-pretouch-mb", "256"]
    with pytest.raises(DynaPipeError, match="--dynapipe-cpu-pretouch-mb 256 writes a CPU rank's malloc heap.*drop it"):
        parse_training_args(gpu, 1, cuda=True)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")
def test_pin_takes_the_ranks_slice_once():
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs two cores")
    probe = ("import json, os\n"
             "from megatron_integration.cpu_affinity import pin_local_rank\n"
             "first = pin_local_rank()\n"
             "again = pin_local_rank()\n"
             "print(json.dumps([first, again, sorted(os.sched_getaffinity(0))]))\n")
    first, again, now = _probe(probe, LOCAL_RANK="1", LOCAL_WORLD_SIZE="2")
    per = len(cores) // 2
    assert first == again == now == cores[per:2 * per]


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux only")
def test_bench_pins_only_where_every_rank_gets_a_core():
    assert bench_default(1) == "cores"
    assert bench_default(len(os.sched_getaffinity(0)) + 1) == "none"


def test_contention_probe_measures_both_phases():
    from megatron_integration.bench_contention import measure_contention

    c = measure_contention(ranks=2, tokens=64, hidden=64, passes=1, timeout_s=120)
    assert (c.ranks, c.tokens, c.hidden) == (2, 64, 64) and c.alone_ms > 0 and c.together_ms > 0
    assert c.to_json()["factor"] == pytest.approx(c.together_ms / c.alone_ms, abs=1e-3)
    with pytest.raises(ValueError, match="at least 2 ranks"):
        measure_contention(ranks=1)


def test_contention_probe_times_each_phase_in_its_own_conditions(monkeypatch):
    """The ranks' body on threads, with a pass that takes 50 ms, or 250 ms where another rank
    computes during it: the alone phase must time only passes no other rank overlaps, the
    together phase passes the ranks run at once, each reported as its own median."""
    import queue
    import threading
    import time

    import torch

    from megatron_integration import bench_contention

    lock, active, crowded = threading.Lock(), set(), {"0": [], "1": []}

    def layer_pass(*_):
        rank = threading.current_thread().name
        with lock:
            active.add(rank)
            others = len(active) > 1
        time.sleep(0.05)
        with lock:
            others = others or len(active) > 1
        if others:
            time.sleep(0.2)
        with lock:
            active.discard(rank)
        crowded[rank].append(others)

    monkeypatch.setattr(bench_contention, "_layer_pass", layer_pass)
    # The body sets these process-wide: not this test process's.
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    monkeypatch.setattr(torch, "manual_seed", lambda seed: None)
    results, barrier = queue.Queue(), threading.Barrier(2, timeout=60)
    threads = [threading.Thread(target=bench_contention._worker, args=(r, 8, 8, 2, barrier, results), name=str(r))
               for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    # Per rank: the untimed warm-up, then per round 2 passes alone and 2 together. The barrier
    # keeps the alone passes apart; the together passes start at once and overlap by 50 ms
    # unless a thread starts that much late (the medians below allow one such pass in two).
    for rank, passes in crowded.items():
        assert len(passes) == 9, (rank, passes)
        assert not any(passes[1:3] + passes[5:7]), (rank, passes)
    medians = sorted(results.get(timeout=1) for _ in threads)
    for rank, alone_ms, together_ms in medians:
        assert 50 <= alone_ms < 140 < together_ms, medians


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")
def test_profiler_runs_on_as_many_cores_as_threads():
    cores = sorted(os.sched_getaffinity(0))
    probe = ("import json, os\n"
             "from megatron_integration.cpu_affinity import use_profiler_threads\n"
             f"too_many = use_profiler_threads({len(cores) + 1}, cuda=False)\n"
             "on_gpu = use_profiler_threads(1, cuda=True)\n"
             "one = use_profiler_threads(1, cuda=False)\n"
             "print(json.dumps([too_many, on_gpu, one, sorted(os.sched_getaffinity(0))]))\n")
    too_many, on_gpu, one, now = _probe(probe, LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    assert too_many is None and on_gpu is None and one == now == cores[:1]
