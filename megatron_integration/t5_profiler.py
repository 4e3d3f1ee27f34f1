"""Measure megatron-core's T5 building blocks and write an encoder-decoder cost profile.

The ops are built as :mod:`megatron_integration.t5_model` builds a T5 stage (megatron-core's
local T5 layer specs in a ``TransformerBlock``, ``LanguageModelEmbedding`` with learned
absolute positions, ``T5LMHead`` and megatron-core's vocab-parallel cross-entropy) and run
with the masks the stage handlers build for rows of one sample each (on a CPU
:func:`megatron_integration.t5_handlers.compact_masks`, on a GPU the ``[mbs, 1, sq, sk]``
:func:`megatron_integration.t5_handlers.segment_mask`):

* ``encoder_layer`` at every (mbs, seqlen): one encoder layer, bidirectional self-attention;
* ``decoder_layer`` at every (mbs, dec_seqlen, seqlen): one decoder layer attending to an
  encoder output of ``seqlen`` tokens; its backward includes that output's gradient;
* ``embedding`` at every (mbs, seqlen); ``output`` (the decoder block's final norm, LM head,
  loss) at every (mbs, dec_seqlen).

Times and memory are measured as for GPT (:func:`megatron_integration.profiler.measure_op`:
stored and peak MiB; the fastest of ``repeats`` timed runs, each from a cold cache), except
that a point's timed runs are spread over ``repeats`` passes over the whole grid, and a time is
lowered to the least time of any larger shape (:func:`suffix_minimum`), which removes
interference spikes.

The encoder and decoder layers' backwards run split, as zero-bubble plans (``zb-h1``) run
them (:mod:`megatron_integration.split_backward`: an input part, then the linear layers'
deferred weight-gradient GEMMs); their ``bw_ms`` is both parts and ``bw_weight_ms`` the
weight part of the backward whose ``bw_ms`` was kept, lowered with :func:`suffix_minimum`
too and never above that point's final ``bw_ms``. ``embedding`` and ``output`` keep whole
backwards. Under tensor parallelism each rank measures on its own (no barrier, no
reduction over the group), and the profile holds rank 0's figures. The result is the
version 2, ``kind: encoder-decoder`` profile :mod:`dynapipe.cost.profile_t5` documents.
"""
from __future__ import annotations

import json
import time
from dataclasses import replace
from typing import Callable, Optional, Sequence

import torch

from dynapipe.cost.profile_checks import PROFILE_FORMAT, PROFILE_VERSION
from dynapipe.cost.profile_t5 import FIELDS, KIND_ENCODER_DECODER, SPLIT_OPS, T5_AXES, T5_OPS, WEIGHT_FIELD
from dynapipe.runtime.weight_grad_store import WeightGradStore
from megatron_integration.attention_calls import measure_attention_call_ms
from megatron_integration.cache_flush import CacheFlush
from megatron_integration.out_of_memory import point_fits
from megatron_integration.profiler import as_trained, measure_op, suffix_minimum
from megatron_integration.split_backward import install_split_backward
from megatron_integration.train_config import GPTModelArgs, ParallelArgs
from megatron_integration.masked_softmax import use_additive_masks


class T5Ops:
    """The four measured ops of one T5 shape, on ``device``. The encoder and decoder blocks'
    linear layers can split their backward into :attr:`weight_grads`."""

    def __init__(self, model: GPTModelArgs, device: torch.device, tp: int = 1, sequence_parallel: bool = False):
        from megatron.core.models.T5.t5_model import T5LMHead
        from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
        from megatron.core.transformer.transformer_block import TransformerBlock

        from megatron_integration.model import transformer_config
        from megatron_integration.t5_model import _block_spec, _layer_specs

        config = transformer_config(replace(model, num_layers=2),
                                    ParallelArgs(world_size=tp, tensor_model_parallel_size=tp,
                                                 sequence_parallel=sequence_parallel),
                                    cuda=device.type == "cuda")
        enc_spec, dec_spec, self.spec_name = _layer_specs()
        self.encoder = TransformerBlock(config=config, spec=_block_spec(enc_spec, 1, sequence_parallel),
                                        pre_process=True, post_process=False)
        # post_process: the block's final norm, which the output op runs as the last stage does.
        self.decoder = TransformerBlock(config=config, spec=_block_spec(dec_spec, 1, sequence_parallel),
                                        pre_process=True, post_process=True)
        self.embedding = LanguageModelEmbedding(config=config, vocab_size=model.vocab_size,
                                                max_sequence_length=model.max_position_embeddings,
                                                position_embedding_type="learned_absolute")
        self.lm_head = T5LMHead(config, parallel_output=True, vocab_size=model.vocab_size, pre_process=False,
                                share_embeddings_and_output_weights=False)
        self.model, self.device, self.dtype, self.config = model, device, config.params_dtype, config
        for part in (self.encoder, self.decoder, self.embedding, self.lm_head):
            as_trained(part, device, self.dtype)  # in place: the precision the stages train in
        for block in (self.encoder, self.decoder):
            use_additive_masks(block, device)  # as the training stages are built
        # The layers' backwards are timed in the two parts zero-bubble plans run (outside an
        # input part the split layers compute both gradients at once, as megatron-core's do).
        self.weight_grads = WeightGradStore()
        install_split_backward([self.encoder, self.decoder], self.weight_grads)
        # Under sequence parallelism a stage's inputs and outputs are this rank's sequence shard.
        self.shards = tp if sequence_parallel else 1

    def _masks(self, b: int, sq: int, sk: int, causal: bool, self_attention: bool) -> torch.Tensor:
        """The mask a stage gives rows of one sample each, with padding: on a CPU the compact
        form (:func:`~megatron_integration.t5_handlers.compact_masks`: padding keys, or causal),
        on a GPU the full ``[mbs, 1, sq, sk]`` one. No padding is masked (every key is real);
        causal layers get their causal mask."""
        from megatron_integration.t5_handlers import segment_mask

        if self.device.type == "cpu":
            if causal:
                return torch.ones((sq, sk), dtype=torch.bool, device=self.device).triu_(1)[None, None]
            return torch.zeros((b, 1, 1, sk), dtype=torch.bool, device=self.device)
        return segment_mask(torch.ones(b, sq, dtype=torch.int64, device=self.device),
                            torch.ones(b, sk, dtype=torch.int64, device=self.device), causal=causal,
                            self_attention=self_attention)

    def _hidden(self, s: int, b: int) -> torch.Tensor:
        return torch.randn(s // self.shards, b, self.model.hidden_size, device=self.device, dtype=self.dtype,
                           requires_grad=True)

    def encoder_layer(self, b: int, s: int):
        x, mask = self._hidden(s, b), self._masks(b, s, s, causal=False, self_attention=True)
        return (lambda: self.encoder(hidden_states=x, attention_mask=mask)), list(self.encoder.parameters())

    def decoder_layer(self, b: int, s_dec: int, s_enc: int):
        y, ctx = self._hidden(s_dec, b), self._hidden(s_enc, b)
        self_mask = self._masks(b, s_dec, s_dec, causal=True, self_attention=True)
        cross_mask = self._masks(b, s_dec, s_enc, causal=False, self_attention=False)
        layer = self.decoder.layers[0]

        def fw():
            out = layer(hidden_states=y, attention_mask=self_mask, context=ctx, context_mask=cross_mask)
            return out[0] if isinstance(out, tuple) else out

        return fw, list(layer.parameters())

    def embedding_op(self, b: int, s: int):
        ids = torch.randint(1, self.model.vocab_size, (b, s), device=self.device)
        pos = torch.arange(s, device=self.device).unsqueeze(0).expand(b, s)
        return (lambda: self.embedding(input_ids=ids, position_ids=pos)), list(self.embedding.parameters())

    def output_op(self, b: int, s_dec: int):
        from megatron.core import tensor_parallel

        y = self._hidden(s_dec, b)
        labels = torch.randint(1, self.model.vocab_size, (s_dec, b), device=self.device)
        norm = self.decoder.final_layernorm

        def fw():
            logits = self.lm_head(norm(y), word_embeddings_weight=None)
            return tensor_parallel.vocab_parallel_cross_entropy(logits.float(), labels).sum()

        return fw, list(norm.parameters()) + list(self.lm_head.parameters())


def profile_t5_model(model: GPTModelArgs, mbs_grid: Sequence[int], seqlen_grid: Sequence[int],
                     dec_seqlen_grid: Sequence[int], device: torch.device, repeats: int = 3, warmup: int = 1,
                     progress: Optional[Callable[[str], None]] = None, sequence_parallel: bool = False) -> dict:
    """Measure the four T5 ops over the grid (samples; encoder and decoder tokens); returns the
    JSON-ready profile. megatron's parallel state must be initialised: one rank, or one
    tensor-parallel group whose ranks all call this (the figures are this rank's; under
    ``sequence_parallel`` every length of the grid must be a multiple of the TP size)."""
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    # Every timed pass starts at a barrier of the TP ranks, as the GPT profiler's do: a rank that
    # started early would otherwise time its wait for the others in the op's first all-reduce.
    group = ps.get_tensor_model_parallel_group() if tp > 1 else None
    ops = T5Ops(model, device, tp, sequence_parallel)
    flush = CacheFlush(device)
    axes = {"mbs": list(mbs_grid), "seqlen": list(seqlen_grid), "dec_seqlen": list(dec_seqlen_grid)}
    builders = {"encoder_layer": ops.encoder_layer, "decoder_layer": ops.decoder_layer,
                "embedding": ops.embedding_op, "output": ops.output_op}
    values: dict = {}
    started = time.perf_counter()
    # The timed runs of a point are spread over ``repeats`` passes over the whole grid, not run
    # back to back: on a shared machine a burst of other load then spoils one run of many
    # points instead of every run of a few, and the fastest run of each point is kept.
    for rep in range(repeats):
        for op in T5_OPS:
            grids = [axes[a] for a in T5_AXES[op]]
            shape = tuple(len(g) for g in grids)
            split = ops.weight_grads if op in SPLIT_OPS else None
            if rep == 0:
                names = FIELDS + ((WEIGHT_FIELD,) if split is not None else ())
                values[op] = {f: torch.zeros(shape, dtype=torch.float64) for f in names}
            table = values[op]
            for index in torch.cartesian_prod(*[torch.arange(n) for n in shape]).reshape(-1, len(shape)).tolist():
                point = [g[i] for g, i in zip(grids, index)]
                where = f"{op} at " + " ".join(f"{a}={v}" for a, v in zip(T5_AXES[op], point))
                at = tuple(index)
                with point_fits(where):
                    fw, params = builders[op](*point)
                    if rep == 0:  # time and memory, after the warm-up
                        m = measure_op(fw, params, device, repeats=1, warmup=warmup, group=group,
                                       weight_grads=split, flush=flush)
                    else:
                        fw_ms, bw_ms, weight_ms = time_op(fw, params, split, flush, group)
                if rep == 0:
                    for f in FIELDS:
                        table[f][at] = getattr(m, f)
                    if split is not None:
                        table[WEIGHT_FIELD][at] = m.bw_weight_ms
                else:
                    table["fw_ms"][at] = min(float(table["fw_ms"][at]), fw_ms)
                    if bw_ms < float(table["bw_ms"][at]):
                        # The weight part belongs to the backward it was timed in.
                        table["bw_ms"][at] = bw_ms
                        if split is not None:
                            table[WEIGHT_FIELD][at] = weight_ms
        if progress:
            progress(f"pass {rep + 1}/{repeats} over the grid: {time.perf_counter() - started:.1f} s so far")
    for v in values.values():
        for f in ("fw_ms", "bw_ms"):
            v[f] = suffix_minimum(v[f])
        if WEIGHT_FIELD in v:
            # Lowered on its own, the weight part could come from a faster point than bw_ms
            # did; it is a part of that backward, so it never exceeds it.
            v[WEIGHT_FIELD] = torch.minimum(suffix_minimum(v[WEIGHT_FIELD]), v["bw_ms"])
    tables = {op: {f: _nested(t.tolist()) for f, t in v.items()} for op, v in values.items()}
    # The encoder's calls (its mask type); a decoder's causal ones cost the same to within noise.
    calls = measure_attention_call_ms(ops.config, device, causal=False, repeats=repeats, warmup=warmup, flush=flush)
    m = model
    return {
        "format": PROFILE_FORMAT, "version": PROFILE_VERSION, "kind": KIND_ENCODER_DECODER,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": m.dtype, "layer_spec": ops.spec_name, "threads": torch.get_num_threads(),
        "model": {"arch": "t5", "hidden_size": m.hidden_size, "num_attention_heads": m.num_attention_heads,
                  "ffn_hidden_size": m.ffn_hidden_size, "kv_channels": m.kv_channels, "vocab_size": m.vocab_size,
                  "position_embedding_type": "learned_absolute", "hidden_dropout": m.hidden_dropout,
                  "attention_dropout": m.attention_dropout, "attention_softmax_in_fp32": m.softmax_in_fp32,
                  "gated_linear_unit": False, "num_query_groups": 0,
                  "add_bias_linear": True, "normalization": "LayerNorm"},
        "mbs": [int(b) for b in mbs_grid], "seqlen": [int(s) for s in seqlen_grid],
        "dec_seqlen": [int(s) for s in dec_seqlen_grid],
        "stage_overhead_ms": 0.0, "attention_call_ms": calls, "tp": tp, "sequence_parallel": bool(sequence_parallel),
        "profiling_s": round(time.perf_counter() - started, 2), "repeats": repeats,
        "times": "fastest of the repeats, each from a cold cache, lowered to the fastest of any larger shape",
        "ops": tables,
    }


def time_op(forward: Callable[[], torch.Tensor], params: Sequence[torch.Tensor],
            weight_grads: Optional[WeightGradStore] = None,
            flush: Optional[Callable[[], None]] = None, group=None) -> tuple[float, float, Optional[float]]:
    """Wall ms of one forward, of its backward (a random output gradient; a scalar loss
    directly) and of that backward's weight part, synchronised on CUDA as
    :func:`~megatron_integration.profiler.measure_op` is. ``weight_grads``: the store the op's
    linear layers defer into; the backward then runs split (input part, then weight part),
    its ms is both parts and the third ms the weight part. Without it the third is None.
    ``flush``: called, untimed, before the forward and before the backward (a
    :class:`~megatron_integration.profiler.CacheFlush`). ``group``: the TP group whose ranks run
    the same op; the forward and the backward each start after a barrier on it."""
    cuda = torch.cuda.is_available()

    def now(barrier: bool = False) -> float:
        if cuda:
            torch.cuda.synchronize()
        if barrier and group is not None:
            import torch.distributed as dist

            dist.barrier(group=group)
        return time.perf_counter()

    if flush is not None:
        flush()
    t0 = now(barrier=True)
    out = forward()
    t1 = now()
    grad = None if out.dim() == 0 else torch.randn_like(out)
    if flush is not None:
        flush()
    t2 = now(barrier=True)
    if weight_grads is None:
        out.backward(grad)
    else:
        with weight_grads.input_part(0):
            out.backward(grad)
    t3 = now()
    if weight_grads is not None:
        weight_grads.run(0)
    t4 = now()
    for p in params:
        p.grad = None
    return (t1 - t0) * 1e3, (t4 - t2) * 1e3, (t4 - t3) * 1e3 if weight_grads is not None else None


def _nested(values):
    """Rounded nested lists (2-D or 3-D tables) as JSON keeps them."""
    if isinstance(values, list):
        return [_nested(v) for v in values]
    return round(float(values), 6)


def write_t5_profile(model: GPTModelArgs, output: str, mbs_grid: Sequence[int], seqlen_grid: Sequence[int],
                     dec_seqlen_grid: Sequence[int], *, repeats: int = 3, warmup: int = 1,
                     threads: Optional[int] = None, seed: int = 1234, progress: bool = False, tp: int = 1,
                     sequence_parallel: bool = False, timeout_minutes: float = 10.0) -> dict:
    """Profile ``model`` as a T5 on this process's device, check the result is a profile the
    cost model reads, write it to ``output`` (rank 0) and return it. ``tp`` > 1: every rank of
    a job of ``tp`` ranks calls this; the job is one tensor-parallel group, and the profile
    holds rank 0's figures (times include the group's all-reduces, memory is per rank).
    ``timeout_minutes``: the process group's (``--distributed-timeout-minutes``); the model's
    ``deterministic_mode`` applies ``--deterministic-mode`` as training does."""
    import sys

    from dynapipe.config import TensorParallelConfig
    from dynapipe.cost.profile import ProfileCostModel
    from megatron_integration.cpu_affinity import use_profiler_threads
    from megatron_integration.initialize import initialize_megatron

    cuda = torch.cuda.is_available()
    use_profiler_threads(threads, cuda)
    info = initialize_megatron(ParallelArgs(world_size=tp, tensor_model_parallel_size=tp,
                                            sequence_parallel=sequence_parallel, timeout_minutes=timeout_minutes,
                                            backend="nccl" if cuda else "gloo"),
                               seed=seed, deterministic=model.deterministic_mode, private_store=True)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    profile = profile_t5_model(model, mbs_grid, seqlen_grid, dec_seqlen_grid, device, repeats=repeats,
                               warmup=warmup, sequence_parallel=sequence_parallel,
                               progress=(lambda line: print(line, file=sys.stderr)) if progress and info.rank == 0
                               else None)
    ProfileCostModel(t5_model_config(model), profile, num_stages=1, source=output,
                     tp=TensorParallelConfig(tp, sequence_parallel))
    if info.rank == 0:
        from dynapipe.output_paths import write_output

        write_output(output, json.dumps(profile, indent=1), "--output")
    return profile


def t5_model_config(model: GPTModelArgs, encoder_layers: int = 1, decoder_layers: int = 1):
    """A planner :class:`~dynapipe.config.ModelConfig` (``arch: t5``) of ``model``'s shape."""
    from dynapipe.config import ModelConfig

    return ModelConfig(name="profiled-t5", arch="t5", num_layers=encoder_layers + decoder_layers,
                       encoder_layers=encoder_layers, decoder_layers=decoder_layers, hidden_size=model.hidden_size,
                       num_attention_heads=model.num_attention_heads, ffn_hidden_size=model.ffn_hidden_size,
                       vocab_size=model.vocab_size, max_seq_length=model.max_position_embeddings, dtype=model.dtype,
                       tie_embeddings=model.tie_embeddings, kv_channels=model.kv_channels,
                       hidden_dropout=model.hidden_dropout, attention_dropout=model.attention_dropout,
                       attention_softmax_in_fp32=model.softmax_in_fp32).validate("profiled-t5")


def _job(model: GPTModelArgs, output: str, grids: tuple, kwargs: dict) -> str:
    from megatron_integration.initialize import destroy

    try:
        write_t5_profile(model, output, *grids, **kwargs)
    finally:
        destroy()
    return output


def measure_t5_profile(model: GPTModelArgs, output: str, mbs_grid: Sequence[int], seqlen_grid: Sequence[int],
                       dec_seqlen_grid: Sequence[int], *, threads: int = 1, timeout_s: float = 1800.0,
                       tp: int = 1, **kwargs) -> str:
    """:func:`write_t5_profile` in ``tp`` spawned ranks (one tensor-parallel group) of
    ``threads`` threads each (the caller keeps no megatron state); a job past ``timeout_s`` s
    is killed and reported. Returns ``output``."""
    from megatron_integration.launch import spawn

    grids = (list(mbs_grid), list(seqlen_grid), list(dec_seqlen_grid))
    return spawn(_job, tp, (model, output, grids, dict(threads=threads, tp=tp, **kwargs)), timeout_s=timeout_s,
                 threads_per_rank=threads)[0]
