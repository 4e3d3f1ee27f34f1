"""Stage placement: the split data structure, the search's optimality and memory, the
bubble it removes. Pure Python + numpy, tiny models."""
import itertools
import json
import re

import numpy as np
import pytest

from dynapipe.config import DeviceConfig, ModelConfig
from dynapipe.cost import AnalyticCostModel, PlacementSample, StagePlacement, build_cost_model, plan_placement
from dynapipe.cost.base import StageLayout
from dynapipe.cost.placement import price_placement
from dynapipe.data.synthetic import sample_lengths
from dynapipe.errors import DynaPipeError
from dynapipe.pipeline_planner import plan_iteration
from dynapipe.schedule.placement import choose_placement

DEVICE = DeviceConfig("toy", peak_tflops=10.0, achievable_fraction=0.5, memory_mib=1e9, op_overhead_ms=0.01)
T5 = ModelConfig("t5-toy", arch="t5", encoder_layers=4, decoder_layers=4, hidden_size=512, num_attention_heads=8,
                 ffn_hidden_size=2048, vocab_size=1000, max_seq_length=1024, dtype="bf16")
# Eight of each: enough layers for the split to follow the encoder's heavier cost.
T5_DEEP = ModelConfig("t5-toy-deep", arch="t5", encoder_layers=8, decoder_layers=8, hidden_size=512,
                      num_attention_heads=8, ffn_hidden_size=2048, vocab_size=1000, max_seq_length=1024, dtype="bf16")
GPT = ModelConfig("gpt-toy", num_layers=8, hidden_size=512, num_attention_heads=8, ffn_hidden_size=2048,
                  vocab_size=1000, max_seq_length=1024, dtype="bf16")


def _sample(encoder_decoder: bool, n: int = 12, seed: int = 0) -> PlacementSample:
    rng = np.random.default_rng(seed)
    seq = rng.integers(64, 1024, n).astype(float)
    dec = rng.integers(8, 128, n).astype(float) if encoder_decoder else np.zeros(n)
    return PlacementSample(rng.integers(1, 4, n).astype(float), seq, dec)


def _compositions(total: int, parts: int):
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0,) + cuts + (total,)
        yield [bounds[i + 1] - bounds[i] for i in range(parts)]


def _placements(model: ModelConfig, S: int):
    """Every contiguous placement of the model's layers on S stages."""
    E = model.encoder_layers if model.is_encoder_decoder else 0
    for sizes in _compositions(model.total_layers, S):
        enc, dec, start = [], [], 0
        for n in sizes:
            e = max(0, min(start + n, E) - start)
            enc.append(e)
            dec.append(n - e)
            start += n
        yield StagePlacement(tuple(enc), tuple(dec))


@pytest.mark.parametrize("model,S,capacity", [(T5, 3, None), (T5, 4, None), (GPT, 3, None), (T5, 3, 600.0),
                                              (T5, 4, 420.0), (GPT, 4, 400.0)])
def test_placement_is_optimal_against_brute_force(model, S, capacity):
    cm = AnalyticCostModel(model, DEVICE, S)
    sample = _sample(model.is_encoder_decoder)
    got = plan_placement(cm, sample, capacity_mib=capacity)
    brute = min(price_placement(cm, p, sample, capacity_mib=capacity).bottleneck_ms for p in _placements(model, S))
    assert np.isfinite(brute)
    assert got.bottleneck_ms == pytest.approx(brute, rel=1e-9)
    # The choice prices as it says.
    again = price_placement(cm, got.placement, sample, capacity_mib=capacity)
    assert again.stage_ms == pytest.approx(got.stage_ms)


@pytest.mark.parametrize("capacity", [440.0, 480.0])
def test_placement_respects_memory(capacity):
    cm = AnalyticCostModel(T5, DEVICE, 4)
    sample = _sample(True)
    free = plan_placement(cm, sample)
    got = plan_placement(cm, sample, capacity_mib=capacity)
    assert all(m <= capacity for m in got.stage_mib)
    moved = cm.with_placement(got.placement)
    assert all(moved.model_state_mib(s) < capacity for s in range(4))
    # The limit binds: the unconstrained optimum does not fit, and costs less.
    assert max(price_placement(cm, free.placement, sample).stage_mib) > capacity
    assert got.bottleneck_ms >= free.bottleneck_ms
    with pytest.raises(DynaPipeError, match="fits"):
        plan_placement(cm, sample, capacity_mib=50.0)


def test_even_split_recovered_for_uniform_layers():
    for S in (2, 4, 8):
        cm = AnalyticCostModel(GPT, DEVICE, S)
        got = plan_placement(cm, _sample(False))
        assert got.placement == StagePlacement.even(GPT, S) == cm.placement


def test_uneven_layers_move_to_lighter_stages():
    """T5 decoder layers on short targets cost less than encoder layers: the decoder
    stages take more of them and the slowest stage gets faster than the even split's."""
    cm = AnalyticCostModel(T5_DEEP, DEVICE, 4)
    sample = _sample(True)
    got = plan_placement(cm, sample)
    even = price_placement(cm, cm.placement, sample)
    # The encoder spreads over more than the even split's two stages.
    assert got.placement.encoder_layers[2] > 0
    assert got.bottleneck_ms < 0.85 * even.bottleneck_ms
    brute = min(price_placement(cm, p, sample).bottleneck_ms for p in _placements(T5_DEEP, 4))
    assert got.bottleneck_ms == pytest.approx(brute, rel=1e-9)


def test_placement_structure_and_errors():
    even = StagePlacement.even(T5, 4)
    assert even.to_json() == {"encoder_layers": [2, 2, 0, 0], "decoder_layers": [0, 0, 2, 2]}
    assert str(even) == "2+0,2+0,0+2,0+2"
    assert StagePlacement.parse("3+0,1+1,0+2,0+1", T5, 4) == StagePlacement((3, 1, 0, 0), (0, 1, 2, 1))
    assert StagePlacement.from_json(even.to_json(), T5) == even
    with pytest.raises(DynaPipeError, match="holds 9 layers; model 'gpt-toy' has 8"):
        StagePlacement.parse("3,2,2,2", GPT, 4)
    gpt = StagePlacement.parse("3,2,2,1", GPT, 4)
    assert gpt.to_json() == {"layers": [3, 2, 2, 1]} and StagePlacement.from_json(gpt.to_json(), GPT) == gpt
    for text, match in [("2+0,2+0,0+2", "3 stages"), ("2+0,2+0,0+3,0+2", "5 decoder layers"),
                        ("2+0,0+2,2+0,0+2", "before the first decoder"), ("4+0,0+0,0+2,0+2", "no layer"),
                        ("2,2,2,2", "ENC\\+DEC"), ("2+x,2,2,2", "not a layer count")]:
        with pytest.raises(DynaPipeError, match=match):
            StagePlacement.parse(text, T5, 4)
    cm = build_cost_model(T5, DEVICE, 4, placement=StagePlacement.parse("3+0,1+1,0+2,0+1", T5, 4))
    assert [(l.encoder_layers, l.decoder_layers) for l in cm.layouts] == [(3, 0), (1, 1), (0, 2), (0, 1)]
    with pytest.raises(DynaPipeError, match="stages"):
        AnalyticCostModel(T5, DEVICE, 2).with_placement(even)


def test_planned_placement_reduces_the_simulated_bubble():
    """On a fixed batch, the placement chosen from a different sample of the same
    distribution cuts the simulated iteration time and the bubble of the even split."""
    device = DeviceConfig("toy-gpu", peak_tflops=100.0, achievable_fraction=0.5, memory_mib=1e9,
                          op_overhead_ms=0.02, half_efficiency_tokens=256)
    cm = AnalyticCostModel(T5_DEEP, device, 4)
    sample = [sample_lengths(48, 100, 1024, True)]
    batch = sample_lengths(48, 7, 1024, True)
    chosen = choose_placement(sample, cm, seq_length=1024)
    assert chosen.chosen.bottleneck_ms < chosen.before.bottleneck_ms
    even = plan_iteration(batch, cm, seq_length=1024)
    planned = plan_iteration(batch, chosen.cost_model, seq_length=1024)
    assert planned.simulated_ms < 0.85 * even.simulated_ms
    assert planned.bubble_fraction < even.bubble_fraction - 0.1


def test_auto_placement_also_weighs_the_even_interleaved_split():
    """The planned interleaved split balances per-stage sample time; on t5-11b PP8 x DP2 its
    heavier stages leave no memory for the schedule (nothing fits), while Megatron-style even
    chunks simulate fastest. ``auto`` simulates all three splits and keeps the fastest."""
    from dynapipe.config import load_device_config, load_model_config
    from dynapipe.cost.chunked_placement import even_chunked_placement
    from dynapipe.schedule.placement import choose_placement_kind, simulated_ms

    cm = build_cost_model(load_model_config("t5-11b"), load_device_config("a100-40gb"), 8)
    batch = sample_lengths(128, 5, 2048, True)
    kw = dict(dp=2, seq_length=2048)
    plan = choose_placement_kind([batch], cm, **kw)
    times = plan.compared
    even = even_chunked_placement(cm, 2)
    assert times["interleaved_even"] == str(even) != times["interleaved"]
    ms = {k: v for k, v in times.items() if k.endswith("_ms")}
    assert ms["interleaved_ms"] == float("inf") and ms["interleaved_even_ms"] < ms["contiguous_ms"]
    assert plan.chosen.placement == plan.cost_model.placement == even
    # The time recorded is the simulation of the split chosen.
    assert simulated_ms([batch], cm.with_placement(even), memory_limit_mib=cm.device.memory_mib, reserved_mib=cm.device.reserved_mib,
                        zero=False, recompute=None, **kw) == pytest.approx(ms["interleaved_even_ms"])


def test_plans_follow_the_placement():
    """Compiled plans carry the placement, and the encoder output joins the message at
    the placement's first decoder stage, not the even split's."""
    placement = StagePlacement.parse("3+0,3+0,2+1,0+7", T5_DEEP, 4)
    cm = AnalyticCostModel(T5_DEEP, DEVICE, 4).with_placement(placement)
    it = plan_iteration(sample_lengths(12, 3, 512, True), cm, seq_length=512)
    plans = it.plans[0]
    assert all(p.meta["placement"] == placement.to_json() for p in plans)
    sends = {p.stage: {t.name for i in p.instructions if type(i).__name__ == "SendActivationStart" for t in i.tensors}
             for p in plans}
    assert sends == {0: {"hidden_states"}, 1: {"hidden_states"}, 2: {"hidden_states", "encoder_output"}, 3: set()}
    loads = {p.stage: {t.name for i in p.instructions if type(i).__name__ == "LoadInput" for t in i.tensors}
             for p in plans}
    assert "dec_tokens" in loads[2] and "dec_tokens" not in loads[3]
    even = plan_iteration(sample_lengths(12, 3, 512, True), AnalyticCostModel(T5_DEEP, DEVICE, 4), seq_length=512)
    assert "placement" not in even.plans[0][0].meta


def test_plan_and_trace_commands_report_the_placement(tmp_path, capsys):
    from dynapipe.cli import main

    model = tmp_path / "t5.yaml"
    model.write_text("name: t5-toy-deep\narch: t5\nencoder_layers: 8\ndecoder_layers: 8\nhidden_size: 512\n"
                     "num_attention_heads: 8\nffn_hidden_size: 2048\nvocab_size: 1000\nmax_seq_length: 1024\n")
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("".join(f"{a} {b}\n" for a, b in sample_lengths(24, 5, 1024, True)))
    base = ["--model", str(model), "--device", "a100-40gb", "--stages", "4", "--lengths", str(lengths)]
    assert main(["plan", *base, "--placement", "auto"]) == 0
    out, err = capsys.readouterr()
    plan = json.loads(out)
    chosen = StagePlacement.from_json(plan["placement"], T5_DEEP)
    assert chosen != StagePlacement.even(T5_DEEP, 4)
    assert plan["bubble_fraction"] < plan["even_split"]["bubble_fraction"]
    assert plan["simulated_ms"] < plan["even_split"]["simulated_ms"]
    assert f"placement {chosen}" in err and "even split 4+0,4+0,0+4,0+4" in err
    # The search's own line, before the plan's summary (a terminal also gets it announced first).
    assert re.search(rf"^placement {re.escape(str(chosen))} chosen \(--placement auto, \d+\.\d s\)$", err, re.M), err
    trace = tmp_path / "trace.json"
    assert main(["trace", *base, "--placement", str(chosen), "--out", str(trace)]) == 0
    meta = json.loads(trace.read_text())["metadata"]
    assert meta["placement"] == chosen.to_json()
    assert meta["bubble_fraction"] == pytest.approx(plan["bubble_fraction"], abs=1e-4)
    assert meta["even_split"]["bubble_fraction"] == pytest.approx(plan["even_split"]["bubble_fraction"], abs=1e-4)
    assert main(["plan", *base, "--placement", "4+0,4+0,0+4"]) == 2
    assert "names 3 stages" in capsys.readouterr().err


def test_decoder_gemms_take_the_efficiency_of_decoder_tokens():
    """A T5 decoder layer's own GEMMs span only the target tokens: short targets run thin
    however long the input is; encoder layers keep the encoder tokens' efficiency."""
    import dataclasses

    from dynapipe.config import load_device_config

    curved = load_device_config("a100-40gb")
    flat = dataclasses.replace(curved, half_efficiency_tokens=0.0)
    k = curved.half_efficiency_tokens
    ratio = {}
    for stage in (0, 3):  # all-encoder and all-decoder stages of the even split
        t = [float(AnalyticCostModel(T5_DEEP, dev, 4).stage_cost(1, 1024, 16, stage=stage).fw_ms) - dev.op_overhead_ms
             for dev in (flat, curved)]
        ratio[stage] = t[1] / t[0]
    assert ratio[0] == pytest.approx((1024 + k) / 1024, rel=1e-12)
    # Priced on input + target tokens, as before, it would be 1.25 too; the decoder GEMMs make it 3.2.
    assert ratio[3] > 2 * ratio[0]


def test_layouts_carry_the_encoder_decoder_roles_and_the_analytic_model_prices_them():
    # The stage holding the first decoder layer embeds the decoder's tokens; the one holding the
    # last encoder layer runs the encoder's final norm. A rank of an interleaved placement takes
    # its chunks' roles.
    from dynapipe.cost.base import stage_layouts

    def roles(layouts):
        return [(l.embeds_decoder, l.ends_encoder) for l in layouts]

    assert roles(stage_layouts(T5, 2)) == [(False, True), (True, False)]
    assert roles(StagePlacement.parse("3+0,1+4", T5, 2).layouts()) == [(False, False), (True, True)]
    assert roles(StagePlacement.parse("4+1,0+3", T5, 2).layouts()) == [(True, True), (False, False)]
    assert roles(StagePlacement.interleaved(T5, 2).layouts()) == [(True, False), (False, True)]
    assert roles(StagePlacement.interleaved(T5, 2).virtual_layouts()) == [(False, False), (False, True),
                                                                          (True, False), (False, False)]
    assert roles(stage_layouts(GPT, 4)) == [(False, False)] * 4
    # Priced: the decoder embedding's dropout mask (a bool a channel on this device: 1 byte)
    # over the decoder tokens, the final norm's bf16 input and fp32 statistics over the encoder's.
    cm = AnalyticCostModel(T5, DEVICE, 2)
    b, s, d = 2.0, 512.0, 64.0
    plain = StageLayout(1, 2, 2, False, False)
    for flags, extra in (({"embeds_decoder": True}, b * d * 512 * 1),
                         ({"ends_encoder": True}, b * s * (512 * 2 + 8))):
        with_role = cm.layout_cost(StageLayout(1, 2, 2, False, False, **flags), b, s, d, "none")
        assert (with_role.stored_mib - cm.layout_cost(plain, b, s, d, "none").stored_mib) * 2**20 == \
            pytest.approx(extra)


@pytest.mark.parametrize("model, device, stages, memory", [
    ("gpt-7b", "a100-40gb", 4, 1.0), ("gpt-7b", "a100-40gb", 3, None), ("t5-11b", "h200", 4, 0.6),
    ("t5-11b", "h200", 8, 1.0)])
def test_the_vectorised_passes_give_the_loop_programs_splits(model, device, stages, memory):
    # Each state cap's passes are numpy steps over a table priced once; the loop priced each
    # layout per cap (20 s for t5-11b on 4 stages). Same objective, same cuts, ties included.
    from placement_reference import loop_dp
    from dynapipe.cost import placement as P
    from dynapipe.config import load_device_config, load_model_config

    m, dev = load_model_config(model), load_device_config(device)
    rng = np.random.default_rng(stages)
    k = 6
    sample = P.PlacementSample(rng.integers(1, 8, k).astype(float), rng.integers(64, 2048, k).astype(float),
                               rng.integers(16, 512, k).astype(float) if m.is_encoder_decoder else np.zeros(k))
    capacity = None if memory is None else memory * dev.memory_mib
    pricer = P._Pricer(build_cost_model(m, dev, stages), sample, stages, P._levels(None), capacity, 2, True)
    L, enc = m.total_layers, (m.encoder_layers if m.is_encoder_decoder else 0)
    caps = sorted({pricer.state_mib(P._segment(s, stages, p, q, enc)) for s in range(stages) for p in range(L)
                   for q in range(p + 1, L + 1) if (s == 0) == (p == 0) and (s == stages - 1) == (q == L)})
    caps = [c for c in caps if c < pricer.capacity] if capacity is not None else [np.inf]
    segments = P._Segments(pricer, stages, L, enc, max(caps))
    found = 0
    for cap in caps[::max(1, len(caps) // 6)] + caps[-1:]:
        first = loop_dp(pricer, stages, L, enc, np.inf, cap)
        assert P._dp(segments, np.inf, cap) == first
        if first[1]:
            found += 1
            slack = first[0] * (1 + 1e-12)
            assert P._dp(segments, slack, cap) == loop_dp(pricer, stages, L, enc, slack, cap)
    assert found  # some cap admits a split
