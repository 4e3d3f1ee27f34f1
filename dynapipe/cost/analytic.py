"""Analytic cost model: FLOPs for time, Korthikanti et al. (2022) formulas for memory.

Time of an op = FLOPs / (peak x achievable fraction x efficiency(tokens)) + a fixed
per-op overhead, where ``efficiency(tokens) = tokens / (tokens + half_efficiency_tokens)``
models how thin micro-batches under-use an accelerator (see ``DeviceConfig``). Each
FLOP takes the efficiency of the tokens its GEMM spans: for T5, the encoder layers and
the cross-attention key/value projections the encoder tokens, everything else in the
decoder (and the output layer) the decoder tokens.
Per transformer layer with ``b`` samples of ``s`` tokens, hidden ``h``, attention width
``a_d`` (heads x kv_channels), key/value width ``k_d`` (query groups x kv_channels; ``a_d``
without grouped-query attention), ``n`` heads and FFN width ``f``, the forward FLOPs are
``2bsh(a_d + 2k_d) + 2bs*a_d*h`` (QKV and output projections) ``+ 4bs^2*a_d`` (scores
and weighted values: the quadratic term) ``+ 2bshf(g + 1)`` (MLP; ``g`` = 2 for a gated
SwiGLU MLP, whose FC1 is twice as wide, else 1). Backward is twice the forward;
recomputation adds the attention core (selective) or the whole layer forward (full).
Biases and the norm type change the parameter count (``stage_param_count``), not these
GEMM FLOPs.

Stored activations per layer, in bytes for 2-byte activations with dropout and unfused
attention, generalise Korthikanti's ``sbh(34 + 5ns/h)``: ``bs(10h + 4a_d + 4k_d + (2g + 2)f)
+ 5nbs^2`` (equal to the paper's formula when ``a_d = k_d = h``, ``g = 1`` and ``f = 4h``; a
gated MLP keeps its two FC1 halves and their product). Dropout at 0, rotary positions, fused
attention and the dtype change the terms as :mod:`dynapipe.cost.activation_bytes` says
(at dropout 0: ``bs(8h + ...) + 2nbs^2``; fused attention: no ``s^2`` term). Selective
recompute drops the score term; full recompute keeps only each layer's input.

Tensor parallelism over ``t`` ranks (figures are per rank): GEMMs, attention heads and
the vocabulary are split ``t`` ways; each layer adds two collectives of its ``bsh``
activations in the forward and two in the backward (all-reduces, or with sequence
parallelism an all-gather and a reduce-scatter each, the same ring volume), priced on
the TP link and not overlapped with compute, as megatron-core runs them. Stored
activations follow Korthikanti: ``bs(10h + (8a_d + 4f)/t) + 5nbs^2/t`` without sequence
parallelism (the norms, dropout masks and residuals are replicated), everything ``/t``
with it.

Packed rows run with per-sample attention (``attention=``, an
:class:`~dynapipe.cost.attention_density.AttentionDensity`) scale each attention core's
FLOPs and stored scores by the share of the row's pairs inside its samples; the linear
layers still span every token of the row.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from dynapipe.config import DeviceConfig, ModelConfig, TensorParallelConfig
from dynapipe.cost.activation_bytes import (FP32_BYTES, cross_token_bytes, layer_token_bytes, norm_stat_bytes,
                                            score_bytes)
from dynapipe.cost.backward_split import cross_attention_flops, layer_flops
from dynapipe.cost.attention_density import DENSE, AttentionDensity
from dynapipe.cost.base import MIB, CostModel, StageCost, StageLayout

# megatron-core's vocabulary-parallel cross entropy keeps each token's target (int64) and mask (bool).
LOSS_TARGET_BYTES = 9


class AnalyticCostModel(CostModel):
    """Cost model computed from a model config and a device config alone."""

    prices_attention_density = True

    def __init__(self, model: ModelConfig, device: DeviceConfig, num_stages: int,
                 tp: Optional[TensorParallelConfig] = None):
        super().__init__(model, num_stages, tp)
        self.device = device

    @property
    def _sp_div(self) -> int:
        """Divisor of the activations TP alone replicates: ``t`` with sequence parallelism."""
        return self.tp.size if self.tp.sequence_parallel else 1

    def _collective_ms(self, b, s):
        """One TP collective of ``b x s x h`` activations, ms: an all-reduce, or with sequence
        parallelism an all-gather or a reduce-scatter (half the ring traffic each)."""
        nbytes = b * s * self.model.hidden_size * self.model.dtype_bytes
        return self.tp.gather_ms(nbytes) if self.tp.sequence_parallel else self.tp.allreduce_ms(nbytes)

    def _layer_comm_ms(self, b, s):
        """One layer's TP collectives, (forward, backward) ms. Without SP an all-reduce after the
        attention and MLP blocks forward, and of their input gradients backward. With SP an
        all-gather before each column-parallel linear (QKV, FC1) and a reduce-scatter after each
        row-parallel one (projection, FC2) forward; backward the transposes (a reduce-scatter of
        each column-parallel input gradient, an all-gather of each row-parallel output
        gradient) plus the column-parallel inputs gathered again for the weight gradients,
        since only their sequence shard was kept: 4 forward, 6 backward."""
        one = self._collective_ms(b, s)
        return (4 * one, 6 * one) if self.tp.sequence_parallel else (2 * one, 2 * one)

    def _embedding_comm_ms(self, b, s):
        """The vocabulary-parallel embedding's TP collectives, (forward, backward) ms: its
        partial lookups all-reduced forward. With SP megatron-core reduce-scatters them instead
        unless learned positions are added after the lookup (then it all-reduces and keeps its
        sequence shard), and the backward all-gathers the gradient of that shard."""
        nbytes = b * s * self.model.hidden_size * self.model.dtype_bytes
        if not self.tp.sequence_parallel:
            return self.tp.allreduce_ms(nbytes), 0.0 * nbytes
        learned = self.model.position_embedding_type == "learned_absolute"
        fw = self.tp.allreduce_ms(nbytes) if learned else self.tp.gather_ms(nbytes)
        return fw, self.tp.gather_ms(nbytes)

    def _loss_comm_ms(self, b, s):
        """The vocabulary-parallel cross entropy's three all-reduces of one fp32 value a token
        (the logits' maximum, the target logit, the sum of exponentials), forward, ms."""
        return 3 * self.tp.allreduce_ms(b * s * FP32_BYTES)

    def _cross_comm_ms(self, b, s_dec, s_enc):
        """A T5 decoder layer's cross-attention TP collectives, (forward, backward) ms. Its
        query projection is column-parallel on the decoder tokens, its key-value projection
        column-parallel on the encoder output (``s_enc`` tokens, whatever the targets' length),
        its output projection row-parallel. Without SP: the output's all-reduce forward, the
        two inputs' gradients all-reduced backward. With SP: both inputs all-gathered and the
        output reduce-scattered forward; backward the transposes plus both inputs gathered
        again for the weight gradients."""
        dec, enc = self._collective_ms(b, s_dec), self._collective_ms(b, s_enc)
        if self.tp.sequence_parallel:
            return 2 * dec + enc, 3 * dec + 2 * enc
        return dec, dec + enc

    # -- FLOPs of the forward of one layer ------------------------------------------------
    def _self_attn_mlp_flops(self, b, s):
        return layer_flops(self.model, b, s)

    def _cross_attn_flops(self, b, s_dec, s_enc):
        return cross_attention_flops(self.model, b, s_dec, s_enc)

    # -- activation bytes of one layer (dynapipe.cost.activation_bytes) ------------------------
    @property
    def _mask_bytes(self) -> int:
        return self.device.dropout_mask_bytes_for(self.model.dtype_bytes)

    def _layer_act_bytes(self, b, s):
        """(linear, scores) bytes one self-attention + MLP layer keeps per TP rank."""
        m, t, mask = self.model, self.tp.size, self._mask_bytes
        linear = b * s * layer_token_bytes(m, t, self._sp_div, mask)
        scores = score_bytes(m, mask) * m.num_attention_heads * b * s * s / t
        return linear, scores

    def _cross_act_bytes(self, b, s_dec, s_enc):
        """(linear, scores) bytes one cross-attention block keeps per TP rank."""
        m, t, mask = self.model, self.tp.size, self._mask_bytes
        dec, enc = cross_token_bytes(m, t, self._sp_div, mask)
        linear = b * (s_dec * dec + s_enc * enc)
        scores = score_bytes(m, mask) * m.num_attention_heads * b * s_dec * s_enc / t
        return linear, scores

    def output_stored_mib(self, layout: StageLayout, mbs, seqlen, dec_seqlen) -> np.ndarray:
        if not layout.has_output:
            return super().output_stored_mib(layout, mbs, seqlen, dec_seqlen)
        m = self.model
        s_dec = dec_seqlen if m.is_encoder_decoder else seqlen
        b = np.asarray(mbs, dtype=np.float64)
        return b * s_dec * self._output_row_bytes() / MIB

    def _output_row_bytes(self) -> float:
        """Stored bytes a token of the final norm, output layer and loss: the norm's input,
        statistics and output (sequence-sharded with SP), the fp32 logits of this rank's
        vocabulary shard, and the loss's int64 target and bool mask."""
        m = self.model
        norm = 2 * m.hidden_size * m.dtype_bytes + norm_stat_bytes(m)
        return norm / self._sp_div + m.vocab_size * FP32_BYTES / self.tp.size + LOSS_TARGET_BYTES

    def _embedding_row_bytes(self) -> float:
        """Stored bytes a token of the embedding: its dropout mask (sequence-sharded with SP).
        The token and position ids its lookups keep are the stage's loaded inputs, which plans
        hold as buffers."""
        m = self.model
        return m.hidden_size * self._mask_bytes / self._sp_div if m.hidden_dropout > 0 else 0.0

    def layout_cost(self, layout: StageLayout, mbs, seqlen, dec_seqlen, recompute: str,
                    attention: Optional[AttentionDensity] = None) -> StageCost:
        m, d = self.model, self.model.dtype_bytes
        b = mbs
        # Per-sample attention over packed rows computes (and stores scores for) only the
        # pairs inside samples: each core's FLOPs and scores scale by its density.
        dens = attention or DENSE
        # Decoder-only models run their layers on `seqlen`; T5 decoders run on `dec_seqlen`.
        s_enc = seqlen
        s_dec = dec_seqlen if m.is_encoder_decoder else seqlen

        t, sp = self.tp.size, self._sp_div
        # FLOPs are weighted by 1 / efficiency of the GEMMs they run in: encoder-side
        # GEMMs span the encoder tokens, decoder-side ones only the decoder tokens, which
        # for short targets are thin however long the input is.
        eff_e = self.device.efficiency(b * s_enc)
        eff_d = self.device.efficiency(b * s_dec)
        fw_lin = fw_core = 0.0
        st_lin = st_scores = 0.0
        layer_inputs = 0.0
        one_layer_full = 0.0
        comm_fw = comm_bw = 0.0  # TP collectives of the layers, ms
        if layout.encoder_layers:
            lin, core = self._self_attn_mlp_flops(b, s_enc)
            lin, core = lin / eff_e, core * dens.input / eff_e
            a_lin, a_sc = self._layer_act_bytes(b, s_enc)
            a_sc = a_sc * dens.input
            n = layout.encoder_layers
            fw_lin, fw_core = fw_lin + n * lin, fw_core + n * core
            st_lin, st_scores = st_lin + n * a_lin, st_scores + n * a_sc
            layer_inputs = layer_inputs + n * b * s_enc * m.hidden_size * d / sp
            one_layer_full = np.maximum(one_layer_full, a_lin + a_sc)
            l_fw, l_bw = self._layer_comm_ms(b, s_enc)
            comm_fw, comm_bw = n * l_fw, n * l_bw
        if layout.decoder_layers:
            self_density = dens.target if m.is_encoder_decoder else dens.input
            lin, core = self._self_attn_mlp_flops(b, s_dec)
            lin, core = lin / eff_d, core * self_density / eff_d
            a_lin, a_sc = self._layer_act_bytes(b, s_dec)
            a_sc = a_sc * self_density
            if m.is_encoder_decoder:
                c_lin, c_core = self._cross_attn_flops(b, s_dec, s_enc)
                # The key and value projections of the encoder output span the encoder tokens.
                kv = 4 * b * s_enc * m.hidden_size * m.attention_dim
                c_lin, c_core = (c_lin - kv) / eff_d + kv / eff_e, c_core * dens.cross / eff_d
                x_lin, x_sc = self._cross_act_bytes(b, s_dec, s_enc)
                x_sc = x_sc * dens.cross
                lin, core, a_lin, a_sc = lin + c_lin, core + c_core, a_lin + x_lin, a_sc + x_sc
            n = layout.decoder_layers
            fw_lin, fw_core = fw_lin + n * lin, fw_core + n * core
            st_lin, st_scores = st_lin + n * a_lin, st_scores + n * a_sc
            layer_inputs = layer_inputs + n * b * s_dec * m.hidden_size * d / sp
            one_layer_full = np.maximum(one_layer_full, a_lin + a_sc)
            l_fw, l_bw = self._layer_comm_ms(b, s_dec)
            comm_fw, comm_bw = comm_fw + n * l_fw, comm_bw + n * l_bw
            if m.is_encoder_decoder:
                x_fw, x_bw = self._cross_comm_ms(b, s_dec, s_enc)
                comm_fw, comm_bw = comm_fw + n * x_fw, comm_bw + n * x_bw
                # Decoder stages also hold the encoder output they attend to.
                layer_inputs = layer_inputs + b * s_enc * m.hidden_size * d / sp

        out_fw = 0.0
        out_stored = 0.0
        out_peak = 0.0
        # The output layer's input gradient is reduced in the backward; with SP its input is
        # all-gathered in the forward and again in the backward for the weight gradient.
        fw_comm, bw_comm = comm_fw, comm_bw
        if layout.has_embedding:
            e_fw, e_bw = self._embedding_comm_ms(b, s_enc)
            fw_comm, bw_comm = fw_comm + e_fw, bw_comm + e_bw
            out_stored = out_stored + b * s_enc * self._embedding_row_bytes()
        if layout.embeds_decoder:  # T5: the decoder's tokens are embedded where its first layer is
            e_fw, e_bw = self._embedding_comm_ms(b, s_dec)
            fw_comm, bw_comm = fw_comm + e_fw, bw_comm + e_bw
            out_stored = out_stored + b * s_dec * self._embedding_row_bytes()
        if layout.ends_encoder:
            # The encoder block's final norm keeps its input and statistics (layers' recomputation
            # does not cover it).
            out_stored = out_stored + b * s_enc * (m.hidden_size * d + norm_stat_bytes(m)) / sp
        if layout.has_output:
            out_fw = 2 * b * s_dec * m.hidden_size * m.vocab_size / eff_d
            # The loss keeps fp32 logits/softmax for its backward; the op needs a second copy.
            out_stored = out_stored + b * s_dec * self._output_row_bytes()
            out_peak = b * s_dec * m.vocab_size * FP32_BYTES / t
            bw_comm = bw_comm + self._collective_ms(b, s_dec)
            fw_comm = fw_comm + self._loss_comm_ms(b, s_dec)
            if self.tp.sequence_parallel:
                fw_comm = fw_comm + self._collective_ms(b, s_dec)
                bw_comm = bw_comm + self._collective_ms(b, s_dec)

        fw_flops = (fw_lin + fw_core + out_fw) / t
        fw_lin, fw_core = fw_lin / t, fw_core / t
        bw_flops = 2 * fw_flops
        if recompute == "selective":
            bw_flops = bw_flops + fw_core
            stored = st_lin + out_stored
            layer_peak = one_layer_full
        elif recompute == "full":
            bw_flops = bw_flops + fw_lin + fw_core
            bw_comm = bw_comm + comm_fw  # the recomputed forward repeats the layers' collectives
            stored = layer_inputs + out_stored
            # Backward rematerialises one layer at a time, plus its gradients.
            layer_peak = 2 * one_layer_full
        else:
            stored = st_lin + st_scores + out_stored
            layer_peak = one_layer_full
        peak = np.maximum(layer_peak, out_peak)

        rate = self.device.effective_flops_per_ms
        overhead = self.device.op_overhead_ms
        shape = np.broadcast(b, s_enc, s_dec).shape
        return StageCost(
            fw_ms=np.broadcast_to(fw_flops / rate + fw_comm + overhead, shape),
            bw_ms=np.broadcast_to(bw_flops / rate + bw_comm + overhead, shape),
            stored_mib=np.broadcast_to(stored / MIB, shape),
            peak_mib=np.broadcast_to(peak / MIB, shape),
        )
