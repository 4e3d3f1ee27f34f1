"""A plain torch GPT split into pipeline stages, its executor handlers, and a reference.

Small attention + MLP blocks on Megatron's ``[seq, mbs, hidden]`` layout, sized by a
:class:`~dynapipe.config.ModelConfig` (``gpt-tiny``: hidden 64, 4 layers). Attention is
causal and padding sits at the end of each row, so a real token never sees a pad token:
the loss of a sample does not depend on how it was padded or batched, which is what
lets a pipelined run be compared with one unpipelined pass over the same samples.

Samples are 1-D int64 tensors of ``L + 1`` token ids: the first ``L`` are the input, the
last ``L`` the labels, so a sample has ``L`` real (loss-bearing) tokens.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from dynapipe.config import ModelConfig
from dynapipe.cost.base import stage_layouts
from dynapipe.plan.instructions import ForwardPass, MicroBatchInfo, TensorSpec


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP on ``[seq, mbs, hidden]``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h = cfg.hidden_size
        self.heads = cfg.num_attention_heads
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc1, self.fc2 = nn.Linear(h, cfg.ffn_hidden_size), nn.Linear(cfg.ffn_hidden_size, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, b, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(s, b, 3, self.heads, h // self.heads).permute(2, 1, 3, 0, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [b, heads, s, d]
        x = x + self.proj(a.permute(2, 0, 1, 3).reshape(s, b, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class ToyGPT(nn.Module):
    """The whole model; :meth:`stage` gives the part a pipeline stage runs."""

    def __init__(self, cfg: ModelConfig, seed: int = 0, max_positions: int = 512):
        super().__init__()
        torch.manual_seed(seed)
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.pos = nn.Embedding(max_positions, cfg.hidden_size)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.LayerNorm(cfg.hidden_size)
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size)

    def stage(self, stage: int, num_stages: int) -> "ToyStage":
        """Stage ``stage`` of ``num_stages``, layers split as the planner's cost model splits them."""
        layouts = stage_layouts(self.cfg, num_stages)
        start = sum(l.encoder_layers + l.decoder_layers for l in layouts[:stage])
        count = layouts[stage].encoder_layers + layouts[stage].decoder_layers
        return ToyStage(self, list(range(start, start + count)), stage == 0, stage == num_stages - 1)


class ToyStage(nn.Module):
    """Layers ``layer_ids`` of a :class:`ToyGPT`, with the embedding on the first stage and
    the output layer and loss on the last (parameters shared with the whole model)."""

    def __init__(self, model: ToyGPT, layer_ids: list[int], first: bool, last: bool):
        super().__init__()
        self.model, self.layer_ids, self.first, self.last = model, layer_ids, first, last

    def own_parameters(self) -> dict[str, nn.Parameter]:
        """Parameters this stage trains, by their name in the whole model."""
        prefixes = [f"blocks.{i}." for i in self.layer_ids]
        if self.first:
            prefixes += ["embed.", "pos."]
        if self.last:
            prefixes += ["norm.", "head."]
        return {n: p for n, p in self.model.named_parameters() if any(n.startswith(x) for x in prefixes)}

    def forward(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """Hidden states ``[seq, mbs, hidden]``, or on the last stage the summed token loss."""
        m = self.model
        if self.first:
            x = (m.embed(inputs["tokens"]) + m.pos(inputs["position_ids"])).transpose(0, 1)
        else:
            x = inputs["hidden_states"]
        for i in self.layer_ids:
            x = m.blocks[i](x)
        if not self.last:
            return x
        logits = m.head(m.norm(x)).float()  # [seq, mbs, vocab]
        nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), inputs["labels"].t().reshape(-1),
                              reduction="none")
        return (nll * inputs["loss_mask"].t().reshape(-1)).sum()


def micro_batch_tensors(samples: Sequence[torch.Tensor], ids: Sequence[int], seqlen: int) -> dict[str, torch.Tensor]:
    """``tokens``, ``position_ids``, ``labels`` (int64) and ``loss_mask`` (float32), all
    ``[len(ids), seqlen]``, for samples ``ids`` right-padded to ``seqlen``."""
    n = len(ids)
    tokens = torch.zeros(n, seqlen, dtype=torch.int64)
    labels = torch.zeros(n, seqlen, dtype=torch.int64)
    mask = torch.zeros(n, seqlen, dtype=torch.float32)
    for row, i in enumerate(ids):
        s = samples[i]
        L = s.numel() - 1
        if L > seqlen:
            raise ValueError(f"sample {i} has {L} tokens, more than the micro-batch's seqlen {seqlen}")
        tokens[row, :L], labels[row, :L], mask[row, :L] = s[:-1], s[1:], 1.0
    pos = torch.arange(seqlen, dtype=torch.int64).expand(n, seqlen).contiguous()
    return {"tokens": tokens, "position_ids": pos, "labels": labels, "loss_mask": mask}


class ToyHandlers:
    """Executor handlers for one :class:`ToyStage` over a global batch of ``samples``."""

    def __init__(self, stage: ToyStage, samples: Sequence[torch.Tensor] = ()):
        self.stage = stage
        self.samples = list(samples)
        self.calls: list[tuple[str, int]] = []

    def load(self, mb: MicroBatchInfo, specs: tuple[TensorSpec, ...]) -> dict[str, torch.Tensor]:
        self.calls.append(("load", mb.mb))
        data = micro_batch_tensors(self.samples, mb.samples, mb.seqlen)
        return {s.name: data[s.name] for s in specs}

    def forward(self, mb: MicroBatchInfo, inputs: dict[str, torch.Tensor], op: ForwardPass) -> torch.Tensor:
        self.calls.append(("fw", mb.mb))
        return self.stage(inputs)


def make_samples(lengths: Sequence[int], vocab: int, seed: int) -> list[torch.Tensor]:
    """One sample of ``L + 1`` random token ids per length ``L``."""
    rng = np.random.default_rng(seed)
    return [torch.from_numpy(rng.integers(0, vocab, size=int(L) + 1)).to(torch.int64) for L in lengths]


def reference_step(model: ToyGPT, samples: Sequence[torch.Tensor],
                   chunk: Optional[int] = None) -> tuple[float, dict[str, torch.Tensor]]:
    """One unpipelined pass over every sample: the mean token loss over all real tokens and
    the gradient of every parameter (``.grad`` is left set). ``chunk`` samples per forward
    (all at once by default), each padded to its own longest."""
    model.zero_grad(set_to_none=True)
    total_tokens = sum(s.numel() - 1 for s in samples)
    stage = model.stage(0, 1)
    ids = list(range(len(samples)))
    chunk = chunk or len(ids)
    loss = 0.0
    for k in range(0, len(ids), chunk):
        part = ids[k:k + chunk]
        seqlen = max(samples[i].numel() - 1 for i in part)
        out = stage(micro_batch_tensors(samples, part, seqlen)) / total_tokens
        out.backward()
        loss += float(out.detach())
    return loss, {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def plan_batch(lengths: Sequence[int], cfg: ModelConfig, *, pp: int, dp: int, schedule: str,
               iteration: int = 0, split_backward: bool = False) -> list[list]:
    """Execution plans ``[replica][stage]`` for one global batch of ``lengths`` from the
    project's planner (micro-batches by dynamic programming on the CPU cost model,
    balanced over ``dp`` replicas, ``schedule`` searched and compiled), validated. The toy
    stages cannot split their backward, so ``auto`` leaves ``zb-h1`` out (``split_backward``: plans
    the handlers must refuse)."""
    from dynapipe.config import load_device_config
    from dynapipe.cost import build_cost_model
    from dynapipe.pipeline_planner import plan_iteration

    cost = build_cost_model(cfg, load_device_config("cpu"), pp)
    planned = plan_iteration(np.asarray(lengths), cost, stages=pp, dp=dp, schedule=schedule,
                             iteration=iteration, validate=True, split_backward=split_backward)
    assert all(p.global_loss_tokens == int(sum(lengths)) for p in planned.all_plans())
    return planned.plans
