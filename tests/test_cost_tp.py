"""Cost model per tensor-parallel size: compute split, TP collectives, activations and model
states per TP rank, with and without sequence parallelism; ``plan``/``cost --tp``."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from dynapipe.cli import main
from dynapipe.config import LinkConfig, TensorParallelConfig, load_device_config, load_model_config
from dynapipe.cost import AnalyticCostModel, build_cost_model
from dynapipe.errors import DynaPipeError

MODEL = load_model_config("gpt-13b")
DEVICE = load_device_config("a100-40gb")
NVLINK = LinkConfig(150.0, 0.01)
FREE = LinkConfig(1e12, 0.0)  # a link that costs nothing: isolates the compute split
MBS = np.array([1, 2, 4, 8])
SEQ = np.array([2048, 1024, 512, 256])


def _cost(tp=1, sp=False, link=NVLINK, recompute="none", stage=1, mbs=MBS, seq=SEQ):
    model = AnalyticCostModel(MODEL, DEVICE, 4, TensorParallelConfig(tp, sp, link))
    return model, model.stage_cost(mbs, seq, recompute=recompute, stage=stage)


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_tp2_halves_compute_on_a_free_link(stage):
    _, one = _cost(1, stage=stage)
    _, two = _cost(2, link=FREE, stage=stage)
    ov = DEVICE.op_overhead_ms
    np.testing.assert_allclose(two.fw_ms - ov, (one.fw_ms - ov) / 2, rtol=1e-9)
    np.testing.assert_allclose(two.bw_ms - ov, (one.bw_ms - ov) / 2, rtol=1e-9)


def test_tp_collectives_grow_with_tokens():
    _, free = _cost(2, link=FREE, mbs=np.array([1, 2, 4]), seq=np.array([512, 512, 512]))
    _, nvl = _cost(2, mbs=np.array([1, 2, 4]), seq=np.array([512, 512, 512]))
    comm_fw = nvl.fw_ms - free.fw_ms
    comm_bw = nvl.bw_ms - free.bw_ms
    assert (comm_fw > 0).all() and (comm_bw > 0).all()
    # Ring volume is linear in tokens: doubling tokens doubles the bandwidth part.
    lat = comm_fw[0] - (comm_fw[1] - comm_fw[0])
    np.testing.assert_allclose(comm_fw - lat, (comm_fw[0] - lat) * np.array([1, 2, 4]), rtol=1e-9)
    # Stage 1 holds 10 layers, 2 all-reduces of b*s*h bf16 each, 2(t-1)/t of it on the wire.
    layers = 10
    nbytes = 512 * MODEL.hidden_size * 2
    expected = layers * 2 * (2 * NVLINK.latency_ms + nbytes / (NVLINK.bandwidth_gbps * 1e6))
    assert comm_fw[0] == pytest.approx(expected, rel=1e-9)
    # TP4 moves 3/4 of the data per rank instead of 1/2: more communication, less compute.
    _, four = _cost(4, mbs=np.array([1]), seq=np.array([512]))
    _, four_free = _cost(4, link=FREE, mbs=np.array([1]), seq=np.array([512]))
    assert (four.fw_ms - four_free.fw_ms)[0] > comm_fw[0]


def test_full_recompute_repeats_the_forward_collectives():
    _, none_free = _cost(2, link=FREE)
    _, none_nvl = _cost(2)
    _, full_free = _cost(2, link=FREE, recompute="full")
    _, full_nvl = _cost(2, recompute="full")
    comm_none = none_nvl.bw_ms - none_free.bw_ms
    comm_full = full_nvl.bw_ms - full_free.bw_ms
    np.testing.assert_allclose(comm_full, 2 * comm_none, rtol=1e-9)


@pytest.mark.parametrize("sp", [False, True])
def test_t5_cross_attention_collectives_span_the_encoder_output(sp):
    """A decoder layer's key-value projection is column-parallel on the encoder output: its TP
    collectives (backward all-reduce; with SP all-gather forward, and backward a reduce-scatter
    plus the input gathered again for the weight gradient) move ``[s_enc, b, h]`` whatever the
    targets' length."""
    t5 = load_model_config("t5-11b")
    link = LinkConfig(100.0, 0.0)

    def comm(s_enc):  # (fw, bw) ms of the TP collectives of a decoder-only stage
        costs = [AnalyticCostModel(t5, DEVICE, 2, TensorParallelConfig(2, sp, lk)) for lk in (link, FREE)]
        slow, free = (c.layout_cost(c.layouts[1], 1, s_enc, 64, "none") for c in costs)
        return float(slow.fw_ms - free.fw_ms), float(slow.bw_ms - free.bw_ms)

    tp = TensorParallelConfig(2, sp, link)
    h, d = t5.hidden_size, t5.dtype_bytes
    enc_step = 2048 - 128
    one = (tp.gather_ms if sp else tp.allreduce_ms)(enc_step * h * d)  # one collective of the extra tokens
    (fw_short, bw_short), (fw_long, bw_long) = comm(128), comm(2048)
    layers = AnalyticCostModel(t5, DEVICE, 2).layouts[1].decoder_layers
    assert bw_long - bw_short == pytest.approx(layers * one * (2 if sp else 1))
    assert fw_long - fw_short == pytest.approx(layers * one if sp else 0.0, abs=1e-9)


def test_sequence_parallel_activations_and_time():
    _, one = _cost(1)
    _, tp2 = _cost(2)
    _, sp2 = _cost(2, sp=True)
    # Without SP the norms, dropout masks and residuals stay replicated: more than half.
    assert (tp2.stored_mib > one.stored_mib / 2).all() and (tp2.stored_mib < one.stored_mib).all()
    # With SP every stored activation is split.
    np.testing.assert_allclose(sp2.stored_mib, one.stored_mib / 2, rtol=1e-9)
    assert (sp2.stored_mib < tp2.stored_mib).all()
    # Korthikanti's per-layer figure without SP: sbh(10 + 24/t + 5as/(ht)) bytes (a_d = h, f = 4h),
    # plus the norms' statistics (16 bytes a token, replicated).
    m = MODEL
    s, h, a = 2048, m.hidden_size, m.num_attention_heads
    per_layer = s * h * (10 + 24 / 2 + 5 * a * s / (h * 2)) + 16 * s
    assert tp2.stored_mib[0] == pytest.approx(10 * per_layer / (1 << 20), rel=1e-9)
    # All-gather + reduce-scatter move what one all-reduce moves.
    np.testing.assert_allclose(sp2.fw_ms, tp2.fw_ms, rtol=1e-9)
    # Full recompute keeps each layer's input: sequence-sharded with SP only.
    _, tp2_full = _cost(2, recompute="full", stage=1)
    _, sp2_full = _cost(2, sp=True, recompute="full", stage=1)
    np.testing.assert_allclose(sp2_full.stored_mib, tp2_full.stored_mib / 2, rtol=1e-9)


def test_output_stage_is_sharded_with_sequence_parallelism():
    # The transient peak (a layer's activations, or the fp32 logits of the vocabulary shard)
    # and the stored output-layer activations are all split with SP, but for the loss's target
    # and mask (9 bytes a token), which every rank keeps for the whole sequence.
    _, one = _cost(1, stage=3)
    _, two = _cost(2, sp=True, stage=3)
    np.testing.assert_allclose(two.peak_mib, one.peak_mib / 2, rtol=1e-9)
    targets = np.asarray(MBS) * np.asarray(SEQ) * 9 / (1 << 20)
    np.testing.assert_allclose(two.stored_mib - targets / 2, one.stored_mib / 2, rtol=1e-9)


def test_model_states_per_tp_rank():
    rope = dataclasses.replace(MODEL, position_embedding_type="rope")
    one = AnalyticCostModel(rope, DEVICE, 4)
    for t in (2, 4, 8):
        tp = AnalyticCostModel(rope, DEVICE, 4, TensorParallelConfig(t))
        for stage in range(4):
            full, part = one.model_state_mib(stage), tp.model_state_mib(stage)
            # Everything but the norms and row-parallel biases is split.
            assert full / t < part < full / t * 1.01
    # A learned position table is replicated: every TP rank of an embedding stage holds all of it.
    table = [AnalyticCostModel(MODEL, DEVICE, 4, TensorParallelConfig(t)).model_state_mib(0)
             - AnalyticCostModel(rope, DEVICE, 4, TensorParallelConfig(t)).model_state_mib(0) for t in (1, 2, 8)]
    assert table[0] > 0 and table == pytest.approx([table[0]] * 3)
    assert AnalyticCostModel(MODEL, DEVICE, 4).model_state_mib(1) == one.model_state_mib(1)
    # The held recompute rise is per rank too.
    sp = AnalyticCostModel(MODEL, DEVICE, 4, TensorParallelConfig(2, True))
    held1 = AnalyticCostModel(MODEL, DEVICE, 4).recompute_held_mib(MBS, SEQ, recompute="selective", stage=1)
    held2 = sp.recompute_held_mib(MBS, SEQ, recompute="selective", stage=1)
    np.testing.assert_allclose(held2, held1 / 2, rtol=1e-9)


def test_tp_config_errors():
    with pytest.raises(DynaPipeError, match="tp 3 does not divide num_attention_heads=40"):
        build_cost_model(MODEL, DEVICE, 4, tp=TensorParallelConfig(3))
    with pytest.raises(DynaPipeError, match="sequence_parallel needs tp 2"):
        TensorParallelConfig(1, True).validate(MODEL)
    with pytest.raises(DynaPipeError, match="tp 16 exceeds the 8 GPUs of a node"):
        TensorParallelConfig(16).validate(dataclasses.replace(MODEL, num_attention_heads=64), gpus_per_node=8)


def _plan(capsys, tmp_path, *extra):
    lengths = tmp_path / "lengths.txt"
    rng = np.random.default_rng(0)
    lengths.write_text("\n".join(str(int(x)) for x in rng.integers(16, 2048, 64)) + "\n")
    rc = main(["plan", "--lengths", str(lengths), "--model", "gpt-13b", "--device", "a100-40gb",
               "--stages", "4", "--dp", "2", "--schedule", "1f1b", *extra])
    out, err = capsys.readouterr()
    return rc, out, err


def test_plan_tp_fits_what_tp1_cannot(capsys, tmp_path):
    rc, _, err = _plan(capsys, tmp_path)
    assert rc == 2 and "model states" in err
    rc, out, err = _plan(capsys, tmp_path, "--tp", "2")
    assert rc == 0, err
    tp2 = json.loads(out)
    assert tp2["tp"] == 2 and tp2["sequence_parallel"] is False
    assert "TP 2 per stage" in err
    assert max(tp2["stage_peak_mib"]) <= 40536
    rc, out, err = _plan(capsys, tmp_path, "--tp", "4", "--sequence-parallel")
    assert rc == 0, err
    tp4 = json.loads(out)
    # The simulator prices the same samples faster on twice the TP ranks.
    assert tp4["simulated_ms"] < tp2["simulated_ms"]
    assert max(tp4["stage_peak_mib"]) < max(tp2["stage_peak_mib"])


def test_cost_command_tp_errors(capsys):
    rc = main(["cost", "--model", "gpt-13b", "--device", "a100-40gb", "--stages", "4", "--shape", "1,512",
               "--tp", "3"])
    assert rc == 2
    assert "--tp 3 does not divide" in capsys.readouterr().err
    rc = main(["cost", "--model", "gpt-13b", "--device", "a100-40gb", "--stages", "4", "--shape", "1,512",
               "--tp", "2", "--sequence-parallel"])
    assert rc == 0
    row = json.loads(capsys.readouterr().out)[0]
    assert row["stored_mib"] > 0


@pytest.mark.parametrize("name,tp", [("gpt-13b-tp2-pp4-dp2-a100-40gb", 2), ("gpt-30b-tp4-pp4-dp2-h100", 4)])
def test_tp_run_configs_need_their_tensor_parallelism(name, tp, gpu_with_te, tmp_path, monkeypatch):
    from megatron_integration.arguments import build_parser, load_run_config, training_config_from_args

    monkeypatch.chdir(tmp_path)  # the run's relative --save is created where it is parsed, not in the checkout

    run = load_run_config(name)
    cfg = training_config_from_args(build_parser().parse_args(list(run.argv)), run.world_size, cuda=True)
    assert cfg.parallel.tensor_model_parallel_size == tp and cfg.parallel.data_parallel_size == 2
    assert run.nproc_per_node % tp == 0  # a TP group never spans nodes
    model = cfg.model.to_model_config(name)
    device = load_device_config(cfg.dynapipe.device)
    pp, limit = cfg.parallel.pipeline_model_parallel_size, cfg.dynapipe.memory_limit_mb
    states = [AnalyticCostModel(model, device, pp, TensorParallelConfig(t)).model_state_mib(dp=2, zero=True)
              for t in (1, tp)]
    # Without TP the model states alone overflow the device; with it activations get room.
    assert states[0] > limit - device.reserved_mib
    assert limit - device.reserved_mib - states[1] > 8 * 1024


def test_a_training_tp_group_that_spans_nodes_is_priced_on_the_inter_node_link():
    # Megatron-LM allows a TP group wider than a node (or one that straddles two); the planner
    # used to price its collectives on NVLink regardless.
    from dynapipe.config import load_cluster_config
    from dynapipe.runtime.plan_source import tensor_parallel_of

    cluster = load_cluster_config("h100-8x")
    assert tensor_parallel_of(8, True, cluster).link == cluster.intra_node
    assert tensor_parallel_of(2, False, cluster).link == cluster.intra_node
    assert tensor_parallel_of(16, True, cluster).link == cluster.inter_node
    assert tensor_parallel_of(3, False, cluster).link == cluster.inter_node  # 3 does not divide 8
    assert tensor_parallel_of(1, False, cluster) is None


def test_a_json_file_that_is_no_profile_is_named_as_such_at_tp2(tmp_path):
    # The TP check read a missing layout as TP1 and blamed the TP size.
    from megatron_integration.arguments import parse_training_args

    bogus = tmp_path / "bogus.json"
    bogus.write_text('{"not": "a profile"}')
    argv = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 128 --max-position-embeddings 128 "
            "--vocab-size 128 --micro-batch-size 1 --global-batch-size 2 --train-iters 1 --lr 1e-4 --mock-data "
            f"--use-dynapipe --tensor-model-parallel-size 2 --dynapipe-cost-model {bogus}").split()
    with pytest.raises(DynaPipeError, match="not a DynaPipe profile") as err:
        parse_training_args(argv, 2)
    assert "tensor-parallel size" not in str(err.value)
