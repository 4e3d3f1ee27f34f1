"""T5 (encoder-decoder) training through the DynaPipe executor on megatron-core stages.

Same model, seed and global batches: DynaPipe's variable-shape micro-batches, padding to
--encoder-seq-length / --decoder-seq-length and isolated packing give the same per-iteration
``lm loss`` (fp32, dropout 0, 1e-5) on PP2, and PP2 x DP2 and TP2 x PP2 give the losses of PP2. One
spawned job per layout runs every method in turn. torch_dist checkpoints resume bitwise, load at
another stage placement, at PP1 and at TP2, and carry megatron-core ``T5Model``'s keys.
"""
import io
import os

import numpy as np
import pytest
import torch

from dynapipe.data.samples import Sample
from dynapipe.errors import DynaPipeError
from megatron_integration.t5_arguments import parse_t5_args
from megatron_integration.t5_batches import baseline_micro_batches, pack_pairs, t5_row_tensors
from megatron_integration.launch import spawn
from megatron_integration.t5_handlers import (key_padding_mask, needed_mask, segment_mask, segment_positions,
                                              single_sample_rows)

from t5_job import PACKING, TIMEOUT, TINY, dist_tensors as _dist_tensors


# -- pure Python ------------------------------------------------------------------------------

def test_megatron_t5_flags_and_their_errors(tmp_path):
    cfg = parse_t5_args(TINY.split(), 2, cuda=False)
    assert (cfg.encoder_layers, cfg.decoder_layers, cfg.encoder_seq_length, cfg.decoder_seq_length) == (2, 2, 128, 64)
    assert cfg.base.model.max_position_embeddings == 128 and cfg.method == "padding"
    m = cfg.planner_model()
    assert m.is_encoder_decoder and (m.encoder_layers, m.decoder_layers) == (2, 2)
    # --num-layers is --encoder-num-layers; the decoder defaults to as many layers (Megatron-LM).
    same = parse_t5_args(TINY.replace("--encoder-num-layers 2 --decoder-num-layers 2", "--num-layers 3").split()
                         + ["--pipeline-model-parallel-size", "3"], 3, cuda=False)
    assert (same.encoder_layers, same.decoder_layers) == (3, 3)
    bad = {
        "--num-layers 2": "were both given",
        "--seq-length 128": "were both given",
        "--max-position-embeddings 100": "exceeds --max-position-embeddings",
        "--max-position-embeddings 0": "--max-position-embeddings 0: must be positive",
        "--pipeline-model-parallel-size 1 --global-batch-size 12 --dynapipe-placement 1+0|1+2": "2 chunks on one "
                                                                                            "pipeline rank",
        "--use-dynapipe --dynapipe-batching packing": "--reset-position-ids --reset-attention-mask",
        "--use-dynapipe --dynapipe-batching padding": "T5's planner plans dynapipe or packing",
        "--dynapipe-batching packing": "--reset-position-ids --reset-attention-mask",
        "--position-embedding-type rope": "learned absolute",
        "--pipeline-model-parallel-size 3": "cannot be split evenly",
        "--tensor-model-parallel-size 3 --pipeline-model-parallel-size 1": "does not divide --num-attention-heads 4",
        "--tensor-model-parallel-size 2 --sequence-parallel --decoder-seq-length 63": "--decoder-seq-length 63 is "
                                                                                      "not a multiple of 2; use 64",
    }
    for extra, text in bad.items():
        with pytest.raises(DynaPipeError, match=text):
            parse_t5_args(TINY.split() + extra.split(), 6, cuda=False)
    # What T5 training does not do yet is refused, not ignored.
    evaluated = parse_t5_args(TINY.split() + "--split 80,10,10 --eval-interval 2 --eval-iters 1".split(), 2, cuda=False)
    assert (evaluated.base.evaluation.eval_interval, evaluated.base.evaluation.eval_iters) == (2, 1)
    assert evaluated.dataset_config("valid").encoder_decoder and evaluated.dataset_config("test") is not None
    assert parse_t5_args(TINY.split(), 2, cuda=False).dataset_config("valid") is None  # mock data, no --split
    assert parse_t5_args(TINY.split() + ["--bf16"], 2, cuda=False).base.model.dtype == "bf16"
    assert parse_t5_args(TINY.split() + ["--fp16"], 2, cuda=False).base.model.dtype == "fp16"
    for extra, text in {"--swiglu": "built as Megatron's T5",
                        "--use-distributed-optimizer": "no sharded optimizer yet"}.items():
        with pytest.raises(DynaPipeError, match=text):
            # Refused by T5's own checks, after the shared ones: still no directory left behind.
            parse_t5_args(TINY.split() + extra.split() + ["--save", str(tmp_path / "refused")], 2, cuda=False)
        assert not (tmp_path / "refused").exists(), extra
    # Packing through the DynaPipe executor: the planner packs, priced per sample with the flag.
    from megatron_integration.dynapipe_step import planned_batching

    packed = TINY + " --use-dynapipe --dynapipe-batching packing --reset-position-ids --reset-attention-mask"
    assert planned_batching(parse_t5_args(packed.split(), 2, cuda=False).base) == "packing"
    per_sample = parse_t5_args((packed + " --dynapipe-packed-attention per-sample").split(), 2, cuda=False)
    assert planned_batching(per_sample.base) == "packing-per-sample" and per_sample.base.per_sample_attention
    # Megatron-LM's default checkpoint format is T5's too.
    assert parse_t5_args(TINY.split() + ["--save", str(tmp_path / "ckpt")], 2, cuda=False).base.ckpt_format == \
        "torch_dist"
    assert (tmp_path / "ckpt").is_dir()
    with pytest.raises(DynaPipeError, match="--decoder-seq-length is required"):
        parse_t5_args(TINY.replace("--decoder-seq-length 64", "").split(), 2, cuda=False)


def test_a_megatron_lm_t5_checkpoint_is_checked_for_the_decoder_it_holds():
    """Megatron-LM's pretrain_t5.py builds the decoder from --num-layers (the encoder's) and records
    --decoder-num-layers unread: its checkpoints are checked against the depth they hold."""
    from types import SimpleNamespace

    from megatron_integration.checkpoint_compat import model_mismatch
    from megatron_integration.t5_checkpoint import t5_megatron_args, t5_model_values

    cfg = parse_t5_args(TINY.split(), 2, cuda=False)  # 2 encoder and 2 decoder layers
    keys = ["encoder.layers.0.mlp.linear_fc1.weight", "decoder.layers.0.mlp.linear_fc1.weight"]
    mine = t5_model_values(cfg)
    megatron_lm = {**t5_megatron_args(cfg), "decoder_num_layers": 1}
    del megatron_lm["dynapipe_placement"]
    assert model_mismatch(SimpleNamespace(**megatron_lm), cfg.base, mine, keys) is None
    deeper = parse_t5_args(TINY.replace("--decoder-num-layers 2", "--decoder-num-layers 4").split(), 2, cuda=False)
    assert model_mismatch(SimpleNamespace(**megatron_lm), deeper.base, t5_model_values(deeper), keys) == (
        "a Megatron-LM T5 checkpoint, whose decoder has --num-layers layers (2, the encoder's) whatever its "
        "--decoder-num-layers (1) says, and 4 here: pass --decoder-num-layers 2")
    # This project's checkpoints hold the decoder their --decoder-num-layers records.
    ours = {**t5_megatron_args(cfg), "decoder_num_layers": 1}
    assert model_mismatch(SimpleNamespace(**ours), cfg.base, mine, keys) == (
        "--decoder-num-layers 1 in the checkpoint, 2 here")


def test_t5_baselines_pad_to_the_flags_and_pack_pairs_whole():
    rng = np.random.default_rng(0)
    lengths = np.stack([rng.integers(1, 100, 24), rng.integers(1, 40, 24)], axis=1)
    pad, padded = baseline_micro_batches("padding", lengths, 128, 64, 2, 2, 1)
    assert [mb.samples for mb in pad[:2]] == [[2, 3], [6, 7]]
    assert {(mb.seqlen, mb.dec_seqlen) for mb in pad} == {(128, 64)} and padded.total_tokens == 24 * (128 + 64)
    assert padded.cross == 24 * 128 * 64 and padded.enc_squares == 24 * 128 ** 2
    rows = pack_pairs(lengths, 128, 64)
    assert sorted(i for r in rows for i in r) == list(range(24))
    assert all(lengths[r, 0].sum() <= 128 and lengths[r, 1].sum() <= 64 for r in rows)
    per_replica = [baseline_micro_batches("packing", lengths, 128, 64, 2, 2, r)[0] for r in range(2)]
    assert len(per_replica[0]) == len(per_replica[1])   # every replica runs as many micro-batches
    assert sorted(i for mbs in per_replica for mb in mbs for i in mb.samples) == list(range(24))
    assert sum(mb.loss_tokens for mbs in per_replica for mb in mbs) == int(lengths[:, 1].sum())
    assert sum(mb.real_tokens for mbs in per_replica for mb in mbs) == int(lengths.sum())


def test_packed_t5_rows_keep_each_pair_in_its_own_segment():
    a = Sample(np.array([5, 6, 7]), np.array([8, 9]))
    b = Sample(np.array([10, 11]), np.array([12, 13, 14]))
    t = t5_row_tensors([[a, b], []], 8, 6, pad_id=0, eod_id=1)
    assert t["tokens"][0].tolist() == [5, 6, 7, 10, 11, 0, 0, 0]
    assert t["enc_mask"][0].tolist() == [1, 1, 1, 2, 2, 0, 0, 0]
    assert t["dec_tokens"][0].tolist() == [1, 8, 1, 12, 13, 0]        # each target shifted behind its own start
    assert t["labels"][0].tolist() == [8, 9, 12, 13, 14, 0]
    assert t["dec_mask"][0].tolist() == [1, 1, 2, 2, 2, 0] and t["loss_mask"][0].tolist() == [1] * 5 + [0]
    assert not t["enc_mask"][1].any() and not t["loss_mask"][1].any()
    # One pair a row: the data loader's own tensors.
    one = t5_row_tensors([[a]], 4, 3)
    assert one["enc_mask"][0].tolist() == [1, 1, 1, 0] and one["dec_tokens"][0].tolist() == [1, 8, 0]


def test_the_loader_collates_packed_t5_rows_with_positions_restarting():
    # What --use-dynapipe --dynapipe-batching packing loads: the planner's packed rows.
    from dynapipe.data.collate import TensorRequest, collate

    a = Sample(np.array([5, 6, 7]), np.array([8, 9]))
    b = Sample(np.array([10, 11]), np.array([12, 13, 14]))
    reqs = [TensorRequest("enc_position_ids", (1, 8), "int64"), TensorRequest("dec_position_ids", (1, 6), "int64"),
            TensorRequest("enc_mask", (1, 8), "int32"), TensorRequest("labels", (1, 6), "int64")]
    t = collate([[a, b]], reqs, 8, 6, encoder_decoder=True)
    assert t["enc_position_ids"][0].tolist() == [0, 1, 2, 0, 1, 0, 0, 0]
    assert t["dec_position_ids"][0].tolist() == [0, 1, 0, 1, 2, 0]
    assert t["enc_mask"].dtype == np.int32 and t["labels"][0].tolist() == [8, 9, 12, 13, 14, 0]
    with pytest.raises(DynaPipeError, match="5/5 encoder/decoder tokens but the plan pads to 4/6"):
        collate([[a, b]], reqs[:1], 4, 6, encoder_decoder=True)


def test_segment_masks_and_positions():
    enc = torch.tensor([[1, 1, 2, 0]])
    dec = torch.tensor([[1, 2, 2]])
    assert segment_positions(enc).tolist() == [[0, 1, 0, 0]]
    keep = ~segment_mask(enc, enc)[0, 0]
    assert keep.tolist() == [[True, True, False, False], [True, True, False, False],
                             [False, False, True, False], [False, False, False, True]]
    causal = ~segment_mask(dec, dec, causal=True)[0, 0]
    assert causal.tolist() == [[True, False, False], [False, True, False], [False, True, True]]
    cross = ~segment_mask(dec, enc, self_attention=False)[0, 0]
    assert cross.tolist() == [[True, True, False, False], [False, False, True, False], [False, False, True, False]]


def _layers_job() -> dict:
    """One rank: a megatron-core encoder layer and decoder layer (the T5 stage's local specs).
    ``unmasked``: whole-sample rows run with an all-keep mask and with None. ``compact``: rows of
    one sample and a padding tail run with the full segment masks and with the compact ones;
    a loss over the real target tokens. Outputs and parameter gradients of each."""
    from megatron_integration.initialize import destroy, initialize_megatron
    from megatron_integration.t5_handlers import compact_masks
    from megatron_integration.t5_profiler import T5Ops
    from megatron_integration.train_config import GPTModelArgs, ParallelArgs

    initialize_megatron(ParallelArgs(world_size=1, backend="gloo"), seed=3)
    try:
        model = GPTModelArgs(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                             vocab_size=256, max_position_embeddings=96, seq_length=96, kv_channels=16,
                             hidden_dropout=0.0, attention_dropout=0.0)
        ops = T5Ops(model, torch.device("cpu"))
        gen = torch.Generator().manual_seed(0)
        x, ctx = torch.randn(96, 2, 64, generator=gen), torch.randn(96, 2, 64, generator=gen)
        y = torch.randn(24, 2, 64, generator=gen)
        layer = ops.decoder.layers[0]
        params = list(ops.encoder.parameters()) + list(layer.parameters())

        def run(enc_mask, causal, cross, dec_real=None):
            enc_out = ops.encoder(hidden_states=x, attention_mask=enc_mask)
            context = ctx if dec_real is None else enc_out  # the padded rows: the decoder reads the encoder
            dec_out = layer(hidden_states=y, attention_mask=causal, context=context, context_mask=cross)[0]
            if dec_real is None:
                loss = enc_out.square().sum() + dec_out.square().sum()
            else:  # [s, b, h]: only the real target tokens count, as the loss mask has it
                loss = (dec_out.square().sum(-1) * dec_real.T).sum()
            loss.backward()
            # numpy: torch tensors would cross the result queue as shared memory of an exited process.
            res = {"enc": enc_out.detach().numpy(), "dec": dec_out.detach().numpy(),
                   "grads": [p.grad.numpy().copy() for p in params]}
            for p in params:
                p.grad = None
            return res

        out = {"unmasked": {}, "compact": {}}
        enc_seg, dec_seg = torch.ones(2, 96, dtype=torch.int64), torch.ones(2, 24, dtype=torch.int64)
        causal = segment_mask(dec_seg, dec_seg, causal=True)
        for name, omit in (("mask", False), ("none", True)):
            enc_mask = needed_mask(enc_seg, enc_seg) if omit else segment_mask(enc_seg, enc_seg)
            cross = needed_mask(dec_seg, enc_seg, self_attention=False) if omit else \
                segment_mask(dec_seg, enc_seg, self_attention=False)
            out["unmasked"][name] = {"masks": (enc_mask is None, cross is None), **run(enc_mask, causal, cross)}
        # Row 0: sample 1, 70 input and 17 target tokens; row 1: sample 2, 96 and 24 (no padding).
        enc_seg = torch.tensor([[1] * 70 + [0] * 26, [2] * 96])
        dec_seg = torch.tensor([[1] * 17 + [0] * 7, [2] * 24])
        full = (segment_mask(enc_seg, enc_seg), segment_mask(dec_seg, dec_seg, causal=True),
                segment_mask(dec_seg, enc_seg, self_attention=False))
        masks = compact_masks(True, enc_seg, dec_seg)
        out["compact"]["shapes"] = [tuple(masks[k].shape) for k in ("enc_attn_mask", "dec_attn_mask",
                                                                    "cross_attn_mask")]
        for name, (e, d, c) in (("full", full), ("compact", (masks["enc_attn_mask"], masks["dec_attn_mask"],
                                                             masks["cross_attn_mask"]))):
            out["compact"][name] = run(e, d, c, dec_real=(dec_seg > 0).float())
        return out
    finally:
        destroy()


@pytest.fixture(scope="module")
def layer_runs():
    (res,) = spawn(_layers_job, 1, timeout_s=TIMEOUT, threads_per_rank=1)
    return res


def test_a_mask_that_masks_nothing_is_omitted_and_changes_nothing(layer_runs):
    # Rows of one whole sample each (the same one in queries and keys): nothing to mask, no mask built.
    one, dec = torch.tensor([[1, 1, 1], [2, 2, 2]]), torch.tensor([[1, 1], [2, 2]])
    assert needed_mask(one, one) is None and needed_mask(dec, one, self_attention=False) is None
    # Padding, a second sample in a row, or another sample in the keys: the segment mask itself.
    padded, two = torch.tensor([[1, 1, 0], [1, 1, 1]]), torch.tensor([[1, 2, 2], [1, 1, 1]])
    for q, k, self_attention in ((padded, padded, True), (two, two, True), (dec, padded, False),
                                 (torch.tensor([[2, 2], [2, 2]]), one, False), (dec[:, :1], two, False)):
        assert torch.equal(needed_mask(q, k, self_attention), segment_mask(q, k, self_attention=self_attention))
    # megatron-core's encoder layer and decoder layer (cross-attention) give the same outputs and
    # gradients with the all-keep masks and without them.
    res = layer_runs["unmasked"]
    assert res["mask"]["masks"] == (False, False) and res["none"]["masks"] == (True, True)
    for key in ("enc", "dec"):
        assert np.array_equal(res["mask"][key], res["none"][key])
    assert all(np.array_equal(a, b) for a, b in zip(res["mask"]["grads"], res["none"]["grads"]))


def test_rows_of_one_sample_get_compact_masks_with_the_same_loss_and_gradients(layer_runs):
    # Which micro-batches qualify: each row one sample, then only padding, the same sample on both sides.
    enc, dec = torch.tensor([[1, 1, 0], [2, 2, 2]]), torch.tensor([[1, 0], [2, 2]])
    assert single_sample_rows(enc) and single_sample_rows(enc, dec) and single_sample_rows(enc.numpy())
    for q, k in ((torch.tensor([[1, 2, 0], [2, 2, 2]]), None),   # two samples in a row (packing)
                 (torch.tensor([[1, 0, 1], [2, 2, 2]]), None),   # padding inside the row
                 (torch.tensor([[0, 0, 0], [2, 2, 2]]), None),   # a row of padding only
                 (enc, torch.tensor([[2, 0], [1, 1]])),          # another sample on the target side
                 (enc, torch.tensor([[0, 0], [2, 2]]))):         # a target row of padding only
        assert not single_sample_rows(q, k), (q, k)
    assert key_padding_mask(torch.tensor([[1, 1], [2, 2]])) is None
    res = layer_runs["compact"]
    assert res["shapes"] == [(2, 1, 1, 96), (1, 1, 24, 24), (2, 1, 1, 96)]
    # Every real token's output, and every parameter gradient, as with the full segment masks.
    full, compact = res["full"], res["compact"]
    np.testing.assert_array_equal(full["enc"][:70, 0], compact["enc"][:70, 0])
    np.testing.assert_array_equal(full["enc"][:, 1], compact["enc"][:, 1])
    np.testing.assert_array_equal(full["dec"][:17, 0], compact["dec"][:17, 0])
    np.testing.assert_array_equal(full["dec"][:, 1], compact["dec"][:, 1])
    assert not np.array_equal(full["enc"][70:, 0], compact["enc"][70:, 0])  # padding queries do differ
    for a, b in zip(full["grads"], compact["grads"]):
        np.testing.assert_array_equal(a, b)


# -- spawned gloo jobs ------------------------------------------------------------------------

def test_t5_dynapipe_and_packing_losses_equal_padding_pp2(pp2):
    padding, first, resumed, packing = pp2[:4]
    assert (padding["method"], first["method"], packing["method"]) == ("padding", "dynapipe", "packing")
    assert len(padding["losses"]) == 3 and all(np.isfinite(padding["losses"]))
    # DynaPipe: two iterations, then (resumed from the checkpoint of the second) the third.
    assert resumed["start_iteration"] == 2 and len(first["losses"]) == 2 and len(resumed["losses"]) == 1
    dynapipe = first["losses"] + resumed["losses"]
    assert dynapipe == pytest.approx(padding["losses"], abs=1e-5, rel=1e-5)
    # Packed pairs are isolated (masks, positions): the same per-sample computation.
    assert packing["losses"] == pytest.approx(padding["losses"], abs=1e-5, rel=1e-5)
    assert packing["real_tokens"] == padding["real_tokens"] and packing["loss_tokens"] == padding["loss_tokens"]
    assert first["real_tokens"] + resumed["real_tokens"] == padding["real_tokens"]
    assert first["loss_tokens"] + resumed["loss_tokens"] == padding["loss_tokens"]
    assert sum(first["padded_tokens"]) < 0.8 * sum(padding["padded_tokens"][:2])
    # Training moves the loss: the comparison is not of untrained constants.
    assert len(set(np.round(padding["losses"], 6))) == 3


def _with(runs, flag, dynapipe=False):
    """The runs whose arguments give ``flag`` the value ``per-sample``, with ``--use-dynapipe``
    or without it."""
    return [r for r in runs if flag in r["argv"] and r["argv"][r["argv"].index(flag) + 1] == "per-sample"
            and ("--use-dynapipe" in r["argv"]) == dynapipe]


def test_t5_packing_with_per_sample_attention_equals_padding_pp2(pp2):
    (per_sample,) = _with(pp2, "--dynapipe-packed-attention")
    padding, packing = pp2[0], pp2[3]
    assert per_sample["method"] == "packing"
    # Each sample's encoder, decoder and cross-attention computed alone: the loss of the masks.
    assert per_sample["losses"] == pytest.approx(padding["losses"], abs=1e-5, rel=1e-5)
    assert per_sample["losses"] == pytest.approx(packing["losses"], abs=1e-6, rel=1e-6)
    assert per_sample["padded_tokens"] == packing["padded_tokens"]  # the same packed rows


def test_t5_per_sample_ops_are_traced_and_priced_at_their_attention_density(pp2):
    """Each traced op of per-sample packing carries the share of the dense pairs its segment
    tables computed, and the bench's stage check prices it there: the same rows as masked
    packing, less predicted compute."""
    import glob
    import json

    from dynapipe.cost.profile import ProfileCostModel
    from megatron_integration.bench_t5_profile import stage_check
    from test_profile_t5 import T5 as PRICED, t5_profile

    def trace_dir(run):
        return run["argv"][run["argv"].index("--dynapipe-trace-dir") + 1]

    (per_sample,) = _with(pp2, "--dynapipe-packed-attention")
    traces = {"per-sample": trace_dir(per_sample), "packing": trace_dir(pp2[3])}
    notes = [e["args"]["attention"] for path in glob.glob(os.path.join(traces["per-sample"], "rank*.json"))
             for e in json.load(open(path))["traceEvents"] if e.get("cat") == "forward" and e.get("ph") == "X"]
    assert notes and all(0 < v <= 1 for n in notes for k, v in n.items() if k != "calls")
    assert {k for n in notes for k in n} == {"input", "target", "cross", "calls"}
    assert min(n["input"] for n in notes if "input" in n) < 1  # rows of several samples
    # One call a sample (2 samples a micro-batch here, packed or not: never fewer than one).
    assert all(n["calls"] >= 1 for n in notes) and max(n["calls"] for n in notes) > 1
    cm = ProfileCostModel(PRICED, t5_profile(), 2)
    checks = {k: stage_check(path, [1, 2], cm) for k, path in traces.items()}
    for a, b in zip(checks["per-sample"]["stages"], checks["packing"]["stages"]):
        assert a["predicted_ms"] < b["predicted_ms"]


def test_t5_dynapipe_with_per_sample_attention_equals_padding_and_skips_the_padding_pp2(pp2):
    """DynaPipe's rows with each sample's attention alone (``--dynapipe-padded-attention
    per-sample``): the padding loss, planned as ``dynapipe-per-sample``, and every traced op
    computed only its samples' pairs (under 1 where a micro-batch's rows pad)."""
    import glob
    import json

    (alone,) = _with(pp2, "--dynapipe-padded-attention", dynapipe=True)
    padding = pp2[0]
    assert alone["method"] == "dynapipe" and len(alone["losses"]) == 3
    assert alone["losses"] == pytest.approx(padding["losses"], abs=1e-5, rel=1e-5)
    assert alone["loss_tokens"] == padding["loss_tokens"]
    trace = alone["argv"][alone["argv"].index("--dynapipe-trace-dir") + 1]
    ops = [e["args"] for path in glob.glob(os.path.join(trace, "rank*.json"))
           for e in json.load(open(path))["traceEvents"] if e.get("cat") == "forward" and e.get("ph") == "X"]
    shares = [{k: v for k, v in a["attention"].items() if k != "calls"} for a in ops if "attention" in a]
    assert ops and len(shares) == len(ops) and all(0 < v <= 1 for d in shares for v in d.values())
    # One call a sample: a row each.
    assert all(a["attention"]["calls"] == a["mbs"] for a in ops)
    # A micro-batch of several samples pads its shorter rows, whose tails compute nothing.
    # (the encoder stage notes its input side, the decoder stage its target and cross sides).
    assert min(min(d.values()) for d, a in zip(shares, ops) if a["mbs"] > 1) < 1


def test_t5_packing_through_the_dynapipe_executor_trains_the_padding_loss(pp2):
    """``--use-dynapipe --dynapipe-batching packing`` on short pairs, several to a row: the
    planner packs them (rows of --encoder-seq-length / --decoder-seq-length tokens) and its
    search schedules them; with per-sample attention the loss is the padding loss."""
    (searched,) = _with(pp2, "--dynapipe-packed-attention", dynapipe=True)
    padding = pp2[pp2.index(searched) - 1]
    assert "--data-path" in padding["argv"] and padding["method"] == "padding"
    assert searched["method"] == "dynapipe" and len(searched["losses"]) == 2
    assert searched["losses"] == pytest.approx(padding["losses"], abs=1e-5, rel=1e-5)
    assert searched["loss_tokens"] == padding["loss_tokens"] and searched["real_tokens"] == padding["real_tokens"]
    # Rows of several pairs: a fraction of padding's rows.
    assert sum(searched["padded_tokens"]) < 0.5 * sum(padding["padded_tokens"])
    assert len(set(np.round(padding["losses"], 6))) == 2
    # The packing baseline's masked rows of several pairs (block-diagonal masks, positions
    # restarting at each pair): the same loss.
    masked = pp2[pp2.index(searched) + 1]
    assert masked["method"] == "packing" and "--data-path" in masked["argv"]
    assert masked["losses"] == pytest.approx(padding["losses"], abs=1e-5, rel=1e-5)
    assert sum(masked["padded_tokens"]) <= 0.5 * sum(padding["padded_tokens"])  # half the rows, or fewer


def test_a_job_of_many_runs_leaves_no_threads_behind(pp2):
    # Every run's process groups go with it (end_run). Before, each run left megatron-core's
    # twenty-odd gloo groups alive, three threads each: a job's later runs ran among hundreds
    # of idle threads and their connections, and a 45-run bench slowed round after round.
    counts = [r["threads_after"] for r in pp2]
    assert len(counts) >= 30 and max(counts) - min(counts) <= 16, counts


def test_t5_traces_record_which_ops_applied_a_mask(pp2, t5_dist):
    # Packing's rows: several samples need their masks, a row of one whole sample none. The
    # trace says which (the handlers' trace_note), so ops of one shape are compared on one work.
    import json

    notes = []
    for rank in range(2):
        with open(t5_dist / "packing-traces" / f"rank{rank:03d}.json") as f:
            ops = [e for e in json.load(f)["traceEvents"] if e.get("cat") in ("forward", "backward")]
        assert ops and all(isinstance(e["args"].get("masked"), bool) for e in ops)
        forward = {(e["args"]["iteration"], e["args"]["mb"]): e["args"]["masked"] for e in ops if e["cat"] == "forward"}
        assert all(forward[e["args"]["iteration"], e["args"]["mb"]] == e["args"]["masked"]
                   for e in ops if e["cat"] == "backward")
        notes += list(forward.values())
    assert True in notes


def test_t5_half_precision_trains_like_padding_and_bf16_resumes_exactly(pp2):
    fp32 = pp2[0]
    full, cut, resumed, dynapipe, packing = pp2[27:32]
    assert [r["method"] for r in (full, dynapipe, packing)] == ["padding", "dynapipe", "packing"]
    # bf16 weights and activations: not fp32's numbers, but the same training within bf16's rounding.
    assert full["losses"] != fp32["losses"]
    assert full["losses"] == pytest.approx(fp32["losses"], rel=5e-3)
    assert full["loss_tokens"] == fp32["loss_tokens"] and full["real_tokens"] == fp32["real_tokens"]
    # Other micro-batch shapes round differently in bf16 (measured 1.4e-5); packing's rows compute
    # padding's samples.
    assert dynapipe["losses"] == pytest.approx(full["losses"], rel=5e-4)
    assert packing["losses"] == pytest.approx(full["losses"], rel=5e-4)
    assert dynapipe["loss_tokens"] == full["loss_tokens"]
    # The checkpoint holds the optimizer's fp32 main copies: the resumed step is bitwise the same.
    assert cut["losses"] == full["losses"][:2]
    assert resumed["start_iteration"] == 2 and resumed["losses"] == full["losses"][2:]
    # fp16: the loss scale (2**32 at first) overflows; the same iterations are skipped, not failed.
    fp16, fp16_dynapipe = pp2[32:34]
    # Only the first loss (the initial weights) is fp32's: the skipped steps changed no weight.
    assert fp16["losses"] != fp32["losses"] and fp16["losses"][0] == pytest.approx(fp32["losses"][0], rel=5e-3)
    assert fp16_dynapipe["losses"] == pytest.approx(fp16["losses"], rel=5e-4)
    skipped = [[int(line.split("number of skipped iterations:")[1].split("|")[0]) for line in r["log_lines"]]
               for r in (fp16, fp16_dynapipe)]
    assert skipped[0] == skipped[1] and len(skipped[0]) == 3 and sum(skipped[0]) >= 1


def test_t5_stage_holding_encoder_end_and_decoder(pp2):
    padding, dynapipe = pp2[4], pp2[5]
    assert len(padding["losses"]) == 2 and padding["losses"] != pp2[0]["losses"][:2]
    assert dynapipe["losses"] == pytest.approx(padding["losses"], abs=1e-5, rel=1e-5)


def test_each_t5_stage_holds_the_parameters_the_planner_prices(pp2, tmp_path):
    """Every run of the fixture (even, uneven and interleaved placements; 2+2, 3+1 and 3+2
    layers; the WordPiece vocabulary): each rank's stage holds what the planner counts for its
    layout, the decoder's embedding copy, the encoder's final norm and the LM head's bias included."""
    from dynapipe.cost.base import stage_param_count

    placements = set()
    for run in pp2:
        argv = list(run["argv"])
        if "--save" in argv:  # the run saved there since: parsed again, it would be refused as an overwrite
            argv[argv.index("--save") + 1] = str(tmp_path / "unsaved")
        cfg = parse_t5_args(argv, 2, cuda=False)
        model, placement = cfg.planner_model(), cfg.stage_placement()
        planned = [stage_param_count(model, layout) for layout in placement.layouts()]
        assert run["parameters_by_rank"] == planned, (run["argv"], placement)
        placements.add(str(placement))
    assert {"2+0,0+2", "2+0,1+1", "2+1,0+1", "1+0,1+0|0+1,0+1", "1+0,1+0|1+0,0+2"} <= placements, placements


def test_t5_span_corruption_of_indexed_data_dynapipe_equals_padding_pp2(pp2):
    padding, dynapipe = pp2[6], pp2[7]
    assert (padding["method"], dynapipe["method"]) == ("padding", "dynapipe")
    assert len(padding["losses"]) == 2 and all(np.isfinite(padding["losses"]))
    # Megatron's fixed-shape samples (padding) and their unpadded pairs (DynaPipe): same losses.
    assert dynapipe["losses"] == pytest.approx(padding["losses"], abs=1e-5, rel=1e-5)
    assert dynapipe["loss_tokens"] == padding["loss_tokens"] and dynapipe["real_tokens"] == padding["real_tokens"]
    assert sum(dynapipe["padded_tokens"]) < sum(padding["padded_tokens"])
    assert padding["losses"] != pp2[0]["losses"][:2]   # other data than the mock mixture
    # Rank 0's start-up lines: the splits of --split 80,20,0 megatron-core built (no test split),
    # their samples and tokens those the run's loss and token counts are drawn from.
    train, valid = padding["data_lines"]
    assert train.startswith(" > train data: 16 span-corrupted samples of megatron-core's T5 dataset (--split 80,20,0)")
    assert valid.startswith(" > valid data: ") and "span-corrupted samples" in valid
    inputs, targets = (int(x.replace(",", "")) for x in train.split("-> ")[1].split(" target")[0].split(" input + "))
    assert inputs + targets == sum(padding["real_tokens"]) and targets == sum(padding["loss_tokens"])
    assert dynapipe["data_lines"] == padding["data_lines"]
    # Megatron's validation split evaluated after iteration 2 and after training, alike for both.
    values = [[float(line.split("lm loss value:")[1].split("|")[0]) for line in run["eval_lines"]
               if "validation loss at" in line] for run in (padding, dynapipe)]
    assert len(values[0]) == 2 and values[1] == pytest.approx(values[0], abs=1e-5, rel=1e-5)


def test_t5_non_even_placement_trains_dynapipe_like_padding(pp2):
    padding, dynapipe = pp2[8], pp2[9]
    assert (padding["method"], dynapipe["method"]) == ("padding", "dynapipe") and len(dynapipe["losses"]) == 2
    assert dynapipe["losses"] == pytest.approx(padding["losses"], abs=1e-5, rel=1e-5)
    # Weights are drawn by global parameter name: the same model as on the even split.
    assert padding["losses"] == pytest.approx(pp2[0]["losses"][:2], abs=1e-5, rel=1e-5)
    assert dynapipe["loss_tokens"] == pp2[0]["loss_tokens"][:2]
    # --log-throughput: the T5 FLOPs of each iteration (bidirectional encoder, causal decoder,
    # cross-attention) over its time and the 2 ranks; padding executes every pair at 128 + 64.
    from dynapipe.cost.model_flops import model_flops, rows_work

    model = parse_t5_args(TINY.split(), 2, cuda=False).planner_model()
    assert padding["executed_work"] == [rows_work(8, 128, 64, encoder_decoder=True)] * 2
    assert dynapipe["real_work"] == padding["real_work"]
    assert [w.total_tokens for w in padding["real_work"]] == padding["real_tokens"]
    for r in (padding, dynapipe):
        assert len(r["log_lines"]) == 2
        for line, executed, real in zip(r["log_lines"], r["executed_work"], r["real_work"]):
            seconds = float(line.split("elapsed time per iteration (ms):")[1].split("|")[0]) / 1e3
            for field, work in (("| throughput per GPU (TFLOP/s/GPU):", executed),
                                ("real-token throughput per GPU (TFLOP/s/GPU):", real)):
                logged = float(line.split(field)[1].split("|")[0])
                assert logged == pytest.approx(model_flops(model, work) / (seconds * 2e12), rel=0.01), line
    assert all(model_flops(model, d) < 0.8 * model_flops(model, p)
               for d, p in zip(dynapipe["executed_work"], padding["executed_work"]))


def test_t5_dynapipe_pp2_x_dp2_and_tp2_x_pp2_with_and_without_sp_train_like_pp2(pp2, t5_dist, tmp_path):
    from megatron_integration.t5_jobs import run_t5_training

    # Two iterations (the same learning-rate schedule: --exit-interval stops a --train-iters 3 run);
    # then the PP2 torch_dist checkpoint of iteration 2 resumed on two replicas, saved by both.
    # Then every method on TP2 x PP2 (two iterations, padding saving), the PP2 checkpoint resumed
    # at TP2 for the third, and every method on TP2 x PP2 with sequence parallelism, contiguous
    # and (padding, DynaPipe) interleaved.
    tp2 = TINY + " --tensor-model-parallel-size 2"
    sp = tp2 + " --sequence-parallel --exit-interval 2"
    ranks = run_t5_training([(TINY + " --use-dynapipe --exit-interval 2 --check-weight-hash-across-dp-replicas-interval "
                                     "1").split(),
                             (TINY + f" --load {t5_dist / 'cut'} --save {t5_dist / 'dp2'}").split(),
                             (tp2 + f" --exit-interval 2 --save {t5_dist / 'tp2'}").split(),
                             (tp2 + " --exit-interval 2 --use-dynapipe").split(),
                             (tp2 + " --exit-interval 2" + PACKING).split(),
                             (tp2 + f" --load {t5_dist / 'cut'}").split(),
                             sp.split(), (sp + " --use-dynapipe").split(), (sp + PACKING).split(),
                             (sp + " --dynapipe-placement interleaved").split(),
                             (sp + " --dynapipe-placement interleaved --use-dynapipe").split()],
                            4, timeout_s=TIMEOUT)
    dynapipe, resumed = ranks[0][:2]
    assert all(r[0]["losses"] == dynapipe["losses"] for r in ranks[1:])
    assert len(dynapipe["losses"]) == 2
    # The replicas, training different micro-batches of each global batch, hold bit-identical weights.
    assert dynapipe["hash_lines"] == [f">>> Weight hashes match after {k} iterations..." for k in range(3)]
    # Two replicas summing their gradients train the same global batches as PP2's padding.
    assert dynapipe["losses"] == pytest.approx(pp2[0]["losses"][:2], abs=1e-5, rel=1e-5)
    assert dynapipe["loss_tokens"] == pp2[0]["loss_tokens"][:2]
    # The embedding copies of the second replica are replicas too: one tensor a key, equal to PP2's.
    assert resumed["start_iteration"] == 2 and resumed["losses"] == pytest.approx(pp2[0]["losses"][2:], abs=1e-6)
    final = _dist_tensors(t5_dist / "full" / "iter_0000003", tmp_path)
    dp2 = _dist_tensors(t5_dist / "dp2" / "iter_0000003", tmp_path)
    assert set(dp2) == set(final) and max((dp2[k] - final[k]).abs().max().item() for k in final) < 1e-6
    # TP2 x PP2: each layer's weights split over two ranks (the sharded weights are slices of the
    # unsplit ones), the same losses and token counts as PP2 for every method, on every rank.
    # With sequence parallelism too: messages are sequence shards, norms' and row-parallel biases'
    # gradients are summed over the TP group; and on the interleaved placement (two chunks a rank).
    tp_runs = [r[2:5] + r[6:11] for r in ranks]
    assert [run["method"] for run in tp_runs[0]] == ["padding", "dynapipe", "packing"] * 2 + ["padding", "dynapipe"]
    assert [r[0]["tp_size"] for r in ranks] == [1] * 4 and all(run["tp_size"] == 2 for rank in tp_runs for run in rank)
    for run in (run for rank in tp_runs for run in rank):
        assert run["losses"] == pytest.approx(pp2[0]["losses"][:2], abs=1e-5, rel=1e-5), run["method"]
        assert run["loss_tokens"] == pp2[0]["loss_tokens"][:2]
    # Saved at TP2: the unsplit tensors under the same keys as PP2's checkpoint of iteration 2. Two
    # Adam steps of lr 1e-2 move a weight by up to 2e-2, and TP2 sums in another order (measured
    # 1.6e-4 at most); a shard put in the wrong place would be off by the weights' size (~0.1).
    cut = _dist_tensors(t5_dist / "cut" / "iter_0000002", tmp_path)
    at_tp2 = _dist_tensors(t5_dist / "tp2" / "iter_0000002", tmp_path)
    assert set(at_tp2) == set(cut) and max((at_tp2[k] - cut[k]).abs().max().item() for k in cut) < 1e-3
    # PP2's checkpoint resharded at load: TP2 trains the third step as PP2 did.
    resharded = ranks[0][5]
    assert resharded["start_iteration"] == 2
    assert resharded["losses"] == pytest.approx(pp2[0]["losses"][2:], abs=1e-5, rel=1e-5)


def test_t5_torch_dist_resume_is_exact_and_loads_at_another_placement(pp2, t5_dist, tmp_path):
    from megatron_integration.checkpoint_dist import read_common

    full, cut, resumed, placed = pp2[0], pp2[19], pp2[20], pp2[21]
    assert cut["losses"] == full["losses"][:2]
    # Bitwise: the same weights, optimizer state, data position and RNG after the round trip.
    assert resumed["start_iteration"] == 2 and resumed["losses"] == full["losses"][2:]
    # The model FLOPs trained so far (Megatron-LM's num_floating_point_operations_so_far): recorded at
    # the cut, counted on from there.
    at_cut = read_common(str(t5_dist / "cut" / "iter_0000002"))["num_floating_point_operations_so_far"]
    assert 0 < at_cut < full["flops_so_far"] and resumed["flops_so_far"] == pytest.approx(full["flops_so_far"])
    final = _dist_tensors(t5_dist / "full" / "iter_0000003", tmp_path)
    again = _dist_tensors(t5_dist / "resumed" / "iter_0000003", tmp_path)
    assert any(k.startswith("optimizer.state.exp_avg_sq.") for k in final) and set(again) == set(final)
    assert [k for k in final if not torch.equal(final[k], again[k])] == []  # Adam's moments included
    # Stage 1 of 2+1,0+1 holds the last decoder layer and the tied output layer (a copy of the word
    # embedding): loaded from the even split's checkpoint by global keys, it trains the same step.
    assert placed["start_iteration"] == 2 and placed["losses"] == pytest.approx(full["losses"][2:], abs=1e-6)
    moved = _dist_tensors(t5_dist / "placed" / "iter_0000003", tmp_path)
    assert set(moved) == set(final)
    assert max((moved[k] - final[k]).abs().max().item() for k in final) < 1e-6
    before = _dist_tensors(t5_dist / "cut" / "iter_0000002", tmp_path)
    assert max((before[k] - final[k]).abs().max().item() for k in final) > 1e-4  # the step above is not empty
    # Megatron-LM's T5 arguments (--num-layers is the encoder's) and the placement saved at.
    args = read_common(str(t5_dist / "placed" / "iter_0000003"))["args"]
    assert (args.num_layers, args.encoder_num_layers, args.decoder_num_layers) == (2, 2, 2)
    assert (args.encoder_seq_length, args.decoder_seq_length, args.dynapipe_placement) == (128, 64, "2+1,0+1")
    files = os.listdir(t5_dist / "placed" / "iter_0000003")
    assert all(f + ".sha256" in files for f in files if not f.endswith(".sha256"))


def test_t5_resumes_from_a_non_persistent_checkpoint_where_load_has_none(pp2, t5_dist):
    full, saved, resumed = pp2[0], pp2[-2], pp2[-1]
    assert "--non-persistent-save-interval" in saved["argv"] and "--load" in resumed["argv"]
    # Saved after iteration 1 alone: 2 and 3 were persistent saves (3, the end of training).
    assert sorted(os.listdir(t5_dist / "np_global")) == ["iter_0000001", "latest_checkpointed_iteration.txt"]
    assert sorted(d for d in os.listdir(t5_dist / "np_saved") if d.startswith("iter_")) == ["iter_0000002",
                                                                                           "iter_0000003"]
    assert saved["losses"] == full["losses"]
    # --load holds nothing: the job resumed from the non-persistent checkpoint, bitwise.
    assert resumed["start_iteration"] == 1 and resumed["losses"] == full["losses"][1:]
    assert os.path.isdir(t5_dist / "np_resumed" / "iter_0000003")


def _reference_sharded_keys(cfg) -> dict:
    """megatron-core's own one-stage ``T5Model`` of ``cfg``'s shape (local layer specs, tied output
    layer): its sharded keys, tensors with their global shapes."""
    from dataclasses import replace

    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.models.T5 import t5_spec
    from megatron.core.models.T5.t5_model import T5Model

    from megatron_integration.model import transformer_config

    base = cfg.base
    parallel = replace(base.parallel, pipeline_model_parallel_size=1)
    enc, dec = (transformer_config(replace(base.model, num_layers=n), parallel, cuda=False)
                for n in (cfg.encoder_layers, cfg.decoder_layers))
    t5 = T5Model(config=dec, encoder_config=enc, transformer_encoder_layer_spec=t5_spec.encoder_model_with_local_spec(),
                 transformer_decoder_layer_spec=t5_spec.decoder_model_with_local_spec(),
                 vocab_size=base.model.vocab_size, max_sequence_length=base.model.max_position_embeddings,
                 share_embeddings_and_output_weights=True)
    metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    return {v.key if isinstance(v, ShardedTensor) else v.unique_key:
            tuple(v.global_shape) if isinstance(v, ShardedTensor) else "object"
            for v in nested_values(t5.sharded_state_dict(metadata=metadata))}


def _one_stage_job(argvs: list) -> dict:
    """Rank body of a one-rank job: each T5 command line (start, losses, checkpoint lines, or its
    one-line error), then megatron-core ``T5Model``'s sharded keys for the first one's shape."""
    from megatron_integration.initialize import destroy
    from megatron_integration.t5_training import pretrain_t5

    configs = [parse_t5_args(argv.split(), 1) for argv in argvs]
    out = {"runs": []}
    try:
        for cfg in configs:
            try:
                run = pretrain_t5(cfg, stream=io.StringIO())
                out["runs"].append({"start_iteration": run.start_iteration, "losses": run.losses,
                                    "checkpoint_lines": run.checkpoint_lines})
            except DynaPipeError as e:
                out["runs"].append({"error": str(e)})
        out["reference"] = _reference_sharded_keys(configs[0])
    finally:
        destroy()
    return out


def test_t5_torch_dist_checkpoint_loads_at_pp1_with_megatron_cores_t5_keys(pp2, t5_dist, tmp_path):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from megatron_integration.launch import spawn

    cut, one_stage = t5_dist / "cut", TINY.replace(" --pipeline-model-parallel-size 2", "")
    # As many threads as each rank of the PP2 job had: the same kernels sum in the same order.
    threads = max(1, (os.cpu_count() or 1) // 2)
    job = spawn(_one_stage_job, 1, ([f"{one_stage} --load {cut} --save {t5_dist / 'pp1'}",
                                     f"{one_stage} --decoder-num-layers 3 --load {cut}",
                                     # A token budget over the data: refused before any stage is built.
                                     f"{one_stage} --use-dynapipe --dynapipe-tokens-per-global-batch 100000000"],),
                timeout_s=TIMEOUT,
                threads_per_rank=threads)[0]
    pp1, refused, budget = job["runs"]
    assert budget["error"].startswith("--dynapipe-tokens-per-global-batch 100000000: more than the ")
    # The PP2 checkpoint's layers, embeddings (one copy) and optimizer state on one stage: the same step.
    assert pp1["start_iteration"] == 2 and pp1["losses"] == pytest.approx(pp2[0]["losses"][2:], abs=1e-6)
    assert pp1["checkpoint_lines"][1] == ("(TP, PP) mismatch after resume ((1, 1) vs (1, 2) from checkpoint): RNG "
                                          "state will be ignored")
    final = _dist_tensors(t5_dist / "full" / "iter_0000003", tmp_path)
    one = _dist_tensors(t5_dist / "pp1" / "iter_0000003", tmp_path)
    assert set(one) == set(final) and max((one[k] - final[k]).abs().max().item() for k in final) < 1e-6
    assert refused["error"] == (f"{cut}/iter_0000002: the checkpoint does not fit this model (--decoder-num-layers "
                                f"2 in the checkpoint, 3 here); use the model arguments it was saved with.")
    # What the PP2 stages wrote is what megatron-core's unsplit T5Model keys: names, global shapes, objects.
    saved = {}
    for key, meta in FileSystemReader(str(cut / "iter_0000002")).read_metadata().state_dict_metadata.items():
        # megatron-core 0.19 also stores the common part (args, iteration) here, as common_state/*.
        if not key.startswith(("optimizer.", "rng_state", "common_state")):
            saved[key] = tuple(meta.size) if isinstance(meta, TensorStorageMetadata) else "object"
    assert saved == job["reference"]
    assert {"encoder.layers.self_attention.linear_qkv.weight", "decoder.layers.cross_attention.linear_kv.weight",
            "embedding.word_embeddings.weight", "lm_head.output_layer.bias"} <= set(saved)


def test_bench_t5_refuses_what_it_cannot_run(tmp_path, capsys, monkeypatch):
    from dynapipe.cli import main
    import megatron_integration.bench_t5_profile as t5_profile

    def measured(*a, **k):
        raise AssertionError("the bench started measuring before refusing")
    monkeypatch.setattr(t5_profile, "measure_bench_profile", measured)
    out = str(tmp_path / "t5.json")
    for extra, text in ((["--methods", "padding-mb"], "for --model t5 choose"),
                        (["--micro-batch-size", "2"], "tunes the baselines' micro-batch size"),
                        (["--t5-sweep", "0,2"], "--t5-sweep"), (["--rounds", "0"], "give at least 1 round"),
                        (["--train-iters", "1"], "leaves no timed iteration"),
                        # Checks GPT's bench makes too: a negative warm-up would time it and count the
                        # last iteration twice; a flag given at all, even 0 or "", is not ignored.
                        (["--warmup-iters", "-1"], "--warmup-iters -1: must be >= 0"),
                        (["--sweep-top", "0"], "--sweep-top 0 is not supported with --model t5"),
                        (["--png", ""], "--png '' is not supported with --model t5"),
                        (["--t5-sweep", ""], "--t5-sweep '': give micro-batch sizes"),
                        # One label and trace directory a size: a repeat would merge as a round.
                        (["--t5-sweep", "2,1,2"], "--t5-sweep '2,1,2': 2 given more than once"),
                        # What the runs would not read: sizes without a baseline, a trace folder the
                        # bench chooses itself, a schedule without a DynaPipe method.
                        (["--methods", "dynapipe", "--t5-sweep", "1,2"], "--t5-sweep 1,2 sets the baselines'"),
                        (["--dynapipe-trace-dir", str(tmp_path)], "the bench writes every DynaPipe run's"),
                        (["--save", str(tmp_path / "ck")], "would overwrite the last one's checkpoints"),
                        (["--methods", "padding", "--dynapipe-schedule", "1f1b"], "runs no DynaPipe method"),
                        # Named as typed: the run's own check would name --micro-batch-size.
                        (["--t5-sweep", "3"], "--t5-sweep 3: 3 x 1 data-parallel replica(s) does not divide "
                                              "--global-batch-size 32"),
                        (["--methods", "padding", "--calibrate-iters", "2"], "--methods padding plans none"),
                        (["--methods", ",dynapipe"], "an empty entry"),
                        (["--exit-interval", "1"], "--exit-interval 1 stops every run after iteration 1")):
        assert main(["bench", "--model", "t5", "--output", out] + extra) == 2
        assert text in capsys.readouterr().err
    assert not (tmp_path / "t5.json").exists()


def test_bench_long_preset_is_the_tiny_t5_on_long_rows_and_t5_only(tmp_path, capsys):
    from dynapipe.cli import main
    from megatron_integration.bench_t5 import T5_PRESETS, t5_with_defaults

    argv = t5_with_defaults([], "long")
    flags = {argv[i]: argv[i + 1] for i in range(len(argv) - 1) if argv[i].startswith("--")}
    tiny = t5_with_defaults([], "tiny")
    assert flags["--encoder-seq-length"] == "4096" and flags["--global-batch-size"] == "128"
    assert [a for a in argv if a not in ("4096", "128")] == [a for a in tiny if a not in ("1024", "32")]
    # Its ranks pre-touch a heap sized for encoder rows of up to 4,096 tokens.
    assert T5_PRESETS["long"].cpu_pretouch_mb > T5_PRESETS["tiny"].cpu_pretouch_mb > 0
    assert "padding" not in T5_PRESETS["long"].methods and "padding" in T5_PRESETS["tiny"].methods
    assert main(["bench", "--preset", "long", "--output", str(tmp_path / "g.json")]) == 2
    assert "--preset long is a T5 preset: add --model t5" in capsys.readouterr().err


def test_bench_t5_figures_count_the_slowest_rank_after_the_warm_up():
    from megatron_integration.bench_t5 import t5_figures

    rank = {"iteration_ms": [900.0, 100.0, 300.0], "real_tokens": [50, 100, 200], "padded_tokens": [80, 200, 400],
            "plan_wait_ms": [0.0, 1.0, 3.0], "losses": [3.0, 2.0, 1.0], "cpu_ms": [5.0, 100.0, 200.0],
            "children_cpu_ms": [1.0, 50.0, None], "minor_faults": [9000, 10, 20], "system_ms": [90.0, 1.0, 3.0],
            "pretouch_s": 0.5}
    slow = dict(rank, iteration_ms=[900.0, 200.0, 300.0])
    fig = t5_figures([rank, slow], warmup_iters=1, prefetch=2)
    assert fig["real_tokens_per_s"] == pytest.approx(300 / 0.5)
    # Iterations 1 and 2 queued plan 2 only (the run has 3): the planner's 2 x 50 ms is one plan's.
    assert fig["planner_cpu_ms"] == pytest.approx(100.0)
    assert fig["padding_efficiency"] == pytest.approx(0.5) and fig["timed_iterations"] == 2
    # Both ranks' CPU and their planner workers' over the timed iterations: 2 x (300 + 50) ms.
    assert fig["real_tokens_per_cpu_s"] == pytest.approx(300 / 0.7, abs=0.01)
    # Memory first touched in the timed iterations, both ranks: 2 x (10 + 20) faults over 2 iterations.
    assert (fig["minor_faults"], fig["system_ms"]) == (30.0, 4.0)
    assert fig["pretouch_s"] == 0.5


def test_pretrain_t5_script_reports_bad_input_in_one_line(capsys):
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "scripts", "pretrain_t5.py")
    spec = importlib.util.spec_from_file_location("pretrain_t5_script", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(TINY.replace("--decoder-seq-length 64", "").split()) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --decoder-seq-length is required") and "\n" not in err


def test_the_mask_decision_is_taken_from_the_host_copies_when_given():
    # On CUDA, deciding from the device tensors would make every forward wait for the GPU; the
    # handlers pass the loaded tensors' host copies, which must decide alone.
    whole = torch.ones(2, 4, dtype=torch.int64)
    padded = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    assert needed_mask(whole, whole) is None
    assert needed_mask(whole, whole, host=(padded.numpy(), padded.numpy())) is not None
    assert needed_mask(padded, padded, host=(whole.numpy(), whole.numpy())) is None


def test_t5_resumed_at_another_train_iters_continues_its_weighted_blend(pp2):
    # The checkpoint records the blend's size (64 samples); the run resumed with --train-iters
    # 16 builds that blend, not one of 128, so iterations 5-8 train on the same samples.
    full, _, resumed = pp2[-8:-5]
    assert len(full["losses"]) == 8 and resumed["start_iteration"] == 4
    assert resumed["losses"] == full["losses"][4:8]
    assert (" > keeping the weighted blend as the checkpoint sized it (64 samples; this run's --train-iters 16 would "
            "size it for 128 samples), so the consumed samples continue its order") in resumed["checkpoint_lines"]


def test_t5_report_stats_computes_every_iteration_twice_and_trains_the_same(pp2):
    stats, dynapipe = pp2[-3], pp2[1]  # DynaPipe for two iterations, without and with report_stats
    assert "--rerun-mode" in stats["argv"] and stats["losses"] == dynapipe["losses"]
    # Reported every two iterations, by rank 0: the last stage's loss and both stages' gradient norms.
    assert stats["stats_lines"] == ["  loss: 2 samples, all identical", "  gradient norm: 4 samples, all identical"]


def test_t5_skips_an_iteration_on_padding_and_dynapipe_alike(pp2):
    padding, dynapipe, full = pp2[-5], pp2[-4], pp2[0]  # full: padding for 3 iterations
    assert "--iterations-to-skip" in padding["argv"] and "--use-dynapipe" in dynapipe["argv"]
    assert len(padding["losses"]) == len(dynapipe["losses"]) == 2
    assert padding["losses"][0] == full["losses"][0]
    assert np.allclose(dynapipe["losses"], padding["losses"], rtol=0, atol=1e-5)
    assert abs(padding["losses"][1] - full["losses"][2]) > 1e-4  # one optimizer step before it, not two


def _t5_losses(argvs: list) -> list:
    """Rank body: each T5 command line's losses, in one job."""
    from megatron_integration.initialize import destroy
    from megatron_integration.t5_training import pretrain_t5

    out = []
    try:
        for argv in argvs:
            out.append(pretrain_t5(parse_t5_args(argv.split(), 1), stream=io.StringIO()).losses)
    finally:
        destroy()
    return out


def test_t5_targets_longer_than_the_encoder_limit_are_planned_whole(tmp_path):
    # DynaPipe's planner cut both sides at --encoder-seq-length: targets of up to 110 tokens under
    # --decoder-seq-length 128 were planned at 64 while the data kept them whole, and every
    # iteration was refused ("the plan and the data disagree on lengths").
    import json

    rng = np.random.default_rng(0)
    data = tmp_path / "pairs.jsonl"
    with open(data, "w") as f:
        for _ in range(16):
            f.write(json.dumps({"input": "q" * int(rng.integers(5, 40)), "target": "t" * int(rng.integers(60, 110))})
                    + "\n")
    base = ("--encoder-num-layers 1 --decoder-num-layers 1 --hidden-size 64 --num-attention-heads 4 "
            "--encoder-seq-length 64 --decoder-seq-length 128 --vocab-size 320 --micro-batch-size 2 "
            f"--global-batch-size 8 --train-iters 2 --lr 1e-3 --hidden-dropout 0 --attention-dropout 0 "
            f"--split 100,0,0 --seed 3 --data-path {data}")
    padding, dynapipe = spawn(_t5_losses, 1, ([base, base + " --use-dynapipe --dynapipe-timeout-s 60"],),
                              timeout_s=TIMEOUT)[0]
    assert len(dynapipe) == 2 and dynapipe == pytest.approx(padding, abs=1e-5), (padding, dynapipe)
