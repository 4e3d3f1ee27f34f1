"""DynaPipe's own rows run with per-sample attention (``dynapipe-per-sample``): each row holds
one sample padded to its micro-batch's longest, and a varlen kernel skips the padding tail's
attention. The DP cut is priced at the attention each candidate computes."""
import json
import subprocess
import sys

import numpy as np
import pytest

from dynapipe.batching import plan_micro_batches
from dynapipe.batching.candidates import build_candidate_table
from dynapipe.batching.memory import memory_budget
from dynapipe.batching.ordering import named_candidate_orders
from dynapipe.config import load_cluster_config, load_device_config, load_model_config
from dynapipe.cost import build_cost_model
from dynapipe.cost.attention_density import packed_density
from dynapipe.errors import DynaPipeError

A100 = load_device_config("a100-40gb")
RNG = np.random.default_rng(7)
GPT_LENGTHS = RNG.integers(8, 2048, size=60)
T5_LENGTHS = np.stack([RNG.integers(8, 2048, size=60), RNG.integers(2, 400, size=60)], axis=1)


@pytest.mark.parametrize("model_name,lengths", [("gpt-7b", GPT_LENGTHS), ("t5-11b", T5_LENGTHS)])
def test_every_candidate_is_priced_at_the_density_of_its_own_samples(model_name, lengths):
    cm = build_cost_model(load_model_config(model_name), A100, 8)
    budget = memory_budget(cm, None, 0.0)
    for _, order in named_candidate_orders(lengths):
        ordered = lengths[order]
        dense = build_candidate_table(ordered, order, cm, budget, "full", 2048, 2048)
        alone = build_candidate_table(ordered, order, cm, budget, "full", 2048, 2048, per_sample=True)
        for end, count in [(1, 1), (5, 3), (30, 12), (60, 60), (47, 20)]:
            e = alone.entry(end, count)
            s, d = int(alone.seqlen[e]), int(alone.dec_seqlen[e])
            density = packed_density(ordered, [[i] for i in range(end - count, end)], s, d)
            want = cm.stage_cost(count, s, d if d else None, recompute="full", attention=density)
            assert alone.time_ms[e] == pytest.approx(float(np.asarray(want.time_ms).reshape(-1)[0]), rel=1e-9)
            # The same micro-batch priced densely costs more, unless its rows pad nothing.
            k = dense.entry(end, count)
            assert (dense.seqlen[k], dense.dec_seqlen[k]) == (s, d)
            assert alone.time_ms[e] <= dense.time_ms[k] * (1 + 1e-12)
            assert alone.stored_mib[e] <= dense.stored_mib[k] * (1 + 1e-12)


@pytest.mark.parametrize("model_name,lengths", [("gpt-7b", GPT_LENGTHS), ("t5-11b", T5_LENGTHS)])
def test_the_per_sample_cut_is_optimal_for_what_it_computes(model_name, lengths):
    cm = build_cost_model(load_model_config(model_name), A100, 8)
    kw = dict(seq_length=2048, recompute="full", gap=0.0)
    dense = plan_micro_batches(lengths, cm, method="dynapipe", **kw)
    alone = plan_micro_batches(lengths, cm, method="dynapipe-per-sample", **kw)
    assert alone.batching == "dynapipe-per-sample"
    assert sorted(i for mb in alone.micro_batches for i in mb.samples) == list(range(len(lengths)))
    for mb in alone.micro_batches:
        assert mb.rows == [[i] for i in mb.samples]  # one sample a row, as the stages load them
        assert mb.attention == packed_density(lengths, mb.rows, mb.seqlen, mb.dec_seqlen)
        assert mb.to_json()["attention_density"] == mb.attention.to_json()
    # The dense cut, run with per-sample attention, is one of the cuts the per-sample DP weighed.
    for mb in dense.micro_batches:
        mb.rows = [[i] for i in mb.samples]
        mb.attention = packed_density(lengths, mb.rows, mb.seqlen, mb.dec_seqlen)
    from dynapipe.batching.planner import _price

    _price(dense.micro_batches, cm, "full")
    assert alone.compute_objective_ms() <= dense.compute_objective_ms() * (1 + 1e-9)
    assert min(mb.attention.input for mb in alone.micro_batches if mb.mbs > 1) < 1


def test_a_cost_model_of_dense_rows_only_refuses_the_per_sample_cut():
    from test_batching_dp import ToyCost

    with pytest.raises(DynaPipeError, match="dynapipe-per-sample'? .* cannot"):
        plan_micro_batches(np.array([10, 20, 30, 40]), ToyCost(0.0, 0.0, 2), method="dynapipe-per-sample",
                           seq_length=128)


def test_the_per_sample_cut_is_planned_and_simulated_by_the_commands(tmp_path):
    from dynapipe.method_compare import compare_methods, global_batch_of_tokens

    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(str(n) for n in [100, 7, 900, 513, 64, 1000, 9, 300]))
    out = tmp_path / "plan.json"

    def plan_cmd(*extra):
        argv = ["plan", "--model", "gpt-7b", "--device", "a100-40gb", "--stages", "4", "--lengths", str(lengths),
                "--batching", "dynapipe-per-sample", *extra]
        return subprocess.run([sys.executable, "-m", "dynapipe", *argv], capture_output=True, text=True, timeout=120)

    r = plan_cmd("--seq-length", "1024", "--output", str(out))
    assert r.returncode == 0, r.stderr
    plan = json.loads(out.read_text())
    assert plan["batching"] == "dynapipe-per-sample"
    assert all(0 < mb["attention_density"]["input"] <= 1 for mb in plan["micro_batches"])
    # One sample a row, as the stages load them.
    assert all(all(len(row) == 1 for row in mb["samples"]) for mb in plan["micro_batches"])
    r = plan_cmd("--micro-batch-size", "2")
    assert r.returncode != 0 and "--batching dynapipe-per-sample sizes every micro-batch itself" in r.stderr

    cm = build_cost_model(load_model_config("gpt-7b"), A100, 4)
    batch = global_batch_of_tokens(32768, 0, 4096)
    res = compare_methods(batch, cm, methods=("dynapipe", "dynapipe-per-sample"), seq_length=4096,
                          cluster=load_cluster_config("a100-8x"), dp=2, zero=True)
    dense, alone = res["dynapipe"].best, res["dynapipe-per-sample"].best
    assert alone.micro_batch_size is None
    # Per-sample rows compute only their samples' own attention.
    assert alone.attention_share < dense.attention_share


@pytest.mark.parametrize("model_name,lengths", [("gpt-7b", GPT_LENGTHS), ("t5-11b", T5_LENGTHS)])
def test_the_activation_plan_prices_per_sample_rows_at_their_density(model_name, lengths):
    """Each rank's plan records its micro-batches' densities (through both plan encodings), and
    the logged planned peak prices them there, below the same plan priced as dense rows."""
    from dataclasses import replace

    from dynapipe.pipeline_planner import plan_iteration
    from dynapipe.plan.serialize import deserialize_plan, serialize_plan
    from dynapipe.runtime.activation_plan import plan_densities, planned_activation_peak_mib
    from dynapipe.runtime.plan_source import decode_plan, encode_plan

    cm = build_cost_model(load_model_config(model_name), A100, 8)
    it = plan_iteration(lengths, cm, stages=8, dp=2, method="dynapipe-per-sample", seq_length=2048,
                        schedule="1f1b", recompute="none", memory_limit_mib=1e6)
    lighter = 0
    for r, plans in enumerate(it.plans):
        mbs = it.search.micro_batches[r]
        for plan in plans:
            for again in (decode_plan(encode_plan(plan)), deserialize_plan(serialize_plan(plan))):
                assert again.meta["attention_density"] == plan.meta["attention_density"]
            dens = plan_densities(plan)
            assert [dens[i.mb].to_json() for i in plan.micro_batches] == [mb.attention.to_json() for mb in mbs]
            dense = replace(plan, meta={k: v for k, v in plan.meta.items() if k != "attention_density"})
            peak, dense_peak = planned_activation_peak_mib(plan, cm), planned_activation_peak_mib(dense, cm)
            assert peak <= dense_peak
            lighter += peak < dense_peak  # where its rows pad, a stage stores fewer scores
    assert lighter > 0
    bad = replace(it.plans[0][0], meta={**it.plans[0][0].meta, "attention_density": [None]})
    with pytest.raises(DynaPipeError, match="one a micro-batch"):
        planned_activation_peak_mib(bad, cm)
    odd = replace(bad, meta={**bad.meta, "attention_density": [{"keys": 0.5}] * len(bad.micro_batches)})
    with pytest.raises(DynaPipeError, match="each is null"):
        planned_activation_peak_mib(odd, cm)
    # A dense run's plans record nothing.
    dense_it = plan_iteration(lengths, cm, stages=8, method="dynapipe", seq_length=2048, schedule="1f1b",
                              recompute="full")
    assert all("attention_density" not in p.meta for p in dense_it.plans[0])


def test_auto_placement_chooses_on_the_cut_the_run_plans():
    """``--dynapipe-placement auto`` prices the stage split on the run's own cut: per-sample
    rows' micro-batches (with their densities) where the run skips its padding's attention."""
    from megatron_integration.arguments import parse_training_args
    from megatron_integration.placement_auto import placement_cut

    from dynapipe.cost.placement import PlacementSample
    from dynapipe.schedule import placement as placement_mod

    cm = build_cost_model(load_model_config("t5-11b"), A100, 8)
    batches = [T5_LENGTHS[:30], T5_LENGTHS[30:]]
    kw = dict(dp=1, memory_limit_mib=None, reserved_mib=0.0, seq_length=2048, zero=False, recompute="full")
    per_sample = placement_mod.Cut("dynapipe-per-sample")
    alone = placement_mod._cut(batches, cm, cut=per_sample, **kw)
    assert all(mb.attention is not None for mb in alone)
    assert all(mb.attention is None for mb in placement_mod._cut(batches, cm, **kw))
    chosen = placement_mod.choose_placement_kind(batches, cm, chunks=1, cut=per_sample,
                                                 **{k: v for k, v in kw.items() if k != "reserved_mib"})
    # The chosen split is priced on the per-sample cut of the placement it started from.
    want = PlacementSample.of(placement_mod._cut(batches, cm, cut=per_sample, **kw))
    from dynapipe.cost.placement import price_placement

    priced = price_placement(cm, chosen.chosen.placement, want, capacity_mib=None, dp=1, zero=False,
                             recompute="full")
    assert priced.bottleneck_ms == pytest.approx(chosen.chosen.bottleneck_ms)
    gpt = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 96 --max-position-embeddings 96 "
           "--vocab-size 128 --global-batch-size 4 --train-iters 1 --lr 1e-4 --mock-data --use-dynapipe")
    assert placement_cut(parse_training_args(gpt.split(), 2)) == placement_mod.Cut("dynapipe", 1)
    padded = parse_training_args((gpt + " --dynapipe-padded-attention per-sample").split(), 2)
    assert placement_cut(padded) == per_sample


def test_auto_placement_of_packing_through_the_executor_chooses_on_its_rows():
    """With ``--use-dynapipe --dynapipe-batching packing`` the executor runs packing's rows,
    which ``auto`` then chooses the split on (at the run's micro-batch size, per sample where
    the rows compute attention per sample); Megatron's baselines keep DynaPipe's cut."""
    from megatron_integration.arguments import parse_training_args
    from megatron_integration.placement_auto import placement_cut

    from dynapipe.schedule import placement as placement_mod

    gpt = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 96 --max-position-embeddings 96 "
           "--vocab-size 128 --global-batch-size 8 --train-iters 1 --lr 1e-4 --mock-data --micro-batch-size 2 "
           "--dynapipe-batching packing --reset-position-ids --reset-attention-mask")
    baseline = parse_training_args(gpt.split(), 2)
    assert placement_cut(baseline) == placement_mod.DYNAPIPE_CUT
    packed = placement_cut(parse_training_args((gpt + " --use-dynapipe").split(), 2))
    assert packed == placement_mod.Cut("packing", 2)
    assert placement_cut(parse_training_args((gpt + " --use-dynapipe --dynapipe-packed-attention per-sample")
                                             .split(), 2)) == placement_mod.Cut("packing-per-sample", 2)
    cm = build_cost_model(load_model_config("gpt-7b"), A100, 4)
    lengths = np.array([300, 1200, 90, 2000, 640, 75, 1500, 410, 980, 33, 1750, 260])
    kw = dict(dp=1, memory_limit_mib=None, reserved_mib=0.0, seq_length=2048, zero=False, recompute="full")
    rows = placement_mod._cut([lengths], cm, cut=packed, **kw)
    want = plan_micro_batches(lengths, cm, method="packing", micro_batch_size=2, seq_length=2048,
                              recompute="full").micro_batches
    assert [(m.samples, m.seqlen) for m in rows] == [(m.samples, m.seqlen) for m in want]
    assert [(m.samples, m.seqlen) for m in rows] != \
        [(m.samples, m.seqlen) for m in placement_mod._cut([lengths], cm, **kw)]  # DynaPipe's cut differs
    # Chosen on those rows: the split's bottleneck is priced on them.
    from dynapipe.cost.placement import PlacementSample, price_placement

    chosen = placement_mod.choose_placement([lengths], cm, cut=packed, seq_length=2048, recompute="full",
                                            memory_limit_mib=None)
    priced = price_placement(cm, chosen.chosen.placement, PlacementSample.of(rows), capacity_mib=None, dp=1,
                             zero=False, recompute="full")
    assert priced.bottleneck_ms == pytest.approx(chosen.chosen.bottleneck_ms)
