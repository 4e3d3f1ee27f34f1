"""``--result-rejected-tracker-filename``: the lines written, as Megatron-LM writes them, and the
iterations a later job skips by them. The lines of real runs (a NaN reproduced in place and on
other devices, then skipped) are checked in ``test_failsafe_faults.py``."""
import math
import os

import pytest
import torch

from dynapipe.errors import DynaPipeError
from megatron_integration.rerun import ResultValidator
from megatron_integration.rerun_settings import RerunSettings
from megatron_integration.rerun_tracker import (Rejection, TrackedSkips, append, check_appendable, read_skips,
                                                same_skips_everywhere, tracked_skips)


def megatron_line(job: str, rank: int, iteration: int, status: str) -> str:
    # As Megatron-LM's RerunStateMachine writes them on a GPU (the result a tensor's repr).
    return (f"ts=2026-11-02 08:15:42.123456 node=gpu-node-{rank // 8} device={rank % 8} jobID={job} rank={rank} "
            f"iteration={iteration} status=RerunValidationStatus.{status} result=tensor(nan, device='cuda:{rank % 8}') "
            f"message='loss'\n")


def test_an_iteration_reproduced_twice_on_one_rank_is_skipped_as_megatron_lm_decides(tmp_path):
    path = tmp_path / "tracker.log"
    path.write_text("".join([
        # Reproduced in place (job 100, exit 16), then on other devices (job 101): skipped.
        megatron_line("100", 3, 12, "INITIAL_RUN"), megatron_line("100", 3, 12, "FIRST_RERUN_REPRODUCIBLE"),
        megatron_line("101", 3, 12, "SECOND_RERUN_REPRODUCIBLE"),
        # Reruns disabled, failed on the same rank in two jobs: skipped.
        megatron_line("102", 5, 40, "RERUN_DISABLED"), "\n", megatron_line("103", 5, 40, "rerun_disabled"),
        # Two ranks of one job: a fault of the whole run, not skipped however often it recurs.
        megatron_line("104", 0, 20, "RERUN_DISABLED"), megatron_line("104", 1, 20, "RERUN_DISABLED"),
        megatron_line("105", 0, 20, "RERUN_DISABLED"),
        # Not reproduced, or only the initial run: a device's fault, never skipped.
        megatron_line("106", 2, 30, "FIRST_RERUN_NOT_REPRODUCIBLE"),
        megatron_line("107", 2, 30, "SECOND_RERUN_NOT_REPRODUCIBLE"),
        megatron_line("106", 2, 31, "INITIAL_RUN"), megatron_line("107", 2, 31, "INITIAL_RUN"),
        # Once only: not yet.
        megatron_line("108", 4, 50, "FIRST_RERUN_REPRODUCIBLE"),
    ]))
    skips = read_skips(str(path))
    assert skips == TrackedSkips(str(path), skip=(12, 40), not_skipped=(20,))
    assert skips.lines() == [
        f"--result-rejected-tracker-filename {path}: skipping iterations [12, 40], each rejected twice on one rank "
        f"with a result that reproduced",
        f"--result-rejected-tracker-filename {path}: not skipping iterations [20], rejected on several ranks of one "
        f"job"]
    assert read_skips(str(tmp_path / "missing.log")) == TrackedSkips(str(tmp_path / "missing.log"))
    assert TrackedSkips("x").lines() == []


def test_a_line_out_of_the_tracker_format_is_refused_by_its_number(tmp_path):
    path = tmp_path / "tracker.log"
    path.write_text(megatron_line("1", 0, 2, "INITIAL_RUN") + "ts=2026 node=a truncated\n")
    with pytest.raises(DynaPipeError, match=r"tracker.log, line 2: not a tracker line \('ts=2026 node=a truncated'\); "
                                            r"correct or remove the line"):
        read_skips(str(path))
    path.write_text(megatron_line("1", 0, 2, "INITIAL_RUN").replace("iteration=2", "iteration=two"))
    with pytest.raises(DynaPipeError, match=r"line 1: rank '0' or iteration 'two' is not a whole number"):
        read_skips(str(path))
    path.write_text(megatron_line("1", 0, 2, "THIRD_RERUN"))
    with pytest.raises(DynaPipeError, match=r"line 1: status 'THIRD_RERUN' is none of RERUN_DISABLED, INITIAL_RUN"):
        read_skips(str(path))


def test_a_tracker_that_cannot_be_appended_to_is_refused_and_a_missing_one_is_created(tmp_path):
    with pytest.raises(DynaPipeError, match=rf"--result-rejected-tracker-filename {tmp_path}: cannot append to it"):
        check_appendable(str(tmp_path))
    fresh = tmp_path / "fresh.log"
    assert tracked_skips(str(fresh)) == TrackedSkips(str(fresh)) and fresh.exists()
    assert tracked_skips(None) is None


def test_appended_lines_are_read_back_with_the_job_id(tmp_path, monkeypatch):
    path = str(tmp_path / "tracker.log")
    monkeypatch.setenv("SLURM_JOBID", "4711")
    append(path, 7, "FIRST_RERUN_REPRODUCIBLE", [Rejection(1, "n1", 0, math.nan, "loss")])
    monkeypatch.delenv("SLURM_JOBID")
    append(path, 7, "SECOND_RERUN_REPRODUCIBLE", [Rejection(1, "n2", 3, math.nan, "loss")])
    append(path, 8, "INITIAL_RUN", [])  # nothing rejected: nothing written
    lines = open(path).read().splitlines()
    assert len(lines) == 2
    assert " node=n1 device=0 jobID=4711 rank=1 iteration=7 status=RerunValidationStatus.FIRST_RERUN_REPRODUCIBLE " \
           "result=nan message='loss'" in lines[0]
    assert " jobID=N/A rank=1 iteration=7 " in lines[1]
    assert read_skips(path).skip == (7,)
    with pytest.raises(ValueError, match="unknown tracker status"):
        append(path, 7, "REPRODUCED", [Rejection(1, "n1", 0, 1.0, "loss")])


def test_ranks_that_read_different_trackers_are_refused():
    same_skips_everywhere([("/shared/t.log", (4,)), ("/shared/t.log", (4,))])
    with pytest.raises(DynaPipeError, match=r"rank 0 skips iterations \[4\] \(/local/t.log\) and rank 1 \[\] "
                                            r"\(/local/t.log\); the ranks read different files. Name one file on a "
                                            r"filesystem every rank reads"):
        same_skips_everywhere([("/local/t.log", (4,)), ("/local/t.log", ())])


def _validator(tmp_path, **settings):
    path = str(tmp_path / "tracker.log")
    module = torch.nn.Linear(1, 1, bias=False)
    validator = ResultValidator(RerunSettings(result_rejected_tracker_filename=path, **settings), check=True,
                                module=module, device=torch.device("cpu"))

    def feed(loss: float, grad: float):
        def forward_backward():
            module.weight.grad = torch.full((1, 1), grad)
            return loss
        return forward_backward
    return validator, feed, path


def _statuses(path: str) -> list[tuple]:
    if not os.path.exists(path):
        return []
    import re

    return [re.search(r"rank=(\d+) iteration=(\d+) status=RerunValidationStatus\.(\w+) result=(\S+) message='(.*)'",
                      line).groups() for line in open(path)]


def test_the_validator_records_each_rejection_with_its_status(tmp_path):
    from megatron_integration.nan_guard import NonFiniteError

    # validate_results: the initial run's line and the rerun's outcome, the loss named.
    validator, feed, path = _validator(tmp_path)
    assert validator.run(0, feed(1.0, 1.0)) is None
    verdict = validator.run(1, feed(math.nan, 1.0))
    assert verdict.exit_code == 16
    assert _statuses(path) == [("0", "2", "INITIAL_RUN", "nan", "loss"),
                               ("0", "2", "FIRST_RERUN_REPRODUCIBLE", "nan", "loss")]
    # A gradient norm alone, not reproduced in place: 17, said as such.
    os.remove(path)
    validator, feed, path = _validator(tmp_path)
    validator.run(0, feed(1.0, 1.0))
    grads = iter([math.inf, 2.0])

    def flaky():
        validator.module.weight.grad = torch.full((1, 1), next(grads))
        return 1.0
    assert validator.run(1, flaky).exit_code == 17
    assert _statuses(path) == [("0", "2", "INITIAL_RUN", "inf", "gradient norm"),
                               ("0", "2", "FIRST_RERUN_NOT_REPRODUCIBLE", "2.0", "gradient norm")]
    # Disabled: the stop is recorded as Megatron-LM's rerun_disabled.
    os.remove(path)
    validator, feed, path = _validator(tmp_path, rerun_mode="disabled")
    with pytest.raises(NonFiniteError):
        validator.run(0, feed(math.inf, 1.0))
    assert _statuses(path) == [("0", "1", "RERUN_DISABLED", "inf", "loss")]


def test_spikes_are_recorded_once_a_rank_and_an_unwritable_tracker_only_warns(tmp_path, monkeypatch):
    import megatron_integration.rerun_stats as rerun_stats

    monkeypatch.setattr(rerun_stats, "LARGE_VALUE_SAMPLES", 2)
    validator, feed, path = _validator(tmp_path, check_for_spiky_loss=True, check_for_large_grads=True)
    for i in range(3):
        validator.run(i, feed(1.0, 1.0))
    assert validator.run(3, feed(20.0, 20.0)) is None  # both spike, reproduced: training goes on
    assert _statuses(path) == [("0", "4", "INITIAL_RUN", "20.0", "loss"),
                               ("0", "4", "FIRST_RERUN_REPRODUCIBLE", "20.0", "loss")]
    lines = []
    validator.log = lines.append
    os.remove(path)
    os.makedirs(path)  # the file became a directory: the write fails, the run goes on
    assert validator.run(4, feed(30.0, 1.0)) is None
    assert any(line.startswith(f"warning: --result-rejected-tracker-filename {path}: could not record the rejected "
                               f"result of iteration 5") and "iteration=5 status=RerunValidationStatus.INITIAL_RUN"
               in line for line in lines)


def test_the_resumed_diagnosis_first_iterations_injections_and_report_stats_are_recorded_as_megatron_lm(tmp_path):
    from megatron_integration.nan_guard import NonFiniteError

    record = {"iteration": 2, "rejected": [0], "reproduced": [0], "values": [[1.0, math.nan, 1.0, 0.0]],
              "places": [["another-node", 0]], "layout": {}, "what": "iteration 2: the loss is NaN"}
    # Resumed elsewhere: reproduced (the run diverged), then not (the first devices were faulty).
    for loss, status, result in ((math.nan, "SECOND_RERUN_REPRODUCIBLE", "nan"),
                                 (3.0, "SECOND_RERUN_NOT_REPRODUCIBLE", "3.0")):
        validator, feed, path = _validator(tmp_path)
        validator.resume = dict(record)
        assert validator.run(1, feed(loss, 1.0)).exit_code == 17
        assert _statuses(path) == [("0", "2", status, result, "loss")]
        os.remove(path)
    # A job's first iteration stops unchecked here (Megatron-LM lets it through): rerun_disabled.
    validator, feed, path = _validator(tmp_path)
    with pytest.raises(NonFiniteError):
        validator.run(4, feed(math.nan, 1.0))
    assert _statuses(path) == [("0", "5", "RERUN_DISABLED", "nan", "loss")]
    os.remove(path)
    # report_stats rejects nothing in Megatron-LM: its stop records nothing.
    validator, feed, path = _validator(tmp_path, rerun_mode="report_stats")
    validator.run(0, feed(1.0, 1.0))
    with pytest.raises(NonFiniteError):
        validator.run(1, feed(math.nan, 1.0))
    assert _statuses(path) == []
    # An injected transient error: named as injected, not reproduced in place.
    validator, feed, path = _validator(tmp_path, error_injection_rate=1)
    validator.run(0, feed(1.5, 1.0))
    assert validator.run(1, feed(1.5, 1.0)).exit_code == 17
    assert _statuses(path) == [("0", "2", "INITIAL_RUN", "1.5", "injected transient_error"),
                               ("0", "2", "FIRST_RERUN_NOT_REPRODUCIBLE", "1.5", "injected transient_error")]


def test_spikes_not_reproduced_or_under_disabled_are_recorded_once_a_rank(tmp_path, monkeypatch):
    import megatron_integration.rerun_stats as rerun_stats

    monkeypatch.setattr(rerun_stats, "LARGE_VALUE_SAMPLES", 2)
    validator, feed, path = _validator(tmp_path, check_for_large_grads=True)
    for i in range(3):
        validator.run(i, feed(1.0, 1.0))
    grads = iter([50.0, 5.0])

    def flaky():
        validator.module.weight.grad = torch.full((1, 1), next(grads))
        return 1.0
    assert validator.run(3, flaky) is None
    assert _statuses(path) == [("0", "4", "INITIAL_RUN", "50.0", "gradient norm"),
                               ("0", "4", "FIRST_RERUN_NOT_REPRODUCIBLE", "5.0", "gradient norm")]
    os.remove(path)
    validator, feed, path = _validator(tmp_path, rerun_mode="disabled", check_for_spiky_loss=True,
                                       check_for_large_grads=True)
    for i in range(2):
        validator.run(i, feed(1.0, 1.0))
    assert validator.run(2, feed(30.0, 30.0)) is None
    assert _statuses(path) == [("0", "3", "RERUN_DISABLED", "30.0", "loss")]
