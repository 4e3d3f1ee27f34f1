"""Megatron-LM's pipeline split of a GPT's layers, as transformer layers per virtual stage.

Megatron-LM's flags, with its meanings (megatron-core builds the stages from the same fields):

- ``--decoder-first-pipeline-num-layers F`` / ``--decoder-last-pipeline-num-layers L``: the
  first (last) pipeline rank holds F (L) layers, the ranks between share the rest evenly.
- ``--account-for-embedding-in-pipeline-split`` / ``--account-for-loss-in-pipeline-split``:
  the embedding (the output layer and loss) counts as one layer of the even split, so the
  first (last) virtual stage builds one transformer layer fewer.
- ``--pipeline-model-parallel-layout``: every virtual stage written out, ``E`` the embedding,
  ``t`` a transformer layer, ``L`` the loss, stages separated by ``|``, ``(...)*n`` and
  ``x*n`` repeating, commas ignored (``"Ettt|(tt|)*2,ttL"``). Its stage count over
  ``--pipeline-model-parallel-size`` is the number of chunks a rank.
- ``--num-virtual-stages-per-pipeline-rank`` / ``--num-layers-per-virtual-pipeline-stage``:
  every rank's layers split evenly over its chunks.

:func:`pipeline_split_from_args` turns them into a :class:`PipelineSplit`: chunks a rank and,
when the split is not Megatron's even one, the layers of every virtual stage (virtual stage
``k`` is chunk ``k // P`` of rank ``k % P``). No torch or megatron import.
"""
from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, replace
from typing import Optional

from dynapipe.errors import DynaPipeError


@dataclass(frozen=True)
class PipelineSplit:
    """How a GPT's transformer layers sit on the pipeline.

    ``chunks``: model chunks a rank (None: one, the plain pipeline). ``layers``: transformer
    layers of every virtual stage in virtual-stage order, or None for Megatron's even split
    (every virtual stage ``num_layers / (P x chunks)``)."""

    chunks: Optional[int] = None
    layers: Optional[tuple[int, ...]] = None
    # --dynapipe-placement auto: the layers are chosen at start-up (placement_auto.resolve_gpt_split).
    auto: bool = False


def pipeline_split_from_args(args: argparse.Namespace, pp: int) -> PipelineSplit:
    """The split Megatron-LM's pipeline flags in ``args`` ask for over ``pp`` ranks, validated as
    Megatron-LM and megatron-core validate it; :class:`DynaPipeError` names the flag otherwise.
    Every virtual stage must hold a transformer layer (the planner prices stages by their layers)."""
    n = args.num_layers
    per_stage, per_rank = args.num_layers_per_virtual_pipeline_stage, args.num_virtual_stages_per_pipeline_rank
    layout = args.pipeline_model_parallel_layout
    first, last = args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
    emb, loss = int(args.account_for_embedding_in_pipeline_split), int(args.account_for_loss_in_pipeline_split)
    given = [f for f, v in (("--num-layers-per-virtual-pipeline-stage", per_stage),
                            ("--num-virtual-stages-per-pipeline-rank", per_rank),
                            ("--pipeline-model-parallel-layout", layout)) if v is not None]
    if len(given) > 1:
        raise DynaPipeError(f"{' and '.join(given)} were all given; give one of them (as in Megatron-LM).")
    uneven = [f for f, v in (("--decoder-first-pipeline-num-layers", first is not None),
                             ("--decoder-last-pipeline-num-layers", last is not None),
                             ("--account-for-embedding-in-pipeline-split", emb),
                             ("--account-for-loss-in-pipeline-split", loss)) if v]
    placement = (getattr(args, "dynapipe_placement", None) or "even").strip()
    if placement not in ("even", "auto"):
        raise DynaPipeError(f"--dynapipe-placement {placement}: a GPT takes even or auto; write a split with "
                            f"Megatron-LM's --pipeline-model-parallel-layout (such as Ettt|tttL) or "
                            f"--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers.")
    if placement == "auto":
        explicit = ([f for f in given if f == "--pipeline-model-parallel-layout"] + uneven)
        if explicit:
            raise DynaPipeError(f"--dynapipe-placement auto and {explicit[0]} were both given; auto chooses the "
                                f"split, {explicit[0]} gives it: drop one.")
        if pp < 2:
            raise DynaPipeError("--dynapipe-placement auto splits the layers over pipeline stages; it needs "
                                "--pipeline-model-parallel-size 2 or more.")
    if layout is not None:
        if uneven:
            raise DynaPipeError(f"--pipeline-model-parallel-layout and {uneven[0]} were both given; the layout "
                                f"places every layer itself, so drop {uneven[0]} (as megatron-core requires).")
        return _checked(layout_layers(layout, pp, n), pp, "--pipeline-model-parallel-layout")
    if (first is not None or last is not None) and (emb or loss):
        raise DynaPipeError(f"{uneven[0]} and {uneven[-1]} were both given; megatron-core takes either the first "
                            f"and last stages' layer counts or the embedding and loss counted as layers, not both.")
    if (first is not None or last is not None) and per_stage is not None:
        raise DynaPipeError("--num-layers-per-virtual-pipeline-stage with an uneven first or last stage: give the "
                            "chunks a rank with --num-virtual-stages-per-pipeline-rank (as Megatron-LM requires).")
    ranks = _rank_layers(n, pp, first, last, emb + loss)
    if per_stage is not None:
        if per_stage < 1:
            raise DynaPipeError(f"--num-layers-per-virtual-pipeline-stage {per_stage}: give at least 1 layer.")
        if ranks[0] % per_stage:
            raise DynaPipeError(f"--num-layers-per-virtual-pipeline-stage {per_stage} does not divide the "
                                f"{ranks[0]} layers of a pipeline stage (--num-layers {n} over "
                                f"--pipeline-model-parallel-size {pp}); use a divisor of {ranks[0]}.")
        chunks = ranks[0] // per_stage
    elif per_rank is not None:
        if per_rank < 1:
            raise DynaPipeError(f"--num-virtual-stages-per-pipeline-rank {per_rank}: give at least 1.")
        chunks = per_rank
    else:
        chunks = 1
    odd = [(p, r) for p, r in enumerate(ranks) if r % chunks]
    if odd:
        p, r = odd[0]
        what = " / ".join(uneven) or "--num-layers"
        raise DynaPipeError(f"--num-virtual-stages-per-pipeline-rank {chunks}: pipeline rank {p} holds {r} layers "
                            f"({what}), which do not split into {chunks} equal chunks; use a number of chunks "
                            f"that divides every rank's layers, or change {what}.")
    layers = [ranks[p] // chunks for c in range(chunks) for p in range(pp)]
    layers[0] -= emb
    layers[-1] -= loss
    split = _checked(layers, pp, uneven[0] if uneven else "--num-layers")
    return replace(split, auto=placement == "auto")


def layout_layers(layout: str, pp: int, num_layers: int) -> list[int]:
    """Transformer layers of every virtual stage of a ``--pipeline-model-parallel-layout`` string
    (Megatron-LM's grammar), checked: ``E`` first, ``L`` last, ``num_layers`` ``t`` in all, a
    multiple of ``pp`` stages."""
    flag = f"--pipeline-model-parallel-layout {layout!r}"
    text = layout.replace(",", "")
    text = re.sub(r"\(([^)]+)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
    text = re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
    stages = text.split("|")
    bad = sorted(set(text) - set("EtL|"))
    if bad:
        hint = " (multi-token prediction layers are not built)" if "m" in bad else ""
        raise DynaPipeError(f"{flag}: unknown symbol {bad[0]!r}{hint}; use E (embedding), t (transformer layer), "
                            f"L (loss), | between stages, (...)*n and x*n to repeat.")
    if len(stages) % pp:
        raise DynaPipeError(f"{flag} has {len(stages)} stages, not a multiple of --pipeline-model-parallel-size "
                            f"{pp}; give {pp} x (chunks a rank) stages.")
    flat = "".join(stages)
    if flat.count("E") != 1 or not stages[0].startswith("E"):
        raise DynaPipeError(f"{flag}: the embedding E must be the first symbol of the first stage, once.")
    if flat.count("L") != 1 or not stages[-1].endswith("L"):
        raise DynaPipeError(f"{flag}: the loss L must be the last symbol of the last stage, once.")
    if flat.count("t") != num_layers:
        raise DynaPipeError(f"{flag} places {flat.count('t')} transformer layers; --num-layers is {num_layers}.")
    return [s.count("t") for s in stages]


def _rank_layers(n: int, pp: int, first: Optional[int], last: Optional[int], extra: int) -> list[int]:
    """Layers (the embedding and loss counted in ``extra``) of every pipeline rank, as megatron-core
    splits them."""
    if first is None and last is None:
        total = n + extra
        if pp > total or total % pp:
            counted = f" plus the {extra} counted for the embedding and loss" if extra else ""
            raise DynaPipeError(f"--num-layers {n}{counted} cannot be split evenly over "
                                f"--pipeline-model-parallel-size {pp}; use a multiple of {pp}, or give "
                                f"--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers.")
        return [total // pp] * pp
    for flag, v in (("--decoder-first-pipeline-num-layers", first), ("--decoder-last-pipeline-num-layers", last)):
        if v is not None and v < 1:
            raise DynaPipeError(f"{flag} {v}: must be at least 1.")
    if pp < 2:
        raise DynaPipeError("--decoder-first/last-pipeline-num-layers need --pipeline-model-parallel-size 2 or more.")
    rest = n - (first or 0) - (last or 0)
    middle = pp - (first is not None) - (last is not None)
    if rest < 0:
        given = " + ".join(str(v) for v in (first, last) if v is not None)
        raise DynaPipeError(f"--decoder-first/last-pipeline-num-layers give the first and last stages {given} layers, "
                            f"more than --num-layers {n}; lower them or raise --num-layers.")
    if (middle == 0 and rest) or (middle and rest % middle):
        raise DynaPipeError(f"--num-layers {n} minus the first and last stages' layers leaves {rest} for the "
                            f"{middle} other pipeline ranks, which does not split evenly; change "
                            f"--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers.")
    mid = rest // middle if middle else 0
    ranks = [mid] * pp
    if first is not None:
        ranks[0] = first
    if last is not None:
        ranks[-1] = last
    return ranks


def megatron_layout(stage_layers: tuple[int, ...]) -> list[list[str]]:
    """megatron-core's ``pipeline_model_parallel_layout`` (one list a virtual stage, in virtual-stage
    order) holding ``stage_layers[k]`` transformer layers on virtual stage ``k``, the embedding on
    the first and the loss on the last: every uneven split Megatron's flags ask for, built one way."""
    layout = [["decoder"] * n for n in stage_layers]
    layout[0].insert(0, "embedding")
    layout[-1].append("loss")
    return layout


def stage_layer_count(parallel, num_layers: int, pp_rank: int, vp_stage: Optional[int]) -> int:
    """Transformer layers megatron-core builds on chunk ``vp_stage`` (None: the only one) of
    pipeline rank ``pp_rank`` under ``parallel`` (a ``ParallelArgs``)."""
    chunks = parallel.virtual_pipeline_model_parallel_size or 1
    if parallel.stage_layers is None:
        return num_layers // (parallel.pipeline_model_parallel_size * chunks)
    return parallel.stage_layers[(vp_stage or 0) * parallel.pipeline_model_parallel_size + pp_rank]


def _checked(layers: list[int], pp: int, flag: str) -> PipelineSplit:
    chunks = len(layers) // pp
    empty = [k for k, v in enumerate(layers) if v < 1]
    if empty:
        k = empty[0]
        raise DynaPipeError(f"{flag}: virtual stage {k} (rank {k % pp}, chunk {k // pp}) would hold no transformer "
                            f"layer; this build needs one on every stage (DynaPipe prices stages by their layers). "
                            f"Give the stages more layers.")
    even = len(set(layers)) == 1
    return PipelineSplit(chunks if chunks > 1 else None, None if even else tuple(layers))
