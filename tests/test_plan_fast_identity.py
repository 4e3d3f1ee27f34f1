"""Whole planning (batching, schedule search, compile, serialize) gives byte-identical plans
with the numpy balancing and simulator helpers as with the original op-by-op ones
(kept in ``balance_reference.py`` / ``schedule_reference.py``), and the same timelines."""
from __future__ import annotations

import numpy as np
import pytest

import balance_reference
import schedule_reference
from dynapipe.batching import planner as batching_planner
from dynapipe.config import load_cluster_config, load_device_config, load_model_config
from dynapipe.cost import build_cost_model
from dynapipe.data.synthetic import sample_lengths
from dynapipe.pipeline_planner import plan_iteration
from dynapipe.plan import serialize_plan
from dynapipe.schedule import search, simulator


def _plan(lengths, cm, dp, memory_limit_mib, schedule, cluster):
    it = plan_iteration(lengths, cm, stages=cm.num_stages, dp=dp, seq_length=2048, schedule=schedule,
                        memory_limit_mib=memory_limit_mib, cluster=cluster)
    return it, [serialize_plan(p) for p in it.all_plans()]


CASES = [  # (model, stages, dp, samples, seed, memory limit MiB or None, schedule, cluster)
    ("gpt-7b", 4, 8, 1500, 0, None, "auto", "a100-8x"),
    ("gpt-7b", 8, 16, 3000, 1, None, "auto", None),
    ("gpt-7b", 8, 3, 700, 2, 22_100, "auto", None),
    ("gpt-7b", 4, 5, 400, 3, None, "adaptive", None),
    ("gpt-7b", 4, 2, 500, 4, None, "1f1b", None),
]


@pytest.fixture(scope="module")
def cost_models():
    dev = load_device_config("a100-40gb")
    model = load_model_config("gpt-7b")
    return {s: build_cost_model(model, dev, s) for s in {c[1] for c in CASES}}


@pytest.mark.parametrize("case", CASES)
def test_plans_are_byte_identical_to_the_reference_path(case, cost_models, monkeypatch):
    _, stages, dp, n, seed, limit, schedule, cluster_name = case
    cm = cost_models[stages]
    cluster = load_cluster_config(cluster_name) if cluster_name else None
    lengths = sample_lengths(n, seed, 2048)
    fast, fast_blobs = _plan(lengths, cm, dp, limit, schedule, cluster)
    with monkeypatch.context() as m:
        m.setattr(batching_planner, "balance_replicas", balance_reference.balance_replicas)
        m.setattr(simulator, "memory_steps",
                  lambda sched, t, st, en, arrays=None: schedule_reference.memory_steps(sched, t, st, en))
        # The reference re-simulates the chosen schedule from its ops, not from the run's arrays.
        m.setattr(search, "simulate", lambda sched, t, record_memory=True, arrays=None:
                  simulator.simulate(sched, t, record_memory=record_memory))
        m.setattr(simulator, "schedule_arrays", schedule_reference.schedule_arrays)
        m.setattr(search, "stage_times_per_replica", schedule_reference.stage_times_per_replica)
        ref, ref_blobs = _plan(lengths, cm, dp, limit, schedule, cluster)
    assert [mb.samples for mb in fast.batch_plan.micro_batches] == [mb.samples for mb in ref.batch_plan.micro_batches]
    assert [mb.replica for mb in fast.batch_plan.micro_batches] == [mb.replica for mb in ref.batch_plan.micro_batches]
    assert fast.search.best == ref.search.best
    assert len(fast_blobs) == stages * dp and fast_blobs == ref_blobs
    for a, b in zip(fast.search.timelines, ref.search.timelines):
        assert a.starts == b.starts and a.ends == b.ends and a.memory == b.memory


@pytest.mark.parametrize("bad_op", [("F", 9, 0), ("X", 1, 0), ("B", 1, 1), ("F", -1, 0)])
def test_schedule_arrays_matches_the_reference_and_refuses_the_same_ops(bad_op):
    from dynapipe.errors import DynaPipeError
    from dynapipe.schedule.one_f_one_b import one_f_one_b
    from dynapipe.schedule.types import Op, Schedule
    good = one_f_one_b(3, 4)
    for a, b in zip(simulator.schedule_arrays(good, 4), schedule_reference.schedule_arrays(good, 4)):
        np.testing.assert_array_equal(a, b)
    ops = [list(o) for o in good.stage_ops]
    ops[1][2] = Op(*bad_op)
    bad = Schedule(good.name, 3, tuple(tuple(o) for o in ops))
    msgs = []
    for f in (simulator.schedule_arrays, schedule_reference.schedule_arrays):
        with pytest.raises(DynaPipeError) as e:
            f(bad, 4)
        msgs.append(str(e.value))
    assert msgs[0] == msgs[1] and str(Op(*bad_op)) in msgs[0]
