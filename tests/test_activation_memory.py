"""Activation memory: the meter (saved tensors + buffers, each storage once) and what a
plan promises (stored activations, buffers and recomputation walked in plan order)."""
import numpy as np
import pytest
import torch

from dynapipe.batching.types import MicroBatch
from dynapipe.config import load_model_config
from dynapipe.cost.base import MIB, CostModel, StageCost
from dynapipe.plan.compile import compile_plans
from dynapipe.runtime.activation_meter import ActivationMeter, measure_activations
from dynapipe.runtime.activation_plan import planned_activation_peak_mib
from dynapipe.runtime.buffers import BufferTable


def test_meter_counts_saved_storages_once_and_releases_them_after_backward():
    w = torch.randn(256, 256, requires_grad=True)
    x = torch.randn(64, 256, requires_grad=True)
    meter = ActivationMeter(exclude=[w])
    with meter.saving():
        h = x @ w  # saves x (w excluded)
        y = torch.tanh(h)  # saves its output y
        z = (y * y).sum()  # saves y twice: one storage
        held = meter.live_bytes
        z.backward()
    assert held == x.numel() * 4 + y.numel() * 4
    assert meter.peak_bytes == held
    del h, y, z
    assert meter.live_bytes == 0


def test_buffers_and_saved_tensors_share_a_storage_once():
    meter = ActivationMeter()
    table = BufferTable(meter=meter)
    a = torch.randn(1024, requires_grad=True)  # a received activation
    b = torch.randn(2048)
    table.put("act_in:0:0", {"h": a}, "here")
    table.put("grad_in:0:0", {"h": b}, "here")
    with meter.saving():
        out = (a * a).sum()  # saves a: already held by the buffer
    assert meter.live_bytes == (1024 + 2048) * 4
    out.backward()
    table.free("grad_in:0:0", 1, "here")
    assert meter.live_bytes == 1024 * 4
    sent = torch.randn(512, requires_grad=True) * 2  # an output with a graph, released after its send
    table.put("act_out:0:0", {"h": sent}, "here")
    assert table.release("act_out:0:0", "here") == 511 * 4
    assert meter.live_bytes == 1024 * 4
    table.clear()
    assert meter.live_bytes == 0


def test_measure_activations_excludes_parameters():
    layer = torch.nn.Linear(128, 128)
    x = torch.randn(32, 128, requires_grad=True)
    with measure_activations(layer, torch.device("cpu")) as act:
        layer(x).sum().backward()
    assert act["peak_mib"] == pytest.approx(x.numel() * 4 / MIB)


class _Flat(CostModel):
    """Every micro-batch stores 10 MiB (selective 6, full 1) with a 3 MiB transient peak."""

    STORED = {"none": 10.0, "selective": 6.0, "full": 1.0}

    def layout_cost(self, layout, mbs, seqlen, dec_seqlen, recompute):
        z = np.zeros(np.broadcast(mbs, seqlen).shape)
        return StageCost(z + 1.0, z + 2.0, z + self.STORED[recompute], z + 3.0)


def _plans(level: str):
    model = load_model_config("gpt-tiny")
    mbs = [MicroBatch(samples=[i], seqlen=256) for i in range(4)]
    return compile_plans("1f1b", mbs, model, num_stages=2, recompute=level), _Flat(model, 2), model


def test_planned_peak_walks_the_plan():
    plans, cost, model = _plans("none")
    act = 256 * model.hidden_size * 4 / MIB  # one [seqlen, 1, hidden] fp32 message
    tokens = 256 * 8 * 2 / MIB  # tokens and position ids, int64
    # Stage 0 under 1F1B holds two micro-batches before its first backward; its last output
    # may wait for its send, and a received gradient arrives before the backward.
    got = planned_activation_peak_mib(plans[0], cost)
    assert 20.0 + act <= got <= 20.0 + 2 * act + 2 * tokens + act
    assert planned_activation_peak_mib(plans[0], cost, transient=True) == pytest.approx(got + 3.0, abs=2 * act + tokens)
    full, _, _ = _plans("full")
    layers = cost.layouts[0].decoder_layers
    # Full recompute: 1 MiB stored a micro-batch, and the backward rematerialises one layer.
    expect = 2 * 1.0 + (10.0 - 1.0) / layers
    assert expect <= planned_activation_peak_mib(full[0], cost) <= expect + 2 * act + 2 * tokens + act


def test_planned_peak_follows_levels_per_micro_batch():
    import dataclasses

    from dynapipe.plan.instructions import BackwardPass, ForwardPass

    plans, cost, _ = _plans("none")
    mixed = dataclasses.replace(plans[1], instructions=tuple(
        dataclasses.replace(x, recompute="full" if x.mb % 2 else "none")
        if isinstance(x, (ForwardPass, BackwardPass)) else x for x in plans[1].instructions))
    none = planned_activation_peak_mib(plans[1], cost)
    assert planned_activation_peak_mib(mixed, cost) <= none


def test_bench_and_log_line_report_measured_against_planned():
    from megatron_integration.bench_results import stage_activation_peaks
    from megatron_integration.logging_utils import IntervalStats, format_log_line
    from megatron_integration.baseline_step import StepResult

    ranks = [{"pp_rank": 1, "activation_measured_mib": [50.0, 9.0, 11.0], "activation_planned_mib": [1.0, 10.0, 12.0]},
             {"pp_rank": 0, "activation_measured_mib": [7.0, 8.0, 6.0], "activation_planned_mib": [None] * 3}]
    assert stage_activation_peaks(ranks, keep=[1, 2]) == [{"stage": 0, "measured": 8.0, "planned": None},
                                                         {"stage": 1, "measured": 11.0, "planned": 12.0}]
    stats = IntervalStats()
    stats.add(StepResult(loss=1.0, loss_tokens=1, real_tokens=1, padded_tokens=1, iteration_ms=1.0,
                         activation_measured_mib=9.06, activation_planned_mib=9.84))
    assert "activation peak (MiB): 9.1/9.8 |" in format_log_line(1, 1, 1, stats, 1.0, 1e-3, 1)
    stats = IntervalStats()
    stats.add(StepResult(loss=1.0, loss_tokens=1, real_tokens=1, padded_tokens=1, iteration_ms=1.0,
                         activation_measured_mib=9.0))
    assert "activation peak (MiB): 9.0/- |" in format_log_line(1, 1, 1, stats, 1.0, 1e-3, 1)
    assert "grad norm: 0.000 |" in format_log_line(1, 1, 1, stats, 1.0, 1e-3, 1)
    # After a skipped (fp16 overflow) step there is no gradient norm: Megatron-LM leaves it out.
    stats.add(StepResult(loss=1.0, loss_tokens=1, real_tokens=1, padded_tokens=1, iteration_ms=1.0, skipped=True))
    assert "grad norm" not in format_log_line(2, 2, 2, stats, 1.0, 1e-3, 1)


def test_cuda_maxima_survive_the_per_iteration_resets(monkeypatch):
    # CudaPeak resets torch's peak statistics every iteration to measure that iteration's
    # activations; the run's maxima (Megatron-LM's memory report) must outlive those resets.
    # The allocator's statistics are stood in for here: this machine has no CUDA.
    import torch

    from dynapipe.runtime import activation_meter as am

    mib = 1 << 20
    state = {"allocated": 0, "peak": 0, "reserved": 0, "reserved_peak": 0}

    def use(allocated_mib, reserved_mib):
        state["allocated"], state["reserved"] = allocated_mib * mib, reserved_mib * mib
        state["peak"] = max(state["peak"], state["allocated"])
        state["reserved_peak"] = max(state["reserved_peak"], state["reserved"])

    def reset(*_):
        state["peak"], state["reserved_peak"] = state["allocated"], state["reserved"]

    def no_nvml(*_):
        raise RuntimeError("pynvml module not found")

    for name, fn in {"synchronize": lambda *_: None, "reset_peak_memory_stats": reset,
                     "memory_allocated": lambda *_: state["allocated"], "max_memory_allocated": lambda *_: state["peak"],
                     "memory_reserved": lambda *_: state["reserved"],
                     "max_memory_reserved": lambda *_: state["reserved_peak"], "device_memory_used": no_nvml}.items():
        monkeypatch.setattr(torch.cuda, name, fn, raising=False)
    device = torch.device("cuda", 0)
    use(100, 128)  # model states
    am.reset_cuda_peaks(device)
    use(900, 1024)  # the first iteration's forward-backward peak, then freed
    use(300, 1024)
    peak = am.CudaPeak(device)  # the second iteration resets the peaks
    use(500, 1024)
    use(300, 1024)
    assert peak.peak_mib() == 200  # this iteration's activations: 500 over the 300 at its start
    m = am.cuda_memory_mib(device)
    assert (m["allocated"], m["max_allocated"], m["reserved"], m["max_reserved"]) == (300, 900, 1024, 1024)
    assert m["device_usage"] is None  # left out where torch cannot read it
    am.reset_cuda_peaks(device)  # a new run counts afresh
    assert am.cuda_memory_mib(device)["max_allocated"] == 300
