"""Model FLOPs as Megatron-LM's --log-throughput counts them (dynapipe.cost.model_flops)."""
import numpy as np
import pytest

from dynapipe.batching.types import MicroBatch
from dynapipe.config import ModelConfig
from dynapipe.cost.model_flops import (TokenWork, micro_batches_work, model_flops, rows_work, samples_work,
                                       tflops_per_device)

GPT = ModelConfig(name="g", arch="gpt", num_layers=4, hidden_size=256, num_attention_heads=8, ffn_hidden_size=1024,
                  vocab_size=32000).validate()


def test_a_fixed_shape_batch_costs_the_closed_form():
    """B rows of s tokens on a GPT with a 4h MLP: 72 B s L h^2 (1 + s/(12 h) + V/(12 L h)), the
    Narayanan et al. count with Megatron-LM's causal half of the scores."""
    B, s, L, h, V = 6, 512, 4, 256, 32000
    want = 72 * B * s * L * h ** 2 * (1 + s / (12 * h) + V / (12 * L * h))
    assert model_flops(GPT, rows_work(B, s)) == pytest.approx(want, rel=1e-12)


def test_gqa_and_swiglu_shrink_and_grow_the_right_terms():
    gqa = ModelConfig(**{**GPT.__dict__, "num_query_groups": 2})
    glu = ModelConfig(**{**GPT.__dict__, "gated_linear_unit": True})
    work = rows_work(1, 100)
    h, kv_full, kv_gqa = 256, 256, 64
    # Two fewer key/value widths per layer and token: 2 x (256 - 64) x h multiply-adds.
    assert model_flops(GPT, work) - model_flops(gqa, work) == pytest.approx(6 * 100 * 4 * h * 2 * (kv_full - kv_gqa))
    # A gated MLP adds one more h x ffn GEMM per layer and token.
    assert model_flops(glu, work) - model_flops(GPT, work) == pytest.approx(6 * 100 * 4 * h * 1024)


def test_samples_cost_less_than_the_rows_they_are_padded_or_packed_into():
    lengths = np.array([100, 300, 40, 72])
    real = samples_work(lengths)
    assert (real.tokens, real.squares) == (512, 100 ** 2 + 300 ** 2 + 40 ** 2 + 72 ** 2)
    packed = rows_work(1, 512)  # the four in one row: the same tokens, attention over the whole row
    assert packed.tokens == real.tokens and model_flops(GPT, packed) > model_flops(GPT, real)
    padded = rows_work(4, 512)
    assert model_flops(GPT, padded) > 3.5 * model_flops(GPT, real)


def test_planned_micro_batches_count_every_row_at_the_padded_length():
    mbs = [MicroBatch(samples=[0, 1], seqlen=64), MicroBatch(samples=[2, 3, 4], rows=[[2, 3], [4]], seqlen=128)]
    assert micro_batches_work(mbs, encoder_decoder=False) == rows_work(2, 64) + rows_work(2, 128)
    t5 = [MicroBatch(samples=[0], seqlen=64, dec_seqlen=16)]
    assert micro_batches_work(t5, encoder_decoder=True) == TokenWork(tokens=16, squares=256, enc_tokens=64,
                                                                     enc_squares=4096, cross=1024)


def test_encoder_decoder_counts_bidirectional_encoder_causal_decoder_and_cross_attention():
    t5 = ModelConfig(name="t", arch="t5", num_layers=3, encoder_layers=2, decoder_layers=1, hidden_size=64,
                     num_attention_heads=4, ffn_hidden_size=256, vocab_size=1000).validate()
    h, ffn, V = 64, 256, 1000
    e, d = 40, 10  # one pair
    per_layer = 4 * h * h + 2 * h * ffn
    want_macs = (e * 2 * per_layer + 2 * e * e * 2 * h               # encoder: full score matrix
                 + d * per_layer + d * d * h                         # decoder self-attention: causal half
                 + d * 2 * h * h + e * 2 * h * h + d * e * 2 * h     # cross: Q and output, K and V, scores
                 + d * h * V)
    assert model_flops(t5, samples_work(np.array([[e, d]]))) == pytest.approx(6 * want_macs, rel=1e-12)
    assert samples_work(np.array([[e, d]])) == rows_work(1, e, d, encoder_decoder=True)


def test_work_adds_and_round_trips_and_bad_lengths_are_named():
    a, b = rows_work(2, 8), samples_work(np.array([[3, 4], [5, 6]]))
    assert (a + b).total_tokens == a.total_tokens + b.total_tokens == 16 + 18
    assert TokenWork.from_json(b.to_json()) == b
    with pytest.raises(ValueError, match=r"shape \(2, 3\)"):
        samples_work(np.zeros((2, 3)))
    assert tflops_per_device(4e12, 2.0, 2) == 1.0 and tflops_per_device(1.0, 0.0, 1) == 0.0
