"""Megatron-LM flags: accepted with Megatron's meaning and defaults, or refused in one line."""
import os
import re
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
    # The schedule decays over the samples, not the whole iterations they round down to (Megatron-LM).
    cfg = parse("--train-samples 803 --lr-warmup-fraction 0.1", iters="")
    assert cfg.train_iters == 100 and cfg.optimizer.lr_decay_iters == pytest.approx(100.375)
    assert cfg.optimizer.lr_warmup_iters == pytest.approx(10.0375)
    # The weight decay's increment spans the samples too (Megatron-LM's wd_incr_steps = train samples).
    pytest.importorskip("megatron.core")
    from megatron_integration.optimizer import scheduler_arguments

    assert scheduler_arguments(cfg)["wd_incr_steps"] == pytest.approx(100.375)
    assert scheduler_arguments(parse(""))["wd_incr_steps"] == 100
    assert parse("--lr-decay-iters 50 --lr-warmup-fraction 0.2").optimizer.lr_warmup_iters == 10


def test_exit_interval_stops_at_its_first_multiple():
    cfg = parse("--exit-interval 40")
    assert cfg.exit_interval == 40
    assert [cfg.last_iteration(s) for s in (0, 39, 40, 80, 99)] == [40, 40, 80, 100, 100]
    assert parse("").last_iteration(7) == 100
    assert parse("--exit-interval 0").last_iteration(7) == 100  # 0 is off, as Megatron-LM reads it


def test_flags_at_their_built_values_are_accepted():
    cfg = parse("--group-query-attention --num-query-groups 4 --rotary-base 10000 --transformer-impl "
                "transformer_engine --attention-backend auto --num-workers 4 --initial-loss-scale 4294967296")
    assert cfg.model.num_attention_heads == 4
    # RoPE's base only matters with RoPE: Megatron ignores it for learned positions.
    assert parse("--rotary-base 500000").model.position_embedding_type == "learned_absolute"
    # CPU: Transformer Engine needs CUDA, so the local layers are what runs either way.
    assert parse("--transformer-impl local").model.transformer_impl == "local"
    assert parse("").model.transformer_impl == "local"


def test_transformer_impl_picks_the_gpu_layers(monkeypatch):
    import megatron_integration.model as model_specs

    monkeypatch.setattr(model_specs, "te_available", lambda: True)
    assert parse("", cuda=True).model.transformer_impl == "transformer_engine"  # Megatron-LM's default
    assert parse("--transformer-impl local", cuda=True).model.transformer_impl == "local"
    # Transformer Engine's causal attention ignores packed rows' per-sample mask: refused, local taken.
    packed = "--dynapipe-batching packing --reset-attention-mask --reset-position-ids"
    with pytest.raises(DynaPipeError, match="^--reset-attention-mask with --transformer-impl transformer_engine.*"
                                            "pass --transformer-impl local"):
        parse(packed, cuda=True)
    with pytest.raises(DynaPipeError, match="^--reset-attention-mask with"):
        parse(packed + " --use-dynapipe", cuda=True)
    assert parse(packed + " --transformer-impl local", cuda=True).model.transformer_impl == "local"
    # So does DynaPipe's per-sample kernel on its own rows: it is the local attention's.
    with pytest.raises(DynaPipeError, match="^--dynapipe-padded-attention per-sample with --transformer-impl "
                                            "transformer_engine.*pass --transformer-impl local"):
        parse("--use-dynapipe --dynapipe-padded-attention per-sample", cuda=True)
    assert parse("--use-dynapipe --dynapipe-padded-attention per-sample --transformer-impl local",
                 cuda=True).per_sample_attention
    monkeypatch.setattr(model_specs, "te_available", lambda: False)
    assert parse("--transformer-impl local", cuda=True).model.transformer_impl == "local"
    with pytest.raises(DynaPipeError, match="^--transformer-impl transformer_engine .* cannot load it here .*"
                                            "--transformer-impl local"):
        parse("", cuda=True)


@pytest.mark.parametrize("extra, cuda", [
    ("--attention-backend flash", True),
    ("--attention-backend local", True),  # Transformer Engine's layers (Megatron-LM's default) on GPUs
    ("--attention-backend unfused", True),  # Transformer Engine's unfused kernel: not steered here
    ("--optimizer sgd", False),
])
def test_values_that_cannot_be_honoured_are_refused(extra, cuda):
    with pytest.raises(DynaPipeError) as e:
        parse(extra, cuda=cuda)
    assert str(e.value).startswith(f"{extra} is not supported by dynapipe-megatron: ")


def test_the_attention_backend_local_layers_use_is_accepted():
    assert parse("--attention-backend local", cuda=False).model.num_layers == 2
    assert parse("--attention-backend local --transformer-impl local", cuda=True).model.num_layers == 2
    # megatron-core's local attention is unfused too (Megatron-LM's T5 test configs name it so).
    assert parse("--attention-backend unfused", cuda=False).model.num_layers == 2
    assert parse("--attention-backend unfused --transformer-impl local", cuda=True).model.num_layers == 2


def test_megatron_lm_launch_scripts_refused_flags_are_named_all_at_once(capsys):
    # Megatron-LM's mixtral and Megatron-FSDP llama3 scripts: every refused flag named in one run.
    with pytest.raises(SystemExit):
        parse("--moe-router-topk 2 --moe-grouped-gemm --use-megatron-fsdp --fsdp-double-buffer")
    lines = capsys.readouterr().err.strip().splitlines()
    assert [ln.split()[1] for ln in lines] == ["--moe-router-topk", "--moe-grouped-gemm", "--use-megatron-fsdp",
                                                "--fsdp-double-buffer"]
    assert all(" is a Megatron-LM flag that dynapipe-megatron does not support: " in ln for ln in lines)
    assert "mixture-of-experts models are not built" in lines[0] and "Megatron-FSDP is not built" in lines[2]
    # A flag no Megatron-LM release of this build's knowledge has (removed upstream, or a typo) is
    # named in the same pass, after the refused ones.
    with pytest.raises(SystemExit):
        parse("--tp-comm-overlap --no-async-tensor-model-parallel-allreduce --lr-decay-stlye=cosine")
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0].startswith("error: --tp-comm-overlap is a Megatron-LM flag")
    assert lines[1].startswith("error: ") and lines[1].split(": ", 1)[1].split(": ", 1)[1].startswith(
        "unrecognized arguments: --no-async-tensor-model-parallel-allreduce --lr-decay-stlye=cosine (a flag")


def test_rope_type_rope_is_the_rope_built_and_yarn_is_refused():
    assert parse("--position-embedding-type rope --rope-type rope").model.position_embedding_type == "rope"
    with pytest.raises(DynaPipeError, match="--rope-type yarn: YaRN rotary embeddings .* not built"):
        parse("--position-embedding-type rope --rope-type yarn")
    with pytest.raises(DynaPipeError, match="--rope-type rope applies to rotary position embeddings"):
        parse("--rope-type rope")


@pytest.mark.parametrize("extra, needle", [
    ("--train-samples 800", "--train-iters 100 were both given"),
    ("--lr-warmup-iters 5 --lr-warmup-fraction 0.1", "give one"),
    ("--lr-warmup-fraction 1.5", "--lr-warmup-fraction 1.5: must be in [0, 1)"),
    ("--lr-warmup-iters 100", "must be shorter than the decay"),
    # megatron-core's scheduler asserts both after start-up; refused before it.
    ("--lr-decay-style constant --lr-warmup-iters 100", "must be shorter than the decay"),
    ("--weight-decay-incr-style linear --start-weight-decay 0.1 --end-weight-decay 0.01",
     "--end-weight-decay 0.01 is below --start-weight-decay 0.1"),
    ("--min-lr 0.1", "--min-lr 0.1 is above --lr"),
    ("--loss-scale 1024", "--loss-scale applies to --fp16 and --bf16"),
    ("--make-vocab-size-divisible-by 0", "--make-vocab-size-divisible-by 0: must be positive"),
])
def test_invalid_schedule_values_name_the_flag(extra, needle):
    with pytest.raises(DynaPipeError) as e:
        parse(extra)
    assert needle in str(e.value)


@pytest.mark.parametrize("extra, world, needle", [
    # Megatron-LM reads the groups only with GQA; here the layers would silently get full MHA.
    ("--num-query-groups 2", 1, "--num-query-groups 2 without --group-query-attention"),
    ("--seed 0", 1, "--seed 0: Megatron-LM takes a positive integer seed"),
    ("--seed -1", 1, "--seed -1: Megatron-LM takes a positive integer seed"),
    # Megatron-LM asserts max_position_embeddings >= seq_length whatever the position type.
    ("--position-embedding-type rope --max-position-embeddings 64",
     1, "--seq-length 128 exceeds --max-position-embeddings 64"),
    # --swiglu's default FFN width (2/3 x 4h rounded down to 64: 512 here) is what TP must divide, not 4h.
    ("--hidden-size 192 --num-attention-heads 6 --swiglu --tensor-model-parallel-size 3",
     3, "does not divide --ffn-hidden-size 512"),
])
def test_megatron_lm_refusals_before_any_work(extra, world, needle):
    with pytest.raises(DynaPipeError) as e:
        parse(extra, world=world)
    assert needle in str(e.value)
    assert parse("--num-query-groups 2 --group-query-attention").model.num_query_groups == 2


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


def test_a_checkpoint_padded_at_another_tp_size_names_the_divisor_that_loads_it():
    # --vocab-size 300 pads to 384 at TP1 and 512 at TP2: resuming at TP2 was refused as a
    # --vocab-size mismatch, though the arguments were the same.
    from types import SimpleNamespace

    from megatron_integration.checkpoint_compat import model_mismatch

    tp2 = "--vocab-size 300 --tensor-model-parallel-size 2"
    cfg = parse(tp2, world=2)
    saved = SimpleNamespace(padded_vocab_size=384, tensor_model_parallel_size=1)
    why = model_mismatch(saved, cfg)
    assert why == ("padded_vocab_size 384 in the checkpoint, 512 here: the 300-id vocabulary was padded to a multiple "
                   "of --make-vocab-size-divisible-by x TP at TP 1; add --make-vocab-size-divisible-by 64 to pad it "
                   "to the same 384 rows at TP 2")
    assert parse(f"{tp2} --make-vocab-size-divisible-by 64", world=2).model.vocab_size == 384
    # Another vocabulary at another TP size is not explained away by a divisor (200 ids would pad
    # to the saved 384 rows with --make-vocab-size-divisible-by 192).
    assert model_mismatch(saved, parse("--vocab-size 200 --tensor-model-parallel-size 2", world=2)).endswith(
        "--vocab-size (or the tokenizer)")
    assert model_mismatch(SimpleNamespace(padded_vocab_size=384, tensor_model_parallel_size=1, vocab_size=290),
                          cfg).endswith("--vocab-size (or the tokenizer)")
    # At the same TP size a different row count is another vocabulary.
    assert model_mismatch(SimpleNamespace(padded_vocab_size=640, tensor_model_parallel_size=2), cfg).endswith(
        "--vocab-size (or the tokenizer)")
    # Saved unpadded (--make-vocab-size-divisible-by 1, 301 rows): no divisor splits 301 rows over
    # 2 TP ranks, so resume at the saved size.
    odd = SimpleNamespace(padded_vocab_size=301, tensor_model_parallel_size=1, make_vocab_size_divisible_by=1)
    assert model_mismatch(odd, parse("--vocab-size 301 --tensor-model-parallel-size 2", world=2)).endswith(
        "no --make-vocab-size-divisible-by pads it to 301 rows at TP 2; resume at TP 1")


@pytest.mark.parametrize("argv", [["--wandb-project=gpt"], ["--fp8-format", "hybrid"],
                                  ["--dataloader-type", "cyclic"], ["--ddp-average-in-collective"],
                                  ["--relative-attention-num-buckets", "32"], ["--fp16-lm-cross-entropy"],
                                  ["--openai-gelu"], ["--use-precision-aware-optimizer"], ["--yaml-cfg", "a.yaml"],
                                  ["--checkpoint-activations"], ["--sft"], ["--decoder-seq-length", "128"]])
def test_unsupported_megatron_flag_is_one_line(argv, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as e:
        build_parser("pretrain_gpt.py").parse_args(BASE.split() + argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    flag = argv[0].split("=")[0]
    assert err == f"error: {flag} is a Megatron-LM flag that dynapipe-megatron does not support: " \
                  f"{UNSUPPORTED_MEGATRON_FLAGS[flag]}\n"
    # Other ranks of a torchrun job say it too: torchrun stops the rest once one rank exits, so
    # a line left to rank 0 could be lost (it was, in some runs).
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit) as e:
        build_parser("pretrain_gpt.py").parse_args(BASE.split() + argv)
    assert e.value.code == 2 and capsys.readouterr().err == err


def test_a_name_megatron_lm_never_had_is_not_called_its_flag(capsys, monkeypatch):
    # Megatron-LM derives args.virtual_pipeline_model_parallel_size; there is no such flag to refuse as its own.
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as e:
        build_parser("pretrain_gpt.py").parse_args(BASE.split() + ["--virtual-pipeline-model-parallel-size", "2"])
    assert e.value.code == 2
    assert capsys.readouterr().err == (
        "error: --virtual-pipeline-model-parallel-size: not a Megatron-LM flag (Megatron derives the virtual pipeline "
        "size); give --num-virtual-stages-per-pipeline-rank or --num-layers-per-virtual-pipeline-stage\n")


@pytest.mark.parametrize("flag, why", [("--fp8-margin", "fp8 training is not supported"),
                                       ("--no-fp8-wgrad", "fp8 training is not supported"),
                                       ("--wandb-entity", "use --tensorboard-dir")])
def test_megatron_flag_families_are_refused_by_prefix_with_the_reason(flag, why, capsys, monkeypatch):
    # Megatron-LM adds fp8 and wandb flags release by release; each gets the family's reason,
    # not argparse's bare "unrecognized arguments".
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as e:
        build_parser("pretrain_gpt.py").parse_args(BASE.split() + [flag, "1"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {flag} is a Megatron-LM flag that dynapipe-megatron does not support: {why}")


def test_refused_values_of_declared_flags_come_with_the_refused_flags_in_one_pass(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as e:
        build_parser("pretrain_gpt.py").parse_args(BASE.split() + ["--openai-gelu", "--rerun-mode", "report_stats",
                                                                   "--error-injection-rate", "3", "--no-load-optim"])
    lines = capsys.readouterr().err.splitlines()
    assert e.value.code == 2 and len(lines) == 3, lines
    assert lines[0].startswith("error: --openai-gelu is a Megatron-LM flag that dynapipe-megatron does not support")
    assert lines[1].startswith("error: --no-load-optim applies to a checkpoint loaded with --load DIR")
    assert lines[2].startswith("error: --error-injection-rate 3 with --rerun-mode report_stats")
    # Without a refused flag the same values are refused by validation, one at a time, as before.
    from megatron_integration.arguments import parse_training_args

    with pytest.raises(DynaPipeError, match="--error-injection-rate 3 with --rerun-mode report_stats"):
        parse_training_args(BASE.split() + ["--train-iters", "2", "--lr", "1e-3", "--mock-data", "--rerun-mode",
                                            "report_stats", "--error-injection-rate", "3"], 1, cuda=False)


def test_unknown_flag_is_still_argparse_error(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as e:
        build_parser("pretrain_gpt.py").parse_args(BASE.split() + ["--colour", "red"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "unrecognized arguments: --colour red (a flag this build neither reads" in err
    assert "the Megatron-LM flags it reads are under Arguments in the README); see pretrain_gpt.py --help" in err
    assert err.count("\n") == 1


def test_script_prints_the_line_once_without_usage():
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "pretrain_gpt.py"), *BASE.split(), "--train-iters", "2",
           "--swiglu", "--fp8-format", "hybrid"]
    env = dict(os.environ, PYTHONPATH=ROOT)
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert result.returncode == 2
    assert result.stderr.startswith("error: --fp8-format is a Megatron-LM flag that dynapipe-megatron does not "
                                    "support: ") and result.stderr.count("\n") == 1, result.stderr
    assert "usage" not in result.stderr


FIXTURES = os.path.join(ROOT, "tests", "fixtures", "gpt2-tiny")


def _megatron_gpt_argv(data: str, save: str) -> list[str]:
    """A Megatron-LM GPT pretraining command line (its GPT/Llama examples' flags) scaled to a tiny
    model: 55 flags. Left out: --fp16 (GPU-only), --bf16 (tested in
    test_megatron_dynapipe.py at bf16's tolerance) and tensor/sequence parallelism (tested in
    test_megatron_tp.py)."""
    return f"""
        --num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 --kv-channels 16
        --group-query-attention --num-query-groups 2 --seq-length 128 --max-position-embeddings 128
        --position-embedding-type rope --rotary-base 10000 --swiglu --disable-bias-linear --normalization RMSNorm
        --untie-embeddings-and-output-weights --attention-backend auto --transformer-impl local --use-flash-attn
        --hidden-dropout 0.0 --attention-dropout 0.0 --init-method-std 0.02 --use-cpu-initialization
        --micro-batch-size 2 --global-batch-size 8 --train-samples 48 --exit-interval 2 --seed 1234
        --lr 3.0e-4 --min-lr 3.0e-5 --lr-decay-style cosine --lr-warmup-fraction 0.25 --weight-decay 0.1
        --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 --clip-grad 1.0 --optimizer adam
        --initial-loss-scale 4294967296
        --pipeline-model-parallel-size 2 --tensor-model-parallel-size 1 --distributed-timeout-minutes 5
        --data-path 0.7 {data}/a_text_document 0.3 {data}/b_text_document
        --tokenizer-type GPT2BPETokenizer --vocab-file {FIXTURES}/vocab.json --merge-file {FIXTURES}/merges.txt
        --make-vocab-size-divisible-by 128 --num-workers 2
        --split 90,8,2 --eval-interval 2 --eval-iters 1
        --save {save} --load {save} --save-interval 1000 --ckpt-format torch_dist --log-interval 1""".split()


def _write_indexed(prefix: str, seed: int, docs: int) -> None:
    """A pre-tokenised dataset as Megatron-LM's preprocess_data.py writes it (megatron-core's builder):
    documents of ids below the tiny GPT-2 vocabulary's EOD, each ending in EOD (id 20)."""
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for _ in range(docs):
        doc = np.append(rng.integers(0, 20, int(rng.integers(8, 127))), 20)
        builder.add_document(doc.astype(np.int32), [len(doc)])
    builder.finalize(prefix + ".idx")


def _torchrun(argv: list[str], nproc: int) -> subprocess.CompletedProcess:
    from megatron_integration.launch import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
           str(free_port()), os.path.join(ROOT, "scripts", "pretrain_gpt.py"), *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)


def test_megatron_gpt_command_line_runs_unchanged(tmp_path):
    """One Megatron-LM GPT command line, unchanged, under torchrun (PP2) with and without --use-dynapipe:
    same losses; Megatron's start-up and end output; --train-samples, --lr-warmup-fraction, --exit-interval
    (with a checkpoint at the exit) and the tokenizer's padded vocabulary, end to end."""
    from dynapipe.cost.base import stage_layouts, stage_param_count
    from megatron_integration.arguments import parse_training_args

    data = tmp_path / "data"
    data.mkdir()
    _write_indexed(str(data / "a_text_document"), 0, 40)
    _write_indexed(str(data / "b_text_document"), 1, 40)
    losses, counts, valid = {}, {}, {}
    for method in ("padding", "dynapipe"):
        save = tmp_path / f"ckpt-{method}"
        save.mkdir()  # --load names the same directory, as in Megatron-LM's examples
        argv = _megatron_gpt_argv(str(data), str(save)) + (["--use-dynapipe"] if method == "dynapipe" else [])
        assert len([a for a in argv if a.startswith("--")]) >= 40
        result = _torchrun(argv, 2)
        assert result.returncode == 0, result.stderr[-3000:]
        out = result.stdout
        # Rank 0's argument dump, once.
        assert out.count("------------------------ arguments ------------------------") == 1
        assert "  swiglu .......................................... True" in out
        # Values validation derived, as Megatron-LM dumps them: 48 / 8 iterations, the padded vocabulary.
        assert "  train_iters ..................................... 6\n" in out
        assert "  padded_vocab_size ............................... 128\n" in out
        assert "  vocab_file " in out and "-------------------- end of arguments ---------------------" in out
        assert " > padded vocab (size: 21) with 107 dummy tokens (new size: 128)" in out
        counts[method] = {int(l.split("(0, ")[1].split(")")[0]): int(l.rsplit(": ", 1)[1]) for l in out.splitlines()
                          if l.startswith(" > number of parameters on (tensor, pipeline) model parallel rank")}
        lines = [l for l in out.splitlines() if re.match(r" \[[-0-9: .]+\] iteration ", l) and "lm loss" in l]
        # 48 samples / 8 per batch = 6 iterations, but the run exits after iteration 2 and saves it.
        assert len(lines) == 2 and "iteration        2/       6" in lines[1], lines
        losses[method] = [float(l.split("lm loss: ")[1].split(" ")[0]) for l in lines]
        summary = [l for l in out.splitlines() if l.startswith(" > training summary:")]
        assert len(summary) == 1 and summary[0].startswith(" > training summary: iterations 1-2 (2) | "
                                                           "consumed samples: 16 |"), summary
        assert out.index(summary[0]) > out.index(lines[1])
        assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
        assert "saving checkpoint at iteration       2 to" in out and "in torch_dist format" in out
        # --eval-interval 2: one validation batch after iteration 2 (the --exit-interval stop skips the final one).
        evals = [l for l in out.splitlines() if l.startswith(" validation loss at iteration")]
        assert len(evals) == 1 and evals[0].startswith(" validation loss at iteration 2 | lm loss value: "), \
            (method, out[-4000:], result.stderr[-2000:])
        valid[method] = float(evals[0].split("lm loss value: ")[1].split(" ")[0])
    assert losses["dynapipe"] == pytest.approx(losses["padding"], rel=2e-5)
    assert valid["dynapipe"] == pytest.approx(valid["padding"], rel=2e-5)
    # Each stage reports the parameters it holds: what the planner prices for that stage.
    model = parse_training_args(_megatron_gpt_argv(str(data), str(tmp_path)), 2).model.to_model_config()
    planned = {l.stage: stage_param_count(model, l) for l in stage_layouts(model, 2)}
    assert counts["padding"] == counts["dynapipe"] == planned


def test_transformer_engine_counts_as_available_only_where_megatron_core_can_build_its_spec(monkeypatch):
    # Transformer Engine's package imports its PyTorch half lazily: a wheel that does not match
    # torch imports, megatron-core's specs find no Transformer Engine, and its spec would fail
    # to build (the runs would fail instead of taking the local layers).
    import types

    import torch

    import megatron_integration.model as model_specs
    from megatron.core.models.gpt import gpt_layer_specs

    monkeypatch.setitem(sys.modules, "transformer_engine", types.ModuleType("transformer_engine"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpt_layer_specs, "HAVE_TE", False, raising=False)
    assert model_specs.te_available() is False
    monkeypatch.setattr(gpt_layer_specs, "HAVE_TE", True)
    assert model_specs.te_available() is True
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert model_specs.te_available() is False  # it needs CUDA


def test_query_key_layer_scaling_is_set_for_transformer_engine_every_time(monkeypatch):
    # megatron-core refuses a Transformer Engine attention whose config and this variable
    # disagree: a job building a model with the flag and then one without must not carry it over.
    from dataclasses import replace

    from megatron_integration.model import transformer_config

    monkeypatch.setenv("NVTE_APPLY_QK_LAYER_SCALING", "")  # restored (unset) after the test
    cfg = parse("--apply-query-key-layer-scaling")
    transformer_config(cfg.model, cfg.parallel, cuda=False)
    assert os.environ["NVTE_APPLY_QK_LAYER_SCALING"] == "1"
    transformer_config(replace(cfg.model, apply_query_key_layer_scaling=False), cfg.parallel, cuda=False)
    assert os.environ["NVTE_APPLY_QK_LAYER_SCALING"] == "0"


def test_legacy_tokenizer_is_accepted_and_changes_nothing():
    # Megatron-LM's flag for the tokenizers whose WordPiece ids this project builds (its default
    # path gives other ids): a run that passes it must parse, and train the same.
    assert parse("--legacy-tokenizer") == parse("")
