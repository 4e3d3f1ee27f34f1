"""Megatron-LM flags: accepted with Megatron's meaning and defaults, or refused in one line."""
import os
import subprocess
import sys

import pytest

from dynapipe.errors import DynaPipeError
from megatron_integration.arguments import (UNSUPPORTED_MEGATRON_FLAGS, build_parser, padded_vocab_size,
                                            parse_training_args)
from megatron_integration.training import vocab_padding_line

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 128 --micro-batch-size 2 "
        "--global-batch-size 8 --lr 1e-3 --mock-data")


def parse(extra: str, world: int = 1, cuda: bool = False, iters: str = "--train-iters 100"):
    return parse_training_args(f"{BASE} {iters} {extra}".split(), world, cuda=cuda)


def test_megatron_schedule_defaults():
    cfg = parse("--min-lr 1e-5")
    # Megatron-LM: linear decay over --train-iters unless --lr-decay-iters, to --min-lr.
    o = cfg.optimizer
    assert (o.lr_decay_style, o.lr_decay_iters, o.min_lr, o.lr_warmup_iters) == ("linear", 100, 1e-5, 0)
    assert parse("--lr-decay-iters 60 --lr-warmup-iters 5").optimizer.lr_decay_iters == 60
    assert parse("--lr-decay-style constant").optimizer.lr_decay_style == "constant"
    assert parse("").optimizer.optimizer == "adam" and parse("--optimizer adam").optimizer.optimizer == "adam"


def test_train_samples_and_warmup_fraction():
    cfg = parse("--train-samples 800 --lr-warmup-fraction 0.1", iters="")
    # iterations = samples // global batch; warm-up = fraction x decay iterations (Megatron-LM).
    assert cfg.train_iters == 100 and cfg.optimizer.lr_decay_iters == 100 and cfg.optimizer.lr_warmup_iters == 10
    assert parse("--train-samples 803", iters="").train_iters == 100
    assert parse("--lr-decay-iters 50 --lr-warmup-fraction 0.2").optimizer.lr_warmup_iters == 10


def test_exit_interval_stops_at_its_first_multiple():
    cfg = parse("--exit-interval 40")
    assert cfg.exit_interval == 40
    assert [cfg.last_iteration(s) for s in (0, 39, 40, 80, 99)] == [40, 40, 80, 100, 100]
    assert parse("").last_iteration(7) == 100


def test_flags_at_their_built_values_are_accepted():
    cfg = parse("--group-query-attention --num-query-groups 4 --rotary-base 10000 --transformer-impl "
                "transformer_engine --attention-backend auto --num-workers 4 --initial-loss-scale 4294967296")
    assert cfg.model.num_attention_heads == 4
    # RoPE's base only matters with RoPE: Megatron ignores it for learned positions.
    assert parse("--rotary-base 500000").model.position_embedding_type == "learned_absolute"
    assert parse("--transformer-impl local").model.num_layers == 2  # CPU: the local spec is what runs


@pytest.mark.parametrize("extra, cuda, flag", [
    ("--swiglu", False, "--swiglu"),
    ("--disable-bias-linear", False, "--disable-bias-linear"),
    ("--group-query-attention --num-query-groups 2", False, "--group-query-attention"),
    ("--position-embedding-type rope --rotary-base 500000", False, "--rotary-base"),
    ("--use-flash-attn", True, "--use-flash-attn"),
    ("--attention-backend flash", True, "--attention-backend"),
    ("--transformer-impl local", True, "--transformer-impl"),
    ("--optimizer sgd", False, "--optimizer"),
    ("--fp16 --loss-scale 1024", True, "--loss-scale"),
    ("--fp16 --initial-loss-scale 65536", True, "--initial-loss-scale"),
])
def test_values_that_cannot_be_honoured_are_refused(extra, cuda, flag):
    with pytest.raises(DynaPipeError) as e:
        parse(extra, cuda=cuda)
    assert str(e.value).startswith(f"{flag} is a Megatron-LM flag that dynapipe-megatron does not support: ")


@pytest.mark.parametrize("extra, needle", [
    ("--train-samples 800", "--train-iters 100 were both given"),
    ("--lr-warmup-iters 5 --lr-warmup-fraction 0.1", "give one"),
    ("--lr-warmup-fraction 1.5", "--lr-warmup-fraction 1.5: must be in [0, 1)"),
    ("--lr-warmup-iters 100", "must be shorter than the decay"),
    ("--min-lr 0.1", "--min-lr 0.1 is above --lr"),
    ("--loss-scale 1024", "--loss-scale applies to --fp16 only"),
    ("--exit-interval 0", "--exit-interval 0: must be positive"),
    ("--make-vocab-size-divisible-by 0", "--make-vocab-size-divisible-by 0: must be positive"),
])
def test_invalid_schedule_values_name_the_flag(extra, needle):
    with pytest.raises(DynaPipeError) as e:
        parse(extra)
    assert needle in str(e.value)


def test_train_samples_refuses_iteration_schedules():
    with pytest.raises(DynaPipeError, match="drop --lr-decay-iters"):
        parse("--train-samples 800 --lr-decay-iters 50", iters="")
    with pytest.raises(DynaPipeError, match="below --global-batch-size 8"):
        parse("--train-samples 4", iters="")


def test_vocabulary_is_padded_as_megatron_pads_it():
    assert padded_vocab_size(50257, 128, 1) == 50304
    assert padded_vocab_size(50257, 128, 2) == 50432
    assert padded_vocab_size(50304, 128, 1) == 50304
    cfg = parse("--vocab-size 50257")
    assert cfg.model.vocab_size == 50304 and cfg.model.to_model_config().vocab_size == 50304
    assert vocab_padding_line(cfg) == " > padded vocab (size: 50257) with 47 dummy tokens (new size: 50304)"
    assert parse("--vocab-size 50257 --make-vocab-size-divisible-by 1").model.vocab_size == 50257
    assert parse("").model.vocab_size == 384  # the byte-level tokenizer's ids, already a multiple of 128


@pytest.mark.parametrize("argv", [["--context-parallel-size", "2"], ["--wandb-project=gpt"], ["--sequence-parallel"],
                                  ["--split", "949,50,1"], ["--overlap-grad-reduce"]])
def test_unsupported_megatron_flag_is_one_line(argv, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as e:
        build_parser("pretrain_gpt.py").parse_args(BASE.split() + argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    flag = argv[0].split("=")[0]
    assert err == f"error: {flag} is a Megatron-LM flag that dynapipe-megatron does not support: " \
                  f"{UNSUPPORTED_MEGATRON_FLAGS[flag]}\n"
    # Other ranks of a torchrun job exit the same way without repeating the line.
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit) as e:
        build_parser("pretrain_gpt.py").parse_args(BASE.split() + argv)
    assert e.value.code == 2 and capsys.readouterr().err == ""


def test_unknown_flag_is_still_argparse_error(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as e:
        build_parser("pretrain_gpt.py").parse_args(BASE.split() + ["--colour", "red"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "unrecognized arguments: --colour red" in err and err.count("\n") == 1


def test_script_prints_the_line_once_without_usage():
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "pretrain_gpt.py"), *BASE.split(), "--train-iters", "2",
           "--swiglu", "--eval-iters", "10"]
    env = dict(os.environ, PYTHONPATH=ROOT)
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert result.returncode == 2
    assert result.stderr.startswith("error: --eval-iters is a Megatron-LM flag that dynapipe-megatron does not "
                                    "support: ") and result.stderr.count("\n") == 1, result.stderr
    assert "usage" not in result.stderr


def test_megatron_flags_in_a_real_run(tmp_path):
    """One torchrun job: --train-samples, --lr-warmup-fraction, --exit-interval (with a checkpoint
    at the exit) and the vocabulary-padding line, end to end."""
    from megatron_integration.launch import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port", str(free_port()),
           os.path.join(ROOT, "scripts", "pretrain_gpt.py"), *BASE.split(), "--seq-length", "64",
           "--train-samples", "48", "--lr-warmup-fraction", "0.5", "--exit-interval", "2", "--log-interval", "1",
           "--vocab-size", "300", "--save", str(tmp_path / "ckpt"), "--dynapipe-mock-samples", "256",
           "--transformer-impl", "transformer_engine", "--num-workers", "2", "--optimizer", "adam"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert " > padded vocab (size: 300) with 84 dummy tokens (new size: 384)" in result.stdout
    lines = [l for l in result.stdout.splitlines() if "iteration" in l and "lm loss" in l]
    # 48 samples / 8 per batch = 6 iterations, but the run exits after iteration 2 and saves it.
    assert len(lines) == 2 and "iteration        2/       6" in lines[1], lines
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
