"""Plan compilation and serialization."""
import dataclasses

import numpy as np
import pytest

from dynapipe.config import load_device_config, load_model_config
from dynapipe.cost import build_cost_model
from dynapipe.errors import DynaPipeError, PlanError
from dynapipe.plan import (FORMAT_VERSION, compile_plans, deserialize_plan, input_specs, message_specs,
                           serialize_plan, validate_plans)
from dynapipe.plan.instructions import (BackwardPass, ForwardPass, LoadInput, RecvActivationStart,
                                        SendActivationStart, SendGradStart)
from dynapipe.plan.serialize import HEADER_BYTES
from dynapipe.schedule import one_f_one_b, simulate, stage_times
from plan_helpers import chunked_micro_batches


@pytest.fixture(scope="module")
def tiny():
    return load_model_config("gpt-tiny")


def test_every_rank_gets_its_inputs_and_exact_shapes(tiny):
    mbs = chunked_micro_batches(np.random.default_rng(0).integers(1, 300, 20), 4, shuffle_seed=1)
    plans = compile_plans("1f1b", mbs, tiny, num_stages=3)
    assert [p.stage for p in plans] == [0, 1, 2]
    total = sum(m.real_tokens for m in mbs)
    for p in plans:
        assert p.loss_tokens == p.global_loss_tokens == total
        assert [m.samples for m in p.micro_batches] == [tuple(m.samples) for m in mbs]
        loads = {i.mb: i for i in p.instructions if isinstance(i, LoadInput)}
        fws = [i for i in p.instructions if isinstance(i, ForwardPass)]
        bws = [i for i in p.instructions if isinstance(i, BackwardPass)]
        assert len(fws) == len(bws) == len(mbs)
        for f in fws:
            mb = mbs[f.mb]
            assert (f.mbs, f.seqlen) == (mb.mbs, mb.seqlen)
            shape = (mb.mbs, mb.seqlen)
            if p.stage == 0:
                assert [(t.name, t.shape, t.dtype) for t in loads[f.mb].tensors] == [
                    ("tokens", shape, "int64"), ("position_ids", shape, "int64")]
            elif p.stage == 2:
                assert [(t.name, t.shape, t.dtype) for t in loads[f.mb].tensors] == [
                    ("labels", shape, "int64"), ("loss_mask", shape, "float32")]
            else:
                assert f.mb not in loads
        for inst in p.instructions:
            if isinstance(inst, (SendActivationStart, SendGradStart, RecvActivationStart)):
                mb = mbs[inst.mb]
                assert [(t.shape, t.dtype) for t in inst.tensors] == [((mb.seqlen, mb.mbs, 64), "float32")]
    validate_plans(plans)


def test_single_stage_loads_everything_and_sends_nothing(tiny):
    mbs = chunked_micro_batches([5, 9, 30, 31], 2)
    (plan,) = compile_plans("1f1b", mbs, tiny, num_stages=1)
    assert {t.name for i in plan.instructions if isinstance(i, LoadInput) for t in i.tensors} == {
        "tokens", "position_ids", "labels", "loss_mask"}
    assert not any(hasattr(i, "peer") for i in plan.instructions)
    validate_plans([plan])


def test_encoder_decoder_plans_carry_the_encoder_output():
    t5 = load_model_config("t5-11b")
    # Stages 0-1 encoder, 2-3 decoder (24 + 24 layers over 4 stages).
    assert [t.name for t in message_specs(t5, 0, 4, 2, 128, 32)] == ["hidden_states"]
    assert [(t.name, t.shape) for t in message_specs(t5, 1, 4, 2, 128, 32)] == [("encoder_output", (128, 2, 1024))]
    assert [(t.name, t.shape, t.dtype) for t in message_specs(t5, 2, 4, 2, 128, 32)] == [
        ("hidden_states", (32, 2, 1024), "bfloat16"), ("encoder_output", (128, 2, 1024), "bfloat16")]
    assert [t.name for t in input_specs(t5, 2, 4, 2, 128, 32)] == ["dec_tokens", "enc_mask", "dec_mask"]
    # Every stage masks padding (and packed samples) out of its attention itself.
    assert [(t.name, t.shape) for t in input_specs(t5, 1, 4, 2, 128, 32)] == [("enc_mask", (2, 128))]
    assert [(t.name, t.shape) for t in input_specs(t5, 3, 4, 2, 128, 32)] == [
        ("enc_mask", (2, 128)), ("dec_mask", (2, 32)), ("labels", (2, 32)), ("loss_mask", (2, 32))]
    rng = np.random.default_rng(3)
    mbs = chunked_micro_batches(rng.integers(1, 200, 12), 3, dec_lengths=rng.integers(1, 40, 12))
    cm = build_cost_model(t5, load_device_config("a100-40gb"), 4)
    plans = compile_plans("adaptive", mbs, t5, num_stages=4, cost_model=cm)
    validate_plans(plans)
    assert plans[0].loss_tokens == sum(m.real_tokens for m in mbs)


def test_compile_follows_the_given_schedule_and_timeline(tiny):
    mbs = chunked_micro_batches(np.arange(1, 41), 5)
    cm = build_cost_model(tiny, load_device_config("cpu"), 4)
    sched = one_f_one_b(4, len(mbs), recompute="selective")
    tl = simulate(sched, stage_times(cm, mbs, recompute="selective"))
    plans = compile_plans(sched, mbs, tiny, timeline=tl, iteration=7)
    for p, ops in zip(plans, sched.stage_ops):
        computed = [(type(i).__name__[0], i.mb) for i in p.instructions if isinstance(i, (ForwardPass, BackwardPass))]
        assert computed == [(op.kind, op.mb) for op in ops]
        assert p.iteration == 7 and p.recompute == "selective" and p.schedule == "1f1b"
        assert all(i.recompute == "selective" for i in p.instructions if isinstance(i, (ForwardPass, BackwardPass)))


def test_replicas_need_the_global_token_count(tiny):
    mbs = chunked_micro_batches([3, 4, 5], 1)
    with pytest.raises(DynaPipeError, match="global_loss_tokens"):
        compile_plans("1f1b", mbs, tiny, num_stages=2, num_replicas=2)


# -- serialization -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def plans(tiny):
    mbs = chunked_micro_batches(np.random.default_rng(1).integers(1, 500, 30), 3)
    return compile_plans("adaptive", mbs, tiny, num_stages=4)


def test_round_trip_is_exact_and_deterministic(plans):
    for p in plans:
        data = serialize_plan(p)
        back = deserialize_plan(data)
        assert back == p and back.meta == p.meta
        assert serialize_plan(back) == data
        assert data[:4] == b"DPPL" and int.from_bytes(data[4:6], "big") == FORMAT_VERSION


def test_payload_is_compact(plans):
    p = plans[1]
    assert len(serialize_plan(p)) < 12 * len(p.instructions)


@pytest.mark.parametrize("cut", [0, 3, HEADER_BYTES - 1, HEADER_BYTES, HEADER_BYTES + 10, -1])
def test_truncated_payload_is_rejected(plans, cut):
    data = serialize_plan(plans[0])
    with pytest.raises(PlanError, match="truncated"):
        deserialize_plan(data[:cut])


def test_corrupted_payload_is_rejected(plans):
    data = bytearray(serialize_plan(plans[2]))
    for pos in (HEADER_BYTES, len(data) // 2, len(data) - 1):
        bad = bytearray(data)
        bad[pos] ^= 0x40
        with pytest.raises(PlanError, match="corrupted"):
            deserialize_plan(bytes(bad))
    with pytest.raises(PlanError, match="not a DynaPipe execution plan"):
        deserialize_plan(b"XXXX" + bytes(data[4:]))
    wrong_version = bytes(data[:4]) + (FORMAT_VERSION + 1).to_bytes(2, "big") + bytes(data[6:])
    with pytest.raises(PlanError, match="version"):
        deserialize_plan(wrong_version)
    with pytest.raises(PlanError, match="trailing"):
        deserialize_plan(bytes(data) + b"\x00")
    with pytest.raises(PlanError, match="must be bytes"):
        deserialize_plan("not bytes")


def test_meta_must_be_json(plans):
    p = dataclasses.replace(plans[0], meta={"bad": object()})
    with pytest.raises(PlanError, match="cannot be serialized"):
        serialize_plan(p)


def _repack(doc: dict) -> bytes:
    import json
    import struct
    import zlib
    payload = zlib.compress(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode("ascii"))
    return struct.pack(">4sHHII", b"DPPL", 1, 1, len(payload), zlib.crc32(payload)) + payload


def test_well_formed_version1_bytes_with_bad_fields_are_rejected(plans):
    import json
    import zlib
    from dynapipe.plan.serialize import serialize_plan_v1
    doc = json.loads(zlib.decompress(serialize_plan_v1(plans[1])[16:]))
    assert deserialize_plan(_repack(doc)) == plans[1]
    cases = [
        (lambda d: d["instructions"][0].__setitem__(0, "launch_missiles"), "unknown opcode"),
        (lambda d: d["instructions"][1].__setitem__(1, "7"), "must be an integer"),
        (lambda d: d["tensors"][0][0].__setitem__(2, "complex128"), "dtype"),
        (lambda d: d["tensors"][0][0].__setitem__(1, [-1, 2, 3]), "non-negative"),
        (lambda d: d.pop("stage"), "missing field"),
        (lambda d: d["micro_batches"][0].__setitem__(1, ["0"]), "integers only"),
    ]
    for mutate, message in cases:
        bad = json.loads(json.dumps(doc))
        mutate(bad)
        with pytest.raises(PlanError, match=message):
            deserialize_plan(_repack(bad))
    # An instruction referring past the end of the tensor table.
    bad = json.loads(json.dumps(doc))
    comm = next(row for row in bad["instructions"] if row[0] == "recv_act_start")
    comm[5] = len(bad["tensors"])
    with pytest.raises(PlanError, match="index the tensor table"):
        deserialize_plan(_repack(bad))


def test_fast_built_instructions_equal_and_hash_like_constructed_ones(plans):
    back = deserialize_plan(serialize_plan(plans[2]))
    for a, b in zip(plans[2].instructions, back.instructions):
        rebuilt = type(a)(**{f.name: getattr(a, f.name) for f in dataclasses.fields(a)})
        assert a == rebuilt == b and hash(a) == hash(rebuilt) == hash(b)


def test_each_rank_carries_its_stage_recompute_level(tiny):
    mbs = chunked_micro_batches(np.arange(1, 25), 4)
    sched = one_f_one_b(3, len(mbs), recompute="per-stage", stage_recompute=("full", "selective", "none"))
    plans = compile_plans(sched, mbs, tiny)
    assert [p.recompute for p in plans] == ["full", "selective", "none"]
    for p in plans:
        assert {i.recompute for i in p.instructions if isinstance(i, (ForwardPass, BackwardPass))} == {p.recompute}
    validate_plans(plans)
