"""Packing under ``--use-dynapipe`` isolates samples like Megatron's packing baseline.

PP2 gloo jobs (fp32, dropout 0) train the same global batches with megatron-core's
padding 1F1B and with the DynaPipe executor running ``--dynapipe-batching packing``.
With samples isolated (the block-diagonal mask built on both stages, positions
restarting at every sample) the logged ``lm loss`` is the padding loss (~1e-5); a
packed sample attending to its row neighbours would change it. (Megatron's own
packing with ``--reset-attention-mask`` against padding: test_megatron_baselines.py.)
Both runs train in one job with the PP2 runs of test_megatron_dynapipe.py when both files run.
"""
import glob
import json
import os
import re

import pytest

from test_megatron_dynapipe import run

PACK = "--dynapipe-batching packing --reset-position-ids --reset-attention-mask"


def _logged_losses(rank: dict) -> list[float]:
    return [float(m.group(1)) for l in rank["log_lines"] for m in [re.search(r"lm loss: (\S+) \|", l)] if m]


PER_SAMPLE = "--use-dynapipe " + PACK + " --dynapipe-packed-attention per-sample --dynapipe-trace-dir {tmp}/per-sample"


@pytest.mark.megatron_runs(("", 2), ("--use-dynapipe " + PACK, 2), (PER_SAMPLE, 2))
def test_dynapipe_packing_with_per_sample_attention_trains_the_same_rows(request):
    """The executor's packed rows with each sample's attention computed alone (segment tables on
    both stages): the masked rows' losses, and the planner priced them per sample."""
    padding = run("", 2, request)
    masked = run("--use-dynapipe " + PACK, 2, request)
    alone = run(PER_SAMPLE, 2, request)
    assert alone["method"] == "dynapipe" and len(alone["losses"]) == 3
    assert alone["losses"] == pytest.approx(masked["losses"], abs=1e-6, rel=1e-6)
    assert alone["losses"] == pytest.approx(padding["losses"], abs=1e-5, rel=1e-5)
    assert alone["padded_tokens"] == masked["padded_tokens"]  # the same packed rows
    # Every traced forward ran segment tables: it notes the share of its rows' pairs computed.
    tmp = request.getfixturevalue("tmp_path_factory").getbasetemp()
    notes = [e["args"].get("attention") for path in glob.glob(os.path.join(str(tmp), "per-sample", "rank*.json"))
             for e in json.load(open(path))["traceEvents"] if e.get("cat") == "forward" and e.get("ph") == "X"]
    assert notes and all(n is not None and 0 < n["input"] <= 1 for n in notes)
    assert min(n["input"] for n in notes) < 1  # rows of several samples


PADDED = "--use-dynapipe --dynapipe-padded-attention per-sample --dynapipe-trace-dir {tmp}/padded-per-sample"


@pytest.mark.megatron_runs(("", 2), (PADDED, 2))
def test_dynapipe_rows_with_per_sample_attention_train_the_padding_loss(request):
    """DynaPipe's own rows with each sample's attention alone (the padding tail skipped: the
    stages load each row's segment ids and run segment tables): the padding loss, and the
    traced ops computed under their rows' dense pairs where rows pad."""
    padding = run("", 2, request)
    alone = run(PADDED, 2, request)
    assert alone["method"] == "dynapipe" and len(alone["losses"]) == 3
    assert alone["losses"] == pytest.approx(padding["losses"], abs=1e-5, rel=1e-5)
    tmp = request.getfixturevalue("tmp_path_factory").getbasetemp()
    ops = [e["args"] for path in glob.glob(os.path.join(str(tmp), "padded-per-sample", "rank*.json"))
           for e in json.load(open(path))["traceEvents"] if e.get("cat") == "forward" and e.get("ph") == "X"]
    assert ops and all(a.get("attention") is not None and 0 < a["attention"]["input"] <= 1 for a in ops)
    assert min(a["attention"]["input"] for a in ops if a["mbs"] > 1) < 1
    assert all(a["attention"]["calls"] == a["mbs"] for a in ops)  # one call a row's sample


def test_the_planner_prices_per_sample_packed_rows_of_a_training_run():
    from megatron_integration.arguments import parse_training_args
    from megatron_integration.dynapipe_step import planned_batching

    base = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 96 --max-position-embeddings 96 "
            "--vocab-size 128 --micro-batch-size 2 --global-batch-size 4 --train-iters 1 --lr 1e-4 --mock-data "
            + "--use-dynapipe " + PACK)
    assert planned_batching(parse_training_args(base.split(), 2)) == "packing"
    per_sample = parse_training_args((base + " --dynapipe-packed-attention per-sample").split(), 2)
    assert planned_batching(per_sample) == "packing-per-sample"
    dyn = base.replace(PACK, "").replace("--micro-batch-size 2 ", "")
    assert planned_batching(parse_training_args(dyn.split(), 2)) == "dynapipe"
    padded = parse_training_args((dyn + " --dynapipe-padded-attention per-sample").split(), 2)
    assert planned_batching(padded) == "dynapipe-per-sample" and padded.per_sample_attention


@pytest.mark.parametrize("extra, names", [
    ("", "without --use-dynapipe"),  # megatron-core's padding rows
    ("--use-dynapipe --dynapipe-batching padding", "padding batching"),
    ("--use-dynapipe " + PACK, "--dynapipe-packed-attention per-sample")])
def test_padded_per_sample_attention_outside_dynapipe_batching_is_refused(extra, names):
    from megatron_integration.arguments import parse_training_args
    from dynapipe.errors import DynaPipeError

    base = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 96 --max-position-embeddings 96 "
            "--vocab-size 128 --micro-batch-size 2 --global-batch-size 4 --train-iters 1 --lr 1e-4 --mock-data ")
    with pytest.raises(DynaPipeError, match="--dynapipe-padded-attention per-sample") as err:
        parse_training_args((base + extra + " --dynapipe-padded-attention per-sample").split(), 2)
    assert names in str(err.value)


@pytest.mark.megatron_runs(("", 2), ("--use-dynapipe " + PACK, 2))
def test_dynapipe_packing_logs_the_padding_loss(request):
    padding = run("", 2, request)
    packed = run("--use-dynapipe " + PACK, 2, request)
    assert packed["method"] == "dynapipe" and padding["method"] == "padding"
    assert len(packed["losses"]) == 3
    assert packed["losses"] == pytest.approx(padding["losses"], abs=1e-5, rel=1e-5)
    logged = _logged_losses(packed)
    assert logged == pytest.approx(padding["losses"], abs=1e-5, rel=1e-5) and len(logged) == 3
    # Same samples trained; packed rows of --seq-length compute fewer padded tokens than padding.
    assert packed["real_tokens"] == padding["real_tokens"]
    assert packed["loss_tokens"] == padding["loss_tokens"]
    assert sum(packed["padded_tokens"]) < sum(padding["padded_tokens"])
