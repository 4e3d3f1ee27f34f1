"""``--dynapipe-schedule zb-h1`` through megatron-core: the backward split into an input part and
a weight part trains the padding baseline's losses (PP2, fp32, 1e-5), the executed traces show
the split on every rank with each weight part after its input part, and what the split cannot
honour yet is refused at start-up. T5 too (the session's T5 job)."""
import json
import os

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
    # The session's T5 job: its last runs are DynaPipe on zb-h1 for two iterations, on the even
    # split and on the interleaved placement (interleaved-zb: the encoder chunk, then the decoder
    # chunk on each rank); the encoder output's gradient reaches the encoder through the input parts.
    padding = pp2[0]
    for zb, schedule in ((pp2[34], "zb-h1"), (pp2[35], "interleaved-zb")):
        assert zb["method"] == "dynapipe" and len(zb["losses"]) == 2
        assert zb["schedules"] == [schedule] * 2
        assert zb["losses"] == pytest.approx(padding["losses"][:2], abs=1e-5, rel=1e-5)
        assert zb["loss_tokens"] == padding["loss_tokens"][:2]


def test_virtual_pipeline_chunks_split_their_backward_too():
    # zb-h1 with virtual-pipeline chunks plans interleaved-zb (as 1f1b plans interleaved 1F1B).
    argv = (TINY + " --use-dynapipe --dynapipe-schedule zb-h1 --num-layers 4 "
                   "--num-virtual-stages-per-pipeline-rank 2").split()
    assert parse_training_args(argv, 2, cuda=False).dynapipe.split_backward


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
def test_t5_chunked_placements_take_the_split(placement):
    from megatron_integration.t5_arguments import parse_t5_args
    from t5_job import TINY as T5_TINY

    argv = (T5_TINY + f" --use-dynapipe --dynapipe-schedule zb-h1 --dynapipe-placement {placement}").split()
    cfg = parse_t5_args(argv, 2, cuda=False)
    assert cfg.placement.chunks == 2 and cfg.base.dynapipe.split_backward


def test_t5_auto_placement_weighs_both_kinds_for_zero_bubble(monkeypatch):
    import megatron_integration.t5_placement as t5p
    from megatron_integration.t5_arguments import parse_t5_args
    from t5_job import TINY as T5_TINY

    # The interleaved placement is priced with interleaved-zb, the contiguous ones with zb-h1;
    # only --overlap-grad-reduce keeps auto to contiguous splits.
    seen = {}
    monkeypatch.setattr("dynapipe.schedule.placement.choose_placement_kind",
                        lambda *a, **kw: seen.update(chunks=kw["chunks"], split=kw["split_backward"]))
    for extra, chunks in (("--dynapipe-schedule zb-h1", 2), ("", 2), ("--overlap-grad-reduce", 1)):
        seen.clear()
        cfg = parse_t5_args((T5_TINY + f" --use-dynapipe {extra} --dynapipe-placement auto").split(), 2, cuda=False)
        t5p.choose_t5_placement(cfg, 2, 1, batches=[])
        assert seen == {"chunks": chunks, "split": True}, extra


def test_transformer_engine_stages_are_refused_at_start_up(monkeypatch):
    # On GPUs --transformer-impl transformer_engine (Megatron-LM's default) builds the stages from its
    # layers, whose weight gradients the split does not defer: refused before anything is built.
    import megatron_integration.model as model_specs

    monkeypatch.setattr(model_specs, "te_available", lambda: True)
    with pytest.raises(DynaPipeError, match="Use --transformer-impl local"):
        parse_training_args((TINY + " --use-dynapipe --dynapipe-schedule zb-h1").split(), 2, cuda=True)
    cfg = parse_training_args((TINY + " --use-dynapipe --dynapipe-schedule 1f1b").split(), 2, cuda=True)
    assert cfg.model.transformer_impl == "transformer_engine"
    cfg = parse_training_args((TINY + " --use-dynapipe --dynapipe-schedule zb-h1 --transformer-impl local").split(),
                              2, cuda=True)
    assert cfg.model.transformer_impl == "local" and cfg.dynapipe.split_backward


def test_auto_splits_the_backward_where_the_stages_can(monkeypatch):
    # auto may choose zb-h1 (interleaved-zb on virtual-pipeline chunks) for any iteration, so its
    # stages get the split and its planner tries it, except on Transformer Engine layers (auto
    # then keeps to the other schedules instead of refusing).
    import megatron_integration.model as model_specs
    from megatron_integration.dynapipe_step import planner_settings
    from megatron_integration.initialize import RankInfo

    def split(extra: str, cuda: bool = False) -> bool:
        cfg = parse_training_args((TINY + " --use-dynapipe " + extra).split(), 2, cuda=cuda)
        return cfg.dynapipe.split_backward

    assert split("") and split("--dynapipe-schedule zb-h1")
    assert not split("--dynapipe-schedule 1f1b") and not split("--dynapipe-schedule adaptive")
    assert split("--num-layers 4 --num-virtual-stages-per-pipeline-rank 2")
    # The baselines' plans are whole 1F1B (T5's run through the executor): no split to slow them.
    assert not parse_training_args(TINY.split(), 2, cuda=False).dynapipe.split_backward
    monkeypatch.setattr(model_specs, "te_available", lambda: True)
    assert not split("", cuda=True) and split("--transformer-impl local", cuda=True)
    monkeypatch.setattr(model_specs, "te_available", lambda: False)
    cfg = parse_training_args((TINY + " --use-dynapipe").split(), 2, cuda=False)
    info = RankInfo(rank=0, world_size=2, pp_rank=0, pp_size=2, dp_rank=0, dp_size=1, tp_rank=0, tp_size=1,
                    device=None)
    assert planner_settings(cfg, info).split_backward


def test_zero_bubble_needs_the_planner():
    with pytest.raises(DynaPipeError, match="--dynapipe-schedule zb-h1 is read by the DynaPipe planner"):
        parse_training_args((TINY + " --dynapipe-schedule zb-h1").split(), 2, cuda=False)
