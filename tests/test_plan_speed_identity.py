"""The faster compile and encode paths give byte-identical plans: the body encoder against
the per-list reference (``encode_reference.py``), compiling from the simulation's op
arrays against compiling from the schedule's ops, and malformed op arrays fall back to
the ops (which name what is wrong)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from dynapipe.config import load_device_config, load_model_config
from dynapipe.cost import build_cost_model
from dynapipe.data.synthetic import sample_lengths
from dynapipe.pipeline_planner import plan_iteration
from dynapipe.plan import binary, compile_plans, deserialize_plan, serialize_plan
from dynapipe.plan.instructions import TensorSpec
from dynapipe.plan.rank_table import op_positions, positions_from_arrays
from dynapipe.schedule.simulator import schedule_arrays
from encode_reference import reference_encode_body


@pytest.fixture(scope="module")
def iterations():
    a100, h200 = load_device_config("a100-40gb"), load_device_config("h200")
    gpt = build_cost_model(load_model_config("gpt-7b"), a100, 4)
    t5 = build_cost_model(load_model_config("t5-11b"), h200, 8)
    rng = np.random.default_rng(3)
    t5_lengths = np.stack([rng.integers(8, 512, 200), rng.integers(4, 128, 200)], 1)
    return [(gpt.model, plan_iteration(sample_lengths(900, 1, 2048), gpt, dp=3, seq_length=2048)),
            (gpt.model, plan_iteration(sample_lengths(400, 2, 2048), gpt, dp=2, seq_length=2048, method="packing")),
            (t5.model, plan_iteration(t5_lengths, t5, dp=2))]


def test_encoded_bodies_match_the_reference_encoder(iterations):
    for _, it in iterations:
        assert set(it.cpu_ms) == {"batching", "schedule", "compile"} and min(it.cpu_ms.values()) >= 0
        for p in it.all_plans():
            assert binary.encode_body(p) == reference_encode_body(p)
            # Decoded plans carry new tensor-list objects: encoded again, the same bytes.
            back = deserialize_plan(serialize_plan(p))
            assert binary.encode_body(back) == reference_encode_body(back)


def test_encoder_refuses_what_the_reference_refuses(iterations):
    p = iterations[0][1].plans[0][1]
    table = p.instructions

    def with_lists(first_two):
        return dataclasses.replace(p, instructions=type(table)(table.rows, table.strings,
                                                               first_two + table.tensor_lists[2:]))

    fresh = (TensorSpec("extra", (3, 4), "float32"),)
    bad = with_lists((fresh, (TensorSpec("hidden", (1, 2), "float64"),)))
    with pytest.raises(Exception) as ref:
        reference_encode_body(bad)
    with pytest.raises(type(ref.value), match="float64"):
        binary.encode_body(bad)
    # The refused plan registered nothing half-way: its good new list encodes right later.
    good = with_lists((fresh, table.tensor_lists[1]))
    assert binary.encode_body(good) == reference_encode_body(good)
    assert binary.encode_body(p) == reference_encode_body(p)


def test_compiling_from_op_arrays_equals_compiling_from_ops(iterations):
    for model, it in iterations:
        res = it.search
        for r in range(len(res.schedules)):
            tl = res.timelines[r]
            assert tl.op_arrays is not None
            kw = dict(timeline=tl, replica=r, num_replicas=len(res.schedules),
                      global_loss_tokens=it.plans[0][0].global_loss_tokens)
            fast = compile_plans(res.schedules[r], res.micro_batches[r], model, **kw)
            kw["timeline"] = dataclasses.replace(tl, op_arrays=None)
            slow = compile_plans(res.schedules[r], res.micro_batches[r], model, **kw)
            assert [serialize_plan(p) for p in fast] == [serialize_plan(p) for p in slow] == \
                [serialize_plan(p) for p in it.plans[r]]


def test_malformed_op_arrays_are_not_trusted(iterations):
    search = iterations[0][1].search
    sched, M = search.schedules[0], len(search.micro_batches[0])
    kind, mb, nops = schedule_arrays(sched, M)
    f, b = positions_from_arrays(kind, mb, nops, M)
    for s in range(sched.num_stages):
        ref = op_positions(sched.name, s, sched.stage_ops[s], M)
        assert np.array_equal(f[s], ref[0]) and np.array_equal(b[s], ref[1])
    swapped = kind.copy()
    first_b = int(np.argmax(swapped[1] == 1))
    swapped[1, [0, first_b]] = swapped[1, [first_b, 0]]           # a backward before its forward
    twice = mb.copy()
    twice[2, 0] = twice[2, 1]                                      # a micro-batch run twice
    assert positions_from_arrays(swapped, mb, nops, M) is None
    assert positions_from_arrays(kind, twice, nops, M) is None
    assert positions_from_arrays(kind, mb, nops - 1, M) is None
    assert positions_from_arrays(kind + 2, mb, nops, M) is None
