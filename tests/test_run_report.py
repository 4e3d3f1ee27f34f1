"""Start-up and end-of-run output in Megatron-LM's shape, and progress bars (no processes)."""
import argparse
import io
from types import SimpleNamespace

import pytest

from dynapipe.progress import Progress, bars_wanted
from megatron_integration.run_report import (argument_dump, parameter_count_line, resolved_args,
                                             t5_resolved_args, training_summary_lines)


def test_argument_dump_is_megatrons_block():
    # A "_" name is the parser's own bookkeeping (which file a data list came from), not an argument.
    args = argparse.Namespace(num_layers=2, Zeta="z", hidden_size=64, use_dynapipe=True, data_path=["a", "b"],
                              _per_split_flag="--per-split-data-args-path s.json")
    lines = argument_dump(args)
    assert lines[0] == "------------------------ arguments ------------------------"
    assert lines[-1] == "-------------------- end of arguments ---------------------"
    body = lines[1:-1]
    # Sorted case-insensitively, names dotted out to one column, values as Python prints them.
    assert [l.split()[0] for l in body] == ["data_path", "hidden_size", "num_layers", "use_dynapipe", "Zeta"]
    assert body[1] == "  hidden_size " + "." * 37 + " 64"
    assert body[0].endswith(" ['a', 'b']") and body[3].endswith(" True")
    assert len({l.index(" ", 2 + len(l.split()[0]) + 1) for l in body}) == 1  # values start in one column


def test_parameter_count_line():
    assert parameter_count_line(1, 3, 123456) == \
        " > number of parameters on (tensor, pipeline) model parallel rank (1, 3): 123456"


def test_training_summary_counts_the_run():
    r = SimpleNamespace(real_tokens=300, padded_tokens=400, loss_tokens=290, skipped=False)
    stamp, summary = training_summary_lines([r, r, SimpleNamespace(**{**vars(r), "skipped": True})], 4, 56, 2.0)
    assert stamp.startswith("[after training is done] datetime: ")
    assert summary == (" > training summary: iterations 5-7 (3) | consumed samples: 56 | real tokens: 900 | "
                       "padded tokens: 1200 | loss tokens: 870 | skipped iterations: 1 | time (s): 2.0 | "
                       "elapsed time per iteration (ms): 666.7 | real tokens/s: 450.0 | padding efficiency: 0.750")
    # Resumed at or past --train-iters: says so, not "iterations 4-3 (0)".
    assert training_summary_lines([], 3, 12, 0.1)[1] == (" > training summary: no iteration left to train "
                                                         "(resumed at iteration 3) | consumed samples: 12")


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_is_plain_lines_off_a_terminal(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    out = io.StringIO()
    with Progress(2, "profiling", stream=out) as bar:
        assert bar.bar is None
        bar.step("first")
        bar.step("second")
    assert out.getvalue() == "first\nsecond\n"


def test_progress_bar_on_a_terminal_and_switches(monkeypatch):
    pytest.importorskip("tqdm")
    monkeypatch.setenv("RANK", "0")
    term = Terminal()
    assert bars_wanted(True, term) and not bars_wanted(False, term) and not bars_wanted(True, io.StringIO())
    with Progress(2, "profiling", stream=term) as bar:
        assert bar.bar is not None
        bar.step("first")
        bar.step("second")
    text = term.getvalue()
    # The lines above a drawn bar (carriage returns redraw it; tqdm throttles redraws).
    assert "first\n" in text and "second\n" in text and "\rprofiling:" in text and "/2 [" in text
    # --no-progress: plain lines even on a terminal.
    term = Terminal()
    with Progress(1, "profiling", enabled=False, stream=term) as bar:
        bar.step("only")
    assert term.getvalue() == "only\n"
    # Other ranks of a job draw and print nothing.
    monkeypatch.setenv("RANK", "1")
    term = Terminal()
    assert not bars_wanted(True, term)
    with Progress(1, "profiling", stream=term) as bar:
        bar.step("line")
    assert term.getvalue() == ""


def test_progress_steps_announced_before_they_end(monkeypatch):
    """The bench's long steps: announced, then completed on the same line (plain), or shown as the
    bar's label and written whole above it (terminal)."""
    monkeypatch.setenv("RANK", "0")
    out = io.StringIO()
    with Progress(2, "bench", stream=out) as bar:
        bar.begin("round 1/1: training padding on 2 rank(s) ...")
        bar.step("12 s")
        bar.step("plain")
    assert out.getvalue() == "round 1/1: training padding on 2 rank(s) ... 12 s\nplain\n"
    pytest.importorskip("tqdm")
    term = Terminal()
    with Progress(1, "bench", stream=term) as bar:
        bar.begin("round 1/1: training dynapipe ...")
        bar.step("3 s")
    assert "\rround 1/1: training dynapipe ...: " in term.getvalue()  # the label while it runs
    assert "round 1/1: training dynapipe ... 3 s\n" in term.getvalue()


def test_dump_shows_values_validation_derived():
    from megatron_integration.arguments import build_parser, training_config_from_args

    argv = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 128 --micro-batch-size 2 "
            "--global-batch-size 8 --lr 1e-3 --mock-data --train-samples 80 --swiglu --vocab-size 50257").split()
    args = build_parser().parse_args(argv)
    cfg = training_config_from_args(args, 2, cuda=False)
    text = "\n".join(argument_dump(resolved_args(args, cfg)))
    for name, value in (("ffn_hidden_size", 128), ("kv_channels", 16), ("padded_vocab_size", 50304),
                        ("train_iters", 10), ("data_parallel_size", 2), ("max_position_embeddings", 128)):
        assert f"  {name} {'.' * (48 - len(name))} {value}\n" in text + "\n", name


def test_dump_holds_what_megatron_lms_validation_leaves_under_its_names():
    from megatron_integration.arguments import build_parser, training_config_from_args
    from megatron_integration.megatron_resolved import megatron_resolved_args

    argv = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 128 --micro-batch-size 2 "
            "--global-batch-size 8 --lr 1e-3 --mock-data --train-iters 4 --vocab-size 512 --recompute-activations "
            "--weight-decay 0.05 --no-bias-dropout-fusion --norm-epsilon 1e-6").split()
    args = build_parser().parse_args(argv)
    assert args.check_for_nan_in_loss_and_grad is None and args.eval_iters is None  # resolved by validation
    dumped = vars(resolved_args(args, training_config_from_args(args, 1, cuda=False)))
    expected = dict(recompute_granularity="selective", check_for_nan_in_loss_and_grad=True, eval_iters=100,
                    rerun_mode="validate_results", overlap_p2p_comm=False, encoder_num_layers=2, encoder_seq_length=128,
                    start_weight_decay=0.05, end_weight_decay=0.05, add_bias_linear=True, add_qkv_bias=True,
                    bias_dropout_fusion=False, masked_softmax_fusion=True, layernorm_epsilon=1e-6,
                    use_dist_ckpt=True, transformer_impl="local")  # Megatron-LM's default names TE: not on CPUs
    assert args.transformer_impl == "transformer_engine"
    assert {k: dumped.get(k) for k in expected} == expected
    # Megatron-LM deletes the shorthand and holds no negative spellings.
    for gone in ("recompute_activations", "disable_bias_linear", "no_bias_dropout_fusion", "norm_epsilon"):
        assert gone not in dumped, gone
    # A lone --data-path without --split: Megatron-LM's legacy split.
    cfg = training_config_from_args(args, 1, cuda=False)
    assert megatron_resolved_args({"data_path": ["x"], "split": None}, cfg)["split"] == "969, 30, 1"
    assert megatron_resolved_args({"data_path": ["x"], "split": "1,0,0"}, cfg)["split"] == "1,0,0"
    assert megatron_resolved_args({"data_path": None, "split": None}, cfg)["split"] is None


def test_t5_dump_names_lengths_and_depths_as_megatron_lm_resolves_them():
    """Whichever spelling was typed (--num-layers or --encoder-num-layers, --seq-length or
    --encoder-seq-length), Megatron-LM's validation leaves both set to the encoder's."""
    from megatron_integration.t5_arguments import build_t5_parser, t5_config_from_args

    argv = ("--encoder-num-layers 3 --decoder-num-layers 1 --hidden-size 64 --num-attention-heads 4 "
            "--seq-length 96 --decoder-seq-length 160 --micro-batch-size 2 --global-batch-size 8 --lr 1e-3 "
            "--mock-data --train-iters 2 --vocab-size 512").split()
    args = build_t5_parser().parse_args(argv)
    assert args.num_layers is None and args.encoder_seq_length is None  # as typed
    text = "\n".join(argument_dump(t5_resolved_args(args, t5_config_from_args(args, 1, cuda=False)))) + "\n"
    for name, value in (("num_layers", 3), ("encoder_num_layers", 3), ("decoder_num_layers", 1),
                        ("seq_length", 96), ("encoder_seq_length", 96), ("decoder_seq_length", 160),
                        ("max_position_embeddings", 160), ("ffn_hidden_size", 256), ("kv_channels", 16),
                        ("transformer_impl", "local")):  # T5's stages are megatron-core's local layers
        assert f"  {name} {'.' * (48 - len(name))} {value}\n" in text, name


def test_interval_loss_is_megatrons_mean_of_the_steps_that_ran_and_the_clock_pauses():
    import time as _time

    from megatron_integration.baseline_step import StepResult
    from megatron_integration.logging_utils import IntervalStats, TrainingLogger, format_log_line

    stats = IntervalStats()
    for loss, tokens, skipped in ((4.0, 10, False), (2.0, 1000, False), (9.0, 5, True)):
        stats.add(StepResult(loss=loss, loss_tokens=tokens, real_tokens=1, padded_tokens=1, iteration_ms=1.0,
                             skipped=skipped))
    line = format_log_line(3, 3, 12, stats, 1.0, 1e-3, 4)
    assert "lm loss: 3.000000E+00 |" in line  # (4 + 2) / 2: not token-weighted, the skipped step left out
    only_skipped = IntervalStats()
    only_skipped.add(StepResult(loss=9.0, loss_tokens=5, real_tokens=1, padded_tokens=1, iteration_ms=1.0,
                                skipped=True))
    assert "lm loss" not in format_log_line(1, 1, 4, only_skipped, 1.0, 1e-3, 4)
    only_skipped.add(StepResult(loss=float("nan"), loss_tokens=5, real_tokens=1, padded_tokens=1, iteration_ms=1.0,
                                skipped=True))
    assert "number of skipped iterations:   2 | number of nan iterations:   1 |" in format_log_line(
        2, 2, 8, only_skipped, 1.0, 1e-3, 4)
    # Evaluation and checkpoints inside an interval are not iteration time.
    logger = TrainingLogger(2, 4, 2, is_logging_rank=False)
    step = StepResult(loss=1.0, loss_tokens=1, real_tokens=1, padded_tokens=1, iteration_ms=1.0)
    logger.record(1, 4, step, 1e-3)
    with logger.paused():
        _time.sleep(0.3)
    line = logger.record(2, 8, step, 1e-3)
    ms = float(line.split("elapsed time per iteration (ms):")[1].split("|")[0])
    assert ms < 100, line


def test_an_exit_interval_stop_is_stamped_as_megatron_stamps_it():
    r = SimpleNamespace(real_tokens=3, padded_tokens=4, loss_tokens=2, skipped=False)
    stamp, _ = training_summary_lines([r, r], 2, 16, 1.0, exited=True)
    assert stamp.startswith("[exiting program at iteration 4] datetime: ")


def test_a_rank_writes_each_line_in_one_call():
    # The ranks share the job's stdout; unbuffered (PYTHONUNBUFFERED), print() would pass the text
    # and its newline on as two writes, and another rank's line could land between them.
    import io

    from megatron_integration.run_report import write_line

    class Recording(io.StringIO):
        def __init__(self):
            super().__init__()
            self.calls = []

        def write(self, s):
            self.calls.append(s)
            return super().write(s)

    out = Recording()
    write_line(out, " validation loss at iteration 2 | lm loss value: 1.0 |")
    assert out.calls == [" validation loss at iteration 2 | lm loss value: 1.0 |\n"]


def test_training_script_wrapper_dumps_warns_and_turns_errors_into_one_line(capsys, monkeypatch):
    from dynapipe.errors import DynaPipeError
    from megatron_integration.arguments import build_parser, training_config_from_args
    from megatron_integration.script_main import run_training_script

    argv = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 128 --micro-batch-size 2 "
            "--global-batch-size 8 --lr 1e-3 --train-iters 4 --vocab-size 512 --data-path 1 a").split()
    args = build_parser().parse_args(argv)
    args.data_path = ["1", "a"]  # the file is never read: the config is built from the mock data's flags
    cfg = training_config_from_args(build_parser().parse_args(argv[:-3] + ["--mock-data"]), 1, cuda=False)
    import megatron_integration.initialize as initialize

    trained, destroyed = [], []
    # This process's own torch.distributed state (another test's) is not the wrapper's to tear down.
    monkeypatch.setattr(initialize, "destroy", lambda failed: destroyed.append(failed))
    monkeypatch.setenv("RANK", "0")
    assert run_training_script(lambda: (args, cfg), lambda c: 1.0, argv, resolved_args, trained.append) == 0
    out, err = capsys.readouterr()
    assert trained == [cfg] and out.count("------------------------ arguments ------------------------") == 1
    assert "  split ........................................... 969, 30, 1\n" in out
    assert err == 'WARNING: Please specify --split when using --data-path. Using legacy default value of "969, 30, 1"\n'
    # Another rank prints neither; a refused input is one line and exit status 2.
    monkeypatch.setenv("RANK", "1")

    def refuse(_):
        raise DynaPipeError("--global-batch-size 7 is not a multiple of\n  4; use 8.")

    assert run_training_script(lambda: (args, cfg), lambda c: 1.0, argv, resolved_args, refuse) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == "error: --global-batch-size 7 is not a multiple of 4; use 8.\n"
    assert destroyed == [False, True]  # torn down after training either way, as a failure the second time
