"""Profile-based cost model: measured per-layer costs over a grid, interpolated.

Profile format (JSON, ``"format": "dynapipe-profile"``, ``"version": 2``)::

    {
      "format": "dynapipe-profile", "version": 2, "kind": "decoder-only",
      "device": "cpu", "dtype": "fp32",
      "model": {"hidden_size": 64, "num_attention_heads": 4,   # what was measured: these
                "ffn_hidden_size": 256, ...},                  # three required, the rest compared
      "mbs": [1, 2, 4, 8],                 # grid rows, ascending
      "seqlen": [64, 128, 256, 512, 1024], # grid columns, ascending
      "stage_overhead_ms": 0.0,            # optional: paid once per stage op
      "attention_call_ms": {"fw": 0.1, "bw": 0.1},  # optional: one per-sample attention call
      "tp": 1, "sequence_parallel": false, # optional: the tensor-parallel group measured
      "ops": {
        "layer":     {"fw_ms": [[...]], "bw_ms": [[...]], "stored_mib": [[...]], "peak_mib": [[...]]},
        "embedding": {... same keys ...},
        "output":    {... same keys ...},
        "layer_selective": {...}, "layer_full": {...}   # optional: the layer at those levels
      }
    }

The layer's tables may also hold ``bw_weight_ms``: the part of ``bw_ms`` that is the
linear layers' weight gradients, timed with the backward split as zero-bubble schedules
run it (``python -m dynapipe profile`` writes it). Where present, it replaces the FLOPs
estimate of :mod:`dynapipe.cost.backward_split` in pricing ``BI``/``BW`` ops
(:meth:`ProfileCostModel.weight_ms`). Encoder-decoder profiles hold it in their
``encoder_layer`` and ``decoder_layer`` tables (:mod:`dynapipe.cost.profile_t5`).

Each table is ``len(mbs) x len(seqlen)``; ``layer`` is one transformer layer, with no
recomputation; ``layer_selective``/``layer_full`` (optional) the same layer measured at
that recompute level (backward including the recomputation, stored memory what the level
keeps, counted as the training ranks count it). Inside the grid values are bilinear in (mbs, seqlen).
Outside it: ``mbs`` below the grid scales proportionally from the first row; above it, memory
scales proportionally from the last row (activations are linear in the number of samples) and
times grow from the last row by the last two rows' step per sample, never less at a length than
at a shorter one (a micro-batch's fixed cost, the kernel launches that dominate small shapes on
GPUs, is paid once, not once per grid-top of samples); ``seqlen`` above the grid follows the
power law through the last two columns (which captures the quadratic attention term), and
below the grid takes the first column (per-op overheads dominate short sequences). A
recompute level the profile has no table for is derived:
``full`` adds a forward to the backward and stores only each layer's input; ``selective``
adds the attention-core share of the forward (from the analytic FLOP split), drops
the attention-score share of the stored memory and adds to the layer's peak what the
recomputed core saves again (:func:`~dynapipe.cost.profile_t5.selective_rebuild_mib`).
Packed rows run with per-sample attention (``attention=``, an
:class:`~dynapipe.cost.attention_density.AttentionDensity`) take the measured dense layer
with its attention-core share of the time and its score share of the stored bytes scaled
by the density (the same analytic shares; the peak stays as measured, high not low).

A profile measured with ``tp`` > 1 holds one TP rank's figures: times include the TP
collectives (all-reduces, or all-gathers and reduce-scatters with ``sequence_parallel``),
memory is per rank. It prices only a run of the same ``tp`` and ``sequence_parallel``
(profiles without these keys were measured at TP 1 without sequence parallelism).

A bf16/fp16 profile prices only runs whose attention softmax runs in the precision it was
measured in (``model.attention_softmax_in_fp32``: Megatron's ``--attention-softmax-in-fp32``,
forced on by ``--apply-query-key-layer-scaling``); one that does not record it prices only runs
at Megatron's default, off. fp32 runs and fused attention are not compared. Every number of a
profile (grid points, ``stage_overhead_ms``, ``tp``, table entries) is at most 2**53.

Version 2 adds ``kind``: ``decoder-only`` (the tables above) or ``encoder-decoder`` (T5:
encoder-layer, decoder-layer, embedding and output tables over a third axis of decoder
lengths, see :mod:`dynapipe.cost.profile_t5`). Version 1 profiles (no ``kind``) are
decoder-only and still load.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

import numpy as np

from dynapipe.config import ModelConfig, TensorParallelConfig
from dynapipe.cost.attention_density import AttentionDensity, thin
from dynapipe.cost.activation_bytes import CUDA_MASK_BYTES, layer_token_bytes, score_bytes
from dynapipe.cost.base import MIB, CostModel, StageCost, StageLayout
from dynapipe.cost.profile_t5 import (KIND_DECODER_ONLY, KIND_ENCODER_DECODER, WEIGHT_FIELD, check_weight_table,
                                      load_t5_tables, profile_kind, selective_rebuild_mib, t5_layout_cost,
                                      t5_weight_ms)
from dynapipe.cost.profile_tables import OpTables, ProfileTable
from dynapipe.cost.profile_checks import (FIELDS, LAYER_OPS, LEVEL_OPS, OPS, check_layer_shape, check_profile,
                                          check_profile_tensor_parallel, read_profile)
from dynapipe.errors import DynaPipeError


def _weight_table(profile: Mapping[str, Any], op: str, source: str) -> np.ndarray:
    """``ops.<op>.bw_weight_ms``, checked against the op's ``bw_ms`` (the rule T5 tables share)."""
    check_weight_table(profile["ops"][op], op, source)
    return np.asarray(profile["ops"][op][WEIGHT_FIELD], dtype=np.float64)


class ProfileCostModel(CostModel):
    """Cost model that interpolates measured per-layer costs (see the module docstring).

    ``tp``: the run's tensor parallelism (default none); the profile must have been measured
    at the same size and sequence-parallel setting."""

    prices_attention_density = True

    def __init__(self, model: ModelConfig, profile: Mapping[str, Any], num_stages: int,
                 source: str = "profile", tp: TensorParallelConfig | None = None):
        check_profile(profile, source)
        kind = profile_kind(profile)
        want = KIND_ENCODER_DECODER if model.is_encoder_decoder else KIND_DECODER_ONLY
        if kind != want:
            raise DynaPipeError(f"{source}: the profile is {kind} and cannot price {want} model {model.name!r}; measure one "
                                f"with `python -m dynapipe profile`{' --t5' if model.is_encoder_decoder else ''} "
                                f"for this model.")
        tp = tp or TensorParallelConfig()
        # First: a profile of another TP layout would also show other (padded) widths.
        check_profile_tensor_parallel(profile, tp.size, tp.sequence_parallel, source)
        check_layer_shape(profile, model, source)
        super().__init__(model, num_stages, tp)
        self.stage_overhead_ms = float(profile.get("stage_overhead_ms", 0.0))
        calls = profile.get("attention_call_ms") or {}
        self.attention_call_ms = (float(calls.get("fw", 0.0)), float(calls.get("bw", 0.0)))
        self.profile = profile
        if profile.get("layer_spec") == "transformer_engine":
            self.unsplit_backward = (f"{source} was measured on Transformer Engine layers, whose backward does "
                                     f"not split")
        # Bytes a dropout mask of the measured layers kept per element, for the derived levels'
        # shares: a CPU's dropout keeps masks of the activation's dtype, CUDA's bool ones.
        self.mask_bytes = model.dtype_bytes if profile.get("device") == "cpu" else CUDA_MASK_BYTES
        if model.is_encoder_decoder:
            self.tables = load_t5_tables(profile)
            return
        mbs = np.asarray(profile["mbs"], dtype=np.float64)
        seqlen = np.asarray(profile["seqlen"], dtype=np.float64)
        present = OPS + tuple(k for k in LEVEL_OPS.values() if k in profile["ops"])
        # An op's fields share its grid: evaluated in one pass (see ProfileTable).
        timed = np.array([f.endswith("_ms") for f in FIELDS])
        self.tables = {op: OpTables(FIELDS, ProfileTable(mbs, seqlen, np.stack([np.asarray(profile["ops"][op][f],
                                                                                     dtype=np.float64)
                                                                          for f in FIELDS]), timed=timed))
                       for op in present}
        self.weight_tables = {op: ProfileTable(mbs, seqlen, _weight_table(profile, op, source), timed=True)
                              for op in present if op in LAYER_OPS and WEIGHT_FIELD in profile["ops"][op]}

    def beyond_grid(self, mbs: int, seqlen: int, dec_seqlen: int = 0) -> list[tuple[str, str, int]]:
        """The axes on which a micro-batch of ``mbs`` samples padded to ``seqlen`` (and
        ``dec_seqlen``) tokens lies beyond the largest measured point, each as ``("what N
        (measured up to M)", "--profile-flag", N)``, the flag the ``profile`` command measures
        that axis with: this model prices it by extrapolation there (times by the
        last measured step in ``mbs``, a power law in the lengths), not from measurements."""
        out = []
        for axis, what, flag, value in (("mbs", "micro-batch size", "--mbs", mbs),
                                        ("seqlen", "sequence length", "--seqlens", seqlen),
                                        ("dec_seqlen", "decoder sequence length", "--dec-seqlens", dec_seqlen)):
            grid = self.profile.get(axis)
            if value and isinstance(grid, list) and grid and value > max(grid):
                out.append((f"{what} {value} (measured up to {max(grid)})", flag, int(value)))
        return out

    @classmethod
    def from_file(cls, model: ModelConfig, path: str, num_stages: int,
                  tp: TensorParallelConfig | None = None) -> "ProfileCostModel":
        """Read a profile JSON file written by ``python -m dynapipe profile``."""
        return cls(model, read_profile(path), num_stages, source=path, tp=tp)

    def weight_ms(self, layout: StageLayout, mbs, seqlen, dec_seqlen, recompute: str):
        """The layers' measured ``bw_weight_ms`` at ``recompute`` (embedding, output layer and
        recomputation stay in the input part), ms; None where the profile did not time it.
        Encoder-decoder: :func:`~dynapipe.cost.profile_t5.t5_weight_ms` (the no-recompute
        tables at every level)."""
        if self.model.is_encoder_decoder:
            return t5_weight_ms(self.tables, layout, mbs, seqlen, dec_seqlen)
        if not layout.decoder_layers:
            return None
        op = LEVEL_OPS.get(recompute) if LEVEL_OPS.get(recompute) in self.tables else "layer"
        if op not in self.weight_tables:
            return None
        return layout.decoder_layers * self.weight_tables[op](mbs, seqlen)

    def _op(self, op: str, b, s) -> dict:
        return self.tables[op](b, s)

    def output_stored_mib(self, layout: StageLayout, mbs, seqlen, dec_seqlen) -> np.ndarray:
        if not layout.has_output:
            return super().output_stored_mib(layout, mbs, seqlen, dec_seqlen)
        return self.tables["output"]["stored_mib"](mbs, dec_seqlen if self.model.is_encoder_decoder else seqlen)

    def _shares(self, seqlen) -> tuple:
        """Analytic shares of a layer's forward FLOPs in its attention core and of its stored
        activations in attention scores, per TP rank as the analytic model splits them: the
        norms' and residuals' share over the sequence shards, the rest (scores included) over
        the tensor-parallel ranks."""
        m = self.model
        h, ad, kd, f, f1 = m.hidden_size, m.attention_dim, m.kv_dim, m.ffn_hidden_size, m.fc1_width
        s = np.asarray(seqlen, dtype=np.float64)
        linear = 2 * h * (ad + 2 * kd) + 2 * ad * h + 2 * h * (f1 + f)
        core_share = 4 * s * ad / (linear + 4 * s * ad)
        t, shard = self.tp.size, self.tp.size if self.tp.sequence_parallel else 1
        scores = score_bytes(m, self.mask_bytes) * m.num_attention_heads * s / t
        return core_share, scores / (layer_token_bytes(m, t, shard, self.mask_bytes) + scores)

    def layout_cost(self, layout: StageLayout, mbs, seqlen, dec_seqlen, recompute: str,
                    attention: Optional[AttentionDensity] = None) -> StageCost:
        m = self.model
        if m.is_encoder_decoder:
            return t5_layout_cost(m, self.tables, layout, mbs, seqlen, dec_seqlen, recompute, self.stage_overhead_ms,
                                  mask_bytes=self.mask_bytes, tp=self.tp.size,
                                  sequence_parallel=self.tp.sequence_parallel, attention=attention)
        n = layout.decoder_layers
        layer = self._op("layer", mbs, seqlen)
        dense_core, score_share = self._shares(seqlen)
        core_share = dense_core
        # The attention cores' part of a backward that recomputes them (selective): their
        # backward (the core share of the no-recompute backward) and their forward again.
        dense_core_ms = dense_core * (layer["fw_ms"] + layer["bw_ms"])
        if attention is not None:
            # Per-sample attention over packed rows: the measured dense layer, its attention
            # core's share of the time and its scores' share of the stored bytes thinned to
            # the pairs inside samples (the peak kept as measured: high, not low).
            layer["fw_ms"], core_share = thin(layer["fw_ms"], dense_core, attention.input)
            layer["bw_ms"], _ = thin(layer["bw_ms"], dense_core, attention.input)
            layer["stored_mib"], score_share = thin(layer["stored_mib"], score_share, attention.input)
        fw, bw = n * layer["fw_ms"], n * layer["bw_ms"]
        stored = n * layer["stored_mib"]
        peak = layer["peak_mib"]
        measured = LEVEL_OPS.get(recompute)
        s = np.asarray(seqlen, dtype=np.float64)
        if measured in self.tables:
            at = self._op(measured, mbs, seqlen)
            if attention is not None:  # these levels store no scores: only the time thins
                at["fw_ms"], _ = thin(at["fw_ms"], dense_core, attention.input)
                if recompute == "selective":
                    at["bw_ms"] = at["bw_ms"] - (1 - np.asarray(attention.input)) * dense_core_ms
                else:  # full: the whole forward again, the core's share of it as of the backward
                    at["bw_ms"], _ = thin(at["bw_ms"], dense_core, attention.input)
            fw, bw, stored, peak = n * at["fw_ms"], n * at["bw_ms"], n * at["stored_mib"], at["peak_mib"]
        elif recompute == "selective":
            t = self.tp.size
            bw = bw + fw * core_share
            stored = stored * (1 - score_share)
            # The backward saves one layer's scores again, which the no-recompute peak never
            # held beside the stored activations, and its attention mask: the causal one an
            # unpacked micro-batch's core builds itself (bool and bias), or the bias of
            # packed rows' mask (one a row).
            b = np.asarray(mbs, dtype=np.float64)
            mask = s * s * np.maximum(1 + m.dtype_bytes, b * m.dtype_bytes)
            peak = peak + selective_rebuild_mib(m, layer["stored_mib"], score_share, b, s, t, mask)
        elif recompute == "full":
            bw = bw + fw
            # Each layer's input; sequence-sharded over the TP ranks with sequence parallelism.
            shard = self.tp.size if self.tp.sequence_parallel else 1
            stored = n * np.asarray(mbs, dtype=np.float64) * s * m.hidden_size * m.dtype_bytes / shard / MIB
            peak = 2 * peak + layer["stored_mib"]
        for op, present in (("embedding", layout.has_embedding), ("output", layout.has_output)):
            if present:
                c = self._op(op, mbs, seqlen)
                fw, bw = fw + c["fw_ms"], bw + c["bw_ms"]
                stored = stored + c["stored_mib"]
                peak = np.maximum(peak, c["peak_mib"])
        o = self.stage_overhead_ms
        return StageCost(fw_ms=fw + o, bw_ms=bw + o, stored_mib=stored, peak_mib=peak)
