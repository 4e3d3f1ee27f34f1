"""Executor handlers of a T5 stage, and the attention masks they build.

The handlers build each stage's attention masks from the plan's ``enc_mask`` / ``dec_mask``
(per-token sample numbers, 0 on padding): encoder self-attention and cross-attention see
only their own sample's input tokens, decoder self-attention is causal within its sample;
embedding stages restart positions at every sample. So a sample's loss does not depend on
how it was padded or packed. The packing baseline with per-sample attention passes segment
tables instead (:mod:`megatron_integration.segment_attention`) and notes in the executor
trace the attention density they computed.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from dynapipe.plan.instructions import ForwardPass, MicroBatchInfo
from megatron_integration.model import Stage
from megatron_integration.segment_attention import t5_segment_tables, table_calls, table_density
from megatron_integration.stage_handlers import ModelStageHandlers
from megatron_integration.t5_chunks import T5Chunks
from megatron_integration.t5_model import set_t5_recompute_level


def segment_mask(q_seg: torch.Tensor, k_seg: torch.Tensor, causal: bool = False,
                 self_attention: bool = True) -> torch.Tensor:
    """Attention mask ``[mbs, 1, sq, sk]`` bool (True = masked, megatron-core's convention)
    from per-token sample numbers ``[mbs, sq]`` / ``[mbs, sk]`` (0 on padding): a query sees
    the keys of its own sample (the earlier ones when ``causal``). In self-attention a
    padding query sees itself, so no row is empty; a padding decoder query in
    cross-attention sees nothing (megatron fills masked scores with -10000, a uniform row;
    its loss is masked)."""
    q, k = q_seg.unsqueeze(2), k_seg.unsqueeze(1)
    keep = (q == k) & (q > 0)
    sq, sk = q_seg.shape[1], k_seg.shape[1]
    if causal:
        keep &= torch.ones((sq, sk), dtype=torch.bool, device=q_seg.device).tril_()
    if self_attention:
        keep |= torch.eye(sq, dtype=torch.bool, device=q_seg.device)
    return (~keep).unsqueeze(1)


def needed_mask(q_seg: torch.Tensor, k_seg: torch.Tensor, self_attention: bool = True,
                host: Optional[tuple] = None) -> Optional[torch.Tensor]:
    """The bidirectional :func:`segment_mask` of ``q_seg`` / ``k_seg``, or None when it would
    mask nothing: every row of both is one whole sample (no padding), the same one.

    Why: megatron-core's unfused softmax applies any mask given with a ``masked_fill`` over
    every score, forward and backward (about a quarter of an encoder layer's time at 1,024
    tokens on a CPU), and building a ``[mbs, 1, sq, sk]`` mask costs milliseconds more;
    without it the scores are the same. Decided from the ``[mbs, s]`` sample numbers, so an
    unneeded mask is never built. For attention whose layer spec takes an arbitrary mask
    (encoder self-attention, cross-attention): a causal layer given None builds its own.
    ``host``: host copies of ``(q_seg, k_seg)`` (tensors or arrays) to decide from, so a CUDA
    forward does not wait for the device to answer."""
    q, k = (torch.as_tensor(host[0]), torch.as_tensor(host[1])) if host is not None else (q_seg, k_seg)
    first = q[:, :1]
    if bool((first > 0).all()) and bool((q == first).all()) and bool((k == first).all()):
        return None
    return segment_mask(q_seg, k_seg, self_attention=self_attention)


def single_sample_rows(q_ids, k_ids=None) -> bool:
    """Whether every row of the per-token sample numbers ``q_ids`` (``[mbs, s]``, tensor or
    array, read on the host) is one sample followed only by padding (0s), and with ``k_ids``
    whether each row of ``k_ids`` is the same sample, followed only by padding: DynaPipe's and
    padding's rows, not packed ones."""
    q = np.asarray(torch.as_tensor(q_ids).cpu())
    if q.ndim != 2 or q.shape[1] == 0:
        return False
    first = q[:, :1]
    real = q > 0
    # Its own sample or padding, and the padding a tail: the real tokens are a prefix of the row.
    if not (first > 0).all() or not ((q == first) | ~real).all() or \
            not (real == np.minimum.accumulate(real, axis=1)).all():
        return False
    if k_ids is None:
        return True
    k = np.asarray(torch.as_tensor(k_ids).cpu())
    return k.shape[0] == q.shape[0] and single_sample_rows(k) and bool((k[:, :1] == first).all())


def key_padding_mask(k_seg: torch.Tensor) -> Optional[torch.Tensor]:
    """``[mbs, 1, 1, sk]`` bool, True on padding keys, or None where no key is padding: what
    rows of one sample each need instead of :func:`segment_mask` (see :func:`compact_masks`)."""
    pad = k_seg == 0
    return pad[:, None, None, :] if bool(pad.any()) else None


def compact_masks(has_encoder: bool, enc_seg: torch.Tensor, dec_seg: Optional[torch.Tensor]) -> dict:
    """The masks of a micro-batch whose rows each hold one sample (:func:`single_sample_rows`)
    where its stage's masks go, in a form that broadcasts instead of ``[mbs, 1, sq, sk]``:
    with ``has_encoder`` encoder self-attention, and with ``dec_seg`` (a stage with a decoder)
    cross-attention, mask only the input's padding keys (``[mbs, 1, 1, sk]``, or None without
    padding); decoder self-attention is causal (``[1, 1, sd, sd]``).

    Why: a full mask is built on every forward, and at long rows that costs as much as a
    quarter of the layer it masks (one 3,584-token row: 24 ms for the bool mask and 23 ms for
    its additive bias on this project's CPU, against about 150 ms for the encoder layer's
    forward), none of which the profile prices. Every real token's scores, outputs and
    gradients are the full mask's: a real query sees exactly its sample's keys either way
    (the padding is after them, and causal order keeps a decoder query from its padding).
    Only padding queries differ: they see the real keys instead of themselves or nothing, and
    their outputs reach no real token (masked as keys, loss-masked as targets), so no loss or
    gradient changes. For megatron-core's unfused softmax on a CPU only; its fused CUDA
    kernels take ``[mbs, 1, sq, sk]`` masks."""
    pad = key_padding_mask(enc_seg)
    out = {"enc_attn_mask": pad} if has_encoder else {}
    if dec_seg is not None:
        sd = dec_seg.shape[1]
        causal = torch.ones((sd, sd), dtype=torch.bool, device=dec_seg.device).triu_(1)
        out.update(dec_attn_mask=causal[None, None], cross_attn_mask=pad)
    return out


def segment_positions(seg: torch.Tensor) -> torch.Tensor:
    """Position ids ``[mbs, s]`` int64 restarting at every sample of a row (runs of equal
    sample numbers; padding counts on from its own start)."""
    b, s = seg.shape
    idx = torch.arange(s, device=seg.device).expand(b, s)
    starts = torch.ones_like(seg, dtype=torch.bool)
    starts[:, 1:] = seg[:, 1:] != seg[:, :-1]
    first = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values
    return (idx - first).to(torch.int64)


class T5StageHandlers(ModelStageHandlers):
    """Executor handlers that run one :class:`~megatron_integration.t5_model.T5Stage`."""

    no_loss_tokens = "the global batch has no target tokens; the loss cannot be normalised."

    def __init__(self, stage: Stage, device: torch.device, split_backward: bool = False,
                 per_sample_attention: bool = False):
        super().__init__(stage, device, split_backward)
        # (micro-batch, chunk) -> whether its forward applied an encoder or cross-attention mask.
        self.masked: dict[tuple[int, int], bool] = {}
        # The packing baseline with each sample's attention computed alone: its stages read
        # segment tables where the masks go (megatron_integration.segment_attention).
        self.per_sample_attention = per_sample_attention
        # (micro-batch, chunk) -> the attention density its segment tables computed (per sample).
        self.density: dict[tuple[int, int], dict] = {}

    def begin(self, micro_batch_tensors: dict, global_loss_tokens: int, plan=None) -> None:
        super().begin(micro_batch_tensors, global_loss_tokens, plan)
        self.masked, self.density = {}, {}

    def trace_note(self, op) -> Optional[dict]:
        """What an executor trace adds to a forward or backward: its ``recompute`` level and
        ``masked``, whether its encoder or cross-attention applied a mask (a row of one whole
        sample needs none, :func:`needed_mask`), so that ops of one shape are compared on the
        same work; with per-sample attention also ``attention``, the share of the dense pairs
        its segment tables computed (input, target, cross) and their calls a core, at which the bench
        prices it."""
        note = dict(super().trace_note(op) or {})
        masked = self.masked.get((op.mb, op.chunk))
        if masked is not None:
            note["masked"] = masked
        density = self.density.get((op.mb, op.chunk))
        if density:
            note["attention"] = density
        return note or None

    def _part(self, chunk: int):
        """The :class:`T5Stage` running chunk ``chunk`` (the rank's only stage without chunks)."""
        t5 = self.stage.gpt
        return t5.chunk(chunk) if isinstance(t5, T5Chunks) else t5

    def _level(self, op) -> None:
        if op is not None:
            set_t5_recompute_level(self._part(op.chunk), self.stage.config, op.recompute)

    def forward(self, mb: MicroBatchInfo, inputs: dict[str, torch.Tensor], op: ForwardPass):
        st, t5 = self.stage, self._part(op.chunk)
        place = t5.place
        self._level(op)
        enc_seg, dec_seg = inputs["enc_mask"], inputs.get("dec_mask")
        kwargs = dict(hidden_states=inputs.get("hidden_states"), encoder_output=inputs.get("encoder_output"),
                      labels=inputs.get("labels"))
        if place.embeds_encoder:
            kwargs.update(enc_tokens=inputs["tokens"], enc_positions=segment_positions(enc_seg))
        if place.embeds_decoder:
            kwargs.update(dec_tokens=inputs["dec_tokens"], dec_positions=segment_positions(dec_seg))
        host = self.tensors.get(mb.mb) or {}  # the loaded tensors' host copies
        enc_host, dec_host = host.get("enc_mask"), host.get("dec_mask")
        if self.per_sample_attention:
            tables = t5_segment_tables(t5.encoder is not None, t5.decoder is not None,
                                       enc_seg if enc_host is None else enc_host,
                                       dec_seg if dec_host is None else dec_host)
            kwargs.update(tables)
            rows, s_enc = enc_seg.shape[0], enc_seg.shape[1]
            s_dec = dec_seg.shape[1] if dec_seg is not None else 0
            self.density[(op.mb, op.chunk)] = {
                **{key: table_density(tables[name], rows, *shape)
                   for key, name, shape in (("input", "enc_attn_mask", (s_enc, s_enc)),
                                            ("target", "dec_attn_mask", (s_dec, s_dec)),
                                            ("cross", "cross_attn_mask", (s_dec, s_enc))) if name in tables},
                # One call a sample on each attention core (the encoder's, else the decoder's count).
                "calls": max(table_calls(t) for t in tables.values())}
        elif self.device.type == "cpu" and single_sample_rows(
                enc_seg if enc_host is None else enc_host,
                # An encoder-only chunk masks no target: its rows qualify on the inputs alone.
                None if dec_seg is None or t5.decoder is None else (dec_seg if dec_host is None else dec_host)):
            kwargs.update(compact_masks(t5.encoder is not None, enc_seg, dec_seg if t5.decoder is not None else None))
        else:
            if t5.encoder is not None:
                kwargs["enc_attn_mask"] = needed_mask(enc_seg, enc_seg, host=None if enc_host is None else
                                                      (enc_host, enc_host))
            if t5.decoder is not None:
                kwargs["dec_attn_mask"] = segment_mask(dec_seg, dec_seg, causal=True)
                kwargs["cross_attn_mask"] = needed_mask(dec_seg, enc_seg, self_attention=False, host=None if (
                    enc_host is None or dec_host is None) else (dec_host, enc_host))
        self.masked[(op.mb, op.chunk)] = any(kwargs.get(k) is not None for k in ("enc_attn_mask", "cross_attn_mask"))
        if isinstance(st.gpt, T5Chunks):
            kwargs["chunk"] = op.chunk
        out = st.module(**kwargs)
        if not place.is_last:
            return out
        return self._sum_loss(out, inputs["loss_mask"])
