"""T5 stage placement in training (``--dynapipe-placement``): pure Python, no process group.

The placement decides what every stage builds (layer ranges, roles, embedding copies), what
DynaPipe's planner prices and compiles (``meta["placement"]``, checked when a plan is
loaded) and what a checkpoint records (a resume with another split is refused). The
spawned check that a non-even placement trains like padding is in ``test_megatron_t5.py``.
"""
import re

import pytest

from dynapipe.cost.placement import StagePlacement
from dynapipe.errors import DynaPipeError
from megatron_integration.t5_arguments import parse_t5_args
from megatron_integration.t5_model import stage_places, t5_global_name
from megatron_integration.t5_placement import (check_checkpoint_placement, check_plan_placement, checkpoint_record,
                                               choose_t5_placement, first_global_batches, resolve_t5_placement)

TINY = ("--encoder-num-layers 2 --decoder-num-layers 2 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 128 "
        "--encoder-seq-length 128 --decoder-seq-length 64 --vocab-size 256 --micro-batch-size 2 --global-batch-size 8 "
        "--train-iters 3 --lr 1e-2 --mock-data --pipeline-model-parallel-size 2")


def _cfg(extra: str = "", layers: str = "", world: int = 2):
    argv = TINY if not layers else TINY.replace("--encoder-num-layers 2 --decoder-num-layers 2", layers)
    return parse_t5_args((argv + " " + extra).split(), world, cuda=False)


def fastest_split(times: dict) -> str:
    """The key of the fastest split in a placement search's ``compared`` (ties to the first)."""
    ms = {k[:-len("_ms")]: v for k, v in times.items() if k.endswith("_ms")}
    return min(ms, key=ms.get)


def _roles(p):
    return (p.enc_start, p.enc_layers, p.dec_start, p.dec_layers, p.embeds_encoder, p.embeds_decoder,
            p.ends_encoder, p.is_last)


def test_placement_decides_every_stages_layers_and_roles():
    # The default is Megatron's even split, as before the flag existed.
    even = _cfg()
    assert even.placement_flag == "even" and str(even.stage_placement()) == "2+0,0+2"
    assert [_roles(p) for p in stage_places(even.planner_model(), 2)] == \
        [_roles(p) for p in stage_places(even.planner_model(), 2, even.stage_placement())]
    # Stage 0 holds the whole encoder and the first decoder layer: it embeds both (one
    # embedding), stage 1 holds no embedding and the tied output layer.
    cfg = _cfg("--dynapipe-placement 2+1,0+1")
    places = stage_places(cfg.planner_model(), 2, cfg.stage_placement())
    assert [_roles(p) for p in places] == [(0, 2, 0, 1, True, True, True, False),
                                           (2, 0, 1, 1, False, False, False, True)]
    assert t5_global_name(places[1], "decoder.layers.0.mlp.linear_fc1.weight", True) == \
        "decoder.layers.1.mlp.linear_fc1.weight"
    # Uneven encoder and decoder (3 + 2 layers do not split evenly over 2 stages: Megatron's
    # split is refused, a written-out or chosen one is not).
    with pytest.raises(DynaPipeError, match="cannot be split evenly"):
        _cfg(layers="--encoder-num-layers 3 --decoder-num-layers 2")
    odd = _cfg("--dynapipe-placement 1+0,2+2", layers="--encoder-num-layers 3 --decoder-num-layers 2")
    assert odd.base.model.num_layers == 5
    assert [_roles(p) for p in stage_places(odd.planner_model(), 2, odd.stage_placement())] == \
        [(0, 1, 0, 0, True, False, False, False), (1, 2, 0, 2, False, True, True, True)]
    # PP3: an encoder-only stage in the middle; the decoder's embedding copy on stage 2.
    pp3 = _cfg("--dynapipe-placement 1+0,2+0,0+2 --pipeline-model-parallel-size 3",
               layers="--encoder-num-layers 3 --decoder-num-layers 2", world=3)
    places = stage_places(pp3.planner_model(), 3, pp3.stage_placement())
    assert [(p.enc_start, p.enc_layers, p.dec_layers, p.embeds_decoder) for p in places] == \
        [(0, 1, 0, False), (1, 2, 0, False), (3, 0, 2, True)]
    assert t5_global_name(places[1], "encoder.layers.1.self_attention.linear_qkv.weight", True) == \
        "encoder.layers.2.self_attention.linear_qkv.weight"


def test_placement_flag_errors_name_the_value():
    for value, text in (("2+2,0+1", "holds 2 encoder \\+ 3 decoder"), ("4,0", "write ENC\\+DEC"),
                        ("2+0,0+1,0+1", "names 3 stages"), ("2+0,x", "is not a layer count"),
                        ("0+2,2+0", "encoder layers must all come before")):
        with pytest.raises(DynaPipeError, match=f"--dynapipe-placement {re.escape(repr(value))}.*{text}"):
            _cfg(f"--dynapipe-placement {value}")
    # Interleaved chunks are trained: the keyword and a chunked split written out.
    for value in ("interleaved", "1+0,1+0|0+1,0+1"):
        placement = _cfg(f"--dynapipe-placement {value}").stage_placement()
        assert placement.chunks == 2 and str(placement) == "1+0,1+0|0+1,0+1"
    auto = _cfg("--dynapipe-placement auto")
    assert auto.placement is None
    with pytest.raises(DynaPipeError, match="chosen at start-up"):
        auto.stage_placement()


def test_auto_placement_is_chosen_from_the_runs_batches_and_priced_by_the_planner():
    from dynapipe.runtime.plan_source import IterationPlanner
    from megatron_integration.t5_placement import planner_cost_model

    # Long inputs, short targets, 4 + 4 layers: the even split's encoder stage is the bottleneck.
    cfg = _cfg("--dynapipe-placement auto --encoder-seq-length 1024 --global-batch-size 16 --use-dynapipe",
               layers="--encoder-num-layers 4 --decoder-num-layers 4")
    batches = first_global_batches(cfg)
    assert len(batches) == 3 and all(b.shape == (16, 2) for b in batches)  # --train-iters 3
    plan = choose_t5_placement(cfg, 2, 1)
    chosen = plan.chosen.placement
    assert chosen != StagePlacement.even(cfg.planner_model(), 2)
    assert plan.chosen.bottleneck_ms < plan.before.bottleneck_ms
    # The best contiguous split and the interleaved ones were all simulated; the fastest is chosen.
    times = plan.compared
    assert StagePlacement.parse(times["interleaved"], cfg.planner_model(), 2).chunks == 2
    assert times["contiguous_ms"] > 0 and times["interleaved_ms"] > 0
    assert str(chosen) == times[fastest_split(times)]
    # Deterministic: every rank computes the same split from the same batches and cost model.
    resolved = resolve_t5_placement(cfg, 2, 1)
    assert resolved.stage_placement() == chosen == choose_t5_placement(cfg, 2, 1).chosen.placement
    # The planner workers price and compile for it; the plans say so, and a stage built
    # with another split refuses them.
    from dataclasses import replace

    from dynapipe.config import load_device_config
    from dynapipe.runtime.plan_source import PlannerSettings

    settings = PlannerSettings(model=cfg.planner_model(), device=load_device_config("cpu"), num_stages=2,
                               seq_length=1024, placement=chosen)
    planned = IterationPlanner(settings).plan(batches[0], 0)[0]
    assert all(StagePlacement.from_json(p.meta["placement"], cfg.planner_model()) == chosen for p in planned)
    check_plan_placement(planned[0], chosen, cfg.planner_model(), 0)
    with pytest.raises(DynaPipeError, match=re.escape(f"iteration 6: the plan was made for stage placement {chosen} "
                                                      f"but this run's stages hold 4+0,0+4")):
        check_plan_placement(planned[1], StagePlacement.even(cfg.planner_model(), 2), cfg.planner_model(), 5)
    # An even plan (no meta key) against non-even stages is refused too.
    even_plan = IterationPlanner(replace(settings, placement=None)).plan(batches[0], 0)[0][0]
    assert "placement" not in even_plan.meta
    with pytest.raises(DynaPipeError, match="made for stage placement 4\\+0,0\\+4"):
        check_plan_placement(even_plan, chosen, cfg.planner_model(), 0)
    assert planner_cost_model(cfg, 2).placement == StagePlacement.even(cfg.planner_model(), 2)


def test_auto_placement_under_tensor_parallelism_is_priced_per_tp_rank():
    from megatron_integration.t5_placement import planner_cost_model

    layers = "--encoder-num-layers 4 --decoder-num-layers 4"
    args = "--dynapipe-placement auto --encoder-seq-length 1024 --global-batch-size 16 --use-dynapipe"
    cfg = parse_t5_args((TINY.replace("--encoder-num-layers 2 --decoder-num-layers 2", layers) + " " + args
                         + " --tensor-model-parallel-size 2").split(), 4, cuda=False)
    one = _cfg(args, layers=layers)
    # Each TP rank computes half a layer (plus the collectives): a stage costs less than at TP1.
    batch = first_global_batches(one)[0]
    tp_cost, one_cost = planner_cost_model(cfg, 2), planner_cost_model(one, 2)
    assert tp_cost.tp.size == 2
    assert (tp_cost.stage_cost([2], [1024], [64], stage=0).time_ms
            < one_cost.stage_cost([2], [1024], [64], stage=0).time_ms)
    # Every split is simulated per TP rank, and the fastest is chosen.
    plan = choose_t5_placement(cfg, 2, 1, batches=[batch])
    times = plan.compared
    assert str(plan.chosen.placement) == times[fastest_split(times)]
    assert plan.chosen.placement != StagePlacement.even(cfg.planner_model(), 2)


def test_resume_with_another_placement_is_refused():
    model = _cfg().planner_model()
    placed = StagePlacement.parse("2+1,0+1", model, 2)
    even = StagePlacement.even(model, 2)
    check_checkpoint_placement(checkpoint_record(placed), placed, model, "ckpt/model_optim_rng.pt")
    check_checkpoint_placement({}, even, model, "ckpt/model_optim_rng.pt")  # saved before placements were recorded
    with pytest.raises(DynaPipeError, match="ckpt/x.pt: saved with stage placement 2\\+0,0\\+2; this run's stages "
                                            "hold 2\\+1,0\\+1. Resume with --dynapipe-placement 2\\+0,0\\+2"):
        check_checkpoint_placement({}, placed, model, "ckpt/x.pt")
    with pytest.raises(DynaPipeError, match="saved with stage placement 2\\+1,0\\+1"):
        check_checkpoint_placement(checkpoint_record(placed), even, model, "ckpt/x.pt")


def test_bench_t5_runs_one_placement_and_simulates_the_bubble_before_and_after():
    from megatron_integration.bench_t5 import _placement
    from megatron_integration.bench_t5_placement import t5_bench_placement

    layers = "--encoder-num-layers 4 --decoder-num-layers 4"
    argv = (TINY.replace("--encoder-num-layers 2 --decoder-num-layers 2", layers)
            + " --encoder-seq-length 1024 --global-batch-size 16").split()
    cfg = parse_t5_args(argv + ["--use-dynapipe"], 2, cuda=False)
    auto = t5_bench_placement(cfg, 2, 1)
    chosen = choose_t5_placement(cfg, 2, 1).chosen.placement
    assert auto["placement"] == str(chosen) and auto["source"] == "auto"
    even, placed = auto["simulated"]["even"], auto["simulated"]["placed"]
    assert (even["placement"], placed["placement"]) == ("4+0,0+4", str(chosen))
    # The planner's own estimate: the chosen split idles the pipeline less than Megatron's.
    assert placed["bubble_fraction"] < even["bubble_fraction"] and placed["simulated_ms"] < even["simulated_ms"]
    # A placement on the command line is what every run builds.
    given = _placement(argv + ["--dynapipe-placement", "3+0,1+4"], 2, 1)
    assert (given["placement"], given["source"]) == ("3+0,1+4", "--dynapipe-placement")
    assert given["simulated"]["placed"]["placement"] == "3+0,1+4"


def test_bench_t5_compute_floor_is_taken_over_the_timed_batches_per_replica():
    from dynapipe.cost.compute_floor import compute_floor_ms
    from megatron_integration.bench_report import format_compute_floor
    from megatron_integration.bench_t5_profile import compute_floor_check
    from megatron_integration.t5_placement import first_global_batches, planner_cost_model

    cfg = _cfg("--use-dynapipe")
    cm = planner_cost_model(cfg, 2)
    timed = first_global_batches(cfg, 3)[1:]
    floor = sum(compute_floor_ms(cm, b) for b in timed) / len(timed)
    checks = {"dynapipe": {"stages": [{"predicted_ms": floor * 0.6}, {"predicted_ms": floor * 0.5}]},
              "packing": {"stages": [{"predicted_ms": floor}, {"predicted_ms": floor}]},
              "padding": {}}  # a run without traces has no prediction
    out = compute_floor_check(cfg, cm, checks, warmup=1, replicas=1)
    assert out["iterations"] == 2 and out["floor_ms"] == pytest.approx(floor, abs=0.05)
    assert out["over_floor"] == {"dynapipe": pytest.approx(1.1, rel=0.02), "packing": pytest.approx(2.0, rel=0.02)}
    # Two data-parallel replicas share each global batch.
    assert compute_floor_check(cfg, cm, checks, 1, 2)["floor_ms"] == pytest.approx(floor / 2, abs=0.05)
    line = format_compute_floor(out, "packing")
    assert "packing's compute is 2.00x the floor, the most any batching gains" in line and "dynapipe" in line
    assert "gains" not in format_compute_floor(out, None)


def test_bench_t5_prices_the_data_parallel_replicas_of_the_run_under_tp(monkeypatch):
    # 4 ranks at TP2 x PP2 are one replica; the bench used to price nproc / PP = 2 of them.
    import megatron_integration.t5_placement as t5_placement
    from megatron_integration.bench_t5_placement import t5_bench_placement

    seen = []
    real = t5_placement.choose_t5_placement

    def recording(cfg, pp, dp, **kw):
        seen.append(dp)
        return real(cfg, pp, dp, **kw)

    monkeypatch.setattr(t5_placement, "choose_t5_placement", recording)
    cfg = parse_t5_args(TINY.split() + ["--use-dynapipe", "--tensor-model-parallel-size", "2"], 4, cuda=False)
    assert cfg.base.parallel.data_parallel_size == 1
    t5_bench_placement(cfg, 4, 1)
    assert seen == [1]


def test_interleaved_placement_refusals_name_the_training_flags_and_the_reason():
    from megatron_integration.t5_placement import parse_t5_placement

    small = _cfg(layers="--encoder-num-layers 1 --decoder-num-layers 1").planner_model()
    with pytest.raises(DynaPipeError, match=r"^--dynapipe-placement interleaved puts an encoder and a decoder layer "
                                            r"on every rank, but model .* has 1 encoder and 1 decoder layer\(s\) for 2 "
                                            r"stages; --pipeline-model-parallel-size is 2; or use even or auto\.$"):
        parse_t5_placement("interleaved", small, 2)
    with pytest.raises(DynaPipeError, match=r"^--dynapipe-placement interleaved .* needs at least 2 stages; "
                                            r"--pipeline-model-parallel-size is 1"):
        parse_t5_placement("interleaved", _cfg().planner_model(), 1)
    # A mistyped keyword is offered every other choice, interleaved among them.
    with pytest.raises(DynaPipeError, match=r"or use even, interleaved or auto\.$"):
        parse_t5_placement("Interleaved", _cfg().planner_model(), 2)
