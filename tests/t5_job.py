"""The tiny T5 of the T5 tests and the spawned jobs several test modules share.

``TINY``: hidden 64, 2 + 2 layers, 128/64 tokens, PP2, dropout 0. The ``pp2`` and ``t5_dist``
fixtures (in ``conftest.py``) run one 2-rank job of every T5 case once per test session.
"""
import torch

TINY = ("--encoder-num-layers 2 --decoder-num-layers 2 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 128 "
        "--encoder-seq-length 128 --decoder-seq-length 64 --vocab-size 256 --micro-batch-size 2 --global-batch-size 8 "
        "--train-iters 3 --lr 1e-2 --mock-data --hidden-dropout 0 --attention-dropout 0 --log-interval 1 --seed 7 "
        "--pipeline-model-parallel-size 2 --dynapipe-timeout-s 60")
# What a profile of TINY's layers records of them.
TINY_WIDTHS = {"hidden_size": 64, "num_attention_heads": 4, "ffn_hidden_size": 128}
PACKING = " --dynapipe-batching packing --reset-position-ids --reset-attention-mask"
TIMEOUT = 300


def dist_tensors(iter_dir, scratch) -> dict:
    """Every tensor of a torch_dist checkpoint (model and optimizer state) by its global key, read
    by torch.distributed.checkpoint alone (no process group, no model)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = scratch / f"{iter_dir.parent.name}-{iter_dir.name}.pt"
    dcp_to_torch_save(str(iter_dir), str(out))
    return {k: v for k, v in torch.load(out, weights_only=False).items() if torch.is_tensor(v)}
