"""The layout advisor: its ranking against an exhaustive grid, memory, and the run config it writes."""
import dataclasses
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from dynapipe.advise import Layout, advise, enumerate_layouts, sample_batches
from dynapipe.layouts import default_tp_sizes
from dynapipe.cli import main
from dynapipe.config import TensorParallelConfig, load_cluster_config, load_device_config, load_model_config
from dynapipe.cost import build_cost_model
from dynapipe.cost.dp_sync import dp_sync_ms
from dynapipe.errors import DynaPipeError
from dynapipe.method_compare import simulate_method

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_layouts_split_the_layers_and_the_gpus():
    gpt13 = load_model_config("gpt-13b")
    a100 = load_cluster_config("a100-8x")
    got = {(l.tp, l.pp, l.dp, l.zero) for l in enumerate_layouts(gpt13, 64, a100, tp_sizes=[1])}
    assert got == {(1, pp, 64 // pp, z) for pp in (1, 2, 4, 8) for z in (False, True)}
    # By default every power-of-two TP inside a node (8 GPUs) that splits the 40 heads,
    # with sequence parallelism; PP divides the 40 layers and what TP leaves of the GPUs.
    layouts = enumerate_layouts(gpt13, 64, a100)
    assert {l.tp for l in layouts} == {1, 2, 4, 8}
    assert all(l.sp == (l.tp > 1) for l in layouts)
    assert {(l.tp, l.pp) for l in layouts} == {(t, p) for t in (1, 2, 4, 8) for p in (1, 2, 4, 8) if t * p <= 64}
    assert all(l.tp * l.pp * l.dp == 64 and l.zero <= (l.dp > 1) for l in layouts)
    assert not any(l.sp for l in enumerate_layouts(gpt13, 64, a100, sequence_parallel=False))
    assert all(l.pp * l.dp * l.tp == 12 for l in enumerate_layouts(load_model_config("gpt-7b"), 12, a100))
    # A prime GPU count leaves only pure data parallelism.
    assert [(l.tp, l.pp, l.dp) for l in enumerate_layouts(load_model_config("gpt-tiny"), 7, a100)] == [(1, 1, 7)] * 2
    # Sequence parallelism only where the sequence length divides by TP (Megatron-LM's rule).
    odd = enumerate_layouts(load_model_config("gpt-tiny"), 2, load_cluster_config("cpu-local"), seq_length=127)
    assert [l.sp for l in odd if l.tp == 2] == [False] and any(l.tp == 2 for l in odd)
    # gpt-tiny's 4 heads cap TP at 4 on a node of 8.
    assert default_tp_sizes(load_model_config("gpt-tiny"), 64, a100) == [1, 2, 4]
    assert default_tp_sizes(gpt13, 4, a100) == [1, 2, 4]


@pytest.mark.parametrize("model, tp_sizes, message", [
    ("gpt-13b", [3], "tp_sizes 3 does not divide num_attention_heads=40"),
    ("gpt-7b", [16], "tp_sizes 16 exceeds the 8 GPUs of a node"),
    ("gpt-13b", [1, 8], "tp_sizes=8 does not divide gpus=12"),
])
def test_tp_sizes_that_cannot_be_placed_are_refused(model, tp_sizes, message):
    with pytest.raises(DynaPipeError, match=message):
        enumerate_layouts(load_model_config(model), 12, load_cluster_config("a100-8x"), tp_sizes=tp_sizes)


def test_top_layout_is_the_best_of_an_exhaustive_grid_and_every_shown_layout_fits():
    model, device = load_model_config("gpt-7b"), load_device_config("a100-40gb")
    cluster = load_cluster_config("a100-8x")
    batches = sample_batches(12_000, 2, 0, 1024)
    calls = []
    advice = advise(batches, model, device, 8, cluster=cluster, seq_length=1024, compare_packing=False,
                    layouts=enumerate_layouts(model, 8, cluster, tp_sizes=[1, 2]),
                    progress=lambda done, total, layout: calls.append((done, total, layout)))
    assert calls[0][:2] == (0, 12) and calls[-1] == (12, 12, None)
    # The exhaustive grid, simulated independently: TP 1 and 2 (with sequence parallelism, its
    # collectives on the node's link), every PP dividing the 32 layers and what TP leaves of
    # the 8 GPUs, with and without the distributed optimizer; the vocabulary as Megatron-LM pads
    # it at each TP size.
    grid = {}
    for tp in (1, 2):
        for pp in (1, 2, 4, 8):
            if tp * pp > 8:
                continue
            tpc = TensorParallelConfig(tp, True, cluster.intra_node) if tp > 1 else None
            trained = dataclasses.replace(model, vocab_size=-(-model.vocab_size // (128 * tp)) * 128 * tp)
            cm = build_cost_model(trained, device, pp, tp=tpc)
            dp = 8 // (tp * pp)
            for zero in ((False, True) if dp > 1 else (False,)):
                try:
                    runs = [simulate_method(b, "dynapipe", cm, dp=dp, seq_length=1024, cluster=cluster, zero=zero,
                                            tp=tp) for b in batches]
                except DynaPipeError:
                    continue
                # The data-parallel step after the pipeline: a ring over the node's link of each
                # stage's fp32 gradients (all-reduce), or with the distributed optimizer their
                # reduce-scatter and the bf16 parameters' all-gather; the largest stage's.
                params = max(cm.layout_param_count(l) for l in cm.layouts)
                link = cluster.intra_node
                hop = lambda nbytes: link.latency_ms + nbytes / dp / (link.bandwidth_gbps * 1e6)  # noqa: E731
                sync = (dp - 1) * (hop(4 * params) + hop(2 * params)) if zero else 2 * (dp - 1) * hop(4 * params)
                grid[Layout(tp, pp, dp, zero, sp=tp > 1)] = (sum(r.real_tokens for r in runs)
                                                             / ((sum(r.iteration_ms for r in runs) + 2 * sync) / 1e3))
    assert len(grid) >= 5 and len(advice.results) == len(grid)
    assert any(l.tp == 2 for l in grid)
    best = max(grid, key=grid.get)
    assert advice.best.layout == best
    assert advice.best.real_tokens_per_s == pytest.approx(grid[best], rel=1e-9)
    for r in advice.results:
        assert r.real_tokens_per_s == pytest.approx(grid[r.layout], rel=1e-9)
    ranked = [r.real_tokens_per_s for r in advice.results]
    assert ranked == sorted(ranked, reverse=True)
    capacity = device.memory_mib - device.reserved_mib
    for r in advice.results:
        assert max(r.stage_peak_mib) <= capacity
    # PP1 holds 6.7B parameters' states on one GPU: refused before planning; TP2 halves them.
    refused = {l: why for l, why in advice.refused}
    assert "model states need" in refused[Layout(1, 1, 8, False)]
    states = {tp: build_cost_model(model, device, 1, tp=TensorParallelConfig(tp, tp > 1)).model_state_mib(dp=1)
              for tp in (1, 2)}
    assert states[2] < 0.55 * states[1]
    assert set(refused) | set(grid) == set(enumerate_layouts(model, 8, cluster, tp_sizes=[1, 2]))


def test_advise_command_writes_a_run_config_that_trains_on_cpu(tmp_path, capsys):
    # A missing folder is created at the write, as every command's outputs are.
    out, js = tmp_path / "best.yaml", tmp_path / "new" / "advice.json"
    rc = main(["advise", "--model", "gpt-tiny", "--device", "cpu", "--cluster", "cpu-local", "--gpus", "2",
               "--mixture", "flan-mixture", "--tokens-per-iteration", "1200", "--seq-length", "128",
               "--batches", "1", "--output", str(out), "--json", str(js)])
    captured = capsys.readouterr()
    text = captured.out
    assert rc == 0, text
    assert "TP 1, 2 (with sequence parallelism)" in text and "vs packing" in text
    layouts = json.loads(js.read_text())["layouts"]
    # Progress on stderr (not a terminal here): one plain line per layout simulated or refused.
    progress = [l for l in captured.err.splitlines() if l.startswith("simulating ")]
    assert len(progress) == len(layouts) + len(json.loads(js.read_text())["refused"])
    shown = [l for l in text.splitlines() if l.strip().startswith(("1 ", "2 ", "3 "))]
    # TP1 PP1 DP2, TP1 PP2 DP1 and TP2 SP PP1 DP1 (no distributed optimizer on a CPU).
    assert len(shown) == len(layouts) == 3
    cpu = load_device_config("cpu")
    for l in layouts:
        assert max(l["stage_peak_mib"]) <= cpu.memory_mib - cpu.reserved_mib
        assert l["tp"] * l["pp"] * l["dp"] == 2
    best = layouts[0]
    config = out.read_text()
    assert f"pipeline-model-parallel-size: {best['pp']}" in config
    assert f"tensor-model-parallel-size: {best['tp']}" in config
    assert ("sequence-parallel: true" in config) == best["sequence_parallel"]
    assert "dynapipe-tokens-per-global-batch: 1200" in config
    assert re_loss(train_one_iteration("pretrain_gpt.py", out))


def train_one_iteration(script: str, run_config) -> str:
    """stdout of ``scripts/<script> --run-config <run_config>`` for one iteration on 2 ranks."""
    from dynapipe.runtime.distributed import free_port

    port = str(free_port())
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                             "--master-port", port, os.path.join(ROOT, "scripts", script),
                             "--run-config", str(run_config), "--train-iters", "1", "--log-interval", "1"],
                            capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def _run_config_argv(parser, run_config) -> list[str]:
    """One iteration of ``run_config`` as the scripts merge it (``--run-config`` itself left out)."""
    from megatron_integration.run_config import add_run_config_argument, with_run_config

    add_run_config_argument(parser)
    argv = with_run_config(parser, ["--run-config", str(run_config), "--train-iters", "1", "--log-interval", "1"], 2)
    at = argv.index("--run-config")
    return argv[:at] + argv[at + 2:]


def gpt_losses_in_a_job(run_config) -> list:
    """The last stage's losses of one iteration of a GPT ``run_config`` on 2 ranks forked from the
    launcher's warm server (no fresh interpreters importing torch): the run config's arguments, as
    the script merges them, through the training the script calls (train_one_iteration runs the
    script itself)."""
    from megatron_integration.arguments import build_parser
    from megatron_integration.jobs import run_trainings

    return run_trainings([_run_config_argv(build_parser(), run_config)], 2, timeout_s=240)[0][-1]["losses"]


def t5_run_in_a_job(run_config) -> tuple[list[str], list[dict]]:
    """``(argv, summaries)``: one iteration of a T5 ``run_config`` on 2 ranks, as
    :func:`gpt_losses_in_a_job`; ``summaries[rank]`` is that rank's summary of the run."""
    from megatron_integration.t5_arguments import build_t5_parser
    from megatron_integration.t5_jobs import run_t5_training

    argv = _run_config_argv(build_t5_parser(), run_config)
    return argv, [ranks[0] for ranks in run_t5_training([argv], 2, timeout_s=240)]


def re_loss(stdout: str) -> bool:
    import re
    return re.search(r"iteration\s+1/\s+1 \|.*lm loss: \d\.\d{6}E[+-]\d\d", stdout) is not None


@pytest.mark.parametrize("argv, message", [
    (["--gpus", "0"], "--gpus 0: must be at least 1"),
    (["--gpus", "2", "--batches", "0"], "--batches 0: must be at least 1"),
    (["--gpus", "2", "--tokens-per-iteration", "-5"], "--tokens-per-iteration -5"),
    (["--gpus", "2", "--seq-length", "4096"], "exceeds the model's max_seq_length"),
    (["--gpus", "2", "--output", "/"], "--output '/' is a directory; give a file path"),
    (["--gpus", "2", "--tp-sizes", "3"], "--tp-sizes 3 does not divide num_attention_heads=4"),
    (["--gpus", "2", "--vpp-sizes", "3"], "--vpp-sizes 3: no pipeline size here splits the 4 layers"),
    (["--gpus", "2", "--tp-sizes", "1,x"], "--tp-sizes: '1,x': expected comma-separated integers"),
    (["--gpus", "2", "--no-packing", "--packing-attention", "mask"], "--no-packing skips the packing comparison"),
    (["--gpus", "2", "--no-packing", "--packing-schedule", "search"], "--no-packing skips the packing comparison"),
    (["--gpus", "2", "--packing-schedule", "search", "--packing-attention", "mask"],
     "with --packing-attention mask use --packing-schedule 1f1b"),
])
def test_bad_advise_arguments_give_one_line(argv, message, capsys):
    rc = main(["advise", "--model", "gpt-tiny", "--device", "cpu", "--cluster", "cpu-local",
               "--mixture", "flan-mixture", *argv])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and err.count("\n") == 1, err


@pytest.mark.parametrize("extra, remedy", [
    ([], "give more GPUs (8 split them into up to 8) or a device with more memory."),
    (["--memory-limit-mb", "30000"], "or a higher --memory-limit-mb (up to the device's 40536 MiB)."),
])
def test_when_no_layout_fits_the_error_says_what_would(extra, remedy, capsys):
    # 7 GPUs leave gpt-7b's 32 layers one stage: its model states fit no GPU of 40 GB. The refusal
    # used to list the layouts tried and stop there.
    rc = main(["advise", "--model", "gpt-7b", "--device", "a100-40gb", "--cluster", "a100-8x", "--gpus", "7",
               "--mixture", "flan-mixture", "--batches", "1", "--no-progress", *extra])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "no layout fits: TP1 PP1 DP7 ZeRO-1: model states need" in err, err
    assert "7 GPU(s) split the 32 layers of gpt-7b into at most 1 pipeline stage(s)" in err and remedy in err, err
    with pytest.raises(DynaPipeError, match=r"higher memory_limit_mib \(up to"):
        advise([np.full(16, 512)], load_model_config("gpt-7b"), load_device_config("a100-40gb"), 7,
               memory_limit_mib=30000, compare_packing=False).best


def test_bad_mixture_and_lengths_give_one_line(tmp_path, capsys):
    base = ["advise", "--model", "gpt-tiny", "--device", "cpu", "--cluster", "cpu-local", "--gpus", "2"]
    assert main(base + ["--mixture", "no-such-mixture"]) == 2
    assert "no-such-mixture" in capsys.readouterr().err
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("12\nabc\n")
    assert main(base + ["--lengths", str(lengths)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "lengths.txt" in err


def test_advise_refuses_sizes_past_its_caps_and_one_path_for_two_files(tmp_path, monkeypatch, capsys):
    # Refused in one line naming advise's own flag, before a batch is sampled (past the caps a
    # run takes hours or exhausts memory; the synthetic sampler would name --samples).
    import dynapipe.advise as library

    def worked(*a, **k):
        raise AssertionError("sampled or simulated before refusing")
    monkeypatch.setattr(library, "sample_batches", worked)
    monkeypatch.setattr(library, "advise", worked)
    base = ["advise", "--model", "gpt-tiny", "--device", "cpu", "--cluster", "cpu-local", "--mixture", "flan-mixture"]
    same = str(tmp_path / "best.yaml")
    for argv, message in ((["--gpus", "100000"], "--gpus 100000: at most 16,384 (the largest published training"),
                          (["--gpus", "2", "--batches", "1000000"], "--batches 1000000: at most 32 (each global"),
                          (["--gpus", "2", "--tokens-per-iteration", "999999999999"],
                           "--tokens-per-iteration 999999999999: at most 16,777,216 (the 16M-token global batches"),
                          (["--gpus", "2", "--output", same, "--json", same],
                           f"--output and --json name the same file {same!r}, which --json would overwrite"),
                          # torchrun starts as many processes on every node (this once wrote 3 x 6).
                          (["--gpus", "20", "--cluster", "a100-8x", "--output", same],
                           "--gpus 20 is not a whole number of a100-8x's 8-GPU nodes, and a run config launches as "
                           "many processes on every node; advise --gpus 16 or 24")):
        assert main(base + argv) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1 and "--samples" not in err, err
    assert not os.listdir(tmp_path)
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("100\n" * 64)
    base = base[:-2]
    assert main(base + ["--gpus", "2", "--lengths", str(lengths), "--output", str(lengths)]) == 2
    err = capsys.readouterr().err
    assert f"--lengths and --output name the same file {str(lengths)!r}, which --output would" in err, err
    assert lengths.read_text() == "100\n" * 64
    # The README's and these tests' requests stay inside the caps.
    from dynapipe.cli.advise import CAPS
    assert CAPS["gpus"][0] >= 64 and CAPS["batches"][0] >= 2 and CAPS["tokens-per-iteration"][0] >= 1 << 20


def test_a_lengths_file_smaller_than_one_global_batch_is_refused(tmp_path, capsys):
    lengths = tmp_path / "l3.txt"
    lengths.write_text("100\n200\n300\n")
    assert main(["advise", "--model", "gpt-tiny", "--device", "cpu", "--cluster", "cpu-local", "--gpus", "2",
                 "--lengths", str(lengths), "--tokens-per-iteration", "1048576", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--lengths holds 600 tokens (samples clipped at 1024), fewer than the 1,048,576 of a global batch" in err
    # Clipped as simulated: 100 + 128 + 128 tokens at --seq-length 128.
    with pytest.raises(DynaPipeError, match="holds 356 tokens .* fewer than the 600"):
        sample_batches(600, 1, 0, 128, pool=np.array([100, 200, 300]))
    assert [len(b) for b in sample_batches(356, 2, 0, 128, pool=np.array([100, 200, 300]))] == [3, 3]


def test_layouts_with_more_replicas_than_samples_are_left_out_not_given_a_larger_batch(tmp_path, capsys):
    from dynapipe.cli.advise_run_config import run_config_text

    tiny, cpu, local = load_model_config("gpt-tiny"), load_device_config("cpu"), load_cluster_config("cpu-local")
    batches = [np.array([100, 120, 90]), np.array([80, 60, 70, 50])]  # 3 samples in the smaller one
    layouts = [Layout(1, 1, 4), Layout(1, 2, 2), Layout(1, 4, 1)]
    advice = advise(batches, tiny, cpu, 4, cluster=local, seq_length=128, layouts=layouts, compare_packing=False)
    assert [l for l, _ in advice.left_out] == [Layout(1, 1, 4)]
    assert "DP above the 3 samples of a global batch" in advice.left_out[0][1]
    assert {r.layout for r in advice.results} | {l for l, _ in advice.refused} == set(layouts[1:])
    with pytest.raises(DynaPipeError, match=r"more data-parallel replicas \(DP4 at the least\) than the 3 samples"):
        advise(batches, tiny, cpu, 4, cluster=local, seq_length=128, layouts=layouts[:1])
    # A layout of another GPU count is not ranked for these GPUs; a layout of no GPUs is no layout.
    with pytest.raises(DynaPipeError, match="layout TP1 PP4 DP4 does not use the 4 GPUs given"):
        advise(batches, tiny, cpu, 4, cluster=local, seq_length=128, layouts=[Layout(1, 4, 4)])
    with pytest.raises(DynaPipeError, match="layout tp=0: must be a whole number of at least 1"):
        Layout(0, 1, 4)
    # The run config keeps the simulated global batch (mean samples), never one stretched to DP.
    config = run_config_text(advice.best, tiny, "cpu", "cpu-local", local, 4, 400, 128, None, None, batches)
    assert "global-batch-size: 4\n" in config
    # The command: 1,024 GPUs and ~8k tokens leave every layout with more replicas than samples.
    out = tmp_path / "best.yaml"
    assert main(["advise", "--model", "gpt-tiny", "--device", "cpu", "--cluster", "cpu-local", "--gpus", "1024",
                 "--mixture", "flan-mixture", "--tokens-per-iteration", "8192", "--no-progress",
                 "--output", str(out)]) == 2
    assert "every layout has more data-parallel replicas (DP64 at the least) than the" in capsys.readouterr().err
    assert not out.exists()


def test_batches_from_a_lengths_pool_respect_the_token_budget():
    pool = np.arange(1, 400)
    batches = sample_batches(5000, 3, 1, 256, pool=pool)
    for b in batches:
        assert np.minimum(b, 256).sum() <= 5000 and len(set(b.tolist())) == len(b)
    assert not np.array_equal(batches[0], batches[1])


def test_encoder_decoder_layouts_are_ones_t5_training_runs(tmp_path, capsys):
    # T5 stages refuse the distributed optimizer; the run config is pretrain_t5.py's, and it trains
    # (here forced to TP2 with sequence parallelism).
    model = tmp_path / "t5-tiny.yaml"
    model.write_text("name: t5-tiny\narch: t5\nencoder_layers: 2\ndecoder_layers: 2\nhidden_size: 64\n"
                     "num_attention_heads: 4\nffn_hidden_size: 256\nvocab_size: 512\nmax_seq_length: 512\n"
                     "dtype: fp32\n")
    out = tmp_path / "t5.yaml"
    rc = main(["advise", "--model", str(model), "--device", "cpu", "--cluster", "cpu-local", "--gpus", "2",
               "--mixture", "flan-mixture", "--tokens-per-iteration", "2000", "--seq-length", "256", "--batches", "1",
               "--tp-sizes", "2", "--no-progress", "--output", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "no distributed optimizer (T5 stages refuse it)" in text and "TP2 SP PP1 DP1" in text
    config = out.read_text()
    for line in ("scripts/pretrain_t5.py --run-config FILE", "encoder-num-layers: 2", "decoder-num-layers: 2",
                 "encoder-seq-length: 256", "tensor-model-parallel-size: 2", "sequence-parallel: true"):
        assert line in config, line
    assert "\n  num-layers:" not in config and "use-distributed-optimizer" not in config
    # No token budget: Megatron's T5 span-corruption data (--data-path) refuses one.
    assert "tokens-per-global-batch" not in config and "global-batch-size: " in config
    stdout = train_one_iteration("pretrain_t5.py", out)
    assert re_loss(stdout)
    # Rank 0's argument block, once, with the depth as Megatron-LM resolves it.
    assert stdout.count("------------------------ arguments ------------------------") == 1
    assert "  num_layers ...................................... 2\n" in stdout
    # Rank 0's data line, as for GPT (the mixture's pairs).
    assert stdout.count(" > train data: ") == 1 and " samples, " in stdout.split(" > train data: ")[1]
    # A run config for another job size is refused on every script, naming the launch it needs.
    result = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "pretrain_t5.py"), "--run-config", str(out)],
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 2 and "torchrun --nnodes 1 --nproc-per-node 2" in result.stderr


def test_tp_groups_stay_inside_a_node_and_t5_layouts_leave_out_the_distributed_optimizer():
    import dataclasses

    a100 = load_cluster_config("a100-8x")  # 8 GPUs a node
    twelve = dataclasses.replace(load_model_config("gpt-tiny"), num_attention_heads=12, ffn_hidden_size=384)
    # TP 3 splits the model but not a node of 8: ranks 6-8 would straddle two nodes.
    with pytest.raises(DynaPipeError, match="tp_sizes 3 does not divide the 8 GPUs of a node"):
        enumerate_layouts(twelve, 12, a100, tp_sizes=[3])
    assert 3 not in default_tp_sizes(twelve, 12, a100)
    # The library's default, not only the command's: T5 stages refuse the distributed optimizer.
    t5 = enumerate_layouts(load_model_config("t5-11b"), 16, a100)
    assert t5 and not any(l.zero for l in t5)


def _tiny_t5_on_cpu(tmp_path):
    """A 3 + 3-layer T5 priced on this CPU, its device, its links and one mixture batch of
    6,000 tokens."""
    from dynapipe.data.synthetic import DEFAULT_MIXTURE, load_mixture

    path = tmp_path / "t5-3-3.yaml"
    path.write_text("name: t5-3-3\narch: t5\nencoder_layers: 3\ndecoder_layers: 3\nhidden_size: 64\n"
                    "num_attention_heads: 4\nffn_hidden_size: 256\nvocab_size: 512\nmax_seq_length: 1024\n"
                    "dtype: fp32\n")
    batches = sample_batches(6000, 1, 0, 1024, encoder_decoder=True, mixture=load_mixture(DEFAULT_MIXTURE))
    return load_model_config(str(path)), load_device_config("cpu"), load_cluster_config("cpu-local"), batches


def test_encoder_decoder_layouts_run_on_the_planned_placement_and_train_on_it(tmp_path):
    from dynapipe.cli.advise_run_config import run_config_text
    from dynapipe.schedule.placement import choose_placement_kind

    model, cpu, local, batches = _tiny_t5_on_cpu(tmp_path)
    advice = advise(batches, model, cpu, 2, cluster=local, seq_length=1024, layouts=[Layout(1, 2, 1)],
                    compare_packing=False)
    best = advice.best
    # The placement the planner chooses on the same batches, independently: not the even 3+0,0+3.
    expect = choose_placement_kind(batches, build_cost_model(model, cpu, 2), seq_length=1024, cluster=local,
                                   memory_limit_mib=cpu.memory_mib, reserved_mib=cpu.reserved_mib)
    assert best.placement == str(expect.cost_model.placement) != "3+0,0+3"
    unplaced = advise(batches, model, cpu, 2, cluster=local, seq_length=1024, layouts=[Layout(1, 2, 1)],
                      compare_packing=False, plan_placement=False).best
    assert unplaced.placement is None and best.real_tokens_per_s > unplaced.real_tokens_per_s
    out = tmp_path / "run.yaml"
    out.write_text(run_config_text(best, model, "cpu", "cpu-local", local, 2, 6000, 1024, None, None, batches))
    assert f'dynapipe-placement: "{best.placement}"' in out.read_text()
    # It trains on that placement: each rank's stage holds the parameters the planner counts for it.
    from dynapipe.cost.base import stage_param_count
    from megatron_integration.t5_arguments import parse_t5_args

    argv, ranks = t5_run_in_a_job(out)
    cfg = parse_t5_args(argv, 2, cuda=False)
    assert str(cfg.stage_placement()) == best.placement
    layouts = cfg.stage_placement().layouts()
    assert [r["parameters"] for r in ranks] == [stage_param_count(cfg.planner_model(), lay) for lay in layouts]
    losses = ranks[-1]["losses"]
    assert len(losses) == 1 and np.isfinite(losses[0]) and losses[0] > 0


def test_interleaved_layouts_are_priced_on_megatron_chunks_and_train_from_the_run_config(tmp_path):
    from dynapipe.cli.advise_run_config import run_config_text
    from dynapipe.cost.chunked_placement import even_chunked_placement

    gpt7, a100 = load_model_config("gpt-7b"), load_cluster_config("a100-8x")
    layouts = enumerate_layouts(gpt7, 16, a100, tp_sizes=[1], chunk_counts=[1, 2, 3])
    # 2 chunks a rank wherever 2 x PP divides the 32 layers (3 never does); never at PP1.
    assert {(l.pp, l.chunks) for l in layouts} == {(p, 1) for p in (1, 2, 4, 8, 16)} | {(p, 2) for p in (2, 4, 8, 16)}
    assert "TP1 PP4 VPP2 DP4 ZeRO-1" in {l.label() for l in layouts}
    # The plain pipeline is always ranked, even when only chunks are asked for.
    assert {l.chunks for l in enumerate_layouts(gpt7, 16, a100, tp_sizes=[1], chunk_counts=[2])} == {1, 2}
    with pytest.raises(DynaPipeError, match="model chunks need PP 2 or more"):
        Layout(1, 1, 2, chunks=2)
    t5 = load_model_config("t5-11b")
    assert {l.chunks for l in enumerate_layouts(t5, 16, a100, chunk_counts=[1, 2])} == {1}
    refused = advise(sample_batches(4096, 1, 0, 512, encoder_decoder=True), t5, load_device_config("a100-40gb"), 16,
                     cluster=a100, layouts=[Layout(8, 2, 1, sp=True, chunks=2)], compare_packing=False).refused
    assert "interleave through their planned placement" in refused[0][1]
    # Priced exactly as DynaPipe on Megatron's even interleaved split.
    device = load_device_config("a100-40gb")
    batches = sample_batches(12_000, 1, 0, 1024)
    got = advise(batches, gpt7, device, 8, cluster=a100, seq_length=1024, layouts=[Layout(1, 4, 2, True, chunks=2)],
                 compare_packing=False).best
    cm = build_cost_model(gpt7, device, 4)
    cm = cm.with_placement(even_chunked_placement(cm, 2))
    run = simulate_method(batches[0], "dynapipe", cm, dp=2, seq_length=1024, cluster=a100, zero=True)
    sync = dp_sync_ms(cm, dp=2, zero=True, cluster=a100)  # a rank's parameters: both its chunks'
    assert got.dynapipe.step_ms == sync > 0
    assert got.real_tokens_per_s == pytest.approx(run.real_tokens / ((run.iteration_ms + sync) / 1e3), rel=1e-9)
    # The run config says the chunks, and the tiny GPT trains on them (DynaPipe, 2 ranks).
    tiny, cpu, local = load_model_config("gpt-tiny"), load_device_config("cpu"), load_cluster_config("cpu-local")
    small = sample_batches(1200, 1, 0, 128)
    best = advise(small, tiny, cpu, 2, cluster=local, seq_length=128, layouts=[Layout(1, 2, 1, chunks=2)],
                  compare_packing=False).best
    out = tmp_path / "vpp.yaml"
    out.write_text(run_config_text(best, tiny, "cpu", "cpu-local", local, 2, 1200, 128, None, None, small))
    assert "num-virtual-stages-per-pipeline-rank: 2" in out.read_text()
    losses = gpt_losses_in_a_job(out)
    assert len(losses) == 1 and np.isfinite(losses[0]) and losses[0] > 0


def test_the_run_config_trains_the_layer_kind_that_was_simulated():
    # A model config's layer kind, dropout and positions become the run's Megatron flags, so the
    # run's planner model is the one advise simulated.
    from dynapipe.cli.advise_run_config import layer_flags
    from megatron_integration.arguments import parse_training_args

    model = dataclasses.replace(load_model_config("gpt-tiny"), gated_linear_unit=True, add_bias_linear=False,
                                add_qkv_bias=True, qk_layernorm=True, normalization="RMSNorm", num_query_groups=2,
                                hidden_dropout=0.0, attention_dropout=0.05, position_embedding_type="rope",
                                tie_embeddings=False)
    argv = [f"--{k}" if v is True else f"--{k} {v}" for k, v in layer_flags(model).items()]
    assert "--transformer-impl local" in argv
    base = (f"--num-layers {model.num_layers} --hidden-size {model.hidden_size} --num-attention-heads "
            f"{model.num_attention_heads} --ffn-hidden-size {model.ffn_hidden_size} --seq-length 128 "
            f"--vocab-size {model.vocab_size} --micro-batch-size 1 --global-batch-size 4 --lr 1e-3 --mock-data "
            f"--train-iters 1")
    got = parse_training_args(f"{base} {' '.join(argv)}".split(), 1, cuda=False).model.to_model_config()
    for key in ("gated_linear_unit", "add_bias_linear", "add_qkv_bias", "qk_layernorm", "normalization",
                "num_query_groups", "hidden_dropout", "attention_dropout", "position_embedding_type", "tie_embeddings"):
        assert getattr(got, key) == getattr(model, key), key
    # Megatron's defaults are not written out; the layers always are (Transformer Engine's are
    # the GPU default, and they keep no attention scores and cannot split their backward).
    assert layer_flags(load_model_config("gpt-tiny")) == {"transformer-impl": "local"}
    te = dataclasses.replace(load_model_config("gpt-tiny"), fused_attention=True)
    assert layer_flags(te) == {"transformer-impl": "transformer_engine"}


def test_the_header_counts_the_tokens_simulated(tmp_path, capsys):
    # Samples longer than --seq-length are simulated clipped; the header summed them whole
    # (~67,800 tokens a batch where the layouts ran on about 16,000).
    lengths = tmp_path / "long.txt"
    lengths.write_text("100\n300\n5000\n" * 40)
    assert main(["advise", "--model", "gpt-tiny", "--device", "cpu", "--cluster", "cpu-local", "--gpus", "2",
                 "--lengths", str(lengths), "--tokens-per-iteration", "16384", "--seq-length", "1024",
                 "--batches", "1", "--no-progress", "--no-packing"]) == 0
    out = capsys.readouterr().out
    tokens = int(re.search(r"global batch\(es\) of ~([\d,]+) tokens", out).group(1).replace(",", ""))
    assert 16384 - 1024 <= tokens <= 16384, out.splitlines()[0]
    # Without the packing comparison the legend does not describe a packing column.
    assert "tokens/s: real (non-pad) tokens, simulated." in out and "packing: the best" not in out


def test_t5_chunk_counts_are_refused_with_the_only_fix(capsys):
    rc = main(["advise", "--model", "t5-11b", "--device", "a100-40gb", "--cluster", "a100-8x", "--gpus", "16",
               "--mixture", "flan-mixture", "--tokens-per-iteration", "65536", "--vpp-sizes", "2", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "--vpp-sizes 2: encoder-decoder models interleave through their planned placement" in err
    assert err.rstrip().endswith("drop --vpp-sizes.")


def test_layouts_are_priced_on_the_vocabulary_megatron_trains_at_their_tp_size():
    # The run config passes the model's vocabulary as --vocab-size, which Megatron-LM pads to a
    # multiple of 128 x TP: gpt-7b's 50,304 ids train as 50,432 at TP2 (advise priced 50,304).
    from dynapipe.advise import trained_model
    from megatron_integration.arguments import parse_training_args

    model = load_model_config("gpt-7b")
    for tp in (1, 2, 4):
        argv = (f"--num-layers 4 --hidden-size 4096 --num-attention-heads 32 --seq-length 128 --vocab-size "
                f"{model.vocab_size} --micro-batch-size 1 --global-batch-size 4 --lr 1e-3 --mock-data "
                f"--train-iters 1 --tensor-model-parallel-size {tp}").split()
        trained = parse_training_args(argv, tp, cuda=False).model.vocab_size
        assert trained_model(model, tp).vocab_size == trained, tp
    assert trained_model(model, 2).vocab_size == 50432


def test_the_data_parallel_step_grows_with_the_parameters_a_gpu_holds_and_leaves_the_node():
    """What the advisor adds to each layout's iteration: ring collectives of a stage's
    gradients over its replicas, on the inter-node link once they span nodes."""
    model, device = load_model_config("gpt-13b"), load_device_config("a100-40gb")
    cluster = load_cluster_config("a100-8x")  # 8 GPUs a node
    pp4 = build_cost_model(model, device, 4)
    params = max(pp4.layout_param_count(l) for l in pp4.layouts)
    assert dp_sync_ms(pp4, dp=1, zero=False, cluster=cluster) == 0.0
    assert dp_sync_ms(pp4, dp=2, zero=False, cluster=None) == 0.0
    inside = dp_sync_ms(pp4, dp=2, zero=False, cluster=cluster, tp=4)   # ranks 0 and 4: one node
    across = dp_sync_ms(pp4, dp=2, zero=False, cluster=cluster, tp=8)   # ranks 0 and 8: two nodes
    bw_in, bw_out = cluster.intra_node.bandwidth_gbps * 1e6, cluster.inter_node.bandwidth_gbps * 1e6
    assert inside == pytest.approx(2 * (cluster.intra_node.latency_ms + 4 * params / 2 / bw_in))
    assert across == pytest.approx(2 * (cluster.inter_node.latency_ms + 4 * params / 2 / bw_out))
    # The distributed optimizer moves 4 + 2 bytes a parameter instead of the all-reduce's 2 x 4.
    zero = dp_sync_ms(pp4, dp=16, zero=True, cluster=cluster)
    plain = dp_sync_ms(pp4, dp=16, zero=False, cluster=cluster)
    assert zero / plain == pytest.approx(0.75, rel=1e-3)


def test_advise_ranks_layouts_with_their_data_parallel_step(tmp_path, capsys):
    model, device = load_model_config("gpt-13b"), load_device_config("a100-40gb")
    cluster = load_cluster_config("a100-8x")
    batches = sample_batches(70_000, 1, 0, 4096)
    advice = advise(batches, model, device, 16, cluster=cluster, seq_length=4096, compare_packing=True,
                    layouts=[Layout(4, 1, 4, True, sp=True), Layout(2, 4, 2, True, sp=True)])
    by = {r.layout: r for r in advice.results}
    for r in advice.results:
        d = r.dynapipe.summary()
        assert d["step_ms"] > 0 and r.to_json()["dp_sync_ms"] == d["step_ms"]
        run = r.dynapipe.runs[0]
        assert r.real_tokens_per_s == pytest.approx(run.real_tokens / ((run.iteration_ms + d["step_ms"]) / 1e3))
        assert r.packing.step_ms == r.dynapipe.step_ms  # both methods pay the layout's step
    # TP4 x DP4 reduces 3.3B parameters a GPU over two nodes; TP2 x PP4 x DP2 0.8B inside one.
    assert by[Layout(4, 1, 4, True, sp=True)].dynapipe.step_ms > 5 * by[Layout(2, 4, 2, True, sp=True)].dynapipe.step_ms


def test_advise_compares_with_per_sample_packing_unless_told_masked_rows():
    model, device = load_model_config("gpt-7b"), load_device_config("a100-40gb")
    cluster = load_cluster_config("a100-8x")
    batches = sample_batches(40_000, 1, 0, 4096)
    kw = dict(cluster=cluster, seq_length=4096, layouts=[Layout(2, 4, 1, True, sp=True)])
    per_sample = advise(batches, model, device, 8, **kw).results[0]
    masked = advise(batches, model, device, 8, packing_method="packing", **kw).results[0]
    assert per_sample.to_json()["packing"]["method"] == "packing-per-sample"
    assert masked.to_json()["packing"]["method"] == "packing"
    # Masked rows compute the attention between samples too: the weaker packing, the larger ratio.
    assert per_sample.packing.real_tokens_per_s > masked.packing.real_tokens_per_s
    assert per_sample.speedup_vs_packing < masked.speedup_vs_packing
    with pytest.raises(DynaPipeError, match="packing method 'padding'"):
        advise(batches, model, device, 8, packing_method="padding", **kw)
    # Given DynaPipe's schedule search too, the same per-sample rows run at least as fast.
    searched = advise(batches, model, device, 8, packing_method="packing-search", **kw).results[0]
    assert searched.to_json()["packing"]["method"] == "packing-search"
    assert searched.packing.real_tokens_per_s >= per_sample.packing.real_tokens_per_s * (1 - 1e-9)


def test_the_best_layout_for_packing_is_named_beside_dynapipes(tmp_path, capsys):
    out = tmp_path / "advice.json"
    rc = main(["advise", "--model", "gpt-tiny", "--device", "cpu", "--cluster", "cpu-local", "--gpus", "4",
               "--mixture", "flan-mixture", "--tokens-per-iteration", "8192", "--seq-length", "512",
               "--no-progress", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0
    data = json.loads(out.read_text())
    packed = [r for r in data["layouts"] if "packing" in r]
    rival = max(packed, key=lambda r: r["packing"]["real_tokens_per_s"])
    got = data["best_packing"]
    assert got["real_tokens_per_s"] == pytest.approx(rival["packing"]["real_tokens_per_s"], abs=0.1)
    assert got["method"] == "packing-per-sample"
    assert got["dynapipe_best_vs_it"] == pytest.approx(data["layouts"][0]["real_tokens_per_s"]
                                                       / rival["packing"]["real_tokens_per_s"], abs=2e-3)
    assert f"best layout for packing: {got['layout']}," in text and "attention per sample" in text


def test_the_run_config_names_a_device_and_cluster_file_by_path(tmp_path, capsys, monkeypatch):
    """A device or cluster YAML is written by its absolute path, not its ``name`` field: a copy
    that keeps a shipped name would otherwise train with the shipped config's figures."""
    from megatron_integration.arguments import build_parser, parse_training_args
    from megatron_integration.run_config import add_run_config_argument, with_run_config

    device = tmp_path / "small-cpu.yaml"
    device.write_text(open(os.path.join(ROOT, "configs", "devices", "cpu.yaml")).read()
                      .replace("memory_mib: 8192", "memory_mib: 6000"))  # keeps `name: cpu`
    monkeypatch.chdir(tmp_path)
    rc = main(["advise", "--model", "gpt-tiny", "--device", "small-cpu.yaml", "--cluster", "cpu-local", "--gpus", "2",
               "--mixture", "flan-mixture", "--tokens-per-iteration", "1200", "--seq-length", "128",
               "--batches", "1", "--no-packing", "--output", "best.yaml"])
    assert rc == 0, capsys.readouterr()
    text = (tmp_path / "best.yaml").read_text()
    assert f"dynapipe-device: {json.dumps(str(device))}" in text and 'dynapipe-cluster: "cpu-local"' in text
    parser = build_parser()
    add_run_config_argument(parser)
    cfg = parse_training_args(with_run_config(parser, ["--run-config", "best.yaml"], 2), 2, cuda=False, parser=parser)
    assert load_device_config(cfg.dynapipe.device).memory_mib == 6000


def test_encoder_decoder_packing_also_runs_on_its_own_split_and_keeps_the_faster(tmp_path, monkeypatch):
    # A split chosen for DynaPipe's micro-batches need not suit packing's: packing also runs on
    # the one chosen for its own rows, under its own schedule, and is compared at its faster.
    import dynapipe.advise as advise_mod
    from dynapipe.schedule.placement import Cut

    model, cpu, local, batches = _tiny_t5_on_cpu(tmp_path)
    cuts, packings = [], []
    placed, compare = advise_mod._placed, advise_mod.compare_over_batches

    def recording_placed(batches, cost_model, kw, cut=advise_mod.DYNAPIPE_CUT, schedule="auto"):
        cuts.append((cut, schedule))
        return placed(batches, cost_model, kw, cut=cut, schedule=schedule)

    def recording_compare(batches, method, cost_model, **kw):
        result = compare(batches, method, cost_model, **kw)
        if method == "packing-per-sample":
            packings.append((str(cost_model.placement), result.real_tokens_per_s))
        return result

    monkeypatch.setattr(advise_mod, "_placed", recording_placed)
    monkeypatch.setattr(advise_mod, "compare_over_batches", recording_compare)
    best = advise(batches, model, cpu, 2, cluster=local, seq_length=1024, layouts=[Layout(1, 2, 1)]).best
    assert cuts[0] == (advise_mod.DYNAPIPE_CUT, "auto")
    assert cuts[1] == (Cut("packing-per-sample", best.packing.micro_batch_size), "1f1b")
    assert len(packings) == 2 and packings[0][0] == best.placement
    kept = max(packings, key=lambda p: p[1])
    assert best.packing.real_tokens_per_s == kept[1]
    assert best.to_json()["packing"]["placement"] == kept[0]
    assert (best.packing_placement is None) == (kept is packings[0])


def test_encoder_decoder_placement_is_chosen_under_the_backward_the_layers_can_run(tmp_path, monkeypatch):
    # Fused attention (Transformer Engine's layers) cannot split its backward: the placement is
    # chosen by simulating the schedules those layers run, not the zero-bubble ones.
    import dataclasses

    import dynapipe.schedule.placement as placement_mod

    model, cpu, local, batches = _tiny_t5_on_cpu(tmp_path)
    seen = []
    choose = placement_mod.choose_placement_kind

    def recording(*args, **kw):
        seen.append(kw["split_backward"])
        return choose(*args, **kw)

    monkeypatch.setattr(placement_mod, "choose_placement_kind", recording)
    for fused in (False, True):
        seen.clear()
        advise(batches, dataclasses.replace(model, fused_attention=fused), cpu, 2, cluster=local, seq_length=1024,
               layouts=[Layout(1, 2, 1)], compare_packing=False)
        assert seen == [not fused], (fused, seen)
