"""What a cost model answers, and the stage layout shared by every cost model.

A cost model prices one pipeline stage running one micro-batch of ``mbs`` samples padded
to ``seqlen`` tokens (and ``dec_seqlen`` decoder tokens for encoder-decoder models).
All inputs broadcast as numpy arrays, so the planner prices a whole table of candidate
micro-batches in one call. Units: ms for time, MiB for memory.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Optional

import numpy as np

from dynapipe.config import ModelConfig, TensorParallelConfig
from dynapipe.errors import DynaPipeError, given, whole_number

RECOMPUTE_LEVELS = ("none", "selective", "full")
MIB = float(1 << 20)


@dataclass(frozen=True)
class StageLayout:
    """What one pipeline stage holds: layer counts and the embedding / output layer.

    Encoder-decoder models have two more roles: ``embeds_decoder`` on the stage holding the
    first decoder layer (it embeds the decoder's tokens, with its own copy of the embedding
    unless it also ``has_embedding``), ``ends_encoder`` on the stage holding the last
    encoder layer (the encoder block's final norm)."""

    stage: int
    encoder_layers: int
    decoder_layers: int
    has_embedding: bool
    has_output: bool
    embeds_decoder: bool = False
    ends_encoder: bool = False

    @property
    def key(self) -> tuple:
        """Everything that prices the stage except its index: equal keys cost the same."""
        return (self.encoder_layers, self.decoder_layers, self.has_embedding, self.has_output,
                self.embeds_decoder, self.ends_encoder)


def layout_of_layers(stage: int, num_stages: int, first: int, end: int, encoder_total: int) -> StageLayout:
    """Stage ``stage`` of ``num_stages`` holding the model's layers ``first .. end - 1``
    (encoder layers first: ``encoder_total`` of them, 0 for a decoder-only model)."""
    enc = max(0, min(end, encoder_total) - first)
    encdec = encoder_total > 0
    return StageLayout(stage, enc, (end - first) - enc, stage == 0, stage == num_stages - 1,
                       embeds_decoder=encdec and first <= encoder_total < end,
                       ends_encoder=encdec and first < encoder_total <= end)


def stage_layouts(model: ModelConfig, num_stages: int) -> list[StageLayout]:
    """Split the model's layers over ``num_stages`` consecutive stages, as Megatron does.

    Layers are taken in order (for T5: encoder layers, then decoder layers) and split as
    evenly as possible, earlier stages taking the remainder. Stage 0 holds the embedding,
    the last stage the output layer (a tied copy when ``num_stages > 1``).
    """
    if num_stages < 1:
        raise DynaPipeError(f"{given('num_stages', num_stages)}: the number of pipeline stages must be at least 1.")
    total = model.total_layers
    if num_stages > total:
        raise DynaPipeError(
            f"{given('num_stages', num_stages)} exceeds the {total} layers of model {model.name!r}: "
            f"every stage needs at least one layer; use at most {total} stages."
        )
    enc_total = model.encoder_layers if model.is_encoder_decoder else 0
    base, extra = divmod(total, num_stages)
    layouts, start = [], 0
    for s in range(num_stages):
        end = start + base + (1 if s < extra else 0)
        layouts.append(layout_of_layers(s, num_stages, start, end, enc_total))
        start = end
    return layouts


def stage_param_count(model: ModelConfig, layout: StageLayout, tp: int = 1) -> int:
    """Parameters held by one stage on one of its ``tp`` tensor-parallel ranks: layers with
    biases and norms, embedding, output layer. The GEMM weights, the column-parallel biases
    and the vocabulary are split over TP; norms and row-parallel biases are replicated.
    Grouped-query attention narrows the key and value projections, a gated MLP doubles FC1,
    ``add_bias_linear=False`` drops the biases (``add_qkv_bias`` keeps the QKV one), RMSNorm has
    no norm bias, and ``qk_layernorm`` adds a query and a key norm over the head width."""
    h, ad, f = model.hidden_size, model.attention_dim, model.ffn_hidden_size
    qkv, fc1 = ad + 2 * model.kv_dim, model.fc1_width
    bias = 1 if model.add_bias_linear else 0
    qkv_bias = 1 if (model.add_bias_linear or model.add_qkv_bias) else 0
    per_width = 1 if model.normalization == "RMSNorm" else 2  # weight (and bias) per normalised channel
    norm = per_width * h
    qk_norms = 2 * per_width * model.head_dim if model.qk_layernorm else 0
    layer = ((h * qkv + ad * h + h * fc1 + f * h + qkv_bias * qkv + bias * fc1) / tp + bias * 2 * h + 2 * norm
             + qk_norms)
    # Cross-attention: query, key/value and output projections (their biases as the layer's,
    # megatron-core's linear_q and linear_kv take add_bias_linear) and its own norm.
    cross = (4 * h * ad + bias * 3 * ad) / tp + bias * h + norm
    dec_layer = layer + (cross if model.is_encoder_decoder else 0)
    count = layout.encoder_layers * layer + layout.decoder_layers * dec_layer
    # A T5 stage embedding the decoder's tokens holds a copy of the embedding unless it is stage 0.
    embeds = layout.has_embedding or layout.embeds_decoder
    if embeds:
        count += model.vocab_size * h / tp
        if model.position_embedding_type == "learned_absolute":  # replicated over TP
            count += (model.max_position_embeddings or model.max_seq_length) * h
    if layout.ends_encoder:
        count += norm  # the encoder block's final layer norm
    if layout.has_output:
        count += norm  # final layer norm
        # Tied embeddings: the last stage keeps its own copy unless it also embeds.
        if not (embeds and model.tie_embeddings):
            count += model.vocab_size * h / tp
        if model.is_encoder_decoder and model.tie_embeddings:
            count += model.vocab_size / tp  # T5's LM head adds a bias to the tied output layer
    return int(count)


@dataclass(frozen=True)
class StageCost:
    """Cost of one micro-batch on one stage. Fields are floats or numpy arrays.

    ``fw_ms``/``bw_ms``: forward and backward time in ms (backward includes recomputation).
    ``stored_mib``: activation memory held from the forward until the backward, MiB.
    ``peak_mib``: transient memory on top of the stored activations while an op runs, MiB.
    """

    fw_ms: np.ndarray
    bw_ms: np.ndarray
    stored_mib: np.ndarray
    peak_mib: np.ndarray

    @property
    def time_ms(self) -> np.ndarray:
        """Forward plus backward time in ms: the ``t`` of the planner's objective."""
        return self.fw_ms + self.bw_ms

    @property
    def memory_mib(self) -> np.ndarray:
        """Stored plus transient activation memory in MiB: what must fit while the op runs."""
        return self.stored_mib + self.peak_mib

    @staticmethod
    def maximum(costs: list["StageCost"]) -> "StageCost":
        """Elementwise maximum of each field over several stages (the most loaded stage)."""
        return StageCost(*(np.maximum.reduce([np.asarray(getattr(c, f)) for c in costs])
                           for f in ("fw_ms", "bw_ms", "stored_mib", "peak_mib")))


def check_recompute(recompute: str) -> str:
    """``recompute`` itself if it is one of :data:`RECOMPUTE_LEVELS`; else a DynaPipeError naming them."""
    if recompute not in RECOMPUTE_LEVELS:
        raise DynaPipeError(f"recompute={recompute!r} is not a recompute level; use one of {RECOMPUTE_LEVELS}.")
    return recompute


def weight_share_of(weight_ms, bw_ms) -> np.ndarray:
    """``weight_ms / bw_ms`` in [0, 1] (0 where the backward takes no time)."""
    bw = np.asarray(bw_ms, dtype=np.float64)
    shape = np.broadcast(np.asarray(weight_ms), bw).shape
    share = np.divide(np.broadcast_to(weight_ms, shape), np.broadcast_to(bw, shape), out=np.zeros(shape),
                      where=np.broadcast_to(bw, shape) > 0)
    return np.clip(share, 0.0, 1.0)


def require_cost_model(value) -> "CostModel":
    """``value`` when it is a :class:`CostModel`, else a :class:`DynaPipeError` saying how to
    build one (a name or None reached the planner as an AttributeError from inside)."""
    if not isinstance(value, CostModel):
        raise DynaPipeError(f"cost_model {value!r:.60}: give a CostModel (dynapipe.cost.build_cost_model(model, "
                            f"device, stages)).")
    return value


class CostModel(ABC):
    """Prices micro-batches on the stages of one pipeline.

    Subclasses implement :meth:`layout_cost` (one stage layout); this class adds stage selection, the bottleneck stage and
    model-state memory.
    """

    #: Whether :meth:`layout_cost` takes ``attention`` (an AttentionDensity: per-sample attention).
    prices_attention_density = False
    #: The fixed cost of one per-sample attention call, (forward, backward) ms: what running
    #: attention once a sample adds per call beyond its pairs (0: one varlen launch, not priced).
    attention_call_ms: tuple[float, float] = (0.0, 0.0)
    #: Why the layers this model prices cannot split their backward (None: they can), so the
    #: schedule search leaves the zero-bubble schedules out and refuses them by name.
    unsplit_backward: Optional[str] = None

    def __init__(self, model: ModelConfig, num_stages: int, tp: Optional[TensorParallelConfig] = None):
        self.model = model
        self.num_stages = num_stages
        # Every figure is per rank of a stage's tensor-parallel group.
        self.tp = tp or TensorParallelConfig()
        self._set_layouts(stage_layouts(model, num_stages))

    def _set_layouts(self, layouts: list[StageLayout]) -> None:
        self.layouts = layouts
        # Stages with the same layout cost the same; price each distinct layout once.
        self._distinct = sorted({self._key(l) for l in self.layouts})

    @property
    def placement(self):
        """The :class:`~dynapipe.cost.placement.StagePlacement` this cost model prices."""
        from dynapipe.cost.placement import StagePlacement

        chunked = getattr(self, "_chunked", None)  # a chunked placement is not recoverable from rank layouts
        if chunked is not None:
            return chunked
        return StagePlacement(tuple(l.encoder_layers for l in self.layouts),
                              tuple(l.decoder_layers for l in self.layouts))

    def with_placement(self, placement) -> "CostModel":
        """A copy of this cost model for the stages of ``placement`` (a
        :class:`~dynapipe.cost.placement.StagePlacement` with ``num_stages`` stages)."""
        import copy

        from dynapipe.cost.stage_placement import StagePlacement

        if not isinstance(placement, StagePlacement):
            raise DynaPipeError(f"placement {placement!r:.60}: give a StagePlacement (StagePlacement.parse(spec, model, "
                                f"stages) reads the --placement syntax; even, the default, is None).")
        placement.validate(self.model)
        if placement.num_stages != self.num_stages:
            raise DynaPipeError(f"stage placement {placement} has {placement.num_stages} stages; the cost model "
                                f"{self.num_stages}.")
        out = copy.copy(self)
        out._set_layouts(placement.layouts())
        out._chunked = placement if placement.chunks > 1 else None
        return out

    @staticmethod
    def _key(layout: StageLayout) -> tuple:
        return layout.key

    @abstractmethod
    def layout_cost(self, layout: StageLayout, mbs, seqlen, dec_seqlen, recompute: str) -> StageCost:
        """Cost of one micro-batch on a stage with this layout (arrays broadcast). Models that
        set :attr:`prices_attention_density` also take ``attention=`` (see :meth:`stage_cost`)."""

    def priced_layout_cost(self, layout: StageLayout, mbs, seqlen, dec_seqlen, recompute: str,
                           attention=None) -> StageCost:
        """:meth:`layout_cost`, plus the fixed cost of per-sample attention's calls
        (:attr:`attention_call_ms` for each of ``attention.calls`` beyond the first, which the
        measured dense layer holds, on every attention core of the stage: one a GPT or T5
        encoder layer, two a T5 decoder layer); a recomputing backward runs the calls' forward
        again."""
        if attention is None:
            return self.layout_cost(layout, mbs, seqlen, dec_seqlen, recompute)
        cost = self.layout_cost(layout, mbs, seqlen, dec_seqlen, recompute, attention=attention)
        fw_call, bw_call = self.attention_call_ms
        if not (fw_call or bw_call):
            return cost
        cores = layout.encoder_layers + layout.decoder_layers * (2 if self.model.is_encoder_decoder else 1)
        calls = np.maximum(np.asarray(attention.calls, dtype=np.float64) - 1.0, 0.0) * cores
        again = fw_call if recompute in ("selective", "full") else 0.0
        return StageCost(fw_ms=cost.fw_ms + calls * fw_call, bw_ms=cost.bw_ms + calls * (bw_call + again),
                         stored_mib=cost.stored_mib, peak_mib=cost.peak_mib)

    def weight_ms(self, layout: StageLayout, mbs, seqlen, dec_seqlen, recompute: str) -> Optional[np.ndarray]:
        """The measured ms of the weight part of a split backward (zero-bubble schedules) on a
        stage with ``layout``, or None where nothing was measured: then
        :func:`dynapipe.cost.backward_split.backward_split`'s FLOPs estimate applies."""
        return None

    def weight_share(self, layout: StageLayout, mbs, seqlen, dec_seqlen, recompute: str) -> Optional[np.ndarray]:
        """:meth:`weight_ms` as a share of the stage's backward ms (None: not measured)."""
        weight = self.weight_ms(layout, mbs, seqlen, dec_seqlen, recompute)
        if weight is None:
            return None
        return weight_share_of(weight, self.layout_cost(layout, mbs, seqlen, dec_seqlen, recompute).bw_ms)

    def layout_param_count(self, layout: StageLayout) -> int:
        """Number of parameters held by one TP rank of a stage with this layout."""
        return stage_param_count(self.model, layout, self.tp.size)

    def stage_cost(self, mbs, seqlen, dec_seqlen=None, *, recompute: str = "none",
                   stage: Optional[int] = None, attention=None) -> StageCost:
        """Cost of a micro-batch of ``mbs`` samples padded to ``seqlen`` tokens.

        ``stage=None`` gives the bottleneck: the elementwise maximum over all stages,
        which is what the planner uses for ``t`` and for the memory check.
        ``dec_seqlen`` is required for encoder-decoder models (decoder tokens).
        ``attention``: an :class:`~dynapipe.cost.attention_density.AttentionDensity` for
        packed rows run with per-sample attention (None: dense attention over every row).
        """
        check_recompute(recompute)
        if attention is not None and not self.prices_attention_density:
            raise DynaPipeError(f"{type(self).__name__} prices dense attention only; per-sample attention "
                                f"(packing-per-sample) needs the analytic or a profile cost model.")
        if self.model.is_encoder_decoder and dec_seqlen is None:
            raise DynaPipeError(f"model {self.model.name!r} is encoder-decoder: give the decoder length too.")
        mbs = np.asarray(mbs, dtype=np.float64)
        seqlen = np.asarray(seqlen, dtype=np.float64)
        dec = None if dec_seqlen is None else np.asarray(dec_seqlen, dtype=np.float64)
        if stage is not None:
            if not 0 <= stage < self.num_stages:
                raise DynaPipeError(f"stage={stage} is outside the pipeline's 0..{self.num_stages - 1}.")
            return self.priced_layout_cost(self.layouts[stage], mbs, seqlen, dec, recompute, attention)
        by_key = {self._key(l): l for l in self.layouts}
        costs = [self.priced_layout_cost(by_key[k], mbs, seqlen, dec, recompute, attention) for k in self._distinct]
        return costs[0] if len(costs) == 1 else StageCost.maximum(costs)

    def output_stored_mib(self, layout: StageLayout, mbs, seqlen, dec_seqlen) -> np.ndarray:
        """Stored activations of the output layer and loss on ``layout``, MiB (0 without one);
        the backward frees them before it reaches the transformer layers."""
        return np.zeros(np.broadcast(np.asarray(mbs), np.asarray(seqlen)).shape)

    def recompute_held_mib(self, mbs, seqlen, dec_seqlen=None, *, recompute: str, stage: int,
                           weight_stash_mib=0.0, attention=None) -> np.ndarray:
        """How far the backward of one micro-batch on ``stage`` rises above its stored
        activations through recomputation, MiB (0 for ``none``).

        megatron-core rematerialises one layer (``full``) or one layer's core attention
        (``selective``) at a time, saving again that layer's share of what the level does
        not store; the highest point is the first layer the backward reaches, after the
        output layer's activations were freed. ``weight_stash_mib``: what a split backward's
        input part keeps for its weight part (MiB, the stage's layers together): not freed
        when the core attention is rematerialised. ``attention``: the micro-batch's
        :class:`~dynapipe.cost.attention_density.AttentionDensity` (None: dense rows).
        """
        if check_recompute(recompute) == "none":
            return np.zeros(np.broadcast(np.asarray(mbs), np.asarray(seqlen)).shape)
        layout = self.layouts[stage]
        layers = max(layout.encoder_layers + layout.decoder_layers, 1)
        kept = self.stage_cost(mbs, seqlen, dec_seqlen, recompute="none", stage=stage, attention=attention).stored_mib
        stored = self.stage_cost(mbs, seqlen, dec_seqlen, recompute=recompute, stage=stage,
                                 attention=attention).stored_mib
        one_layer = np.maximum(np.asarray(kept) - np.asarray(stored), 0.0) / layers
        freed = self.output_stored_mib(layout, mbs, seqlen, dec_seqlen)
        if recompute == "selective":
            # Before the core attention is rematerialised the backward has also freed the
            # layer's MLP side: all it stores but its input, norm output and Q, K, V.
            m, t = self.model, self.tp.size
            # Q, K, V are split over TP ranks; the input and norm output only with SP.
            replicated = 2 * m.hidden_size / (t if self.tp.sequence_parallel else 1)
            attn_inputs = (np.asarray(mbs, dtype=np.float64) * np.asarray(seqlen, dtype=np.float64)
                           * (replicated + (m.attention_dim + 2 * m.kv_dim) / t) * m.dtype_bytes / MIB)
            # A split backward's input part keeps the layer's linear inputs for its weight part
            # (measured: its peak rose by the score matrix that this credit had cancelled).
            stash = np.asarray(weight_stash_mib, dtype=np.float64) / layers
            freed = freed + np.maximum(np.asarray(stored) / layers - attn_inputs - stash, 0.0)
        return np.maximum(one_layer - freed, 0.0)

    def model_state_mib(self, stage: Optional[int] = None, *, dp: int = 1, zero: bool = False) -> float:
        """Parameters, gradients and optimizer state of one TP rank of a stage in MiB
        (``None``: the largest).

        Megatron's mixed precision: bf16 keeps 2-byte parameters, fp32 main gradients, and
        fp32 master weights plus two Adam moments (2 + 4 + 12 = 18 bytes a parameter); fp16
        keeps its gradients in fp16 and the optimizer an fp32 copy of them beside the master
        weights and moments (2 + 2 + 16 = 20); fp32 keeps 4 + 4 + 8 = 16. ``zero=True`` shards
        the optimizer part over ``dp`` replicas (Megatron's distributed optimizer: bf16
        6 + 12/dp, fp16 4 + 16/dp, as Megatron-LM's own table of them).
        """
        layouts = self.layouts if stage is None else [self.layouts[stage]]
        return max(self.layout_state_mib(l, dp=dp, zero=zero) for l in layouts)

    def layout_state_mib(self, layout: StageLayout, *, dp: int = 1, zero: bool = False) -> float:
        """Model states of one TP rank of a stage with ``layout``, MiB (see :meth:`model_state_mib`)."""
        dp = whole_number("dp", dp)  # the data-parallel replicas the optimizer state is sharded over
        param_b, grad_b, optim_b = {"bf16": (2, 4, 12), "fp16": (2, 2, 16)}.get(self.model.dtype, (4, 4, 8))
        per_param = param_b + grad_b + optim_b / (dp if zero else 1)
        return self.layout_param_count(layout) * per_param / MIB

    def activation_budget_mib(self, memory_limit_mib: float, *, reserved_mib: float = 0.0,
                              dp: int = 1, zero: bool = False) -> float:
        """MiB left for activations on the most loaded stage under ``memory_limit_mib``."""
        return memory_limit_mib - reserved_mib - self.model_state_mib(dp=dp, zero=zero)
