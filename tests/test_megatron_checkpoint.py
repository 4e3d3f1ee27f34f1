"""Checkpoints: a run resumed from iteration k continues exactly as the uninterrupted run."""
import os
import re

import pytest

from megatron_integration.jobs import run_training
from megatron_integration.launch import RankFailed

# Dropout on: the resumed run must also restore every RNG to draw the same masks.
TINY = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 128 --seq-length 128 "
        "--vocab-size 256 --micro-batch-size 2 --global-batch-size 4 --lr 1e-2 --mock-data "
        "--hidden-dropout 0.1 --attention-dropout 0.1 --log-interval 1 --seed 11 --pipeline-model-parallel-size 2")
TIMEOUT = 240


def test_resume_continues_identically(tmp_path):
    save = str(tmp_path / "ckpt")
    full = run_training(f"{TINY} --train-iters 4".split(), 2, timeout_s=TIMEOUT)[0]["losses"]
    # Interrupted as Megatron-LM runs are: same --train-iters (the learning-rate decay spans it), --exit-interval.
    first = run_training(f"{TINY} --train-iters 4 --exit-interval 2 --save {save}".split(), 2, timeout_s=TIMEOUT)[0]
    assert first["losses"] == full[:2]
    with open(os.path.join(save, "latest_checkpointed_iteration.txt")) as f:
        assert f.read().strip() == "2"
    # Megatron's torch_dist layout (the default --ckpt-format), every file with its checksum.
    iter_dir = os.path.join(save, "iter_0000002")
    files = sorted(os.listdir(iter_dir))
    assert {"metadata.json", "common.pt", ".metadata"} <= set(files)
    assert any(f.startswith("__1_") and f.endswith(".distcp") for f in files)  # the second stage's shards
    assert all(f + ".sha256" in files for f in files if not f.endswith(".sha256"))
    saving, saved = first["checkpoint_lines"]
    assert re.fullmatch(rf"\[[-0-9: .]+\] saving checkpoint at iteration       2 to {save} in torch_dist format",
                        saving)
    assert re.fullmatch(rf"  \[[-0-9: .]+\] successfully saved checkpoint from iteration       2 to {save} "
                        rf"\[ t 1/1, p 1/2 \]", saved)
    resumed = run_training(f"{TINY} --train-iters 4 --load {save}".split(), 2, timeout_s=TIMEOUT)[0]
    assert resumed["start_iteration"] == 2
    assert resumed["losses"] == full[2:]  # bitwise: same weights, optimizer state, data position and RNG
    assert resumed["checkpoint_lines"][:2] == [f" loading distributed checkpoint from {save} at iteration 2",
                                               f"  successfully loaded checkpoint from {save} [ t 1/1, p 1/2 ] "
                                               f"at iteration 2"]
    # Without restoring RNG states the dropout masks differ, so the check above has teeth.
    no_rng = run_training(f"{TINY} --train-iters 4 --load {save} --no-load-rng".split(), 2,
                          timeout_s=TIMEOUT)[0]
    assert abs(no_rng["losses"][0] - full[2]) > 1e-6


def test_loading_into_a_different_model_is_refused(tmp_path):
    save = str(tmp_path / "ckpt")
    one_stage = TINY.replace(" --pipeline-model-parallel-size 2", "")
    run_training(f"{one_stage} --train-iters 1 --save {save}".split(), 1, timeout_s=TIMEOUT)
    wider = one_stage.replace("--ffn-hidden-size 128", "--ffn-hidden-size 192")
    with pytest.raises(RankFailed, match="does not fit this model"):
        run_training(f"{wider} --train-iters 2 --load {save}".split(), 1, timeout_s=TIMEOUT)
