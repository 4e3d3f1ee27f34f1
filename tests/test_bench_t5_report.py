"""What ``bench --model t5`` reports beyond each run's figures: the ratios round by round, and
the spread of identical ops (the machine's noise), and how they are printed."""
import io

import pytest

from megatron_integration.bench_report import round_ratios, rounds_line
from megatron_integration.bench_t5_report import print_t5_report, same_shape_spread


def _runs(**rounds):
    return {label: {"rounds_real_tokens_per_s": list(v)} for label, v in rounds.items()}


def test_round_ratios_pair_the_reported_runs_round_by_round():
    results = {"dynapipe": {"run": "dynapipe-even"}, "padding": {"run": "padding@mbs2"},
               "packing": {"run": "packing@mbs1"}}
    runs = _runs(**{"dynapipe-even": (200.0, 150.0, 180.0), "padding@mbs2": (50.0, 50.0, 60.0),
                    "packing@mbs1": (100.0, 60.0, 90.0), "dynapipe": (190.0, 120.0, 170.0)})
    out = round_ratios(results, runs, ["padding", "packing"], "packing",
                       {"even_vs_placed": ("dynapipe-even", "dynapipe")})
    assert out["dynapipe_vs_packing"] == [2.0, 2.5, 2.0]
    assert out["dynapipe_vs_padding"] == [4.0, 3.0, 3.0]
    assert out["padding_vs_packing"] == [0.5, pytest.approx(0.833), pytest.approx(0.667)]
    assert out["packing_vs_padding"] == [2.0, 1.2, 1.5]
    # The best baseline's and the named pairs' ratios the same way.
    assert out["dynapipe_vs_best_baseline"] == out["dynapipe_vs_packing"]
    assert out["even_vs_placed"] == [pytest.approx(1.053), 1.25, pytest.approx(1.059)]
    assert "padding_vs_padding" not in out
    # The best baseline is the one named, wherever it is listed.
    best_first = round_ratios(results, runs, ["padding", "packing"], "padding")
    assert best_first["dynapipe_vs_best_baseline"] == [4.0, 3.0, 3.0]


def test_round_ratios_are_empty_with_one_round():
    results = {"dynapipe": {"run": "dynapipe"}, "packing": {"run": "packing@mbs1"}}
    assert round_ratios(results, _runs(dynapipe=(2.0,), **{"packing@mbs1": (1.0,)}), ["packing"], "packing") == {}


def test_the_report_says_how_far_one_round_can_be_trusted():
    # The quick demo runs one round: its line says so and how to get each round's ratios.
    one = rounds_line({}, 3)
    assert one.startswith("one round of 3 timed iteration(s) a method") and "--rounds 3" in one
    several = rounds_line({"dynapipe_vs_packing": [1.25, 1.5]}, 3)
    assert several == "ratios round by round (each round's runs side by side): dynapipe_vs_packing 1.25x, 1.50x"


def _op(dur_us, kind="backward", stage=0, mbs=1, seqlen=1024, dec=256, chunk=None, replica=0, masked=None):
    args = {"mbs": mbs, "seqlen": seqlen, "dec_seqlen": dec, "iteration": 1}
    if chunk is not None:
        args["chunk"] = chunk
    if masked is not None:
        args["masked"] = masked
    return {"ph": "X", "cat": kind, "pid": replica, "tid": stage, "dur": dur_us, "args": args}


def test_same_shape_spread_divides_each_op_by_its_groups_median():
    # Two groups of identical ops: times 1, 2, 2, 4 (median 2) and 10, 10, 10 (median 10).
    events = [_op(t) for t in (1.0, 2.0, 2.0, 4.0)] + [_op(t, kind="forward") for t in (10.0, 10.0, 10.0)]
    # Too few of a shape, another stage, or another chunk: each its own group, all left out.
    events += [_op(5.0, seqlen=512), _op(50.0, stage=1), _op(50.0, stage=1), _op(3.0, chunk=1)]
    events += [{"ph": "X", "cat": "comm", "pid": 0, "tid": 0, "dur": 99.0, "args": {}}]
    out = same_shape_spread(events)
    assert out["groups"] == 2 and out["ops"] == 7
    # Quotients 0.5, 1, 1, 2, 1, 1, 1: the 10th and 90th percentiles (linear).
    assert out["p10"] == pytest.approx(0.8) and out["p90"] == pytest.approx(1.4)
    assert out["p90_over_p10"] == pytest.approx(1.75)


def test_ops_with_and_without_a_mask_are_not_identical():
    # One shape, two kinds of work: the rows that needed a mask took twice as long.
    events = [_op(t, masked=True) for t in (100.0, 98.0, 102.0)] + [_op(t, masked=False) for t in (48.0, 50.0, 49.0)]
    out = same_shape_spread(events)
    assert out["groups"] == 2 and out["p90_over_p10"] < 1.05
    # Without the note the six would be one group, and the mask would read as noise.
    blind = same_shape_spread([_op(e["dur"]) for e in events])
    assert blind["groups"] == 1 and blind["p90_over_p10"] > 1.8


def test_per_sample_ops_of_other_densities_are_not_identical():
    # Packed rows of one shape holding other samples: per-sample attention does other work.
    def op(dur, density):
        e = _op(dur)
        e["args"]["attention"] = {"input": density, "target": 1.0, "cross": density}
        return e

    events = [op(t, 0.2) for t in (50.0, 51.0, 49.0)] + [op(t, 0.9) for t in (100.0, 99.0, 101.0)]
    assert same_shape_spread(events)["groups"] == 2 and same_shape_spread(events)["p90_over_p10"] < 1.05


def test_same_shape_spread_keeps_replicas_apart_and_needs_a_repeated_shape():
    # Each replica's stage 0 has two ops of the shape: together three would make a group.
    assert same_shape_spread([_op(1.0), _op(2.0), _op(1.0, replica=1), _op(9.0, replica=1)]) is None
    assert same_shape_spread([]) is None


def _report(per_round, spread):
    method = {"run": "dynapipe-even", "real_tokens_per_cpu_s": 1.0, "real_tokens_per_s": 2.0,
              "padding_efficiency": 0.9, "iteration_ms": 10.0, "time_split_ms": {}, "same_shape_spread": None}
    packing = {**method, "run": "packing@mbs1", "real_tokens_per_s": 1.0, "same_shape_spread": spread}
    placed = {"placement": "2+0,0+2", "bubble_fraction": 0.2, "simulated_ms": 5.0}
    return {"methods": {"dynapipe": method, "packing": packing}, "ratios": {"dynapipe_vs_packing": 2.0},
            "ratios_per_round": per_round, "best_baseline": "packing",
            "setup": {"load_average": {"start": [1.0], "end": [2.0]}},
            "placement": {"placement": "2+0,0+2", "source": "even", "simulated": {"even": placed, "placed": placed}},
            "cost_model": {"profile": "p.json", "profile_s": None, "stage_check": {},
                           "compute_floor": {"predicted_ms": {}}}}


def test_split_backwards_count_whole_in_the_stage_and_calibration_checks():
    # zb-h1 plans trace each backward as an input and a weight part: the checks that price a
    # backward whole (stage compute, the calibration fit) must see both parts as one backward.
    from megatron_integration.bench_report import passes

    def op(cat, mb, dur, tid=0):
        return {"ph": "X", "cat": cat, "tid": tid, "dur": dur, "args": {"mb": mb, "mbs": 1, "seqlen": 64}}

    events = [op("forward", 0, 10.0), op("forward", 1, 11.0), op("backward-input", 0, 20.0),
              op("backward-input", 1, 21.0), op("backward-weight", 0, 5.0), op("comm", 0, 99.0),
              op("backward-weight", 1, 6.0), op("backward", 2, 30.0), op("backward-input", 0, 7.0, tid=1)]
    got = [(e["cat"], e["args"]["mb"], e["dur"]) for e in passes(events)]
    assert got == [("forward", 0, 10.0), ("forward", 1, 11.0), ("backward", 0, 25.0), ("backward", 1, 27.0),
                   ("backward", 2, 30.0)]  # the unpaired input part of another stage is not a whole backward


def test_the_report_prints_each_ratio_round_by_round_and_the_ops_spread():
    spread = {"ops": 92, "groups": 4, "p10": 0.54, "p90": 1.19, "p90_over_p10": 2.2}
    out = io.StringIO()
    print_t5_report(_report({"dynapipe_vs_packing": [1.94, 1.46]}, spread), out)
    text = out.getvalue()
    assert "dynapipe_vs_packing: 2.00x (round by round: 1.94x, 1.46x)" in text
    assert "packing 0.54-1.19 (92 ops)" in text and "dynapipe 0." not in text
    # Which schedules the runs' plans ran, where the runs reported them.
    assert "pipeline schedules run" not in text
    report = _report({}, None)
    report["methods"]["dynapipe"]["schedules"] = {"zb-h1": 2, "adaptive": 1}
    report["methods"]["packing"]["schedules"] = {"1f1b": 3}
    out = io.StringIO()
    print_t5_report(report, out)
    assert "pipeline schedules run (timed iterations): dynapipe zb-h1 x2, adaptive x1; packing 1f1b x3" in out.getvalue()
    # One round, no repeated shapes: neither line.
    out = io.StringIO()
    print_t5_report(_report({}, None), out)
    assert "dynapipe_vs_packing: 2.00x\n" in out.getvalue() and "identical ops" not in out.getvalue()
    # What the runs faulted in during the timed iterations, where they recorded it.
    report = _report({}, None)
    report["setup"]["cpu_pretouch_mb"] = 1024
    report["methods"]["dynapipe"].update(minor_faults=412.0, system_ms=85.0, pretouch_s=0.45)
    out = io.StringIO()
    print_t5_report(report, out)
    assert "pre-touched 1024 MiB of heap at start-up): dynapipe 412 faults, 85 ms, pre-touch 0.45 s\n" in out.getvalue()
