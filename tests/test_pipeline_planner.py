"""End to end: lengths -> micro-batches -> schedule -> validated per-rank plans; commands."""
import argparse
import json
import os

import numpy as np
import pytest

from dynapipe.batching import plan_micro_batches
from dynapipe.cli import main
from dynapipe.cli.schedule_options import add_schedule_arguments, resolve_cluster, schedule_json
from dynapipe.config import load_device_config, load_model_config
from dynapipe.cost import build_cost_model
from dynapipe.data.synthetic import sample_lengths
from dynapipe.errors import DynaPipeError
from dynapipe.pipeline_planner import plan_iteration
from dynapipe.plan import read_plan_dir, validate_plans


@pytest.fixture(scope="module")
def tiny_cost():
    return build_cost_model(load_model_config("gpt-tiny"), load_device_config("cpu"), 2)


def test_plan_iteration_covers_every_sample_once(tiny_cost):
    lengths = sample_lengths(96, 3, 512)
    it = plan_iteration(lengths, tiny_cost, stages=2, dp=2, cluster=resolve_cluster(None, "cpu"), validate=True)
    assert len(it.plans) == 2 and all(len(rep) == 2 for rep in it.plans)
    samples = sorted(x for rep in it.plans for m in rep[0].micro_batches for x in m.samples)
    assert samples == list(range(96))
    assert all(p.global_loss_tokens == int(lengths.sum()) for p in it.all_plans())
    assert sum(rep[0].loss_tokens for rep in it.plans) == int(lengths.sum())
    assert it.plan_for(1, 0) is it.plans[1][0] and it.plan_for(1, 0).replica == 1
    for replica, stage in ((2, 0), (0, 2), (-1, 0), (0, -1)):
        with pytest.raises(DynaPipeError, match=rf"plan_for\({replica}, {stage}\): the iteration was planned for "
                                                r"replicas 0 to 1 and stages 0 to 1"):
            it.plan_for(replica, stage)
    assert set(it.timings_ms) == {"batching", "schedule", "compile", "validate"}
    assert it.planning_ms == pytest.approx(sum(it.timings_ms[k] for k in ("batching", "schedule", "compile")))
    j = it.schedule_json(explain=True)
    assert j["schedule"] in ("1f1b", "adaptive", "zb-h1") and j["recompute"] in ("none", "selective", "full")
    assert len(j["stage_peak_mib"]) == 2 and 0 <= j["bubble_fraction"] < 1 and j["candidates"]
    assert j["simulated_ms"] == pytest.approx(max(t.makespan_ms for t in it.timelines), abs=1e-3)


def test_plans_are_deterministic(tiny_cost):
    from dynapipe.plan import serialize_plan
    lengths = sample_lengths(64, 9, 512)
    a = plan_iteration(lengths, tiny_cost, dp=2, iteration=4)
    b = plan_iteration(lengths, tiny_cost, dp=2, iteration=4)
    assert [serialize_plan(p) for p in a.all_plans()] == [serialize_plan(p) for p in b.all_plans()]


def test_recompute_is_chosen_when_samples_need_it():
    cm = build_cost_model(load_model_config("gpt-7b"), load_device_config("a100-40gb"), 4)
    lengths = np.array([2000, 1900, 300, 120, 80] * 4)
    with pytest.raises(DynaPipeError, match="does not fit in memory even alone"):
        plan_micro_batches(lengths, cm, memory_limit_mib=40536, reserved_mib=2048)
    it = plan_iteration(lengths, cm, validate=True)
    assert it.recompute != "none"
    assert max(it.stage_peak_mib) <= 40536 - 2048


def test_encoder_decoder_loss_counts_target_tokens():
    t5 = load_model_config("t5-11b")
    cm = build_cost_model(t5, load_device_config("h200"), 4)
    lengths = sample_lengths(24, 0, 512, encoder_decoder=True)
    it = plan_iteration(lengths, cm, validate=True)
    assert it.plans[0][0].global_loss_tokens == int(lengths[:, 1].sum())
    # The micro-batches keep their non-pad tokens (input + target); the loss count is apart.
    assert sum(mb.real_tokens for mb in it.batch_plan.micro_batches) == int(lengths.sum())
    assert sum(mb.planned_loss_tokens for mb in it.batch_plan.micro_batches) == int(lengths[:, 1].sum())


def test_encoder_decoder_loss_tokens_are_the_truncated_targets():
    # Targets longer than seq_length are cut by the planner; the loss normaliser counted them whole
    # (210 for targets 150 and 60 at seq_length 128, where 188 are trained).
    cm = build_cost_model(load_model_config("t5-11b"), load_device_config("a100-40gb"), 8)
    it = plan_iteration([[100, 150], [40, 60]], cm, seq_length=128, validate=True)
    assert it.plans[0][0].global_loss_tokens == 128 + 60
    assert sum(mb.loss_tokens for mb in it.batch_plan.micro_batches) == 188


def test_a_micro_batch_of_no_replica_is_refused_not_dropped(tiny_cost):
    import dataclasses

    from dynapipe.pipeline_planner import schedule_batch_plan

    bp = plan_micro_batches(sample_lengths(8, 1, 256), tiny_cost, dp=2)
    last = bp.micro_batches[-1]
    for bad in (2, -1):
        broken = dataclasses.replace(bp, micro_batches=bp.micro_batches[:-1] + [dataclasses.replace(last, replica=bad)])
        with pytest.raises(DynaPipeError, match=f"assigned to replica {bad}, outside 0..1"):
            schedule_batch_plan(broken, tiny_cost)


def test_stages_must_match_the_cost_model(tiny_cost):
    with pytest.raises(DynaPipeError, match="stages 3: the cost model was built for 2 stages"):
        plan_iteration([10, 20], tiny_cost, stages=3)


def test_schedule_json_and_plan_out(tiny_cost, tmp_path):
    p = argparse.ArgumentParser()
    add_schedule_arguments(p)
    args = p.parse_args(["--schedule", "adaptive", "--plan-out", str(tmp_path / "plans"), "--explain"])
    bp = plan_micro_batches(sample_lengths(40, 1, 512), tiny_cost, dp=2, memory_limit_mib=8192, reserved_mib=512)
    out = schedule_json(args, bp, tiny_cost)
    assert out["schedule"] == "adaptive" and out["order"] == "planned"
    assert {c["schedule"] for c in out["candidates"]} == {"adaptive"}
    assert out["schedule_planning_ms"] > 0
    assert len(out["plan_files"]) == 4 and all(os.path.exists(f) for f in out["plan_files"])
    plans = read_plan_dir(str(tmp_path / "plans"))
    assert validate_plans(plans).replicas == 2


def test_validate_command(tiny_cost, tmp_path, capsys):
    it = plan_iteration(sample_lengths(30, 2, 512), tiny_cost, dp=1)
    from dynapipe.plan import write_plan_dir
    paths = write_plan_dir(it.all_plans(), str(tmp_path))
    assert main(["validate", str(tmp_path)]) == 0
    assert "valid: 2 plans (1 replica(s) x 2 stages)" in capsys.readouterr().out
    with open(paths[1], "r+b") as f:
        f.seek(40)
        byte = f.read(1)
        f.seek(40)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert main(["validate", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and os.path.basename(paths[1]) in err and "corrupted" in err
    os.remove(paths[1])
    assert main(["validate", str(tmp_path)]) == 2
    assert "no plan for rank(s) [1]" in capsys.readouterr().err
    assert main(["validate", str(tmp_path / "nowhere")]) == 2


def test_trace_command(tmp_path, capsys):
    out, png = tmp_path / "t.json", tmp_path / "t.png"
    rc = main(["trace", "--samples", "24", "--model", "gpt-tiny", "--device", "cpu", "--stages", "2",
               "--seq-length", "256", "--out", str(out), "--png", str(png)])
    assert rc == 0
    trace = json.loads(out.read_text())
    events = trace["traceEvents"]
    threads = {e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert threads == {"stage 0", "stage 1"}
    ops = [e for e in events if e["ph"] == "X"]
    assert ops and all(e["name"][0] in "FB" and "x" in e["name"] for e in ops)
    split = trace["metadata"]["schedule"] == "zb-h1"  # auto's choice; zb-h1 splits every backward
    assert trace["metadata"]["schedule"] in ("1f1b", "adaptive", "zb-h1")
    assert {e["cat"] for e in ops} == ({"forward", "backward-input", "backward-weight"} if split
                                       else {"forward", "backward"})
    assert {e["name"] for e in events if e["ph"] == "C"} == {"memory stage 0", "memory stage 1"}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "trace written" in capsys.readouterr().err


def test_a_share_of_the_budget_caps_micro_batches_of_several_samples():
    cm = build_cost_model(load_model_config("gpt-7b"), load_device_config("a100-40gb"), 4)
    lengths = np.array([3000, 900, 800, 700, 600, 500, 400, 300, 200, 100] * 4)
    kw = dict(memory_limit_mib=40_960, reserved_mib=2048, recompute="selective")
    whole = plan_micro_batches(lengths, cm, **kw)
    half = plan_micro_batches(lengths, cm, micro_batch_share=0.5, **kw)
    budget = half.extra["activation_budget_mib"]
    assert half.extra["micro_batch_share"] == 0.5 and whole.extra["micro_batch_share"] == 1.0
    need = [mb.stored_mib + mb.peak_mib for mb in whole.micro_batches if mb.mbs > 1]
    assert max(need) > 0.5 * budget  # the share binds here
    for mb in half.micro_batches:
        assert mb.stored_mib + mb.peak_mib <= (0.5 if mb.mbs > 1 else 1.0) * budget + 1e-9
    assert len(half.micro_batches) > len(whole.micro_batches)
    assert sorted(i for mb in half.micro_batches for i in mb.samples) == list(range(len(lengths)))
    for bad in (0.0, 1.5):
        with pytest.raises(DynaPipeError, match=f"micro_batch_share {bad}"):
            plan_micro_batches(lengths, cm, micro_batch_share=bad, **kw)


def test_a_tight_limit_cuts_smaller_micro_batches_when_the_pipeline_needs_the_room():
    # gpt-13b, TP2 with sequence parallelism x PP4 x DP2 on a100-40gb (the advisor's layout):
    # cut to fit alone, the micro-batches made the search recompute everything on the first
    # stage (its four in flight did not fit) and DynaPipe simulated 0.93x the best packing.
    from dynapipe.advise import sample_batches
    from dynapipe.config import TensorParallelConfig, load_cluster_config
    from dynapipe.data.synthetic import DEFAULT_MIXTURE, load_mixture
    from dynapipe.method_compare import simulate_method
    from dynapipe.pipeline_planner import schedule_batch_plan

    model, device = load_model_config("gpt-13b"), load_device_config("a100-40gb")
    cluster = load_cluster_config("a100-8x")
    cm = build_cost_model(model, device, 4, tp=TensorParallelConfig(2, True, cluster.intra_node))
    batch = sample_batches(1 << 20, 1, 0, 4096, mixture=load_mixture(DEFAULT_MIXTURE))[0]
    kw = dict(dp=2, zero=True, cluster=cluster, tp=2, seq_length=4096)
    planned = plan_iteration(batch, cm, **kw)
    share = planned.batch_plan.extra["micro_batch_share"]
    assert share < 1.0
    # The cut that fits each micro-batch alone, searched the same way, is slower.
    alone = plan_micro_batches(batch, cm, dp=2, zero=True, seq_length=4096, recompute="selective",
                               memory_limit_mib=device.memory_mib, reserved_mib=device.reserved_mib)
    alone_it = schedule_batch_plan(alone, cm, cluster=cluster, tp=2, zero=True, lengths=batch)
    assert "full" in alone_it.stage_recompute
    assert planned.simulated_ms < 0.95 * alone_it.simulated_ms
    assert planned.timings_ms["batching"] > alone.planning_ms  # the tries are counted
    packing = simulate_method(batch, "packing", cm, micro_batch_size=1, **kw)
    assert planned.simulated_ms < packing.iteration_ms
    # With memory to spare nothing is tried: the cut fits alone and in flight.
    roomy = plan_iteration(batch, cm, memory_limit_mib=1e6, **kw)
    assert roomy.batch_plan.extra["micro_batch_share"] == 1.0


def test_room_in_flight_is_tried_on_a_fall_back_or_a_long_fill_and_drain_once_a_distinct_cut(monkeypatch):
    import dynapipe.pipeline_planner as pp

    cm = build_cost_model(load_model_config("gpt-7b"), load_device_config("a100-40gb"), 4)
    cut = dict(method="dynapipe", dp=1, memory_limit_mib=40_960, reserved_mib=2048)
    search = dict(schedule="auto", memory_limit_mib=40_960, reserved_mib=2048, cluster=None, tp=1, zero=False)
    shares, bars = [], []  # the shares each try cuts with; the makespans each search must beat
    cut_with, search_with = pp.plan_micro_batches, pp._search
    monkeypatch.setattr(pp, "plan_micro_batches",
                        lambda *a, **k: shares.append(k.get("micro_batch_share")) or cut_with(*a, **k))
    monkeypatch.setattr(pp, "_search", lambda *a, **k: bars.append(k.get("must_beat_ms")) or search_with(*a, **k))

    def tried(lengths, stage_recompute, **extra):
        planned = cut_with(lengths, cm, recompute="selective", **{**cut, **extra})
        shares.clear(), bars.clear()
        # 1 microsecond is unbeatable: whatever runs, nothing is returned.
        assert pp.leave_room_in_flight(lengths, cm, planned=planned, level="selective", simulated_ms=1e-3,
                                       stage_recompute=stage_recompute, cut={**cut, **extra}, search=search) is None
        return sorted(shares)

    # 200 samples cut into 30 micro-batches (43 and 81 at shares 1/2 and 1/4): fill and drain
    # are 3/33 of the pipeline, so only a fall-back to full recompute is worth the tries.
    many = np.array([1000, 500, 300, 200, 100] * 40)
    assert tried(many, ["selective"] * 4) == []
    assert tried(many, ["full"] + ["selective"] * 3) == [0.25, 0.5] and bars == [1e-3, 1e-3]
    assert tried(many, ["full"] + ["selective"] * 3, method="packing") == []
    # 60 samples cut into 14 (3/17 fill and drain): tried without a fall-back; share 1/2 cuts
    # the same 14 micro-batches, so only 1/4's 24 are searched.
    few = np.array([1000, 500, 300, 200, 100] * 12)
    assert tried(few, ["selective"] * 4) == [0.25, 0.5] and len(bars) == 1


def test_a_cut_that_holds_fewer_micro_batches_in_flight_wins_where_the_pipeline_runs_short_of_memory():
    # gpt-13b PP8 x DP2 with the distributed optimizer on a100-40gb (the cluster bench's case): cut
    # to fit alone (priced without recompute), the search had to recompute selectively and ran
    # fewer, larger micro-batches with more bubble; cut to an eighth of the budget it runs faster.
    from dynapipe.config import load_cluster_config
    from dynapipe.method_compare import global_batch_of_tokens
    from dynapipe.pipeline_planner import schedule_batch_plan

    model, device = load_model_config("gpt-13b"), load_device_config("a100-40gb")
    cluster = load_cluster_config("a100-8x")
    cm = build_cost_model(model, device, 8)
    batch = global_batch_of_tokens(65536, 0, 4096)
    planned = plan_iteration(batch, cm, dp=2, zero=True, cluster=cluster, seq_length=4096)
    assert planned.batch_plan.extra["micro_batch_share"] == 0.125
    alone = plan_micro_batches(batch, cm, dp=2, zero=True, seq_length=4096, recompute="none",
                               memory_limit_mib=device.memory_mib, reserved_mib=device.reserved_mib)
    alone_it = schedule_batch_plan(alone, cm, cluster=cluster, zero=True, lengths=batch)
    assert "full" not in alone_it.stage_recompute  # no fall-back to full recompute: the old trigger missed it
    assert len(planned.batch_plan.micro_batches) > len(alone.micro_batches)
    assert planned.simulated_ms < 0.97 * alone_it.simulated_ms


def test_a_search_that_must_beat_a_makespan_refuses_cheaply_or_finds_the_same_best(monkeypatch):
    from dynapipe.schedule.search import search_schedules

    cm = build_cost_model(load_model_config("gpt-7b"), load_device_config("a100-40gb"), 4)
    bp = plan_micro_batches(np.array([1000, 500, 300, 200, 100] * 40), cm, recompute="selective",
                            memory_limit_mib=40_960, reserved_mib=2048)
    kw = dict(capacity_mib=40_960 - 2048)
    free = search_schedules([bp.micro_batches], cm, **kw)
    bound = search_schedules([bp.micro_batches], cm, must_beat_ms=free.makespan_ms * 1.01, **kw)
    assert bound.makespan_ms == free.makespan_ms and bound.best.schedule == free.best.schedule
    # Cheaply: every candidate's simulation runs under the bar and stops once it falls behind.
    import dynapipe.schedule.search as search_module

    seen, run = [], search_module._run

    def recording(name, times, capacity, abort_ms, abort_mib, max_delay=None):
        out = run(name, times, capacity, abort_ms, abort_mib, max_delay)
        seen.append((abort_ms, out[0]))
        return out

    monkeypatch.setattr(search_module, "_run", recording)
    with pytest.raises(DynaPipeError, match=r"runs faster than .* ms"):
        search_schedules([bp.micro_batches], cm, must_beat_ms=free.makespan_ms, **kw)
    from dynapipe.schedule import _kernels as K

    assert seen and all(abort <= free.makespan_ms for abort, _ in seen)
    assert any(status == K.SLOW for _, status in seen)


@pytest.mark.parametrize("lengths, kwargs, needle", [
    ([1, None, 3], {}, "sample 1: length None is not an integer"),
    ([10, 20], {"reserved_mib": float("nan")}, "reserved memory nan MiB must be a finite number, 0 or more"),
    ([10, 20], {"reserved_mib": -1}, "reserved memory -1 MiB must be a finite number, 0 or more"),
    ([10, 20], {"memory_limit_mib": "lots"}, "memory_limit_mib='lots': the memory limit \(MiB\) must be a positive number"),
])
def test_bad_planner_inputs_are_one_line_errors_naming_the_value(tiny_cost, lengths, kwargs, needle):
    with pytest.raises(DynaPipeError, match=needle):
        plan_micro_batches(lengths, tiny_cost, **kwargs)


def test_ragged_encoder_decoder_lengths_are_refused_in_one_line():
    cm = build_cost_model(load_model_config("t5-11b"), load_device_config("a100-40gb"), 8)
    with pytest.raises(DynaPipeError, match=r"not one row per sample of equal size .* \(n, 2\)"):
        plan_iteration([[1, 2], [3]], cm)


@pytest.mark.parametrize("kwargs, needle", [({"tp": 0}, r"^tp 0: the tensor-parallel size"),
                                            ({"replicas": ["a"]}, r"^replicas \['a'\]: give data-parallel replica")])
def test_bad_tensor_parallel_size_or_replicas_are_refused(tiny_cost, kwargs, needle):
    with pytest.raises(DynaPipeError, match=needle):
        plan_iteration([10, 20, 30], tiny_cost, **kwargs)


def test_a_long_timeline_title_is_wrapped_to_the_picture(tmp_path, monkeypatch):
    # A per-stage recompute list made the title run off the picture's right edge, taking the
    # makespan and bubble with it.
    import matplotlib.pyplot as plt

    import dynapipe.cli.trace as trace_cli
    from dynapipe.schedule.trace import plot_timeline

    drawn, figures = [], []

    def draw(tl, mbs, path, **kw):
        drawn.append((tl, mbs))
        open(path, "wb").close()

    monkeypatch.setattr(trace_cli, "plot_timeline", draw)
    assert main(["trace", "--samples", "24", "--model", "gpt-tiny", "--device", "cpu", "--stages", "2",
                 "--seq-length", "256", "--out", str(tmp_path / "t.json"), "--png", str(tmp_path / "t.png")]) == 0
    title = "recompute " + "selective/" * 30 + "none by stage: 5697.7 ms, bubble 17.7%"
    monkeypatch.setattr(plt, "close", figures.append)
    plot_timeline(*drawn[0], str(tmp_path / "long.png"), title=title)
    shown = figures[0].axes[0].get_title()
    assert max(len(line) for line in shown.splitlines()) <= 140 and "".join(shown.split()) == "".join(title.split())
