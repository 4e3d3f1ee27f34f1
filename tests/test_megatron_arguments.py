"""Megatron-style arguments: valid command lines build a config; invalid ones fail clearly."""
import re

import pytest

from dynapipe.errors import DynaPipeError
from megatron_integration.arguments import build_parser, parse_training_args

BASE = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 256 --micro-batch-size 2 "
        "--global-batch-size 8 --train-iters 3 --lr 1e-3 --mock-data")


def parse(extra: str = "", world: int = 2, cuda: bool = False, base: str = BASE):
    return parse_training_args((base + " " + extra).split(), world, cuda=cuda)


def test_valid_command_line_builds_config():
    cfg = parse("--pipeline-model-parallel-size 2 --use-dynapipe --dynapipe-schedule adaptive", world=4)
    assert cfg.method == "dynapipe"
    assert cfg.dynapipe.batching == "dynapipe" and cfg.dynapipe.schedule == "adaptive"
    assert cfg.parallel.data_parallel_size == 2 and cfg.parallel.backend == "gloo"
    assert cfg.model.ffn_hidden_size == 256 and cfg.model.max_position_embeddings == 256
    assert cfg.model.dtype == "fp32"
    mc = cfg.model.to_model_config()
    assert mc.num_layers == 4 and mc.hidden_size == 64


def test_without_use_dynapipe_the_method_is_a_megatron_baseline():
    assert parse().method == "padding"
    assert parse("--dynapipe-batching packing --reset-position-ids --reset-attention-mask").method == "packing"
    assert parse("--micro-batch-size 2 --pipeline-model-parallel-size 2").num_micro_batches == 4


@pytest.mark.parametrize("extra, world, cuda, needle", [
    ("--global-batch-size 6", 2, False, "--global-batch-size 6 is not divisible by --micro-batch-size 2 x data-parallel size 2"),
    ("--seq-length 512 --max-position-embeddings 256", 1, False, "--seq-length 512 exceeds --max-position-embeddings 256"),
    ("--fp16 --bf16", 1, True, "--fp16 and --bf16"),
    ("--hysteresis 3", 1, False, "--hysteresis sets the dynamic loss scale"),
    ("--pipeline-model-parallel-size 2", 3, False, "world size 3 is not divisible"),
    ("--pipeline-model-parallel-size 3", 3, False, "--num-layers 4 cannot be split evenly"),
    ("--pipeline-model-parallel-size 8", 8, False, "--num-layers 4 cannot be split evenly"),
    ("--use-dynapipe --dynapipe-cost-model /nonexistent/profile.json", 1, False, "no such profile file"),
    ("--use-dynapipe --dynapipe-device nope", 1, False, "--dynapipe-device nope: config file 'nope' does not exist"),
    ("--use-dynapipe --dynapipe-cluster nope", 1, False, "--dynapipe-cluster nope: config file"),
    ("--dynapipe-batching dynapipe", 1, False, "add --use-dynapipe"),
    ("--num-attention-heads 5", 1, False, "--hidden-size 64 is not divisible by --num-attention-heads 5"),
    ("--use-dynapipe --dynapipe-batching token-budget", 1, False, "needs --dynapipe-max-tokens"),
    ("--use-dynapipe --dynapipe-batching token-budget --dynapipe-max-tokens 100", 1, False, "below --seq-length"),
    ("--tensor-model-parallel-size 2 --sequence-parallel --seq-length 255 --max-position-embeddings 256", 2, False,
     "--seq-length 255 is not a multiple of 2; use 256"),
    ("--tensor-model-parallel-size 3", 3, False, "--tensor-model-parallel-size 3 does not divide --num-attention-heads 4"),
    ("--distributed-backend nccl", 1, False, "nccl needs GPUs"),
    ("--distributed-backend gloo --transformer-impl local", 1, True, "gloo with GPUs: the stages exchange CUDA"),
    ("--reset-position-ids", 1, False, "packed rows only"),
    ("--save-interval 5", 1, False, "--save-interval needs --save"),
    ("--load /nonexistent/ckpt", 1, False, "no such checkpoint directory"),
    ("--hidden-dropout 1.5", 1, False, "--hidden-dropout 1.5"),
    ("--train-iters 0", 1, False, "--train-iters 0: must be positive"),
    ("--data-path x.jsonl", 1, False, "--mock-data and --data-path"),
    ("--dynapipe-tokens-per-global-batch 1000", 1, False, "needs --use-dynapipe"),
    ("--use-distributed-optimizer", 2, False, "--use-distributed-optimizer needs GPUs"),
])
def test_invalid_combinations_name_the_flag(extra, world, cuda, needle):
    with pytest.raises(DynaPipeError) as e:
        parse(extra, world=world, cuda=cuda)
    assert needle in str(e.value)


def test_missing_required_and_missing_data():
    with pytest.raises(DynaPipeError, match="--lr is required"):
        parse_training_args(BASE.replace("--lr 1e-3", "").split(), 1, cuda=False)
    with pytest.raises(DynaPipeError, match="no data"):
        parse_training_args(BASE.replace("--mock-data", "").split(), 1, cuda=False)
    with pytest.raises(DynaPipeError, match="no such file"):
        parse_training_args(BASE.replace("--mock-data", "--data-path /nonexistent/data.jsonl").split(), 1, cuda=False)


def test_dynapipe_path_does_not_need_divisible_micro_batches():
    cfg = parse("--use-dynapipe --global-batch-size 7 --pipeline-model-parallel-size 2", world=2)
    assert cfg.method == "dynapipe" and cfg.global_batch_size == 7
    with pytest.raises(DynaPipeError, match="smaller than the data-parallel size"):
        parse("--use-dynapipe --global-batch-size 1", world=2)


def test_parser_has_megatron_and_dynapipe_flags():
    text = build_parser().format_help()
    for flag in ("--num-layers", "--hidden-size", "--num-attention-heads", "--ffn-hidden-size", "--seq-length",
                 "--max-position-embeddings", "--global-batch-size", "--micro-batch-size",
                 "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--lr", "--train-iters", "--seed",
                 "--bf16", "--fp16", "--data-path", "--mock-data", "--save", "--load", "--log-interval",
                 "--tensorboard-dir", "--use-dynapipe", "--dynapipe-batching", "--dynapipe-schedule",
                 "--dynapipe-memory-limit-mb", "--dynapipe-cost-model", "--dynapipe-planner-workers",
                 "--dynapipe-prefetch", "--dynapipe-kv-backend"):
        assert flag in text, flag


def test_sequence_parallel_at_tp1_is_switched_off_with_megatron_lms_warning():
    # Megatron-LM's launch scripts pass --sequence-parallel whatever their TP size; it warns.
    with pytest.warns(UserWarning, match="Disabling sequence parallelism because tensor model parallelism is "
                                         "disabled"):
        cfg = parse("--sequence-parallel")
    assert cfg.parallel.sequence_parallel is False and cfg.parallel.tensor_model_parallel_size == 1


def test_tensor_and_sequence_parallel_run_on_cpu():
    """TP > 1 (with or without --sequence-parallel) is accepted on CPU, on both paths."""
    cfg = parse("--tensor-model-parallel-size 2 --sequence-parallel --use-dynapipe", world=4)
    assert cfg.parallel.tensor_model_parallel_size == 2 and cfg.parallel.sequence_parallel
    assert cfg.parallel.data_parallel_size == 2 and cfg.method == "dynapipe"
    cfg = parse("--tensor-model-parallel-size 2", world=2)
    assert not cfg.parallel.sequence_parallel and cfg.method == "padding"


def test_manual_gc_flags_take_megatrons_defaults_and_points():
    import gc

    from megatron_integration.manual_gc import ManualGC
    from megatron_integration.t5_arguments import parse_t5_args
    from t5_job import TINY

    assert parse().manual_gc == ManualGC(enabled=False, interval=0, eval=True)
    assert parse("--manual-gc --manual-gc-interval 5 --no-manual-gc-eval").manual_gc == ManualGC(True, 5, False)
    assert parse_t5_args((TINY + " --manual-gc").split(), 2, cuda=False).base.manual_gc.enabled
    with pytest.raises(DynaPipeError, match="--manual-gc-interval -1: must be >= 0"):
        parse("--manual-gc --manual-gc-interval -1")
    # Settings that would do nothing without --manual-gc are refused, not ignored.
    for extra in ("--manual-gc-interval 5", "--no-manual-gc-eval"):
        with pytest.raises(DynaPipeError, match=f"{extra.split()[0]}.* has no effect without --manual-gc"):
            parse(extra)
    # Where collections happen: the generation of every collection, as the collector reports it.
    seen: list[int] = []

    def record(phase, info):
        if phase == "start":
            seen.append(info["generation"])

    gc.callbacks.append(record)
    try:
        was = ManualGC(True, 2).start()
        assert not gc.isenabled() and seen == [2]  # collector off, one full collection first
        for iteration in (1, 2, 3, 4):
            ManualGC(True, 2).after_iteration(iteration)
        assert seen == [2, 2, 2]  # after iterations 2 and 4
        with ManualGC(True, 2).evaluation():
            assert seen[-1] == 2
        assert seen == [2, 2, 2, 2, 0]  # all generations before an evaluation, the youngest after
        with ManualGC(True, 2, eval=False).evaluation():
            pass
        ManualGC(True, 0).after_iteration(10)  # interval 0: none between iterations
        assert len(seen) == 5
        ManualGC(True, 2).stop(was)
        assert gc.isenabled() == was
        # Without --manual-gc nothing changes (the collector held off here, so that no
        # threshold collection lands in the count).
        gc.disable()
        collected = len(seen)
        off = ManualGC()
        assert off.start() is False and not gc.isenabled()
        off.after_iteration(2)
        with off.evaluation():
            pass
        off.stop(True)
        assert len(seen) == collected and not gc.isenabled()
    finally:
        gc.callbacks.remove(record)
        gc.enable()


def test_megatron_lms_generated_aliases_are_the_same_flags():
    # Megatron-LM's dataclass-built parser also spells these; each must set the same value.
    from megatron_integration.arguments import build_parser

    p = build_parser()
    base = BASE.split()
    pairs = [("--no-manual-gc-eval", "--disable-manual-gc-eval", "manual_gc_eval"),
             ("--override-opt_param-scheduler", "--override-opt-param-scheduler", "override_opt_param_scheduler"),
             ("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler",
              "use_checkpoint_opt_param_scheduler"),
             ("--no-log-loss-scale-to-tensorboard", "--disable-log-loss-scale-to-tensorboard",
              "log_loss_scale_to_tensorboard")]
    for ours, alias, dest in pairs:
        default = getattr(p.parse_args(base), dest)
        assert getattr(p.parse_args(base + [ours]), dest) == getattr(p.parse_args(base + [alias]), dest) != default
    assert p.parse_args(base + ["--persistent-save-interval", "7"]).save_interval == 7


def test_encoder_spellings_of_layers_and_length_are_megatron_lms_aliases_for_gpt():
    # Megatron-LM's validate_args fills --num-layers from --encoder-num-layers and --seq-length
    # from --encoder-seq-length, and refuses both spellings of one setting.
    typed = BASE.replace("--num-layers 4", "--encoder-num-layers 2").replace("--seq-length 256",
                                                                           "--encoder-seq-length 128")
    cfg = parse(base=typed)
    assert (cfg.model.num_layers, cfg.model.seq_length, cfg.model.max_position_embeddings) == (2, 128, 128)
    with pytest.raises(DynaPipeError, match="--num-layers 4 and --encoder-num-layers 4 were both given"):
        parse("--encoder-num-layers 4")
    with pytest.raises(DynaPipeError, match="--seq-length 256 and --encoder-seq-length 128 were both given"):
        parse("--encoder-seq-length 128")
    # A later check names the flag as the user spelled it.
    with pytest.raises(DynaPipeError, match=r"but --encoder-seq-length 129 is not a multiple of 2; use 130"):
        parse("--tensor-model-parallel-size 2 --sequence-parallel",
              base=typed.replace("--encoder-seq-length 128", "--encoder-seq-length 129"))


@pytest.mark.parametrize("extra, needle", [
    ("--dynapipe-schedule 1f1b", "--dynapipe-schedule 1f1b is read by the DynaPipe planner"),
    ("--dynapipe-prefetch 2", "--dynapipe-prefetch 2 is read by the DynaPipe planner"),
    ("--dynapipe-planner-workers 2", "--dynapipe-planner-workers 2 is read by the DynaPipe planner"),
    ("--dynapipe-kv-backend redis", "--dynapipe-kv-backend redis is read by the DynaPipe planner"),
    ("--dynapipe-timeout-s 60", "--dynapipe-timeout-s 60.0 is read by the DynaPipe executor"),
    ("--dynapipe-trace-dir /tmp/t", "--dynapipe-trace-dir /tmp/t is read by the DynaPipe executor"),
    ("--dynapipe-device cpu", "--dynapipe-device cpu is read by the DynaPipe planner (and "),
    ("--dynapipe-cluster h100-8x", "--dynapipe-cluster h100-8x is read by the DynaPipe planner"),
    ("--dynapipe-memory-limit-mb 1", "--dynapipe-memory-limit-mb 1.0 is read by the DynaPipe planner"),
    ("--tensorboard-log-interval 5", "--tensorboard-log-interval 5 applies to TensorBoard's scalars; add --tensorboard-dir"),
    ("--tensorboard-queue-size 10", "--tensorboard-queue-size 10 applies to TensorBoard"),
    ("--no-log-loss-scale-to-tensorboard", "--no-log-loss-scale-to-tensorboard applies to TensorBoard"),
])
def test_flags_that_would_change_nothing_are_refused(extra, needle):
    # Without --use-dynapipe, GPT's baselines run megatron-core's schedules: no planner, no executor.
    with pytest.raises(DynaPipeError, match=needle.replace("(", r"\(")):
        parse(extra, world=1)
    assert parse(extra + " --use-dynapipe --tensorboard-dir /tmp/tb", world=1)


def test_the_cost_model_flags_price_an_auto_placement_without_dynapipe():
    # --dynapipe-placement auto chooses every method's split with the planner's cost model.
    with pytest.raises(DynaPipeError, match="--dynapipe-cost-model p.json is read by the DynaPipe planner"):
        parse("--dynapipe-cost-model p.json", world=1)
    auto = "--pipeline-model-parallel-size 2 --dynapipe-placement auto --dynapipe-memory-limit-mb 500"
    assert parse(auto, world=2).dynapipe.memory_limit_mb == 500
    from megatron_integration.args_dynapipe import without_unused_dynapipe_flags

    argv = ["--dynapipe-device", "cpu", "--lr", "1e-3"]
    assert without_unused_dynapipe_flags(argv, False) == ["--lr", "1e-3"]
    assert without_unused_dynapipe_flags(argv + ["--dynapipe-placement=auto"], False) == argv + [
        "--dynapipe-placement=auto"]


def test_t5_baselines_take_the_executor_flags_but_not_the_planners():
    from megatron_integration.t5_arguments import parse_t5_args
    from t5_job import TINY

    cfg = parse_t5_args((TINY + " --dynapipe-timeout-s 60").split(), 2, cuda=False)
    assert cfg.base.dynapipe.timeout_s == 60.0 and not cfg.base.dynapipe.enabled
    with pytest.raises(DynaPipeError, match="--dynapipe-prefetch 2 is read by the DynaPipe planner"):
        parse_t5_args((TINY + " --dynapipe-prefetch 2").split(), 2, cuda=False)
    with pytest.raises(DynaPipeError, match="--dynapipe-device cpu is read by the DynaPipe planner"):
        parse_t5_args((TINY + " --dynapipe-device cpu").split(), 2, cuda=False)
    # An auto placement is priced with them, for the baselines too.
    assert parse_t5_args((TINY + " --dynapipe-device cpu --dynapipe-placement auto").split(), 2,
                         cuda=False).base.dynapipe.device == "cpu"


def test_the_bench_gives_the_dynapipe_flags_to_the_dynapipe_runs_only():
    from megatron_integration.bench import Entry
    from megatron_integration.bench_t5_entries import T5Entry

    argv = ["--dynapipe-prefetch", "2", "--dynapipe-timeout-s=60", "--lr", "1e-3", "--dynapipe-mock-samples", "64"]
    assert Entry("dynapipe").argv(argv)[:7] == argv
    assert Entry("padding", 2).argv(argv)[:4] == ["--lr", "1e-3", "--dynapipe-mock-samples", "64"]
    t5 = T5Entry("packing", micro_batch_size=2).argv(argv)
    assert "--dynapipe-prefetch" not in t5 and "--dynapipe-timeout-s=60" in t5


def test_nan_check_is_off_under_fp16_dynamic_loss_scaling_as_in_megatron_lm():
    # There a non-finite gradient is the scaler's signal (the step is skipped, the scale
    # lowered); with a static scale, or in fp32/bf16, the loss and the gradients are checked.
    assert parse().check_for_nan_in_loss_and_grad
    assert parse("--bf16").check_for_nan_in_loss_and_grad
    assert not parse("--fp16").check_for_nan_in_loss_and_grad
    assert parse("--fp16 --loss-scale 1024").check_for_nan_in_loss_and_grad
    assert not parse("--fp16 --loss-scale 1024 --no-check-for-nan-in-loss-and-grad").check_for_nan_in_loss_and_grad


def test_gradient_buffers_take_megatron_lms_precision():
    from megatron_integration.ddp import ddp_config

    def fp32_grads(extra):
        cfg = parse(extra)
        assert ddp_config(cfg, 1000).grad_reduce_in_fp32 == cfg.optimizer.grad_reduce_in_fp32
        return cfg.optimizer.grad_reduce_in_fp32

    assert fp32_grads("") and fp32_grads("--bf16") and not fp32_grads("--bf16 --grad-reduce-in-bf16")
    assert not fp32_grads("--fp16") and fp32_grads("--fp16 --accumulate-allreduce-grads-in-fp32")


def test_megatron_lms_defaults_for_the_global_batch_the_head_size_and_a_first_launch(tmp_path):
    base = BASE.replace("--global-batch-size 8 ", "")
    # One micro-batch a data-parallel replica: 2 x (4 ranks / PP2).
    cfg = parse("--pipeline-model-parallel-size 2", world=4, base=base)
    assert cfg.global_batch_size == 4 and cfg.num_micro_batches == 1
    # Where the default cannot be computed, the error names why, as Megatron-LM's asserts do.
    with pytest.raises(DynaPipeError, match="world size 3 is not divisible by --tensor-model-parallel-size 1 x "
                                            "--pipeline-model-parallel-size 2"):
        parse("--pipeline-model-parallel-size 2", world=3, base=base)
    with pytest.raises(DynaPipeError, match=r"--global-batch-size is required: Megatron-LM's default, "
                                            r"--micro-batch-size x the data-parallel size, needs --micro-batch-size"):
        parse("", world=2, base=base.replace("--micro-batch-size 2 ", ""))
    # Under a token budget the error says what the sample count is still for.
    with pytest.raises(DynaPipeError, match=r"required \(with --dynapipe-tokens-per-global-batch 4096 it sets only "
                                            r"the evaluation batches' sample count\): "):
        parse("--use-dynapipe --dynapipe-tokens-per-global-batch 4096", world=2,
              base=base.replace("--micro-batch-size 2 ", ""))
    # A given --kv-channels sets the head size, so hidden need not divide by the heads.
    assert parse("--hidden-size 64 --num-attention-heads 3 --kv-channels 16").model.kv_channels == 16
    with pytest.raises(DynaPipeError, match="--num-attention-heads 3; change one, or give the head size"):
        parse("--hidden-size 64 --num-attention-heads 3")
    # Megatron-LM's scripts pass --save and --load the same path: the first launch starts fresh.
    ckpt = str(tmp_path / "ckpt")
    assert parse(f"--save {ckpt} --load {ckpt}", world=1).load == ckpt
    with pytest.raises(DynaPipeError, match="no such checkpoint directory"):
        parse(f"--save {ckpt} --load {tmp_path / 'typo'}", world=1)


def test_a_load_or_save_that_would_lose_a_checkpoint_is_refused(tmp_path):
    """Megatron-LM starts from random where --load has no tracker, and --save overwrites: a
    --load of one saved iteration, of iterations whose tracker is gone, or a --save over another
    run's checkpoints would lose one, so each is refused before any work."""
    run = tmp_path / "run"
    (run / "iter_0000002").mkdir(parents=True)
    (run / "iter_0000002" / "metadata.json").write_text("{}")
    with pytest.raises(DynaPipeError, match=rf"--load {run}/iter_0000002: is one saved iteration, not the "
                                            rf"directory that holds latest_checkpointed_iteration.txt; give --load {run} "):
        parse(f"--save {run} --load {run}/iter_0000002", world=1)
    with pytest.raises(DynaPipeError, match=r"holds 1 saved iteration\(s\) \(iter_0000002 the last\) but no"):
        parse(f"--save {run} --load {run}", world=1)
    (run / "latest_checkpointed_iteration.txt").write_text("2")
    assert parse(f"--save {run} --load {run}", world=1).load == str(run)  # resumes it
    other = tmp_path / "other"
    other.mkdir()
    for extra in (f"--save {run}", f"--save {run} --load {other}"):
        with pytest.raises(DynaPipeError, match=rf"--save {run}: holds another run's checkpoints .* give --load "
                                                rf"{run} to resume that run, or another --save"):
            parse(extra, world=1)
    # An empty --load is a fresh start, as in Megatron-LM (a folder made ahead of the first launch),
    # whatever its name.
    assert parse(f"--save {other} --load {other}", world=1).load == str(other)
    (other / "release").mkdir()
    assert parse(f"--save {other}/release --load {other}/release", world=1).load == f"{other}/release"
    assert (run / "latest_checkpointed_iteration.txt").read_text() == "2"
    # One directory through a symbolic link (/scratch and the /lustre/scratch it names) resumes.
    link = tmp_path / "link"
    link.symlink_to(run)
    assert parse(f"--save {run} --load {link}", world=1).load == str(link)
    # A fine-tuning job relaunched after preemption resumes its own --save, not --finetune again.
    with pytest.raises(DynaPipeError, match=rf"give --load {run} without --finetune to resume that run"):
        parse(f"--save {run} --load {other} --finetune", world=1)


def test_t5_errors_from_the_shared_checks_name_the_flags_the_user_typed():
    # The shared checks see the encoder's length as --seq-length; a T5 user typed
    # --encoder-seq-length, and the error must say so.
    from megatron_integration.t5_arguments import parse_t5_args
    from t5_job import TINY

    assert "--encoder-seq-length" in TINY and " --seq-length" not in TINY
    with pytest.raises(DynaPipeError) as e:
        parse_t5_args((TINY.replace("--encoder-seq-length 128", "--encoder-seq-length 127") +
                       " --tensor-model-parallel-size 2 --sequence-parallel").split(), 4, cuda=False)
    assert "--encoder-seq-length 127 is not a multiple of 2" in str(e.value)
    assert "--seq-length" not in str(e.value).replace("--encoder-seq-length", "")
    # Found before the model is built, under the name typed (it was --seq-length, after the model).
    for typed in ("--encoder-seq-length", "--seq-length"):
        with pytest.raises(DynaPipeError, match=f"^{typed} 1: must be at least 2 tokens"):
            parse_t5_args(TINY.replace("--encoder-seq-length 128", f"{typed} 1").split(), 2, cuda=False)
    # T5's own checks name the spelling typed too: Megatron-LM's --num-layers / --seq-length.
    megatron_spelling = TINY.replace("--encoder-seq-length", "--seq-length").replace("--encoder-num-layers",
                                                                                    "--num-layers")
    for extra, world, message in (
            ("--max-position-embeddings 100", 2, "--seq-length 128 exceeds --max-position-embeddings 100"),
            ("--pipeline-model-parallel-size 3", 3, "--num-layers 2 + --decoder-num-layers 2 = 4 layers cannot be split"),
            ("--num-layers 0", 2, "--num-layers 0: must be positive")):
        argv = (megatron_spelling.replace("--num-layers 2", "") + " " + extra if "--num-layers" in extra
                else megatron_spelling + " " + extra).split()
        with pytest.raises(DynaPipeError, match=f"^{re.escape(message)}"):
            parse_t5_args(argv, world, cuda=False)


def test_flags_of_another_batching_or_of_mock_data_are_refused_not_ignored(tmp_path):
    # --dynapipe-max-tokens is token-budget's budget: another batching would run as if it were not given.
    for extra, batching in (("", "padding"), ("--use-dynapipe", "dynapipe"),
                            ("--use-dynapipe --dynapipe-batching packing --reset-position-ids "
                             "--reset-attention-mask", "packing")):
        with pytest.raises(DynaPipeError, match=f"--dynapipe-max-tokens 512 is the budget of .* {batching} batching "
                                                f"does not read it"):
            parse(f"{extra} --dynapipe-max-tokens 512")
    assert parse("--use-dynapipe --dynapipe-batching token-budget --dynapipe-max-tokens 512").dynapipe.max_tokens == 512
    # The mock dataset's flags with real data.
    data = tmp_path / "pairs.jsonl"
    data.write_text('{"input": "a b", "target": "c"}\n')
    real = BASE.replace("--mock-data", f"--data-path {data} --split 100,0,0")
    for extra, flag in (("--dynapipe-mock-samples 64", "--dynapipe-mock-samples 64"),
                        ("--dynapipe-mixture configs/data/flan-mixture.yaml", "--dynapipe-mixture configs/data")):
        with pytest.raises(DynaPipeError, match=f"{flag}.* shapes the --mock-data dataset"):
            parse(extra, base=real)
        parse(extra)  # with --mock-data
    # T5 plans its micro-batches with DynaPipe's own batching, whatever the flag.
    from megatron_integration.t5_arguments import parse_t5_args
    from t5_job import TINY

    with pytest.raises(DynaPipeError, match="--dynapipe-max-tokens 512 is the budget"):
        parse_t5_args((TINY + " --use-dynapipe --dynapipe-max-tokens 512").split(), 2, cuda=False)


def test_auto_placement_prices_the_baselines_split_at_their_recompute_level():
    # Megatron's baselines recompute every layer at the flags' level; DynaPipe's planner chooses.
    from megatron_integration.placement_auto import priced_recompute

    auto = "--pipeline-model-parallel-size 2 --dynapipe-placement auto"
    assert priced_recompute(parse(auto)) == "none"
    assert priced_recompute(parse(f"{auto} --recompute-granularity selective")) == "selective"
    assert priced_recompute(parse(f"{auto} --recompute-granularity full --recompute-method uniform "
                                  f"--recompute-num-layers 1")) == "full"
    assert priced_recompute(parse(f"{auto} --use-dynapipe")) is None
    assert priced_recompute(parse(f"{auto} --use-dynapipe --dynapipe-recompute selective")) == "selective"


def test_redis_settings_need_the_redis_plan_store():
    for flag in ("--dynapipe-redis-host 10.0.0.1", "--dynapipe-redis-port 7000", "--dynapipe-store-retry-s 5.5"):
        with pytest.raises(DynaPipeError, match=f"{flag} sets the Redis plan store; plans go through "
                                                f"--dynapipe-kv-backend store: add --dynapipe-kv-backend redis"):
            parse(f"--use-dynapipe {flag}")
        assert parse(f"--use-dynapipe --dynapipe-kv-backend redis {flag}").dynapipe.kv_backend == "redis"


@pytest.mark.parametrize("extra, message", [
    # Looked up as a host name, each failed only after --dynapipe-store-retry-s of retries.
    ("--dynapipe-redis-host redis://127.0.0.1:6380", "--dynapipe-redis-host 'redis://127.0.0.1:6380': give the "
                                                     "server's host name or address alone; its port goes in"),
    ("--dynapipe-redis-host 10.0.0.5:6380", "--dynapipe-redis-host '10.0.0.5:6380': give the server's host name"),
    # A GPU's activation figures on CPU ranks: the plans promised less memory than they used.
    ("--dynapipe-device h100-80gb", "--dynapipe-device h100-80gb: its dropout_mask_bytes 1 is CUDA's (a bool mask)"),
])
def test_planner_settings_that_cannot_work_here_are_refused(extra, message):
    with pytest.raises(DynaPipeError) as e:
        parse(extra + " --use-dynapipe --dynapipe-kv-backend redis", world=1)
    assert message in str(e.value)


def test_an_ipv6_redis_host_and_a_gpu_device_on_gpus_are_taken():
    assert parse("--use-dynapipe --dynapipe-kv-backend redis --dynapipe-redis-host ::1",
                 world=1).dynapipe.redis_host == "::1"
    assert parse("--use-dynapipe --dynapipe-device h100-80gb --transformer-impl local", world=1,
                 cuda=True).dynapipe.device == "h100-80gb"


def test_tensor_parallelism_on_gpus_before_blackwell_needs_one_device_connection(monkeypatch):
    # Megatron-LM asserts CUDA_DEVICE_MAX_CONNECTIONS=1 under TP on GPUs before Blackwell (its
    # TP collectives rely on kernels running in launch order); Blackwell needs nothing.
    from megatron_integration.tensor_parallel import check_device_max_connections

    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    with pytest.raises(DynaPipeError, match="--tensor-model-parallel-size 2 on GPUs before Blackwell needs the "
                                            "environment variable CUDA_DEVICE_MAX_CONNECTIONS=1"):
        check_device_max_connections(2, arch_major=9)
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")
    with pytest.raises(DynaPipeError, match="it is '8'"):
        check_device_max_connections(2, arch_major=8)
    check_device_max_connections(2, arch_major=10)
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    check_device_max_connections(2, arch_major=9)


def test_a_token_budget_below_the_longest_sample_is_refused_at_start_up():
    # Every mock sample of the FLAN-like mixture up to 256 tokens: a budget of 100 would put one
    # sample alone in each batch, over the budget.
    from megatron_integration.data import data_summary_lines

    cfg = parse("--use-dynapipe --dynapipe-tokens-per-global-batch 100", world=1)
    with pytest.raises(DynaPipeError, match=r"--dynapipe-tokens-per-global-batch 100: below the longest training "
                                            r"sample \(256 tokens\).*give at least 256"):
        data_summary_lines(cfg)
    assert len(data_summary_lines(parse("--use-dynapipe --dynapipe-tokens-per-global-batch 4096", world=1))) == 1


def test_values_a_port_from_megatron_lm_must_drop_are_refused_together(capsys, monkeypatch):
    # Porting Megatron-LM's Llama-3 example to CPU used to take one launch per refused value.
    from dynapipe.errors import RefusedArguments

    extra = ("--apply-layernorm-1p --cross-entropy-loss-fusion --attention-backend fused "
             "--use-distributed-optimizer")
    with pytest.raises(RefusedArguments) as e:
        parse(extra)
    flags = ["--apply-layernorm-1p", "--cross-entropy-loss-fusion", "--attention-backend fused",
             "--use-distributed-optimizer"]
    assert [next(f for f in flags if f in str(x)) for x in e.value.errors] == flags
    # The training script prints one error line each, and nothing else.
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "pretrain_gpt.py")
    spec = importlib.util.spec_from_file_location("pretrain_gpt_script", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    import megatron_integration.training  # noqa: F401  (megatron's import-time notices go out before the capture)

    capsys.readouterr()
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert script.main((BASE + " " + extra).split()) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 4 and all(line.startswith("error: ") for line in err), err
    assert all(f in line for f, line in zip(flags, err)), err
    # One alone is raised as itself.
    with pytest.raises(DynaPipeError) as one:
        parse("--apply-layernorm-1p")
    assert not isinstance(one.value, RefusedArguments)
