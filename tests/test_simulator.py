"""The simulator against hand-computed timelines, and every schedule's dependencies."""
import numpy as np
import pytest

from dynapipe.batching.types import MicroBatch
from dynapipe.config import ClusterConfig, LinkConfig, load_device_config, load_model_config
from dynapipe.cost import build_cost_model
from dynapipe.errors import DynaPipeError
from dynapipe.schedule import Op, Schedule, StageTimes, adaptive_schedule, one_f_one_b, simulate, stage_times
from dynapipe.schedule import _kernels as K
from dynapipe.schedule.comm import message_bytes


def uniform_times(S, M, fw=1.0, bw=2.0, comm=0.0, stored=10.0, peak=1.0, state=100.0):
    ones = np.ones((S, M))
    c = np.full((max(S - 1, 0), M), comm)
    return StageTimes(fw * ones, bw * ones, stored * ones, peak * ones, c, c.copy(), np.full(S, state))


def random_times(rng, S, M):
    fw = rng.uniform(0.5, 5.0, size=M) * rng.uniform(0.8, 1.2, size=(S, 1))
    comm = rng.uniform(0.0, 0.3, size=(max(S - 1, 0), M))
    return StageTimes(fw, 2 * fw, 10 * fw, fw.copy(), comm, comm.copy(), np.full(S, 50.0))


@pytest.mark.parametrize("S", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("M", [1, 2, 5, 16])
def test_uniform_1f1b_takes_m_plus_s_minus_1_slots(S, M):
    tl = simulate(one_f_one_b(S, M), uniform_times(S, M, fw=1.0, bw=2.0))
    assert tl.makespan_ms == pytest.approx((M + S - 1) * 3.0)
    # Every stage computes M forwards and backwards and idles (S - 1) slots.
    assert tl.busy_ms == pytest.approx([3.0 * M] * S)
    assert tl.idle_ms == pytest.approx([3.0 * (S - 1)] * S)
    assert tl.bubble_fraction == pytest.approx((S - 1) / (M + S - 1))


def test_two_stage_timeline_and_memory_by_hand():
    # S=2, M=2, fw=1, bw=2, 0.5 ms per transfer; stored 10 MiB, peak 1 MiB, states 100 MiB.
    tl = simulate(one_f_one_b(2, 2), uniform_times(2, 2, comm=0.5))
    # stage 0: F0 [0,1] F1 [1,2] B0 [5,7] B1 [8,10]; stage 1: F0 [1.5,2.5] B0 [2.5,4.5] F1 [4.5,5.5] B1 [5.5,7.5]
    assert [str(op) for op in tl.schedule.stage_ops[0]] == ["F0", "F1", "B0", "B1"]
    assert tl.starts[0] == [0.0, 1.0, 5.0, 8.0] and tl.ends[0] == [1.0, 2.0, 7.0, 10.0]
    assert tl.starts[1] == [1.5, 2.5, 4.5, 5.5] and tl.ends[1] == [2.5, 4.5, 5.5, 7.5]
    assert tl.makespan_ms == 10.0 and tl.busy_ms == [6.0, 6.0]
    assert tl.bubble_fraction == pytest.approx(1 - 12 / 20)
    # Stage 0 holds both micro-batches before B0: 100 + 2 x 10 + 1 transient = 121 MiB.
    assert tl.peak_mib[0] == pytest.approx(121.0)
    assert tl.peak_mib[1] == pytest.approx(111.0)
    assert tl.memory[0] == [(0.0, 100.0), (0.0, 111.0), (1.0, 110.0), (1.0, 121.0), (2.0, 120.0),
                            (5.0, 121.0), (7.0, 110.0), (8.0, 111.0), (10.0, 100.0)]


def check_dependencies(tl, times):
    S, M = times.num_stages, times.num_micro_batches
    f, b = {}, {}
    for s in range(S):
        prev_end = 0.0
        for i, op in enumerate(tl.schedule.stage_ops[s]):
            start, end = tl.starts[s][i], tl.ends[s][i]
            assert start >= prev_end - 1e-9, "ops of one stage overlap"
            dur = times.fw_ms[s, op.mb] if op.kind == "F" else times.bw_ms[s, op.mb]
            assert end - start == pytest.approx(dur)
            (f if op.kind == "F" else b)[(s, op.mb)] = (start, end)
            prev_end = end
    assert len(f) == len(b) == S * M
    for (s, m), (start, _) in f.items():
        if s > 0:
            assert start >= f[(s - 1, m)][1] + times.act_comm_ms[s - 1, m] - 1e-9
    for (s, m), (start, _) in b.items():
        if s < S - 1:
            assert start >= b[(s + 1, m)][1] + times.grad_comm_ms[s, m] - 1e-9
        else:
            assert start >= f[(s, m)][1] - 1e-9


@pytest.mark.parametrize("seed", range(6))
def test_every_schedule_respects_dependencies(seed):
    rng = np.random.default_rng(seed)
    S, M = int(rng.integers(1, 9)), int(rng.integers(1, 30))
    times = random_times(rng, S, M)
    check_dependencies(simulate(one_f_one_b(S, M), times), times)
    sched, tl = adaptive_schedule(times)
    check_dependencies(tl, times)
    # Bounded by memory: room for two of the largest micro-batches on every stage.
    cap = times.state_mib + 2 * (times.stored_mib + times.peak_mib).max()
    sched, tl = adaptive_schedule(times, cap)
    check_dependencies(tl, times)
    assert max(tl.peak_mib) <= cap.max() + 1e-9


@pytest.mark.parametrize("seed", range(4))
def test_adaptive_timeline_is_reproduced_by_the_simulator(seed):
    rng = np.random.default_rng(100 + seed)
    times = random_times(rng, 4, 20)
    cap = times.state_mib + 3 * (times.stored_mib + times.peak_mib).max()
    sched, built = adaptive_schedule(times, cap, record_memory=True)
    again = simulate(sched, times)
    assert again.starts == built.starts and again.ends == built.ends
    assert again.peak_mib == built.peak_mib and again.memory == built.memory


def test_adaptive_fills_the_pipeline_without_waiting():
    # Uniform micro-batches, unbounded memory: no stage ever idles while work is ready,
    # so the makespan is the 1F1B optimum.
    times = uniform_times(4, 8)
    _, tl = adaptive_schedule(times)
    assert tl.makespan_ms == pytest.approx((8 + 4 - 1) * 3.0)


def test_adaptive_one_in_flight_when_memory_allows_only_one():
    times = uniform_times(3, 5, stored=10.0, peak=1.0, state=100.0)
    sched, tl = adaptive_schedule(times, [111.0] * 3)
    for ops in sched.stage_ops:
        assert [op.kind for op in ops] == ["F", "B"] * 5
    assert tl.peak_mib == pytest.approx([111.0] * 3)


def test_a_schedule_that_cannot_run_is_rejected():
    stage0 = (Op("F", 0), Op("B", 0), Op("F", 1), Op("B", 1))
    stage1 = (Op("F", 1), Op("B", 1), Op("F", 0), Op("B", 0))
    with pytest.raises(DynaPipeError, match="stage .* waits forever"):
        simulate(Schedule("broken", 2, (stage0, stage1)), uniform_times(2, 2))


@pytest.mark.parametrize("stage0, needle", [
    ((Op("F", 0), Op("B", 0), Op("F", 1)), "micro-batch 1's forward 1 time.* B x0, BI x0, BW x0"),
    ((Op("F", 0), Op("F", 0), Op("B", 0), Op("F", 1), Op("B", 1)), "micro-batch 0's forward 2 time"),
    ((Op("F", 0), Op("B", 0)), "micro-batch 1's forward 0 time"),
    ((Op("F", 0), Op("BI", 0), Op("F", 1), Op("B", 1)), "micro-batch 0's forward 1 time.* B x0, BI x1, BW x0"),
])
def test_a_schedule_missing_or_repeating_an_op_is_refused_not_simulated(stage0, needle):
    # It used to simulate to a plausible timeline: 8.9 ms instead of 10.9 without stage 0's B1.
    stage1 = (Op("F", 0), Op("B", 0), Op("F", 1), Op("B", 1))
    with pytest.raises(DynaPipeError, match=f"schedule 'odd': stage 0 runs {needle}"):
        simulate(Schedule("odd", 2, (stage0, stage1)), uniform_times(2, 2))


def test_a_chunked_schedule_missing_an_op_is_refused_too():
    from dynapipe.schedule.interleaved import chunked_schedule_arrays

    full = tuple(Op(k, m, c) for c in (0, 1) for m in (0, 1) for k in ("F", "B"))
    chunked_schedule_arrays(Schedule("whole", 1, (full,), num_chunks=2), 2)
    with pytest.raises(DynaPipeError, match="stage 0 runs micro-batch 1 of chunk 1's forward 1 time"):
        chunked_schedule_arrays(Schedule("short", 1, (full[:-1],), num_chunks=2), 2)


def test_split_backward_kinds_pass_the_check_and_unknown_kinds_do_not():
    # BI/BW were reserved until zb-h1 (tests/test_zero_bubble.py covers them in depth).
    ops = (Op("F", 0), Op("BI", 0), Op("BW", 0))
    Schedule("zb", 1, (ops,)).check()
    with pytest.raises(DynaPipeError, match="kind 'X'"):
        Schedule("bad", 1, ((Op("F", 0), Op("X", 0)),)).check()


@pytest.mark.skipif(not K.compiled(), reason="numba not installed: only the Python loops exist")
def test_compiled_and_python_kernels_agree():
    rng = np.random.default_rng(7)
    times = random_times(rng, 5, 17)
    from dynapipe.schedule.simulator import kernel_inputs, schedule_arrays
    kind, mb, nops = schedule_arrays(one_f_one_b(5, 17), 17)
    none = np.zeros_like(times.fw_ms)
    args = (kind, mb, np.zeros_like(kind), nops, *kernel_inputs(times), none, none, np.inf, np.inf)
    for a, b in zip(K.chunked_split_kernel(*args), K.chunked_split_kernel.py_func(*args)):
        np.testing.assert_array_equal(a, b)
    state = times.state_mib.astype(float)
    args = (*kernel_inputs(times)[:6], state, np.full(5, 80.0), np.full(5, 17), True, np.inf, np.inf)
    for a, b in zip(K.adaptive_kernel(*args), K.adaptive_kernel.py_func(*args)):
        np.testing.assert_array_equal(a, b)


def test_communication_from_cluster_links():
    model = load_model_config("gpt-tiny")
    cm = build_cost_model(model, load_device_config("cpu"), 4)
    # 2 GPUs a node: stages 0-1 share a node, the boundary 1 -> 2 crosses nodes.
    cluster = ClusterConfig("two-per-node", gpus_per_node=2, intra_node=LinkConfig(10.0, 0.01),
                            inter_node=LinkConfig(1.0, 0.1))
    mbs = [MicroBatch([0, 1], 64), MicroBatch([2], 128)]
    t = stage_times(cm, mbs, cluster=cluster)
    nbytes = 64 * 2 * 64 * 4  # [seqlen, mbs, hidden] fp32
    assert t.act_comm_ms[0, 0] == pytest.approx(0.01 + nbytes / 10e9 * 1e3)
    assert t.act_comm_ms[1, 0] == pytest.approx(0.1 + nbytes / 1e9 * 1e3)
    assert t.grad_comm_ms[1, 1] == pytest.approx(0.1 + 128 * 1 * 64 * 4 / 1e9 * 1e3)
    assert t.fw_ms.shape == (4, 2) and np.all(t.state_mib > 0)


def test_t5_decoder_stages_also_send_the_encoder_output():
    model = load_model_config("t5-11b")
    cm = build_cost_model(model, load_device_config("a100-40gb"), 4)
    h, d = model.hidden_size, model.dtype_bytes
    # Stages 0-1 hold the encoder, 2-3 the decoder.
    assert message_bytes(model, cm.layouts, 0, 2, 512, 64) == 512 * 2 * h * d
    assert message_bytes(model, cm.layouts, 1, 2, 512, 64) == 512 * 2 * h * d
    assert message_bytes(model, cm.layouts, 2, 2, 512, 64) == (64 + 512) * 2 * h * d


def test_each_replica_is_priced_over_its_own_links():
    # a100-8x, 4 stages x 3 replicas: stage s of replica r is rank 3s + r. Replica 0's last
    # boundary (6 -> 9) leaves its node, replica 2's middle one (5 -> 8) does.
    from dynapipe.config import load_cluster_config
    from dynapipe.schedule.costs import stage_times_per_replica

    cluster = load_cluster_config("a100-8x")
    cm = build_cost_model(load_model_config("gpt-7b"), load_device_config("a100-40gb"), 4)
    mbs = [MicroBatch([0], 1024)]
    r0, _, r2 = stage_times_per_replica(cm, [mbs, mbs, mbs], cluster=cluster, dp=3)
    c0, c2 = r0.act_comm_ms[:, 0], r2.act_comm_ms[:, 0]
    assert c0[2] > c0[1] == c0[0] and c2[1] > c2[0] == c2[2], (c0, c2)
    np.testing.assert_array_equal(r2.act_comm_ms, stage_times(cm, mbs, cluster=cluster, dp=3, replica=2).act_comm_ms)
