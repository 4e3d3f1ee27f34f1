"""``scripts/bench_cluster.py --quick``: the simulated cluster-scale comparison, JSON and Markdown."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from dynapipe.schedule.types import CHUNKED_SCHEDULE_NAMES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "bench_cluster.py")


def test_quick_writes_every_method_with_tuned_baselines(tmp_path):
    out = tmp_path / "cluster.json"
    r = subprocess.run([sys.executable, SCRIPT, "--quick", "--output", str(out)], capture_output=True, text=True,
                       timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["setup"]["tokens_per_batch"] == 65536 and report["setup"]["device"] == "a100-40gb"
    (case,) = report["cases"]
    assert (case["model"], case["stages"], case["dp"], case["seq_length"]) == ("gpt-7b", 4, 2, 2048)
    assert sum(case["real_tokens_per_batch"]) <= 65536
    methods = case["methods"]
    assert list(methods) == ["dynapipe", "dynapipe-1f1b", "dynapipe-per-sample", "packing", "packing-per-sample",
                             "packing-search", "padding", "padding-mb"]
    # DynaPipe's rows on the per-sample kernel compute less attention, and never below the floor.
    alone = methods["dynapipe-per-sample"]
    assert alone["attention_share"] <= methods["dynapipe"]["attention_share"]
    assert alone["compute_over_floor"] >= 1.0
    assert methods["packing"]["vs_packing"] == 1.0 and methods["packing-search"]["vs_packing_search"] == 1.0
    assert methods["packing-per-sample"]["vs_packing_per_sample"] == 1.0
    # Per-sample attention computes less than masked rows, and the search only adds freedom.
    per_sample = methods["packing-per-sample"]
    assert per_sample["real_tokens_per_s"] > methods["packing"]["real_tokens_per_s"]
    assert per_sample["attention_share"] < methods["packing"]["attention_share"]
    assert methods["packing-search"]["real_tokens_per_s"] >= per_sample["real_tokens_per_s"] * (1 - 1e-9)
    assert methods["packing-search"]["attention_share"] == pytest.approx(per_sample["attention_share"])
    for name, m in methods.items():
        assert m["real_tokens_per_s"] > 0 and m["planning_ms"] > 0 and 0 <= m["bubble_fraction"] < 1
        assert len(m["stage_peak_mib"]) == 4 and max(m["stage_peak_mib"]) <= 40536 - 2048
        ratio = m["real_tokens_per_s"] / methods["packing"]["real_tokens_per_s"]
        assert m["vs_packing"] == pytest.approx(ratio, abs=2e-3)
        if name.startswith("dynapipe"):
            assert m["micro_batch_size"] is None and "sweep" not in m
        else:
            # The kept size is the sweep's best among the sizes that fit.
            fits = [s for s in m["sweep"] if s["fits"]]
            assert fits and m["micro_batch_size"] == max(fits, key=lambda s: s["real_tokens_per_s"])["micro_batch_size"]
    assert methods["dynapipe"]["real_tokens_per_s"] >= methods["dynapipe-1f1b"]["real_tokens_per_s"]
    # Nothing computes below the compute floor; padding to --seq-length wastes the most.
    floors = {k: m["compute_over_floor"] for k, m in methods.items() if "compute_over_floor" in m}
    assert set(floors) == {"dynapipe", "dynapipe-per-sample", "packing", "packing-per-sample", "padding", "padding-mb"}
    assert min(floors.values()) >= 1.0 and floors["packing-per-sample"] < floors["packing"]
    assert floors["padding"] == max(floors.values()) > 2.0
    assert methods["dynapipe-1f1b"]["schedule"] == ["1f1b"] and methods["packing"]["schedule"] == ["1f1b"]
    md = (tmp_path / "cluster.md").read_text().splitlines()
    assert md[0].startswith("| case | method") and len(md) == 2 + len(methods)
    assert "| dynapipe |" in md[2] and "x |" in md[2]


@pytest.mark.parametrize("extra, message", [
    (["--methods", "dynapipe,zero-bubble"], "zero-bubble"),
    (["--methods", "dynapipe,dynapipe"], "choose each at most once"),
    # Every batch is planned by every method of every case: a size past the largest published runs
    # grew for minutes before anything was printed.
    (["--tokens", "1000000000"], "--tokens 1000000000: give 1 to 16,777,216 tokens"),
    (["--batches", "33"], "--batches 33: give 1 to 32"),
    (["--markdown", ""], "--markdown '': an empty path"),
])
def test_bad_requests_are_refused_in_one_line(tmp_path, extra, message):
    r = subprocess.run([sys.executable, SCRIPT, "--quick", "--output", str(tmp_path / "x.json"), *extra],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 2 and message in r.stderr and r.stderr.count("\n") == 1, r.stderr


def test_encoder_decoder_case_runs_on_its_planned_placement(tmp_path):
    # The T5 rows (PP8 x DP2, and TP2 x PP4 x DP2 on the same GPUs) choose a stage placement
    # first; every method then runs on it and DynaPipe on Megatron's even split is kept as the "before".
    out = tmp_path / "t5.json"
    r = subprocess.run([sys.executable, SCRIPT, "--quick", "--case", "t5-11b", "--methods", "dynapipe,packing",
                        "--tokens", "16384", "--output", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    cases = json.loads(out.read_text())["cases"]
    assert [(c["model"], c["stages"], c["tp"]) for c in cases] == [("t5-11b", 8, 1), ("t5-11b", 4, 2)]
    for case in cases:
        assert set(case["methods"]) == {"dynapipe", "packing", "dynapipe-even-split"}
        chosen, before = case["placement"]["placement"], case["placement"]["before"]
        assert sum(chosen["encoder_layers"]) == sum(before["encoder_layers"]) == 24
        assert sum(chosen["decoder_layers"]) == sum(before["decoder_layers"]) == 24
        assert max(case["placement"]["chosen"]["stage_ms"]) < max(before["stage_ms"])  # the bottleneck got lighter
        # Contiguous, planned interleaved and (where another) even interleaved splits were all
        # simulated on the choice batches; the fastest was kept.
        cmp = case["placement"]["compared"]
        assert np.isfinite(cmp["contiguous_ms"]) and np.isfinite(cmp["interleaved_ms"])
        times = {k[:-len("_ms")]: v for k, v in cmp.items() if k.endswith("_ms")}
        fastest = min(times, key=times.get)
        assert (chosen.get("chunks", 1) == 2) == fastest.startswith("interleaved")
        if chosen.get("chunks"):
            assert case["methods"]["dynapipe"]["schedule"][0] in CHUNKED_SCHEDULE_NAMES
        # Each row says the split it ran: DynaPipe's choice, Megatron's even split for the before,
        # and for packing the faster of DynaPipe's and the one chosen for its own micro-batches.
        ran = {name: row["placement"] for name, row in case["methods"].items()}
        assert ran["dynapipe"] == cmp[fastest]
        half = case["stages"] // 2
        # Packing ran on DynaPipe's split and on its own, and kept the faster.
        tried = case["methods"]["packing"]["splits_tried"]
        assert ran["dynapipe"] in tried and 1 <= len(tried) <= 2
        best = max((v, k) for k, v in tried.items() if isinstance(v, float))
        assert ran["packing"] == best[1]
        assert case["methods"]["packing"]["real_tokens_per_s"] == pytest.approx(best[0], abs=0.1)
        assert ran["dynapipe-even-split"] == ",".join([f"{24 // half}+0"] * half + [f"0+{24 // half}"] * half)
        for split in ran.values():
            layers = [tuple(map(int, stage.split("+"))) for chunk in split.split("|") for stage in chunk.split(",")]
            assert sum(e for e, _ in layers) == sum(d for _, d in layers) == 24, split
    bad = subprocess.run([sys.executable, SCRIPT, "--case", "no-such-case", "--output", str(tmp_path / "x.json")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "matches no case" in bad.stderr and "t5-11b" in bad.stderr


def test_gpt_chunk_case_runs_every_method_interleaved(tmp_path):
    # The interleaved GPT rows run every method on Megatron's chunked split; DynaPipe on one chunk
    # a rank is kept as the "before".
    out = tmp_path / "chunks.json"
    r = subprocess.run([sys.executable, SCRIPT, "--quick", "--case", "gpt-7b PP8 x DP2, seq 4096, 4 chunks",
                        "--methods", "dynapipe,packing", "--tokens", "16384", "--output", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    (case,) = json.loads(out.read_text())["cases"]
    assert case["chunks"] == 4 and set(case["methods"]) == {"dynapipe", "packing", "dynapipe-one-chunk"}
    assert case["methods"]["packing"]["schedule"] == ["interleaved"]
    assert set(case["methods"]["dynapipe"]["schedule"]) <= set(CHUNKED_SCHEDULE_NAMES)
    assert not set(case["methods"]["dynapipe-one-chunk"]["schedule"]) & set(CHUNKED_SCHEDULE_NAMES)


def test_fused_attention_prices_no_score_matrix(tmp_path):
    # Transformer Engine's flash/fused attention keeps no scores: the same packed micro-batches
    # need less memory, so a larger micro-batch size fits 40 GB.
    runs = {}
    for flag in ((), ("--fused-attention",)):
        out = tmp_path / f"q{len(flag)}.json"
        r = subprocess.run([sys.executable, SCRIPT, "--quick", "--methods", "packing", "--output", str(out), *flag],
                           capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert r.returncode == 0, r.stderr[-3000:]
        report = json.loads(out.read_text())
        runs[report["setup"]["attention"]] = report["cases"][0]["methods"]["packing"]
    unfused, fused = runs["unfused, dropout 0.1"], runs["fused"]
    assert (unfused["micro_batch_size"], unfused["recompute"]) == (fused["micro_batch_size"], fused["recompute"])
    assert all(f < u for f, u in zip(fused["stage_peak_mib"], unfused["stage_peak_mib"]))
    largest = {k: max(s["micro_batch_size"] for s in m["sweep"] if s["fits"]) for k, m in runs.items()}
    assert largest["fused"] > largest["unfused, dropout 0.1"]


def test_stages_that_cannot_split_their_backward_get_no_zero_bubble_schedule(tmp_path):
    out = tmp_path / "te.json"
    r = subprocess.run([sys.executable, SCRIPT, "--quick", "--case", "gpt-7b PP8 x DP2, seq 2048", "--methods",
                        "dynapipe,packing-search", "--fused-attention", "--no-split-backward", "--output", str(out)],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["setup"]["split_backward"] is False and report["setup"]["attention"] == "fused"
    (case,) = report["cases"]
    for name, m in case["methods"].items():
        assert m["schedule"] and not set(m["schedule"]) & {"zb-h1", "interleaved-zb"}, (name, m["schedule"])


def test_quick_keeps_a_batch_count_given(tmp_path):
    out = tmp_path / "cluster.json"
    r = subprocess.run([sys.executable, SCRIPT, "--quick", "--batches", "2", "--methods", "packing", "--output",
                        str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    (case,) = json.loads(out.read_text())["cases"]
    assert len(case["real_tokens_per_batch"]) == 2 and case["methods"]["packing"]["batches"] == 2
