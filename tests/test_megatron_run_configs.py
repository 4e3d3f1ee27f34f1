"""The shipped run configs parse into valid training configs, and their plans fit in memory."""
import glob
import os

import pytest

from dynapipe.config import CONFIG_DIR, TensorParallelConfig, load_cluster_config, load_device_config
from dynapipe.cost import build_cost_model
from dynapipe.data.synthetic import sample_lengths
from dynapipe.errors import DynaPipeError
from dynapipe.pipeline_planner import plan_iteration
from megatron_integration.arguments import build_parser, load_run_config, training_config_from_args
from megatron_integration.run_config import add_run_config_argument, negatable_flags, with_run_config

RUNS = sorted(glob.glob(os.path.join(CONFIG_DIR, "runs", "*.yaml")))


@pytest.mark.parametrize("path", RUNS, ids=[os.path.basename(p) for p in RUNS])
def test_run_config_is_valid_and_plannable(path, tmp_path, monkeypatch, gpu_with_te):
    # The GPU configs are for GPU nodes with Transformer Engine (--transformer-impl's default) installed.
    # Validation proves --save writable by creating it; keep the relative checkpoints/ out of the checkout.
    monkeypatch.chdir(tmp_path)
    run = load_run_config(path)
    assert run.world_size is not None
    gpu = "cpu" not in os.path.basename(path)
    cfg = training_config_from_args(build_parser().parse_args(list(run.argv)), run.world_size, cuda=gpu)
    assert cfg.method == "dynapipe"
    if gpu:
        assert cfg.model.dtype == "bf16" and cfg.dynapipe.memory_limit_mb is not None
    # One global batch of the mixture plans within the memory limit on this cluster.
    model = cfg.model.to_model_config("run")
    device = load_device_config(cfg.dynapipe.device)
    assert cfg.dynapipe.memory_limit_mb is None or cfg.dynapipe.memory_limit_mb <= device.memory_mib
    cluster = load_cluster_config(cfg.dynapipe.cluster)
    tp = TensorParallelConfig(cfg.parallel.tensor_model_parallel_size, link=cluster.intra_node)
    # Tensor parallelism stays inside a node.
    tp.validate(model, cluster.gpus_per_node)
    cost = build_cost_model(model, device, cfg.parallel.pipeline_model_parallel_size, tp=tp)
    lengths = sample_lengths(cfg.global_batch_size, 0, cfg.model.seq_length)
    plan = plan_iteration(lengths, cost, dp=cfg.parallel.data_parallel_size, memory_limit_mib=cfg.dynapipe.memory_limit_mb,
                          cluster=cluster, seq_length=cfg.model.seq_length,
                          zero=cfg.optimizer.distributed)
    limit = cfg.dynapipe.memory_limit_mb or device.memory_mib
    assert max(plan.stage_peak_mib) <= limit
    assert sum(len(mb.samples) for mb in plan.batch_plan.micro_batches) == cfg.global_batch_size


def test_run_config_errors(tmp_path):
    with pytest.raises(DynaPipeError, match="no such file"):
        load_run_config(str(tmp_path / "missing.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("arguments: {num-layers: 2}\n")
    with pytest.raises(DynaPipeError, match="unexpected"):
        load_run_config(str(bad))
    # An empty file (or empty args) gives nothing: named, where the run would have stopped
    # on the first required flag.
    for text in ("", "args: {}\n"):
        bad.write_text(text)
        with pytest.raises(DynaPipeError, match=f"{bad}: the run config gives no arguments"):
            load_run_config(str(bad))
    ok = tmp_path / "ok.yaml"
    ok.write_text("args: {num-layers: 2, bf16: true, fp16: false, data-path: [a.jsonl, b.jsonl]}\n")
    assert load_run_config(str(ok)).argv == ("--num-layers", "2", "--bf16", "--data-path", "a.jsonl", "b.jsonl")
    assert load_run_config("gpt-tiny-cpu-pp2").nproc_per_node == 2


def test_run_config_false_turns_off_a_flag_that_is_on_by_default(tmp_path):
    # Megatron-LM's --check-for-nan-in-loss-and-grad is on unless --no-...; `false` must not leave it on.
    run = tmp_path / "nan.yaml"
    run.write_text("args: {check-for-nan-in-loss-and-grad: false, bf16: false, ckpt-fully-parallel-save: false, "
                   "load-optim: false}\n")
    parser = build_parser()
    add_run_config_argument(parser)
    argv = with_run_config(parser, ["--run-config", str(run)], world_size=1)
    assert argv[:4] == ["--no-check-for-nan-in-loss-and-grad", "--no-ckpt-fully-parallel-save", "--no-load-optim",
                        "--run-config"] and "--bf16" not in argv
    assert "check-for-nan-in-loss-and-grad" in negatable_flags(parser)
    args = parser.parse_args(argv + ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                                     "--seq-length", "128", "--mock-data"])
    assert args.check_for_nan_in_loss_and_grad is False and args.ckpt_fully_parallel_save is False
    assert args.no_load_optim


def test_a_setting_typed_in_megatron_lms_other_spelling_replaces_the_run_configs():
    # The run config says --seq-length 1024 and --num-layers 4; the command line --encoder-seq-length
    # 512 and --encoder-num-layers=2 (Megatron-LM's other spellings): the typed ones win, as any
    # typed flag does, instead of the two spellings being refused as both given.
    parser = build_parser()
    add_run_config_argument(parser)
    argv = with_run_config(parser, ["--run-config", "configs/runs/gpt-tiny-cpu-pp2.yaml", "--encoder-seq-length",
                                    "512", "--encoder-num-layers=2"], world_size=2)
    assert "--seq-length" not in argv and "--num-layers" not in argv
    cfg = training_config_from_args(parser.parse_args(argv), 2, cuda=False)
    assert (cfg.model.seq_length, cfg.model.num_layers) == (512, 2)


def test_an_alternative_typed_on_the_command_line_replaces_the_run_configs_choice(tmp_path):
    # The file trains --train-iters 20 on --mock-data; the command line asks for --train-samples and
    # indexed data instead (Megatron-LM refuses either pair together): the typed choices win.
    from megatron_integration.run_config import shadowed_by

    parser = build_parser()
    add_run_config_argument(parser)
    argv = with_run_config(parser, ["--run-config", "configs/runs/gpt-tiny-cpu-pp2.yaml", "--train-samples", "640",
                                    "--data-path", "0.7", "a", "0.3", "b"], world_size=2)
    assert "--train-iters" not in argv and "--mock-data" not in argv
    assert argv[argv.index("--data-path"):][:5] == ["--data-path", "0.7", "a", "0.3", "b"]
    # One split's path replaces the file's whole data and the --split that divided it (which
    # Megatron-LM refuses beside per-split paths), not the file's other splits.
    assert shadowed_by({"--valid-data-path"}) == {"--mock-data", "--data-path", "--data-args-path",
                                                  "--per-split-data-args-path", "--split"}
    assert "--train-data-path" in shadowed_by({"--data-path"}) and "--data-path" not in shadowed_by({"--data-path"})
    assert "--split" not in shadowed_by({"--data-path"})  # the file's split divides the typed data


@pytest.mark.parametrize("typed, file_args, needle", [
    (["--train-samples", "640"], "{train-iters: 20, lr-warmup-iters: 5}",
     "--train-samples counts the run in samples, but RUN gives lr-warmup-iters: 5, which Megatron-LM refuses "
     "beside it; give it in samples on the command line (--lr-warmup-samples or --lr-warmup-fraction), which "
     "replaces the file's."),
    (["--train-iters", "20"], "{train-samples: 640, lr-decay-samples: 600}",
     "--train-iters counts the run in iterations, but RUN gives lr-decay-samples: 600"),
])
def test_a_run_length_typed_in_the_other_unit_than_the_files_schedule_names_the_file(tmp_path, typed, file_args,
                                                                                       needle):
    # The shipped GPU configs warm up over lr-warmup-iters: --train-samples typed over one was refused
    # in Megatron-LM's words, naming a flag the user never typed and not the file it came from.
    run = tmp_path / "run.yaml"
    run.write_text(f"args: {file_args}\n")
    parser = build_parser()
    add_run_config_argument(parser)
    with pytest.raises(DynaPipeError) as e:
        with_run_config(parser, ["--run-config", str(run), *typed], world_size=1)
    assert needle.replace("RUN", str(run)) in str(e.value)
    # Typing the schedule in the run's unit replaces the file's.
    fix = ["--lr-warmup-fraction", "0.1"] if typed[0] == "--train-samples" else ["--lr-decay-iters", "20"]
    argv = with_run_config(parser, ["--run-config", str(run), *typed, *fix], world_size=1)
    assert not {"--lr-warmup-iters", "--lr-decay-samples", "--train-iters", "--train-samples"} - {
        typed[0]} & set(argv)


@pytest.mark.parametrize("args, needle", [
    ("{num-layers: [1, 2]}", "args.num-layers takes one value, not the list [1, 2]"),
    ("{mock-data: 'yes'}", "args.mock-data is an on/off flag; give true or false, not 'yes'"),
    ("{num-layer: 2}", "args.num-layer is not a flag of this script"),
    # true passed the flag without its value, false and null dropped it without a word.
    ("{train-iters: true}", "args.train-iters takes a value, not true; give one, or null (or no entry) for the "
                            "script's default"),
    ("{lr: false}", "args.lr takes a value, not false"),
])
def test_run_config_entries_the_parser_would_misread_are_named(tmp_path, args, needle):
    run = tmp_path / "bad.yaml"
    run.write_text(f"args: {args}\n")
    parser = build_parser()
    add_run_config_argument(parser)
    with pytest.raises(DynaPipeError) as e:
        with_run_config(parser, ["--run-config", str(run)], world_size=1)
    assert str(e.value).startswith(f"{run}: ") and needle in str(e.value)


def test_an_unsupported_megatron_flag_in_a_run_config_is_named_with_its_reason(tmp_path, capsys):
    run = tmp_path / "unsupported.yaml"
    run.write_text("args: {overlap-param-gather: true}\n")
    parser = build_parser()
    add_run_config_argument(parser)
    argv = with_run_config(parser, ["--run-config", str(run)], world_size=1)
    with pytest.raises(SystemExit) as e:
        parser.parse_args(argv)
    assert e.value.code == 2
    assert "--overlap-param-gather is a Megatron-LM flag that dynapipe-megatron does not support" in capsys.readouterr().err
