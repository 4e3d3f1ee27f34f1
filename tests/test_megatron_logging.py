"""Megatron-format log lines: averaged over the interval, printed only by the logging rank."""
import io
import re

from megatron_integration.logging_utils import TrainingLogger
from megatron_integration.baseline_step import StepResult


def result(loss, tokens, ms, wait=0.0):
    return StepResult(loss=loss, loss_tokens=tokens, real_tokens=1000, padded_tokens=2000, iteration_ms=ms,
                      grad_norm=0.5, plan_wait_ms=wait, consumed_samples=0)


def test_interval_averages_and_format():
    out = io.StringIO()
    log = TrainingLogger(train_iters=5, global_batch_size=8, log_interval=2, is_logging_rank=True, stream=out)
    assert log.record(1, 8, result(2.0, 100, 10.0, wait=1.0), lr=1e-3) is None
    line = log.record(2, 16, result(4.0, 300, 10.0, wait=3.0), lr=1e-3)
    # Megatron-LM's interval loss: the mean of the iterations' losses, (2 + 4) / 2, not
    # token-weighted ((2*100 + 4*300) / 400 = 3.5).
    assert "lm loss: 3.000000E+00" in line
    assert "iteration        2/       5" in line and "consumed samples:           16" in line
    # Megatron-LM's wall-clock stamp first, its NaN count last.
    assert re.match(r" \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6}\] iteration        2/       5 \|", line), line
    assert line.endswith("number of skipped iterations:   0 | number of nan iterations:   0 |")
    assert "padding efficiency: 0.500" in line and "plan wait (ms): 2.00" in line
    assert "learning rate: 1.000000E-03" in line and "global batch size:     8" in line
    assert out.getvalue().strip() == line.strip()
    assert "truncated samples" not in line
    # The last iteration always logs, even off the interval; truncated samples come from the results.
    last = result(1.0, 10, 10.0)
    last.truncated = 3
    line = log.record(5, 40, last, lr=1e-3)
    assert line is not None and "truncated samples: 3" in line


def test_global_batch_size_is_the_last_iterations_under_a_token_budget():
    # A token budget (--dynapipe-tokens-per-global-batch) makes each iteration's sample count
    # differ from --global-batch-size; the line says the iteration's own, as Megatron-LM prints
    # its current global batch size. A resumed run counts from the checkpoint's samples.
    out = io.StringIO()
    log = TrainingLogger(4, 10, 1, is_logging_rank=True, stream=out, consumed_samples=100)
    assert "global batch size:    11" in log.record(1, 111, result(2.0, 10, 1.0), lr=1e-3)
    assert "global batch size:     9" in log.record(2, 120, result(2.0, 10, 1.0), lr=1e-3)
    fresh = TrainingLogger(4, 10, 1, is_logging_rank=True, stream=io.StringIO())
    assert "global batch size:    12" in fresh.record(1, 12, result(2.0, 10, 1.0), lr=1e-3)


def test_only_the_logging_rank_prints_and_missing_tensorboard_is_a_warning(tmp_path, capsys, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_tensorboard(name, *args, **kwargs):
        if name.startswith("torch.utils.tensorboard"):
            raise ImportError("No module named 'tensorboard'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    out = io.StringIO()
    log = TrainingLogger(2, 8, 1, is_logging_rank=True, tensorboard_dir=str(tmp_path), stream=out)
    assert log.writer is None and "TensorBoard is unavailable" in capsys.readouterr().err
    silent = io.StringIO()
    quiet = TrainingLogger(2, 8, 1, is_logging_rank=False, stream=silent)
    assert quiet.record(1, 8, result(1.0, 10, 5.0), lr=0.1) is not None
    assert silent.getvalue() == ""


def test_memory_report_line_is_megatrons():
    from megatron_integration.logging_utils import memory_report_line

    line = memory_report_line(3, 10, {"allocated": 1024.5, "max_allocated": 3072.25, "reserved": 4096.0,
                                      "max_reserved": 5120.0})
    # Megatron-LM's report_memory, field for field, so the tools that read its logs read this one.
    fields = re.fullmatch(r"\[Rank (\d+)\] \(after (\d+) iterations\) memory \(MB\) \| allocated: ([\d.]+) \| "
                          r"max allocated: ([\d.]+) \| reserved: ([\d.]+) \| max reserved: ([\d.]+)", line)
    assert fields is not None, line
    assert [float(v) for v in fields.groups()] == [3, 10, 1024.5, 3072.25, 4096.0, 5120.0]
    # The device's own count, as Megatron-LM appends it where torch can read it.
    line = memory_report_line(0, 2, {"allocated": 1.0, "max_allocated": 2.0, "reserved": 4.0, "max_reserved": 4.0,
                                     "device_usage": 4600.5})
    assert line.endswith("| max reserved: 4.0 | device usage: 4600.5"), line


def test_skipped_iterations_are_counted_and_a_skipped_last_iteration_leaves_its_interval_logged():
    # --iterations-to-skip: a skipped batch adds to the consumed and skipped samples, not to the next
    # iteration's global batch; when --train-iters' own iteration is skipped, the open interval is
    # logged at the last trained iteration.
    out = io.StringIO()
    log = TrainingLogger(train_iters=4, global_batch_size=8, log_interval=10, is_logging_rank=True, stream=out)
    assert log.flush(lr=1e-3) is None  # nothing recorded yet
    assert log.record(1, 8, result(2.0, 100, 10.0), lr=1e-3) is None
    log.skip(16)
    assert log.record(3, 24, result(4.0, 100, 10.0), lr=1e-3) is None
    log.skip(32)
    line = log.flush(lr=1e-3)
    assert "iteration        3/       4 | consumed samples:           24 | skipped samples:           16 |" in line
    assert "global batch size:     8" in line and "lm loss: 3.000000E+00" in line
    assert log.flush(lr=1e-3) is None  # logged once
