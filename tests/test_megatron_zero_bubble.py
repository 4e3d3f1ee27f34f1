"""``--dynapipe-schedule zb-h1`` through megatron-core: the backward split into an input part and
a weight part trains the padding baseline's losses (PP2, fp32, 1e-5), the executed traces show
the split on every rank with each weight part after its input part, and what the split cannot
honour yet is refused at start-up. T5 too (the session's T5 job)."""
import json
import os
import re

import pytest

from dynapipe.errors import DynaPipeError
from megatron_integration.arguments import parse_training_args
from test_megatron_dynapipe import LLAMA, TINY, run

ZB = "--use-dynapipe --dynapipe-schedule zb-h1 --dynapipe-trace-dir {tmp}/zb-traces"


@pytest.mark.megatron_runs(("", 2), (ZB, 2))
def test_zero_bubble_trains_the_padding_losses_and_splits_every_backward(request, tmp_path_factory):
    padding = run("", 2, request)
    zb = run(ZB, 2, request)
    assert zb["method"] == "dynapipe" and len(zb["losses"]) == 3
    assert zb["losses"] == pytest.approx(padding["losses"], abs=1e-5, rel=1e-5)
    assert zb["loss_tokens"] == padding["loss_tokens"]
    traces = os.path.join(str(tmp_path_factory.getbasetemp()), "zb-traces")
    for rank in range(2):
        with open(os.path.join(traces, f"rank{rank:03d}.json")) as f:
            events = json.load(f)
        events = events["traceEvents"] if isinstance(events, dict) else events
        ops = [(e["args"]["iteration"], e["name"].split()[0]) for e in events
               if e.get("ph") == "X" and e.get("cat", "").startswith(("forward", "backward"))]
        assert ops and not any(name.startswith("B") and name[1].isdigit() for _, name in ops), ops[:8]
        for it in {i for i, _ in ops}:
            names = [name for i, name in ops if i == it]
            inputs = [n[2:] for n in names if n.startswith("BI")]
            weights = [n[2:] for n in names if n.startswith("BW")]
            assert sorted(inputs) == sorted(weights) == sorted(n[1:] for n in names if n.startswith("F"))
            assert all(names.index("BI" + m) < names.index("BW" + m) for m in inputs), names


def test_zero_bubble_trains_t5_like_padding(pp2):
    # The session's T5 job: its last run is DynaPipe on zb-h1 for two iterations; the encoder
    # output's gradient reaches the encoder stage through the input parts.
    zb, padding = pp2[34], pp2[0]
    assert zb["method"] == "dynapipe" and len(zb["losses"]) == 2
    assert zb["losses"] == pytest.approx(padding["losses"][:2], abs=1e-5, rel=1e-5)
    assert zb["loss_tokens"] == padding["loss_tokens"][:2]


def test_virtual_pipeline_flags_are_refused():
    argv = (TINY + " --use-dynapipe --dynapipe-schedule zb-h1 --num-layers 4 "
                   "--num-virtual-stages-per-pipeline-rank 2").split()
    with pytest.raises(DynaPipeError, match="plain pipeline"):
        parse_training_args(argv, 2, cuda=False)


ZB_OVERLAP = f"{LLAMA} --use-dynapipe --dynapipe-schedule zb-h1 --overlap-grad-reduce --ddp-bucket-size 20000"


@pytest.mark.megatron_runs((LLAMA, 4), (ZB_OVERLAP, 4))
def test_zero_bubble_overlaps_the_reduction_on_pp2_x_dp2(request):
    # Stage 1 runs the weight part of the next-to-last micro-batch after the last input part:
    # under no_sync, so each bucket's reduction starts in the last weight part with every
    # replica's gradients complete (a reduction started early would lose them: other losses).
    padding, zb = run(LLAMA, 4, request), run(ZB_OVERLAP, 4, request)
    assert zb["method"] == "dynapipe" and len(zb["losses"]) == 3
    assert zb["losses"] == pytest.approx(padding["losses"], abs=1e-5, rel=1e-5)


@pytest.mark.parametrize("placement", ["interleaved", "1+0,1+0|0+1,0+1"])
def test_t5_chunked_placements_are_refused(placement):
    from megatron_integration.t5_arguments import parse_t5_args
    from t5_job import TINY as T5_TINY

    argv = (T5_TINY + f" --use-dynapipe --dynapipe-schedule zb-h1 --dynapipe-placement {placement}").split()
    with pytest.raises(DynaPipeError, match="contiguous placements; --dynapipe-placement " + re.escape(placement)):
        parse_t5_args(argv, 2, cuda=False)


def test_t5_auto_placement_chooses_among_contiguous_splits_for_zero_bubble(monkeypatch):
    import megatron_integration.t5_placement as t5p
    from megatron_integration.t5_arguments import parse_t5_args
    from t5_job import TINY as T5_TINY

    seen = {}
    monkeypatch.setattr("dynapipe.schedule.placement.choose_placement_kind",
                        lambda *a, **kw: seen.setdefault("chunks", kw["chunks"]))
    for schedule, chunks in (("zb-h1", 1), ("auto", 2)):
        seen.clear()
        cfg = parse_t5_args((T5_TINY + f" --use-dynapipe --dynapipe-schedule {schedule} "
                                       f"--dynapipe-placement auto").split(), 2, cuda=False)
        t5p.choose_t5_placement(cfg, 2, 1, batches=[])
        assert seen["chunks"] == chunks, schedule


def test_transformer_engine_stages_are_refused_at_start_up(monkeypatch):
    # On GPUs with Transformer Engine the stages use its layers (--transformer-impl local is refused
    # there), whose weight gradients the split does not defer: refused before anything is built.
    import megatron_integration.model as model_specs

    monkeypatch.setattr(model_specs, "te_available", lambda: True)
    with pytest.raises(DynaPipeError, match="with Transformer Engine installed"):
        parse_training_args((TINY + " --use-dynapipe --dynapipe-schedule zb-h1").split(), 2, cuda=True)
    parse_training_args((TINY + " --use-dynapipe --dynapipe-schedule 1f1b").split(), 2, cuda=True)


def test_auto_splits_the_backward_where_the_stages_can(monkeypatch):
    # auto may choose zb-h1 for any iteration, so its stages get the split and its planner tries
    # zb-h1, except on Transformer Engine layers or virtual-pipeline chunks (auto then keeps to
    # the other schedules instead of refusing).
    import megatron_integration.model as model_specs
    from megatron_integration.dynapipe_step import planner_settings
    from megatron_integration.initialize import RankInfo

    def split(extra: str, cuda: bool = False) -> bool:
        cfg = parse_training_args((TINY + " --use-dynapipe " + extra).split(), 2, cuda=cuda)
        return cfg.dynapipe.split_backward

    assert split("") and split("--dynapipe-schedule zb-h1")
    assert not split("--dynapipe-schedule 1f1b") and not split("--dynapipe-schedule adaptive")
    assert not split("--num-layers 4 --num-virtual-stages-per-pipeline-rank 2")
    # The baselines' plans are whole 1F1B (T5's run through the executor): no split to slow them.
    assert not parse_training_args(TINY.split(), 2, cuda=False).dynapipe.split_backward
    monkeypatch.setattr(model_specs, "te_available", lambda: True)
    assert not split("", cuda=True)
    monkeypatch.setattr(model_specs, "te_available", lambda: False)
    cfg = parse_training_args((TINY + " --use-dynapipe").split(), 2, cuda=False)
    info = RankInfo(rank=0, world_size=2, pp_rank=0, pp_size=2, dp_rank=0, dp_size=1, tp_rank=0, tp_size=1,
                    device=None)
    assert planner_settings(cfg, info).split_backward


def test_zero_bubble_needs_the_planner():
    with pytest.raises(DynaPipeError, match="--dynapipe-schedule zb-h1 is read by the DynaPipe planner"):
        parse_training_args((TINY + " --dynapipe-schedule zb-h1").split(), 2, cuda=False)
