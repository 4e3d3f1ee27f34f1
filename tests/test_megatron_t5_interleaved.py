"""T5 on interleaved placements and T5 evaluation, from the shared 2-rank T5 job (``pp2`` in
``conftest.py``): every method trains the even split's losses on two chunks a rank, checkpoints
resume across placements, evaluation logs Megatron's lines, and the bench runs each baseline on
the contiguous split too beside an interleaved placement.
"""
import json

import pytest
import torch

from t5_job import dist_tensors as _dist_tensors


def test_t5_interleaved_placement_trains_every_method_like_the_even_split(pp2):
    padding, dynapipe, packing = pp2[10:13]
    assert (padding["method"], dynapipe["method"], packing["method"]) == ("padding", "dynapipe", "packing")
    # Two chunks a rank, one T5 stage each: the same model and losses as on the contiguous split.
    for run in (padding, dynapipe, packing):
        assert len(run["losses"]) == 2
        assert run["losses"] == pytest.approx(pp2[0]["losses"][:2], abs=1e-5, rel=1e-5)
        assert run["loss_tokens"] == pp2[0]["loss_tokens"][:2]
    assert sum(dynapipe["padded_tokens"]) < sum(padding["padded_tokens"])


def test_t5_evaluation_runs_every_method_forward_only_with_megatrons_lines(pp2):
    runs = pp2[15:19]
    assert [r["method"] for r in runs] == ["padding", "dynapipe", "packing", "dynapipe"]
    values = []
    for run in runs:
        lines = [line for line in run["eval_lines"] if "validation loss at" in line]
        # Megatron-LM's lines: after iteration 2, then after training on the validation and test sets.
        assert [line.split("|")[0].strip() for line in lines] == [
            "validation loss at iteration 2", "validation loss at iteration 3 on validation set",
            "validation loss at iteration 3 on test set"], run["eval_lines"]
        values.append([float(line.split("lm loss value:")[1].split("|")[0]) for line in lines])
        assert run["eval_path"] == "dynapipe-plans:3"  # forward-only plans through the executor
        assert len(run["losses"]) == 3
    # Forward only, no dropout: every method (and placement) gives the same validation losses and,
    # between evaluations, the same training losses.
    for v in values[1:]:
        assert v == pytest.approx(values[0], abs=1e-5, rel=1e-5)
    for run in runs[1:]:
        assert run["losses"] == pytest.approx(runs[0]["losses"], abs=1e-5, rel=1e-5)
    assert values[0][0] != values[0][1] and values[0][1] != values[0][2]  # other batches, other weights


def test_t5_interleaved_last_chunk_that_also_embeds_the_decoder(pp2):
    padding, dynapipe = pp2[13:15]
    assert (padding["method"], dynapipe["method"]) == ("padding", "dynapipe") and len(padding["losses"]) == 1
    assert dynapipe["losses"] == pytest.approx(padding["losses"], abs=1e-5, rel=1e-5)
    assert padding["losses"] != pp2[0]["losses"][:1]  # another model (3 + 2 layers)


def test_t5_interleaved_checkpoints_resume_and_load_at_any_placement(pp2, t5_dist, tmp_path):
    full = pp2[0]
    from_even, il_cut, to_even, cut, resumed = pp2[22:27]
    final = _dist_tensors(t5_dist / "full" / "iter_0000003", tmp_path)
    # Chunks of the interleaved split loaded from the even split's checkpoint by global keys
    # (optimizer state included): the same third step, every tensor of the even split's end.
    for run in (from_even, to_even, resumed):
        assert run["start_iteration"] == 2 and run["losses"] == pytest.approx(full["losses"][2:], abs=1e-6)
    assert il_cut["losses"] == pytest.approx(full["losses"][:2], abs=1e-6)
    assert cut["losses"] == pytest.approx(full["losses"][:2], abs=1e-6)
    got = _dist_tensors(t5_dist / "il_resumed" / "iter_0000003", tmp_path)
    assert set(got) == set(final)
    assert max((got[k] - final[k]).abs().max().item() for k in final) < 1e-6
    # from_il's first two steps ran on the interleaved split (another summation order: losses
    # agree within 2e-7). Adam's normalised step carries that into the weights at about 1e-6,
    # more on the few elements whose gradients are near zero (measured: 153 of 586k elements
    # above 1e-6, the largest 1.3e-5, on a bias). A checkpoint loaded into the wrong places
    # would be off by the weights' own size, on most elements.
    got = _dist_tensors(t5_dist / "from_il" / "iter_0000003", tmp_path)
    assert set(got) == set(final)
    diffs = [(got[k] - final[k]).abs().flatten() for k in final if torch.is_floating_point(final[k])]
    diffs = torch.cat(diffs)
    assert diffs.max().item() < 1e-4 and (diffs > 1e-6).float().mean().item() < 1e-3


def test_bench_t5_every_method_also_runs_contiguous_and_even_and_keeps_its_best():
    from megatron_integration.bench_t5_entries import t5_entries

    even = {"even": {"placement": "2+0,0+2"}}
    placed = {"placement": "1+0,1+0|0+1,0+1", "search": {"compared": {"contiguous": "1+0,1+2"}}, "simulated": even}
    entries = t5_entries(["dynapipe", "packing"], (1, 2), placed)
    assert [e.label for e in entries] == [
        "dynapipe", "dynapipe-contiguous", "dynapipe-even", "packing@mbs1", "packing@mbs1-contiguous",
        "packing@mbs1-even", "packing@mbs2", "packing@mbs2-contiguous", "packing@mbs2-even"]
    argv = entries[4].argv(["--dynapipe-placement", "1+0,1+0|0+1,0+1"])
    assert argv[argv.index("--dynapipe-placement", 2) + 1] == "1+0,1+2"  # the later flag wins
    assert entries[2].argv([])[-2:] == ["--dynapipe-placement", "even"] and entries[2].method == "dynapipe-even"
    # With dynapipe-even asked for, DynaPipe's even run is that method's, run once.
    labels = [e.label for e in t5_entries(["dynapipe", "dynapipe-even"], (1,), placed)]
    assert labels == ["dynapipe", "dynapipe-contiguous", "dynapipe-even"]
    # A contiguous placement tries the even split beside it, and the interleaved one the search
    # compared (where packing's stages balanced when DynaPipe's ran faster contiguous); the
    # even split itself nothing more.
    contiguous = {"placement": "1+0,1+2", "search": {"compared": {"contiguous": "1+0,1+2"}}, "simulated": even}
    assert [e.label for e in t5_entries(["packing"], (1,), contiguous)] == ["packing@mbs1", "packing@mbs1-even"]
    contiguous["search"]["compared"]["interleaved"] = "1+0,1+0|0+1,0+1"
    entries = t5_entries(["dynapipe", "packing"], (1,), contiguous)
    assert [e.label for e in entries] == ["dynapipe", "dynapipe-interleaved", "dynapipe-even", "packing@mbs1",
                                          "packing@mbs1-interleaved", "packing@mbs1-even"]
    argv = entries[4].argv(["--dynapipe-placement", "1+0,1+2"])
    assert argv[argv.index("--dynapipe-placement", 2) + 1] == "1+0,1+0|0+1,0+1"
    # Of the two interleaved splits the search simulated, the faster that fits is the one run.
    from megatron_integration.bench_t5_entries import fastest_interleaved

    compared = {"contiguous": "2+0,1+3", "interleaved": "P", "interleaved_ms": float("inf"),
                "interleaved_even": "E", "interleaved_even_ms": 9.0}
    assert fastest_interleaved(compared) == "E"
    assert fastest_interleaved({**compared, "interleaved_ms": 8.0}) == "P"
    assert fastest_interleaved({**compared, "interleaved_ms": None, "interleaved_even_ms": None}) == "P"
    assert fastest_interleaved({"contiguous": "2+0,1+3"}) is None
    three = {"placement": "2+0,1+3", "search": {"compared": compared}, "simulated": even}
    entries = t5_entries(["dynapipe"], (1,), three)
    assert [e.label for e in entries] == ["dynapipe", "dynapipe-interleaved", "dynapipe-even"]
    assert entries[1].split == "E"
    on_even = {"placement": "2+0,0+2", "simulated": even}
    assert [e.label for e in t5_entries(["packing"], (1,), on_even)] == ["packing@mbs1"]
    # On the even split, DynaPipe runs once for both of its methods; dynapipe-even alone keeps its run.
    from megatron_integration.bench_t5_entries import best_runs

    once = t5_entries(["dynapipe", "dynapipe-even", "packing"], (1,), on_even)
    assert [(e.label, e.also) for e in once] == [("dynapipe", ("dynapipe-even",)), ("packing@mbs1", ())]
    figures = {"dynapipe": {"real_tokens_per_s": 2.0}, "packing@mbs1": {"real_tokens_per_s": 1.0}}
    best = best_runs(once, figures, ["dynapipe", "dynapipe-even", "packing"])
    assert [(m, e.label) for m, (e, _) in best.items()] == [("dynapipe", "dynapipe"), ("dynapipe-even", "dynapipe"),
                                                             ("packing", "packing@mbs1")]
    assert [e.label for e in t5_entries(["dynapipe-even"], (1,), on_even)] == ["dynapipe-even"]
    assert [(e.label, e.also) for e in t5_entries(["dynapipe"], (1,), on_even)] == [("dynapipe", ())]


def test_bench_dynapipe_per_sample_runs_every_placement_with_its_attention_flag():
    """DynaPipe's per-sample rows are a method of their own in both benches: on every placement
    a DynaPipe run takes, planned by the DynaPipe executor with the padded rows' flag."""
    from megatron_integration.arguments import parse_training_args
    from megatron_integration.bench import Entry
    from megatron_integration.bench_presets import EXECUTOR_METHODS, PRESETS
    from megatron_integration.bench_t5 import T5_PRESETS
    from megatron_integration.bench_t5_entries import t5_entries
    from megatron_integration.dynapipe_step import planned_batching
    from megatron_integration.t5_arguments import parse_t5_args

    even = {"even": {"placement": "2+0,0+2"}}
    placed = {"placement": "1+0,1+0|0+1,0+1", "search": {"compared": {"contiguous": "1+0,1+2"}}, "simulated": even}
    entries = t5_entries(["dynapipe-per-sample"], (1, 2), placed)
    assert [e.label for e in entries] == ["dynapipe-per-sample", "dynapipe-per-sample-contiguous",
                                          "dynapipe-per-sample-even"]
    t5 = ("--encoder-num-layers 2 --decoder-num-layers 2 --hidden-size 64 --num-attention-heads 4 "
          "--encoder-seq-length 128 --decoder-seq-length 32 --global-batch-size 4 --train-iters 1 --lr 1e-4 "
          "--mock-data --pipeline-model-parallel-size 2").split()
    cfg = parse_t5_args(entries[0].argv(t5), 2)
    assert cfg.method == "dynapipe" and planned_batching(cfg.base) == "dynapipe-per-sample"
    assert all("dynapipe-per-sample" in T5_PRESETS[p].methods for p in ("tiny", "long"))
    # T5's packing with the schedule search: a baseline swept over sizes, planned by the executor's planner.
    searched = t5_entries(["packing-search"], (1, 2), placed)
    assert [e.label for e in searched][:2] == ["packing-search@mbs1", "packing-search@mbs1-contiguous"]
    cfg = parse_t5_args(searched[0].argv(t5), 2)
    assert cfg.base.dynapipe.enabled and planned_batching(cfg.base) == "packing-per-sample"
    assert cfg.base.micro_batch_size == 1 and cfg.base.per_sample_attention
    assert all("packing-search" in T5_PRESETS[p].methods for p in ("tiny", "long"))
    gpt = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 96 --max-position-embeddings 96 "
           "--vocab-size 128 --global-batch-size 4 --train-iters 1 --lr 1e-4 --mock-data").split()
    assert planned_batching(parse_training_args(Entry("dynapipe-per-sample").argv(gpt), 2)) == "dynapipe-per-sample"
    assert "dynapipe-per-sample" in EXECUTOR_METHODS
    assert all("dynapipe-per-sample" in PRESETS[p].methods for p in ("tiny", "representative"))


def test_bench_t5_baselines_also_run_on_their_own_best_split():
    from megatron_integration.bench_t5_entries import t5_entries

    even = {"even": {"placement": "2+0,0+2"}}
    placed = {"placement": "1+0,1+0|0+1,0+1", "search": {"compared": {"contiguous": "1+0,1+2"}}, "simulated": even,
              "baselines": {"packing@mbs1": "2+1,0+1", "packing@mbs2": "1+0,1+2", "padding@mbs1": "2+0,0+2"}}
    labels = [e.label for e in t5_entries(["dynapipe", "packing", "padding"], (1, 2), placed)]
    # packing@mbs1's own split is new; mbs2's is the contiguous one, padding's the even one: run once.
    assert labels == ["dynapipe", "dynapipe-contiguous", "dynapipe-even",
                      "packing@mbs1", "packing@mbs1-contiguous", "packing@mbs1-even", "packing@mbs1-own",
                      "packing@mbs2", "packing@mbs2-contiguous", "packing@mbs2-even",
                      "padding@mbs1", "padding@mbs1-contiguous", "padding@mbs1-even",
                      "padding@mbs2", "padding@mbs2-contiguous", "padding@mbs2-even"]
    own = next(e for e in t5_entries(["packing"], (1,), placed) if e.split_name == "own")
    argv = own.argv(["--dynapipe-placement", "1+0,1+0|0+1,0+1"])
    assert argv[len(argv) - 1 - argv[::-1].index("--dynapipe-placement") + 1] == "2+1,0+1"


def test_bench_t5_baseline_splits_balance_the_baselines_own_micro_batches():
    # Long inputs and short targets: the baselines' rows make the encoder layers the heavy ones, so
    # their own split moves encoder layers onto the decoder's stage, where the even split has none.
    from dynapipe.cost.placement import StagePlacement
    from megatron_integration.bench_t5_placement import baseline_splits
    from megatron_integration.t5_arguments import parse_t5_args
    from megatron_integration.t5_placement import first_global_batches
    from t5_job import TINY

    cfg = parse_t5_args((TINY + " --encoder-num-layers 4 --decoder-num-layers 4 --encoder-seq-length 512 "
                               "--decoder-seq-length 32 --max-position-embeddings 512").split(), 2)
    batches = first_global_batches(cfg, 2)
    splits = baseline_splits(cfg, 2, 1, batches, [("padding", 2), ("packing", 2)])
    assert set(splits) == {"padding@mbs2", "packing@mbs2"}
    model = cfg.planner_model()
    for spec in splits.values():
        placement = StagePlacement.parse(spec, model, 2)
        assert sum(placement.encoder_layers) == 4 and sum(placement.decoder_layers) == 4
    for spec in splits.values():
        assert StagePlacement.parse(spec, model, 2).encoder_layers[1] > 0, splits


def test_bench_t5_keeps_each_methods_fastest_run_dynapipes_even_one_included():
    from megatron_integration.bench_t5_entries import best_runs, t5_entries

    placed = {"placement": "1+0,1+0|0+1,0+1", "search": {"compared": {"contiguous": "1+0,1+2"}},
              "simulated": {"even": {"placement": "2+0,0+2"}}}
    entries = t5_entries(["dynapipe", "dynapipe-even", "packing"], (1, 2), placed)
    speed = {"dynapipe": 10.0, "dynapipe-contiguous": 9.0, "dynapipe-even": 12.0, "packing@mbs1": 6.0,
             "packing@mbs1-contiguous": 7.0, "packing@mbs1-even": 5.0, "packing@mbs2": 6.5,
             "packing@mbs2-contiguous": 4.0, "packing@mbs2-even": 3.0}
    figures = {k: {"real_tokens_per_s": v} for k, v in speed.items()}
    best = {m: e.label for m, (e, _) in best_runs(entries, figures, ["dynapipe", "dynapipe-even", "packing"]).items()}
    assert best == {"dynapipe": "dynapipe-even", "dynapipe-even": "dynapipe-even", "packing": "packing@mbs1-contiguous"}
    figures["dynapipe"]["real_tokens_per_s"] = 13.0
    assert best_runs(entries, figures, ["dynapipe", "dynapipe-even"])["dynapipe"][0].label == "dynapipe"
    # Asked for DynaPipe alone, its even run still counts; dynapipe-even is not reported.
    only = t5_entries(["dynapipe"], (1,), placed)
    figures["dynapipe"]["real_tokens_per_s"] = 1.0
    assert {m: e.label for m, (e, _) in best_runs(only, figures, ["dynapipe"]).items()} == {"dynapipe": "dynapipe-even"}


def test_bench_t5_runs_dynapipe_with_the_profile_before_calibration_beside_it(tmp_path):
    from megatron_integration.bench_t5_entries import UNCALIBRATED, best_runs, t5_entries
    from megatron_integration.t5_arguments import parse_t5_args

    from test_profile_t5 import t5_profile

    measured, calibrated = str(tmp_path / "measured.json"), str(tmp_path / "calibrated.json")
    for path in (measured, calibrated):  # parsing the arguments checks the profile against the run
        open(path, "w").write(json.dumps(t5_profile()))
    placed = {"placement": "1+0,1+2", "simulated": {"even": {"placement": "2+0,0+2"}}}
    entries = t5_entries(["dynapipe", "packing"], (1,), placed, measured)
    assert [e.label for e in entries] == ["dynapipe", "dynapipe-even", "packing@mbs1", "packing@mbs1-even",
                                          UNCALIBRATED]
    # On the bench's placement, planned with the measured profile: the later flag wins.
    argv = entries[-1].argv(["--dynapipe-cost-model", calibrated, "--dynapipe-placement", "1+0,1+2",
                             "--encoder-num-layers", "2", "--decoder-num-layers", "2", "--hidden-size", "64",
                             "--num-attention-heads", "4", "--encoder-seq-length", "128",
                             "--decoder-seq-length", "64", "--global-batch-size", "8", "--mock-data",
                             "--pipeline-model-parallel-size", "2", "--train-iters", "2", "--lr", "1e-4"])
    cfg = parse_t5_args(argv, 2)
    assert cfg.base.dynapipe.enabled and cfg.base.dynapipe.cost_model == measured
    assert cfg.placement_flag == "1+0,1+2"
    # It is its own method: never DynaPipe's fastest run.
    figures = {e.label: {"real_tokens_per_s": 1.0} for e in entries}
    figures[UNCALIBRATED]["real_tokens_per_s"] = 99.0
    assert best_runs(entries, figures, ["dynapipe", "packing", UNCALIBRATED])["dynapipe"][0].label != UNCALIBRATED
    # Nothing calibrated, or no DynaPipe: no such run.
    assert UNCALIBRATED not in [e.label for e in t5_entries(["dynapipe"], (1,), placed)]
    assert UNCALIBRATED not in [e.label for e in t5_entries(["packing"], (1,), placed, measured)]


def test_bench_t5_refuses_the_uncalibrated_run_as_a_method(tmp_path, capsys):
    from dynapipe.cli import main

    assert main(["bench", "--model", "t5", "--output", str(tmp_path / "b.json"),
                 "--methods", "dynapipe,dynapipe-uncalibrated"]) == 2
    assert "dynapipe-uncalibrated runs by itself whenever the bench calibrates" in capsys.readouterr().err


def test_adaptive_on_the_interleaved_placement_runs_its_interleaved_form(pp2):
    # --dynapipe-schedule adaptive on chunks plans the interleaved adaptive schedule, as 1f1b and
    # zb-h1 plan their interleaved forms (run 36 of the session's T5 job).
    run = pp2[36]
    assert run["method"] == "dynapipe" and run["schedules"] == ["interleaved-adaptive"] * 2
    assert run["losses"] == pytest.approx(pp2[0]["losses"][:2], abs=1e-5, rel=1e-5)
