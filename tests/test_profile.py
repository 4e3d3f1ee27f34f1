"""``python -m dynapipe profile``: real megatron-core measurements the profile cost model reads."""
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from dynapipe.config import load_device_config, load_model_config
from dynapipe.cost import build_cost_model
from dynapipe.cost.profile import WEIGHT_FIELD, ProfileCostModel
from dynapipe.errors import DynaPipeError
from megatron_integration.live_memory import LiveMemoryTracker
from megatron_integration.cache_flush import CacheFlush
from megatron_integration.profiler import MIB, measure_op
from profile_widths import TINY_WIDTHS


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("profile") / "tiny.json"
    cmd = [sys.executable, "-m", "dynapipe", "profile", "--output", str(path), "--model", "gpt-tiny",
           "--mbs", "1,2", "--seqlens", "32,64,128", "--repeats", "1", "--threads", "1"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "measures two lengths" not in result.stderr  # three: a layer's square term is read from them
    return path


def test_profile_loads_in_the_cost_model(profile_path):
    data = json.loads(profile_path.read_text())
    assert data["format"] == "dynapipe-profile" and (data["version"], data["kind"]) == (2, "decoder-only")
    assert data["mbs"] == [1, 2] and data["seqlen"] == [32, 64, 128]
    assert data["layer_spec"] == "local" and data["device"] == "cpu"
    assert "each from a cold cache" in data["times"]
    tiny = load_model_config("gpt-tiny")
    model = build_cost_model(tiny, None, num_stages=2, profile=str(profile_path))
    assert isinstance(model, ProfileCostModel)
    # A per-sample attention call's fixed cost, measured on megatron-core's local attention.
    calls = data["attention_call_ms"]
    assert calls["fw"] > 0 and calls["bw"] > 0 and model.attention_call_ms == (calls["fw"], calls["bw"])
    cost = model.stage_cost([1, 2], [64, 100])
    assert np.all(cost.fw_ms > 0) and np.all(cost.bw_ms > 0) and np.all(cost.stored_mib > 0)


def test_profile_times_the_weight_part_of_the_layer_backward(profile_path):
    # The layer's backward is timed split, as zero-bubble plans run it: its weight part is a
    # positive part of it at every level measured; embedding and output are not split.
    data = json.loads(profile_path.read_text())
    for op in ("layer", "layer_selective", "layer_full"):
        w, bw = np.array(data["ops"][op]["bw_weight_ms"]), np.array(data["ops"][op]["bw_ms"])
        assert w.shape == bw.shape and np.all(w > 0) and np.all(w < bw), op
    assert all("bw_weight_ms" not in data["ops"][op] for op in ("embedding", "output"))
    # The cost model prices BI/BW with the measured share, not the FLOPs estimate.
    from dynapipe.cost.backward_split import backward_split
    from dynapipe.schedule.costs import stage_times
    from dynapipe.batching.types import MicroBatch

    tiny = load_model_config("gpt-tiny")
    cm = build_cost_model(tiny, None, num_stages=2, profile=str(profile_path))
    layout = cm.layouts[0]
    share = cm.weight_share(layout, 2, 128, None, "none")
    n = layout.decoder_layers
    expected = n * data["ops"]["layer"]["bw_weight_ms"][1][2] / float(cm.stage_cost(2, 128, stage=0).bw_ms)
    assert float(share) == pytest.approx(expected)
    assert float(share) != pytest.approx(float(backward_split(tiny, layout, 2, 128)[0]), rel=1e-3)
    t = stage_times(cm, [MicroBatch(samples=(0, 1), seqlen=128)])
    assert t.bw_weight_ms[0, 0] == pytest.approx(float(share) * t.bw_ms[0, 0])


def test_a_weight_part_longer_than_its_backward_is_refused(tmp_path):
    data = _synthetic_profile()
    data["ops"]["layer"] = dict(data["ops"]["layer"], bw_weight_ms=[[0.6, 0.5]])
    with pytest.raises(DynaPipeError, match=r"ops.layer.bw_weight_ms must be a \d+x\d+ table, the shape of"):
        ProfileCostModel(load_model_config("gpt-tiny"), data, 2)
    data["ops"]["layer"]["bw_weight_ms"] = [[0.25, 0.5]]
    cm = ProfileCostModel(load_model_config("gpt-tiny"), data, 2)
    assert cm.weight_share(cm.layouts[1], 1, 64, None, "none") > 0


def test_measured_memory_scales_as_activations_do(profile_path):
    layer = json.loads(profile_path.read_text())["ops"]["layer"]
    stored = np.array(layer["stored_mib"])
    # Twice the samples store twice the activations; longer sequences store more.
    assert stored[1] == pytest.approx(2 * stored[0], rel=0.05)
    assert np.all(np.diff(stored, axis=1) > 0)
    # A [s, b, h] fp32 layer input alone is s*b*h*4 bytes; a layer stores several such tensors.
    assert stored[0][0] > 32 * 1 * 64 * 4 * 4 / MIB


def test_live_memory_tracker_counts_what_is_alive():
    x = torch.randn(1024, 256, requires_grad=True)  # 1 MiB
    w = torch.randn(256, 1024, requires_grad=True)  # 1 MiB
    with LiveMemoryTracker() as tracker:
        y = x @ w  # 4 MiB
        z = torch.relu(y)  # 4 MiB, saved for the backward
        del y
        assert tracker.live == pytest.approx(4 * MIB, rel=0.01)
        assert tracker.peak == pytest.approx(8 * MIB, rel=0.01)
        z.sum().backward()
        del z
    # What survives: the two parameter gradients.
    assert tracker.live == pytest.approx(2 * MIB, rel=0.01)


def test_measure_op_reports_saved_tensors_not_parameters():
    lin = torch.nn.Linear(64, 64)
    x = torch.randn(128, 64, requires_grad=True)
    m = measure_op(lambda: torch.nn.functional.gelu(lin(x)), list(lin.parameters()), torch.device("cpu"),
                   repeats=1, warmup=0)
    # Saved: x (for the weight gradient) and the linear output (for gelu); never the weight.
    assert m.stored_mib == pytest.approx(2 * 128 * 64 * 4 / MIB, rel=0.01)
    assert m.fw_ms > 0 and m.bw_ms > 0 and m.peak_mib >= 0


def test_every_timed_pass_starts_after_a_cache_flush_outside_its_time():
    # The flush runs before every forward and every backward, the warm-up's included, so no
    # timed pass finds the previous one's data cached, and none of its time is counted.
    import time

    events = []

    class Mark(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            events.append("backward")
            return g

    w = torch.nn.Parameter(torch.randn(8, 8))

    def forward():
        events.append("forward")
        return Mark.apply(torch.randn(4, 8) @ w).sum()

    def flush():
        events.append("flush")
        time.sleep(0.2)

    m = measure_op(forward, [w], torch.device("cpu"), repeats=2, warmup=1, flush=flush)
    # Three timed-loop runs, then the untimed memory runs (a forward, and one with its backward).
    assert events[:12] == ["flush", "forward", "flush", "backward"] * 3
    assert "flush" not in events[12:] and events[12:].count("forward") == 2
    assert 0 < m.fw_ms < 100 and 0 < m.bw_ms < 100  # the 200 ms flushes are outside the timed passes


def test_the_cache_flush_outsizes_the_caches_it_evicts(monkeypatch):
    import megatron_integration.cache_flush as cache_flush

    cpu = torch.device("cpu")
    monkeypatch.setattr(cache_flush.torch, "get_num_threads", lambda: 1)
    monkeypatch.setattr(cache_flush.os, "sysconf", lambda name: 2 << 20)
    assert CacheFlush.default_bytes(cpu) == 16 << 20  # 4 x 2 MiB is below the 16 MiB floor
    monkeypatch.setattr(cache_flush.os, "sysconf", lambda name: 8 << 20)
    assert CacheFlush.default_bytes(cpu) == 32 << 20
    # A fill split over 4 threads writes a quarter of the buffer from each core.
    monkeypatch.setattr(cache_flush.torch, "get_num_threads", lambda: 4)
    assert CacheFlush.default_bytes(cpu) == 128 << 20

    def unknown(name):
        raise ValueError(name)

    monkeypatch.setattr(cache_flush.os, "sysconf", unknown)  # not reported: the floor
    assert CacheFlush.default_bytes(cpu) == 16 << 20
    flush = CacheFlush(cpu, nbytes=1 << 20)
    flush()
    assert flush.nbytes == 1 << 20 and float(flush._buffer.sum()) == (1 << 20) // 4


def test_bad_grid_is_refused(tmp_path):
    cmd = [sys.executable, "-m", "dynapipe", "profile", "--output", str(tmp_path / "p.json"), "--model", "gpt-tiny",
           "--seqlens", "64,32"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "--seqlens '64,32'" in result.stderr


# -- tensor parallelism ------------------------------------------------------------------

TP_SEQLENS = [64, 128]


@pytest.fixture(scope="module")
def tp2_profile_path(tmp_path_factory):
    """One TP2 group with sequence parallelism (two spawned gloo ranks) over a tiny grid,
    through the command line."""
    from dynapipe.cli import main

    path = tmp_path_factory.mktemp("profile_tp") / "new-folder" / "tp2.json"  # created, as every output's
    rc = main(["profile", "--output", str(path), "--model", "gpt-tiny", "--mbs", "1",
               "--seqlens", ",".join(map(str, TP_SEQLENS)), "--repeats", "1", "--threads", "1", "--no-progress",
               "--tensor-model-parallel-size", "2", "--sequence-parallel"])
    assert rc == 0
    return path


def test_tp_profile_measures_one_rank_of_the_group(tp2_profile_path, profile_path):
    from dynapipe.config import TensorParallelConfig
    from dynapipe.cost import AnalyticCostModel

    data = json.loads(tp2_profile_path.read_text())
    assert data["tp"] == 2 and data["sequence_parallel"] is True
    assert data["mbs"] == [1] and data["seqlen"] == TP_SEQLENS
    for op, table in data["ops"].items():
        for field in ("fw_ms", "bw_ms"):
            assert np.all(np.isfinite(table[field])) and np.all(np.array(table[field]) > 0), (op, field)
    # Per-rank activations against the TP1 profile measured in this module (same model, same
    # shapes): with sequence parallelism every stored layer activation is split over the two
    # ranks, which is the analytic model's TP2-SP / TP1 ratio (one half).
    one = json.loads(profile_path.read_text())
    cols = [one["seqlen"].index(s) for s in TP_SEQLENS]
    tp1 = np.array(one["ops"]["layer"]["stored_mib"])[0, cols]
    tp2 = np.array(data["ops"]["layer"]["stored_mib"])[0]
    tiny = load_model_config("gpt-tiny")
    analytic = [AnalyticCostModel(tiny, load_device_config("cpu"), 1, t).stage_cost(1, TP_SEQLENS).stored_mib
                for t in (None, TensorParallelConfig(2, True))]
    ratio = analytic[1] / analytic[0]
    assert np.all(tp2 < tp1)
    np.testing.assert_allclose(tp2 / tp1, ratio, atol=0.1)
    # The cost model prices a TP2-SP run with the measured per-rank times.
    cm = build_cost_model(tiny, None, num_stages=2, profile=str(tp2_profile_path), tp=TensorParallelConfig(2, True))
    layer, emb = data["ops"]["layer"], data["ops"]["embedding"]
    assert float(cm.stage_cost(1, 64, stage=0).fw_ms) == pytest.approx(2 * layer["fw_ms"][0][0] + emb["fw_ms"][0][0])
    # And refuses the profile for any other TP layout, naming both.
    for tp in (None, TensorParallelConfig(2), TensorParallelConfig(4, True)):
        with pytest.raises(DynaPipeError) as e:
            build_cost_model(tiny, None, num_stages=2, profile=str(tp2_profile_path), tp=tp)
        assert "measured at tensor-parallel size 2 with sequence parallelism, but the run uses" in str(e.value)
        assert "\n" not in str(e.value)


def _synthetic_profile(**tp_keys):
    table = {k: [[0.5, 1.0]] for k in ("fw_ms", "bw_ms", "stored_mib", "peak_mib")}
    return {"format": "dynapipe-profile", "version": 1, "mbs": [1], "seqlen": [64, 128], "model": dict(TINY_WIDTHS),
            "ops": {"layer": table, "embedding": table, "output": table}, **tp_keys}


def test_profile_tp_layout_must_match_the_run():
    from dynapipe.config import TensorParallelConfig

    tiny = load_model_config("gpt-tiny")
    # A profile that does not say was measured at TP 1.
    ProfileCostModel(tiny, _synthetic_profile(), 2)
    with pytest.raises(DynaPipeError, match="measured at tensor-parallel size 1 without sequence parallelism, "
                                            "but the run uses tensor-parallel size 2 without"):
        ProfileCostModel(tiny, _synthetic_profile(), 2, tp=TensorParallelConfig(2))
    # Four stages: stage 1 holds one layer, no embedding or output layer.
    tp2 = ProfileCostModel(tiny, _synthetic_profile(tp=2), 4, tp=TensorParallelConfig(2))
    # Model states are one TP rank's.
    assert tp2.layout_param_count(tp2.layouts[1]) < ProfileCostModel(tiny, _synthetic_profile(), 4).layout_param_count(
        tp2.layouts[1])
    # Full recompute keeps each layer's input, sequence-sharded only with sequence parallelism.
    sp2 = ProfileCostModel(tiny, _synthetic_profile(tp=2, sequence_parallel=True), 4, tp=TensorParallelConfig(2, True))
    full = [float(m.stage_cost(1, 128, recompute="full", stage=1).stored_mib) for m in (tp2, sp2)]
    assert full[1] == pytest.approx(full[0] / 2)
    for bad, needle in (({"tp": 0}, "'tp' 0 must be a positive integer"),
                        ({"tp": "2"}, "'tp' '2' must be a positive integer"),
                        ({"sequence_parallel": "yes"}, "'sequence_parallel' 'yes' must be true or false")):
        with pytest.raises(DynaPipeError, match=needle):
            ProfileCostModel(tiny, _synthetic_profile(**bad), 2)


def test_training_arguments_accept_a_profile_of_the_run_tp_only(tmp_path):
    from megatron_integration.arguments import parse_training_args

    base = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 128 --micro-batch-size 1 "
            "--global-batch-size 4 --train-iters 1 --lr 1e-3 --mock-data --use-dynapipe "
            "--tensor-model-parallel-size 2 --dynapipe-cost-model ").split()
    path = tmp_path / "tp2.json"
    path.write_text(json.dumps(_synthetic_profile(tp=2)))
    cfg = parse_training_args(base + [str(path)], 2, cuda=False)
    assert cfg.dynapipe.cost_model == str(path) and cfg.parallel.tensor_model_parallel_size == 2
    with pytest.raises(DynaPipeError) as e:
        parse_training_args(base + [str(path), "--sequence-parallel"], 2, cuda=False)
    assert str(e.value) == (f"--dynapipe-cost-model {path}: the profile was measured at tensor-parallel size 2 "
                            f"without sequence parallelism, but the run uses tensor-parallel size 2 with sequence "
                            f"parallelism; measure one with `python -m dynapipe profile "
                            f"--tensor-model-parallel-size 2 --sequence-parallel` or use the analytic cost model.")
    path.write_text(json.dumps(_synthetic_profile()))
    with pytest.raises(DynaPipeError, match="measured at tensor-parallel size 1 without sequence parallelism"):
        parse_training_args(base + [str(path)], 2, cuda=False)


@pytest.mark.parametrize("extra, needle", [
    (["--tensor-model-parallel-size", "3"], "--tensor-model-parallel-size 3 does not divide --num-attention-heads 4"),
    (["--sequence-parallel"], "--sequence-parallel needs --tensor-model-parallel-size 2 or more"),
    (["--tensor-model-parallel-size", "2", "--sequence-parallel", "--seqlens", "64,99"],
     "--seqlens holds 99, not a multiple of 2"),
    (["--seqlens", "128"], "--seqlens '128': give at least 2 lengths; the cost model prices other lengths from the "
                           "trend between them."),
    # Megatron-LM's other spelling is read, not ignored: the grid then reaches past it.
    (["--encoder-seq-length", "1"], "--seq-length 1: a profile needs at least 2 tokens."),
    (["--seq-length", "64", "--encoder-seq-length", "64"], "--seq-length 64 and --encoder-seq-length 64 were both"),
])
def test_profile_command_refuses_a_tp_layout_it_cannot_measure(tmp_path, capsys, extra, needle):
    from dynapipe.cli import main

    rc = main(["profile", "--output", str(tmp_path / "p.json"), "--model", "gpt-tiny", "--seqlens", "64,128", *extra])
    assert rc == 2
    err = capsys.readouterr().err
    assert needle in err and not (tmp_path / "p.json").exists()


def test_a_transformer_engine_spec_is_profiled_without_a_weight_part(tmp_path):
    # Transformer Engine's layers cannot split their backward (zero-bubble plans are refused with
    # them); the profiler installed the split on every spec and so refused to profile them at all.
    # Stood in for here by the local layers under Transformer Engine's spec name.
    path = tmp_path / "te.json"
    code = ("import sys\n"
            "import megatron_integration.model as m\n"
            "local = m.layer_spec\n"
            "m.layer_spec = lambda use_te, *a: (local(False, *a)[0], 'transformer_engine')\n"
            "from dynapipe.cli import main\n"
            f"sys.exit(main(['profile', '--output', {str(path)!r}, '--model', 'gpt-tiny', '--mbs', '1',\n"
            "                '--seqlens', '16,32', '--repeats', '1', '--threads', '1', '--no-progress']))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    # Two lengths: said at once that what lies beyond them will be under-priced.
    assert "note: --seqlens measures two lengths (16, 32); longer micro-batches will be priced from a line" \
        in result.stderr, result.stderr[-3000:]
    data = json.loads(path.read_text())
    assert data["layer_spec"] == "transformer_engine"
    assert "bw_weight_ms" not in data["ops"]["layer"] and data["ops"]["layer"]["bw_ms"][0][0] > 0


def test_the_peak_counts_one_gradient_in_flight_not_every_parameters_gradient():
    # The parameters' gradients live in the model state (megatron-core's gradient buffers), which
    # the memory budget counts once; the op's peak keeps only the one being computed.
    net = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))  # 1 MiB a weight
    m = measure_op(lambda: net(torch.randn(4, 512)), list(net.parameters()), torch.device("cpu"), repeats=1,
                   warmup=0)
    assert 0.9 < m.peak_mib < 1.5, m
    assert all(p.grad is None for p in net.parameters())


def test_the_peak_is_counted_beyond_what_is_stored_inputs_included():
    # sin() keeps its 4 MiB input; fw + bw hold 20 MiB at their highest, counted from before
    # the input existed, so 16 MiB beyond the stored input. The input existed before the peak
    # was read and was subtracted from it anyway: 12 MiB.
    from megatron_integration.live_memory import LiveMemoryTracker

    x = torch.randn(1 << 20, requires_grad=True)
    m = measure_op(lambda: x.sin(), [], torch.device("cpu"), repeats=1, warmup=0)
    with LiveMemoryTracker() as t:
        y = torch.randn(1 << 20).requires_grad_()
        out = y.sin()
        out.backward(torch.randn_like(out))
        del out
    assert m.stored_mib == pytest.approx(4.0)
    assert m.peak_mib == pytest.approx(t.peak / 2**20 - m.stored_mib, abs=0.01)


def test_measured_times_are_made_monotone_in_both_axes():
    from megatron_integration.profiler import _monotone

    # The weight part has a spike (5.0, above larger shapes' 2.9) and a point above its own
    # backward (9.5 > 9.0): lowered to 2.9, then capped at the backward (2.0 and 9.0).
    noisy = {"layer": {"fw_ms": [[2.0, 1.5, 3.0], [2.5, 4.0, 6.0]], "bw_ms": [[1.0, 2.0, 3.0], [2.0, 3.0, 9.0]],
                       WEIGHT_FIELD: [[0.9, 5.0, 2.9], [1.9, 2.9, 9.5]]}}
    out = _monotone(noisy)["layer"]
    assert out["fw_ms"] == [[1.5, 1.5, 3.0], [2.5, 4.0, 6.0]]  # never above a larger shape's time
    assert out["bw_ms"] == [[1.0, 2.0, 3.0], [2.0, 3.0, 9.0]]
    assert out[WEIGHT_FIELD] == [[0.9, 2.0, 2.9], [1.9, 2.9, 9.0]]


def test_profiled_modules_run_in_the_training_precision(tmp_path):
    # Training wraps every stage in Float16Module, which casts megatron-core's fp32-built norms and
    # rotary frequencies to the half type; the profiler timed bf16 linears next to fp32 norms,
    # which CPUs compute in mixed precision and CUDA's layer norm refuses ("expected scalar type
    # BFloat16 but found Float"; seen on the first GPU run).
    code = """
import os, torch
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(__import__("dynapipe.runtime.distributed",
                  fromlist=["x"]).free_port()), RANK="0", WORLD_SIZE="1")
from megatron_integration.arguments import parse_training_args
from megatron_integration.initialize import initialize_megatron
from megatron_integration.profiler import _Ops
from megatron_integration.t5_profiler import T5Ops
from megatron_integration.train_config import ParallelArgs
flags = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
         "--vocab-size 512 --position-embedding-type rope --transformer-impl local --micro-batch-size 1 "
         "--global-batch-size 1 --train-iters 1 --lr 1e-4 --mock-data --bf16").split()
cfg = parse_training_args(flags, 1)
initialize_megatron(ParallelArgs(world_size=1, backend="gloo"), 1)
cpu = torch.device("cpu")
gpt, t5 = _Ops(cfg.model, cpu, False), T5Ops(cfg.model, cpu)
for name, part in (("layer", gpt.layer), ("ends", gpt.ends), ("encoder", t5.encoder), ("decoder", t5.decoder),
                   ("embedding", t5.embedding), ("lm_head", t5.lm_head)):
    tensors = list(part.named_parameters()) + list(part.named_buffers())
    dtypes = {str(t.dtype) for _, t in tensors if t.is_floating_point()}
    print(name, sorted(dtypes), any("norm" in n for n, _ in tensors))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line.split(" ", 1) for line in result.stdout.splitlines()]
    assert [n for n, _ in lines] == ["layer", "ends", "encoder", "decoder", "embedding", "lm_head"]
    for name, rest in lines:
        assert rest.startswith("['torch.bfloat16']"), (name, rest)
    assert dict(lines)["layer"].endswith("True")  # the layer's norms were among those checked


@pytest.mark.parametrize("given, expected", [
    ([], (0.0, 0.05, "rope", "RMSNorm")),  # nothing given: the config's
    (["--hidden-dropout", "0.1", "--position-embedding-type", "learned_absolute", "--normalization", "LayerNorm"],
     (0.1, 0.05, "learned_absolute", "LayerNorm")),
])
def test_profile_takes_dropout_and_positions_from_the_config_unless_given(tmp_path, given, expected):
    # An explicit flag at Megatron's default value holds against the config; it used to be
    # taken for "not given" and replaced by the config's value.
    import argparse

    from dynapipe.cli import profile

    config = tmp_path / "m.yaml"
    tiny = "".join(line for line in open("configs/models/gpt-tiny.yaml") if not line.startswith("dtype:"))
    config.write_text(tiny + "hidden_dropout: 0.0\nattention_dropout: 0.05\nposition_embedding_type: rope\n"
                      "normalization: RMSNorm\ndtype: fp16\n")
    parser = argparse.ArgumentParser()
    profile.add_arguments(parser)
    args = parser.parse_args(["--output", "p.json", "--model", str(config)] + given)
    profile.fill_from_model_config(args)
    assert (args.hidden_dropout, args.attention_dropout, args.position_embedding_type, args.normalization) == expected
    # The config's precision, fp16 too (it was measured in fp32, and then refused for the model).
    assert args.fp16 and not args.bf16
    bare = parser.parse_args(["--output", "p.json"])  # no config: Megatron's defaults
    profile.fill_from_model_config(bare)
    assert (bare.hidden_dropout, bare.attention_dropout, bare.position_embedding_type, bare.normalization) == (
        0.1, 0.1, "learned_absolute", "LayerNorm")


def test_profile_refuses_what_a_t5_profile_would_not_measure(tmp_path, capsys, monkeypatch):
    from dynapipe.cli import main

    base = ["profile", "--output", str(tmp_path / "p.json"), "--t5", "--hidden-size", "64", "--num-attention-heads",
            "4", "--vocab-size", "256"]
    assert main(base + ["--num-layers", "4"]) == 2
    assert "--num-layers 4: a T5 profile measures one encoder and one decoder layer" in capsys.readouterr().err
    # On a GPU with Transformer Engine Megatron-LM's default layers are its, which T5 stages never
    # build (the machine is described to the argument checks; nothing runs on it).
    import torch

    import megatron_integration.model as model_specs

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(model_specs, "te_available", lambda: True)
    assert main(base) == 2
    assert "T5 stages are built from megatron-core's local layers" in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()


def test_the_default_grid_reaches_the_sequence_length_given():
    from dynapipe.cli.profile import default_seqlens

    assert default_seqlens(None, 512) == "64,128,256,512"
    assert default_seqlens("gpt-7b", 300) == "64,128,256,300"


def test_a_grid_point_that_does_not_fit_is_named_in_one_line(tmp_path):
    from megatron_integration.out_of_memory import point_fits

    with pytest.raises(DynaPipeError, match=r"the profile measuring layer at mbs=8 seqlen=64 ran out of memory \(.*"
                                            r"can't allocate memory.*\); measure a grid this device holds: smaller "
                                            r"--mbs"):
        with point_fits("layer at mbs=8 seqlen=64"):
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: "
                               "you tried to allocate 1638399983616 bytes")
    with pytest.raises(RuntimeError, match="a shape bug"):  # other failures are not called memory
        with point_fits("layer at mbs=8 seqlen=64"):
            raise RuntimeError("a shape bug")
    # The whole command: the points before it are measured, then one line and no profile file.
    if open("/proc/sys/vm/overcommit_memory").read().strip() == "1":
        pytest.skip("the kernel grants any allocation (vm.overcommit_memory=1): a 1.6 TB table would be touched")
    out = tmp_path / "p.json"
    r = subprocess.run([sys.executable, "-m", "dynapipe", "profile", "--output", str(out), "--model", "gpt-tiny",
                        "--no-progress", "--mbs", "1,99999999", "--seqlens", "64,128", "--repeats", "1",
                        "--warmup", "0"], capture_output=True, text=True, timeout=240)
    assert r.returncode == 2, r.stderr
    assert "error: the profile measuring layer at mbs=99999999 seqlen=64 ran out of memory" in r.stderr
    assert "Traceback" not in r.stderr and not out.exists()
