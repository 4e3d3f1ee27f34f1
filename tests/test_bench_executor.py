"""scripts/bench_executor.py: one small run of its main function produces the three timings
(executor, plain 1F1B loop, megatron-core 1F1B) and the ratios, with equal losses and gradients."""
import json
import os
import statistics
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

import bench_executor  # noqa: E402

SMALL = ["--micro-batches", "4", "--mbs", "1", "--seqlen", "32", "--rounds", "3", "--warmup", "1", "--json"]


@pytest.fixture(scope="module")
def result():
    import io
    from contextlib import redirect_stdout

    pytest.importorskip("megatron.core")
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert bench_executor.main(SMALL) == 0
    return json.loads(buf.getvalue().strip().splitlines()[-1])


def _median_ratio(a, b):
    return statistics.median(x / y for x, y in zip(a, b))


def test_three_runners_timed(result):
    assert result["runners"] == ["executor", "plain", "megatron"]
    assert result["megatron"]["schedule"] == "forward_backward_pipelining_without_interleaving"
    for name in result["runners"]:
        assert len(result["round_ms"][name]) == 3
        assert all(t > 0 for t in result["round_ms"][name])
    for key in ("executor_ms", "plain_1f1b_ms", "megatron_1f1b_ms"):
        assert result[key] > 0, key
    # Each reported median is the median of that runner's rounds.
    assert result["megatron_1f1b_ms"] == pytest.approx(statistics.median(result["round_ms"]["megatron"]), abs=0.01)


def test_ratios_are_medians_of_per_round_ratios(result):
    r = result["round_ms"]
    assert result["ratio"] == pytest.approx(_median_ratio(r["executor"], r["plain"]), rel=1e-3)
    assert result["ratio_vs_megatron"] == pytest.approx(_median_ratio(r["executor"], r["megatron"]), rel=1e-3)
    assert result["ratio_of_medians_vs_megatron"] == pytest.approx(
        statistics.median(r["executor"]) / statistics.median(r["megatron"]), rel=1e-3)


def test_same_compute_in_every_runner(result):
    # The worker raises unless the losses agree every round; the gradients are compared too.
    assert result["grad_max_rel_diff"] <= bench_executor.GRAD_RTOL


def test_report_shows_every_runner_and_ratio(result):
    text = bench_executor.format_report(result)
    for label in bench_executor.LABELS.values():
        assert label in text
    assert f"{result['ratio']:.4f}" in text and f"{result['ratio_vs_megatron']:.4f}" in text


def test_summarise_without_megatron():
    out = bench_executor.summarise({"executor": [2.0, 4.0, 6.0], "plain": [1.0, 2.0, 2.0]})
    assert out["executor_ms"] == 4.0 and out["plain_1f1b_ms"] == 2.0
    assert out["ratio"] == 2.0  # median of 2, 2, 3
    assert out["ratio_best"] == 2.0 and out["ratio_of_medians"] == 2.0
    assert out["megatron_1f1b_ms"] is None and out["ratio_vs_megatron"] is None


def test_rejects_a_one_stage_pipeline():
    with pytest.raises(SystemExit):
        bench_executor.parse_args(["--stages", "1"])
