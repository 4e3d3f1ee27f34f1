"""Recompute options: Megatron's --recompute-* and --dynapipe-recompute, the planner's
level escalation on the command line, and the profile cost model's measured levels."""
import json

import pytest

from dynapipe.cli import main
from dynapipe.config import load_model_config
from dynapipe.cost.profile import ProfileCostModel
from dynapipe.errors import DynaPipeError
from megatron_integration.arguments import parse_training_args
from profile_widths import TINY_WIDTHS

BASE = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 256 --micro-batch-size 2 "
        "--global-batch-size 8 --train-iters 3 --lr 1e-3 --mock-data --pipeline-model-parallel-size 2")


def parse(extra: str):
    return parse_training_args((BASE + " " + extra).split(), 2, cuda=False)


def test_megatron_recompute_flags_keep_megatrons_meaning():
    cfg = parse("--recompute-granularity full --recompute-method block --recompute-num-layers 2")
    assert (cfg.recompute.granularity, cfg.recompute.method, cfg.recompute.num_layers) == ("full", "block", 2)
    assert cfg.dynapipe.recompute is None  # baselines: no planner level
    assert parse("").recompute.granularity is None  # Megatron's default: no recompute
    assert parse("--recompute-granularity selective").recompute.granularity == "selective"


@pytest.mark.parametrize("extra, words", [
    ("--recompute-granularity full", "--recompute-method"),
    ("--recompute-granularity full --recompute-method uniform --recompute-num-layers 3", "between 1 and the 2"),
    ("--recompute-granularity selective --recompute-method uniform", "selective takes no"),
    ("--recompute-method uniform", "need --recompute-granularity full"),
    ("--dynapipe-recompute full", "needs --use-dynapipe"),
    ("--use-dynapipe --recompute-granularity full --recompute-method block --recompute-num-layers 1",
     "cannot be honoured"),
    ("--use-dynapipe --recompute-granularity selective --dynapipe-recompute full", "disagree"),
    ("--use-dynapipe --dynapipe-batching packing --reset-position-ids", "add --reset-attention-mask"),
    # megatron-core 0.16 recomputes uniform groups without clamping the last: a chunk of 1 layer
    # (an uneven 3 + 1 split) and groups of 2 would fail at the first forward.
    ("--decoder-first-pipeline-num-layers 3 --recompute-granularity full --recompute-method uniform "
     "--recompute-num-layers 2", "a model chunk of 1 layer.s. is not a whole number of groups of 2.*"
                                 "use --recompute-num-layers 1, or --recompute-method block"),
])
def test_inputs_the_path_cannot_honour_are_refused(extra, words):
    with pytest.raises(DynaPipeError, match=words):
        parse(extra)


def test_dynapipe_level_comes_from_either_flag():
    assert parse("--use-dynapipe").dynapipe.recompute is None  # auto: the search chooses
    assert parse("--use-dynapipe --dynapipe-recompute selective").dynapipe.recompute == "selective"
    cfg = parse("--use-dynapipe --recompute-granularity full --recompute-method uniform --recompute-num-layers 1")
    assert cfg.dynapipe.recompute == "full"
    assert parse("--use-dynapipe --recompute-granularity selective").dynapipe.recompute == "selective"


def _lengths(tmp_path):
    p = tmp_path / "lengths.txt"
    # Long enough that only full recompute holds one sample on gpt-7b's 4 stages of 40 GB.
    p.write_text("3840\n" * 8)
    return str(p)


@pytest.mark.parametrize("command", ["plan", "trace"])
def test_cli_escalates_recompute_when_not_given(tmp_path, capsys, command):
    args = [command, "--lengths", _lengths(tmp_path), "--model", "gpt-7b", "--device", "a100-40gb", "--stages", "4"]
    if command == "trace":
        args += ["--out", str(tmp_path / "t.json")]
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert "recompute full, chosen" in err  # it says which level it chose
    if command == "plan":
        assert json.loads(out)["batching_recompute"] == "full"
    # A level given explicitly is not escalated: none cannot hold a 3840-token sample here.
    assert main(args + ["--recompute", "none"]) == 2
    assert "does not fit in memory even alone" in capsys.readouterr().err


def test_cli_reports_a_sample_that_fits_at_no_level(tmp_path, capsys):
    args = ["plan", "--lengths", _lengths(tmp_path), "--model", "gpt-7b", "--device", "a100-40gb",
            "--stages", "8", "--memory-limit-mb", "20000"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "sample 0" in err and "recompute 'full'" in err and "MiB" in err


def _profile(levels: bool) -> dict:
    grid = lambda v: [[v, 2 * v], [2 * v, 4 * v]]  # noqa: E731  (mbs 1, 2 x seqlen 64, 128)
    op = lambda v: {"fw_ms": grid(v), "bw_ms": grid(2 * v), "stored_mib": grid(v), "peak_mib": grid(v / 2)}  # noqa: E731
    ops = {"layer": op(1.0), "embedding": op(0.01), "output": op(0.5)}
    if levels:
        ops.update(layer_selective=op(0.6), layer_full=op(0.1))
    return {"format": "dynapipe-profile", "version": 1, "mbs": [1, 2], "seqlen": [64, 128], "model": TINY_WIDTHS,
            "ops": ops}


def test_profile_cost_model_reads_measured_levels():
    model = load_model_config("gpt-tiny")
    measured = ProfileCostModel(model, _profile(True), num_stages=2)
    derived = ProfileCostModel(model, _profile(False), num_stages=2)
    layers = measured.layouts[0].decoder_layers
    for level, per_layer in (("none", 1.0), ("selective", 0.6), ("full", 0.1)):
        c = measured.stage_cost(1, 64, recompute=level, stage=0)
        assert float(c.stored_mib) == pytest.approx(layers * per_layer + 0.01)
        assert float(c.bw_ms) == pytest.approx(layers * 2 * per_layer + 0.02)
    # Without the tables the levels are still derived (older profiles keep working).
    assert float(derived.stage_cost(1, 64, recompute="full", stage=0).stored_mib) < 1.0
    # Recomputing one layer at a time: the backward rises by one layer's share, less what the
    # output layer freed first on the last stage.
    held = measured.recompute_held_mib(1, 64, recompute="full", stage=0)
    assert float(held) == pytest.approx(0.9)
    assert float(measured.recompute_held_mib(1, 64, recompute="full", stage=1)) == pytest.approx(0.4)
    assert float(measured.recompute_held_mib(1, 64, recompute="none", stage=0)) == 0.0
    bad = _profile(True)
    bad["ops"]["layer_full"]["stored_mib"] = [[1.0]]
    with pytest.raises(DynaPipeError, match="layer_full.stored_mib"):
        ProfileCostModel(model, bad, num_stages=2)
