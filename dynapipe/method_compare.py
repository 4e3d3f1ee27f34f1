"""Simulated comparison of batching methods on one global batch: DynaPipe against tuned baselines.

Every method goes through the project's own planner and simulator
(:func:`dynapipe.pipeline_planner.plan_iteration`) with the same cost model, memory
limit and cluster links, so the figures differ only by how the micro-batches are made
and scheduled:

* ``dynapipe``: DP-cut micro-batches, schedule search (schedule x order x recompute);
* ``dynapipe-1f1b``: the same micro-batches, plain 1F1B (the gain of cutting alone);
* ``dynapipe-zb``: the same micro-batches under the zero-bubble schedule ``zb-h1``;
* ``packing`` / ``padding`` / ``padding-mb``: the baselines under 1F1B with the lightest
  uniform recompute level that fits, as a Megatron user would run them (packed rows with
  Megatron's per-sample mask: dense attention over every row);
* ``packing-per-sample``: the same packed rows run with attention on each sample alone (a
  varlen kernel), priced at their attention density: the strongest packing;
* ``packing-search``: the strongest packing: ``packing-per-sample``'s micro-batches given
  DynaPipe's schedule search (schedule, order, per-stage recompute), so the comparison with
  DynaPipe has the same schedule freedom and only the cut differs.

The baselines have a micro-batch size; :func:`tune_baseline` sweeps it over the values
that fit in memory and keeps the fastest. Pure Python + numpy: no torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from dynapipe.config import ClusterConfig
from dynapipe.cost.attention_share import attention_share
from dynapipe.cost.base import RECOMPUTE_LEVELS, CostModel, check_recompute
from dynapipe.errors import DynaPipeError, whole_number
from dynapipe.method_inputs import checked_batch, not_a_batch
from dynapipe.pipeline_planner import IterationPlan, plan_iteration

# method -> (batching method of the planner, schedule, whether the search picks recompute)
METHOD_SPECS: dict[str, tuple[str, str, bool]] = {
    "dynapipe": ("dynapipe", "auto", True),
    "dynapipe-1f1b": ("dynapipe", "1f1b", True),
    # DynaPipe's rows with per-sample attention (the padding tail skipped, as a varlen kernel does).
    "dynapipe-per-sample": ("dynapipe-per-sample", "auto", True),
    "packing": ("packing", "1f1b", False),
    "packing-per-sample": ("packing-per-sample", "1f1b", False),
    "packing-search": ("packing-per-sample", "auto", True),
    "padding": ("padding", "1f1b", False),
    "padding-mb": ("padding-mb", "1f1b", False),
    "dynapipe-zb": ("dynapipe", "zb-h1", True),
}
METHODS = tuple(METHOD_SPECS)
# Methods whose micro-batch size is a free parameter worth tuning.
SIZED_METHODS = ("packing", "packing-per-sample", "packing-search", "padding", "padding-mb")


def method_cut(method: str, micro_batch_size: Optional[int] = None):
    """``(cut, schedule)``: how ``method`` cuts global batches (a
    :class:`~dynapipe.schedule.placement.Cut`, at ``micro_batch_size`` samples or rows, 1 when
    None) and the schedule it runs, for choosing a stage placement on its own micro-batches."""
    from dynapipe.schedule.placement import Cut

    batching, schedule, _ = METHOD_SPECS[method]
    return Cut(batching, micro_batch_size or 1), schedule


def check_priceable(method: str, cost_model: CostModel) -> None:
    """Refuse a method whose micro-batches ``cost_model`` cannot price: per-sample rows'
    (``dynapipe-per-sample``, ``packing-per-sample``, ``packing-search``) need a model that prices attention
    densities. Checked before any sweep, where a refusal would read as "does not fit"."""
    if METHOD_SPECS.get(method, ("",))[0].endswith("-per-sample") and not cost_model.prices_attention_density:
        raise DynaPipeError(f"method {method!r} runs its rows with per-sample attention, which "
                            f"{type(cost_model).__name__} cannot price (it prices dense attention only); use the "
                            f"analytic or a profile cost model, or compare with 'packing' (masked rows).")


@dataclass
class MethodSimulation:
    """One method's simulated iteration.

    ``iteration_ms``: simulated makespan of the slowest replica (ms). ``real_tokens``:
    non-pad tokens of the global batch, input + target, every replica, after truncation at
    the sequence length; ``padded_tokens``: tokens computed, padding included.
    ``real_tokens_per_s``: ``real_tokens`` per second of ``iteration_ms``. ``stage_peak_mib``:
    simulated peak memory of every stage, model states included (MiB). ``planning_ms``:
    wall time of planning this configuration (batching + schedule + compile; the sweep
    of :func:`tune_baseline` is not included). ``micro_batch_size``: samples (rows for
    packing) a micro-batch; ``None`` for DynaPipe's variable sizes.
    """

    method: str
    micro_batch_size: Optional[int]
    recompute: str
    stage_recompute: list[str]
    schedule: str
    order: str
    micro_batches: int
    iteration_ms: float
    real_tokens: int
    padded_tokens: int
    real_tokens_per_s: float
    bubble_fraction: float
    stage_peak_mib: list[float]
    planning_ms: float
    attention_share: float = 0.0

    @property
    def padding_efficiency(self) -> float:
        """Non-pad tokens (input + target) / tokens computed."""
        return self.real_tokens / max(self.padded_tokens, 1)

    def to_json(self) -> dict:
        return {"method": self.method, "micro_batch_size": self.micro_batch_size, "recompute": self.recompute,
                "stage_recompute": list(self.stage_recompute), "schedule": self.schedule, "order": self.order,
                "micro_batches": self.micro_batches, "iteration_ms": round(self.iteration_ms, 3),
                "real_tokens": self.real_tokens, "padded_tokens": self.padded_tokens,
                "padding_efficiency": round(self.padding_efficiency, 4),
                "real_tokens_per_s": round(self.real_tokens_per_s, 1),
                "bubble_fraction": round(self.bubble_fraction, 4),
                "stage_peak_mib": [round(p, 1) for p in self.stage_peak_mib],
                "planning_ms": round(self.planning_ms, 3), "attention_share": round(self.attention_share, 4)}


@dataclass
class TunedBaseline:
    """The best micro-batch size of a baseline and every size tried.

    ``sweep`` rows: ``micro_batch_size`` and either the :meth:`MethodSimulation.to_json`
    figures (``fits: true``) or ``fits: false`` with the reason.
    """

    best: MethodSimulation
    sweep: list[dict] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"best": self.best.to_json(), "sweep": list(self.sweep)}


def plan_shapes(plan: IterationPlan, encoder_decoder: bool) -> list[tuple[int, ...]]:
    """Padded shape of every micro-batch of a plan: ``(rows, seqlen[, dec_seqlen])``."""
    mbs = plan.batch_plan.micro_batches
    if encoder_decoder:
        return [(mb.mbs, mb.seqlen, mb.dec_seqlen) for mb in mbs]
    return [(mb.mbs, mb.seqlen) for mb in mbs]


def global_batch_of_tokens(tokens: int, seed: int, seq_length: int, encoder_decoder: bool = False,
                           mixture=None) -> np.ndarray:
    """A global batch drawn from the synthetic mixture: samples (clipped at ``seq_length``
    tokens) in draw order until adding the next would exceed ``tokens`` (at least one).
    Lengths as :func:`dynapipe.data.synthetic.sample_lengths` returns them."""
    from dynapipe.data.synthetic import sample_lengths

    tokens = whole_number("tokens", tokens)
    seq_length = whole_number("seq_length", seq_length)
    n = max(16, 4 * tokens // seq_length)
    while True:
        lengths = sample_lengths(n, seed, seq_length, encoder_decoder, mixture)
        per_sample = lengths.reshape(len(lengths), -1).sum(axis=1)
        fit = int(np.searchsorted(np.cumsum(per_sample), tokens, side="right"))
        if fit < n:
            return lengths[:max(fit, 1)]
        n *= 2


def _real_tokens(lengths, seq_length: Optional[int]) -> int:
    arr = np.asarray(lengths)
    if seq_length is not None:
        arr = np.minimum(arr, seq_length)
    return int(arr.sum())


def _to_simulation(method: str, plan: IterationPlan, cost_model: CostModel, real_tokens: int,
                   micro_batch_size: Optional[int]) -> MethodSimulation:
    bp = plan.batch_plan
    enc_dec = cost_model.model.is_encoder_decoder
    return MethodSimulation(
        method=method, micro_batch_size=micro_batch_size, recompute=plan.recompute,
        stage_recompute=plan.stage_recompute, schedule=plan.schedule, order=plan.order,
        micro_batches=len(bp.micro_batches), iteration_ms=plan.simulated_ms, real_tokens=real_tokens,
        padded_tokens=sum(mb.padded_tokens for mb in bp.micro_batches),
        real_tokens_per_s=real_tokens / (plan.simulated_ms / 1e3) if plan.simulated_ms > 0 else 0.0,
        bubble_fraction=plan.bubble_fraction, stage_peak_mib=plan.stage_peak_mib, planning_ms=plan.planning_ms,
        attention_share=attention_share(cost_model.model, plan_shapes(plan, enc_dec),
                                        [mb.attention for mb in bp.micro_batches]))


def simulate_method(lengths, method: str, cost_model: CostModel, *, dp: int = 1,
                    micro_batch_size: Optional[int] = None, seq_length: Optional[int] = None,
                    memory_limit_mib: Optional[float] = None, reserved_mib: Optional[float] = None,
                    cluster: Optional[ClusterConfig] = None, tp: int = 1, zero: bool = False,
                    split_backward: bool = True, schedule: Optional[str] = None,
                    recompute: Optional[str] = None) -> MethodSimulation:
    """Plan and simulate one iteration of ``lengths`` (tokens) with ``method`` (one of :data:`METHODS`).

    ``micro_batch_size`` (samples, rows for packing) is required by the sized baselines.
    The baselines under 1F1B take the lightest uniform recompute level that fits;
    ``dynapipe``/``packing-search`` let the schedule search choose (per stage), and
    ``dynapipe-1f1b`` lets it choose a uniform level. Memory defaults to the cost
    model's device config (MiB). ``split_backward=False``: the stages cannot split their
    backward (Transformer Engine's layers), so no search tries the zero-bubble schedules.
    ``schedule`` / ``recompute`` replace the method's own (a run that fixes them:
    ``--dynapipe-schedule``, ``--dynapipe-recompute``); a fixed level is the only one tried.
    Raises :class:`DynaPipeError` when nothing fits.
    """
    # Inputs are checked here, once: inside the recompute loop below an input error would read
    # as "fits at no recompute level".
    checked_batch(lengths, cost_model, dp=dp, tp=tp, seq_length=seq_length, memory_limit_mib=memory_limit_mib,
                  reserved_mib=reserved_mib, cluster=cluster, zero=zero, split_backward=split_backward,
                  micro_batch_size=micro_batch_size)
    if method not in METHOD_SPECS:
        raise DynaPipeError(f"method {method!r} is not known; use one of {', '.join(METHODS)}.")
    batching, own_schedule, searched = METHOD_SPECS[method]
    schedule = own_schedule if schedule is None else schedule
    check_priceable(method, cost_model)
    if method in SIZED_METHODS and micro_batch_size is None:
        raise DynaPipeError(f"method {method!r} needs a micro-batch size (samples, or rows for packing).")
    if method not in SIZED_METHODS and micro_batch_size is not None:
        raise DynaPipeError(f"method {method!r} cuts its own micro-batches and reads no micro_batch_size "
                            f"({micro_batch_size}); leave it None.")
    common = dict(dp=dp, method=batching, schedule=schedule, memory_limit_mib=memory_limit_mib,
                  reserved_mib=reserved_mib, cluster=cluster, micro_batch_size=micro_batch_size or 1,
                  seq_length=seq_length, tp=tp, zero=zero, split_backward=split_backward)
    real = _real_tokens(lengths, seq_length)
    if searched and recompute is None:
        plan = plan_iteration(lengths, cost_model, recompute=None, **common)
        return _to_simulation(method, plan, cost_model, real, micro_batch_size)
    error: Optional[DynaPipeError] = None
    levels = RECOMPUTE_LEVELS if recompute is None else (check_recompute(recompute),)
    for level in levels:  # ordered light to heavy: the first that fits is the lightest
        try:
            plan = plan_iteration(lengths, cost_model, recompute=level, **common)
        except DynaPipeError as e:
            error = e
            continue
        return _to_simulation(method, plan, cost_model, real, micro_batch_size)
    raise DynaPipeError(f"{method} with micro-batch size {micro_batch_size} fits in memory at no recompute "
                        f"level: {error}")


def micro_batch_size_candidates(lengths, method: str, seq_length: Optional[int] = None) -> list[int]:
    """Powers of two from 1 up to the number of samples (padding) or packed rows (packing)."""
    arr = np.asarray(lengths)
    if method.startswith("packing"):
        from dynapipe.batching.baselines import packing

        cap = int(seq_length if seq_length is not None else arr.max())
        rows = len(packing(np.minimum(arr, cap), 1, cap)[0])
    else:
        rows = len(arr)
    out, m = [], 1
    while m <= max(rows, 1):
        out.append(m)
        m *= 2
    return out


def _sizes(micro_batch_sizes) -> list[int]:
    """The sizes of a sweep, each checked up front: the sweep stops at the first size that
    does not fit, and a bad entry must not pass for one."""
    return [whole_number("micro_batch_size", m) for m in micro_batch_sizes]


def tune_baseline(lengths, method: str, cost_model: CostModel, *,
                  micro_batch_sizes: Optional[Sequence[int]] = None, **kwargs) -> TunedBaseline:
    """Sweep a baseline's micro-batch size and keep the highest simulated real tokens/s.

    ``micro_batch_sizes`` default to :func:`micro_batch_size_candidates`. Activation
    memory grows with the size, so the sweep stops at the first size that fits at no
    recompute level (recorded with ``fits: false``). ``kwargs`` go to
    :func:`simulate_method`. Raises :class:`DynaPipeError` when no size fits.
    """
    if method not in SIZED_METHODS:
        raise DynaPipeError(f"method {method!r} has no micro-batch size to tune; use one of "
                            f"{', '.join(SIZED_METHODS)}.")
    checked_batch(lengths, cost_model, **kwargs)  # an input error would read as "no size fits"
    check_priceable(method, cost_model)
    sizes = _sizes(micro_batch_sizes) if micro_batch_sizes is not None else \
        micro_batch_size_candidates(lengths, method, kwargs.get("seq_length"))
    if not sizes:
        raise DynaPipeError(f"no micro-batch size to try for {method}.")
    best: Optional[MethodSimulation] = None
    sweep: list[dict] = []
    for m in sorted(sizes):
        try:
            sim = simulate_method(lengths, method, cost_model, micro_batch_size=m, **kwargs)
        except DynaPipeError as e:
            sweep.append({"micro_batch_size": m, "fits": False, "reason": str(e)})
            break
        sweep.append({"micro_batch_size": m, "fits": True, **sim.to_json()})
        if best is None or sim.real_tokens_per_s > best.real_tokens_per_s:
            best = sim
    if best is None:
        raise DynaPipeError(f"{method}: no micro-batch size in {sorted(sizes)} fits in memory "
                            f"({sweep[0]['reason']}).")
    return TunedBaseline(best, sweep)


def compare_methods(lengths, cost_model: CostModel, methods: Sequence[str] = METHODS,
                    **kwargs) -> dict[str, TunedBaseline]:
    """Every method of ``methods`` on the same batch: sized baselines tuned by
    :func:`tune_baseline`, DynaPipe simulated once (its ``sweep`` is empty).
    ``kwargs`` go to :func:`simulate_method`."""
    out: dict[str, TunedBaseline] = {}
    for method in methods:
        if method in SIZED_METHODS:
            out[method] = tune_baseline(lengths, method, cost_model, **kwargs)
        else:
            out[method] = TunedBaseline(simulate_method(lengths, method, cost_model, **kwargs))
    return out


@dataclass
class BatchesResult:
    """One method over several global batches at one setting (a fixed micro-batch size for
    the baselines: a user tunes it once for a dataset, not per batch).

    ``runs``: the simulation of every batch. ``sweep``: for tuned baselines, the
    aggregate figures (:meth:`summary`) of every size tried. ``step_ms``: what every
    iteration adds after the pipeline (ms; the layout advisor's data-parallel
    synchronisation, :func:`~dynapipe.cost.dp_sync.dp_sync_ms`), counted in the iteration time.
    """

    method: str
    runs: list[MethodSimulation]
    sweep: list[dict] = field(default_factory=list)
    step_ms: float = 0.0

    @property
    def micro_batch_size(self) -> Optional[int]:
        return self.runs[0].micro_batch_size

    @property
    def real_tokens_per_s(self) -> float:
        """All batches' non-pad tokens (input + target) per second of their summed simulated
        iteration time (``step_ms`` included)."""
        ms = sum(r.iteration_ms for r in self.runs) + self.step_ms * len(self.runs)
        return sum(r.real_tokens for r in self.runs) / (ms / 1e3) if ms > 0 else 0.0

    def summary(self) -> dict:
        """Aggregate figures: real tokens/s (non-pad, input + target), mean iteration ms
        (``step_ms`` included, and given as ``step_ms``), median planning ms (wall
        time, so the median resists a busy machine), mean bubble,
        highest stage peak (MiB), FLOP-weighted attention share, and the recompute levels
        and schedules chosen (a set over the batches)."""
        n = len(self.runs)
        peaks = np.max([r.stage_peak_mib for r in self.runs], axis=0)
        return {"method": self.method, "micro_batch_size": self.micro_batch_size,
                "real_tokens_per_s": round(self.real_tokens_per_s, 1),
                "iteration_ms": round(sum(r.iteration_ms for r in self.runs) / n + self.step_ms, 3),
                "step_ms": round(self.step_ms, 3),
                "planning_ms": round(float(np.median([r.planning_ms for r in self.runs])), 3),
                "bubble_fraction": round(sum(r.bubble_fraction for r in self.runs) / n, 4),
                "padding_efficiency": round(sum(r.real_tokens for r in self.runs)
                                            / max(sum(r.padded_tokens for r in self.runs), 1), 4),
                "micro_batches": round(sum(r.micro_batches for r in self.runs) / n, 1),
                "stage_peak_mib": [round(float(p), 1) for p in peaks],
                "attention_share": round(sum(r.attention_share for r in self.runs) / n, 4),
                "recompute": sorted({r.recompute for r in self.runs}),
                "schedule": sorted({r.schedule for r in self.runs}), "batches": n}


def compare_over_batches(batches: Sequence, method: str, cost_model: CostModel, *,
                         micro_batch_sizes: Optional[Sequence[int]] = None, **kwargs) -> BatchesResult:
    """``method`` on every batch of ``batches``. Sized baselines sweep one micro-batch size
    for all batches (default: :func:`micro_batch_size_candidates` of the first batch) and
    keep the size with the highest aggregate real tokens/s; the sweep stops at the first
    size that fits no batch at any recompute level. ``kwargs`` go to :func:`simulate_method`."""
    if batches is None or isinstance(batches, (str, bytes)) or (len(batches) and not_a_batch(batches[0])):
        raise DynaPipeError("batches: give a sequence of global batches, each a sequence of sample lengths "
                            "(a single batch goes in a list: [lengths]).")
    if not len(batches):
        raise DynaPipeError("no global batch to simulate.")
    for b in batches:  # an input error would read as "no size fits"
        checked_batch(b, cost_model, **kwargs)
    if method not in SIZED_METHODS:
        return BatchesResult(method, [simulate_method(b, method, cost_model, **kwargs) for b in batches])
    check_priceable(method, cost_model)
    sizes = _sizes(micro_batch_sizes) if micro_batch_sizes is not None else \
        micro_batch_size_candidates(batches[0], method, kwargs.get("seq_length"))
    best: Optional[BatchesResult] = None
    sweep: list[dict] = []
    for m in sorted(sizes):
        try:
            res = BatchesResult(method, [simulate_method(b, method, cost_model, micro_batch_size=m, **kwargs)
                                         for b in batches])
        except DynaPipeError as e:
            sweep.append({"micro_batch_size": m, "fits": False, "reason": str(e)})
            break
        sweep.append({"fits": True, **res.summary()})
        if best is None or res.real_tokens_per_s > best.real_tokens_per_s:
            best = res
    if best is None:
        raise DynaPipeError(f"{method}: no micro-batch size in {sorted(sizes)} fits in memory "
                            f"({sweep[0]['reason']}).")
    best.sweep = sweep
    return best
