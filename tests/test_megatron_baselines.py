"""The fixed-shape baselines through megatron-core's own 1F1B, on gloo ranks.

Same model, seed and global batches: a 2-stage pipeline (and 2 stages x 2 replicas)
gives the same per-iteration ``lm loss`` as one process; packing with per-sample
positions and attention isolation gives it too (fp32, ~1e-5).
"""
import pytest

from megatron_integration.jobs import run_training

TINY = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 128 --seq-length 256 "
        "--vocab-size 256 --micro-batch-size 2 --global-batch-size 8 --train-iters 3 --lr 1e-2 --mock-data "
        "--hidden-dropout 0 --attention-dropout 0 --log-interval 1 --seed 7")
TIMEOUT = 240


def losses(extra: str, world: int) -> list[float]:
    ranks = run_training((TINY + " " + extra).split(), world, timeout_s=TIMEOUT)
    # Every rank reports the same global loss.
    for r in ranks[1:]:
        assert r["losses"] == ranks[0]["losses"]
    return ranks[0]["losses"], ranks


@pytest.fixture(scope="module")
def single_process():
    return losses("", 1)


def test_pp2_padding_matches_single_process(single_process):
    ref, ref_ranks = single_process
    got, ranks = losses("--pipeline-model-parallel-size 2", 2)
    assert len(got) == 3
    assert got == pytest.approx(ref, abs=1e-5, rel=1e-5)
    assert ranks[0]["loss_tokens"] == ref_ranks[0]["loss_tokens"]
    # Megatron-format lines from the logging rank (the last stage).
    line = ranks[1]["log_lines"][0]
    for key in ("iteration", "consumed samples:", "elapsed time per iteration (ms):", "lm loss:",
                "real tokens/s:", "padding efficiency:", "plan wait (ms):"):
        assert key in line


def test_pp2_dp2_padding_matches_single_process(single_process):
    ref, _ = single_process
    got, _ = losses("--pipeline-model-parallel-size 2", 4)
    assert got == pytest.approx(ref, abs=1e-5, rel=1e-5)


def test_pp2_packing_with_isolation_matches_padding(single_process):
    ref, ref_ranks = single_process
    got, ranks = losses("--pipeline-model-parallel-size 2 --dynapipe-batching packing "
                        "--reset-position-ids --reset-attention-mask", 2)
    assert got == pytest.approx(ref, abs=1e-5, rel=1e-5)
    # Packing computes fewer padded tokens than padding to --seq-length.
    assert sum(ranks[0]["padded_tokens"]) < sum(ref_ranks[0]["padded_tokens"])
    assert ranks[0]["real_tokens"] == ref_ranks[0]["real_tokens"]
