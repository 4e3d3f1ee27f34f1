"""Stage placement: how many encoder and decoder layers every pipeline stage holds.

A :class:`StagePlacement` (:mod:`dynapipe.cost.stage_placement`, importable from here too)
is the split itself (one data structure for GPT and T5, shared by the cost model, the plan
JSON and the model stages that build it).
:func:`plan_placement` chooses one from the cost model over a sample of micro-batch
shapes: the contiguous split whose slowest stage is fastest, every stage's model states
and in-flight activations within the memory limit. Pure Python + numpy; ms and MiB.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from dynapipe.cost.attention_density import AttentionDensity, stack
from dynapipe.cost.base import RECOMPUTE_LEVELS, CostModel, StageLayout, check_recompute, layout_of_layers
from dynapipe.cost.stage_placement import StagePlacement
from dynapipe.errors import DynaPipeError, given, real_number, shown, whole_number


@dataclass(frozen=True)
class PlacementChoice:
    """A placement and how it prices on the sample.

    ``stage_ms[s]``: forward + backward time of every sample micro-batch on stage ``s``
    (ms), at ``stage_recompute[s]``, the lightest level whose estimated memory fits.
    ``bottleneck_ms``: the largest of them. ``stage_mib[s]``: that estimate (model states
    plus in-flight activations, MiB).
    """

    placement: StagePlacement
    stage_ms: tuple[float, ...]
    stage_recompute: tuple[str, ...]
    stage_mib: tuple[float, ...]

    @property
    def bottleneck_ms(self) -> float:
        return max(self.stage_ms)

    def to_json(self) -> dict:
        return {**self.placement.to_json(), "stage_ms": [round(t, 3) for t in self.stage_ms],
                "stage_recompute": list(self.stage_recompute), "stage_mib": [round(m, 1) for m in self.stage_mib]}


@dataclass(frozen=True)
class PlacementSample:
    """Micro-batch shapes the placement is priced on: ``mbs`` (rows), ``seqlen`` and
    ``dec_seqlen`` (tokens; 0 for decoder-only models), arrays of equal length; ``attention``:
    their attention densities (packed rows run per sample), None where all are dense."""

    mbs: np.ndarray
    seqlen: np.ndarray
    dec_seqlen: np.ndarray
    attention: Optional[AttentionDensity] = None

    def __post_init__(self) -> None:
        arrays = [np.asarray(getattr(self, f), dtype=np.float64) for f in ("mbs", "seqlen", "dec_seqlen")]
        if not arrays[0].size or arrays[0].ndim != 1 or any(a.shape != arrays[0].shape for a in arrays):
            raise DynaPipeError(f"PlacementSample: mbs, seqlen and dec_seqlen must be 1-D arrays of one equal, "
                                f"non-zero length (one entry per micro-batch); got shapes "
                                f"{[list(a.shape) for a in arrays]}.")
        for name, a, low in zip(("mbs", "seqlen", "dec_seqlen"), arrays, (1, 1, 0)):
            if not np.all(np.isfinite(a)) or np.any(a < low):
                raise DynaPipeError(f"PlacementSample.{name} holds values below {low} or not finite; give rows "
                                    f"and tokens of real micro-batches.")
        if self.attention is not None:
            for name in ("input", "target", "cross"):
                shape = np.shape(getattr(self.attention, name))
                if shape not in ((), arrays[0].shape):
                    raise DynaPipeError(f"PlacementSample.attention.{name} has shape {list(shape)} for "
                                        f"{arrays[0].size} micro-batches; give one density a micro-batch (or one "
                                        f"for all).")

    @staticmethod
    def of(micro_batches) -> "PlacementSample":
        """The shapes of planned :class:`~dynapipe.batching.types.MicroBatch` es."""
        mbs = list(micro_batches)
        if not mbs:
            raise DynaPipeError("stage placement needs at least one micro-batch to price.")
        arr = lambda f: np.array([float(f(mb)) for mb in mbs])  # noqa: E731
        return PlacementSample(arr(lambda mb: mb.mbs), arr(lambda mb: mb.seqlen), arr(lambda mb: mb.dec_seqlen),
                               stack([getattr(mb, "attention", None) for mb in mbs]))


class _Pricer:
    """Time and memory of one stage layout on the sample, each layout priced once.

    The micro-batch planner checks every micro-batch against the memory left by the
    heaviest stage's model states (``state_cap``), so a placement is priced under such a
    cap: a stage's level must let the sample's largest micro-batch fit alone in
    ``capacity - state_cap``, and its in-flight activations fit beside its own states.
    """

    def __init__(self, cost_model: CostModel, sample: PlacementSample, num_stages: int, levels: Sequence[str],
                 capacity_mib: Optional[float], dp: int, zero: bool):
        if cost_model.model.is_encoder_decoder and np.any(np.asarray(sample.dec_seqlen) < 1):
            raise DynaPipeError(f"PlacementSample.dec_seqlen holds {float(np.min(sample.dec_seqlen)):g}: every "
                                f"micro-batch of encoder-decoder model {cost_model.model.name!r} has at least one "
                                f"target token; give the decoder lengths (tokens) of real micro-batches.")
        if sample.attention is not None and not cost_model.prices_attention_density:
            raise DynaPipeError(f"{type(cost_model).__name__} prices dense attention only; a placement sample of "
                                f"per-sample packed rows needs the analytic or a profile cost model.")
        self.cm, self.sample, self.S, self.levels = cost_model, sample, num_stages, tuple(levels)
        self.capacity = np.inf if capacity_mib is None else float(capacity_mib)
        self.dp, self.zero = dp, zero
        self._levels: dict = {}
        self._states: dict = {}

    def state_mib(self, layout: StageLayout) -> float:
        key = layout.key
        hit = self._states.get(key)
        if hit is None:
            hit = self._states[key] = self.cm.layout_state_mib(layout, dp=self.dp, zero=self.zero)
        return hit

    def _level(self, layout: StageLayout, i: int) -> tuple[float, float, float]:
        """``(ms, in-flight MiB, alone MiB)`` at level ``self.levels[i]``: summed fw + bw
        time; stored activations of the ``S - stage`` largest micro-batches (1F1B's
        warm-up depth) plus the largest transient peak; the largest micro-batch's stored
        + peak. Layouts that differ only in their stage share one cost-model call."""
        key = layout.key + (i,)
        hit = self._levels.get(key)
        if hit is None:
            smp = self.sample
            dec = smp.dec_seqlen if self.cm.model.is_encoder_decoder else None
            c = self.cm.priced_layout_cost(layout, smp.mbs, smp.seqlen, dec, self.levels[i], smp.attention)
            ones = np.ones(len(smp.mbs))
            stored = np.asarray(c.stored_mib, dtype=np.float64) * ones
            peak = np.asarray(c.peak_mib, dtype=np.float64) * ones
            hit = self._levels[key] = (float(np.sum((np.asarray(c.fw_ms) + np.asarray(c.bw_ms)) * ones)),
                                       np.cumsum(np.sort(stored)[::-1]), float(peak.max()),
                                       float((stored + peak).max()))
        ms, flight, peak, alone = hit
        in_flight = min(self.S - layout.stage, len(flight))
        return ms, float(flight[in_flight - 1]) + peak, alone

    def price(self, layout: StageLayout, state_cap: float = np.inf) -> tuple[float, str, float]:
        """``(ms, level, MiB)`` at the lightest level that fits under ``state_cap`` (``inf``
        ms when none does); MiB: the stage's states plus in-flight activations."""
        state = self.state_mib(layout)
        cap = max(state, state_cap) if np.isfinite(state_cap) else state
        if state > cap or state >= self.capacity:
            return np.inf, self.levels[-1], np.inf
        for i, level in enumerate(self.levels):
            ms, flight, alone = self._level(layout, i)
            if state + flight <= self.capacity and cap + alone <= self.capacity:
                return ms, level, state + flight
        return np.inf, self.levels[-1], np.inf


def _segment(s: int, S: int, p: int, q: int, enc_total: int) -> StageLayout:
    """Stage ``s`` holding layers ``p..q-1`` of the model (encoder layers first)."""
    return layout_of_layers(s, S, p, q, enc_total)


class _Segments:
    """Every stage-and-layer-range's state (MiB) and, per recompute level, its time (ms),
    in-flight and alone memory (MiB) on the sample: ``[S, L + 1, L + 1]`` arrays indexed by
    (stage ``s``, first layer ``p``, end layer ``q``), priced once for all the state caps
    :func:`plan_placement` tries (``inf`` where a stage cannot hold that range)."""

    def __init__(self, pricer: _Pricer, S: int, L: int, enc_total: int, worst_cap: float):
        n = len(pricer.levels)
        self.S, self.L, self.capacity = S, L, pricer.capacity
        self.state = np.full((S, L + 1, L + 1), np.inf)
        self.ms, self.flight, self.alone = (np.full((n, S, L + 1, L + 1), np.inf) for _ in range(3))
        for st in range(S):
            # Stage st takes layers p..q-1; the stages before it one layer each at least, the later too.
            for p in range(st, L - (S - st) + 1):
                for q in range(p + 1, L - (S - st - 1) + 1):
                    layout = _segment(st, S, p, q, enc_total)
                    state = self.state[st, p, q] = pricer.state_mib(layout)
                    if state >= self.capacity:
                        continue  # fits at no level (Pricer.price)
                    # Lightest first, up to the first level that fits under the loosest cap tried
                    # (``worst_cap``): it fits under every tighter one, so no heavier level is chosen.
                    cap = state if not np.isfinite(worst_cap) else max(state, worst_cap)
                    for i in range(n):
                        ms, flight, alone = pricer._level(layout, i)
                        self.ms[i, st, p, q], self.flight[i, st, p, q], self.alone[i, st, p, q] = ms, flight, alone
                        if state + flight <= self.capacity and cap + alone <= self.capacity:
                            break

    def stage_ms(self, state_cap: float) -> np.ndarray:
        """``[S, L + 1, L + 1]`` ms of each range at the lightest level that fits under
        ``state_cap`` (:meth:`_Pricer.price`), ``inf`` where none does, and for every range
        from the first one whose states exceed ``state_cap`` on (more layers only add)."""
        C = self.capacity
        cap = np.maximum(self.state, state_cap) if np.isfinite(state_cap) else self.state
        out = np.full(self.state.shape, np.inf)
        open_ = self.state < C
        for i in range(len(self.ms)):
            fits = open_ & (self.state + self.flight[i] <= C) & (cap + self.alone[i] <= C)
            out = np.where(fits & ~np.isfinite(out), self.ms[i], out)
        ranges = np.isfinite(self.state)  # the ranges a stage can take (others stay inf)
        over = np.maximum.accumulate(ranges & (self.state > state_cap), axis=2)
        return np.where(over, np.inf, out)


def _dp(segments: _Segments, cap_ms: float, state_cap: float) -> tuple[float, list[int]]:
    """Contiguous split of the ``L`` layers into ``S`` non-empty stages whose states are at
    most ``state_cap`` MiB each.

    ``cap_ms = inf``: minimise the slowest stage's time. Otherwise: minimise the sum of
    squared stage times among splits whose every stage takes at most ``cap_ms`` (the
    second pass, which picks the most balanced of the splits with the least bottleneck).
    Returns ``(objective, cuts)`` with ``cuts[s]`` the first layer of stage ``s``. Ties go
    to the earliest cut (``argmin``'s first index).
    """
    S, L = segments.S, segments.L
    minimax = not np.isfinite(cap_ms)
    ms = segments.stage_ms(state_cap)
    if not minimax:
        ms = np.where(ms > cap_ms, np.inf, ms)
    best = np.full((S + 1, L + 1), np.inf)
    arg = np.zeros((S + 1, L + 1), dtype=np.int64)
    best[0, 0] = 0.0
    for s in range(S):
        prev = best[s][:, None]
        val = np.maximum(prev, ms[s]) if minimax else prev + ms[s] * ms[s]
        arg[s + 1] = np.argmin(val, axis=0)
        best[s + 1] = val[arg[s + 1], np.arange(L + 1)]
    if not np.isfinite(best[S, L]):
        return np.inf, []
    cuts, q = [], L
    for s in range(S, 0, -1):
        p = int(arg[s, q])
        cuts.append(p)
        q = p
    return float(best[S, L]), cuts[::-1]


def _choice(pricer: _Pricer, placement: StagePlacement) -> PlacementChoice:
    """``placement`` priced under the cap its own heaviest stage sets."""
    layouts = placement.layouts()
    cap = max(pricer.state_mib(l) for l in layouts)
    priced = [pricer.price(l, cap) for l in layouts]
    return PlacementChoice(placement, tuple(p[0] for p in priced), tuple(p[1] for p in priced),
                           tuple(p[2] for p in priced))


def price_placement(cost_model: CostModel, placement: StagePlacement, sample: PlacementSample, *,
                    capacity_mib: Optional[float] = None, dp: int = 1, zero: bool = False,
                    recompute: Optional[str] = None) -> PlacementChoice:
    """How ``placement`` prices on ``sample`` (see :class:`PlacementChoice`); stages that fit
    at no level get ``inf`` ms. ``recompute``: the lightest level tried (``None``: none)."""
    pricer = _Pricer(cost_model, sample, placement.num_stages, _levels(recompute), capacity_mib, dp, zero)
    return _choice(pricer, placement.validate(cost_model.model))


def _levels(recompute: Optional[str]) -> list[str]:
    if recompute is None:
        return list(RECOMPUTE_LEVELS)
    return list(RECOMPUTE_LEVELS[RECOMPUTE_LEVELS.index(check_recompute(recompute)):])


def plan_placement(cost_model: CostModel, sample: PlacementSample, num_stages: Optional[int] = None, *,
                   capacity_mib: Optional[float] = None, dp: int = 1, zero: bool = False,
                   recompute: Optional[str] = None) -> PlacementChoice:
    """The contiguous stage placement whose slowest stage is fastest on ``sample``.

    Every stage is priced with ``cost_model.layout_cost`` at the lightest recompute level
    (from ``recompute`` up) whose memory estimate fits ``capacity_mib`` (MiB for model
    states and activations: the device limit minus its reserve; ``None``: unlimited).
    A dynamic program over (stages, layers) finds the least bottleneck exactly; among
    the splits that reach it, a second pass keeps the one with the least sum of squared
    stage times. ``dp``/``zero`` size the model states as the planner does.
    Raises :class:`DynaPipeError` when no split fits.
    """
    if not isinstance(sample, PlacementSample):
        raise DynaPipeError(f"sample {shown(sample)}: give a PlacementSample (micro-batch shapes: mbs, seqlen, "
                            f"dec_seqlen arrays), for example PlacementSample.of(micro_batches).")
    model = cost_model.model
    S = cost_model.num_stages if num_stages is None else whole_number("num_stages", num_stages)
    if capacity_mib is not None:
        real_number("capacity_mib", capacity_mib, unlimited=True)
    L = model.total_layers
    if not 1 <= S <= L:
        raise DynaPipeError(f"{given('num_stages', S)}: stage placement needs 1 to {L} stages for model "
                            f"{model.name!r}.")
    enc_total = model.encoder_layers if model.is_encoder_decoder else 0
    pricer = _Pricer(cost_model, sample, S, _levels(recompute), capacity_mib, dp, zero)
    # Every state cap a stage can set, lightest first: a tighter cap leaves the planner
    # more activation memory, a looser one lets stages hold more layers.
    caps = sorted({pricer.state_mib(_segment(s, S, p, q, enc_total))
                   for s in range(S) for p in range(L) for q in range(p + 1, L + 1)
                   if (s == 0) == (p == 0) and (s == S - 1) == (q == L)})
    if not np.isfinite(pricer.capacity):
        caps = [np.inf]  # nothing to leave room for: one pass
    tried = [c for c in caps if not (np.isfinite(c) and c >= pricer.capacity)]
    segments = _Segments(pricer, S, L, enc_total, max(tried) if tried else np.inf)
    found = (np.inf, [], np.inf)
    for cap in caps:
        if np.isfinite(cap) and cap >= pricer.capacity:
            break
        bottleneck, cuts = _dp(segments, np.inf, cap)
        if cuts and bottleneck < found[0]:
            found = (bottleneck, cuts, cap)
    bottleneck, cuts, cap = found
    if not cuts:
        raise DynaPipeError(f"no placement of {model.name!r}'s {L} layers on {S} stages fits "
                            f"{pricer.capacity:.0f} MiB per device; use more stages, the distributed optimizer "
                            f"or more memory.")
    # A relative slack so float rounding cannot exclude the split the first pass found.
    _, balanced = _dp(segments, bottleneck * (1 + 1e-12), cap)
    bounds = (balanced or cuts) + [L]
    layouts = [_segment(s, S, bounds[s], bounds[s + 1], enc_total) for s in range(S)]
    placement = StagePlacement(tuple(l.encoder_layers for l in layouts), tuple(l.decoder_layers for l in layouts))
    return _choice(pricer, placement.validate(model))
