"""The DP micro-batcher: exact against brute force, same results from C and numpy, memory held."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynapipe.batching import plan_micro_batches
from dynapipe.batching.candidates import CandidateTable, build_candidate_table
from dynapipe.batching.dp_partition import DEFAULT_GAP, compiled_kernel_available, optimal_partition, solve_capped
from dynapipe.batching.memory import memory_budget
from dynapipe.errors import DynaPipeError
from dynapipe.batching.ordering import candidate_orders, padded_length
from dynapipe.config import load_device_config, load_model_config
from dynapipe.cost import build_cost_model
from dynapipe.cost.base import CostModel, StageCost

A100 = load_device_config("a100-40gb")
GPT7B = load_model_config("gpt-7b")
T5 = load_model_config("t5-11b")
COST = {s: build_cost_model(GPT7B, A100, s) for s in (1, 2, 4, 8)}
T5_COST = build_cost_model(T5, A100, 8)
HYP = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
needs_c = pytest.mark.skipif(not compiled_kernel_available(), reason="C kernel not built (pip install -e .)")


def brute_force(ordered, cost_model, budget_mib, dp, cap):
    """Minimum of sum/dp + (S-1) max over every cut of ``ordered`` into consecutive groups."""
    n = len(ordered)
    enc = padded_length(ordered if ordered.ndim == 1 else ordered[:, 0], cap)
    dec = None if ordered.ndim == 1 else padded_length(ordered[:, 1], cap)
    pairs = [(i, j) for i in range(n) for j in range(i + 1, n + 1)]
    c = cost_model.stage_cost([j - i for i, j in pairs], [enc[i:j].max() for i, j in pairs],
                              None if dec is None else [dec[i:j].max() for i, j in pairs])
    price = {p: (float(c.time_ms[k]), float(c.stored_mib[k] + c.peak_mib[k])) for k, p in enumerate(pairs)}
    best = np.inf
    for mask in range(1 << (n - 1)):
        bounds = [0] + [b + 1 for b in range(n - 1) if mask >> b & 1] + [n]
        segs = [price[(a, b)] for a, b in zip(bounds, bounds[1:])]
        if any(m > budget_mib for _, m in segs):
            continue
        times = [t for t, _ in segs]
        best = min(best, sum(times) / dp + (cost_model.num_stages - 1) * max(times))
    return best


def limit_for(cost_model, lengths, factor):
    """A memory limit whose activation budget is ``factor`` x the longest sample's need."""
    longest = padded_length(np.array([lengths.max()]))[0]
    c = cost_model.stage_cost(1, longest)
    need = float(c.stored_mib + c.peak_mib)
    return A100.reserved_mib + cost_model.model_state_mib() + factor * need


@HYP
@given(lengths=st.lists(st.integers(1, 2048), min_size=1, max_size=10),
       stages=st.sampled_from([1, 2, 4, 8]), dp=st.integers(1, 4),
       factor=st.sampled_from([1.0, 1.5, 3.0, 1e9]))
def test_dp_equals_brute_force(lengths, stages, dp, factor):
    dp = min(dp, len(lengths))  # the planner refuses more replicas than samples
    lengths = np.array(lengths)
    cm = COST[stages]
    limit = limit_for(cm, lengths, factor)
    plan = plan_micro_batches(lengths, cm, dp=dp, memory_limit_mib=limit, reserved_mib=A100.reserved_mib, gap=0.0,
                              split_to_balance=False)
    budget = limit - A100.reserved_mib - cm.model_state_mib()
    expect = brute_force(np.sort(lengths), cm, budget, dp, GPT7B.max_seq_length)
    assert plan.objective_ms == pytest.approx(expect, rel=1e-9)
    assert sorted(i for mb in plan.micro_batches for i in mb.samples) == list(range(len(lengths)))
    assert all(mb.stored_mib + mb.peak_mib <= budget for mb in plan.micro_batches)


@pytest.mark.parametrize("seed", range(4))
def test_dp_equals_brute_force_twelve_samples(seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 2049, size=12)
    cm = COST[8]
    limit = limit_for(cm, lengths, 2.0)
    plan = plan_micro_batches(lengths, cm, dp=2, memory_limit_mib=limit, reserved_mib=A100.reserved_mib, gap=0.0,
                              split_to_balance=False)
    budget = limit - A100.reserved_mib - cm.model_state_mib()
    assert plan.objective_ms == pytest.approx(brute_force(np.sort(lengths), cm, budget, 2, 4096), rel=1e-9)
    # The planner's default gap stays within it of the optimum.
    near = plan_micro_batches(lengths, cm, dp=2, memory_limit_mib=limit, reserved_mib=A100.reserved_mib,
                              split_to_balance=False)
    assert plan.objective_ms <= near.objective_ms <= plan.objective_ms / (1 - DEFAULT_GAP) * (1 + 1e-12)


@settings(max_examples=15, deadline=None)
@given(pairs=st.lists(st.tuples(st.integers(1, 1024), st.integers(1, 256)), min_size=1, max_size=8),
       dp=st.integers(1, 3))
def test_encoder_decoder_dp_equals_brute_force_over_each_order(pairs, dp):
    dp = min(dp, len(pairs))  # the planner refuses more replicas than samples
    lengths = np.array(pairs)
    budget = memory_budget(T5_COST, None)
    per_order = []
    for order in candidate_orders(lengths):
        table = build_candidate_table(lengths[order], order, T5_COST, budget, cap=T5.max_seq_length)
        part = optimal_partition(table, 8, dp)
        expect = brute_force(lengths[order], T5_COST, np.inf, dp, T5.max_seq_length)
        assert part.objective_ms == pytest.approx(expect, rel=1e-9)
        per_order.append(expect)
    plan = plan_micro_batches(lengths, T5_COST, dp=dp, gap=0.0, split_to_balance=False)
    assert plan.objective_ms == pytest.approx(min(per_order), rel=1e-9)
    assert sorted(i for mb in plan.micro_batches for i in mb.samples) == list(range(len(lengths)))
    for mb in plan.micro_batches:  # padded shapes cover every sample
        assert mb.seqlen >= lengths[mb.samples, 0].max() and mb.dec_seqlen >= lengths[mb.samples, 1].max()


def test_unsorted_order_uses_per_end_rows_and_stays_exact():
    lengths = np.array([900, 20, 700, 33, 1500, 64, 8, 300])
    budget = memory_budget(COST[4], None)
    table = build_candidate_table(lengths, np.arange(8), COST[4], budget, cap=4096)
    assert len(table.row_len) == len(lengths)  # one row per end: shapes are range maxima
    part = optimal_partition(table, 4, 1)
    assert part.objective_ms == pytest.approx(brute_force(lengths, COST[4], np.inf, 1, 4096), rel=1e-9)


def test_pruned_search_equals_solving_every_cap():
    rng = np.random.default_rng(7)
    lengths = np.sort(np.minimum(rng.lognormal(5.5, 1.0, size=160).astype(int) + 1, 2048))
    cm = COST[8]
    for limit in (limit_for(cm, lengths, 3.0), None):
        budget = memory_budget(cm, limit, A100.reserved_mib)
        table = build_candidate_table(lengths, np.arange(len(lengths)), cm, budget, cap=2048)
        total, choice = np.empty(len(lengths) + 1), np.zeros(len(lengths) + 1, dtype=np.int64)
        every = []
        for v in np.unique(table.time_ms):
            f, m = solve_capped(table, v, total, choice)
            every.append(f / 2 + 7 * m)
        part = optimal_partition(table, 8, 2)
        assert part.objective_ms == pytest.approx(min(every), rel=1e-12)
        assert part.evaluations < len(np.unique(table.time_ms)) / 4  # the bounds prune most caps


def test_gap_stops_within_it_of_the_optimum_with_fewer_solves():
    rng = np.random.default_rng(11)
    lengths = np.sort(np.minimum(rng.lognormal(5.5, 1.0, size=3000).astype(int) + 1, 2048))
    cm = COST[8]
    table = build_candidate_table(lengths, np.arange(len(lengths)), cm, memory_budget(cm, None), cap=2048)
    exact = optimal_partition(table, 8, 16)
    for gap in (1e-4, 1e-3, 1e-2):
        part = optimal_partition(table, 8, 16, gap=gap)
        assert exact.objective_ms <= part.objective_ms <= exact.objective_ms / (1 - gap) * (1 + 1e-12)
        assert part.evaluations <= exact.evaluations
        assert sum(e - s for s, e in part.cuts) == len(lengths)
    assert optimal_partition(table, 8, 16, gap=1e-2).evaluations < exact.evaluations
    with pytest.raises(ValueError, match="gap=1.5"):
        optimal_partition(table, 8, 16, gap=1.5)


class ToyCost(CostModel):
    """t = overhead + k (r s + q s^2) ms, memory k s MiB: strong batching and pipeline trade-offs."""

    def __init__(self, overhead, quad, stages):
        super().__init__(load_model_config("gpt-tiny"), stages)
        self.overhead, self.quad = overhead, quad

    def layout_cost(self, layout, mbs, seqlen, dec_seqlen, recompute):
        b, s = np.broadcast_arrays(mbs, seqlen)
        t = self.overhead + b * (s + self.quad * s * s)
        return StageCost(t / 3, 2 * t / 3, b * s * 1.0, 0.0 * b)

    def model_state_mib(self, *args, **kwargs):
        return 0.0


@settings(max_examples=150, deadline=None)
@given(lengths=st.lists(st.integers(1, 1024), min_size=1, max_size=11), stages=st.sampled_from([2, 4]),
       dp=st.integers(1, 3), overhead=st.sampled_from([0.0, 1.0, 10.0, 100.0]),
       quad=st.sampled_from([0.0, 1e-4, 1e-2]), budget=st.sampled_from([np.inf, 1024.0, 3072.0]))
def test_dp_equals_brute_force_under_strong_trade_offs(lengths, stages, dp, overhead, quad, budget):
    # The optimum is often far from the unconstrained cut here, so the pruned search must dig.
    lengths = np.sort(lengths)
    cm = ToyCost(overhead, quad, stages)
    table = build_candidate_table(lengths, np.arange(len(lengths)), cm, memory_budget(cm, budget), cap=1024)
    part = optimal_partition(table, stages, dp)
    assert part.objective_ms == pytest.approx(brute_force(lengths, cm, budget, dp, 1024), rel=1e-9)


class NonMonotoneMemory(CostModel):
    """Two samples need 90 MiB, one or three 10 or 30: memory not monotone in the count."""

    def __init__(self):
        super().__init__(load_model_config("gpt-tiny"), 1)

    def layout_cost(self, layout, mbs, seqlen, dec_seqlen, recompute):
        b, _ = np.broadcast_arrays(np.asarray(mbs, float), np.asarray(seqlen, float))
        t = np.where(b == 3, 100.0, 10.0 + b)
        return StageCost(t / 3, 2 * t / 3, np.where(b == 2, 90.0, 10.0 * b), 0.0 * b)

    def model_state_mib(self, *args, **kwargs):
        return 0.0


def test_no_micro_batch_exceeds_its_share_when_memory_is_not_monotone():
    plan = plan_micro_batches([8, 8, 8], NonMonotoneMemory(), memory_limit_mib=100.0, micro_batch_share=0.5, gap=0.0)
    share = 0.5 * plan.extra["activation_budget_mib"]
    assert all(len(mb.samples) == 1 or mb.stored_mib + mb.peak_mib <= share for mb in plan.micro_batches), \
        [(mb.samples, mb.stored_mib) for mb in plan.micro_batches]


def _random_table(rng, n, monotone):
    rows = rng.integers(1, n + 1)
    row_len = rng.integers(1, n + 1, size=rows)
    t = rng.uniform(1.0, 50.0, size=int(row_len.sum()))
    offsets = np.cumsum(row_len) - row_len
    if monotone:
        for o, l in zip(offsets, row_len):
            t[o:o + l] = np.sort(t[o:o + l])
    else:
        t[rng.random(len(t)) < 0.15] = np.inf
    row_of_end = np.concatenate(([0], rng.integers(0, rows, size=n)))
    z = np.zeros(len(t))
    return CandidateTable(n, row_of_end, offsets.astype(np.int64), row_len.astype(np.int64), t, z, z,
                          z.astype(np.int64), z.astype(np.int64), monotone)


@needs_c
@pytest.mark.parametrize("seed", range(30))
def test_c_and_numpy_kernels_are_identical(seed):
    rng = np.random.default_rng(seed)
    table = _random_table(rng, int(rng.integers(1, 40)), monotone=bool(seed % 2))
    for cap in np.quantile(table.time_ms[np.isfinite(table.time_ms)], [0.0, 0.3, 0.7, 1.0]):
        out = []
        for compiled in (True, False):
            total, choice = np.empty(table.n + 1), np.zeros(table.n + 1, dtype=np.int64)
            res = solve_capped(table, cap, total, choice, use_compiled=compiled)
            out.append((res, total.tobytes(), choice.tobytes()))
        assert out[0] == out[1]


@needs_c
def test_c_and_numpy_give_identical_plans():
    rng = np.random.default_rng(3)
    lengths = np.minimum(rng.lognormal(5.0, 1.0, size=300).astype(int) + 1, 2048)
    plans = [plan_micro_batches(lengths, COST[8], memory_limit_mib=A100.memory_mib, reserved_mib=A100.reserved_mib,
                                use_compiled=c) for c in (True, False)]
    assert plans[0].extra["dp_kernel"] == "c" and plans[1].extra["dp_kernel"] == "numpy"
    assert [mb.to_json() for mb in plans[0].micro_batches] == [mb.to_json() for mb in plans[1].micro_batches]
    assert plans[0].objective_ms == plans[1].objective_ms


def test_memory_limit_binds_and_holds():
    rng = np.random.default_rng(11)
    lengths = rng.integers(100, 2049, size=200)
    cm = COST[1]  # one stage: no pipeline term, so bigger micro-batches pay and memory is what stops them
    free = plan_micro_batches(lengths, cm)
    limit = limit_for(cm, lengths, 1.2)
    tight = plan_micro_batches(lengths, cm, memory_limit_mib=limit, reserved_mib=A100.reserved_mib)
    budget = tight.extra["activation_budget_mib"]
    assert max(mb.stored_mib + mb.peak_mib for mb in free.micro_batches) > budget  # the limit matters here
    assert all(mb.stored_mib + mb.peak_mib <= budget for mb in tight.micro_batches)
    assert tight.objective_ms >= free.objective_ms


def test_reported_costs_match_the_cost_model():
    lengths = np.array([5, 17, 100, 101, 640, 2000, 2048, 33])
    plan = plan_micro_batches(lengths, COST[4], dp=2)
    for mb in plan.micro_batches:
        assert mb.seqlen == padded_length(np.array([lengths[mb.samples].max()]))[0]
        c = COST[4].stage_cost(len(mb.samples), mb.seqlen)
        assert mb.time_ms == pytest.approx(float(c.time_ms)) and mb.stored_mib == pytest.approx(float(c.stored_mib))
        assert mb.real_tokens == lengths[mb.samples].sum()
    times = [mb.time_ms for mb in plan.micro_batches]
    assert plan.objective_ms == pytest.approx(sum(times) / 2 + 3 * max(times))


def test_one_sample_and_identical_lengths():
    one = plan_micro_batches([77], COST[8])
    assert [mb.samples for mb in one.micro_batches] == [[0]] and one.micro_batches[0].seqlen == 80
    same = plan_micro_batches([64] * 50, COST[8])
    assert sorted(i for mb in same.micro_batches for i in mb.samples) == list(range(50))
    assert same.padding_efficiency == 1.0


def test_brute_force_helper_sees_every_partition():
    # 4 samples: 8 cuts; with S=1 and dp=1 the optimum is the cheapest cut, checked by hand.
    lengths = np.array([8, 8, 8, 8])
    cm = COST[1]
    c = {k: float(cm.stage_cost(k, 8).time_ms) for k in range(1, 5)}
    by_hand = min(sum(c[len(g)] for g in parts) for parts in (
        [[0, 1, 2, 3]], [[0], [1, 2, 3]], [[0, 1], [2, 3]], [[0, 1, 2], [3]], [[0], [1], [2, 3]],
        [[0], [1, 2], [3]], [[0, 1], [2], [3]], [[0], [1], [2], [3]]))
    assert brute_force(lengths, cm, np.inf, 1, 4096) == pytest.approx(by_hand)


@needs_c
def test_c_kernel_rejects_wrong_arrays():
    from dynapipe.batching import _dp_kernel
    table = _random_table(np.random.default_rng(0), 5, True)
    total, choice = np.empty(6), np.zeros(6, dtype=np.int64)
    args = [table.time_ms, table.offsets, table.row_len, table.row_of_end, 10.0, True, total, choice]
    with pytest.raises(TypeError, match="time_ms"):
        _dp_kernel.solve_capped(table.time_ms.astype(np.float32), *args[1:])
    with pytest.raises(TypeError, match="choice"):
        _dp_kernel.solve_capped(*args[:7], choice.astype(np.float64))
    with pytest.raises(ValueError, match="sizes"):
        _dp_kernel.solve_capped(*args[:6], np.empty(3), choice)
    bad_rows = table.row_of_end.copy()
    bad_rows[2] = 99
    with pytest.raises(ValueError, match="out of range"):
        _dp_kernel.solve_capped(*args[:3], bad_rows, *args[4:])


def test_each_candidate_order_keeps_its_own_name():
    from dynapipe.batching.ordering import named_candidate_orders, snake_order

    # Inputs and targets rise together: the input- and target-major sorts are one order, so
    # the snake order is the second candidate (it was reported as "target-major").
    lengths = np.array([[474, 410], [515, 789], [859, 850], [950, 1000], [1104, 1214], [1490, 1436]])
    named = named_candidate_orders(lengths)
    assert [n for n, _ in named] == ["input-major", "snake"]
    assert named[1][1].tolist() == snake_order(lengths[:, 0], lengths[:, 1]).tolist()
    assert [n for n, _ in named_candidate_orders(lengths[:, 0])] == ["sorted"]
    plan = plan_micro_batches(lengths, T5_COST, gap=0.0, split_to_balance=False)
    order = dict(named)[plan.extra["order"]]
    assert [i for mb in plan.micro_batches for i in mb.samples] == order.tolist()


@needs_c
def test_the_compiled_kernel_reads_tables_of_any_byte_order_as_numpy_does():
    # Big-endian times were read byte-swapped (2.6e-320 ms) where numpy read 3.0.
    t = np.array([1.0, 3.0, 2.0, 5.0], dtype=">f8")
    z = np.zeros(4)
    table = CandidateTable(2, np.array([0, 0, 1]), np.array([0, 2], dtype=">i8"), np.array([2, 2]), t, z, z,
                           z.astype(np.int64), z.astype(np.int64), True)
    got = {}
    for compiled in (False, True):
        total, choice = np.empty(3), np.zeros(3, dtype=np.int64)
        got[compiled] = (solve_capped(table, 10.0, total, choice, use_compiled=compiled), choice.tolist())
    assert got[True] == got[False] == ((3.0, 2.0), [0, 1, 1])
    with pytest.raises(DynaPipeError, match="total must be native float64"):
        solve_capped(table, 10.0, np.empty(3, dtype=">f8"), np.zeros(3, dtype=np.int64), use_compiled=True)
    from dynapipe.batching import _dp_kernel
    with pytest.raises(TypeError, match="native byte order"):
        _dp_kernel.solve_capped(t, table.offsets.astype(np.int64), table.row_len, table.row_of_end, 10.0, True,
                                np.empty(3), np.zeros(3, dtype=np.int64))


def test_the_numpy_loop_is_announced_once_a_process(monkeypatch):
    # An optional extension that failed to build left the planner an order of magnitude slower without a word.
    import warnings

    from dynapipe.batching import dp_partition, plan_micro_batches
    from dynapipe.config import load_device_config, load_model_config
    from dynapipe.cost import build_cost_model

    monkeypatch.setattr(dp_partition, "_dp_kernel", None)
    monkeypatch.setattr(dp_partition, "_fallback_warned", False)
    cm = build_cost_model(load_model_config("gpt-tiny"), load_device_config("cpu"), num_stages=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            plan_micro_batches(np.array([10, 20, 30, 40]), cm)
    assert [str(w.message) for w in caught if "C loop" in str(w.message)] == [
        "dynapipe: the planner's C loop (dynapipe.batching._dp_kernel) is not built, so the DP runs its numpy loop, "
        "an order of magnitude slower; reinstall with a C compiler present (pip install -e .)."]
