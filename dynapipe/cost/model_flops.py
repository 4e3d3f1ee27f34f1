"""Model floating-point operations of a training iteration, as Megatron-LM's
``--log-throughput`` counts them.

Megatron-LM prices a global batch by the transformer's matrix multiplications only:
forward, plus two backward GEMMs (weight and data gradient), 2 FLOPs a multiply-add. The
projections and the MLP scale with the tokens, the attention scores and their weighted sum
with the squared sequence lengths (half of them under a causal mask), and the output layer
with the tokens times the vocabulary. Embeddings, norms and softmax are not counted. For a
fixed-shape (BSHD) batch Megatron-LM counts every row at ``--seq-length``; for packed (THD)
sequences the real tokens and each sub-sequence's own squared length.

A batch's work is summarised by :class:`TokenWork`: the sums the count is linear in. Two
summaries of the same batch answer two questions: :func:`micro_batches_work` the shapes a
method executed (every row at its padded length: Megatron-LM's count for the layout run) and
:func:`samples_work` the samples themselves (each at its own lengths: the work any batching
must do). Encoder-decoder models are counted by the same rules: a bidirectional encoder (no
causal half), a causal decoder, and cross-attention over every (decoder, encoder) token pair.
No torch.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Iterable

import numpy as np

from dynapipe.config import ModelConfig

# Each GEMM runs three times (forward, backward data and weight gradients); 2 FLOPs a multiply-add.
FLOPS_PER_MAC = 3 * 2


@dataclass(frozen=True)
class TokenWork:
    """The sums a batch's FLOPs are linear in (tokens; squares in tokens^2).

    Decoder-only models: ``tokens`` and ``squares`` of the sequences attention runs over.
    Encoder-decoder models: ``tokens`` / ``squares`` the decoder's, ``enc_tokens`` /
    ``enc_squares`` the encoder's, ``cross`` the sum of decoder x encoder lengths.
    """

    tokens: int = 0
    squares: int = 0
    enc_tokens: int = 0
    enc_squares: int = 0
    cross: int = 0

    def __add__(self, other: "TokenWork") -> "TokenWork":
        return TokenWork(*(a + b for a, b in zip(self.astuple(), other.astuple())))

    def astuple(self) -> tuple[int, ...]:
        return (self.tokens, self.squares, self.enc_tokens, self.enc_squares, self.cross)

    @property
    def total_tokens(self) -> int:
        """Every token the batch holds, encoder and decoder (tokens)."""
        return self.tokens + self.enc_tokens

    def to_json(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_json(d: dict) -> "TokenWork":
        return TokenWork(**{k: int(v) for k, v in d.items()})


def rows_work(rows: int, seqlen: int, dec_seqlen: int = 0, encoder_decoder: bool = False) -> TokenWork:
    """``rows`` rows of ``seqlen`` tokens (and ``dec_seqlen`` decoder tokens for an
    encoder-decoder model), each computed whole: attention over the full row."""
    if not encoder_decoder:
        return TokenWork(tokens=rows * seqlen, squares=rows * seqlen * seqlen)
    return TokenWork(tokens=rows * dec_seqlen, squares=rows * dec_seqlen * dec_seqlen, enc_tokens=rows * seqlen,
                     enc_squares=rows * seqlen * seqlen, cross=rows * seqlen * dec_seqlen)


def samples_work(lengths: np.ndarray) -> TokenWork:
    """Every sample at its own lengths: ``lengths`` in tokens, ``(n,)`` for decoder-only samples,
    ``(n, 2)`` (input, target) for encoder-decoder ones."""
    a = np.asarray(lengths, dtype=np.int64)
    if a.ndim == 1:
        return TokenWork(tokens=int(a.sum()), squares=int((a * a).sum()))
    if a.ndim != 2 or a.shape[1] != 2:
        raise ValueError(f"lengths of shape {a.shape}: expected (n,) or (n, 2) tokens")
    enc, dec = a[:, 0], a[:, 1]
    return TokenWork(tokens=int(dec.sum()), squares=int((dec * dec).sum()), enc_tokens=int(enc.sum()),
                     enc_squares=int((enc * enc).sum()), cross=int((enc * dec).sum()))


def micro_batches_work(micro_batches: Iterable, encoder_decoder: bool) -> TokenWork:
    """What micro-batches (:class:`~dynapipe.batching.types.MicroBatch`) execute: each of its
    rows at the micro-batch's padded ``seqlen`` (and ``dec_seqlen``)."""
    total = TokenWork()
    for mb in micro_batches:
        total = total + rows_work(mb.mbs, mb.seqlen, mb.dec_seqlen, encoder_decoder)
    return total


def model_flops(model: ModelConfig, work: TokenWork) -> float:
    """Forward + backward FLOPs of ``work`` on ``model`` (Megatron-LM's count; see the module
    docstring). For a decoder-only model of hidden size h, L layers, a 4h MLP and vocabulary V,
    B rows of s tokens cost ``72 B s L h^2 (1 + s / (12 h) + V / (12 L h))``."""
    h, q, kv = model.hidden_size, model.attention_dim, model.kv_dim
    projections = h * (q + 2 * kv) + q * h  # QKV and the attention output, per token
    mlp = h * model.ffn_hidden_size * (3 if model.gated_linear_unit else 2)
    logits = h * model.vocab_size
    if not model.is_encoder_decoder:
        layers = model.num_layers
        # Causal: half the score matrix, for scores and for their weighted sum.
        macs = work.tokens * (layers * (projections + mlp) + logits) + work.squares * layers * q
        return float(FLOPS_PER_MAC * macs)
    enc, dec = model.encoder_layers, model.decoder_layers
    encoder = work.enc_tokens * enc * (projections + mlp) + work.enc_squares * enc * 2 * q
    cross_projections = work.tokens * (h * q + q * h) + work.enc_tokens * h * 2 * kv  # Q, output; K, V of the encoder
    decoder = (work.tokens * dec * (projections + mlp) + work.squares * dec * q
               + dec * cross_projections + work.cross * dec * 2 * q)
    return float(FLOPS_PER_MAC * (encoder + decoder + work.tokens * logits))


def tflops_per_device(flops: float, elapsed_s: float, devices: int) -> float:
    """TFLOP/s per device (GPU, or rank on CPU) for ``flops`` done by ``devices`` together in
    ``elapsed_s`` seconds, as Megatron-LM divides by the world size (0.0 without time)."""
    if elapsed_s <= 0 or devices <= 0:
        return 0.0
    return flops / (elapsed_s * 1e12 * devices)
