"""DynaPipe through megatron-core: same losses as megatron's own padding 1F1B, and resumable.

Same model, seed and global batches; DynaPipe plans variable-shape micro-batches, the
executor runs them on the megatron-core stages; the per-iteration ``lm loss`` equals the
padding baseline's (fp32, ~1e-5) on PP2 and on PP2 x DP2, the latter with a Llama-style
model (SwiGLU, grouped-query attention, no linear biases, RMSNorm, RoPE base 500000, untied
output layer) that the planner prices as built; on PP2 so do the validation and test
losses (forward-only plans vs megatron-core's forward-only schedule).
"""
import math
import os

import pytest

from megatron_integration.jobs import run_training

TINY = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 128 --seq-length 256 "
        "--vocab-size 256 --micro-batch-size 2 --global-batch-size 8 --train-iters 3 --lr 1e-2 --mock-data "
        "--hidden-dropout 0 --attention-dropout 0 --log-interval 1 --seed 7 --pipeline-model-parallel-size 2 "
        "--dynapipe-timeout-s 60")
TIMEOUT = 300


# Runs by command line: test modules that need the same job (the PP2 padding baseline) share
# one, since the suite's time budget is mostly process start-up.
_RUNS: dict = {}


def run(extra: str, world: int) -> dict:
    """Rank 0's summary of one training job of TINY + ``extra`` on ``world`` ranks (cached)."""
    key = (" ".join(extra.split()), world)
    if key not in _RUNS:
        _RUNS[key] = _run(extra, world)
    return _RUNS[key]


def _run(extra: str, world: int) -> dict:
    ranks = run_training((TINY + " " + extra).split(), world, timeout_s=TIMEOUT)
    for r in ranks[1:]:
        assert r["losses"] == ranks[0]["losses"] and r["eval_lines"] == ranks[0]["eval_lines"]
    return dict(ranks[0], printed_first=ranks[0]["printed"], printed_last=ranks[-1]["printed"])


# Megatron's evaluation: validation after iteration 2, validation and test after training.
EVAL = "--split 80,10,10 --eval-interval 2 --eval-iters 2"


def _eval_values(r: dict) -> list[tuple[str, float, float]]:
    """(where, lm loss value, PPL) of each validation line."""
    out = []
    for line in r["eval_lines"][1::3]:
        where, loss, ppl = (p.strip() for p in line.split("|")[:3])
        out.append((where, float(loss.split(":")[1]), float(ppl.split(":")[1])))
    return out


LLAMA = ("--swiglu --disable-bias-linear --group-query-attention --num-query-groups 2 --normalization RMSNorm "
         "--position-embedding-type rope --rotary-base 500000 --untie-embeddings-and-output-weights")


@pytest.mark.parametrize("world, model", [(2, ""), (4, LLAMA)], ids=["pp2", "pp2xdp2-llama"])
def test_dynapipe_loss_equals_padding(world, model):
    padding = run(model, world)
    # PP2: DynaPipe also evaluates (forward-only plans), and the padding baseline once more with
    # evaluation (megatron-core's forward-only schedule): same training losses, same validation losses.
    dynapipe = run(f"{model} --use-dynapipe" + (" " + EVAL if world == 2 else ""), world)
    if world == 2:
        padding_eval = run(EVAL, world)
        assert padding_eval["losses"] == padding["losses"]  # forward only: training untouched, bit for bit
        # 2 batches at iteration 2, then 2 of validation and 2 of test: all through forward-only plans.
        assert (dynapipe["eval_path"], padding_eval["eval_path"]) == ("dynapipe-plans:6", "megatron-forward-only")
        mine, ref = _eval_values(dynapipe), _eval_values(padding_eval)
        assert [w for w, _, _ in ref] == ["validation loss at iteration 2",
                                          "validation loss at iteration 3 on validation set",
                                          "validation loss at iteration 3 on test set"]
        assert [w for w, _, _ in mine] == [w for w, _, _ in ref]
        assert [v for _, v, _ in mine] == pytest.approx([v for _, v, _ in ref], abs=1e-5, rel=1e-5)
        assert all(ppl == pytest.approx(math.exp(v), rel=1e-6) for _, v, ppl in ref)
        assert ref[0][1] != ref[1][1]  # the second validation read the next batches of the stream
        # Printed by the last stage only, between rules of dashes, as Megatron-LM prints them.
        assert "validation loss at iteration 2 |" in dynapipe["printed_last"]
        assert "validation loss" not in dynapipe["printed_first"]
        assert set(padding_eval["eval_lines"][0]) == {"-"} and len(padding_eval["eval_lines"][0]) == \
            len(padding_eval["eval_lines"][1]) + 1
    assert dynapipe["method"] == "dynapipe" and padding["method"] == "padding"
    assert len(dynapipe["losses"]) == 3
    assert dynapipe["losses"] == pytest.approx(padding["losses"], abs=1e-5, rel=1e-5)
    # Same samples: same real and loss tokens; DynaPipe computes far fewer padded tokens.
    assert dynapipe["real_tokens"] == padding["real_tokens"]
    assert dynapipe["loss_tokens"] == padding["loss_tokens"]
    assert sum(dynapipe["padded_tokens"]) < 0.9 * sum(padding["padded_tokens"])


def test_dynapipe_resume_continues_identically(tmp_path):
    save = str(tmp_path / "ckpt")
    extra = "--use-dynapipe --train-iters 4"
    # The uninterrupted run also saves after iteration 2; the resumed one starts from that
    # checkpoint (the tracker file pointed back at it, as when the job had been stopped there:
    # test_megatron_flags.py stops a run with --exit-interval).
    full = run(f"{extra} --save {save} --save-interval 2", 2)
    assert sorted(os.listdir(save)) == ["iter_0000002", "iter_0000004", "latest_checkpointed_iteration.txt"]
    with open(os.path.join(save, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("2")
    resumed = run(f"{extra} --load {save}", 2)
    assert resumed["start_iteration"] == 2
    assert resumed["losses"] == pytest.approx(full["losses"][2:], abs=1e-6, rel=1e-6)
