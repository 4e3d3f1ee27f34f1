"""The CPU allocator setting: freed blocks stay in the process, and the heap is never trimmed,
so a repeated pass stops page-faulting its buffers in anew, whatever its working set (measured
in fresh processes: the setting is process-wide)."""
import json
import subprocess
import sys
import textwrap

import pytest

from megatron_integration import cpu_allocator

PROBE = textwrap.dedent("""
    import json, resource
    import numpy as np
    from megatron_integration.cpu_allocator import keep_freed_memory

    def faults_per_pass(passes=6, mib=48):
        # Allocate, write and free a buffer above glibc's largest dynamic mmap threshold.
        np.ones(mib * 1024 * 1024 // 8).sum()
        start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(passes):
            np.ones(mib * 1024 * 1024 // 8).sum()
        return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start) / passes

    before = faults_per_pass()
    setting = keep_freed_memory()
    after = faults_per_pass()
    print(json.dumps({"before": before, "after": after, "applied": setting.applied,
                      "mmap": setting.mmap_threshold_bytes, "again": keep_freed_memory() is setting}))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc only")
def test_keep_freed_memory_stops_page_faults_per_pass():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["applied"] and r["again"]
    if r["mmap"] < 48 * 1024 * 1024:
        pytest.skip(f"this glibc caps the mmap threshold at {r['mmap']} bytes")
    # glibc's default maps the 48 MiB anew and faults it in every pass (12,288 pages of 4 KiB,
    # or 24 of 2 MiB where the kernel backs it with transparent huge pages).
    assert r["before"] >= 20, r
    assert r["after"] < 0.05 * r["before"], r


TRIM_PROBE = textwrap.dedent("""
    import json, resource, sys
    import numpy as np
    from megatron_integration.cpu_allocator import TRIM_NEVER, keep_freed_memory

    trim = TRIM_NEVER if sys.argv[1] == "never" else int(sys.argv[1])
    setting = keep_freed_memory(trim_threshold_bytes=trim)

    def faults_per_pass(passes=5, mib=40, blocks=3):
        # A working set of several heap blocks, all freed at the end of the pass: the heap top
        # then holds all of them, as a stage's after its backward.
        def one_pass():
            held = [np.ones(mib * 1024 * 1024 // 8) for _ in range(blocks)]
            return sum(float(h[-1]) for h in held)
        one_pass()
        start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(passes):
            one_pass()
        return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start) / passes

    print(json.dumps({"faults": faults_per_pass(), "applied": setting.applied, "mmap": setting.mmap_threshold_bytes,
                      "trim": setting.trim_threshold_bytes}))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc only")
def test_a_working_set_above_a_trim_threshold_stays_in_the_process():
    """A finite trim threshold (64 MiB standing in for any) hands a freed 120 MiB working set
    back to the kernel and faults it in again every pass; the default never trims."""
    runs = {}
    for trim in ("never", str(64 * 1024 * 1024)):
        out = subprocess.run([sys.executable, "-c", TRIM_PROBE, trim], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        runs[trim] = json.loads(out.stdout.strip().splitlines()[-1])
    kept, trimmed = runs["never"], runs[str(64 * 1024 * 1024)]
    assert kept["applied"] and kept["trim"] == cpu_allocator.TRIM_NEVER
    if kept["mmap"] < 40 * 1024 * 1024:
        pytest.skip(f"this glibc caps the mmap threshold at {kept['mmap']} bytes")
    # 120 MiB are 30,720 pages of 4 KiB (60 of 2 MiB under transparent huge pages).
    assert trimmed["faults"] >= 40, runs
    assert kept["faults"] < 0.05 * trimmed["faults"], runs


def test_off_glibc_nothing_changes(monkeypatch):
    monkeypatch.setattr(cpu_allocator, "_applied", None)
    monkeypatch.setattr(cpu_allocator.sys, "platform", "darwin")
    setting = cpu_allocator.keep_freed_memory()
    assert not setting.applied and "darwin" in setting.reason
    assert cpu_allocator.current_setting() is setting


PRETOUCH_PROBE = textwrap.dedent("""
    import json, resource, sys
    import torch
    from megatron_integration.cpu_allocator import keep_freed_memory, pretouch_heap
    from megatron_integration.cpu_time import IterationCpu

    keep_freed_memory()
    took = pretouch_heap(int(sys.argv[1]))
    cpu = IterationCpu()
    # A first pass to a working set of 96 MiB in tensors (torch's own aligned allocations),
    # as a stage's first forward at a new longest row.
    held = [torch.ones(24 * 1024 * 1024 // 4) for _ in range(4)]
    cpu.record()
    del held
    cpu.record()
    print(json.dumps({"took_s": took, "faults": cpu.minor_faults, "system_ms": cpu.system_ms}))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc only")
def test_a_pretouched_heap_serves_a_first_pass_without_page_faults():
    """Without pre-touching, a first 96 MiB working set faults every page in (24,576 of 4 KiB);
    after ``pretouch_heap(128)`` it comes from pages already written. ``IterationCpu`` counts
    the faults of each iteration it records."""
    runs = {}
    for mib in ("0", "128"):
        out = subprocess.run([sys.executable, "-c", PRETOUCH_PROBE, mib], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        runs[mib] = json.loads(out.stdout.strip().splitlines()[-1])
    cold, warm = runs["0"], runs["128"]
    assert cold["took_s"] == 0.0 and warm["took_s"] > 0.0
    # 96 MiB is 48 pages even if the kernel backs them with 2 MiB pages.
    assert cold["faults"][0] >= 48, runs
    assert warm["faults"][0] < 0.05 * cold["faults"][0], runs
    # Freeing faults nothing in; both iterations' system time is recorded.
    assert cold["faults"][1] < 0.05 * cold["faults"][0] and len(cold["system_ms"]) == 2, runs


def test_pretouch_refuses_what_would_not_keep_the_pages(monkeypatch):
    with pytest.raises(ValueError, match="-1 MiB"):
        cpu_allocator.pretouch_heap(-1)
    # A run asking for none after one that pre-touched (a job's ranks train runs in turn)
    # reports none, not the run before's seconds.
    monkeypatch.setattr(cpu_allocator, "_pretouched_s", 1.5)
    assert cpu_allocator.pretouch_heap(0) == 0.0 and cpu_allocator.pretouched_seconds() == 0.0
    never = cpu_allocator.TRIM_NEVER
    for setting, needle in ((None, "keep_freed_memory\\(\\) has not run"),
                            (cpu_allocator.AllocatorSetting(False, reason="not glibc (darwin)"), "not glibc"),
                            (cpu_allocator.AllocatorSetting(True, 1 << 30, 64 << 20), "never trimmed"),
                            (cpu_allocator.AllocatorSetting(True, 8 << 20, never), "mmap threshold above")):
        monkeypatch.setattr(cpu_allocator, "_applied", setting)
        with pytest.raises(ValueError, match=needle):
            cpu_allocator.pretouch_heap(16)
