"""Per-sample attention of packed rows (``--dynapipe-packed-attention per-sample``): the same
outputs and gradients as Megatron's block-diagonal mask for every real token, no work between
samples; refused where it cannot run. The end-to-end loss check against padding is in
``test_megatron_baselines.py``."""
import numpy as np
import pytest
import torch

from dynapipe.data.samples import Sample
from dynapipe.errors import DynaPipeError
from megatron_integration.launch import spawn
from megatron_integration.segment_attention import is_segment_table, segment_table, table_calls

TIMEOUT = 180
BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 96 --max-position-embeddings 96 "
        "--vocab-size 128 --micro-batch-size 2 --global-batch-size 2 --train-iters 1 --lr 1e-4 --mock-data "
        "--hidden-dropout 0 --attention-dropout 0 --dynapipe-batching packing --reset-position-ids "
        "--reset-attention-mask")


def test_the_segment_table_pairs_each_sample_with_its_own_keys():
    seg = np.array([[1, 1, 2, 2, 2, 0], [3, 3, 3, 3, 0, 0]])
    # Self-attention: every sample of a row attends to itself; the padding tail to nothing, so
    # the work is the pairs inside samples that the cost model's attention density counts.
    assert segment_table(seg).tolist() == [[0, 0, 2, 0, 2], [0, 2, 5, 2, 5], [0, 5, 6, 0, 0],
                                           [1, 0, 4, 0, 4], [1, 4, 6, 0, 0]]
    from dynapipe.cost.attention_density import packed_density

    table = segment_table(seg)
    pairs = int(sum((b - a) * (kb - ka) for _, a, b, ka, kb in table.tolist()))
    assert pairs == round(packed_density(np.array([2, 3, 4]), [[0, 1], [2]], 6).input * 2 * 36)
    # Cross-attention: a target run attends to its sample's input run; padding to nothing.
    enc = np.array([[1, 1, 1, 2, 0, 0, 0], [3, 3, 3, 3, 3, 3, 3]])
    assert segment_table(seg, enc).tolist() == [[0, 0, 2, 0, 3], [0, 2, 5, 3, 4], [0, 5, 6, 0, 0],
                                                [1, 0, 4, 0, 7], [1, 4, 6, 0, 0]]
    # One call a sample with keys, as the cost model counts them; padding tails make none.
    assert table_calls(table) == packed_density(np.array([2, 3, 4]), [[0, 1], [2]], 6).calls == 3
    assert table_calls(segment_table(seg, enc)) == 3
    assert is_segment_table(torch.from_numpy(segment_table(seg)))
    assert not is_segment_table(torch.ones(2, 1, 6, 6, dtype=torch.bool)) and not is_segment_table(None)


def _rows():
    rng = np.random.default_rng(5)

    def sample(n):  # a prompt and a target of n tokens together
        tokens = rng.integers(2, 128, n)
        return Sample(input_ids=tokens[: n // 3], target_ids=tokens[n // 3:])

    return [[sample(30), sample(41), sample(20)], [sample(90)]]  # row 0 ends in 5 pads, row 1 in 6


def _compare_job(extra: str) -> dict:
    from megatron_integration.arguments import parse_training_args
    from megatron_integration.batches import rows_micro_batch
    from megatron_integration.initialize import destroy, initialize_megatron
    from megatron_integration.model import build_gpt_stage
    from megatron_integration.train_config import ParallelArgs

    info = initialize_megatron(ParallelArgs(world_size=1, backend="gloo"), seed=3)
    out = {}
    try:
        rows = _rows()
        for how in ("mask", "per-sample"):
            cfg = parse_training_args((BASE + " " + extra + " --dynapipe-packed-attention " + how).split(), 1)
            gpt = build_gpt_stage(cfg, info)
            gpt.train()
            mb = rows_micro_batch(rows, 96, True, True, per_sample_attention=how == "per-sample")
            losses = gpt(mb.tokens, mb.position_ids, mb.attention_mask, labels=mb.labels)
            out[how] = _trained(gpt, losses * mb.loss_mask)
        return out
    finally:
        destroy()


@pytest.mark.parametrize("extra", ["", "--group-query-attention --num-query-groups 2 "
                                       "--position-embedding-type rope --recompute-granularity selective"])
def test_per_sample_attention_equals_the_mask_on_every_real_token(extra):
    (res,) = spawn(_compare_job, 1, (extra,), timeout_s=TIMEOUT, threads_per_rank=1)
    _check_the_same(res)


def _trained(model, real_losses) -> dict:
    """Backward of the real tokens' losses; what the comparison reads (numpy, as results cross
    the spawn queue)."""
    real_losses.sum().backward()
    return {"loss": real_losses.detach().numpy(),
            "grads": {n: p.grad.numpy().copy() for n, p in model.named_parameters() if p.grad is not None},
            "core": sorted({type(m).__name__ for m in model.modules() if "Attention" in type(m).__name__})}


def _check_the_same(res: dict) -> None:
    mask, alone = res["mask"], res["per-sample"]
    assert "SegmentedDotProductAttention" in alone["core"] and "SegmentedDotProductAttention" not in mask["core"]
    np.testing.assert_allclose(alone["loss"], mask["loss"], rtol=1e-5, atol=1e-6)
    assert np.abs(mask["loss"]).sum() > 1.0  # real tokens carry the loss
    assert set(alone["grads"]) == set(mask["grads"]) and len(mask["grads"]) > 10
    for name, g in mask["grads"].items():
        np.testing.assert_allclose(alone["grads"][name], g, rtol=1e-4, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("extra, match", [
    ("--dynapipe-batching padding", "--dynapipe-packed-attention per-sample"),
    ("--dynapipe-batching packing --reset-position-ids", "--dynapipe-packed-attention per-sample"),
    ("--use-dynapipe", "needs --dynapipe-batching packing with --reset-attention-mask"),
])
def test_per_sample_attention_is_refused_where_it_cannot_run(extra, match):
    from megatron_integration.arguments import parse_training_args

    argv = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 96 --max-position-embeddings 96 "
            "--vocab-size 128 --micro-batch-size 2 --global-batch-size 2 --train-iters 1 --lr 1e-4 --mock-data "
            + extra + " --dynapipe-packed-attention per-sample").split()
    with pytest.raises(DynaPipeError, match=match):
        parse_training_args(argv, 1)


T5_BASE = ("--encoder-num-layers 2 --decoder-num-layers 2 --hidden-size 64 --num-attention-heads 4 "
           "--encoder-seq-length 96 --decoder-seq-length 48 --max-position-embeddings 96 --vocab-size 128 "
           "--micro-batch-size 2 --global-batch-size 2 --train-iters 1 --lr 1e-4 --mock-data --hidden-dropout 0 "
           "--attention-dropout 0 --dynapipe-batching packing --reset-position-ids --reset-attention-mask")


def _t5_compare_job(extra: str) -> dict:
    """A T5 stage (encoder, decoder with cross-attention, LM head) on packed rows: the masks
    the executor's handlers build against the per-sample segment tables."""
    from megatron_integration.initialize import destroy, initialize_megatron
    from megatron_integration.segment_attention import t5_segment_tables
    from megatron_integration.t5_arguments import parse_t5_args
    from megatron_integration.t5_batches import t5_row_tensors
    from megatron_integration.t5_model import build_t5_stage
    from megatron_integration.t5_handlers import needed_mask, segment_mask, segment_positions
    from megatron_integration.train_config import ParallelArgs

    info = initialize_megatron(ParallelArgs(world_size=1, backend="gloo"), seed=3)
    rng = np.random.default_rng(9)
    pair = lambda n, m: Sample(input_ids=rng.integers(2, 128, n), target_ids=rng.integers(2, 128, m))  # noqa: E731
    rows = [[pair(30, 10), pair(40, 20), pair(12, 5)], [pair(96, 41)]]  # row 1 has no input padding
    t = {k: torch.from_numpy(v) for k, v in t5_row_tensors(rows, 96, 48).items()}
    enc, dec = t["enc_mask"], t["dec_mask"]
    out = {}
    try:
        for how in ("mask", "per-sample"):
            cfg = parse_t5_args((T5_BASE + " " + extra + " --dynapipe-packed-attention " + how).split(), 1, cuda=False)
            t5 = build_t5_stage(cfg, info)
            t5.train()
            if how == "mask":
                masks = {"enc_attn_mask": needed_mask(enc, enc), "dec_attn_mask": segment_mask(dec, dec, causal=True),
                         "cross_attn_mask": needed_mask(dec, enc, self_attention=False)}
            else:
                masks = t5_segment_tables(True, True, enc, dec)
            loss = t5(enc_tokens=t["tokens"], enc_positions=segment_positions(enc), dec_tokens=t["dec_tokens"],
                      dec_positions=segment_positions(dec), labels=t["labels"], **masks)
            out[how] = _trained(t5, loss * t["loss_mask"])
        return out
    finally:
        destroy()


@pytest.mark.parametrize("extra", ["", "--recompute-granularity full --recompute-method uniform "
                                       "--recompute-num-layers 1"])
def test_t5_per_sample_attention_equals_the_masks(extra):
    (res,) = spawn(_t5_compare_job, 1, (extra,), timeout_s=TIMEOUT, threads_per_rank=1)
    _check_the_same(res)
