"""``bench --model t5``: the runs of one bench, each method on each micro-batch size and placement it tries.

As each baseline keeps its fastest micro-batch size, every method keeps its fastest stage
placement: the bench's placement (what ``auto`` chose, or ``--dynapipe-placement``), the
best contiguous split beside an interleaved one, Megatron's even split, and for a baseline
the contiguous split that balances its own micro-batches. DynaPipe's
even-split run is also reported as its own method, ``dynapipe-even``: the measured before of
the placement. When the bench calibrated its profile, ``dynapipe-uncalibrated`` runs DynaPipe
planned with the measured profile as it was, on the bench's placement: what the calibration
changed, measured side by side. Pure Python.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

from megatron_integration.args_dynapipe import without_unused_dynapipe_flags

T5_METHOD_FLAGS = {
    "dynapipe": ["--use-dynapipe"],
    # DynaPipe on Megatron's even split (its entry carries the split): the measured "before"
    # of the stage placement.
    "dynapipe-even": ["--use-dynapipe"],
    # DynaPipe planned with the profile before calibration (its entry carries that profile).
    "dynapipe-uncalibrated": ["--use-dynapipe"],
    # DynaPipe's rows with each sample's attention computed alone (the padding tails skipped):
    # the same kernel as packing-per-sample's, so the two compare the cut alone.
    "dynapipe-per-sample": ["--use-dynapipe", "--dynapipe-padded-attention", "per-sample"],
    "padding": ["--dynapipe-batching", "padding"],
    "packing": ["--dynapipe-batching", "packing", "--reset-position-ids", "--reset-attention-mask"],
    # The same rows, each sample's attention (encoder, decoder, cross) computed alone.
    "packing-per-sample": ["--dynapipe-batching", "packing", "--reset-position-ids", "--reset-attention-mask",
                           "--dynapipe-packed-attention", "per-sample"],
    # The same per-sample rows packed by the planner and run through the DynaPipe executor with its
    # schedule search: the strongest packing, with DynaPipe's schedule freedom.
    "packing-search": ["--use-dynapipe", "--dynapipe-batching", "packing", "--reset-position-ids",
                       "--reset-attention-mask", "--dynapipe-packed-attention", "per-sample"],
}
T5_BASELINES = ("padding", "packing", "packing-per-sample", "packing-search")
#: Added by the bench itself when it calibrates, not a ``--methods`` choice.
UNCALIBRATED = "dynapipe-uncalibrated"


@dataclass(frozen=True)
class T5Entry:
    """One run of the bench: a method at a micro-batch size (None: DynaPipe's own micro-batches),
    on the bench's stage placement or on ``split`` (a ``--dynapipe-placement`` SPEC: the best
    contiguous split or Megatron's even split, tried so that every method keeps its fastest
    placement; ``split_name`` ends the label). ``extra``: flags after all others (the last
    occurrence of a flag wins). ``also``: the methods this run also stands for (DynaPipe's run
    on a bench placement that is the even split is ``dynapipe-even``'s too)."""

    method: str
    micro_batch_size: Optional[int] = None
    split: Optional[str] = None
    split_name: str = ""
    extra: tuple[str, ...] = ()
    also: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        label = self.method if self.micro_batch_size is None else f"{self.method}@mbs{self.micro_batch_size}"
        return label + (f"-{self.split_name}" if self.split_name else "")

    def argv(self, argv: Sequence[str]) -> list[str]:
        flags = T5_METHOD_FLAGS[self.method]
        # The DynaPipe runs' planner settings are refused by the baselines.
        out = (list(argv) if "--use-dynapipe" in flags else without_unused_dynapipe_flags(argv, True)) + flags
        out += ["--dynapipe-placement", self.split] if self.split else []
        out += ["--micro-batch-size", str(self.micro_batch_size)] if self.micro_batch_size else []
        return out + list(self.extra)


def fastest_interleaved(compared: dict) -> Optional[str]:
    """The interleaved split a placement search's ``compared`` simulated fastest: the planned
    one (``interleaved``) or the even chunks (``interleaved_even``), ms finite first (a split
    nothing fitted on is ``inf``, or ``None`` in JSON); the planned one when neither is finite
    or no times were kept; None when no interleaved split was tried."""
    options = [(compared.get(f"{key}_ms"), compared[key]) for key in ("interleaved", "interleaved_even")
               if compared.get(key)]
    finite = [(ms, split) for ms, split in options if isinstance(ms, (int, float)) and math.isfinite(ms)]
    if finite:
        return min(finite, key=lambda o: o[0])[1]
    return options[0][1] if options else None


def t5_entries(methods: Sequence[str], sweep: Sequence[int], placement: dict,
               uncalibrated_profile: Optional[str] = None) -> list[T5Entry]:
    """Every run: each baseline at every size of ``sweep``; every method on the bench's
    placement (``placement``, see ``_placement``), on the best contiguous split when that
    placement is interleaved (on the faster interleaved one the search compared when it is
    contiguous: a baseline's stages may balance there when DynaPipe's do not), and on
    Megatron's even split when it is not that; each baseline
    size also on its own best contiguous split (``placement["baselines"]``, labelled ``-own``)
    where that is none of these (DynaPipe's
    even-split run is ``dynapipe-even``; on the even split itself DynaPipe runs once, for
    both); with ``uncalibrated_profile`` (the profile the
    bench calibrated) and DynaPipe among ``methods``, also :data:`UNCALIBRATED` on the bench's
    placement."""
    chosen = placement["placement"]
    even = ((placement.get("simulated") or {}).get("even") or {}).get("placement")
    compared = placement.get("search", {}).get("compared") or {}
    contiguous, interleaved = compared.get("contiguous"), fastest_interleaved(compared)
    splits = [(None, "")]
    if "|" in chosen and contiguous and contiguous != even:
        splits.append((contiguous, "contiguous"))
    if "|" not in chosen and interleaved:
        splits.append((interleaved, "interleaved"))
    if even and chosen != even:
        splits.append(("even", "even"))
    # The bench's placement is the even split: one DynaPipe run is both methods' (the same
    # config run twice measured nothing but the machine).
    one_run = even is not None and chosen == even and "dynapipe" in methods
    out = []
    for m in methods:
        if m == "dynapipe-even":
            if not one_run:
                out.append(T5Entry(m, None, "even"))
            continue
        for size in (sweep if m in T5_BASELINES else (None,)):
            own = (placement.get("baselines") or {}).get(f"{m}@mbs{size}")
            # Splits as written ("even" is the even placement's own spelling).
            tried = {chosen, even} | {split for split, _ in splits if split not in (None, "even")}
            extra = [(own, "own")] if own and own not in tried else []
            for split, name in splits + extra:
                if m == "dynapipe" and not name:
                    out.append(T5Entry(m, size, split, name,
                                       also=("dynapipe-even",) if one_run and "dynapipe-even" in methods else ()))
                elif m != "dynapipe" or name != "even":
                    out.append(T5Entry(m, size, split, name))
                elif "dynapipe-even" not in methods:  # else that method's run is this one
                    out.append(T5Entry("dynapipe-even", None, "even"))
    if uncalibrated_profile and "dynapipe" in methods:
        out.append(T5Entry(UNCALIBRATED, extra=("--dynapipe-cost-model", uncalibrated_profile)))
    return out


def best_runs(entries: Sequence[T5Entry], figures: dict, methods: Sequence[str]) -> dict:
    """``method -> (entry, figures)`` of each method's fastest run, in the order of ``methods``
    (``figures``: label ->
    the run's figures, ``real_tokens_per_s`` among them): over its micro-batch sizes and
    placements; DynaPipe's candidates include its even-split run, and a run stands for the
    methods of its ``also`` too."""
    best: dict = {}
    for e in entries:
        candidate_of = {e.method, *e.also} | ({"dynapipe"} if e.method == "dynapipe-even" else set())
        for m in candidate_of & set(methods):
            if m not in best or figures[e.label]["real_tokens_per_s"] > best[m][1]["real_tokens_per_s"]:
                best[m] = (e, figures[e.label])
    return {m: best[m] for m in methods if m in best}
