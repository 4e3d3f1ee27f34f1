"""Plans for tensor-parallel stages: message shapes under sequence parallelism, the layout in
the plan, validation, rounding to the TP size; and the run-side checks that need no processes."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from dynapipe.batching.types import BatchPlan, MicroBatch
from dynapipe.config import TensorParallelConfig, load_device_config, load_model_config
from dynapipe.cost import build_cost_model
from dynapipe.errors import DynaPipeError, PlanError
from dynapipe.pipeline_planner import plan_iteration, round_for_sequence_parallel
from dynapipe.plan import deserialize_plan, serialize_plan
from dynapipe.plan.compile import compile_plans
from dynapipe.plan.instructions import (RecvActivationStart, RecvGradStart, SendActivationStart, SendGradStart,
                                        sequence_shards)
from dynapipe.plan.validate import validate_plans
from dynapipe.runtime.plan_source import IterationPlanner, PlannerSettings, check_planner_settings

MODEL = load_model_config("gpt-tiny")
DEVICE = load_device_config("cpu")
LENGTHS = np.random.default_rng(3).integers(5, 250, 24)
TRANSFERS = (SendActivationStart, RecvActivationStart, SendGradStart, RecvGradStart)


def _plan(tp: int, sp: bool, stages: int = 2, dp: int = 2):
    tpc = TensorParallelConfig(tp, sp) if tp > 1 else None
    cost = build_cost_model(MODEL, DEVICE, stages, None, tpc)
    return plan_iteration(LENGTHS, cost, dp=dp, tp=tp, memory_limit_mib=1e9)


def _messages(plans):
    for p in plans:
        for x in p.instructions:
            if isinstance(x, TRANSFERS):
                yield p, x


@pytest.mark.parametrize("sp", [False, True])
def test_tp_plans_carry_the_layout_and_sharded_messages(sp):
    it = _plan(2, sp)
    plans = it.all_plans()
    validate_plans(plans)  # the fast and the full validator accept [seqlen / tp, mbs, hidden]
    n = 0
    for p, x in _messages(plans):
        info = p.micro_batches[x.mb]
        (t,) = x.tensors
        assert t.shape == ((info.seqlen // 2) if sp else info.seqlen, info.mbs, MODEL.hidden_size)
        n += 1
    assert n > 0
    for p in plans:
        assert p.meta["tp"] == 2 and p.meta.get("sequence_parallel", False) == sp
        assert sequence_shards(p) == (2 if sp else 1)
        again = deserialize_plan(serialize_plan(p))  # the layout survives the plan's own format
        assert again.meta["tp"] == 2 and sequence_shards(again) == sequence_shards(p)


@pytest.mark.parametrize("sp", [False, True])
def test_interleaved_tp_plans_carry_the_layout_and_sharded_messages(sp):
    """Chunked plans (a T5 on an interleaved placement) under TP: the layout in meta, every message
    (decoder states and the encoder output) a sequence shard under SP, the validator agreeing."""
    from dynapipe.config import ModelConfig
    from dynapipe.cost.placement import StagePlacement

    t5 = ModelConfig(name="t5-tp", arch="t5", num_layers=4, encoder_layers=2, decoder_layers=2, hidden_size=64,
                     num_attention_heads=4, ffn_hidden_size=256, vocab_size=512, max_seq_length=512,
                     dtype="fp32").validate("t5-tp")
    placement = StagePlacement.parse("1+0,1+0|0+1,0+1", t5, 2)
    cost = build_cost_model(t5, DEVICE, 2, None, TensorParallelConfig(2, sp), placement=placement)
    lengths = np.stack([LENGTHS, LENGTHS // 3 + 4], axis=1)
    plans = plan_iteration(lengths, cost, dp=1, tp=2, memory_limit_mib=1e9, schedule="interleaved").all_plans()
    validate_plans(plans)
    shards = 2 if sp else 1
    names = set()
    for p, x in _messages(plans):
        info = p.micro_batches[x.mb]
        for t in x.tensors:
            names.add(t.name)
            if t.name == "encoder_output":
                assert t.shape[0] == info.seqlen // shards
            else:
                assert t.shape[0] in (info.seqlen // shards, info.dec_seqlen // shards)
    assert {"hidden_states", "encoder_output"} <= names
    for p in plans:
        assert p.meta["tp"] == 2 and p.meta.get("sequence_parallel", False) == sp and p.meta["chunks"] == 2


def test_tp1_plans_have_no_tp_keys():
    for p in _plan(1, False).all_plans():
        assert "tp" not in p.meta and "sequence_parallel" not in p.meta


def test_validation_refuses_messages_that_ignore_sequence_parallelism():
    plans = _plan(2, False).all_plans()
    # The same full-length messages, claimed to be sequence-parallel: every rank's transfer is wrong.
    claimed = [dataclasses.replace(p, meta={**p.meta, "sequence_parallel": True}) for p in plans]
    with pytest.raises(PlanError, match=r"expected \[seqlen / 2, mbs, hidden\]"):
        validate_plans(claimed)
    odd = [dataclasses.replace(p, meta={**p.meta, "tp": 0, "sequence_parallel": True}) for p in plans]
    with pytest.raises(PlanError, match="meta tp=0 is not a whole number of tensor-parallel ranks"):
        validate_plans(odd)


def test_sequence_parallel_rounds_lengths_to_the_tp_size():
    mbs = [MicroBatch(samples=[0, 1], seqlen=40), MicroBatch(samples=[2], seqlen=48)]
    plan = BatchPlan("dynapipe", mbs, num_stages=2, dp=1, objective_ms=0.0, padding_efficiency=1.0,
                     replica_time_ms=[0.0])
    assert round_for_sequence_parallel(plan, 2, 1024) is plan  # multiples of 8 already divide by 2, 4, 8
    rounded = round_for_sequence_parallel(plan, 3, 1024)
    assert [m.seqlen for m in rounded.micro_batches] == [42, 48]
    assert [m.seqlen for m in plan.micro_batches] == [40, 48]  # the input is not changed
    with pytest.raises(DynaPipeError, match="exceeds the model's 41 tokens"):
        round_for_sequence_parallel(plan, 3, 41)


def test_compile_refuses_lengths_sequence_parallelism_cannot_split():
    mbs = [MicroBatch(samples=[0], seqlen=41, real_tokens=41)]
    with pytest.raises(DynaPipeError, match="micro-batch 0 is padded to 41 tokens"):
        compile_plans("1f1b", mbs, MODEL, num_stages=2, tp=2, sequence_parallel=True)
    with pytest.raises(DynaPipeError, match="needs tp >= 2"):
        compile_plans("1f1b", mbs, MODEL, num_stages=2, tp=1, sequence_parallel=True)
    # The interleaved compiler too (it floored 101 tokens to messages of 50).
    from dynapipe.cost.placement import StagePlacement
    from dynapipe.plan.compile_chunked import compile_interleaved_1f1b

    layouts = StagePlacement.even(MODEL, 2, 2).virtual_layouts()
    with pytest.raises(DynaPipeError, match="micro-batch 0 is padded to 101 tokens"):
        compile_interleaved_1f1b([MicroBatch(samples=[i], seqlen=101, real_tokens=101) for i in range(4)], MODEL,
                                 layouts, 2, tp=2, sequence_parallel=True)


def test_planner_settings_build_a_tp_cost_model():
    s = PlannerSettings(model=MODEL, device=DEVICE, num_stages=2, dp=1, tp=2, sequence_parallel=True)
    planner = IterationPlanner(s)
    assert planner.cost_model.tp.size == 2 and planner.cost_model.tp.sequence_parallel
    plans = planner.plan(LENGTHS[:6], iteration=0)
    assert all(sequence_shards(p) == 2 for row in plans for p in row)
    with pytest.raises(DynaPipeError, match="sequence_parallel needs tp 2"):
        check_planner_settings(dataclasses.replace(s, tp=1))


def test_run_refuses_a_plan_of_another_tp_layout():
    from megatron_integration.tensor_parallel import check_plan_tensor_parallel

    plan = _plan(2, True, dp=1).plans[0][0]
    check_plan_tensor_parallel(plan, 2, True)
    with pytest.raises(PlanError, match="compiled for tensor-parallel size 2 with sequence parallelism, but this "
                                        "run has --tensor-model-parallel-size 2 without --sequence-parallel"):
        check_plan_tensor_parallel(plan, 2, False)
    with pytest.raises(PlanError, match="--tensor-model-parallel-size 4"):
        check_plan_tensor_parallel(plan, 4, True)


def test_sequence_parallel_norms_mark_their_parameters():
    """megatron-core's local spec (no Apex) gets norms whose gradients finalize_model_grads
    sums over the TP group; other specs are left alone."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_integration.tensor_parallel import SequenceParallelTorchNorm, sequence_parallel_block_spec

    spec = get_gpt_layer_local_spec()
    cfg = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, sequence_parallel=True,
                            tensor_model_parallel_size=2)
    assert sequence_parallel_block_spec(spec, dataclasses.replace(cfg, sequence_parallel=False), 2) is spec
    block = sequence_parallel_block_spec(spec, cfg, 2)
    assert isinstance(block, TransformerBlockSubmodules) and len(block.layer_specs) == 2
    layer = block.layer_specs[0].submodules
    if spec.submodules.input_layernorm is WrappedTorchNorm:
        assert layer.input_layernorm is SequenceParallelTorchNorm
        assert layer.pre_mlp_layernorm is SequenceParallelTorchNorm
        assert block.layer_norm is SequenceParallelTorchNorm
    norm = SequenceParallelTorchNorm(cfg, 64)
    assert all(p.sequence_parallel for p in norm.parameters()) and len(list(norm.parameters())) == 2


@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("interleaved", [False, True])
def test_the_schedule_search_prices_the_messages_the_plans_send(sp, interleaved):
    """Under sequence parallelism a TP rank sends ``[seqlen / tp, mbs, hidden]`` slices: the
    simulator prices each boundary's transfer at the bytes the compiled plans send, not the
    whole sequence's."""
    from dynapipe.config import load_cluster_config
    from dynapipe.cost.placement import StagePlacement
    from dynapipe.schedule.costs import stage_times
    from dynapipe.schedule.interleaved import virtual_stage_times_per_replica

    gpt = load_model_config("gpt-13b")
    cluster = load_cluster_config("a100-8x")
    placement = StagePlacement.parse("5,5|5,5|5,5|5,5" if interleaved else "20,20", gpt, 2)
    cost = build_cost_model(gpt, load_device_config("a100-40gb"), 2, None, TensorParallelConfig(2, sp),
                            placement=placement)
    mbs = [MicroBatch(samples=[0], seqlen=4096), MicroBatch(samples=[1, 2], seqlen=1024)]
    if interleaved:
        comm = virtual_stage_times_per_replica(cost, [mbs], cluster=cluster, tp=2)[0].act_comm_ms
    else:
        comm = stage_times(cost, mbs, cluster=cluster, tp=2).act_comm_ms
    shards = 2 if sp else 1
    for i, mb in enumerate(mbs):
        sent = mb.seqlen // shards * mb.mbs * gpt.hidden_size * gpt.dtype_bytes
        # Every boundary here is between ranks 2 apart (TP 2, DP 1): the same link each time.
        link = cluster.link(0, 2)
        assert comm[:, i] == pytest.approx(np.full(comm.shape[0], link.transfer_ms(sent)))
