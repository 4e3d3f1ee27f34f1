"""DynaPipe through megatron-core: same losses as megatron's own padding 1F1B, and resumable.

Same model, seed and global batches; DynaPipe plans variable-shape micro-batches, the
executor runs them on the megatron-core stages; the per-iteration ``lm loss`` equals the
padding baseline's (fp32, ~1e-5) on PP2 and on PP2 x DP2, the latter with a Llama-style
model (SwiGLU, grouped-query attention, no linear biases, RMSNorm, RoPE base 500000, untied
output layer) that the planner prices as built.
"""
import pytest

from megatron_integration.jobs import run_training

TINY = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 128 --seq-length 256 "
        "--vocab-size 256 --micro-batch-size 2 --global-batch-size 8 --train-iters 3 --lr 1e-2 --mock-data "
        "--hidden-dropout 0 --attention-dropout 0 --log-interval 1 --seed 7 --pipeline-model-parallel-size 2 "
        "--dynapipe-timeout-s 60")
TIMEOUT = 300


def run(extra: str, world: int) -> dict:
    ranks = run_training((TINY + " " + extra).split(), world, timeout_s=TIMEOUT)
    for r in ranks[1:]:
        assert r["losses"] == ranks[0]["losses"]
    return ranks[0]


LLAMA = ("--swiglu --disable-bias-linear --group-query-attention --num-query-groups 2 --normalization RMSNorm "
         "--position-embedding-type rope --rotary-base 500000 --untie-embeddings-and-output-weights")


@pytest.mark.parametrize("world, model", [(2, ""), (4, LLAMA)], ids=["pp2", "pp2xdp2-llama"])
def test_dynapipe_loss_equals_padding(world, model):
    padding = run(model, world)
    dynapipe = run(f"{model} --use-dynapipe", world)
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
    full = run(extra, 2)["losses"]
    # Interrupted as Megatron-LM runs are: same --train-iters (the learning-rate decay spans it), --exit-interval.
    first = run(f"{extra} --exit-interval 2 --save {save}", 2)
    assert first["losses"] == pytest.approx(full[:2], abs=1e-6, rel=1e-6)
    resumed = run(f"{extra} --load {save}", 2)
    assert resumed["start_iteration"] == 2
    assert resumed["losses"] == pytest.approx(full[2:], abs=1e-6, rel=1e-6)
