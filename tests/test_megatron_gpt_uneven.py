"""Megatron-LM's uneven pipeline splits for GPT: ``--decoder-first-pipeline-num-layers``,
``--decoder-last-pipeline-num-layers``, ``--account-for-{embedding,loss}-in-pipeline-split``
and ``--pipeline-model-parallel-layout``.

The split derived from the flags is checked against megatron-core's own layer counts; one
2-rank job trains the same 6-layer model on the even split, on ``4,2`` (padding), on ``2,4``
(DynaPipe, cut with a ``torch_dist`` checkpoint and resumed on the even split) and on an
interleaved layout ``3,1 | 1,1`` (DynaPipe): every run gives the even split's losses (fp32,
dropout 0, 1e-5), and each rank holds the layers its split gives it.
"""
import argparse
import re

import pytest

from dynapipe.errors import DynaPipeError
from megatron_integration.args_layout import PipelineSplit, layout_layers, pipeline_split_from_args
from megatron_integration.arguments import parse_training_args
from megatron_integration.jobs import run_trainings

BASE = ("--hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 128 --vocab-size 256 --micro-batch-size 2 "
        "--lr 1e-2 --mock-data --hidden-dropout 0 --attention-dropout 0 --log-interval 1 --seed 7 --train-iters 3 "
        "--num-layers 6 --seq-length 128 --global-batch-size 8 --pipeline-model-parallel-size 2")
TIMEOUT = 300


def flags(**kw) -> argparse.Namespace:
    base = dict(num_layers=6, num_layers_per_virtual_pipeline_stage=None, num_virtual_stages_per_pipeline_rank=None,
                pipeline_model_parallel_layout=None, decoder_first_pipeline_num_layers=None,
                decoder_last_pipeline_num_layers=None, account_for_embedding_in_pipeline_split=False,
                account_for_loss_in_pipeline_split=False)
    base.update(kw)
    return argparse.Namespace(**base)


def megatron_core_layers(n, pp, chunks, first, last, emb, loss) -> list[int]:
    """Layers megatron-core builds on every virtual stage for these settings (its own function)."""
    import torch
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=n, hidden_size=64, num_attention_heads=4, pipeline_model_parallel_size=pp,
                               virtual_pipeline_model_parallel_size=chunks if chunks > 1 else None,
                               num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last,
                               account_for_embedding_in_pipeline_split=emb, account_for_loss_in_pipeline_split=loss,
                               use_cpu_initialization=True, pipeline_dtype=torch.float32)
    return [get_num_layers_to_build(config, vp_stage=c if chunks > 1 else None, pp_rank=p)
            for c in range(chunks) for p in range(pp)]


CASES = [(n, pp, v, first, last, emb, loss)
         for n, pp, v in ((6, 2, 1), (8, 2, 2), (12, 3, 2), (10, 4, 1), (16, 4, 2))
         for first, last in ((None, None), (None, 2), (4, None), (2, 2), (1, 3))
         for emb, loss in ((False, False), (True, False), (False, True), (True, True))
         if not ((first or last) and (emb or loss))]


@pytest.mark.parametrize("n, pp, v, first, last, emb, loss", CASES)
def test_the_split_is_megatron_cores(n, pp, v, first, last, emb, loss):
    args = flags(num_layers=n, num_virtual_stages_per_pipeline_rank=v if v > 1 else None,
                 decoder_first_pipeline_num_layers=first, decoder_last_pipeline_num_layers=last,
                 account_for_embedding_in_pipeline_split=emb, account_for_loss_in_pipeline_split=loss)
    try:
        split = pipeline_split_from_args(args, pp)
    except DynaPipeError:
        # Refused: megatron-core refuses it too, or it leaves a virtual stage without a layer.
        try:
            want = megatron_core_layers(n, pp, v, first, last, emb, loss)
        except (AssertionError, ValueError, ZeroDivisionError):
            return
        assert min(want) < 1, (want, "refused a split megatron-core builds with a layer on every stage")
        return
    want = megatron_core_layers(n, pp, v, first, last, emb, loss)
    got = list(split.layers) if split.layers is not None else [n // (pp * v)] * (pp * v)
    assert got == want
    assert split.chunks == (v if v > 1 else None)


def test_a_layout_string_reads_as_megatron_core_reads_it():
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    for text, pp, n in (("Ettt|(tt|)*2,ttL", 4, 9), ("Et*3|t|tt|tL", 2, 7), ("E,t|t|t|t,L", 2, 4)):
        want = [sum(1 for x in stage if x.name == "decoder")
                for stage in PipelineParallelLayerLayout.parse_str_to_list(text)]
        assert layout_layers(text, pp, n) == want
    assert pipeline_split_from_args(flags(pipeline_model_parallel_layout="Ett|t|t|ttL"), 2) == \
        PipelineSplit(2, (2, 1, 1, 2))
    # A layout that is the even split is the even split (the plain pipeline's path).
    assert pipeline_split_from_args(flags(pipeline_model_parallel_layout="Ettt|tttL"), 2) == PipelineSplit()


@pytest.mark.parametrize("kw, needle", [
    (dict(pipeline_model_parallel_layout="tEtt|tttL"), "embedding E must be the first"),
    (dict(pipeline_model_parallel_layout="Ettt|ttL"), "places 5 transformer layers; --num-layers is 6"),
    (dict(pipeline_model_parallel_layout="Ettt|tt|tL"), "3 stages, not a multiple"),
    (dict(pipeline_model_parallel_layout="Ettt|ttmL"), "multi-token prediction"),
    (dict(pipeline_model_parallel_layout="Ettt|tttL", decoder_first_pipeline_num_layers=3), "both given"),
    (dict(pipeline_model_parallel_layout="Ettt|tttL", num_virtual_stages_per_pipeline_rank=2), "give one"),
    (dict(decoder_first_pipeline_num_layers=4, account_for_loss_in_pipeline_split=True), "not both"),
    (dict(decoder_first_pipeline_num_layers=4, num_layers_per_virtual_pipeline_stage=1),
     "--num-virtual-stages-per-pipeline-rank"),
    (dict(decoder_first_pipeline_num_layers=7), "give the first and last stages 7 layers, more than --num-layers 6"),
    (dict(decoder_first_pipeline_num_layers=0), "must be at least 1"),
    (dict(decoder_first_pipeline_num_layers=3, num_virtual_stages_per_pipeline_rank=2),
     "pipeline rank 0 holds 3 layers"),
    (dict(account_for_embedding_in_pipeline_split=True), "plus the 1 counted"),
    (dict(pipeline_model_parallel_layout="E|ttt|ttt|L"), r"virtual stage 0 \(rank 0, chunk 0\) would hold no"),
])
def test_splits_this_build_cannot_run_are_refused(kw, needle):
    with pytest.raises(DynaPipeError, match=needle):
        pipeline_split_from_args(flags(**kw), 2)


@pytest.mark.parametrize("extra, needle", [
    ("--dynapipe-placement auto --pipeline-model-parallel-layout Ettt|tttL", "auto and --pipeline-model-parallel"),
    ("--dynapipe-placement auto --decoder-last-pipeline-num-layers 2", "auto and --decoder-last"),
    ("--dynapipe-placement 4,2", "a GPT takes even or auto"),
    ("--dynapipe-placement auto --pipeline-model-parallel-size 1", "needs --pipeline-model-parallel-size 2"),
])
def test_auto_split_refusals(extra, needle):
    with pytest.raises(DynaPipeError, match=needle):
        parse_training_args(f"{BASE} {extra}".split(), 2)


def test_auto_split_leaves_a_heavy_output_layer_fewer_layers():
    """The planner's cost model prices the output layer: a 4096-token vocabulary on hidden 64 weighs
    more than four transformer layers, so ``auto`` gives the last stage one layer; a 256-token one
    leaves Megatron's even split. Pure: no process group, the same choice every time."""
    from megatron_integration.placement_auto import choose_gpt_split, layout_text, resolve_gpt_split

    auto = f"{BASE} --use-dynapipe --dynapipe-placement auto"
    cfg = parse_training_args(f"{auto} --vocab-size 4096".split(), 2)
    assert cfg.parallel.auto_split and cfg.parallel.stage_layers is None
    resolved, line = resolve_gpt_split(cfg)
    assert resolved.parallel.stage_layers == (5, 1) and "5,1" in line and "Ettttt|tL" in line
    plan = choose_gpt_split(cfg)
    assert plan.chosen.bottleneck_ms < plan.before.bottleneck_ms
    assert plan.before.placement.decoder_layers == (3, 3)
    assert resolve_gpt_split(parse_training_args(auto.split(), 2))[0].parallel.stage_layers is None
    # On two chunks a rank: every virtual stage chosen, the last one lightest.
    chunked = resolve_gpt_split(parse_training_args(
        f"{auto} --vocab-size 4096 --num-layers 8 --num-virtual-stages-per-pipeline-rank 2".split(), 2))[0]
    layers = chunked.parallel.stage_layers
    assert len(layers) == 4 and sum(layers) == 8 and layers[-1] == min(layers)
    assert chunked.parallel.virtual_pipeline_model_parallel_size == 2
    assert layout_layers(layout_text(layers), 2, 8) == list(layers)
    # Given splits are left as given.
    given = parse_training_args(f"{BASE} --decoder-last-pipeline-num-layers 2".split(), 2)
    assert resolve_gpt_split(given) == (given, None)


def test_t5_takes_its_split_as_a_placement():
    from megatron_integration.t5_arguments import parse_t5_args

    argv = ("--encoder-num-layers 2 --decoder-num-layers 2 --hidden-size 64 --num-attention-heads 4 "
            "--encoder-seq-length 128 --decoder-seq-length 32 --micro-batch-size 2 --global-batch-size 8 "
            "--train-iters 2 --lr 1e-3 --mock-data --pipeline-model-parallel-size 2 "
            "--decoder-first-pipeline-num-layers 3").split()
    with pytest.raises(DynaPipeError, match="--dynapipe-placement"):
        parse_t5_args(argv, 2)


def test_the_planner_prices_the_split_megatron_core_builds():
    from megatron_integration.dynapipe_step import gpt_placement

    cfg = parse_training_args(f"{BASE} --use-dynapipe --decoder-last-pipeline-num-layers 4".split(), 2)
    assert cfg.parallel.stage_layers == (2, 4) and cfg.parallel.rank_layers(6) == [2, 4]
    placement = gpt_placement(cfg, argparse.Namespace(pp_size=2))
    assert placement.decoder_layers == (2, 4) and placement.chunks == 1
    cfg = parse_training_args(f"{BASE} --use-dynapipe --pipeline-model-parallel-layout Ettt|t|t|tL".split(), 2)
    placement = gpt_placement(cfg, argparse.Namespace(pp_size=2))
    assert placement.decoder_layers == (3, 1, 1, 1) and placement.chunks == 2
    assert cfg.parallel.rank_layers(6) == [4, 2] and cfg.parallel.virtual_pipeline_model_parallel_size == 2


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("gpt-uneven-ckpt")
    dyn = BASE + " --use-dynapipe"
    evaluate = " --split 80,10,10 --eval-interval 2 --eval-iters 1"
    runs = {"even": BASE + evaluate, "first-4": BASE + " --decoder-first-pipeline-num-layers 4",
            "last-4-cut": dyn + f" --decoder-last-pipeline-num-layers 4 --exit-interval 2 --save {ckpt}",
            "resumed-even": dyn + f" --load {ckpt}",
            "layout-chunks": dyn + evaluate + " --pipeline-model-parallel-layout Ettt|t|t|tL"}
    # --dynapipe-placement auto on a model whose output layer outweighs four layers: padding, and
    # DynaPipe cut after 2 iterations (per-rank checkpoint) and resumed, choosing again.
    auto = " --vocab-size 4096 --dynapipe-placement auto"
    runs.update({"auto-padding": BASE + auto,
                 "auto-cut": dyn + auto + f" --exit-interval 2 --ckpt-format dynapipe --save {ckpt}/auto",
                 "auto-resumed": dyn + auto + f" --ckpt-format dynapipe --load {ckpt}/auto"})
    ranks = run_trainings([r.split() for r in runs.values()], 2, timeout_s=TIMEOUT)
    return dict(zip(runs, ranks))


def close(a: list, b: list, tol: float = 1e-5) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= tol * max(1.0, abs(y)) for x, y in zip(a, b))


def eval_values(run: dict) -> list[str]:
    return [line.split("lm loss value: ")[1].split(" ")[0] for line in run["eval_lines"] if "lm loss value" in line]


def params(run: list[dict]) -> list[int]:
    """Parameters each pipeline rank built (its printed count)."""
    out = []
    for rank in run:
        m = re.search(r"model parallel rank \(0, (\d)\): (\d+)", rank["printed"])
        out.append((int(m.group(1)), int(m.group(2))))
    return [n for _, n in sorted(out)]


def test_every_split_trains_the_even_splits_model(job):
    ref = job["even"][0]["losses"]
    assert close(job["first-4"][0]["losses"], ref), (job["first-4"][0]["losses"], ref)
    assert close(job["layout-chunks"][0]["losses"], ref), (job["layout-chunks"][0]["losses"], ref)
    # DynaPipe's evaluation plans run on the layout's chunks too.
    evals = [eval_values(job[k][0]) for k in ("even", "layout-chunks")]
    assert evals[0] and close([float(v) for v in evals[1]], [float(v) for v in evals[0]]), evals
    cut, resumed = job["last-4-cut"][0], job["resumed-even"][0]
    assert close(cut["losses"], ref[:2]) and resumed["start_iteration"] == 2
    # torch_dist keeps megatron-core's global layer keys: saved on 2,4, it resumes on 3,3.
    assert close(resumed["losses"], ref[2:]), (resumed["losses"], ref)


def test_auto_split_trains_and_resumes_on_the_split_it_chose(job):
    padding, cut, resumed = (job[k][0] for k in ("auto-padding", "auto-cut", "auto-resumed"))
    for run in (padding, cut, resumed):
        assert "pipeline split (transformer layers per virtual stage): 5,1 (--dynapipe-placement auto" \
            in run["printed"]
    assert close(cut["losses"], padding["losses"][:2]), (cut["losses"], padding["losses"])
    # The per-rank checkpoint recorded 5,1 and the resumed run chose 5,1 again, so it loaded.
    assert resumed["start_iteration"] == 2 and close(resumed["losses"], padding["losses"][2:])
    even, first4, auto = params(job["even"]), params(job["first-4"]), params(job["auto-padding"])
    layer = first4[0] - even[0]
    grown = (4096 - 256) * 64  # the embedding (rank 0) and its tied output copy (rank 1)
    assert auto == [even[0] + 2 * layer + grown, even[1] - 2 * layer + grown]


def test_each_rank_holds_the_layers_its_split_gives_it(job):
    even, first4, chunks = params(job["even"]), params(job["first-4"]), params(job["layout-chunks"])
    layer = first4[0] - even[0]  # rank 0 holds one layer more on 4,2 than on 3,3 ...
    assert layer > 0 and even[1] - first4[1] == layer  # ... and rank 1 one fewer
    assert chunks == first4  # the layout's chunks 3 + 1 and 1 + 1: 4 and 2 layers, as on 4,2
    assert sum(even) == sum(first4) == sum(chunks)
