"""The vectorised plan compiler gives exactly the instructions of the original one."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from dynapipe.config import load_device_config, load_model_config
from dynapipe.cost import build_cost_model
from dynapipe.errors import DynaPipeError
from dynapipe.pipeline_planner import plan_iteration
from dynapipe.plan import compile_plans, deserialize_plan, serialize_plan, validate_plans
from dynapipe.plan.table import InstructionTable
from dynapipe.schedule import adaptive_schedule, one_f_one_b, simulate
from dynapipe.schedule.costs import StageTimes
from dynapipe.schedule.types import Op, Schedule
from plan_helpers import chunked_micro_batches
from plan_reference import reference_instructions

TINY, T5 = load_model_config("gpt-tiny"), load_model_config("t5-11b")
A100 = load_device_config("a100-40gb")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(S=st.integers(1, 6), n=st.integers(1, 40), size=st.integers(1, 4), seed=st.integers(0, 2**16),
       uniform=st.booleans(), adaptive=st.booleans(), t5=st.booleans())
def test_random_batches_compile_to_the_reference_instructions(S, n, size, seed, uniform, adaptive, t5):
    rng = np.random.default_rng(seed)
    model = T5 if t5 or S > 4 else TINY
    dec = rng.integers(1, 64, n) if model is T5 else None
    mbs = chunked_micro_batches(rng.integers(1, 200, n), size, dec_lengths=dec, shuffle_seed=seed)
    M = len(mbs)
    fw = np.ones((S, M)) if uniform else rng.uniform(0.1, 3.0, (S, M))
    c = np.full((S - 1, M), 0.0 if uniform else 0.3)
    times = StageTimes(fw, 2 * fw, fw, fw, c, c.copy(), np.zeros(S))
    if adaptive:
        sched, tl = adaptive_schedule(times, capacity_mib=np.full(S, 3 * fw.max()))
    else:
        sched = one_f_one_b(S, M)
        tl = simulate(sched, times)
    plans = compile_plans(sched, mbs, model, timeline=tl)
    ref = reference_instructions(sched, tl, plans[0].micro_batches, model, [p.recompute for p in plans])
    for p, r in zip(plans, ref):
        assert isinstance(p.instructions, InstructionTable)
        assert tuple(p.instructions) == r
    validate_plans(plans)
    assert [deserialize_plan(serialize_plan(p)) for p in plans] == plans


def test_planned_iteration_matches_reference_and_splits_by_replica():
    cm = build_cost_model(load_model_config("gpt-7b"), A100, 4)
    lengths = np.random.default_rng(5).integers(16, 2048, 600)
    it = plan_iteration(lengths, cm, dp=4, seq_length=2048)
    for r in range(4):
        ref = reference_instructions(it.search.schedules[r], it.search.timelines[r], it.plans[r][0].micro_batches,
                                     cm.model, [p.recompute for p in it.plans[r]])
        assert [tuple(p.instructions) for p in it.plans[r]] == ref
    # Compiling a subset of the replicas gives byte-identical plans for them.
    part = plan_iteration(lengths, cm, dp=4, seq_length=2048, replicas=[1, 3])
    assert [len(row) for row in part.plans] == [0, 4, 0, 4]
    assert [serialize_plan(p) for p in part.all_plans()] == [
        serialize_plan(p) for r in (1, 3) for p in it.plans[r]]
    validate_plans(part.all_plans(), complete=False)
    with pytest.raises(DynaPipeError, match="outside the 4 data-parallel replicas"):
        plan_iteration(lengths, cm, dp=4, seq_length=2048, replicas=[4])


def test_malformed_schedules_are_refused():
    mbs = chunked_micro_batches([5, 9, 30, 31], 2)
    twice = Schedule("bad", 2, ((Op("F", 0), Op("F", 0), Op("B", 0), Op("B", 1)),
                                (Op("F", 0), Op("B", 0), Op("F", 1), Op("B", 1))))
    backwards_first = Schedule("bad", 1, ((Op("B", 0), Op("F", 0), Op("F", 1), Op("B", 1)),))
    for sched in (twice, backwards_first):
        with pytest.raises(DynaPipeError, match="schedule 'bad'"):
            compile_plans(sched, mbs, TINY, timeline=None)


def _verdict(plans):
    try:
        return validate_plans(plans)
    except DynaPipeError as e:
        return str(e)


@pytest.mark.parametrize("S, dp, seed", [(2, 1, 0), (3, 2, 1), (4, 1, 2)])
def test_fast_validation_never_accepts_what_the_full_validator_refuses(S, dp, seed):
    import dataclasses

    from dynapipe.plan.table import COL, NCOLS
    from dynapipe.plan.validate_fast import group_is_valid

    rng = np.random.default_rng(seed)
    model = TINY
    mbs = chunked_micro_batches(rng.integers(1, 200, 8 * dp), 2)
    total = int(sum(m.real_tokens for m in mbs))
    grid = [compile_plans("1f1b" if r % 2 else "adaptive", mbs[r::dp], model, num_stages=S, replica=r,
                          num_replicas=dp, global_loss_tokens=total) for r in range(dp)]
    assert all(group_is_valid(row) for row in grid)     # the compiler's plans take the fast path
    flat = [p for row in grid for p in row]
    refused = 0
    for trial in range(150):
        r, s = int(rng.integers(dp)), int(rng.integers(S))
        plan = grid[r][s]
        rows = plan.instructions.rows.copy()
        n = len(rows)
        what = trial % 6
        if what == 0:                                   # swap two instructions
            i, j = rng.integers(n, size=2)
            rows[[i, j]] = rows[[j, i]]
        elif what == 1:                                 # drop one
            rows = np.delete(rows, int(rng.integers(n)), axis=0)
        elif what == 2:                                 # duplicate one
            i = int(rng.integers(n))
            rows = np.insert(rows, i, rows[i], axis=0)
        elif what == 3:                                 # another micro-batch
            i = int(rng.integers(n))
            rows[i, COL["mb"]] = (rows[i, COL["mb"]] + 1) % len(plan.micro_batches)
        elif what == 4:                                 # another peer or group
            i = int(rng.integers(n))
            col = COL["peer"] if rng.random() < 0.5 else COL["group"]
            rows[i, col] = int(rng.integers(-1, S))
        else:                                           # another tensor list or shape
            i = int(rng.integers(n))
            col = COL["tensors"] if rng.random() < 0.5 else COL["seqlen"]
            top = len(plan.instructions.tensor_lists) if col == COL["tensors"] else 400
            rows[i, col] = int(rng.integers(top))
        assert rows.shape[1] == NCOLS
        table = InstructionTable(rows, plan.instructions.strings, plan.instructions.tensor_lists)
        mutated = [dataclasses.replace(p, instructions=table) if p is plan else p for p in flat]
        as_objects = [dataclasses.replace(p, instructions=tuple(p.instructions)) for p in mutated]
        fast, full = _verdict(mutated), _verdict(as_objects)
        assert fast == full, (trial, what, fast, full)
        refused += isinstance(full, str)
    assert refused > 100   # the mutations do break plans, so both paths were exercised


@pytest.mark.parametrize("model", [TINY, T5], ids=["gpt", "t5"])
def test_a_load_of_another_token_length_is_refused_by_both_validators(model):
    import dataclasses

    from dynapipe.plan.instructions import TensorSpec
    from dynapipe.plan.validate_fast import group_is_valid

    mbs = chunked_micro_batches([40, 31, 12, 25], 2, dec_lengths=[9, 7, 5, 3] if model is T5 else None)
    plans = compile_plans("1f1b", mbs, model, num_stages=2, global_loss_tokens=int(sum(m.real_tokens for m in mbs)))
    assert group_is_valid(plans) and not isinstance(_verdict(plans), str)
    table = plans[0].instructions
    # Every load list of stage 0 with its first tensor's tokens 5 longer than its micro-batch's,
    # or given a third dimension: the executor's loader makes neither.
    for change in (lambda shape: (shape[0], shape[1] + 5), lambda shape: shape + (1,)):
        lists = [tuple([TensorSpec(ts[0].name, change(ts[0].shape), ts[0].dtype), *ts[1:]])
                 if ts and ts[0].name == "tokens" else ts for ts in table.tensor_lists]
        bad = [dataclasses.replace(plans[0], instructions=InstructionTable(table.rows, table.strings, tuple(lists)))]
        bad += plans[1:]
        assert not group_is_valid(bad)
        message = _verdict([dataclasses.replace(p, instructions=tuple(p.instructions)) for p in bad])
        assert "input tensor tokens" in message and "does not match micro-batch" in message, message
