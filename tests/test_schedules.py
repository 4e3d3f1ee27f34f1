"""Schedule search: candidates, memory, the fastest that fits, and clear failures."""
import math

import numpy as np

import pytest

from dynapipe.batching import plan_micro_batches
from dynapipe.batching.types import MicroBatch
from dynapipe.config import load_cluster_config, load_device_config, load_model_config
from dynapipe.cost import build_cost_model
from dynapipe.data.synthetic import sample_lengths
from dynapipe.errors import DynaPipeError
from dynapipe.schedule import ORDERS, search_schedules, simulate
from dynapipe.schedule.orders import clustered


@pytest.fixture(scope="module")
def gpt7b():
    model = load_model_config("gpt-7b")
    device = load_device_config("a100-40gb")
    return model, device, load_cluster_config("a100-8x")


def planned(model, device, S, seed, n=256, dp=1):
    cm = build_cost_model(model, device, S)
    bp = plan_micro_batches(sample_lengths(n, seed, 1024), cm, dp=dp, memory_limit_mib=device.memory_mib,
                            reserved_mib=device.reserved_mib)
    return cm, bp


@pytest.mark.parametrize("S,seed", [(4, 0), (4, 1), (8, 2), (8, 3)])
def test_auto_is_never_slower_than_1f1b_and_fits(gpt7b, S, seed):
    model, device, cluster = gpt7b
    cm, bp = planned(model, device, S, seed)
    cap = device.memory_mib - device.reserved_mib
    reps = [bp.replica(0)]
    base = search_schedules(reps, cm, schedule="1f1b", capacity_mib=cap, cluster=cluster)
    auto = search_schedules(reps, cm, schedule="auto", capacity_mib=cap, cluster=cluster)
    assert auto.makespan_ms <= base.makespan_ms + 1e-9
    assert max(auto.stage_peak_mib) <= cap
    # The reported figures are those of the chosen schedule re-simulated from scratch.
    again = simulate(auto.schedules[0], auto.times[0])
    assert again.makespan_ms == pytest.approx(auto.makespan_ms)
    assert again.peak_mib == pytest.approx(auto.stage_peak_mib)
    # Micro-batches are handed back in the order the schedule indexes them.
    assert sorted(id(m) for m in auto.micro_batches[0]) == sorted(id(m) for m in reps[0])
    assert [reps[0][i] for i in auto.schedules[0].mb_order] == auto.micro_batches[0]


def test_explain_simulates_every_candidate_exactly(gpt7b):
    model, device, cluster = gpt7b
    cm, bp = planned(model, device, 4, 5, n=64)
    res = search_schedules([bp.replica(0)], cm, capacity_mib=device.memory_mib - device.reserved_mib,
                           cluster=cluster, explain=True)
    uniform = [c for c in res.candidates if c.recompute != "per-stage"]
    mixed = [c for c in res.candidates if c.recompute == "per-stage"]
    assert len(uniform) == 3 * len(ORDERS) * 3  # 1f1b, adaptive, zb-h1 x orders x levels
    assert all(len(set(c.stage_recompute)) > 1 for c in mixed)
    assert all(c.status in ("fits", "over-memory") for c in res.candidates)
    fitting = [c for c in res.candidates if c.fits]
    assert res.best.makespan_ms == min(c.makespan_ms for c in fitting)
    # Exact figures for every candidate, the ones over memory included: what the same schedule,
    # order and level give simulated alone without a memory cap.
    stages = cm.num_stages
    assert all(math.isfinite(c.makespan_ms) and len(c.peak_mib) == stages for c in res.candidates)
    # (zb-h1's figures depend on the capacity: its weight delays are capped until it fits.)
    over = [c for c in uniform if c.status == "over-memory" and c.schedule != "zb-h1"]
    assert len(over) >= 2, "this batch should leave candidates of 1f1b or adaptive over memory"
    for c in (over[0], over[-1]):
        alone = search_schedules([bp.replica(0)], cm, schedule=c.schedule, orders=[c.order], recompute=c.recompute,
                                 cluster=cluster, per_stage=False)
        assert alone.best.makespan_ms == pytest.approx(c.makespan_ms)
        assert alone.best.peak_mib == pytest.approx(c.peak_mib)
    fast = search_schedules([bp.replica(0)], cm, capacity_mib=device.memory_mib - device.reserved_mib,
                            cluster=cluster)
    assert fast.best == res.best


def test_more_recompute_lowers_memory_and_fixes_1f1b(gpt7b):
    model, device, cluster = gpt7b
    cm, bp = planned(model, device, 8, 0)
    none = search_schedules([bp.replica(0)], cm, schedule="1f1b", recompute="none", cluster=cluster)
    full = search_schedules([bp.replica(0)], cm, schedule="1f1b", recompute="full", cluster=cluster)
    assert max(full.stage_peak_mib) < max(none.stage_peak_mib)
    assert full.makespan_ms > none.makespan_ms
    cap = (max(full.stage_peak_mib) + max(none.stage_peak_mib)) / 2
    chosen = search_schedules([bp.replica(0)], cm, schedule="1f1b", capacity_mib=cap, cluster=cluster)
    assert chosen.best.recompute != "none"


def test_nothing_fits_names_the_closest_candidate_and_the_excess(gpt7b):
    model, device, cluster = gpt7b
    cm, bp = planned(model, device, 4, 0, n=32)
    with pytest.raises(DynaPipeError, match=r"no schedule fits in 30000 MiB .* MiB over the limit") as e:
        search_schedules([bp.replica(0)], cm, capacity_mib=30000, cluster=cluster)
    # Model states alone take more than 30000 MiB on stage 0: the closest candidate is
    # the one with the least memory, which is full recompute.
    assert "recompute full" in str(e.value)


def test_replicas_share_one_candidate(gpt7b):
    model, device, cluster = gpt7b
    cm, bp = planned(model, device, 4, 3, dp=2)
    res = search_schedules([bp.replica(0), bp.replica(1)], cm,
                           capacity_mib=device.memory_mib - device.reserved_mib, cluster=cluster)
    assert len(res.schedules) == 2
    assert res.makespan_ms == pytest.approx(max(t.makespan_ms for t in res.timelines))
    assert {s.name for s in res.schedules} == {res.best.schedule}


def test_orders_are_permutations_with_light_ends():
    w = np.array([5.0, 1.0, 3.0, 4.0, 2.0, 6.0])
    for fn in ORDERS.values():
        assert sorted(fn(w)) == list(range(6))
    assert [w[i] for i in clustered(w)] == [1.0, 3.0, 5.0, 6.0, 4.0, 2.0]


def test_unknown_schedule_and_empty_batch_are_clear_errors(gpt7b):
    model, device, cluster = gpt7b
    cm = build_cost_model(model, device, 4)
    with pytest.raises(DynaPipeError, match="schedule='gpipe' is not known"):
        search_schedules([[MicroBatch([0], 64)]], cm, schedule="gpipe")
    with pytest.raises(DynaPipeError, match="no micro-batches"):
        search_schedules([[]], cm)


def test_per_stage_recompute_recomputes_only_where_memory_needs_it(gpt7b):
    # 1F1B keeps S - s micro-batches in flight on stage s: early stages need more
    # recompute than late ones, and a stage's memory depends only on its own costs.
    model, device, cluster = gpt7b
    cm, bp = planned(model, device, 4, 0, n=512)
    cap = device.memory_mib - device.reserved_mib
    reps = [bp.replica(0)]
    res = search_schedules(reps, cm, schedule="auto", orders=["planned"], capacity_mib=cap, cluster=cluster,
                           explain=True)
    mixed = [c for c in res.candidates if c.recompute == "per-stage" and c.schedule == "1f1b"]
    assert len(mixed) == 1
    levels = mixed[0].stage_recompute
    order = ["none", "selective", "full"]
    assert [order.index(x) for x in levels] == sorted((order.index(x) for x in levels), reverse=True)
    assert mixed[0].fits
    by_level = {c.recompute: c for c in res.candidates if c.schedule == "1f1b"}
    for s, lv in enumerate(levels):
        # Stage s fits at its level; one level lighter it would not.
        assert by_level[lv].peak_mib[s] <= cap
        if lv != "none":
            assert by_level[order[order.index(lv) - 1]].peak_mib[s] > cap
    heaviest = by_level[levels[0]]
    assert mixed[0].makespan_ms < heaviest.makespan_ms
    plain = search_schedules(reps, cm, schedule="1f1b", capacity_mib=cap, cluster=cluster)
    assert all(c.recompute != "per-stage" for c in plain.candidates)
