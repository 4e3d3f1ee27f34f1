"""Plan the micro-batches of one global batch with any batching method.

:func:`plan_micro_batches` is the single entry point: it validates the lengths,
truncates them at ``seq_length`` if asked, forms micro-batches with the chosen method,
prices them with the cost model (time of the bottleneck stage, activation memory),
balances them across data-parallel replicas and reports the objective
``T = sum(time_ms) / dp + (stages - 1) * max(time_ms)``.
"""
from __future__ import annotations

import time
from dataclasses import replace
from typing import NamedTuple, Optional

import numpy as np

from dynapipe.batching import baselines
from dynapipe.batching.balance import balance_replicas, replica_times, split_to_balance
from dynapipe.batching.candidates import build_candidate_table
from dynapipe.batching.dp_partition import DEFAULT_GAP, optimal_partition
from dynapipe.batching.lengths import validate_lengths
from dynapipe.batching.memory import MemoryBudget, memory_budget
from dynapipe.batching.ordering import named_candidate_orders
from dynapipe.batching.types import BatchPlan, LengthLimit, MicroBatch
from dynapipe.cost import CostModel
from dynapipe.cost.attention_density import packed_density, stack
from dynapipe.cost.base import check_recompute, require_cost_model
from dynapipe.errors import DynaPipeError, flag, given

METHODS = ("dynapipe", "dynapipe-per-sample", "padding", "padding-mb", "packing", "packing-per-sample", "token-budget")
#: The methods whose micro-batches the DP cuts: ``dynapipe-per-sample`` runs each row's
#: attention on its sample alone (a varlen kernel skips the padding tail), and its cut is
#: priced at the attention each candidate computes.
DP_METHODS = ("dynapipe", "dynapipe-per-sample")


def check_method(method: str, max_tokens: Optional[int] = None) -> None:
    """Refuse a batching ``method`` that is not one of :data:`METHODS`, and a ``max_tokens``
    (padded tokens a micro-batch; None or 0: not given) it would not read (only
    ``token-budget`` does)."""
    if method not in METHODS:
        raise DynaPipeError(f"{given('method', method)} is not a batching method; use one of {', '.join(METHODS)}.")
    if max_tokens and method != "token-budget":
        raise DynaPipeError(f"{given('max_tokens', max_tokens)}: {given('method', method)} does not read it (only "
                            f"token-budget does); leave it out or use {given('method', 'token-budget')}.")


def _positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise DynaPipeError(f"{given(name, value)} must be a positive integer.")
    return int(value)


class _Limits(NamedTuple):
    """The length limits in force (tokens): ``cap`` of a sample (an encoder-decoder input),
    ``dec_cap`` of an encoder-decoder target (None for decoder-only), and whether the target's
    was given on its own (the fixed-shape baselines then pad targets to it, as Megatron's
    ``--decoder-seq-length``)."""

    cap: int
    dec_cap: Optional[int]
    dec_given: bool


def _over_model(side: np.ndarray, lengths: np.ndarray, model_max: int, name: str) -> None:
    too_long = np.flatnonzero(side > model_max)
    if len(too_long):
        i = int(too_long[0])
        raise DynaPipeError(
            f"sample {i} has length {lengths[i].tolist()} tokens, more than the model's max_seq_length "
            f"{model_max} ({len(too_long)} sample(s) in all); pass {given(name, model_max)} to truncate them.")


def _limit(value, name: str, model_max: int) -> int:
    value = _positive_int(value, name)
    if value > model_max:
        raise DynaPipeError(f"{given(name, value)} exceeds the model's max_seq_length {model_max}; use at most "
                            f"{model_max}.")
    return value


def _limit_lengths(lengths: np.ndarray, seq_length: Optional[LengthLimit],
                   model_max: int) -> tuple[np.ndarray, _Limits, int]:
    """Truncate each side at its limit where one is given; a side without one must fit the
    model's maximum.

    ``seq_length``: None, one limit for every side (tokens), or an (input, target) pair for an
    encoder-decoder model (either may be None). Returns the lengths, the limits in force and
    how many samples were cut.
    """
    pair = isinstance(seq_length, (tuple, list))
    if pair and (lengths.ndim != 2 or len(seq_length) != 2):
        raise DynaPipeError(f"seq_length {tuple(seq_length)!r}: an (input, target) pair of limits is for "
                            f"encoder-decoder models, whose lengths are (input, target) pairs; give one length.")
    if not pair:
        if seq_length is None:
            _over_model(lengths.reshape(len(lengths), -1).max(axis=1), lengths, model_max, "seq_length")
            return lengths, _Limits(model_max, model_max if lengths.ndim == 2 else None, False), 0
        cap = _limit(seq_length, "seq_length", model_max)
        cut = int((lengths.reshape(len(lengths), -1) > cap).any(axis=1).sum())
        return np.minimum(lengths, cap), _Limits(cap, cap if lengths.ndim == 2 else None, False), cut
    caps = []
    for side, (value, name) in enumerate(zip(seq_length, ("seq_length[0]", "seq_length[1]"))):
        if value is None:
            _over_model(lengths[:, side], lengths, model_max, name)
        caps.append(model_max if value is None else _limit(value, name, model_max))
    cut = int((lengths > np.array(caps)).any(axis=1).sum())
    return np.minimum(lengths, np.array(caps)), _Limits(caps[0], caps[1], seq_length[1] is not None), cut


def _set_real_tokens(lengths: np.ndarray, mbs: list[MicroBatch]) -> None:
    per_sample = lengths.reshape(len(lengths), -1).sum(axis=1)
    sizes = np.array([len(mb.samples) for mb in mbs])
    flat = np.fromiter((i for mb in mbs for i in mb.samples), dtype=np.int64, count=int(sizes.sum()))
    sums = np.add.reduceat(per_sample[flat], np.cumsum(sizes) - sizes)
    for mb, tokens in zip(mbs, sums.tolist()):
        mb.real_tokens = tokens


def _plan_dynapipe(lengths: np.ndarray, cost_model: CostModel, budget: MemoryBudget, dp: int, recompute: str,
                   limits: _Limits, use_compiled: Optional[bool], gap: float,
                   split: bool, per_sample: bool = False) -> tuple[list[MicroBatch], dict]:
    """The exact DP cut of each candidate order, then (``split``, ``dp`` > 1) its split for
    balance; the order with the lowest objective (with ``split``, of the replicas as
    balanced) wins. ``per_sample``: rows run attention on their sample alone; each
    micro-batch then lists its one-sample rows and carries its attention density."""
    best = None
    stages = cost_model.num_stages
    for name, order in named_candidate_orders(lengths):
        table = build_candidate_table(lengths[order], order, cost_model, budget, recompute, limits.cap, limits.dec_cap,
                                      per_sample=per_sample)
        part = optimal_partition(table, stages, dp, use_compiled=use_compiled, gap=gap)
        cuts, splits, value = part.cuts, 0, part.objective_ms
        if split and dp > 1:
            cuts, splits, value = split_to_balance(cuts, lambda s, e: _table_time(table, s, e), dp, stages)
        if best is None or value < best[0]:
            best = (value, name, order, part, table, cuts, splits)
    _, name, order, part, table, cuts, splits = best
    mbs = []
    for start, end in cuts:
        e = table.entry(end, end - start)
        samples = order[start:end].tolist()
        seq, dec = int(table.seqlen[e]), int(table.dec_seqlen[e])
        rows = [[i] for i in samples] if per_sample else None
        mbs.append(MicroBatch(samples=samples, seqlen=seq, dec_seqlen=dec, rows=rows,
                              time_ms=float(table.time_ms[e]), stored_mib=float(table.stored_mib[e]),
                              peak_mib=float(table.peak_mib[e]),
                              attention=packed_density(lengths, rows, seq, dec) if per_sample else None))
    extra = {"order": name, "dp_evaluations": part.evaluations, "dp_candidates": part.candidates,
             "dp_kernel": part.kernel, "balance_splits": splits}
    return mbs, extra


def _table_time(table, start: int, end: int) -> Optional[float]:
    """Time of positions ``start .. end - 1`` as one micro-batch (ms); ``None`` if not a candidate."""
    try:
        t = float(table.time_ms[table.entry(end, end - start)])
    except IndexError:
        return None
    return t if np.isfinite(t) else None


def _price(mbs: list[MicroBatch], cost_model: CostModel, recompute: str) -> None:
    counts = np.array([mb.mbs for mb in mbs])
    seq = np.array([mb.seqlen for mb in mbs])
    dec = np.array([mb.dec_seqlen for mb in mbs]) if cost_model.model.is_encoder_decoder else None
    c = cost_model.stage_cost(counts, seq, dec, recompute=recompute, attention=stack([mb.attention for mb in mbs]))
    for i, mb in enumerate(mbs):
        mb.time_ms = float(c.time_ms[i])
        mb.stored_mib = float(c.stored_mib[i])
        mb.peak_mib = float(c.peak_mib[i])


def plan_micro_batches(lengths, cost_model: CostModel, *, method: str = "dynapipe", dp: int = 1,
                       memory_limit_mib: Optional[float] = None, reserved_mib: float = 0.0,
                       micro_batch_size: int = 1, seq_length: Optional[LengthLimit] = None,
                       max_tokens: Optional[int] = None, recompute: str = "none",
                       zero: bool = False, use_compiled: Optional[bool] = None,
                       gap: float = DEFAULT_GAP, split_to_balance: bool = True,
                       micro_batch_share: float = 1.0) -> BatchPlan:
    """Micro-batches of one global batch, priced, balanced over ``dp`` replicas.

    ``lengths``: ``(n,)`` tokens (decoder-only) or ``(n, 2)`` input and target tokens
    (encoder-decoder); at least ``dp`` of them. ``method``: one of :data:`METHODS`
    (what this docstring says of ``dynapipe`` holds for each of :data:`DP_METHODS`). ``memory_limit_mib`` (MiB per
    device; ``None`` = unlimited) minus ``reserved_mib`` minus the model states of the
    most loaded stage is what a micro-batch's stored + peak activations may use; the
    ``dynapipe`` method honours it (raising :class:`DynaPipeError` for a sample that
    cannot fit alone), baselines report ``extra["over_memory_micro_batches"]``.
    ``seq_length`` truncates samples (tokens; each side for encoder-decoder, or an (input,
    target) pair of limits, either None) and is the row length of ``padding``/``packing``
    (default: the model's ``max_seq_length``); a target limit given in a pair is the length the
    fixed-shape baselines pad targets to, as Megatron's ``--decoder-seq-length`` (without one,
    the longest target's).
    ``micro_batch_size`` (samples, or rows for packing) is used by the fixed-size
    baselines (the DP methods refuse one other than 1); ``max_tokens`` (padded tokens a
    micro-batch, input and target together; default ``micro_batch_size x seq_length``, for
    encoder-decoder models ``micro_batch_size x`` (input limit + target limit)) by
    ``token-budget`` only (the others refuse one). ``zero`` shards optimizer
    state over the ``dp`` replicas when pricing model states. ``use_compiled`` selects the
    DP kernel (``None``: C when built). ``gap``: relative optimality gap of the
    ``dynapipe`` cut's objective (0: exact; default :data:`DEFAULT_GAP`, 0.1%).
    ``split_to_balance``: with ``dp`` > 1, split the ``dynapipe`` cut's micro-batches where
    too few of them leave a replica waiting (:func:`~dynapipe.batching.balance.split_to_balance`;
    ``extra["balance_splits"]`` counts them); off, the plan is the DP's cut as it is.
    ``micro_batch_share`` (0 < share <= 1): a ``dynapipe`` micro-batch of two or more
    samples may use this share of the activation budget (a sample alone all of it), to
    leave room for the micro-batches a pipeline holds at once; the baselines' fixed shapes
    ignore it.
    """
    start = time.perf_counter()
    check_method(method, max_tokens)
    dp = _positive_int(dp, "dp")
    micro_batch_size = _positive_int(micro_batch_size, "micro_batch_size")
    # A size the method would not read is refused, not planned as if it had not been given.
    if method in DP_METHODS and micro_batch_size != 1:
        raise DynaPipeError(f"{given('micro_batch_size', micro_batch_size)}: {given('method', method)} sizes every "
                            f"micro-batch itself and does not read it; leave it out, or use a fixed-size method "
                            f"(padding, padding-mb, packing, packing-per-sample) or token-budget.")
    check_recompute(recompute)
    require_cost_model(cost_model)
    flag("zero", zero)
    flag("split_to_balance", split_to_balance)
    model = cost_model.model
    arr = validate_lengths(lengths, model.is_encoder_decoder)
    if dp > len(arr):
        # A replica needs a sample; past the batch size the balance only multiplies empty
        # replicas, at a cost that grows with dp until planning stalls.
        raise DynaPipeError(f"{given('dp', dp)} exceeds the {len(arr)} sample(s) of the global batch, so "
                            f"{dp - len(arr)} replica(s) would get no sample; use {given('dp', len(arr))} or less, or "
                            f"a batch of at least "
                            f"{dp} samples.")
    arr, limits, truncated = _limit_lengths(arr, seq_length, model.max_seq_length)
    cap = limits.cap
    fixed_dec = limits.dec_cap if limits.dec_given else None
    if isinstance(gap, bool) or not isinstance(gap, (int, float)) or not 0.0 <= gap < 1.0:
        raise DynaPipeError(f"gap {gap!r}: the relative optimality gap of the cut must lie in [0, 1) "
                            f"(0: the exact optimum; default {DEFAULT_GAP}).")
    if isinstance(micro_batch_share, (bool, np.bool_)) or not isinstance(micro_batch_share, (int, float, np.number)) \
            or not 0.0 < micro_batch_share <= 1.0:
        raise DynaPipeError(f"micro_batch_share {micro_batch_share!r}: must be a number in (0, 1] (the share of the "
                            f"activation budget a micro-batch of two or more samples may use).")
    budget = replace(memory_budget(cost_model, memory_limit_mib, reserved_mib, dp=dp, zero=zero),
                     micro_batch_share=float(micro_batch_share))
    extra: dict = {"activation_budget_mib": budget.activation_mib, "model_state_mib": budget.model_state_mib,
                   "seq_length": cap, "truncated_samples": truncated}
    if limits.dec_cap is not None:
        extra["dec_seq_length"] = limits.dec_cap

    if method in DP_METHODS:
        if method == "dynapipe-per-sample" and not cost_model.prices_attention_density:
            raise DynaPipeError(f"{given('method', method)} prices each micro-batch's per-sample attention, "
                                f"which {type(cost_model).__name__} cannot (it prices dense attention only); use "
                                f"the analytic or a profile cost model, or {given('method', 'dynapipe')}.")
        extra["micro_batch_share"] = budget.micro_batch_share
        mbs, more = _plan_dynapipe(arr, cost_model, budget, dp, recompute, limits, use_compiled, gap, split_to_balance,
                                   per_sample=method == "dynapipe-per-sample")
        extra.update(more)
    else:
        if method == "padding":
            mbs = baselines.padding(arr, micro_batch_size, cap, fixed_dec)
        elif method == "padding-mb":
            mbs = baselines.padding_to_longest(arr, micro_batch_size, cap, limits.dec_cap)
        elif method in ("packing", "packing-per-sample"):
            mbs, pairs = baselines.packing(arr, micro_batch_size, cap, fixed_dec,
                                           per_sample=method == "packing-per-sample")
            # What masked rows compute and discard; per-sample attention computes none of it.
            extra["cross_sample_attention_pairs"] = pairs
        else:
            # A sample's padded shape counts both sides for encoder-decoder models (each up to its limit).
            shape = cap + (limits.dec_cap or 0)
            tokens = micro_batch_size * shape if max_tokens is None else _positive_int(max_tokens, "max_tokens")
            extra["max_tokens"] = tokens
            mbs = baselines.token_budget(arr, tokens, cap, limits.dec_cap)
        _price(mbs, cost_model, recompute)
        extra["over_memory_micro_batches"] = sum(mb.stored_mib + mb.peak_mib > budget.activation_mib for mb in mbs)

    _set_real_tokens(arr, mbs)
    times = [mb.time_ms for mb in mbs]
    for mb, r in zip(mbs, balance_replicas(times, dp)):
        mb.replica = r
    per_replica = replica_times(times, [mb.replica for mb in mbs], dp)
    extra["replica_spread_ms"] = max(per_replica) - min(per_replica)
    extra["empty_replicas"] = dp - len({mb.replica for mb in mbs})
    plan = BatchPlan(batching=method, micro_batches=mbs, num_stages=cost_model.num_stages, dp=dp,
                     objective_ms=0.0, padding_efficiency=0.0, replica_time_ms=per_replica, extra=extra)
    plan.objective_ms = plan.compute_objective_ms()
    plan.padding_efficiency = plan.compute_padding_efficiency()
    plan.planning_ms = (time.perf_counter() - start) * 1e3
    return plan
