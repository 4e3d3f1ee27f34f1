"""Measure megatron-core's GPT building blocks and write a DynaPipe cost profile.

For every (mbs, seqlen) of a grid, three ops are measured on the current device:

* ``layer``: one transformer layer as a pipeline stage runs it (a one-layer
  ``GPTModel`` stage without embedding or output layer, RoPE included when used);
  ``layer_selective`` and ``layer_full``: the same layer at those recompute levels, set
  exactly as the training handlers set them
  (:func:`megatron_integration.model.set_recompute_level`), so the backward time includes
  the recomputation and the stored memory is what that level keeps;
* ``embedding``: the word (+ position) embedding;
* ``output``: final norm, output layer and the cross-entropy loss.

Times: the fastest wall ms of the forward and of the backward over ``repeats`` runs
after warm-up (CUDA synchronised around each); the minimum, because interference from
other processes only ever adds time. Each timed pass starts from a cold cache, as a
pipeline stage's op does (:mod:`megatron_integration.cache_flush` says why and by how much).
The layer's backward runs split, as zero-bubble plans run it (an input part, then the linear
layers' deferred weight gradients), and ``bw_weight_ms`` is the weight part of the fastest
backward. Memory, MiB:

* ``stored_mib``: the distinct storages autograd saves for the backward, parameters
  excluded, counted by the :class:`~dynapipe.runtime.activation_meter.ActivationMeter`
  that measures the training ranks;
* ``peak_mib``: the highest live activation memory during the forward or the backward,
  minus ``stored_mib``. On CUDA from the allocator's peak statistics; on CPU from a
  dispatch-level tracker that counts every storage an op creates until it is freed.

With tensor parallelism (``tp`` > 1, every rank of megatron's TP group calls
:func:`profile_model`), the ops are megatron-core's tensor-parallel layers and every figure is
one TP rank's: the times include the TP collectives (all-reduces, or all-gathers and
reduce-scatters with sequence parallelism, whose inputs are then ``seqlen / tp`` tokens
long), the memory is what one rank holds. The ranks start every timed run together (a
barrier on the TP group) and the profile keeps the slowest rank's time.

The output is the format :mod:`dynapipe.cost.profile` documents and
``ProfileCostModel`` reads.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from dynapipe.cost.profile_checks import FIELDS, LAYER_OPS, LEVEL_OPS, OPS, PROFILE_FORMAT, PROFILE_VERSION
from dynapipe.cost.profile_t5 import WEIGHT_FIELD
from dynapipe.runtime.activation_meter import ActivationMeter
from dynapipe.runtime.weight_grad_store import WeightGradStore
from megatron_integration.attention_calls import measure_attention_call_ms
from megatron_integration.cache_flush import CacheFlush
from megatron_integration.live_memory import LiveMemoryTracker
from megatron_integration.out_of_memory import point_fits
from megatron_integration.split_backward import install_split_backward
from megatron_integration.train_config import GPTModelArgs, ParallelArgs
from megatron_integration.masked_softmax import use_additive_masks

MIB = float(1 << 20)


@dataclass
class OpMeasurement:
    """One op at one shape: ms and MiB (see module docstring)."""

    fw_ms: float
    bw_ms: float
    stored_mib: float
    peak_mib: float
    bw_weight_ms: Optional[float] = None  # the weight part of bw_ms, where the backward was split


def _sync(device: torch.device, group=None) -> None:
    """Wait for the device, then (``group``: a TP group) for the group's other ranks, so a
    timed run starts when every rank's does."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if group is not None:
        import torch.distributed as dist

        dist.barrier(group=group)


def _saved_storage_bytes(fn: Callable[[], torch.Tensor], params: Sequence[torch.Tensor]) -> tuple[torch.Tensor, int]:
    """Run ``fn`` and return its output and the bytes autograd holds for its backward,
    counted as the training ranks count them."""
    out, saved, _ = _saved_and_inputs(fn, params)
    return out, saved


def _saved_and_inputs(fn: Callable[[], torch.Tensor], params: Sequence[torch.Tensor]) -> tuple[torch.Tensor, int, int]:
    """:func:`_saved_storage_bytes`, and of those bytes the ones of tensors that existed
    before ``fn`` ran: its inputs, the tensors its closure holds (the layer's input, the
    encoder output, token ids). A memory peak measured from before the call does not see them."""
    meter = ActivationMeter(exclude=params)
    with meter.saving():
        out = fn()
    inputs = [v for v in map(_cell, getattr(fn, "__closure__", None) or ()) if isinstance(v, torch.Tensor)]
    return out, meter.live_bytes, meter.held_bytes(inputs)


def _cell(cell):
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


def measure_op(forward: Callable[[], torch.Tensor], params: Sequence[torch.Tensor], device: torch.device,
               repeats: int = 3, warmup: int = 1, group=None, weight_grads=None,
               flush: Optional[Callable[[], None]] = None) -> OpMeasurement:
    """Time and memory of ``forward()`` (returns the op's output) and its backward.

    The backward is driven by a random gradient of the output's shape (a scalar
    output, a loss, is backpropagated directly). ``group``: the TP group every rank of
    which runs the same op; each timed forward and backward starts after a barrier on it.
    ``weight_grads``: the :class:`~dynapipe.runtime.weight_grad_store.WeightGradStore` the
    op's linear layers defer into (:mod:`megatron_integration.split_backward`): the backward
    is then timed as zero-bubble plans run it, an input part and then a weight part, and
    ``bw_weight_ms`` is the weight part (``bw_ms`` both). ``flush``: called, untimed, before
    every forward and backward (a :class:`CacheFlush`; None: the runs follow each other warm).
    """
    def grad_like(out):
        return None if out.dim() == 0 else torch.randn_like(out)

    fw, bw, bww = [], [], []
    for i in range(warmup + repeats):
        if flush is not None:
            flush()
        _sync(device, group)
        t0 = time.perf_counter()
        out = forward()
        _sync(device)
        t1 = time.perf_counter()
        g = grad_like(out)
        if flush is not None:
            flush()
        _sync(device, group)
        t2 = time.perf_counter()
        if weight_grads is None:
            out.backward(g)
        else:
            with weight_grads.input_part(0):
                out.backward(g)
        _sync(device)
        t3 = time.perf_counter()
        if weight_grads is not None:
            weight_grads.run(0)
            _sync(device)
        t4 = time.perf_counter()
        for p in params:
            p.grad = None
        if i >= warmup:
            fw.append((t1 - t0) * 1e3)
            bw.append((t4 - t2) * 1e3)
            bww.append((t4 - t3) * 1e3)
        del out, g

    # Memory: one more run, untimed. The parameters' gradients exist before it, as in training
    # (megatron-core's gradient buffers), so the peak counts activations, not the gradients that
    # the model-state budget already holds.
    out, stored, stored_inputs = _saved_and_inputs(forward, params)
    del out
    for p in params:
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        out = forward()
        g = grad_like(out)
        out.backward(g)
        torch.cuda.synchronize(device)
        peak_total = torch.cuda.max_memory_allocated(device) - base
        del out, g
    else:
        with LiveMemoryTracker() as tracker:
            out = forward()
            g = grad_like(out)
            out.backward(g)
            del out, g
        peak_total = tracker.peak
    for p in params:
        p.grad = None
    # Beyond what the op stores: the peak was read from before the forward, when its inputs
    # already existed, so the stored inputs are not in it (subtracting them too left the peak
    # one layer input short).
    peak = max(0.0, peak_total - (stored - stored_inputs))
    # The weight part of the fastest backward (the two parts of one run add up to it).
    fastest = int(min(range(len(bw)), key=bw.__getitem__))
    return OpMeasurement(min(fw), bw[fastest], stored / MIB, peak / MIB,
                         bww[fastest] if weight_grads is not None else None)


def suffix_minimum(table: torch.Tensor) -> torch.Tensor:
    """Each point's time lowered to the least time measured at any point at least as large on
    every axis. An op's time never falls when samples or tokens are added, and other load
    only ever adds time, so a larger shape's time bounds a smaller one's from above: this
    removes interference spikes without lowering any time below one that was measured."""
    out = table.clone()
    for axis in range(out.dim()):
        flipped = out.flip(axis)
        out = torch.cummin(flipped, dim=axis).values.flip(axis)
    return out




def _monotone(tables: dict) -> dict:
    """Every op's times lowered with :func:`suffix_minimum` over the (mbs, seqlen) grid, the
    weight part kept within its backward, as the T5 profiler does. Why: a noisy point (another
    process on the machine) would otherwise price a shape above a larger one, and the power law
    beyond the grid would follow the noise."""
    for v in tables.values():
        for f in ("fw_ms", "bw_ms"):
            v[f] = suffix_minimum(torch.tensor(v[f], dtype=torch.float64)).tolist()
        if WEIGHT_FIELD in v:
            v[WEIGHT_FIELD] = torch.minimum(suffix_minimum(torch.tensor(v[WEIGHT_FIELD], dtype=torch.float64)),
                                            torch.tensor(v["bw_ms"], dtype=torch.float64)).tolist()
    return tables


def as_trained(module: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """``module`` on ``device`` in the precision the training stages run it: under bf16/fp16,
    megatron-core's ``Float16Module`` casts every floating parameter and buffer (norms and
    rotary frequencies too, which megatron-core builds in fp32) to the half type. Profiled in
    mixed precision, the norms would compute in fp32 on CPUs and be refused by CUDA's kernels."""
    if dtype in (torch.bfloat16, torch.float16):
        return module.to(device=device, dtype=dtype)
    return module.to(device)


class _Ops:
    """The three measured ops built from megatron-core modules for one model shape."""

    def __init__(self, model: GPTModelArgs, device: torch.device, use_te: Optional[bool], tp: int = 1,
                 sequence_parallel: bool = False):
        from dataclasses import replace

        from megatron.core.models.gpt.gpt_model import GPTModel

        from megatron_integration.model import layer_spec, set_recompute_level, transformer_config
        from megatron_integration.tensor_parallel import sequence_parallel_block_spec

        self._set_level = set_recompute_level
        # The model's own dropout: its masks are part of what the backward keeps.
        one = replace(model, num_layers=1)
        parallel = ParallelArgs(world_size=tp, tensor_model_parallel_size=tp, sequence_parallel=sequence_parallel)
        tconfig = self.tconfig = transformer_config(one, parallel, cuda=device.type == "cuda")
        spec, self.spec_name = layer_spec(use_te, model.normalization, model.qk_layernorm)
        # The norms the training stages build under sequence parallelism.
        spec = sequence_parallel_block_spec(spec, tconfig, 1)
        # A stage's activations between layers are sequence-sharded under sequence parallelism.
        self.shard = tp if sequence_parallel else 1
        common = dict(config=tconfig, transformer_layer_spec=spec, vocab_size=model.vocab_size,
                      max_sequence_length=model.max_position_embeddings,
                      position_embedding_type=model.position_embedding_type)
        self.dtype = tconfig.params_dtype
        # A middle stage holding one layer: input through set_input_tensor, output hidden states.
        self.layer = as_trained(GPTModel(pre_process=False, post_process=False, **common), device, self.dtype)
        # Embedding and output layer (untied, so each op owns its weight).
        self.ends = as_trained(GPTModel(pre_process=True, post_process=True, share_embeddings_and_output_weights=False,
                                        **common), device, self.dtype)
        self.model, self.device = model, device
        use_additive_masks(self.layer, device)  # as the training stages are built
        # The layer's backward is timed in the two parts zero-bubble plans run, where the layers
        # can split it: Transformer Engine's cannot (zero-bubble plans are refused with them), so
        # their profile has no weight part.
        self.weight_grads = WeightGradStore() if self.spec_name == "local" else None
        if self.weight_grads is not None:
            install_split_backward([self.layer], self.weight_grads)

    def layer_fn(self, b: int, s: int, level: str = "none"):
        x = torch.randn(s // self.shard, b, self.model.hidden_size, device=self.device, dtype=self.dtype,
                        requires_grad=True)

        def fw():
            self._set_level(self.layer, self.layer.config, level)
            self.layer.set_input_tensor(x)
            return self.layer(None, None, None)

        return fw, list(self.layer.parameters())

    def embedding_fn(self, b: int, s: int):
        ids = torch.randint(1, self.model.vocab_size, (b, s), device=self.device)
        pos = torch.arange(s, device=self.device).unsqueeze(0).expand(b, s)
        emb = self.ends.embedding
        return (lambda: emb(ids, pos)), list(emb.parameters())

    def output_fn(self, b: int, s: int):
        x = torch.randn(s // self.shard, b, self.model.hidden_size, device=self.device, dtype=self.dtype,
                        requires_grad=True)
        labels = torch.randint(1, self.model.vocab_size, (b, s), device=self.device)
        m = self.ends

        def fw():
            h = m.decoder.final_layernorm(x)
            logits, _ = m.output_layer(h)
            return m.compute_language_model_loss(labels, logits).float().sum()

        params = list(m.decoder.final_layernorm.parameters()) + list(m.output_layer.parameters())
        return fw, params


def slowest_rank(m: OpMeasurement, group, device: torch.device) -> OpMeasurement:
    """Every field's maximum over the TP group (a stage is as fast as its slowest TP rank)."""
    if group is None:
        return m
    import torch.distributed as dist

    split = m.bw_weight_ms is not None
    values = torch.tensor([getattr(m, f) for f in FIELDS] + ([m.bw_weight_ms] if split else []),
                          dtype=torch.float64, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
    v = values.tolist()
    return OpMeasurement(*v[:len(FIELDS)], v[len(FIELDS)] if split else None)


def profile_model(model: GPTModelArgs, mbs_grid: Sequence[int], seqlen_grid: Sequence[int], device: torch.device,
                  repeats: int = 3, warmup: int = 1, use_te: Optional[bool] = None,
                  progress: Optional[Callable[[str], None]] = None, levels: bool = True,
                  sequence_parallel: bool = False) -> dict:
    """Measure every op over the grid; returns the profile as a JSON-ready dict.

    megatron's parallel state must be initialised; its tensor-parallel size is the one
    measured, and every rank of the TP group calls this with the same arguments (each gets
    the same profile: the slowest rank's times, the largest rank's memory).
    ``sequence_parallel``: Megatron's ``--sequence-parallel`` (every sequence length must
    then be a multiple of the TP size). ``levels=False`` skips the layer at the recompute
    levels (the cost model then derives them), which is most of the profiling time.
    """
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    if sequence_parallel and (tp == 1 or any(s % tp for s in seqlen_grid)):
        raise ValueError(f"sequence parallelism needs TP > 1 and sequence lengths divisible by {tp}: {seqlen_grid}")
    group = ps.get_tensor_model_parallel_group() if tp > 1 else None
    ops = _Ops(model, device, use_te, tp, sequence_parallel)
    flush = CacheFlush(device)
    builders = {"layer": ops.layer_fn, "embedding": ops.embedding_fn, "output": ops.output_fn,
                **{op: (lambda b, s, lv=lv: ops.layer_fn(b, s, lv)) for lv, op in LEVEL_OPS.items()}}
    names = OPS + (tuple(LEVEL_OPS.values()) if levels else ())
    tables = {op: {f: [[0.0] * len(seqlen_grid) for _ in mbs_grid] for f in FIELDS} for op in names}
    for i, b in enumerate(mbs_grid):
        for j, s in enumerate(seqlen_grid):
            for op in names:
                with point_fits(f"{op} at mbs={b} seqlen={s}"):
                    fw, params = builders[op](b, s)
                    split = ops.weight_grads if op in LAYER_OPS else None
                    m = measure_op(fw, params, device, repeats=repeats, warmup=warmup, group=group,
                                   weight_grads=split, flush=flush)
                m = slowest_rank(m, group, device)
                for f in FIELDS:
                    tables[op][f][i][j] = round(getattr(m, f), 6)
                if m.bw_weight_ms is not None:
                    tables[op].setdefault(WEIGHT_FIELD, [[0.0] * len(seqlen_grid) for _ in mbs_grid])
                    tables[op][WEIGHT_FIELD][i][j] = round(m.bw_weight_ms, 6)
            if progress:
                layer = tables["layer"]
                levels_line = (f"  stored selective/full {tables['layer_selective']['stored_mib'][i][j]:.2f}/"
                               f"{tables['layer_full']['stored_mib'][i][j]:.2f} MiB" if levels else "")
                progress(f"mbs={b:<4d} seqlen={s:<6d} layer fw {layer['fw_ms'][i][j]:8.2f} ms  "
                         f"bw {layer['bw_ms'][i][j]:8.2f} ms  stored {layer['stored_mib'][i][j]:8.2f} MiB  "
                         f"peak {layer['peak_mib'][i][j]:8.2f} MiB{levels_line}")
    tables = _monotone(tables)
    calls = measure_attention_call_ms(ops.tconfig, device, causal=True, repeats=repeats, warmup=warmup, flush=flush,
                                      group=group)
    return {
        "format": PROFILE_FORMAT,
        "version": PROFILE_VERSION,
        "kind": "decoder-only",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": model.dtype,
        "layer_spec": ops.spec_name,
        "threads": torch.get_num_threads(),
        "model": {"num_layers": model.num_layers, "hidden_size": model.hidden_size,
                  "num_attention_heads": model.num_attention_heads, "ffn_hidden_size": model.ffn_hidden_size,
                  "kv_channels": model.kv_channels, "vocab_size": model.vocab_size,
                  "position_embedding_type": model.position_embedding_type,
                  "hidden_dropout": model.hidden_dropout, "attention_dropout": model.attention_dropout,
                  # Unfused attention's softmax in fp32 (--attention-softmax-in-fp32, forced on by
                  # --apply-query-key-layer-scaling): a half-precision layer then keeps fp32
                  # probabilities and their cast copy, and takes longer.
                  "attention_softmax_in_fp32": model.softmax_in_fp32,
                  # The layer-shape switches ProfileCostModel checks against the model it prices.
                  "gated_linear_unit": model.swiglu, "num_query_groups": model.num_query_groups or 0,
                  "add_bias_linear": model.add_bias_linear, "add_qkv_bias": model.add_qkv_bias,
                  "qk_layernorm": model.qk_layernorm, "normalization": model.normalization},
        "mbs": [int(b) for b in mbs_grid],
        "seqlen": [int(s) for s in seqlen_grid],
        "stage_overhead_ms": 0.0,
        "attention_call_ms": calls,
        "times": "fastest of the repeats, each from a cold cache, lowered to the fastest of any larger shape",
        "tp": int(tp),
        "sequence_parallel": bool(sequence_parallel),
        "ops": tables,
    }
