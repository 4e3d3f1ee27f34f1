"""Interleaved (virtual-pipeline) placements and schedules: the chunked placement, interleaved
1F1B, its simulator, memory per rank, the search over it. Pure Python + numpy, tiny models."""
import json

import numpy as np
import pytest

from dynapipe.config import DeviceConfig, LinkConfig, ModelConfig
from dynapipe.cost import AnalyticCostModel, PlacementSample, StagePlacement
from dynapipe.cost.base import StageLayout
from dynapipe.cost.chunked_placement import even_chunked_placement, plan_chunked_placement
from dynapipe.batching.types import MicroBatch
from dynapipe.errors import DynaPipeError
from dynapipe.plan.compile import compile_plans
from dynapipe.schedule.costs import StageTimes
from dynapipe.schedule.interleaved import (interleaved_1f1b, interleaved_arrays, micro_batch_groups,
                                           schedule_from_chunked_arrays,
                                           virtual_stage_times_per_replica)
from dynapipe.schedule.search import search_schedules
from dynapipe.schedule.simulator import simulate
from dynapipe.schedule.types import CHUNKED_SCHEDULE_NAMES, Op

DEVICE = DeviceConfig("toy", peak_tflops=10.0, achievable_fraction=0.5, memory_mib=1e9, op_overhead_ms=0.01)
T5 = ModelConfig("t5-toy", arch="t5", encoder_layers=4, decoder_layers=4, hidden_size=512, num_attention_heads=8,
                 ffn_hidden_size=2048, vocab_size=1000, max_seq_length=1024, dtype="bf16")
GPT = ModelConfig("gpt-toy", num_layers=8, hidden_size=512, num_attention_heads=8, ffn_hidden_size=2048,
                  vocab_size=1000, max_seq_length=1024, dtype="bf16")


def _times(P, v, M, rng=None, fw=1.0, bw=2.0, stored=0.0, comm=0.0, state=0.0):
    V = P * v
    if rng is not None:
        f = rng.uniform(0.5, 3.0, (V, M))
        return StageTimes(f, f * rng.uniform(1.5, 3.0, (V, M)), rng.uniform(0, 5, (V, M)), rng.uniform(0, 1, (V, M)),
                          rng.uniform(0, 0.3, (V - 1, M)), rng.uniform(0, 0.3, (V - 1, M)), np.zeros(P))
    full = lambda x: np.full((V, M), float(x))  # noqa: E731
    return StageTimes(full(fw), full(bw), full(stored), full(0.0), np.full((V - 1, M), comm),
                      np.full((V - 1, M), comm), np.full(P, float(state)))


def test_interleaved_schedule_is_valid_and_runs_for_random_shapes():
    rng = np.random.default_rng(0)
    for P in range(2, 9):
        for v in (2, 3):
            for M in sorted({1, 2, P - 1, P, P + 1, 2 * P - 1, 2 * P + 3, int(rng.integers(1, 25))} - {0}):
                sched = interleaved_1f1b(P, v, M).check()
                assert sched.num_chunks == v
                # Every rank runs every (micro-batch, chunk) forward, then its backward.
                assert all(len(ops) == 2 * v * M for ops in sched.stage_ops)
                tl = simulate(sched, _times(P, v, M, rng))  # raises if the order waits in a cycle
                assert tl.makespan_ms > 0 and len(tl.busy_ms) == P


def test_uniform_micro_batches_take_the_interleaved_slot_count():
    # Equal chunks: (v M + P - 1) forward+backward slots of one chunk, fill and drain cut by v.
    for P, v, M in [(4, 2, 8), (8, 2, 16), (8, 2, 17), (4, 3, 5), (2, 2, 3)]:
        tl = simulate(interleaved_1f1b(P, v, M), _times(P, v, M))
        assert tl.makespan_ms == pytest.approx(3.0 * (v * M + P - 1))
    # Megatron's groups (a short last group) leave more idle for M not a multiple of P.
    assert micro_batch_groups(8, 17) == (9, 8) and micro_batch_groups(8, 17, spread=False) == (8, 8, 1)
    megatron = schedule_from_chunked_arrays("interleaved", *interleaved_arrays(8, 2, 17, spread=False), chunks=2)
    # Its critical path (F 1 ms, B 2 ms; "B8.0": micro-batch 8's backward in chunk 0). The last
    # rank waits 7 F for micro-batch 0, then runs, with no wait, the 2 x 16 forwards of the two
    # full groups, micro-batch 16's first (F16.0) and 3 x 8 backwards (group 0 in both chunks,
    # group 1 in chunk 1). Its next op, B8.0, waits on rank 0, which takes F16.1, the 5
    # backwards its order still holds ahead of B8.1 (B3.0..B7.0) and B8.1. The last rank then
    # runs B8.0, F16.1 and B9.0..B15.0 before B16.1, whose gradient crosses all 16 virtual
    # stages with no rank busy: 50 slots of one chunk's F + B, against 41 with spread groups.
    fill, full_groups = 7 * 1.0, (2 * 16 + 1) * 1.0 + 3 * 8 * 2.0
    rank0_to_b8_1, last_rank_to_b16_1, last_micro_batch_back = 1.0 + 6 * 2.0, 8 * 2.0 + 1.0, 16 * 2.0
    megatron_ms = fill + full_groups + rank0_to_b8_1 + last_rank_to_b16_1 + last_micro_batch_back
    assert megatron_ms == 3.0 * 50
    tl = simulate(megatron.check(), _times(8, 2, 17))
    assert tl.makespan_ms == pytest.approx(megatron_ms)

    def start(rank, kind, mb, chunk):
        return tl.starts[rank][megatron.stage_ops[rank].index(Op(kind, mb, chunk))]

    # The path's steps where the simulator has them.
    assert [start(7, "F", 16, 0) + 1.0, start(0, "B", 8, 1) + 2.0, start(7, "B", 16, 1)] == pytest.approx(
        [fill + full_groups, fill + full_groups + rank0_to_b8_1,
         fill + full_groups + rank0_to_b8_1 + last_rank_to_b16_1])


def _adaptive(times, P, capacity=np.inf):
    from dynapipe.schedule.interleaved_adaptive import INTERLEAVED_ADAPTIVE, interleaved_adaptive_orders

    arrays = interleaved_adaptive_orders(times, P, capacity)
    return schedule_from_chunked_arrays(INTERLEAVED_ADAPTIVE, *arrays, chunks=times.num_stages // P).check()


def _idles_with_work_ready(sched, tl, t) -> list:
    """Where a rank of ``tl`` sat idle although an op it may run next (a backward whose gradient
    had arrived, or the next forward of a chunk whose input had arrived) was ready."""
    P, V = sched.num_stages, t.num_stages
    f_end, b_end = {}, {}
    for s, ops in enumerate(sched.stage_ops):
        for j, op in enumerate(ops):
            (f_end if op.kind == "F" else b_end)[(op.chunk * P + s, op.mb)] = tl.ends[s][j]

    def arrival(kind, k, m):
        if kind == "F":
            return 0.0 if k == 0 else f_end[k - 1, m] + t.act_comm_ms[k - 1, m]
        return f_end[k, m] if k == V - 1 else b_end[k + 1, m] + t.grad_comm_ms[k, m]

    bad = []
    for s, ops in enumerate(sched.stage_ops):
        for j in range(1, len(ops)):
            idle_from, start = tl.ends[s][j - 1], tl.starts[s][j]
            if start <= idle_from + 1e-9:
                continue
            done = ops[:j]
            nxt = {c: min((op.mb for op in ops[j:] if op.kind == "F" and op.chunk == c), default=None)
                   for c in range(sched.num_chunks)}
            for op in ops[j:]:
                k = op.chunk * P + s
                may = op.kind == "B" or nxt[op.chunk] == op.mb
                if may and op not in done and arrival(op.kind, k, op.mb) < start - 1e-9:
                    bad.append((s, j, op))
    return bad


def test_adaptive_interleaved_schedule_is_valid_for_random_shapes_and_never_idles_with_work_ready():
    rng = np.random.default_rng(1)
    for P in (2, 3, 4, 8):
        for v in (2, 3):
            for M in (1, P - 1 or 1, P, 2 * P + 1, int(rng.integers(1, 20))):
                t = _times(P, v, M, rng)
                sched = _adaptive(t, P)
                assert all(len(ops) == 2 * v * M for ops in sched.stage_ops)
                tl = simulate(sched, t)  # raises if an order waits in a cycle
                # Wait-free (no memory limit): a rank idles only while nothing it may run has arrived.
                assert _idles_with_work_ready(sched, tl, t) == []
    # Megatron's fixed order does idle with work ready on the same kind of shapes.
    t = _times(4, 2, 9, np.random.default_rng(2))
    fixed = interleaved_1f1b(4, 2, 9)
    assert _idles_with_work_ready(fixed, simulate(fixed, t), t)


def test_adaptive_interleaved_beats_the_fixed_order_where_chunks_are_uneven():
    # A T5 on 2 ranks x 2 chunks: encoder chunks (virtual stages 0, 1) cost 4x the decoder
    # chunks, and micro-batches vary 1-8x: interleaved 1F1B waits on the pattern.
    rng = np.random.default_rng(3)
    P, v, M = 2, 2, 11
    scale = rng.uniform(1.0, 8.0, M)
    fw = np.outer([4.0, 4.0, 1.0, 1.0], scale)
    t = StageTimes(fw, 2 * fw, np.outer([2.0, 2.0, 1.0, 1.0], scale), np.zeros((4, M)), np.full((3, M), 0.1),
                   np.full((3, M), 0.1), np.zeros(2))
    fixed = simulate(interleaved_1f1b(P, v, M), t)
    adaptive = simulate(_adaptive(t, P), t)
    assert adaptive.makespan_ms < 0.97 * fixed.makespan_ms
    # Under a memory cap a rank admits a forward only while it fits (one always runs).
    cap = 0.6 * max(adaptive.peak_mib)
    capped = simulate(_adaptive(t, P, cap), t)
    assert max(capped.peak_mib) <= cap + 1e-9 < max(adaptive.peak_mib)
    assert capped.makespan_ms > adaptive.makespan_ms  # the memory costs time: fewer forwards in flight


def test_search_tries_both_interleaved_schedules_and_compiles_the_winner():
    from dynapipe.plan.validate import validate_plans

    it, _ = _chunked_iteration(2, "interleaved", n=11, seed=4, dp=1)
    tried = {c.schedule for c in it.search.candidates}
    assert tried == {"interleaved", "interleaved-adaptive", "interleaved-zb"}
    fits = [c for c in it.search.candidates if c.fits]
    assert it.search.best.makespan_ms == min(c.makespan_ms for c in fits)
    validate_plans(it.all_plans())
    # Chosen by name, the adaptive one compiles into plans that validate too.
    from dynapipe.pipeline_planner import plan_iteration

    rng = np.random.default_rng(4)
    cm = AnalyticCostModel(T5, DEVICE, 2).with_placement(StagePlacement.parse("interleaved", T5, 2))
    lengths = np.stack([rng.integers(16, 1000, 11), rng.integers(4, 200, 11)], 1)
    named = plan_iteration(lengths, cm, dp=1, memory_limit_mib=None, schedule="interleaved-adaptive", validate=True)
    assert named.schedule == "interleaved-adaptive" and named.all_plans()[0].schedule == "interleaved-adaptive"


def test_simulated_time_of_a_toy_case_by_hand():
    # One micro-batch, 2 ranks x 2 chunks: the forward chain through virtual stages 0..3
    # (rank 0, 1, 0, 1) with transfers between, then the backward chain back.
    fw = np.array([[1.0], [2.0], [3.0], [4.0]])
    bw = 2 * fw
    ac = np.array([[0.5], [0.25], [0.125]])
    t = StageTimes(fw, bw, np.zeros((4, 1)), np.zeros((4, 1)), ac, ac.copy(), np.zeros(2))
    tl = simulate(interleaved_1f1b(2, 2, 1), t)
    assert tl.makespan_ms == pytest.approx(10.0 + 20.0 + 2 * 0.875)
    # Rank 0 runs F(vs0) [0, 1], F(vs2) [3.75, 6.75], then B(vs2), B(vs0).
    assert tl.starts[0][1] == pytest.approx(1 + 0.5 + 2 + 0.25)
    assert tl.busy_ms == pytest.approx([3.0 * (1 + 3), 3.0 * (2 + 4)])


def test_rank_memory_counts_every_chunk_it_holds():
    # 1 micro-batch on 2 ranks x 2 chunks: rank 0 stores chunk 0's activations (5 MiB) until
    # its backward, so when chunk 1 (7 MiB) runs its forward both are stored.
    st = np.array([[5.0], [1.0], [7.0], [1.0]])
    pk = np.array([[0.0], [0.0], [2.0], [0.0]])
    z = np.zeros((3, 1))
    t = StageTimes(np.ones((4, 1)), np.ones((4, 1)), st, pk, z, z.copy(), np.array([100.0, 50.0]))
    tl = simulate(interleaved_1f1b(2, 2, 1), t)
    assert tl.peak_mib[0] == pytest.approx(100 + 5 + 7 + 2)
    assert tl.peak_mib[1] == pytest.approx(50 + 1 + 1)
    assert max(m for _, m in tl.memory[0]) == pytest.approx(tl.peak_mib[0])
    assert tl.memory[0][-1][1] == pytest.approx(100.0)  # everything freed at the end


def test_chunked_placement_spec_json_and_layouts():
    p = StagePlacement.parse("2+0,2+0|0+2,0+2", T5, 2)
    assert p.chunks == 2 and p.num_stages == 2 and p.num_virtual_stages == 4
    assert str(p) == "2+0,2+0|0+2,0+2"
    assert StagePlacement.from_json(json.loads(json.dumps(p.to_json())), T5) == p
    assert p == StagePlacement.parse("interleaved", T5, 2) == StagePlacement.interleaved(T5, 2)
    # Every rank holds encoder and decoder layers; the cost model prices the rank as both.
    assert [(l.encoder_layers, l.decoder_layers) for l in p.layouts()] == [(2, 2), (2, 2)]
    assert [(l.encoder_layers, l.decoder_layers, l.has_embedding, l.has_output) for l in p.virtual_layouts()] == \
        [(2, 0, True, False), (2, 0, False, False), (0, 2, False, False), (0, 2, False, True)]
    g = StagePlacement.parse("2,2|2,2", GPT, 2)
    assert g.to_json() == {"layers": [2, 2, 2, 2], "chunks": 2} and str(g) == "2,2|2,2"
    for bad, match in [("2+0,2+0|0+2", "per chunk"), ("2+0,0+2|2+0,0+2", "before the first decoder"),
                       ("3+0,1+0|0+2,0+1", "decoder layers")]:
        with pytest.raises(DynaPipeError, match=match):
            StagePlacement.parse(bad, T5, 2)
    with pytest.raises(DynaPipeError, match="not encoder-decoder"):
        StagePlacement.interleaved(GPT, 2)


def test_cost_model_keeps_the_chunks_and_states_count_both_chunks():
    cm = AnalyticCostModel(T5, DEVICE, 2)
    icm = cm.with_placement(StagePlacement.interleaved(T5, 2))
    assert icm.placement.chunks == 2 and cm.placement.chunks == 1
    both = cm.layout_state_mib(StageLayout(0, 2, 2, True, False))
    assert icm.model_state_mib(0) == pytest.approx(both)
    assert both > cm.layout_state_mib(StageLayout(0, 2, 0, True, False))
    # Per virtual stage costs: the decoder chunk's transfers carry the encoder output too.
    mbs = [MicroBatch(samples=[0, 1], seqlen=128, dec_seqlen=32), MicroBatch(samples=[2], seqlen=256, dec_seqlen=16)]
    link = LinkConfig(bandwidth_gbps=1.0, latency_ms=0.001)

    class Cluster:
        def link(self, a, b):
            return link

    (t,) = virtual_stage_times_per_replica(icm, [mbs], cluster=Cluster())
    assert t.fw_ms.shape == (4, 2) and t.state_mib.shape == (2,)
    assert t.act_comm_ms[2, 0] > t.act_comm_ms[0, 0]  # decoder message: hidden + encoder output


def test_search_runs_interleaved_on_a_chunked_placement():
    cm = AnalyticCostModel(T5, DEVICE, 2).with_placement(StagePlacement.interleaved(T5, 2))
    rng = np.random.default_rng(1)
    mbs = [MicroBatch(samples=[i], seqlen=int(rng.integers(64, 512)), dec_seqlen=int(rng.integers(8, 64)))
           for i in range(7)]
    res = search_schedules([mbs], cm, capacity_mib=None)
    assert res.best.schedule in ("interleaved", "interleaved-adaptive", "interleaved-zb")
    assert res.schedules[0].num_chunks == 2
    assert search_schedules([mbs], cm, capacity_mib=None, schedule="interleaved").best.schedule == "interleaved"
    assert res.makespan_ms == pytest.approx(res.timelines[0].makespan_ms)
    with pytest.raises(DynaPipeError, match="compile_chunked_plans"):
        compile_plans(res.schedules[0], res.micro_batches[0], T5, timeline=res.timelines[0])
    # adaptive on chunks is the adaptive interleaved order, as 1f1b is interleaved 1F1B.
    assert search_schedules([mbs], cm, capacity_mib=None, schedule="adaptive").best.schedule == "interleaved-adaptive"
    with pytest.raises(DynaPipeError, match="interleaved"):
        search_schedules([mbs], AnalyticCostModel(T5, DEVICE, 2), schedule="interleaved")


def test_chunked_placement_balances_virtual_stages():
    rng = np.random.default_rng(0)
    n = 12
    sample = PlacementSample(np.ones(n), rng.integers(256, 1024, n).astype(float), rng.integers(8, 64, n).astype(float))
    cm = AnalyticCostModel(T5, DEVICE, 2)
    p = plan_chunked_placement(cm, sample, 2)
    assert p.chunks == 2 and p.num_stages == 2
    even = even_chunked_placement(cm, 2)
    vt = lambda pl: [sum(AnalyticCostModel(T5, DEVICE, 4).layout_cost(l, sample.mbs, sample.seqlen, sample.dec_seqlen,  # noqa: E731
                                                                         "none").time_ms) for l in pl.virtual_layouts()]
    assert max(vt(p)) <= max(vt(even)) + 1e-9
    # Encoder layers cost more than decoder layers on long inputs: the split moves an
    # encoder layer off the encoder-only chunks.
    assert max(vt(p)) < max(vt(even))


def _chunked_iteration(P=2, spec="interleaved", n=9, seed=0, dp=2):
    from dynapipe.pipeline_planner import plan_iteration

    rng = np.random.default_rng(seed)
    cm = AnalyticCostModel(T5, DEVICE, P).with_placement(StagePlacement.parse(spec, T5, P))
    lengths = np.stack([rng.integers(16, 1000, n), rng.integers(4, 200, n)], 1)
    return plan_iteration(lengths, cm, dp=dp, memory_limit_mib=None), cm


@pytest.mark.parametrize("P,spec", [(2, "interleaved"), (2, "1+0,2+0|1+1,0+3"), (4, "interleaved"),
                                    (3, "1+0,1+0,1+0|1+0,0+2,0+2")])
def test_compiled_interleaved_plans_validate_with_chunk_tagged_transfers(P, spec):
    from dynapipe.plan.instructions import ForwardPass, RecvActivationStart, SendActivationStart
    from dynapipe.plan.serialize import deserialize_plan, serialize_plan
    from dynapipe.plan.validate import validate_plans

    it, cm = _chunked_iteration(P, spec, n=11, seed=P)
    plans = it.all_plans()
    summary = validate_plans(plans)
    assert summary.stages == P and summary.transfers > 0
    V = 2 * P
    for p in plans:
        assert p.meta["chunks"] == 2 and p.meta["placement"] == cm.placement.to_json()
        fw = [(i.mb, i.chunk) for i in p.instructions if isinstance(i, ForwardPass)]
        assert sorted(fw) == sorted((m.mb, c) for m in p.micro_batches for c in range(2))
        assert deserialize_plan(serialize_plan(p)).instructions == p.instructions
    # The activation crossing from the last rank's chunk 0 to rank 0's chunk 1 carries the
    # tensors of that virtual boundary, with the peers of the ring.
    last, first = plans[P - 1], plans[0]
    sends = [i for i in last.instructions if isinstance(i, SendActivationStart) and i.chunk == 0]
    recvs = [i for i in first.instructions if isinstance(i, RecvActivationStart) and i.chunk == 1]
    assert sends and [(i.mb, i.tensors) for i in sends] == [(i.mb, i.tensors) for i in recvs]
    assert {i.peer for i in sends} == {0} and {i.peer for i in recvs} == {P - 1}
    layouts = cm.placement.virtual_layouts()
    names = [t.name for t in sends[0].tensors]
    assert names == (["encoder_output"] if layouts[P].encoder_layers == 0 else ["hidden_states"])
    assert V == len(layouts)


def test_validator_catches_broken_interleaved_plans():
    import dataclasses

    from dynapipe.errors import PlanError
    from dynapipe.plan.instructions import RecvActivationStart
    from dynapipe.plan.validate import validate_plans

    it, _ = _chunked_iteration(2, "interleaved", n=7, dp=1)
    plans = it.all_plans()
    validate_plans(plans)
    # Rank 1 posts two receives of rank 0's activations back to back; swapped, each rank's plan is
    # still valid on its own, but the pairing across ranks (first message, first receive) is not.
    p = plans[1]
    a = next(k for k, i in enumerate(p.instructions)
             if isinstance(i, RecvActivationStart) and isinstance(p.instructions[k + 1], RecvActivationStart))
    insts = list(p.instructions)
    insts[a], insts[a + 1] = insts[a + 1], insts[a]
    with pytest.raises(PlanError, match="message order differs from the sender"):
        validate_plans([plans[0], dataclasses.replace(p, instructions=tuple(insts))])
    # A receive on rank 0 that names the wrong chunk is a receive into a buffer nobody fills
    # (refused by rank 0's own checks).
    q = plans[0]
    k = next(k for k, i in enumerate(q.instructions) if isinstance(i, RecvActivationStart) and i.chunk == 1)
    insts = list(q.instructions)
    insts[k] = dataclasses.replace(insts[k], chunk=0, buffer="act_in:%d:0" % insts[k].mb)
    with pytest.raises(PlanError):
        validate_plans([dataclasses.replace(q, instructions=tuple(insts)), plans[1]])
    # A chunk the plan does not run is refused.
    insts = list(q.instructions)
    insts[0] = dataclasses.replace(insts[0], chunk=5)
    with pytest.raises(PlanError, match="chunk 5"):
        validate_plans([dataclasses.replace(q, instructions=tuple(insts)), plans[1]])
    # Each chunk's passes run at its own level (meta chunk_recompute), not the rank's first chunk's.
    assert q.meta["chunk_recompute"] == [q.recompute] * 2
    mixed = dataclasses.replace(q, meta={**q.meta, "chunk_recompute": [q.recompute, "full"]})
    with pytest.raises(PlanError, match=r"chunk 1's level \(meta chunk_recompute\) 'full'"):
        validate_plans([mixed, plans[1]])


def test_executor_checks_interleaved_plans_locally():
    import dataclasses

    from dynapipe.errors import PlanError
    from dynapipe.runtime.plan_check import check_plan_locally

    it, _ = _chunked_iteration(2, "interleaved", n=5, dp=1)
    plan = it.plans[0][0]
    check_plan_locally(plan, stage=0, num_stages=2)  # accepted: the executor runs chunks
    ins = list(plan.instructions)
    ins[0] = dataclasses.replace(ins[0], chunk=2)
    with pytest.raises(PlanError, match="chunk 2 is not one of this plan's 2 virtual-pipeline chunk"):
        check_plan_locally(dataclasses.replace(plan, instructions=tuple(ins)), stage=0, num_stages=2)
    with pytest.raises(PlanError, match=r"meta\['chunks'\] is 'two'"):
        check_plan_locally(dataclasses.replace(plan, meta={**plan.meta, "chunks": "two"}), stage=0, num_stages=2)


def test_plan_command_writes_interleaved_plans_that_validate(tmp_path, capsys):
    from dynapipe.cli import main
    from dynapipe.data.synthetic import sample_lengths

    lengths = tmp_path / "lengths.txt"
    lengths.write_text("".join(f"{a} {b}\n" for a, b in sample_lengths(24, 5, 1024, True)))
    base = ["--model", "t5-11b", "--device", "a100-40gb", "--stages", "4", "--dp", "2", "--memory-limit-mb", "200000",
            "--lengths", str(lengths)]
    assert main(["plan", *base, "--placement", "interleaved", "--plan-out", str(tmp_path / "plans")]) == 0
    out, err = capsys.readouterr()
    plan = json.loads(out)
    assert plan["schedule"] in CHUNKED_SCHEDULE_NAMES and plan["placement"]["chunks"] == 2
    assert "even split" in err
    assert main(["validate", str(tmp_path / "plans")]) == 0
    assert "valid: 8 plans" in capsys.readouterr().out
    assert main(["trace", *base, "--placement", "interleaved", "--out", str(tmp_path / "t.json")]) == 0
    capsys.readouterr()
    ops = [e for e in json.loads((tmp_path / "t.json").read_text())["traceEvents"] if e.get("ph") == "X"]
    assert {e["args"]["chunk"] for e in ops} == {0, 1}
    assert main(["plan", *base, "--placement", "6+0,6+0,6+0,6+0|0+6,0+6,0+6"]) == 2
    assert "names" in capsys.readouterr().err
    # A chunked --schedule names the placement's schedule; the even split beside it takes auto.
    for schedule in ("interleaved", "interleaved-adaptive"):
        assert main(["plan", *base, "--placement", "interleaved", "--schedule", schedule]) == 0
        out, _ = capsys.readouterr()
        named = json.loads(out)
        assert named["schedule"] == schedule and named["even_split"]["simulated_ms"] > 0
    assert main(["trace", *base, "--placement", "interleaved", "--schedule", "interleaved-adaptive",
                 "--out", str(tmp_path / "a.json")]) == 0
    capsys.readouterr()
    # The unchunked names run as their interleaved forms, as training's --dynapipe-schedule reads them.
    for schedule, runs in (("1f1b", "interleaved"), ("adaptive", "interleaved-adaptive")):
        assert main(["plan", *base, "--placement", "interleaved", "--schedule", schedule]) == 0
        assert json.loads(capsys.readouterr()[0])["schedule"] == runs
    assert main(["plan", *base, "--schedule", "interleaved-adaptive"]) == 2
    assert "use --schedule 1f1b, adaptive or zb-h1 or auto" in capsys.readouterr().err


def test_interleaved_takes_megatrons_groups_when_the_spread_ones_do_not_fit():
    # 7 micro-batches on 4 ranks: the spread grouping runs all 7 through chunk 0 first (fewer
    # slots, but every rank warms up on all of them); Megatron's groups of 4 + 3 hold less. At a
    # limit only Megatron's groups fit at selective, the search used to fall back to full recompute.
    from dynapipe.config import load_device_config, load_model_config
    from dynapipe.cost import build_cost_model
    from plan_helpers import chunked_micro_batches

    model, P, v, M = load_model_config("gpt-7b"), 4, 2, 7
    cm = build_cost_model(model, load_device_config("a100-40gb"), P, placement=StagePlacement.even(model, P, chunks=v))
    mbs = chunked_micro_batches(np.full(M, 2048), 1)
    spread = search_schedules([mbs], cm, schedule="interleaved", recompute="selective")
    kind, mb, ch, nops = interleaved_arrays(P, v, M, spread=False)
    megatron = simulate(schedule_from_chunked_arrays("interleaved", kind, mb, ch, nops, chunks=v), spread.times[0])
    assert max(megatron.peak_mib) < max(spread.best.peak_mib)
    cap = (max(megatron.peak_mib) + max(spread.best.peak_mib)) / 2
    r = search_schedules([mbs], cm, schedule="interleaved", capacity_mib=cap)
    assert r.best.recompute == "selective" and max(r.best.peak_mib) <= cap
    assert r.best.makespan_ms == pytest.approx(megatron.makespan_ms)


def test_per_chunk_recompute_is_also_sized_for_megatrons_groups():
    # A per-chunk mix sized only for the spread groups recomputes more than Megatron's groups of
    # P need; the search tries the mix sized for each grouping and keeps the faster.
    from dynapipe.config import load_device_config, load_model_config
    from dynapipe.cost import build_cost_model
    from dynapipe.schedule.interleaved import chunk_levels
    from plan_helpers import chunked_micro_batches

    model, P, v, M = load_model_config("gpt-7b"), 4, 2, 7
    cm = build_cost_model(model, load_device_config("a100-40gb"), P, placement=StagePlacement.even(model, P, chunks=v))
    mbs = chunked_micro_batches(np.full(M, 2048), 1)
    levels = ["none", "selective", "full"]
    by_level = {lv: search_schedules([mbs], cm, schedule="interleaved", recompute=lv).times for lv in levels}
    cap = 40_000.0
    spread_mix = chunk_levels(by_level, levels, cap, spread=True)
    megatron_mix = chunk_levels(by_level, levels, cap, spread=False)
    assert megatron_mix.count("full") < spread_mix.count("full")
    mixed = lambda mix: StageTimes.mixed([by_level[mix[k]][0] for k in range(P * v)])  # noqa: E731
    as_spread = simulate(schedule_from_chunked_arrays("interleaved", *interleaved_arrays(P, v, M), chunks=v),
                         mixed(spread_mix))
    assert max(as_spread.peak_mib) <= cap
    r = search_schedules([mbs], cm, schedule="interleaved", capacity_mib=cap, per_stage=True)
    assert r.best.recompute == "per-stage" and r.best.stage_recompute == megatron_mix
    assert max(r.best.peak_mib) <= cap and r.best.makespan_ms < 0.97 * as_spread.makespan_ms


def test_chunked_candidates_carry_one_level_per_virtual_stage():
    # Uniform and per-chunk candidates alike: a list of P levels would read as one per rank.
    cm = AnalyticCostModel(GPT, DEVICE, 2).with_placement(StagePlacement.even(GPT, 2, chunks=2))
    mbs = [MicroBatch(samples=[i], seqlen=256) for i in range(3)]
    r = search_schedules([mbs], cm, schedule="auto", explain=True, capacity_mib=1e9)
    assert r.candidates and all(len(c.stage_recompute) == 4 for c in r.candidates)


def test_plan_command_names_a_per_chunk_mix_by_virtual_stage(tmp_path, capsys):
    from dynapipe.cli import main
    from dynapipe.data.synthetic import sample_lengths

    lengths = tmp_path / "lengths.txt"
    lengths.write_text("".join(f"{a} {b}\n" for a, b in sample_lengths(24, 5, 1024, True)))
    assert main(["plan", "--model", "t5-11b", "--device", "a100-40gb", "--stages", "4", "--dp", "2",
                 "--memory-limit-mb", "65000", "--lengths", str(lengths), "--placement", "interleaved"]) == 0
    out, err = capsys.readouterr()
    levels = json.loads(out)["recompute"]
    assert isinstance(levels, list) and len(levels) == 8 and len(set(levels)) > 1
    assert f"recompute {'/'.join(levels)} by virtual stage" in err
