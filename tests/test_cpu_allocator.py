"""The CPU allocator setting: freed blocks stay in the process, so a repeated pass stops
page-faulting its buffers in anew (measured in a fresh process: the setting is process-wide)."""
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


def test_off_glibc_nothing_changes(monkeypatch):
    monkeypatch.setattr(cpu_allocator, "_applied", None)
    monkeypatch.setattr(cpu_allocator.sys, "platform", "darwin")
    setting = cpu_allocator.keep_freed_memory()
    assert not setting.applied and "darwin" in setting.reason
    assert cpu_allocator.current_setting() is setting
