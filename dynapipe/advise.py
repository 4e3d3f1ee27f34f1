"""The layout advisor: which parallel layout to train a model with, chosen by simulation.

For a model, a device, a cluster and a number of GPUs, :func:`~dynapipe.layouts.enumerate_layouts` lists
the layouts (tensor-parallel x pipeline-parallel x data-parallel, and Megatron's
distributed optimizer on or off); :func:`advise` plans and simulates a few sampled
global batches on each with DynaPipe (its schedule search picks the schedule and the
recompute level per stage) and with the best tuned packing baseline (by default packed rows
whose attention runs per sample, as a varlen kernel gives packing on a GPU), adds the layout's
data-parallel gradient synchronisation (:func:`~dynapipe.cost.dp_sync.dp_sync_ms`), and
ranks the layouts by DynaPipe's predicted real tokens per second. Layouts whose model states
alone exceed the memory are refused without planning; a layout is shown only if every
batch's plan fits.

Tensor parallelism stays inside a node, as Megatron places it (TP ranks adjacent); a
layout with TP > 1 is priced by the analytic cost model at that TP size, with its
collectives on the cluster's intra-node link, and with Megatron's sequence parallelism on
unless asked otherwise (it holds a TP rank's norm and dropout activations at 1/TP for the
same communication volume).
Pure Python + numpy: no torch.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable, Optional, Sequence

import numpy as np

from dynapipe.config import ClusterConfig, DeviceConfig, ModelConfig, TensorParallelConfig, padded_vocab_size
from dynapipe.cost import build_cost_model
from dynapipe.cost.chunked_placement import even_chunked_placement
from dynapipe.cost.dp_sync import dp_sync_ms
from dynapipe.cost.placement import StagePlacement
from dynapipe.errors import DynaPipeError, arg, given, whole_number
from dynapipe.method_compare import BatchesResult, compare_over_batches, method_cut
from dynapipe.method_inputs import checked_batches
from dynapipe.layouts import Layout, enumerate_layouts, leave_out_idle_replicas
from dynapipe.schedule.placement import DYNAPIPE_CUT, Cut

#: The packings :func:`advise` compares with: per-sample attention under 1F1B (the default),
#: masked rows under 1F1B, or per-sample attention given DynaPipe's schedule search (the strongest).
PACKING_METHODS = ("packing-per-sample", "packing", "packing-search")


@dataclass
class LayoutResult:
    """The simulated figures of one layout over the sampled batches.

    ``dynapipe``/``packing``: :class:`~dynapipe.method_compare.BatchesResult` of each
    method (``packing`` is ``None`` when no packed micro-batch size fits, or when the
    comparison was not asked for). ``advise_ms``: wall time spent on this layout.
    """

    layout: Layout
    dynapipe: BatchesResult
    packing: Optional[BatchesResult]
    advise_ms: float = 0.0
    #: Layers per stage when not Megatron's even split (encoder-decoder models: the planned
    #: placement, as ``--dynapipe-placement`` writes it).
    placement: Optional[str] = None
    #: Packing's, when it ran faster on the placement chosen for its own micro-batches.
    packing_placement: Optional[str] = None

    @property
    def real_tokens_per_s(self) -> float:
        """DynaPipe's simulated non-pad tokens (input + target) per second at this layout."""
        return self.dynapipe.real_tokens_per_s

    @property
    def stage_peak_mib(self) -> list[float]:
        """Highest simulated memory of every stage over the batches, model states included (MiB)."""
        return [float(x) for x in np.max([r.stage_peak_mib for r in self.dynapipe.runs], axis=0)]

    @property
    def speedup_vs_packing(self) -> Optional[float]:
        if self.packing is None or self.packing.real_tokens_per_s <= 0:
            return None
        return self.real_tokens_per_s / self.packing.real_tokens_per_s

    def to_json(self) -> dict:
        d = self.dynapipe.summary()
        out = {"tp": self.layout.tp, "sequence_parallel": self.layout.sp, "pp": self.layout.pp,
               "chunks": self.layout.chunks, "dp": self.layout.dp, "zero": self.layout.zero, "real_tokens_per_s": d["real_tokens_per_s"], "iteration_ms": d["iteration_ms"],
               "bubble_fraction": d["bubble_fraction"], "stage_peak_mib": [round(p, 1) for p in self.stage_peak_mib],
               "dp_sync_ms": d["step_ms"],
               "planning_ms": d["planning_ms"], "recompute": d["recompute"], "schedule": d["schedule"],
               "placement": self.placement}
        if self.packing is not None:
            p = self.packing.summary()
            out["packing"] = {"method": self.packing.method, "micro_batch_size": p["micro_batch_size"],
                              "real_tokens_per_s": p["real_tokens_per_s"],
                              "iteration_ms": p["iteration_ms"], "recompute": p["recompute"],
                              "placement": self.packing_placement or self.placement}
            out["speedup_vs_packing"] = round(self.speedup_vs_packing, 3)
        return out


@dataclass
class Advice:
    """The ranked layouts (fastest first), the layouts refused (they do not fit) and those left
    out (more data-parallel replicas than a global batch has samples), each with the reason."""

    results: list[LayoutResult]
    refused: list[tuple[Layout, str]] = field(default_factory=list)
    elapsed_ms: float = 0.0
    left_out: list[tuple[Layout, str]] = field(default_factory=list)
    # What would make a layout fit when none does (more GPUs, more memory), for the refusal.
    remedy: str = ""

    @property
    def best_packing(self) -> Optional[LayoutResult]:
        """The layout on which packing simulates fastest (None without a packing comparison):
        a user who packs would train on it, so DynaPipe's best layout is set against it."""
        packed = [r for r in self.results if r.packing is not None]
        return max(packed, key=lambda r: r.packing.real_tokens_per_s, default=None)

    @property
    def best(self) -> LayoutResult:
        if not self.results:
            # The most split layouts first: they come closest to fitting.
            closest = sorted(self.refused, key=lambda r: (-r[0].tp * r[0].pp, not r[0].zero))
            more = f" (and {len(closest) - 3} more)" if len(closest) > 3 else ""
            raise DynaPipeError("no layout fits: " + "; ".join(f"{l.label()}: {why}" for l, why in closest[:3])
                                + more + (f". {self.remedy}" if self.remedy else "."))
        return self.results[0]


def advise(batches: Sequence[np.ndarray], model: ModelConfig, device: DeviceConfig, gpus: int, *,
           cluster: Optional[ClusterConfig] = None, seq_length: Optional[int] = None,
           memory_limit_mib: Optional[float] = None, layouts: Optional[Sequence[Layout]] = None,
           compare_packing: bool = True, plan_placement: bool = True,
           packing_method: str = "packing-per-sample",
           progress: Optional[Callable[[int, int, Layout], None]] = None) -> Advice:
    """Simulate every layout (default :func:`enumerate_layouts`) on ``batches`` (sample
    lengths in tokens, one array per global batch) and rank them by DynaPipe's real
    tokens/s, each layout's data-parallel synchronisation after the pipeline included (both
    methods' ``step_ms``: :func:`~dynapipe.cost.dp_sync.dp_sync_ms` on ``cluster``, not
    overlapped, as the run config it writes runs it). ``memory_limit_mib`` per GPU defaults to the device's memory; the
    device's reserved MiB is taken off it. ``progress(done, total, layout)`` is called
    before each layout and once at the end (``layout`` then ``None``).
    ``plan_placement``: an encoder-decoder model's layouts with PP > 1 run on the stage
    placement the planner chooses on ``batches`` (contiguous or interleaved, as
    ``pretrain_t5.py --dynapipe-placement auto`` does; seconds a layout at cluster scale),
    every method on it; off, on Megatron's even split.
    ``packing_method``: the packing compared with, ``packing-per-sample`` (the rows' attention
    computed per sample, under 1F1B as Megatron runs it), ``packing`` (Megatron's masked rows:
    dense attention) or ``packing-search`` (per-sample rows given DynaPipe's schedule search, the
    same schedule freedom: the strongest packing, slower to simulate).
    """
    if packing_method not in PACKING_METHODS:
        raise DynaPipeError(f"packing method {packing_method!r}: compare with one of {', '.join(PACKING_METHODS)}.")
    batches = checked_batches(batches, model, device, cluster=cluster, seq_length=seq_length, layouts=layouts)
    if layouts is not None:
        other = [lay.label() for lay in layouts if lay.tp * lay.pp * lay.dp != gpus]
        if other:
            raise DynaPipeError(f"layout {other[0]} does not use the {gpus} GPUs given (TP x PP x DP must be "
                                f"{gpus}); give layouts of {gpus} GPUs or the GPU count they use.")
    layouts = list(layouts) if layouts is not None else enumerate_layouts(model, gpus, cluster, seq_length=seq_length)
    layouts, left_out = leave_out_idle_replicas(layouts, batches)
    limit, capacity = gpu_capacity_mib(device, memory_limit_mib)
    t0 = time.perf_counter()
    results, refused = [], []
    cost_models: dict[tuple[int, int, bool, int], object] = {}
    for k, layout in enumerate(layouts):
        if progress is not None:
            progress(k, len(layouts), layout)
        started = time.perf_counter()
        if layout.chunks > 1 and model.is_encoder_decoder:
            refused.append((layout, "encoder-decoder models interleave through their planned placement, not chunks"))
            continue
        key = (layout.pp, layout.tp, layout.sp, layout.chunks)
        cm = cost_models.get(key)
        if cm is None:
            cm = build_cost_model(trained_model(model, layout.tp), device, layout.pp, tp=_tp_config(layout, cluster))
            if layout.chunks > 1:
                cm = cm.with_placement(even_chunked_placement(cm, layout.chunks))
            cost_models[key] = cm
        states = cm.model_state_mib(dp=layout.dp, zero=layout.zero)
        if states >= capacity:
            refused.append((layout, f"model states need {states:.0f} MiB of the {capacity:.0f} MiB a GPU may use"))
            continue
        # Transformer Engine's layers (a model config with fused attention) cannot split their
        # backward: no zero-bubble schedule for them.
        kw = dict(dp=layout.dp, seq_length=seq_length, memory_limit_mib=limit, reserved_mib=device.reserved_mib,
                  cluster=cluster, tp=layout.tp, zero=layout.zero, split_backward=not model.fused_attention)
        placement, placed = None, plan_placement and model.is_encoder_decoder and layout.pp > 1
        even_cm = cm
        if placed:
            cm = _placed(batches, cm, kw)
            if cm.placement != StagePlacement.even(model, layout.pp):
                placement = str(cm.placement)
        try:
            dyn = compare_over_batches(batches, "dynapipe", cm, **kw)
        except DynaPipeError as e:
            refused.append((layout, str(e)))
            continue
        peak = max(max(r.stage_peak_mib) for r in dyn.runs)
        if peak > capacity + 1e-6:
            refused.append((layout, f"simulated peak {peak:.0f} MiB exceeds the {capacity:.0f} MiB a GPU may use"))
            continue
        pack, pack_placement = None, None
        if compare_packing:
            try:
                pack = compare_over_batches(batches, packing_method, cm, **kw)
            except DynaPipeError:
                pack = None
        if pack is not None and placed:
            # A split chosen for DynaPipe's micro-batches need not suit packing's: it also runs
            # on the one chosen for its own (its rows at its tuned size, its own schedule).
            cut, schedule = method_cut(packing_method, pack.micro_batch_size)
            own_cm = _placed(batches, even_cm, kw, cut=cut, schedule=schedule)
            try:
                own = compare_over_batches(batches, packing_method, own_cm, **kw)
            except DynaPipeError:
                own = None
            if own is not None and own.real_tokens_per_s > pack.real_tokens_per_s:
                pack, pack_placement = own, str(own_cm.placement)
        # Layouts differ in the data-parallel step after the pipeline; both methods pay it.
        sync = dp_sync_ms(cm, dp=layout.dp, zero=layout.zero, cluster=cluster, tp=layout.tp)
        dyn = replace(dyn, step_ms=sync)
        pack = replace(pack, step_ms=sync) if pack is not None else None
        results.append(LayoutResult(layout, dyn, pack, (time.perf_counter() - started) * 1e3, placement,
                                    pack_placement))
    if progress is not None:
        progress(len(layouts), len(layouts), None)
    # Fastest first; ties broken towards fewer pipeline stages, less TP, fewer chunks, then no sharding.
    results.sort(key=lambda r: (-r.real_tokens_per_s, r.layout.pp, r.layout.tp, r.layout.chunks, r.layout.zero))
    remedy = "" if results else _remedy(model, gpus, [lay for lay, _ in refused], device, limit)
    return Advice(results, refused, (time.perf_counter() - t0) * 1e3, left_out, remedy)


def _remedy(model: ModelConfig, gpus: int, tried: Sequence[Layout], device: DeviceConfig, limit_mib: float) -> str:
    """What would let a layout of ``model`` fit when none of ``tried`` (all of ``gpus``) does:
    a deeper pipeline on more GPUs, or more memory a GPU (``limit_mib``: the limit the layouts
    were refused under, MiB)."""
    layers = model.total_layers
    deepest = max((lay.pp for lay in tried), default=1)
    memory = (f"a higher {arg('memory_limit_mib')} (up to the device's {device.memory_mib:g} MiB)"
              if limit_mib < device.memory_mib else "a device with more memory")
    if deepest >= layers:
        return f"Each of the {layers} layers already has a stage of its own: give {memory}."
    # The fewest GPUs that split the layers into more stages than these do, each holding fewer
    # layers (found within the next multiple of the layer count).
    more = next(n for n in range(gpus + 1, gpus + layers + 1)
                if any(not layers % p and not n % p for p in range(deepest + 1, layers + 1)))
    stages = max(p for p in range(1, layers + 1) if not layers % p and not more % p)
    return (f"{gpus} GPU(s) split the {layers} layers of {model.name} into at most {deepest} pipeline stage(s); "
            f"give more GPUs ({more} split them into up to {stages}) or {memory}.")


def _placed(batches: Sequence[np.ndarray], cost_model, kw: dict, cut: Cut = DYNAPIPE_CUT, schedule: str = "auto"):
    """``cost_model`` on the placement the simulation of ``batches`` cut as ``cut`` (DynaPipe's by
    default) under ``schedule`` runs fastest (:func:`~dynapipe.schedule.placement.choose_placement_kind`);
    the input placement if none plans."""
    from dynapipe.schedule.placement import choose_placement_kind

    try:
        return choose_placement_kind(batches, cost_model, dp=kw["dp"], memory_limit_mib=kw["memory_limit_mib"],
                                     reserved_mib=kw["reserved_mib"], seq_length=kw["seq_length"], zero=kw["zero"],
                                     cluster=kw["cluster"], split_backward=kw["split_backward"], cut=cut,
                                     schedule=schedule).cost_model
    except DynaPipeError:
        return cost_model


def trained_model(model: ModelConfig, tp: int) -> ModelConfig:
    """``model`` as Megatron-LM trains it at TP size ``tp`` from the run config :func:`advise`
    writes: that passes the model's vocabulary as ``--vocab-size``, which Megatron-LM pads to a
    multiple of 128 x TP (gpt-7b's 50,304 ids: 50,432 at TP2)."""
    return replace(model, vocab_size=padded_vocab_size(model.vocab_size, tensor_parallel=tp))


def _tp_config(layout: Layout, cluster: Optional[ClusterConfig]) -> Optional[TensorParallelConfig]:
    """The cost model's TP: its collectives on the cluster's intra-node link (TP stays in a node)."""
    if layout.tp == 1:
        return None
    link = cluster.intra_node if cluster is not None else TensorParallelConfig().link
    return TensorParallelConfig(layout.tp, layout.sp, link)


def gpu_capacity_mib(device: DeviceConfig, memory_limit_mib: Optional[float]) -> tuple[float, float]:
    """``(limit, capacity)``: the memory limit per GPU (default the device's) and what the
    plans may use of it once the device's reserved memory is taken off. Refuses a limit
    that leaves nothing, which would otherwise refuse every layout against a negative budget."""
    limit = device.memory_mib if memory_limit_mib is None else float(memory_limit_mib)
    capacity = limit - device.reserved_mib
    if not capacity > 0:
        typed = int(limit) if limit.is_integer() else limit  # as a command line gives it
        raise DynaPipeError(f"{given('memory_limit_mib', typed)} leaves nothing for the plans once the "
                            f"{device.reserved_mib:g} MiB device {device.name!r} reserves (reserved_mib) are "
                            f"taken off; give more than {device.reserved_mib:g} MiB "
                            f"(the device has {device.memory_mib:g}).")
    return limit, capacity


def sample_batches(tokens: int, count: int, seed: int, seq_length: int, *, encoder_decoder: bool = False,
                   mixture=None, pool: Optional[np.ndarray] = None) -> list[np.ndarray]:
    """``count`` global batches of about ``tokens`` tokens each (samples clipped at
    ``seq_length``): drawn from the synthetic ``mixture``, or without replacement from
    the lengths ``pool`` (shuffled with ``seed``; each batch takes samples until the next
    would pass ``tokens``; refused when the pool holds fewer than ``tokens``)."""
    whole_number("tokens", tokens)
    whole_number("count", count)
    if pool is None:
        from dynapipe.method_compare import global_batch_of_tokens

        return [global_batch_of_tokens(tokens, seed + b, seq_length, encoder_decoder, mixture) for b in range(count)]
    pool = np.asarray(pool)
    held = int(np.minimum(pool, seq_length).sum())
    if held < tokens:
        # Every batch would be the whole pool: a smaller global batch than the one asked.
        raise DynaPipeError(f"{arg('pool', 'the pool of lengths')} holds {held:,} tokens (samples clipped at "
                            f"{seq_length}), fewer than the {tokens:,} of a global batch ({given('tokens', tokens)}); "
                            f"give more lengths or {given('tokens', held)} or less.")
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        order = rng.permutation(len(pool))
        per = np.minimum(pool[order], seq_length).reshape(len(pool), -1).sum(axis=1)
        n = int(np.searchsorted(np.cumsum(per), tokens, side="right"))
        out.append(pool[order[:max(n, 1)]])
    return out
