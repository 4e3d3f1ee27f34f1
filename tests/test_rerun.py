"""The rerun state machine's parts that need no process group: how results are compared, what an
injected error turns out to be, the determinism statistics, and the settings' refusals. The runs
themselves (a NaN computed again, injected errors, a resumed diagnosis, report_stats) are in
``test_failsafe_faults.py``."""
import math

import pytest
import torch

from dynapipe.errors import DynaPipeError
from megatron_integration.rerun import ResultValidator, _rejected, _reproduced
from megatron_integration.rerun_stats import GRAD_NORM_TOLERANCE, QuickStats, compare
from megatron_integration.rerun_settings import RerunSettings


def test_results_compare_as_megatron_lm_compares_them():
    assert compare(2.0, 2.0) == 0.0 and compare(math.nan, math.nan) == 0.0
    assert compare(math.inf, math.inf) == 0.0
    assert compare(math.nan, 1.0) == math.inf and compare(1.0, math.inf) == math.inf
    assert compare(1.0, 1.002) == pytest.approx(0.002 / 1.001)


def test_a_rank_is_rejected_for_a_non_finite_loss_or_norm_or_an_injected_error():
    # [has a loss, loss sum, gradient norm, injected] a rank.
    values = torch.tensor([[0.0, 0.0, 3.0, 0.0], [1.0, math.nan, 2.0, 0.0], [0.0, 0.0, math.inf, 0.0],
                           [1.0, 5.0, 1.0, 1.0], [1.0, 5.0, 1.0, 0.0]], dtype=torch.float64)
    assert _rejected(values) == [1, 2, 3]


def test_reproduction_allows_megatron_lms_gradient_norm_tolerance_and_none_on_the_loss():
    first = torch.tensor([1.0, math.nan, 4.0, 0.0], dtype=torch.float64)
    assert _reproduced(first, first.clone(), None, "in_place")
    near = torch.tensor([1.0, math.nan, 4.0 * (1 + GRAD_NORM_TOLERANCE / 2), 0.0], dtype=torch.float64)
    assert _reproduced(first, near, None, "in_place")
    far = torch.tensor([1.0, math.nan, 4.0 * (1 + 3 * GRAD_NORM_TOLERANCE), 0.0], dtype=torch.float64)
    assert not _reproduced(first, far, None, "in_place")
    finite_loss = torch.tensor([1.0, 2.5, 4.0, 0.0], dtype=torch.float64)
    assert not _reproduced(first, finite_loss, None, "in_place")
    # A rank without a loss is judged by its gradient norm only.
    no_loss = torch.tensor([0.0, 0.0, math.inf, 0.0], dtype=torch.float64)
    assert _reproduced(no_loss, no_loss.clone(), None, "elsewhere")


def test_an_injected_error_turns_out_as_its_type_says():
    values = torch.tensor([1.0, 2.0, 3.0, 1.0], dtype=torch.float64)
    outcomes = {kind: (_reproduced(values, values, kind, "in_place"), _reproduced(values, values, kind, "elsewhere"))
                for kind in ("transient_error", "persistent_error", "correct_result")}
    # Transient: not reproduced in place. Persistent: reproduced in place, not elsewhere. Correct: both.
    assert outcomes == {"transient_error": (False, True), "persistent_error": (True, False),
                        "correct_result": (True, True)}


def test_determinism_statistics_count_identical_results_and_spread_the_rest():
    stats = QuickStats()
    assert stats.line() == "0 samples, all identical"
    for diff in (0.0, 0.0, 1e-3, 2e-3):
        stats.record(diff)
    line = stats.line()
    assert line.startswith("4/2 total/identical samples, rel. variability: avg= 7.500E-04")
    assert line.endswith("max: 2.000E-03")


def test_a_run_without_the_check_computes_once_and_never_stops():
    calls = []
    module = torch.nn.Linear(2, 2)
    module.weight.grad = torch.full((2, 2), math.nan)
    validator = ResultValidator(RerunSettings(), check=False, module=module, device=torch.device("cpu"))
    assert validator.run(3, lambda: calls.append(1) or math.nan) is None
    assert calls == [1]


def test_one_rank_reruns_and_reports_a_transient_fault_without_a_process_group():
    """One rank: a loss that is NaN at first and finite when computed again is a transient fault."""
    module = torch.nn.Linear(2, 2)
    module.weight.grad, module.bias.grad = torch.ones(2, 2), torch.ones(2)
    losses = iter([1.0, math.nan, 2.0])
    lines = []
    validator = ResultValidator(RerunSettings(), check=True, module=module, device=torch.device("cpu"),
                                log=lines.append)
    assert validator.run(0, lambda: next(losses)) is None
    verdict = validator.run(1, lambda: next(losses))
    assert verdict.exit_code == 17 and verdict.checkpoint and verdict.record is None
    assert verdict.message.startswith("iteration 2: the loss is NaN or infinite on rank 0, and computing it again")
    assert lines == ["iteration 2: result rejected on rank 0; computing the iteration again on the same devices to "
                     "check whether it reproduces"]


def test_the_first_iteration_of_a_job_stops_without_a_rerun():
    from megatron_integration.nan_guard import NonFiniteError

    module = torch.nn.Linear(2, 2)
    module.weight.grad, module.bias.grad = torch.ones(2, 2), torch.ones(2)
    validator = ResultValidator(RerunSettings(), check=True, module=module, device=torch.device("cpu"))
    with pytest.raises(NonFiniteError, match="^iteration 1: the loss is NaN .* not computed again"):
        validator.run(0, lambda: math.inf)


@pytest.mark.parametrize("kwargs, said", [
    (dict(rerun_mode="sometimes"), "rerun_mode='sometimes': choose one of disabled, validate_results, report_stats"),
    (dict(error_injection_type="flaky"), "error_injection_type='flaky': choose one of correct_result"),
    (dict(error_injection_rate=-1), "error_injection_rate=-1: give a whole number, at least 0"),
    (dict(error_injection_rate=2.5), "error_injection_rate=2.5: give a whole number"),
    (dict(rerun_mode="report_stats", error_injection_rate=4),
     "error_injection_rate=4 with rerun_mode='report_stats': injected errors are diagnosed by "
     "rerun_mode='validate_results' only"),
])
def test_settings_refuse_what_no_mode_does(kwargs, said):
    with pytest.raises(DynaPipeError) as e:
        RerunSettings(**kwargs)
    assert said in str(e.value)


def _record_dir(tmp_path, record: dict) -> str:
    import json

    from megatron_integration.checkpoint_files import write_checksum

    iter_dir = tmp_path / "iter_0000001"
    iter_dir.mkdir()
    path = iter_dir / "rerun_state.json"
    path.write_text(json.dumps(record))
    write_checksum(str(path))
    return str(path)


def test_a_record_is_refused_where_its_diagnosis_cannot_compare_rank_by_rank(tmp_path):
    from megatron_integration.rerun_record import load_record

    path = _record_dir(tmp_path, {"iteration": 2, "rejected": [1], "values": [[0, 0, 1, 0], [1, math.nan, 1, 0]],
                                  "places": [["n", 0], ["n", 1]]})
    with pytest.raises(DynaPipeError, match=f"^{path}: the result of iteration 2 was rejected in a job of 2 ranks, "
                                            f"and this one has 1"):
        load_record(str(tmp_path), 1, "validate_results", print)
    lines = []
    assert load_record(str(tmp_path), 1, "disabled", lines.append) is None
    assert lines == [f"ignoring {path} under --rerun-mode disabled: training goes on past the rejected result it "
                     f"records"]
    assert load_record(str(tmp_path), 2, "validate_results", lines.append) is None  # another iteration: none


def test_a_damaged_record_is_named_unless_the_run_goes_past_it(tmp_path):
    from megatron_integration.rerun_record import load_record

    path = _record_dir(tmp_path, {"iteration": 2, "rejected": [0], "values": [[1, math.nan, 1, 0]],
                                  "places": [["n", 0]]})
    with open(path, "a") as f:
        f.write(" ")
    with pytest.raises(DynaPipeError, match=f"checkpoint file {path} .*"):
        load_record(str(tmp_path), 1, "validate_results", print)
    assert load_record(str(tmp_path), 1, "report_stats", lambda line: None) is None


def _spiky_validator(monkeypatch, **settings):
    """A one-rank validator whose scale is set by 3 values, and a model whose gradient norm the
    fake forward-backward sets (``(loss, grad)`` pairs, one a computation)."""
    import megatron_integration.rerun_stats as rerun_stats

    monkeypatch.setattr(rerun_stats, "LARGE_VALUE_SAMPLES", 3)
    module = torch.nn.Linear(1, 1, bias=False)
    lines = []
    validator = ResultValidator(RerunSettings(**settings), check=True, module=module, device=torch.device("cpu"),
                                log=lines.append)
    calls = []

    def feed(loss: float, grad: float):
        def forward_backward():
            calls.append((loss, grad))
            module.weight.grad = torch.full((1, 1), grad)
            return loss
        return forward_backward
    return validator, feed, calls, lines


def test_a_spiky_loss_is_computed_again_and_training_goes_on(monkeypatch):
    validator, feed, calls, lines = _spiky_validator(monkeypatch, check_for_spiky_loss=True)
    # The first iteration of a job is not checked; the next three set the scale (largest 2.0).
    for i, loss in enumerate([50.0, 1.0, 2.0, 1.5]):
        assert validator.run(i, feed(loss, 1.0)) is None
    assert len(calls) == 4 and lines == []
    assert validator.run(4, feed(19.0, 1.0)) is None  # below 10x: nothing
    # 10x: computed again (the same value: reproduced), and the optimizer may step.
    spike = iter([20.0, 20.0])
    assert validator.run(5, lambda: calls.append("again") or next(spike)) is None
    assert calls[-2:] == ["again", "again"]
    assert lines[0] == ("iteration 6: the loss of rank 0 is 20, at least 10x the largest of its first 3 (2); "
                        "computing the iteration again on the same devices")
    assert lines[1].startswith("iteration 6: the loss of rank 0 is reproduced (20): the result stands")
    # Not reproduced: said with the device, training still goes on.
    flaky = iter([40.0, 1.0])
    assert validator.run(6, lambda: next(flaky)) is None
    assert "the loss of rank 0 is not reproduced (1): a possible transient fault of rank 0: node" in lines[-1]


def test_large_gradients_are_checked_with_their_tolerance_and_only_warned_about_when_disabled(monkeypatch):
    validator, feed, calls, lines = _spiky_validator(monkeypatch, check_for_large_grads=True)
    for i in range(4):
        validator.run(i, feed(1.0, 1.0))
    grads = iter([30.0, 30.0 * (1 + 5e-4)])  # within Megatron-LM's 0.1% for gradient norms

    def forward_backward():
        validator.module.weight.grad = torch.full((1, 1), next(grads))
        return 1.0
    assert validator.run(4, forward_backward) is None
    assert lines[-1].startswith("iteration 5: the gradient norm of rank 0 is reproduced")
    disabled, feed, calls, lines = _spiky_validator(monkeypatch, rerun_mode="disabled", check_for_large_grads=True,
                                                    check_for_spiky_loss=True)
    for i in range(3):  # under disabled the first iteration counts too
        disabled.run(i, feed(1.0, 1.0))
    assert disabled.run(3, feed(10.0, 10.0)) is None and len(calls) == 4  # not computed again
    assert lines == ["warning: iteration 4: the loss of rank 0 is 10, at least 10x the largest of its first 3 (1); "
                     "the gradient norm of rank 0 is 10, at least 10x the largest of its first 3 (1); training goes "
                     "on (--rerun-mode disabled)"]


def test_report_stats_checks_no_spikes_and_a_nan_in_the_recomputation_is_a_transient_fault(monkeypatch):
    stats, feed, calls, lines = _spiky_validator(monkeypatch, rerun_mode="report_stats", check_for_spiky_loss=True)
    for i in range(5):
        stats.run(i, feed(1.0 if i < 4 else 100.0, 1.0))
    assert not any("10x" in line for line in lines)
    validator, feed, calls, lines = _spiky_validator(monkeypatch, check_for_spiky_loss=True)
    for i in range(4):
        validator.run(i, feed(1.0, 1.0))
    spike = iter([20.0, math.nan])
    verdict = validator.run(4, lambda: next(spike))
    assert verdict.exit_code == 17 and verdict.checkpoint and verdict.record is None
    assert verdict.message.startswith("iteration 5: the loss is NaN or infinite on rank 0 when computed again after "
                                      "an unexpectedly large value, finite the first time: a possible transient "
                                      "fault of rank 0 (rank 0: node")


def test_a_verdict_leaves_the_random_state_the_iteration_started_from(monkeypatch):
    """The checkpoint saved on a verdict holds the weights from before the iteration, and so must
    its random state (dropout masks drawn again on resume): the state after the recomputation is
    the one the iteration started from."""
    module = torch.nn.Linear(2, 2)
    module.weight.grad, module.bias.grad = torch.ones(2, 2), torch.ones(2)
    validator = ResultValidator(RerunSettings(), check=True, module=module, device=torch.device("cpu"))
    validator.run(0, lambda: 1.0)

    def diverged():
        torch.rand(64)  # dropout draws from the generator
        return math.nan
    before = torch.get_rng_state()
    verdict = validator.run(1, diverged)
    assert verdict.exit_code == 16 and verdict.record["reproduced"] == [0]
    assert torch.equal(torch.get_rng_state(), before)
    validator.run(2, lambda: 1.0)
    flaky = iter([math.nan, 1.0])

    def transient():
        torch.rand(64)
        return next(flaky)
    before = torch.get_rng_state()
    assert validator.run(3, transient).exit_code == 17
    assert torch.equal(torch.get_rng_state(), before)


def test_a_record_of_another_layout_is_refused(tmp_path):
    from megatron_integration.rerun_record import load_record

    layout = {"tp": 1, "pp": 1, "dp": 1, "method": "padding", "micro_batch_size": 2, "split": None}
    path = _record_dir(tmp_path, {"iteration": 2, "rejected": [0], "values": [[1, math.nan, 1, 0]],
                                  "places": [["n", 0]], "layout": dict(layout, method="dynapipe")})
    with pytest.raises(DynaPipeError, match=f"^{path}: the result of iteration 2 was rejected in a job of dp 1, "
                                            f"method dynapipe, .*and this one is dp 1, method padding"):
        load_record(str(tmp_path), 1, "validate_results", print, layout=layout)
    lines = []
    assert load_record(str(tmp_path), 1, "validate_results", lines.append, check=False, layout=layout) is None
    assert lines == [f"ignoring {path} under --no-check-for-nan-in-loss-and-grad: training goes on past the "
                     f"rejected result it records"]
    record = load_record(str(tmp_path), 1, "validate_results", lines.append,
                         layout=dict(layout, method="dynapipe"))
    assert record["iteration"] == 2


def test_determinism_statistics_keep_the_newest_samples_as_megatron_lm_does(monkeypatch):
    import megatron_integration.rerun_stats as rerun_stats

    monkeypatch.setattr(rerun_stats, "STATS_SAMPLES", 3)
    stats = QuickStats()
    for diff in (1e-3, 2e-3, 3e-3, 4e-3, 0.0):
        stats.record(diff)
    assert sorted(stats.samples) == [2e-3, 3e-3, 4e-3] and stats.identical == 1
