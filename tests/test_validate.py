"""The validator catches each class of broken plan and accepts every compiled plan."""
import dataclasses
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynapipe.config import ClusterConfig, load_device_config, load_model_config
from dynapipe.cost import build_cost_model
from dynapipe.errors import NoScheduleFits, PlanError
from dynapipe.pipeline_planner import plan_iteration
from dynapipe.plan import compile_plans, validate_plans
from dynapipe.plan.instructions import (BackwardPass, FreeBuffer, RecvActivationFinish, RecvActivationStart,
                                        RecvGradFinish, RecvGradStart, SendActivationFinish, SendActivationStart,
                                        SendGradStart, TensorSpec)
from dynapipe.schedule import Op, Schedule, StageTimes, one_f_one_b, simulate
from plan_helpers import chunked_micro_batches

TINY = load_model_config("gpt-tiny")


def plans_for(lengths, size, S=2, schedule="1f1b"):
    return compile_plans(schedule, chunked_micro_batches(lengths, size), TINY, num_stages=S)


def edit(plan, instructions):
    return dataclasses.replace(plan, instructions=tuple(instructions))


def index_of(plan, cls, mb=None, buffer=None):
    for k, inst in enumerate(plan.instructions):
        if isinstance(inst, cls) and (mb is None or inst.mb == mb) and (buffer is None or inst.buffer == buffer):
            return k
    raise AssertionError(f"no {cls.__name__} in plan")


def test_compiled_plans_pass():
    summary = validate_plans(plans_for(range(1, 41), 4, S=3))
    assert summary.stages == 3 and summary.micro_batches == 10 and summary.transfers == 2 * 2 * 10
    assert "valid: 3 plans" in summary.line()


def test_shape_mismatch():
    plans = plans_for(range(1, 13), 3)
    r1 = list(plans[1].instructions)
    for k, inst in enumerate(r1):
        if isinstance(inst, (RecvActivationStart, RecvActivationFinish)) and inst.mb == 2:
            (t,) = inst.tensors
            r1[k] = dataclasses.replace(inst, tensors=(TensorSpec(t.name, t.shape[:2] + (32,), t.dtype),))
    with pytest.raises(PlanError, match=r"rank 1 instruction \d+ \(recv_act_start micro-batch 2\): expects "
                                        r".*\[\d+, 3, 32\].* sends .*\[\d+, 3, 64\].*shape mismatch"):
        validate_plans([plans[0], edit(plans[1], r1)])


def test_dtype_mismatch_is_a_shape_mismatch_too():
    plans = plans_for(range(1, 13), 3)
    r0 = list(plans[0].instructions)
    for k, inst in enumerate(r0):
        if isinstance(inst, SendActivationStart | SendActivationFinish) and inst.mb == 1:
            r0[k] = dataclasses.replace(inst, tensors=tuple(dataclasses.replace(t, dtype="bfloat16")
                                                             for t in inst.tensors))
    with pytest.raises(PlanError, match="bfloat16.*shape mismatch"):
        validate_plans([edit(plans[0], r0), plans[1]])


@pytest.mark.parametrize("change, needle", [
    # Both ends of every transfer agree, so only the tensors' own sense can refuse these.
    (lambda t: TensorSpec(t.name, t.shape[:-1] + (0,), t.dtype), r"has shape \[(\d+, )+0\]; every dimension"),
    (lambda t: TensorSpec(t.name, t.shape, "float32") if t.name == "tokens" else t, "'tokens' is float32"),
])
def test_tensors_no_layer_can_take_are_refused_though_both_ends_agree(change, needle):
    from dynapipe.plan.instructions import LoadInput

    plans = plans_for(range(1, 13), 3)
    edited = []
    for p in plans:
        ins = [dataclasses.replace(i, tensors=tuple(change(t) for t in i.tensors))
               if getattr(i, "tensors", None) and (isinstance(i, LoadInput) or len(i.tensors[0].shape) == 3) else i
               for i in p.instructions]
        edited.append(edit(p, ins))
    with pytest.raises(PlanError, match=needle):
        validate_plans(edited)


def test_ranks_that_name_another_schedule_are_refused():
    plans = plans_for(range(1, 13), 3)
    with pytest.raises(PlanError, match="rank 1: schedule=zb-h1 differs from rank 0's 1f1b; the plans of one "
                                        "iteration must all come from one planning run"):
        validate_plans([plans[0], dataclasses.replace(plans[1], schedule="zb-h1")])


def test_swapped_send_order():
    # Rank 0 runs micro-batch 1's forward (and sends it) before micro-batch 0's, rank 1
    # expects them in the original order: NCCL would pair the messages wrongly.
    mbs = chunked_micro_batches([8] * 6, 2)
    normal = one_f_one_b(2, 3)
    s0 = (Op("F", 1), Op("F", 0), Op("B", 0), Op("F", 2), Op("B", 1), Op("B", 2))
    # Named as rank 1's schedule: only the message order differs (another name is refused first).
    swapped = Schedule("1f1b", 2, (s0, normal.stage_ops[1]))
    times = StageTimes(*(np.ones((2, 3)),) * 4, np.zeros((1, 3)), np.zeros((1, 3)), np.zeros(2))
    good = compile_plans(normal, mbs, TINY)
    bad = compile_plans(swapped, mbs, TINY, timeline=simulate(swapped, times))
    with pytest.raises(PlanError, match=r"rank 1 instruction \d+ .*message order differs from the sender: rank 0's "
                                        r"message #0 to rank 1 is the act of micro-batch 1 .*swapped send order"):
        validate_plans([bad[0], good[1]])


def test_swapped_receive_order():
    # Rank 1 posts the receive of micro-batch 1 ahead of micro-batch 0's.
    plans = plans_for(range(1, 25), 3)
    r1 = list(plans[1].instructions)
    first = index_of(plans[1], RecvActivationStart, mb=0)
    second = index_of(plans[1], RecvActivationStart, mb=1)
    r1.insert(first, r1.pop(second))
    with pytest.raises(PlanError, match=r"rank 1 instruction \d+ \(recv_act_start micro-batch 1\): message order "
                                        r"differs from the sender"):
        validate_plans([plans[0], edit(plans[1], r1)])


def test_missing_receive():
    plans = plans_for(range(1, 13), 3)
    r0 = [i for i in plans[0].instructions if not (isinstance(i, (RecvGradStart, RecvGradFinish)) and i.mb == 3)]
    with pytest.raises(PlanError, match=r"rank 1 instruction \d+ \(send_grad_start micro-batch 3\): rank 0 posts "
                                        r"no matching receive \(missing receive"):
        validate_plans([edit(plans[0], r0), plans[1]])


def test_missing_send():
    plans = plans_for(range(1, 13), 3)
    r0 = [i for i in plans[0].instructions
          if not (isinstance(i, (SendActivationStart, SendActivationFinish)) and i.mb == 0)]
    with pytest.raises(PlanError, match="rank 0 never sends the act of micro-batch 0.*missing send"):
        validate_plans([edit(plans[0], r0), plans[1]])


def test_double_free():
    plans = plans_for(range(1, 13), 3)
    r1 = list(plans[1].instructions)
    k = index_of(plans[1], FreeBuffer, mb=1, buffer="act_in:1:0")
    r1.insert(k + 1, r1[k])
    with pytest.raises(PlanError, match=rf"rank 1 instruction {k + 1} \(free micro-batch 1\): frees buffer "
                                        rf"'act_in:1:0' a second time \(double free; first at instruction {k}\)"):
        validate_plans([plans[0], edit(plans[1], r1)])


def test_use_after_free():
    plans = plans_for(range(1, 13), 3)
    r0 = list(plans[0].instructions)
    free = index_of(plans[0], FreeBuffer, mb=2, buffer="act_out:2:0")
    bw = index_of(plans[0], BackwardPass, mb=2)
    r0.insert(bw, r0.pop(free))
    with pytest.raises(PlanError, match=rf"rank 0 instruction {bw + 1} \(bw micro-batch 2\): uses buffer "
                                        rf"'act_out:2:0' after it was freed at instruction {bw}"):
        validate_plans([edit(plans[0], r0), plans[1]])


def test_deadlock_is_found_by_the_symbolic_run():
    # One micro-batch: rank 0 waits for the gradient before sending the activation.
    plans = plans_for([16], 1)
    r0 = list(plans[0].instructions)
    send = [r0.pop(index_of(plans[0], SendActivationStart)), None]
    send[1] = r0.pop(next(k for k, i in enumerate(r0) if isinstance(i, SendActivationFinish)))
    bw = next(k for k, i in enumerate(r0) if isinstance(i, BackwardPass))
    r0[bw:bw] = send
    with pytest.raises(PlanError, match=r"deadlock.*rank 0 instruction \d+ \(recv_grad_finish micro-batch 0\) waits"
                                        r".*rank 1 instruction \d+ \(recv_act_finish micro-batch 0\) waits"):
        validate_plans([edit(plans[0], r0), plans[1]])


def test_grouped_posts_complete_together_and_must_match():
    plans = plans_for([8, 8, 8, 8], 2)
    ok = validate_plans(plans)
    # A group on one side whose partner ops are not both at the head on the other
    # side cannot complete under the conservative model.
    r0 = list(plans[0].instructions)
    send1 = index_of(plans[0], SendActivationStart, mb=1)
    grad0 = index_of(plans[0], RecvGradStart, mb=0)
    assert grad0 == send1 + 1, "the compiled order posts send act 1 then receive grad 0"
    r0[send1] = dataclasses.replace(r0[send1], group=5)
    r0[grad0] = dataclasses.replace(r0[grad0], group=5)
    # Grouped on one end only: refused by name (NCCL can hang on batched lists that differ).
    with pytest.raises(PlanError, match="is posted in group 5 but its partner .* is posted alone"):
        validate_plans([edit(plans[0], r0), plans[1]])
    # Grouped on both ends, each in a group of its own on rank 1 in the compiled order.
    r1 = [dataclasses.replace(i, group=10 + k) if (isinstance(i, SendGradStart) and i.mb == 0) or
          (isinstance(i, RecvActivationStart) and i.mb == 1) else i for k, i in enumerate(plans[1].instructions)]
    with pytest.raises(PlanError, match="deadlock"):
        validate_plans([edit(plans[0], r0), edit(plans[1], r1)])
    assert ok.transfers == 4
    # The same pair grouped on both sides (rank 1: send gradient 0 + receive activation
    # 1, as Megatron's send_backward_recv_forward) completes.
    r1 = list(plans[1].instructions)
    act1 = r1.pop(index_of(plans[1], RecvActivationStart, mb=1))
    sg0 = next(k for k, i in enumerate(r1) if isinstance(i, SendGradStart) and i.mb == 0)
    r1[sg0] = dataclasses.replace(r1[sg0], group=7)
    r1.insert(sg0 + 1, dataclasses.replace(act1, group=7))
    validate_plans([edit(plans[0], r0), edit(plans[1], r1)])


def test_unfinished_transfer_leak_and_early_free():
    plans = plans_for([8, 16, 24, 32], 2)
    r1 = list(plans[1].instructions)
    k = next(k for k, i in enumerate(r1) if isinstance(i, RecvActivationFinish))
    with pytest.raises(PlanError, match="is never finished"):
        validate_plans([plans[0], edit(plans[1], r1[:k] + r1[k + 1:])])
    last_free = max(k for k, i in enumerate(r1) if isinstance(i, FreeBuffer))
    with pytest.raises(PlanError, match="is never freed"):
        validate_plans([plans[0], edit(plans[1], r1[:last_free] + r1[last_free + 1:])])
    r0 = list(plans[0].instructions)
    sg = index_of(plans[1], SendGradStart, mb=0)
    r1b = list(r1)
    r1b.insert(sg + 1, FreeBuffer(mb=0, buffer="grad_out:0:0"))
    with pytest.raises(PlanError, match="while a transfer of it is still in flight"):
        validate_plans([edit(plans[0], r0), edit(plans[1], r1b)])


def test_plan_set_structure():
    plans = plans_for([8, 16, 24, 32], 2, S=3)
    with pytest.raises(PlanError, match=r"no plan for rank\(s\) \[1\]"):
        validate_plans([plans[0], plans[2]])
    with pytest.raises(PlanError, match="two plans"):
        validate_plans([plans[0], plans[0], plans[1], plans[2]])
    wrong = dataclasses.replace(plans[2], global_loss_tokens=plans[2].global_loss_tokens + 1)
    with pytest.raises(PlanError, match="global_loss_tokens"):
        validate_plans([plans[0], plans[1], wrong])


# -- property: every compiled plan passes ------------------------------------------------

GPT7B = load_model_config("gpt-7b")
A100 = load_device_config("a100-40gb")
COST = {S: build_cost_model(GPT7B, A100, S) for S in (2, 3, 4, 8)}
LINKS = ClusterConfig("test", gpus_per_node=4)


@pytest.mark.parametrize("schedule", ["1f1b", "adaptive", "auto"])
@pytest.mark.parametrize("S", [2, 3, 4, 8])
# 12 parametrisations x 40 random batches per run keep the property in CI's time budget;
# Hypothesis draws new batches on every run.
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=st.lists(st.integers(1, 1024), min_size=1, max_size=48), dp=st.sampled_from([1, 2]),
       headroom=st.sampled_from([None, 3000.0, 20000.0]))
def test_plans_from_random_batches_validate(schedule, S, lengths, dp, headroom):
    # Memory: unlimited, or the model states plus a little or a lot of room for activations,
    # so that the adaptive schedule's memory bound and the recompute search both get used.
    cm = COST[S]
    dp = min(dp, len(lengths))  # the planner refuses more replicas than samples
    limit = 1e12 if headroom is None else cm.model_state_mib() + A100.reserved_mib + headroom
    try:
        it = plan_iteration(np.array(lengths), cm, dp=dp, schedule=schedule, cluster=LINKS,
                            memory_limit_mib=limit)
    except NoScheduleFits:
        # The one acceptable refusal: under a memory limit, no schedule of the cut fits. (No
        # sample is refused alone: one of 1024 tokens needs at most ~930 MiB of activations at
        # full recompute, well inside the smallest headroom.)
        if headroom is None:
            raise
        return
    summary = validate_plans(it.all_plans())
    assert summary.replicas == dp and summary.stages == S
    samples = sorted(x for rep in it.plans for m in rep[0].micro_batches for x in m.samples)
    assert samples == list(range(len(lengths)))
    assert it.plans[0][0].global_loss_tokens == sum(lengths)


@settings(max_examples=60, deadline=None)
@given(S=st.sampled_from([2, 3, 4, 8]), m=st.integers(1, 24), uniform=st.booleans(), seed=st.integers(0, 2**16),
       comm=st.sampled_from([0.0, 0.5]))
def test_plans_from_random_costs_validate(S, m, uniform, seed, comm):
    # Uniform costs make many transfers ready at the same instant: the global order's
    # tie-breaking must still give every rank a consistent posting order.
    rng = np.random.default_rng(seed)
    mbs = chunked_micro_batches(rng.integers(1, 64, size=2 * m), 2)
    M = len(mbs)
    fw = np.ones((S, M)) if uniform else rng.uniform(0.1, 3.0, size=(S, M))
    c = np.full((S - 1, M), comm)
    times = StageTimes(fw, 2 * fw, fw, fw, c, c.copy(), np.zeros(S))
    for sched in (one_f_one_b(S, M),):
        validate_plans(compile_plans(sched, mbs, TINY if S <= 4 else GPT7B, timeline=simulate(sched, times)))
    from dynapipe.schedule import adaptive_schedule
    sched, tl = adaptive_schedule(times, capacity_mib=np.full(S, 3 * fw.max()))
    validate_plans(compile_plans(sched, mbs, TINY if S <= 4 else GPT7B, timeline=tl))


def test_encoder_decoder_loss_tokens_are_bounded_by_the_decoder_rows():
    # Encoder-decoder losses count targets only: mbs x dec_seqlen bounds them, not the input too
    # (the looser bound let a planner's untruncated target count through).
    from dynapipe.pipeline_planner import plan_iteration

    cm = build_cost_model(load_model_config("t5-11b"), A100, 8)
    it = plan_iteration([[100, 40], [40, 60]], cm, validate=True)
    plans = it.plans[0]
    mb = plans[0].micro_batches[0]
    over = dataclasses.replace(mb, loss_tokens=mb.mbs * mb.dec_seqlen + 1)
    assert over.loss_tokens <= mb.mbs * (mb.seqlen + mb.dec_seqlen)
    bad = [dataclasses.replace(p, micro_batches=(over,) + tuple(p.micro_batches[1:])) for p in plans]
    with pytest.raises(PlanError, match=rf"micro-batch {mb.mb} .* {mb.mbs} x {mb.dec_seqlen} padded target tokens"):
        validate_plans(bad)


def _every(plans, **meta):
    return [dataclasses.replace(p, meta={**p.meta, **meta}) for p in plans]


def _first_mb(plans, **fields):
    mb = dataclasses.replace(plans[0].micro_batches[0], **fields)
    return [dataclasses.replace(p, micro_batches=(mb,) + tuple(p.micro_batches[1:])) for p in plans]


@pytest.mark.parametrize("breakage, match", [
    # Each of these passed before: the instructions alone do not show them.
    (lambda ps: [dataclasses.replace(ps[0], meta={**ps[0].meta, "tp": 4})] + ps[1:],
     r"rank 1: meta tp=None differs from rank 0's 4"),
    (lambda ps: [ps[0]] + _every(ps[1:], forward_only=True), r"meta forward_only=True differs from rank 0's None"),
    (lambda ps: [dataclasses.replace(ps[0], meta={**ps[0].meta, "placement": {"layers": [1, 3]}})] + ps[1:],
     r"meta placement=None differs from rank 0's \{'layers': \[1, 3\]\}"),
    (lambda ps: _every(ps, tp=-1), r"meta tp=-1 is not a whole number"),
    (lambda ps: _every(ps, mb_order=[99, -1]), r"mb_order=\[99, -1\] is not an order of the plan's 2 micro-batches"),
    (lambda ps: [dataclasses.replace(p, iteration=-1) for p in ps], r"iteration=-1 is not a whole number from 0"),
    (lambda ps: [dataclasses.replace(p, recompute="bogus") for p in ps], r"recompute='bogus' is not one of"),
    # The plan says full while its passes store everything: memory the plan did not price.
    (lambda ps: [dataclasses.replace(ps[0], recompute="full")] + ps[1:],
     r"rank 0 instruction \d+ \(fw micro-batch 0\): recompute level 'none' differs from the plan's recompute "
     r"level 'full'"),
    (lambda ps: _first_mb(ps, samples=(-5, 1)), r"micro-batch 0 has samples \[-5, 1\]; samples are indices"),
    (lambda ps: _first_mb(ps, samples=(0, 1, 5)), r"micro-batch 0 has 2 row\(s\) but 3 samples"),
])
def test_edited_plans_are_refused(breakage, match):
    plans = plans_for([8, 16, 24, 32], 2)
    validate_plans(plans)
    with pytest.raises(PlanError, match=match):
        validate_plans(breakage(list(plans)))


@pytest.mark.parametrize("micro_batch, match", [
    (dict(samples=[0], seqlen=0), r"micro-batch 0 has seqlen=0; it needs a whole number of tokens from 1 to the "
                                  r"model's max_seq_length 1024"),
    (dict(samples=[0], seqlen=10 ** 6), r"seqlen=1000000"),
    (dict(samples=[0], seqlen=63.5), r"seqlen=63.5"),
    (dict(samples=[0], seqlen="64"), r"seqlen='64'"),
    (dict(samples=[0], seqlen=64, dec_seqlen=32), r"dec_seqlen=32 but 'gpt-tiny' is decoder-only"),
    (dict(samples=[], seqlen=64), r"micro-batch 0 has no samples"),
    (dict(samples=[-3], seqlen=64), r"micro-batch 0 has samples \[-3\]"),
])
def test_compile_refuses_micro_batches_no_stage_could_run(micro_batch, match):
    from dynapipe.batching import MicroBatch
    from dynapipe.errors import DynaPipeError

    compile_plans("1f1b", [MicroBatch([0], 64)], TINY, num_stages=2)
    with pytest.raises(DynaPipeError, match=match):
        compile_plans("1f1b", [MicroBatch(**micro_batch)], TINY, num_stages=2)
    with pytest.raises(DynaPipeError, match=r"iteration=1.5: must be a whole number of at least 0"):
        compile_plans("1f1b", [MicroBatch([0], 64)], TINY, num_stages=2, iteration=1.5)
    with pytest.raises(DynaPipeError, match=r"num_stages=2.0: must be a whole number"):
        compile_plans("1f1b", [MicroBatch([0], 64)], TINY, num_stages=2.0)


def test_compile_refuses_an_encoder_decoder_micro_batch_without_decoder_tokens():
    from dynapipe.batching import MicroBatch
    from dynapipe.errors import DynaPipeError

    t5 = load_model_config("t5-11b")
    compile_plans("1f1b", [MicroBatch([0], 64, dec_seqlen=16)], t5, num_stages=2)
    with pytest.raises(DynaPipeError, match=r"micro-batch 0 has dec_seqlen=0; it needs a whole number of tokens "
                                            r"from 1"):
        compile_plans("1f1b", [MicroBatch([0], 64)], t5, num_stages=2)


def test_a_micro_batch_of_padding_rows_only_compiles_and_validates():
    # The fixed-shape T5 packing baseline fills a replica's last micro-batch with empty rows.
    from dynapipe.batching import MicroBatch
    from dynapipe.errors import DynaPipeError

    t5 = load_model_config("t5-11b")
    mbs = [MicroBatch([0, 1], 64, dec_seqlen=16, rows=[[0, 1], []]), MicroBatch([], 64, dec_seqlen=16, rows=[[], []])]
    validate_plans(compile_plans("1f1b", mbs, t5, num_stages=2))
    with pytest.raises(DynaPipeError, match="micro-batch 1 has no samples"):
        compile_plans("1f1b", mbs[:1] + [MicroBatch([], 64, dec_seqlen=16, rows=[])], t5, num_stages=2)


@pytest.mark.parametrize("cls,stage,peer,needle", [
    (SendActivationStart, 0, 2, "sends the act of micro-batch 0 to rank 2, but the next stage, virtual stage 1, is rank 1"),
    (RecvActivationStart, 2, 0, "receives the act of micro-batch 0 from rank 0, but the previous stage, virtual "
                                "stage 1, is rank 1"),
    (SendGradStart, 2, 0, "sends the grad of micro-batch 0 to rank 0, but the previous stage, virtual stage 1, is "
                          "rank 1"),
])
def test_a_message_to_a_rank_that_is_not_the_neighbour_stage_is_refused(cls, stage, peer, needle):
    # Three stages: an activation from rank 0 straight to rank 2 would skip stage 1's layers;
    # every other check (matched pairs, order, shapes) can still hold.
    from dynapipe.plan.validate_transfers import FINISH_OF
    from dynapipe.runtime.plan_check import check_plan_locally

    plans = plans_for([8, 8, 8], 3, S=3)
    finish = next(f for f, s in FINISH_OF.items() if s is cls)
    rows = [dataclasses.replace(i, peer=peer) if isinstance(i, (cls, finish)) and i.mb == 0 else i
            for i in plans[stage].instructions]
    bad = edit(plans[stage], rows)
    with pytest.raises(PlanError, match=re.escape(needle)):
        validate_plans([bad if s == stage else p for s, p in enumerate(plans)])
    with pytest.raises(PlanError, match=re.escape(needle)):
        check_plan_locally(bad, stage=stage, num_stages=3)


def test_the_first_and_last_virtual_stages_have_no_neighbour_beyond_them():
    from dynapipe.plan.validate_transfers import neighbour_error

    spec = (TensorSpec("h", (8, 1, 64), "float32"),)
    first = RecvActivationStart(mb=0, chunk=0, peer=1, buffer="act_in:0:0", tensors=spec)
    assert neighbour_error(first, 0, 2, 2) == ("virtual stage 0 (chunk 0 of rank 0) has no previous stage to receive "
                                               "the act of micro-batch 0 from.")
    # The wrap-around from rank 1's chunk 0 arrives in rank 0's chunk 1 (virtual stage 2).
    assert neighbour_error(dataclasses.replace(first, chunk=1), 0, 2, 2) == ""
    last = SendActivationStart(mb=0, chunk=1, peer=0, buffer="act_out:0:1", tensors=spec)
    assert "virtual stage 3 (chunk 1 of rank 1) has no next stage" in neighbour_error(last, 1, 2, 2)


def test_samples_outside_the_global_batch_or_twice_are_refused():
    # Samples index the global batch: 0..n-1, each once over every replica.
    plans = plans_for(range(1, 9), 2)
    assert validate_plans(plans)

    def with_samples(mb, samples):
        out = []
        for p in plans:
            mbs = [dataclasses.replace(m, samples=tuple(samples)) if m.mb == mb else m for m in p.micro_batches]
            out.append(dataclasses.replace(p, micro_batches=tuple(mbs)))
        return out

    first = plans[0].micro_batches[0]
    far = [9999] + list(first.samples[1:])
    with pytest.raises(PlanError, match=rf"samples \[1, 2, 3\]...\[7, 9999\], .* sample 9999 is outside it "
                                         rf"and sample {first.samples[0]} is missing"):
        validate_plans(with_samples(0, far))
    twice = list(plans[0].micro_batches[1].samples[:1]) + list(first.samples[1:])
    with pytest.raises(PlanError, match="every sample is trained once"):
        validate_plans(with_samples(0, twice))
