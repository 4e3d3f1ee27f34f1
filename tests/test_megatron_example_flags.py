"""Megatron-LM's own example command lines (its Llama-3 8B and GPT-3 175B training scripts),
scaled to a tiny model: every flag they use is honoured, accepted as what this build already
does, or refused in one line naming the flag and why; none is an unknown argument.

The flags are written out here (the scripts are not copied); the shapes are tiny and the
process counts one, but each flag keeps the meaning and value kind the scripts give it.
"""
import os
import types

import numpy as np
import pytest

from dynapipe.errors import DynaPipeError
from megatron_integration.arguments import UNSUPPORTED_MEGATRON_FLAGS, build_parser, parse_training_args

TINY = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 128 --max-position-embeddings 128 "
        "--micro-batch-size 1 --global-batch-size 8")
# The flags of Megatron-LM's Llama-3 8B script that this build takes (values scaled down).
LLAMA3 = (TINY + " --use-mcore-models --ffn-hidden-size 224 --group-query-attention --num-query-groups 2 "
          "--kv-channels 16 --position-embedding-type rope --rotary-base 1000000 --rotary-percent 1.0 "
          "--attention-dropout 0.0 --hidden-dropout 0.0 --swiglu --normalization RMSNorm --init-method-std 0.0134 "
          "--untie-embeddings-and-output-weights --disable-bias-linear --train-samples 64 --lr-decay-samples 60 "
          "--lr-warmup-samples 12 --lr 0.00015 --min-lr 0.00001 --decoupled-lr 5.0e-4 --decoupled-min-lr 4.5e-5 "
          "--lr-decay-style cosine --clip-grad 1.0 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --bf16 "
          "--grad-reduce-in-bf16 --calculate-per-token-loss --manual-gc --empty-unused-memory-level 1 "
          "--exit-duration-in-mins 235 --tensor-model-parallel-size 1 --context-parallel-size 1 "
          "--expert-model-parallel-size 1 --mock-data "
          "--tokenizer-type NullTokenizer --vocab-size 1000 --data-cache-path /tmp/cache --split 99,1,0 "
          "--no-create-attention-mask-in-dataloader --no-mmap-bin-files --num-workers 1 --log-interval 1 "
          "--eval-iters 2 --eval-interval 4 --ckpt-format torch_dist --log-throughput "
          "--distributed-timeout-minutes 60 --overlap-grad-reduce")
# The ones it refuses, each with the words of its reason (on this CPU machine).
LLAMA3_REFUSED = {
    "--attention-backend fused": "megatron-core chooses the backend",
    "--apply-layernorm-1p": "zero-centred norm weights",
    "--cross-entropy-loss-fusion": "GPU kernel",
    "--fp8-format hybrid": "fp8 training",
    "--fp8-amax-history-len 1024": "fp8 training",
    "--fp8-amax-compute-algo max": "fp8 training",
    "--fp8-param-gather": "fp8 training",
    "--tiktoken-pattern v2": "TikTokenizer",
    "--overlap-param-gather": "within the optimizer step",
    "--profile": "--dynapipe-trace-dir",
    "--profile-step-start 4": "profiling hooks",
    "--profile-step-end 6": "profiling hooks",
    "--use-distributed-optimizer": "needs GPUs",
    "--context-parallel-size 2": "no context parallelism",
    "--expert-model-parallel-size 2": "mixture-of-experts models are not built",
    "--rotary-percent 0.5": "cover the whole head",
}
# Megatron-LM's GPT-3 175B script's flags (values scaled down): taken ...
GPT3 = (TINY + " --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --train-samples 64 "
        "--lr-decay-samples 48 --lr-warmup-samples 8 --lr 6.0e-5 --min-lr 6.0e-6 --lr-decay-style cosine "
        "--log-interval 1 --eval-iters 1 --eval-interval 4 --mock-data --split 949,50,1 --clip-grad 1.0 "
        "--weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --init-method-std 0.006 --fp16 --overlap-grad-reduce")
# ... and refused.
GPT3_REFUSED = {"--rampup-batch-size 16 16 5859375": "the global batch is fixed",
                "--overlap-param-gather": "within the optimizer step"}


def parse(line: str, world: int = 1, cuda: bool = False):
    return parse_training_args(line.split(), world, cuda=cuda)


def refusal(line: str, capsys) -> str:
    """The one-line error a command line gets (a DynaPipeError's text, or the parser's)."""
    try:
        parse(line)
    except DynaPipeError as e:
        return str(e)
    except SystemExit:
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0, err
        return err
    raise AssertionError(f"accepted: {line}")


def test_megatrons_llama3_flags_parse_and_reach_the_configs():
    cfg = parse(LLAMA3)
    o = cfg.optimizer
    assert (o.decoupled_lr, o.decoupled_min_lr, o.grad_reduce_in_bf16) == (5.0e-4, 4.5e-5, True)
    assert cfg.train_iters == 8 and (o.lr_warmup_iters, o.lr_decay_iters) == (12 / 8, 60 / 8)
    assert (cfg.exit_duration_in_mins, cfg.empty_unused_memory_level) == (235, 1)
    assert cfg.data.mmap_bin_files is False and cfg.model.norm_epsilon == 1e-5 and cfg.log_throughput
    assert cfg.ddp.overlap_grad_reduce and cfg.ddp.bucket_size is None
    pytest.importorskip("megatron.core")
    from megatron_integration.model import transformer_config
    from megatron_integration.optimizer import optimizer_config

    oc = optimizer_config(cfg)
    assert (oc.decoupled_lr, oc.decoupled_min_lr) == (5.0e-4, 4.5e-5)
    tc = transformer_config(cfg.model, cfg.parallel, cuda=False)
    assert tc.layernorm_epsilon == 1e-5 and not tc.cross_entropy_loss_fusion


def test_megatrons_gpt3_flags_parse():
    cfg = parse(GPT3)
    assert cfg.train_iters == 8 and cfg.optimizer.lr_warmup_iters == 1 and cfg.optimizer.lr_decay_iters == 6


@pytest.mark.parametrize("line, flags", [(LLAMA3, LLAMA3_REFUSED), (GPT3, GPT3_REFUSED)])
def test_the_rest_is_refused_in_one_line_naming_the_flag(line, flags, capsys):
    for extra, why in flags.items():
        message = refusal(f"{line} {extra}", capsys)
        assert extra.split()[0] in message and why in message, (extra, message)


# Megatron-LM's asynchronous-checkpoint flags, common in its cluster scripts: each refused with
# what this build does instead (its rerun state machine's flags are taken, below).
RESILIENCE_REFUSED = {
    "--use-persistent-ckpt-worker": "saved synchronously",
    "--ckpt-assume-constant-structure": "built at every save",
}


def test_megatrons_resilience_flags_are_taken_or_refused_with_what_is_done_instead(capsys):
    for extra, why in RESILIENCE_REFUSED.items():
        message = refusal(f"{GPT3} {extra}", capsys)
        assert extra.split()[0] in message and why in message, (extra, message)
    # The rerun state machine's flags mean what they mean in Megatron-LM, with its defaults.
    from megatron_integration.rerun_settings import RerunSettings

    assert parse(GPT3).rerun == RerunSettings("validate_results", 0, "transient_error")
    assert parse(f"{GPT3} --rerun-mode validate_results") == parse(GPT3)
    cfg = parse(f"{TINY} --train-iters 4 --lr 1e-3 --mock-data --rerun-mode disabled")
    assert cfg.check_for_nan_in_loss_and_grad and cfg.rerun.rerun_mode == "disabled"
    assert parse(f"{GPT3} --rerun-mode report_stats").rerun.rerun_mode == "report_stats"
    # --iterations-to-skip numbered from 1, as logged (Megatron-LM since core_v0.17), in order, once each.
    assert parse(f"{GPT3} --iterations-to-skip 5 2 5").iterations_to_skip == (2, 5)
    assert parse(GPT3).iterations_to_skip == ()
    # Megatron-LM decides to exit after trained iterations only: skipped multiples of
    # --exit-interval (iterations 2 and 4) run on to the next one, 6.
    skipping = parse(f"{TINY} --train-iters 8 --lr 1e-3 --mock-data --exit-interval 2 --iterations-to-skip 2 4")
    assert skipping.last_iteration(0) == 6 and skipping.last_iteration(6) == 8
    assert parse(f"{TINY} --train-iters 8 --lr 1e-3 --mock-data --exit-interval 2 --iterations-to-skip 1 3"
                 ).last_iteration(0) == 2
    assert "--iterations-to-skip 0: iterations are numbered from 1" in refusal(f"{GPT3} --iterations-to-skip 3 0",
                                                                               capsys)
    spikes = parse(f"{GPT3} --check-for-spiky-loss --check-for-large-grads").rerun
    assert spikes.check_for_spiky_loss and spikes.check_for_large_grads
    assert not parse(GPT3).rerun.check_for_spiky_loss and not parse(GPT3).rerun.check_for_large_grads
    injected = parse(f"{GPT3} --loss-scale 1024 --error-injection-rate 1000 "
                     f"--error-injection-type persistent_error").rerun
    assert (injected.error_injection_rate, injected.error_injection_type) == (1000, "persistent_error")
    for bad, said in (("--error-injection-rate -1", "--error-injection-rate -1: give a whole number, at least 0"),
                      ("--rerun-mode disabled --error-injection-rate 10",
                       "--error-injection-rate 10 with --rerun-mode disabled: injected errors are diagnosed by "
                       "--rerun-mode validate_results only")):
        assert said in refusal(f"{GPT3} {bad}", capsys), bad
    # What would be accepted and do nothing is refused: an injection with the NaN check off (GPT3
    # is --fp16 without a --loss-scale), spike checks under report_stats.
    assert "--error-injection-rate 5: errors are injected into the NaN/Inf check" in refusal(
        f"{GPT3} --error-injection-rate 5", capsys)
    assert parse(f"{GPT3} --loss-scale 1024 --error-injection-rate 5").rerun.error_injection_rate == 5
    assert "--check-for-large-grads with --rerun-mode report_stats: report_stats computes every iteration twice" in (
        refusal(f"{GPT3} --rerun-mode report_stats --check-for-large-grads", capsys))


def test_the_weight_hash_interval_is_megatron_lms(capsys):
    assert parse(GPT3).weight_hash_interval is None
    assert parse(f"{GPT3} --check-weight-hash-across-dp-replicas-interval 100").weight_hash_interval == 100
    assert "--check-weight-hash-across-dp-replicas-interval 0: must be positive" in refusal(
        f"{GPT3} --check-weight-hash-across-dp-replicas-interval 0", capsys)


def test_the_exit_signal_handler_is_megatron_lms(capsys):
    assert parse(GPT3).exit_signal is None
    assert parse(f"{GPT3} --exit-signal-handler").exit_signal == "SIGTERM"
    assert parse(f"{GPT3} --exit-signal-handler --exit-signal SIGUSR1").exit_signal == "SIGUSR1"
    assert "--exit-signal SIGUSR1 names the signal --exit-signal-handler catches" in refusal(
        f"{GPT3} --exit-signal SIGUSR1", capsys)
    assert "--exit-signal SIGKILL: a process cannot catch SIGKILL" in refusal(
        f"{GPT3} --exit-signal-handler --exit-signal SIGKILL", capsys)


def test_the_tracker_files_iterations_join_iterations_to_skip(tmp_path, capsys):
    from test_rerun_tracker import megatron_line

    tracker = tmp_path / "tracker.log"
    tracker.write_text(megatron_line("1", 0, 9, "RERUN_DISABLED") + megatron_line("2", 0, 9, "RERUN_DISABLED"))
    cfg = parse(f"{GPT3} --iterations-to-skip 3 7 --result-rejected-tracker-filename {tracker}")
    assert cfg.iterations_to_skip == (3, 7, 9) and cfg.tracked_skips.skip == (9,)
    assert cfg.rerun.result_rejected_tracker_filename == str(tracker)
    assert parse(GPT3).rerun.result_rejected_tracker_filename is None and parse(GPT3).tracked_skips is None
    # A file the job cannot append to, or one out of the format, stops it at start-up.
    assert f"--result-rejected-tracker-filename {tmp_path}: cannot append to it" in refusal(
        f"{GPT3} --result-rejected-tracker-filename {tmp_path}", capsys)
    tracker.write_text("garbage\n")
    assert "line 1: not a tracker line ('garbage')" in refusal(f"{GPT3} --result-rejected-tracker-filename {tracker}",
                                                               capsys)


def test_no_flag_of_the_examples_is_unknown():
    parser = build_parser()
    declared = {s for a in parser._actions for s in a.option_strings}
    for line in (LLAMA3, GPT3, *LLAMA3_REFUSED, *GPT3_REFUSED):
        for flag in (w for w in line.split() if w.startswith("--")):
            assert flag in declared or flag in UNSUPPORTED_MEGATRON_FLAGS, flag


def test_no_declared_flag_is_also_refused():
    """A flag the parser declares never reaches the refusal table: an entry there for it would
    be a dead, misleading reason."""
    declared = {s for a in build_parser()._actions for s in a.option_strings}
    assert not declared & set(UNSUPPORTED_MEGATRON_FLAGS)


def test_megatron_lm_flags_without_a_reason_of_their_own_get_their_groups(capsys):
    """Megatron-LM's flags this build does not read are refused as Megatron-LM flags, with their
    group's reason, all of them in one pass, never as 'unrecognized'; none of them is one the
    GPT or T5 parser declares or refuses by name."""
    from megatron_integration.megatron_lm_flags import FLAG_GROUP
    from megatron_integration.t5_arguments import build_t5_parser

    declared = {s for p in (build_parser(), build_t5_parser()) for a in p._actions for s in a.option_strings}
    assert not declared & set(FLAG_GROUP) and not set(UNSUPPORTED_MEGATRON_FLAGS) & set(FLAG_GROUP)
    assert len(FLAG_GROUP) > 500 and all(f.startswith("--") for f in FLAG_GROUP)
    # The README counts them.
    readme = open(os.path.join(os.path.dirname(__file__), "..", "README.md")).read()
    assert f"and the {len(FLAG_GROUP)} other flags of" in " ".join(readme.split())
    extra = "--cuda-graph-impl local --rl-use-sequence-packing --img-h 224 --ckpt-step 4 --bogus-flag 1"
    with pytest.raises(SystemExit):
        parse(f"{GPT3} {extra}")
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 5, lines
    unsupported = "is a Megatron-LM flag that dynapipe-megatron does not support: "
    assert lines[0].startswith("error: --cuda-graph-impl " + unsupported + "this build does not implement it")
    assert "(Megatron-LM's 'transformer configuration' group); drop it" in lines[0]
    assert "--rl-use-sequence-packing " + unsupported + "Megatron-LM's reinforcement-learning loop" in lines[1]
    assert "--img-h " + unsupported + "vision models are not built" in lines[2]
    assert "--ckpt-step " + unsupported + "--load resumes from the iteration in" in lines[3]
    # Not a Megatron-LM flag at all: argparse's words, said once, with the others.
    assert "unrecognized arguments: --bogus-flag (a flag this build neither reads nor knows" in lines[4]


@pytest.mark.parametrize("extra, note", [
    # Launch scripts' unquoted split: the values are named with the flag they follow and the fix.
    ("--split 949 50 1", "unrecognized arguments: 50 1 (they follow --split 949, which takes one value: "
                         "--split 949,50,1)"),
    ("--lr 1e-3 2e-3", "unrecognized arguments: 2e-3 (they follow --lr 1e-3, which takes one value)"),
])
def test_values_left_over_after_a_flag_name_the_flag(extra, note, capsys):
    with pytest.raises(SystemExit):
        parse(f"{GPT3} {extra}")
    err = capsys.readouterr().err
    assert note in err and "neither reads nor knows" not in err, err


def test_a_schedule_in_samples_is_megatrons_schedule():
    """Megatron-LM steps its scheduler by the samples of each iteration; the iterations here,
    fractional where the samples do not divide, give the same rate at every iteration."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    o = parse(LLAMA3).optimizer

    def rates(warmup, decay, increment):
        opt = types.SimpleNamespace(param_groups=[{"lr": 0.0}])
        s = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=1.5e-4, min_lr=1e-5, lr_warmup_steps=warmup,
                                    lr_decay_steps=decay, lr_decay_style="cosine", start_wd=0.1, end_wd=0.1,
                                    wd_incr_steps=1, wd_incr_style="constant")
        out = []
        for _ in range(8):
            s.step(increment)
            out.append(opt.param_groups[0]["lr"])
        return out

    ours, megatrons = rates(o.lr_warmup_iters, o.lr_decay_iters, 1), rates(12, 60, 8)
    assert np.allclose(ours, megatrons, rtol=1e-12, atol=0) and len(set(ours)) > 4


@pytest.mark.parametrize("extra, needle", [
    ("--train-iters 8 --lr-warmup-samples 8", "need --train-samples"),
    ("--train-samples 64 --lr-warmup-samples 8 --lr-warmup-fraction 0.1", "were both given"),
    ("--train-iters 8 --decoupled-min-lr 1e-5", "needs --decoupled-lr"),
    ("--train-iters 8 --decoupled-lr 1e-5 --decoupled-min-lr 1e-4", "above --decoupled-lr"),
    ("--train-iters 8 --grad-reduce-in-bf16", "applies to --bf16 only"),
    ("--train-iters 8 --recompute-activations --recompute-granularity full --recompute-method uniform "
     "--recompute-num-layers 1", "were both given"),
    ("--train-iters 8 --exit-duration-in-mins -1", "must be a number of minutes"),
    ("--train-iters 8 --norm-epsilon 0", "--norm-epsilon 0.0: must be positive"),
    ("--train-iters 8 --no-create-attention-mask-in-dataloader --dynapipe-batching packing --reset-position-ids "
     "--reset-attention-mask", "give one of them"),
    # Megatron-LM's other choices: refused with the reason, not by argparse's bare "invalid choice".
    ("--train-iters 8 --optimizer muon", "--optimizer muon is not supported by dynapipe-megatron: only adam"),
    ("--train-iters 8 --position-embedding-type none", r"\(NoPE\) is not built; use learned_absolute or rope"),
    ("--train-iters 8 --position-embedding-type yarn", "--position-embedding-type yarn is not supported"),
    ("--train-iters 8 --ckpt-format fsdp_dtensor", "--ckpt-format fsdp_dtensor is not supported"),
    ("--train-iters 8 --transformer-impl inference_optimized", "inference-only layers do not train"),
])
def test_bad_values_are_refused_with_the_fix(extra, needle):
    with pytest.raises(DynaPipeError, match=needle):
        parse(f"{TINY} --lr 1e-3 --mock-data {extra}")


def test_the_nan_check_by_name_under_dynamic_fp16_scaling_is_refused_not_dropped():
    # Megatron-LM turns the check off under --fp16 with dynamic scaling (and has only the --no-
    # spelling); asked for by name there it was dropped unsaid.
    base = f"{TINY} --train-iters 4 --lr 1e-3 --mock-data --fp16"
    assert not parse(base).check_for_nan_in_loss_and_grad
    with pytest.raises(DynaPipeError, match="^--check-for-nan-in-loss-and-grad: under --fp16 with dynamic loss"):
        parse(f"{base} --check-for-nan-in-loss-and-grad")
    assert parse(f"{base} --loss-scale 128 --check-for-nan-in-loss-and-grad").check_for_nan_in_loss_and_grad
    assert parse(f"{TINY} --train-iters 4 --lr 1e-3 --mock-data").check_for_nan_in_loss_and_grad


def test_recompute_activations_is_selective():
    assert parse(f"{TINY} --lr 1e-3 --mock-data --train-iters 2 --recompute-activations").recompute.granularity \
        == "selective"


def test_t5_refuses_what_its_stages_do_not_take():
    from megatron_integration.t5_arguments import parse_t5_args

    argv = ("--encoder-num-layers 2 --decoder-num-layers 2 --hidden-size 64 --num-attention-heads 4 "
            "--encoder-seq-length 128 --decoder-seq-length 32 --micro-batch-size 2 --global-batch-size 8 "
            "--train-iters 2 --lr 1e-3 --mock-data --pipeline-model-parallel-size 2").split()
    for extra in ("--decoupled-lr 1e-3", "--cross-entropy-loss-fusion"):
        with pytest.raises(DynaPipeError, match=extra.split()[0]):
            parse_t5_args(argv + extra.split(), 2, cuda=True)
    # T5 stages are megatron-core's local layers: Megatron-LM's default Transformer Engine is refused on GPUs.
    with pytest.raises(DynaPipeError, match="^the T5 stages are built from megatron-core's local layers .* "
                                            "--transformer-impl is transformer_engine \\(Megatron-LM's default, in "
                                            "effect when the flag is not given\\); pass --transformer-impl local"):
        parse_t5_args(argv, 2, cuda=True)
    assert parse_t5_args(argv + ["--transformer-impl", "local"], 2, cuda=True).base.model.transformer_impl == "local"
    assert parse_t5_args(argv, 2, cuda=False).base.model.transformer_impl == "local"
    # One virtual stage per rank is Megatron-LM's "no interleaving"; two are refused (chunks are a placement).
    assert parse_t5_args(argv + ["--num-virtual-stages-per-pipeline-rank", "1"], 2, cuda=False).base.model
    with pytest.raises(DynaPipeError, match="^--num-virtual-stages-per-pipeline-rank .*2: .*--dynapipe-placement"):
        parse_t5_args(argv + ["--num-virtual-stages-per-pipeline-rank", "2"], 2, cuda=False)
    # So is a chunk of a rank's share of the layers Megatron-LM counts for a T5: --num-layers (the
    # encoder's), or --decoder-num-layers when only --encoder-num-layers is given. Never both
    # together: 2 + 2 layers on 2 ranks take 1 as no interleaving, and 2 is refused (Megatron-LM
    # asserts on it).
    assert parse_t5_args(argv + ["--num-layers-per-virtual-pipeline-stage", "1"], 2, cuda=False).base.model
    with pytest.raises(DynaPipeError, match="^--num-layers-per-virtual-pipeline-stage .*2: "):
        parse_t5_args(argv + ["--num-layers-per-virtual-pipeline-stage", "2"], 2, cuda=False)
    deep_encoder = [a for a in argv if a != "--encoder-num-layers"]
    deep_encoder[deep_encoder.index("2")] = "4"  # the encoder's count, now after --num-layers
    deep_encoder = ["--num-layers"] + deep_encoder
    assert parse_t5_args(deep_encoder + ["--num-layers-per-virtual-pipeline-stage", "2"], 2, cuda=False).base.model
    for value in ("1", "3"):
        with pytest.raises(DynaPipeError, match=f"^--num-layers-per-virtual-pipeline-stage .*{value}: "):
            parse_t5_args(deep_encoder + ["--num-layers-per-virtual-pipeline-stage", value], 2, cuda=False)
    # Every T5 method runs through the executor: megatron-core's overlap switch has nothing to turn off.
    with pytest.raises(DynaPipeError, match="^--no-overlap-p2p-communication .*drop it"):
        parse_t5_args(argv + ["--no-overlap-p2p-communication"], 2, cuda=False)


def test_indexed_data_read_without_memory_maps_is_the_same(tmp_path):
    from dynapipe.data.indexed import MegatronIndexedDataset, write_indexed_dataset
    from dynapipe.data.samples import LengthLimits

    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 50, size=int(n)) for n in rng.integers(5, 40, size=12)]
    docs[7][3] = 60  # one id outside a 50-token vocabulary
    prefix = str(tmp_path / "docs")
    write_indexed_dataset(prefix, docs)
    limits = LengthLimits(32, 0, "truncate")
    mapped, read = (MegatronIndexedDataset(prefix, limits, mmap=m) for m in (True, False))
    assert read.mmap is False and len(read) == len(mapped)
    for i in range(len(mapped)):
        assert np.array_equal(read[i].target_ids, mapped[i].target_ids)
    with pytest.raises(DynaPipeError, match="sequence 7, token 3 has id 60"):
        read.validate_tokens(50)


def _exit_worker(ctx, late_rank: int):
    import torch
    import torch.distributed as dist

    from megatron_integration.training_limits import exit_duration_reached

    started = 1000.0
    # Only one rank's clock is past the limit; every rank must stop at this iteration.
    now = started + (121.0 if dist.get_rank() == late_rank else 30.0)
    return (exit_duration_reached(2, started, torch.device("cpu"), now_s=now),
            exit_duration_reached(3, started, torch.device("cpu"), now_s=now))


def test_every_rank_stops_when_one_rank_is_past_the_duration():
    from dynapipe.runtime.distributed import spawn

    # Both ranks stop, and both report the late rank's 121 s (rank 0's own 30 s would read as a
    # stop before the limit).
    got = spawn(_exit_worker, 2, args=(1,), timeout_s=120)
    assert [(round(a, 6), b) for a, b in got] == [(round(121 / 60, 6), None)] * 2, got


def _duration_during_evaluation(argv: list) -> dict:
    import io

    from megatron_integration import training_loop
    from megatron_integration.training import pretrain

    calls = []

    def reached(minutes, started_s, device, now_s=None):  # past the limit from its second check on
        calls.append(minutes)
        return 61.0 if len(calls) >= 2 else None

    training_loop.exit_duration_reached = reached
    run = pretrain(parse_training_args(argv, 1, cuda=False), stream=io.StringIO())
    return dict(iterations=len(run.results), eval_lines=run.eval_lines, calls=calls)


def test_the_duration_is_checked_after_every_evaluation_batch_too():
    # Megatron-LM's evaluate() checks the limit after each batch: past it during an evaluation
    # of 5 batches, the evaluation stops after its first (no result) and the run stops there.
    from megatron_integration.evaluation import TIME_UP_LINE
    from megatron_integration.launch import spawn

    argv = (f"{TINY} --vocab-size 256 --lr 1e-3 --mock-data --split 90,5,5 --train-iters 4 --eval-interval 2 "
            f"--eval-iters 5 --exit-duration-in-mins 60").split()
    out = spawn(_duration_during_evaluation, 1, (argv,), timeout_s=180)[0]
    # Checked after iteration 1, after the first evaluation batch at iteration 2, then by the loop.
    assert out["calls"] == [60, 60, 60], out
    assert out["iterations"] == 2 and out["eval_lines"] == [TIME_UP_LINE], out


def _duration_with_save(argv: list) -> str:
    import io

    from megatron_integration import training_loop
    from megatron_integration.training import pretrain

    training_loop.exit_duration_reached = lambda minutes, started_s, device, now_s=None: 61.25
    out = io.StringIO()
    pretrain(parse_training_args(argv, 1, cuda=False), stream=out)
    return out.getvalue()


def test_the_duration_exit_line_follows_the_final_save(tmp_path):
    # Megatron-LM saves, then prints "exiting program after ... minutes": printed first, a save
    # that then failed would follow a line saying the program was exiting.
    from megatron_integration.launch import spawn

    argv = (f"{TINY} --vocab-size 256 --lr 1e-3 --mock-data --train-iters 4 --exit-duration-in-mins 60 "
            f"--save {tmp_path / 'ck'}").split()
    printed = spawn(_duration_with_save, 1, (argv,), timeout_s=180)[0]
    saved = printed.index("successfully saved checkpoint")
    exiting = printed.index("exiting program after 61.25 minutes")
    assert saved < exiting and "after iteration 1" in printed[exiting:], printed
    assert (tmp_path / "ck" / "latest_checkpointed_iteration.txt").read_text().strip() == "1"


def _summary_with_slow_evaluations(argv: list) -> tuple[str, float]:
    import io
    import time

    from megatron_integration import evaluation
    from megatron_integration.training import pretrain

    real = evaluation.Evaluator.evaluate

    def slow(self, split, first_batch):
        time.sleep(2.0)
        return real(self, split, first_batch)

    evaluation.Evaluator.evaluate = slow
    out = io.StringIO()
    pretrain(parse_training_args(argv, 1, cuda=False), stream=out)
    lines = out.getvalue().splitlines()
    # The log lines' own iteration time (one iteration a line), which leaves evaluation out.
    logged_s = sum(float(ln.split("elapsed time per iteration (ms): ")[1].split(" ")[0]) / 1e3
                   for ln in lines if "elapsed time per iteration (ms): " in ln)
    return next(line for line in lines if line.startswith(" > training summary:")), logged_s


def test_the_training_summary_leaves_evaluation_time_out_as_the_log_lines_do():
    # Evaluations of a second each fell inside the summary's time: its time per iteration and
    # tokens/s then described evaluation, not training.
    from megatron_integration.launch import spawn

    argv = (f"{TINY} --vocab-size 256 --lr 1e-3 --mock-data --split 90,5,5 --train-iters 2 --eval-interval 1 "
            f"--eval-iters 1 --log-interval 1").split()
    summary, logged_s = spawn(_summary_with_slow_evaluations, 1, (argv,), timeout_s=180)[0]
    seconds = float(summary.split("time (s): ")[1].split(" ")[0])
    # The two periodic evaluations slept 4 s; the iterations' time depends on the machine's load
    # (seconds for the first one on a busy host), which the log lines measure as well.
    assert logged_s > 0 and seconds < logged_s + 1.0, (summary, logged_s)


def test_no_limit_means_no_collective():
    import torch

    from megatron_integration.training_limits import check_exit_duration, exit_duration_reached

    # Megatron-LM treats 0 as no limit; no process group is needed then.
    assert check_exit_duration(0) is None
    assert exit_duration_reached(None, 0.0, torch.device("cpu"), now_s=1e9) is None


def _optimizer_groups(argv: list):
    """(max_lr, lr, parameter names) of every optimizer group of a one-rank GPT stage."""
    from megatron_integration.initialize import initialize_megatron
    from megatron_integration.model import build_stage
    from megatron_integration.optimizer import build_optimizer

    cfg = parse_training_args(argv, 1)
    info = initialize_megatron(cfg.parallel, cfg.seed)
    stage = build_stage(cfg, info)
    optimizer, _ = build_optimizer(cfg, stage)
    names = {id(p): n for n, p in stage.gpt.named_parameters()}
    return [(g.get("max_lr"), g["lr"], sorted(names[id(p)] for p in g["params"])) for g in optimizer.param_groups]


def test_decoupled_lr_reaches_the_embedding_and_output_layer_only():
    from megatron_integration.launch import spawn

    argv = f"{TINY} --mock-data --train-iters 4 --lr 1e-3 --decoupled-lr 5e-4 --untie-embeddings-and-output-weights"
    groups = spawn(_optimizer_groups, 1, (argv.split(),), timeout_s=120)[0]
    decoupled = [g for g in groups if g[0] == 5e-4]
    named = sorted(n for g in decoupled for n in g[2])
    assert named == ["embedding.word_embeddings.weight", "output_layer.weight"], groups
    assert all(g[1] == 5e-4 for g in decoupled)  # no warm-up: the peak rate from the first step
    assert all(g[1] == 1e-3 for g in groups if g[0] != 5e-4) and len(groups) > len(decoupled)
