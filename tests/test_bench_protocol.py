"""The bench's protocol without training: presets, rotation, medians, sweep choice, time breakdown."""
import io
import json

import pytest

from megatron_integration.bench import PRESETS, Entry, rotated, with_defaults
from megatron_integration.bench import MethodResult, median_result, summarise
from megatron_integration.bench_results import format_memory_faults, plans_queued_in
from megatron_integration.bench_report import breakdown
from megatron_integration.bench_report import format_compute_floor
from megatron_integration.bench_sim import BenchSimulation
from profile_widths import TINY_WIDTHS


def test_rotation_puts_every_entry_first_once():
    entries = ["a", "b", "c", "d"]
    orders = [rotated(entries, k) for k in range(4)]
    assert [o[0] for o in orders] == entries
    assert all(sorted(o) == entries for o in orders)
    assert rotated(entries, 5) == rotated(entries, 1) and rotated([], 3) == []


def test_presets_fill_only_missing_arguments():
    argv = with_defaults(["--seq-length", "256"], "representative")
    assert argv[:2] == ["--seq-length", "256"] and argv.count("--seq-length") == 1
    assert argv[argv.index("--hidden-size") + 1] == "512" and "--mock-data" in argv
    tiny = with_defaults([], "tiny")
    assert tiny[tiny.index("--hidden-size") + 1] == "64"
    # A setting given in Megatron-LM's other spelling is given: the preset adds neither spelling.
    other = with_defaults(["--encoder-seq-length", "512", "--encoder-num-layers", "2"], "tiny")
    assert "--seq-length" not in other and "--num-layers" not in other
    assert PRESETS["representative"].rounds >= 2 and PRESETS["representative"].sweep_top >= 1
    assert Entry("packing", 4).argv(["--x"])[-2:] == ["--micro-batch-size", "4"]
    assert Entry("packing", 4).label == "packing@mbs4" and Entry("dynapipe").label == "dynapipe"
    # DynaPipe's micro-batches under 1F1B or the zero-bubble schedule: the planner is told so.
    for method, schedule in (("dynapipe-1f1b", "1f1b"), ("dynapipe-zb", "zb-h1")):
        argv = Entry(method).argv(["--x"])
        assert "--use-dynapipe" in argv and argv[argv.index("--dynapipe-schedule") + 1] == schedule


def _ranks(iter_ms, children=None, waits=None, cpu=None):
    n = len(iter_ms[0])
    return [{"iteration_ms": ms, "plan_wait_ms": (waits or [[1.0] * n] * len(iter_ms))[k], "real_tokens": [100] * n,
             "padded_tokens": [200] * n, "losses": [1.0] * n, "layer_spec": "local",
             "cpu_ms": (cpu or [[50.0] * n] * len(iter_ms))[k],
             "children_cpu_ms": (children or [[0.0] * n] * len(iter_ms))[k]} for k, ms in enumerate(iter_ms)]


def test_summary_takes_slowest_rank_and_counts_planner_cpu():
    # An iteration lasts as long as its slowest rank (rank 1 in the first timed iteration, rank 0
    # in the second); its plan wait is the longest any rank waited, here the other rank's each
    # time (6 and 4 ms, where the slowest ranks waited 5 and 3); the ranks' own CPU adds up.
    ranks = _ranks([[900.0, 100.0, 300.0], [50.0, 200.0, 100.0]], children=[[500.0, 4.0, 6.0], [0.0, 0.0, 0.0]],
                   waits=[[9.0, 6.0, 3.0], [0.0, 5.0, 4.0]], cpu=[[99.0, 60.0, 70.0], [0.0, 20.0, 40.0]])
    r = summarise(ranks, warmup_iters=1, prefetch=1)
    assert r.timed_iterations == 2 and r.iteration_ms == pytest.approx(250.0)
    assert r.real_tokens_per_s == pytest.approx(200 / 0.5) and r.padding_efficiency == pytest.approx(0.5)
    # The warm-up's planning (500 ms: compiling the simulator) is outside the timed window.
    assert r.planner_cpu_ms == pytest.approx(5.0) and r.rank_cpu_ms == pytest.approx((80.0 + 110.0) / 2)
    assert r.plan_wait_ms == pytest.approx((6.0 + 4.0) / 2)
    assert r.planning_overhead == pytest.approx((5.0 + 5.0) / 250.0)


def test_planner_cpu_is_per_plan_made_in_the_timed_window():
    # The presets' shape: 4 iterations, 1 warm-up, --dynapipe-prefetch 2. Iteration 0 queues plans
    # 0 and 1, iterations 1 and 2 one each, iteration 3 none (the run ends): 2 plans in 3 timed
    # iterations, 15 ms each, where a mean over the iterations said 10.
    ranks = _ranks([[900.0, 100.0, 100.0, 100.0]], children=[[1750.0, 20.0, 10.0, 0.0]])
    assert plans_queued_in([1, 2, 3], 2, 4) == 2 and plans_queued_in([0, 1, 2, 3], 2, 4) == 4
    assert plans_queued_in([1, 2, 3], 1, 30) == 3 and plans_queued_in([], 2, 4) == 0
    assert summarise(ranks, warmup_iters=1, prefetch=2).planner_cpu_ms == pytest.approx(15.0)
    # No plan queued in the window (prefetch covered the whole run in the warm-up): no figure.
    assert summarise(_ranks([[9.0, 1.0, 1.0]], children=[[5.0, 1.0, 0.0]]), 1, prefetch=4).planner_cpu_ms is None


def test_memory_first_touched_is_summed_over_ranks_per_timed_iteration():
    # The warm-up's faults (the model built, the heap grown) are outside the window; the ranks add up.
    ranks = _ranks([[900.0, 100.0, 100.0], [900.0, 100.0, 100.0]])
    ranks[0].update(minor_faults=[90000, 10, 30], system_ms=[800.0, 4.0, 6.0])
    ranks[1].update(minor_faults=[70000, 100, 60], system_ms=[700.0, 10.0, 20.0])
    r = summarise(ranks, warmup_iters=1, prefetch=1)
    assert r.minor_faults == pytest.approx((110 + 90) / 2) and r.system_ms == pytest.approx((14.0 + 26.0) / 2)
    assert r.to_json()["minor_faults"] == 100.0 and r.to_json()["system_ms"] == 20.0
    assert r.pretouch_s is None  # the ranks did not record a pre-touch
    ranks[0]["pretouch_s"], ranks[1]["pretouch_s"] = 0.4, 0.6
    r = summarise(ranks, warmup_iters=1, prefetch=1)
    assert r.pretouch_s == 0.6 and r.to_json()["pretouch_s"] == 0.6  # the slowest rank's
    line = format_memory_faults({"dynapipe": (r.minor_faults, r.system_ms, r.pretouch_s),
                                 "packing": (5.0, 1.0, None), "padding": (None, None, None)}, 1024)
    assert "dynapipe 100 faults, 20 ms, pre-touch 0.60 s" in line and "1024 MiB" in line
    # A method whose ranks asked for the heap but did not record writing it says so.
    assert "packing 5 faults, 1 ms, heap not pre-touched" in line and "padding" not in line
    assert "no heap pre-touched" in format_memory_faults({"dynapipe": (1.0, 1.0, None)}, 0)
    # A rank that did not record them (an older summary): no figure, not a partial sum.
    del ranks[1]["minor_faults"]
    assert summarise(ranks, warmup_iters=1, prefetch=1).minor_faults is None
    runs = [MethodResult(1.0, 1.0, 1.0, 0.0, minor_faults=f, system_ms=s, pretouch_s=t)
            for f, s, t in ((5.0, 1.0, 0.5), (9.0, 3.0, 0.7), (7.0, 2.0, 0.6))]
    m = median_result(runs)
    assert (m.minor_faults, m.system_ms, m.pretouch_s) == (7.0, 2.0, 0.7)


def test_median_over_rounds():
    # Every figure its own median: no round's figures are taken whole.
    runs = [MethodResult(real_tokens_per_s=v, padding_efficiency=0.5, iteration_ms=1000.0 / v, plan_wait_ms=w,
                         planner_cpu_ms=c, rank_cpu_ms=k)
            for v, c, w, k in ((10.0, 1.0, 5.0, 7.0), (30.0, 3.0, 1.0, 9.0), (20.0, 2.0, 3.0, 6.0))]
    m = median_result(runs)
    assert m.real_tokens_per_s == 20.0 and m.iteration_ms == pytest.approx(50.0) and m.planner_cpu_ms == 2.0
    assert (m.plan_wait_ms, m.rank_cpu_ms) == (3.0, 7.0)
    assert m.rounds == 3 and m.to_json()["rounds"] == 3


def test_breakdown_from_megatron_steps_and_from_executor_traces(tmp_path):
    # Two megatron-core stages, iteration 1 (us). Stage 0 sends from 1,000 to 11,000; stage 1
    # posts the matching receive at 3,000 and is blocked until 12,000.
    ranks = _ranks([[100.0, 100.0], [100.0, 100.0]])
    ranks[0]["pp_rank"], ranks[1]["pp_rank"] = 0, 1
    ranks[0]["breakdown_ms"] = [{}, {"forward_ms": 30.0, "backward_ms": 40.0, "finalize_ms": 5.0,
                                     "schedule_ms": 90.0, "optimizer_ms": 6.0, "micro_batches": 2,
                                     "p2p_calls": [[1000.0, 11000.0, True, False, False, False]]}]
    ranks[1]["breakdown_ms"] = [{}, {"forward_ms": 30.0, "backward_ms": 40.0, "finalize_ms": 5.0,
                                     "schedule_ms": 90.0, "optimizer_ms": 6.0, "micro_batches": 2,
                                     "p2p_calls": [[3000.0, 12000.0, False, False, True, False]]}]
    b0, b1 = breakdown(ranks, 1)
    assert (b0["compute"], b0["optimizer_and_grads"], b0["stage"]) == (70.0, 11.0, 0)
    # Stage 0 waited 2 ms for stage 1 to post the receive, then 8 ms for the transfer.
    assert (b0["bubble"], b0["comm"]) == (2.0, 8.0)
    # When stage 1 posted its receive the send was already posted: all its wait is the transfer.
    assert (b1["bubble"], b1["comm"]) == (0.0, 9.0)
    assert b0["overhead"] == pytest.approx(90.0 - 70.0 - 10.0 - 5.0) and b0["overhead_per_mb"] == pytest.approx(2.5)
    assert b0["unattributed"] == pytest.approx(100.0 - 70.0 - 10.0 - 5.0 - 11.0)
    # DynaPipe: the executors' Chrome traces of iteration 1 (us, each on its own origin).
    ev0 = [{"ph": "X", "cat": "forward", "ts": 0, "dur": 20000, "pid": 0, "tid": 0, "args": {"iteration": 1, "mb": 0}},
           {"ph": "X", "cat": "comm", "name": "send_act_start 0 peer 1 [1x8x4]", "ts": 20000, "dur": 1000,
            "pid": 0, "tid": 0, "args": {"iteration": 1}},
           {"ph": "X", "cat": "comm", "name": "recv_grad_start 0 peer 1 [1x8x4]", "ts": 21000, "dur": 1000,
            "pid": 0, "tid": 0, "args": {"iteration": 1}},
           {"ph": "X", "cat": "comm", "name": "recv_grad_finish 0 peer 1 [1x8x4]", "ts": 22000, "dur": 48000,
            "pid": 0, "tid": 0, "args": {"iteration": 1}},
           {"ph": "X", "cat": "backward", "ts": 75000, "dur": 20000, "pid": 0, "tid": 0,
            "args": {"iteration": 1, "mb": 0}},
           {"ph": "X", "cat": "forward", "ts": 0, "dur": 99000, "pid": 0, "tid": 0, "args": {"iteration": 0}}]
    # Stage 1's clock origin is 10 ms later: it receives, computes 40 ms, sends the gradient at 60 ms.
    ev1 = [{"ph": "X", "cat": "comm", "name": "recv_act_start 0 peer 0 [1x8x4]", "ts": 0, "dur": 1000,
            "pid": 0, "tid": 1, "args": {"iteration": 1}},
           {"ph": "X", "cat": "comm", "name": "recv_act_finish 0 peer 0 [1x8x4]", "ts": 1000, "dur": 11000,
            "pid": 0, "tid": 1, "args": {"iteration": 1}},
           {"ph": "X", "cat": "forward", "ts": 12000, "dur": 20000, "pid": 0, "tid": 1, "args": {"iteration": 1, "mb": 0}},
           {"ph": "X", "cat": "backward", "ts": 32000, "dur": 20000, "pid": 0, "tid": 1, "args": {"iteration": 1}},
           {"ph": "X", "cat": "comm", "name": "send_grad_start 0 peer 0 [1x8x4]", "ts": 52000, "dur": 1000,
            "pid": 0, "tid": 1, "args": {"iteration": 1}}]
    (tmp_path / "rank000.json").write_text(json.dumps({"traceEvents": ev0, "otherData": {"origin_us": 0.0}}))
    (tmp_path / "rank001.json").write_text(json.dumps({"traceEvents": ev1, "otherData": {"origin_us": 10000.0}}))
    dyn = _ranks([[100.0, 100.0], [100.0, 100.0]])
    for r in dyn:
        r["breakdown_ms"] = [{}, {}]
    d0, d1 = breakdown(dyn, 1, str(tmp_path))
    assert (d0["compute"], d0["plan_wait"], d0["stage"], d1["stage"]) == (40.0, 1.0, 0, 1)
    # Stage 0 is blocked 22..70 ms; stage 1 posts the gradient's send at 62 ms: 40 ms bubble, 8 ms transfer.
    assert d0["bubble"] == pytest.approx(40.0) and d0["comm"] == pytest.approx(8.0 + 2.0)
    # Stage 1 is blocked 11..22 ms on an activation stage 0 had sent at 20 ms.
    assert d1["bubble"] == pytest.approx(9.0) and d1["comm"] == pytest.approx(2.0 + 2.0)
    # The executor's span is 95 ms of which 5 ms are gaps between instructions.
    assert d0["overhead"] == pytest.approx(95.0 - 40.0 - 50.0) and d0["optimizer_and_grads"] == pytest.approx(4.0)
    for d in (d0, d1):
        parts = sum(d[k] for k in ("compute", "bubble", "comm", "overhead", "optimizer_and_grads", "plan_wait"))
        assert parts + d["unattributed"] == pytest.approx(d["iteration"])


def test_sweep_keeps_the_best_measured_size():
    rows = [{"micro_batch_size": m, "fits": True, "real_tokens_per_s": s} for m, s in ((1, 9.0), (2, 8.0), (4, 1.0))]
    res = {"packing@mbs1": MethodResult(5.0, 1, 1, 0), "packing@mbs2": MethodResult(7.0, 1, 1, 0)}
    out = BenchSimulation.sweep_with_measured(rows, res, "packing")
    assert [r["chosen"] for r in out] == [False, True, False]
    assert [r["measured_real_tokens_per_s"] for r in out] == [5.0, 7.0, None]


def test_simulated_sweep_lists_sizes_that_divide_the_batch():
    from megatron_integration.arguments import parse_training_args

    argv = with_defaults(["--global-batch-size", "12", "--train-iters", "3", "--seq-length", "256",
                          "--max-position-embeddings", "256", "--use-dynapipe"], "representative")
    sim = BenchSimulation(parse_training_args(argv, 2), 2, None, warmup_iters=1)
    assert len(sim.batches) == 2 and all(len(b) == 12 and b.max() <= 256 for b in sim.batches)
    assert sim.candidate_sizes("padding") == [1, 2, 4]  # 8 does not divide 12
    rows = sim.sweep("padding-mb")
    assert [r["micro_batch_size"] for r in rows] == [1, 2, 4] and all(r["fits"] and r["simulated"] for r in rows)
    # Full rows give GPT-7B's 1/7 (hidden = sequence length, FFN 4h); shorter rows give less.
    assert sim.attention_share("padding") == pytest.approx(1 / 7 * 256 / 512 / (1 / 7 * 256 / 512 + 6 / 7), rel=1e-6)
    assert sim.attention_share("dynapipe") < sim.attention_share("padding")


def test_bench_compute_floor_prices_every_methods_micro_batches_over_the_timed_batches():
    from megatron_integration.arguments import parse_training_args
    from dynapipe.cost.compute_floor import compute_floor_ms

    argv = with_defaults(["--global-batch-size", "12", "--train-iters", "3", "--seq-length", "256",
                          "--max-position-embeddings", "256", "--use-dynapipe"], "representative")
    sim = BenchSimulation(parse_training_args(argv, 2), 2, None, warmup_iters=1)
    out = sim.compute_floor({"padding": 2, "padding-mb": 2, "packing": 1, "packing-per-sample": 1, "dynapipe": None})
    floor = sum(compute_floor_ms(sim.cost, b) for b in sim.batches) / 2
    assert out["iterations"] == 2 and out["floor_ms"] == pytest.approx(floor, abs=0.05)
    # Padding computes 6 micro-batches of 2 full rows a batch, priced on both stages.
    full = 6 * sum(float(sim.cost.stage_cost(2, 256, stage=k).time_ms) for k in range(2))
    assert out["predicted_ms"]["padding"] == pytest.approx(full, rel=1e-3)
    packed = [sim.micro_batches("packing", b, 1) for b in sim.batches]
    assert all(len(mbs) < 12 and all((mb.mbs, mb.seqlen) == (1, 256) for mb in mbs) for mbs in packed)
    # The same rows run per sample skip the attention between samples: priced at their density.
    per_sample = [sim.micro_batches("packing-per-sample", b, 1) for b in sim.batches]
    assert [[mb.rows for mb in mbs] for mbs in per_sample] == [[mb.rows for mb in mbs] for mbs in packed]
    assert out["floor_ms"] <= out["predicted_ms"]["packing-per-sample"] < out["predicted_ms"]["packing"]
    # Nothing computes below the floor; padding to the longest of each micro-batch wastes less than full rows.
    assert all(v >= 1.0 for v in out["over_floor"].values())
    assert out["over_floor"]["padding-mb"] < out["over_floor"]["padding"]
    line = format_compute_floor(out, "packing")
    assert f"packing's compute is {out['over_floor']['packing']:.2f}x the floor" in line


def test_bench_refuses_what_the_preset_cannot_honour(tmp_path, capsys):
    from dynapipe.cli import main

    base = ["bench", "--output", str(tmp_path / "x.json"), "--preset", "representative"]
    for extra, message in ((["--micro-batch-size", "2"], "--sweep-top 0"), (["--rounds", "0"], "--rounds 0"),
                           (["--methods", "dynapipe,dynapipe"], "at most once"),
                           (["--num-virtual-stages-per-pipeline-rank", "2"], "bench_gpt_interleaved.py"),
                           (["--decoder-first-pipeline-num-layers", "3"], "pretrain_gpt.py"),
                           (["--nproc", "0"], "--nproc 0: must be 1 or more"),
                           (["--threads-per-rank", "-1"], "--threads-per-rank -1: must be 1 or more"),
                           (["--timeout-s", "0"], "--timeout-s 0.0: must be positive"),
                           (["--t5-sweep", "1,2"], "--t5-sweep 1,2 sets the T5 baselines"),
                           (["--methods", "dynapipe,"], "--methods 'dynapipe,': an empty entry"),
                           # The fit leaves the first iteration out: one iteration fits nothing.
                           (["--calibrate-iters", "1"], "--calibrate-iters 1: give 0 (none) or at least 2"),
                           (["--exit-interval", "1"], "--exit-interval 1 stops every run after iteration 1"),
                           (["--dynapipe-placement", "bogus"], "the GPT bench runs Megatron's even split only"),
                           # An unchunked layout is a split, not chunks: pointed at pretrain_gpt.py.
                           (["--pipeline-model-parallel-layout", "Ett|ttL"], "the GPT bench runs Megatron's even")):
        assert main(base + extra) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    assert not (tmp_path / "x.json").exists()


def test_breakdown_summary_is_per_stage():
    from megatron_integration.bench_report import breakdown_summary, breakdown_table

    def row(rank, stage, compute, bubble):
        return {"rank": rank, "stage": stage, "iteration": 100.0, "compute": compute, "bubble": bubble, "comm": 5.0,
                "overhead": 2.0, "overhead_per_mb": 0.5, "micro_batches": 4, "optimizer_and_grads": 5.0,
                "plan_wait": 0.0, "unattributed": 100.0 - compute - bubble - 12.0}

    rnd = [row(0, 0, 80.0, 3.0), row(1, 1, 40.0, 43.0)]
    s = breakdown_summary([rnd, rnd])
    assert s["compute"] == 60.0 and s["bubble"] == 23.0 and s["busy_fraction"] == 0.8
    assert [st["stage"] for st in s["stages"]] == [0, 1] and s["stages"][1]["bubble"] == 43.0
    table = breakdown_table({"packing": s})
    assert "bubble" in table and "43.0" in table and breakdown_summary([]) == {}


def test_sweep_runs_only_sizes_close_to_the_best_simulated():
    from megatron_integration.bench import pick_sizes

    ranked = [{"micro_batch_size": m, "real_tokens_per_s": v} for m, v in ((2, 100.0), (1, 95.0), (4, 80.0))]
    assert [r["micro_batch_size"] for r in pick_sizes(ranked, 2, 0.1)] == [2, 1]
    assert [r["micro_batch_size"] for r in pick_sizes(ranked, 3, 0.1)] == [2, 1]
    assert [r["micro_batch_size"] for r in pick_sizes(ranked, 3, 0.0)] == [2, 1, 4]
    # The tiny preset: padding's near-tied sizes (as one run's profile simulated them) both run,
    # the other baselines' best one only.
    tiny = PRESETS["tiny"]
    padding = [{"micro_batch_size": m, "real_tokens_per_s": v} for m, v in ((16, 4085.0), (1, 4071.0), (2, 4055.0))]
    assert [r["micro_batch_size"] for r in pick_sizes(padding, tiny.sweep_top_of["padding"], tiny.sweep_within)] == [16, 1]
    assert [r["micro_batch_size"] for r in pick_sizes(padding[:1] + [{"micro_batch_size": 1, "real_tokens_per_s": 3800.0}],
                                                      tiny.sweep_top_of["padding"], tiny.sweep_within)] == [16]
    assert tiny.sweep_top == 1 and set(tiny.sweep_top_of) == {"padding"}

    assert [r["micro_batch_size"] for r in pick_sizes(ranked, 2, 0.01)] == [2] and pick_sizes([], 2, 0.1) == []


def test_the_heap_is_pre_touched_only_where_no_gpu_keeps_the_activations(monkeypatch):
    from megatron_integration.bench_presets import host_defaults

    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert host_defaults(2, 1024)["--dynapipe-cpu-pretouch-mb"] == "1024"
    assert PRESETS["tiny"].cpu_pretouch_mb == PRESETS["representative"].cpu_pretouch_mb == 1024
    # On a GPU host the flag is refused (GPU ranks' activations live in device memory): the
    # bench must not add it there, or every GPU bench would fail on a flag nobody typed.
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    assert "--dynapipe-cpu-pretouch-mb" not in host_defaults(2, 1024)
    assert "--dynapipe-cpu-pretouch-mb" not in with_defaults([], "tiny")

def test_bench_layer_checks_requests_without_the_command_line():
    # The bench is called by the command line, never the other way round: checking a request
    # (which parses every method's Megatron arguments) must not load dynapipe.cli.
    import subprocess
    import sys

    code = ("import sys\n"
            "from dynapipe.errors import DynaPipeError\n"
            "from megatron_integration.bench import check_request\n"
            "assert check_request([], ['dynapipe', 'packing'], 'representative') == 2\n"
            "# One replica by default: PP2 x TP2 is four ranks, not two that TP2 cannot split.\n"
            "assert check_request(['--tensor-model-parallel-size', '2'], ['dynapipe', 'padding'], 'tiny') == 4\n"
            "try:\n"
            "    check_request(['--train-iters', '1'], ['dynapipe'], 'tiny')\n"
            "except DynaPipeError as e:\n"
            "    assert '--train-iters 1' in str(e)\n"
            "else:\n"
            "    raise SystemExit('accepted')\n"
            "print(sorted(m for m in sys.modules if m.startswith('dynapipe.cli')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_fixed_cost_per_op_is_fitted_in_profile_units(tmp_path):
    import numpy as np

    from megatron_integration.bench_calibrate import fit_stage_overhead, write_calibrated_profile

    predicted = np.array([1.0, 2.0, 4.0, 8.0, 16.0])
    # A loaded machine (everything 1.5x slower) with a fixed 3 ms per op the profile did not see.
    fit = fit_stage_overhead(predicted, 1.5 * predicted + 3.0, executor_ms=0.6)
    assert fit.slope == pytest.approx(1.5) and fit.intercept_ms == pytest.approx(3.0) and fit.ops == 5
    assert fit.stage_overhead_ms == pytest.approx((3.0 + 0.6) / 1.5)
    # Ops cheaper than predicted by a constant: no negative overhead.
    assert fit_stage_overhead(predicted, predicted - 1.0, 0.0).stage_overhead_ms == 0.0
    assert fit_stage_overhead(predicted[:1], predicted[:1], 0.5).stage_overhead_ms == pytest.approx(0.5)
    # Times that shrink as the predicted cost grows are noise: only the executor's time is kept.
    noise = fit_stage_overhead(predicted, 20.0 - predicted, 0.5)
    assert (noise.slope, noise.intercept_ms, noise.stage_overhead_ms) == (1.0, 0.0, 0.5)
    # So do times that grow at under half the predicted rate (a 0.28x slope fitted on a loaded
    # host): no fixed cost is read from them; at half the rate the fit is kept.
    flat = fit_stage_overhead(predicted, 0.28 * predicted + 11.9, 0.5)
    assert (flat.slope, flat.intercept_ms, flat.stage_overhead_ms) == (1.0, 0.0, 0.5)
    half = fit_stage_overhead(predicted, 0.5 * predicted + 2.0, 0.0)
    assert half.slope == pytest.approx(0.5) and half.stage_overhead_ms == pytest.approx(4.0)

    from dynapipe.config import load_model_config
    from dynapipe.cost.profile import ProfileCostModel

    grid = [[1.0, 2.0], [2.0, 4.0]]
    table = {f: grid for f in ("fw_ms", "bw_ms", "stored_mib", "peak_mib")}
    profile = {"format": "dynapipe-profile", "version": 1, "mbs": [1, 2], "seqlen": [64, 128], "model": TINY_WIDTHS,
               "ops": {op: table for op in ("layer", "embedding", "output")}}
    src, out = tmp_path / "p.json", tmp_path / "p.calibrated.json"
    src.write_text(json.dumps(profile))
    write_calibrated_profile(str(src), str(out), fit)
    written = json.loads(out.read_text())
    assert written["stage_overhead_ms"] == pytest.approx(2.4) and written["calibration"]["ops"] == 5
    assert written["ops"] == profile["ops"]
    # The planner's cost model pays it once per stage forward and once per backward.
    model = load_model_config("gpt-tiny")
    plain = ProfileCostModel.from_file(model, str(src), 2).stage_cost(2, 100, stage=1)
    paid = ProfileCostModel.from_file(model, str(out), 2).stage_cost(2, 100, stage=1)
    assert float(paid.fw_ms - plain.fw_ms) == pytest.approx(2.4) and float(paid.bw_ms - plain.bw_ms) == pytest.approx(2.4)


def test_executed_trace_keeps_its_wall_clock_origin():
    # Ranks write their traces separately, each starting at 0: the origin puts them on one clock again.
    from dynapipe.runtime.exec_trace import ExecEvent, ExecTrace, chrome_trace

    tr = ExecTrace(stage=1, replica=0, iteration=2)
    tr.events += [ExecEvent(0, "fw", 0, "F0", "forward", 5000.0, 10.0, "F", (1, 8, 0)),
                  ExecEvent(1, "send_act_start", 0, "send_act_start 0 peer 2 [8x1x4]", "comm", 5020.0, 1.0)]
    doc = chrome_trace([tr])
    assert doc["otherData"]["origin_us"] == 5000.0
    assert [e["ts"] + doc["otherData"]["origin_us"] for e in doc["traceEvents"] if e["ph"] == "X"] == [5000.0, 5020.0]


@pytest.mark.parametrize("model", ["gpt", "t5"])
def test_bench_refuses_outputs_it_could_not_write_before_any_run(tmp_path, capsys, monkeypatch, model):
    # The JSON (and the picture) are written after minutes of training: a path that would fail
    # then is refused before anything is measured or trained, for GPT and T5 alike.
    from dynapipe.cli import main
    import megatron_integration.bench as bench
    import megatron_integration.bench_t5_profile as t5_profile

    def ran(*a, **k):
        raise AssertionError("a run started before the outputs were checked")
    monkeypatch.setattr(bench, "run_bench", ran)
    monkeypatch.setattr(t5_profile, "measure_bench_profile", ran)
    d, f, x = tmp_path / "d", tmp_path / "f", str(tmp_path / "x.json")
    pic = tmp_path / "pic.png"
    d.mkdir()
    pic.mkdir()
    f.write_text("")
    data, prefix = tmp_path / "data.jsonl", tmp_path / "corpus"
    data.write_text('{"text": "a"}\n')
    for suffix in (".bin", ".idx"):
        (tmp_path / ("corpus" + suffix)).write_bytes(b"")
    cases = [(["--output", str(d)], f"--output '{d}' is a directory; give a file path"),
             (["--output", f"{d}/"], "is a directory"),
             (["--output", f"{f}/x.json"], f"'{f}' is a file, not a folder, so nothing can be written under it"),
             (["--output", x, "--warmup-iters", "-1"], "--warmup-iters -1: must be >= 0"),
             # Files the runs read are never written over: the data, an indexed dataset's prefix,
             # a cost model next to --output.
             (["--output", str(data), "--data-path", str(data)],
              f"--data-path and --output name the same file '{data}', which --output would overwrite"),
             (["--output", f"{prefix}.bin", "--data-path", "1", str(prefix)], "--data-path and --output name"),
             (["--output", str(tmp_path / "b.json"), f"--dynapipe-cost-model={tmp_path / 'b.profile.json'}"]
              + (["--calibrate-iters", "0"] if model == "t5" else []), None)]
    if model == "gpt":
        monkeypatch.chdir(tmp_path)
        (tmp_path / "1").write_text("")
        cases.append((["--output", x, "--train-data-path", str(prefix), "--valid-data-path", str(prefix),
                       "--tensor-model-parallel-size", "1"], "runs"))
        cases += [(["--output", x, "--png", "b.txt"], "--png 'b.txt' does not end in .png"),
                  (["--output", x, "--png", ""], "--png '': an empty path"),
                  (["--output", f"{d}.png", "--png", f"{d}.png"], "--output and --png name the same file"),
                  (["--output", x, "--png", str(pic)], f"--png '{pic}' is a directory")]
    for extra, message in cases:
        if message is None:
            # A profile given is read, not measured: --output's own profile name is free (the
            # request gets as far as reading it).
            (tmp_path / "b.profile.json").write_text("{}")
            assert main(["bench", "--model", model, *extra]) == 2
            assert "not a DynaPipe profile" in capsys.readouterr().err
            (tmp_path / "b.profile.json").unlink()
            continue
        if message == "runs":
            # Inputs may share a file (one dataset for training and validation), and a file named
            # as a number ("1") is no output: the bench gets as far as its runs.
            with pytest.raises(AssertionError, match="a run started"):
                main(["bench", "--model", model, *extra])
            continue
        assert main(["bench", "--model", model, *extra]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, (extra, err)
    left = sorted(p.name for p in tmp_path.iterdir() if p.name != "1")
    assert left == ["corpus.bin", "corpus.idx", "d", "data.jsonl", "f", "pic.png"] and not any(d.iterdir())
    assert data.read_text() == '{"text": "a"}\n'


def test_warm_up_check_is_shared_by_the_gpt_and_t5_benches():
    from dynapipe.errors import DynaPipeError
    from megatron_integration.bench import check_request
    from megatron_integration.bench_checks import check_warmup_iters

    check_warmup_iters(0)
    for refuse in (lambda: check_warmup_iters(-1), lambda: check_request([], ["dynapipe"], "tiny", warmup_iters=-1)):
        with pytest.raises(DynaPipeError, match="--warmup-iters -1: must be >= 0"):
            refuse()


def test_a_baseline_with_no_size_that_fits_is_refused_before_any_run(tmp_path, monkeypatch):
    # At 600 MiB (512 of them the cpu device's reserve) every padding/packing size needs recompute,
    # which the megatron-core baseline runs do not do: the bench said nothing and crashed after
    # training DynaPipe (KeyError on the baseline).
    from dynapipe.errors import DynaPipeError
    import megatron_integration.bench as bench

    def ran(*a, **k):
        raise AssertionError("a training run started")
    monkeypatch.setattr(bench, "run_training", ran)
    argv = ["--dynapipe-memory-limit-mb", "600", "--train-iters", "3", "--global-batch-size", "16",
            "--dynapipe-cost-model", "analytic"]
    with pytest.raises(DynaPipeError, match=r"no micro-batch size of the packing baseline fits the memory limit "
                                            r"without recompute \(1: needs recompute .*--dynapipe-memory-limit-mb"):
        bench.run_bench(argv, ["dynapipe", "packing"], 2, str(tmp_path / "b.json"), sweep_top=1, calibrate_iters=0,
                        progress=False, stream=io.StringIO())
    assert not (tmp_path / "b.json").exists()


def test_run_bench_from_python_refuses_what_the_command_line_refuses(tmp_path, monkeypatch):
    # The calibration and picture checks lived in the command line alone: from Python,
    # calibrate_iters=1 fitted on the warm-up iteration and an impossible calibration was skipped unsaid.
    from dynapipe.errors import DynaPipeError
    import importlib.util
    import megatron_integration.bench as bench

    def ran(*a, **k):
        raise AssertionError("a process started")
    monkeypatch.setattr(bench, "run_training", ran)
    monkeypatch.setattr(bench, "measure_profile", ran)
    argv, out = ["--train-iters", "3"], str(tmp_path / "b.json")
    for methods, kw, message in (
            (["dynapipe"], dict(calibrate_iters=1), r"--calibrate-iters 1: give 0 \(none\) or at least 2"),
            (["dynapipe"], dict(calibrate_iters=-2), "--calibrate-iters -2: give 0"),
            (["padding"], dict(calibrate_iters=2), "--methods padding runs nothing through it"),
            (["dynapipe"], dict(calibrate_iters=2, argv=argv + ["--dynapipe-cost-model", "analytic"]),
             "there is none to calibrate")):
        with pytest.raises(DynaPipeError, match=message):
            bench.run_bench(kw.pop("argv", argv), methods, 2, out, progress=False, stream=io.StringIO(), **kw)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    with pytest.raises(DynaPipeError, match="--png needs matplotlib"):
        bench.run_bench(argv, ["dynapipe"], 2, out, png=str(tmp_path / "b.png"), progress=False, stream=io.StringIO())
    assert not any(tmp_path.iterdir())


def test_waiting_for_the_last_rank_after_the_pipeline_part_is_bubble_not_optimizer():
    # The last stage ends its 1F1B before stage 0's last backward; it then waits in the gradient
    # all-reduces for stage 0. That drain was counted as its optimizer time (219 against 10 ms).
    from megatron_integration.bench_breakdown import RankTimeline, rows

    def rank(stage, end_us, opt_ms):
        return RankTimeline(0, stage, 1000.0, 800.0, 4, optimizer_and_grads_ms=opt_ms, pipeline_end_us=end_us)

    r0, r1 = rows([rank(0, 5_120_000.0, 30.0), rank(1, 5_000_000.0, 150.0)])
    assert (r0["bubble"], r0["optimizer_and_grads"]) == (0.0, 30.0)
    assert (r1["bubble"], r1["optimizer_and_grads"]) == (120.0, 30.0)
    assert r1["unattributed"] == rank(1, 0.0, 150.0).iteration_ms - 800.0 - 150.0  # parts still add up
    # Never more than the time outside the pipeline part; nothing where a rank did not record its end.
    capped, unknown = rows([rank(0, 6_000_000.0, 30.0), rank(1, 5_000_000.0, 150.0)])[1], \
        rows([rank(0, None, 30.0), rank(1, 5_000_000.0, 150.0)])[1]
    assert (capped["bubble"], capped["optimizer_and_grads"]) == (150.0, 0.0)
    assert (unknown["bubble"], unknown["optimizer_and_grads"]) == (0.0, 150.0)


def test_a_timed_step_counts_its_device_time_without_stopping_the_host():
    # On GPUs megatron-core's forward and backward steps return once their kernels are launched:
    # a step's time is the span between events recorded around it on the device, read once the
    # schedule has ended; the host does not wait inside the schedule (a synchronisation at every
    # step would undo the overlapped exchanges and wait for the NCCL streams' receives too).
    from megatron_integration.schedule_timing import DeviceSpans, ScheduleTiming, _timed

    clock = {"now": 0.0, "waited": 0}

    class Event:  # the device's clock: each record happens at the device's current time
        def record(self):
            self.at = clock["now"]

        def synchronize(self):
            clock["waited"] += 1

        def elapsed_time(self, end):
            return end.at - self.at

    def launch(ms):
        clock["now"] += ms  # the kernels this call enqueued run for ms on the device
        return "launched"

    timing = ScheduleTiming()
    spans = DeviceSpans(Event)
    forward = spans.timed(launch, timing, "forward_ms")
    backward = spans.timed(launch, timing, "backward_ms")
    assert forward(30.0) == "launched" and backward(50.0) == "launched" and forward(20.0) == "launched"
    assert timing.forward_ms == 0.0 and clock["waited"] == 0  # nothing read, nothing waited for yet
    spans.settle()
    assert (timing.forward_ms, timing.backward_ms) == (50.0, 50.0) and clock["waited"] == 3
    spans.settle()  # settled spans are not counted twice
    assert (timing.forward_ms, timing.backward_ms) == (50.0, 50.0)
    # An exchange megatron-core ends with a device synchronise (batched, batch_p2p_sync) first
    # waits for the step before it, so its recorded window is the exchange's alone; an
    # overlapped exchange (not batched) waits for nothing.
    from types import SimpleNamespace

    from megatron_integration.schedule_timing import _recorded

    waits = []
    exchange = _recorded(lambda self, **kw: "sent", timing, sync=lambda: waits.append(1))
    batched = SimpleNamespace(config=SimpleNamespace(batch_p2p_comm=True, batch_p2p_sync=True))
    overlapped = SimpleNamespace(config=SimpleNamespace(batch_p2p_comm=False, batch_p2p_sync=True))
    assert exchange(batched, tensor_send_next=1) == "sent" and waits == [1]
    assert exchange(overlapped, recv_prev=True) == "sent" and waits == [1]
    assert [c[2:] for c in timing.p2p_calls] == [[True, False, False, False], [False, False, True, False]]
    # CPU ranks: the wall time of the call.
    untimed = ScheduleTiming()
    _timed(lambda: None, untimed, "backward_ms")()
    assert 0.0 <= untimed.backward_ms < 500.0  # a no-op: one preemption on a loaded host is the most


def test_a_tensor_parallel_bench_is_simulated_per_tensor_parallel_rank():
    # TP2 x PP2 on 4 ranks: the sweep and the simulated columns priced the layout at TP1.
    from megatron_integration.arguments import parse_training_args

    base = ["--global-batch-size", "8", "--train-iters", "3", "--seq-length", "256", "--max-position-embeddings",
            "256", "--use-dynapipe"]
    argv = with_defaults(base + ["--tensor-model-parallel-size", "2", "--sequence-parallel"], "representative")
    sim = BenchSimulation(parse_training_args(argv, 4), 4, None, warmup_iters=1)
    assert sim.dp == 1 and sim.cost.tp.size == 2 and sim.cost.tp.sequence_parallel
    one = BenchSimulation(parse_training_args(with_defaults(base, "representative"), 2), 2, None, warmup_iters=1)
    assert float(sim.cost.stage_cost(2, 256).time_ms) < float(one.cost.stage_cost(2, 256).time_ms)


def test_executor_methods_are_simulated_under_the_runs_fixed_schedule_and_recompute():
    from megatron_integration.arguments import parse_training_args

    argv = with_defaults(["--global-batch-size", "12", "--train-iters", "3", "--seq-length", "256",
                          "--max-position-embeddings", "256", "--dynapipe-schedule", "1f1b",
                          "--dynapipe-recompute", "selective", "--use-dynapipe"], "representative")
    sim = BenchSimulation(parse_training_args(argv, 2), 2, None, warmup_iters=1)
    for method in ("dynapipe", "packing-search"):
        kw = sim._kwargs(method)
        assert (kw["schedule"], kw["recompute"]) == ("1f1b", "selective"), method
    # A method that fixes its own schedule, and megatron-core's baselines, keep theirs.
    assert "schedule" not in sim._kwargs("dynapipe-zb") and "schedule" not in sim._kwargs("packing")
    rows = sim.sweep("packing-search")
    assert all(r["recompute"] == ["selective"] and r["schedule"] == ["1f1b"] for r in rows if r["fits"])
