"""DynaPipe against tuned baselines at cluster scale, simulated with the project's own planner.

For each case (model, pipeline stages x data-parallel replicas, sequence length) a few
global batches of ``--tokens`` tokens are drawn from the synthetic FLAN-like mixture and
every method is planned and simulated on the same batches with the analytic cost model
of ``--device`` and the links of ``--cluster`` (see :mod:`dynapipe.method_compare`):

* ``dynapipe``: DP-cut micro-batches and the schedule search;
* ``dynapipe-1f1b``: the same micro-batches under plain 1F1B (cutting alone);
* ``dynapipe-per-sample``: DynaPipe with a varlen kernel on its own rows (each row's padding
  tail computes no attention), its cut priced so: against ``packing-per-sample`` and
  ``packing-search`` the like-for-like method, both sides on the same kernel;
* ``packing``: best micro-batch size (rows), 1F1B, lightest uniform recompute that fits;
  rows isolated by Megatron's per-sample mask, so attention spans every row densely;
* ``packing-per-sample``: the same, rows run with attention on each sample alone (a varlen
  kernel, as Transformer Engine's THD format gives packing on a GPU), priced at the pairs
  inside samples: the strongest packing, and the ``vs per-sample packing`` column's base;
* ``packing-search``: per-sample packing's micro-batches with DynaPipe's schedule search: the
  strongest packing, with the same schedule freedom as DynaPipe;
* ``padding`` and ``padding-mb``: Megatron's padding to the sequence length, and padding
  each micro-batch to its longest sample, tuned like packing.

Encoder-decoder cases run every method on the stage placement the planner chooses on
other batches of the mixture, contiguous or interleaved, whichever DynaPipe's simulation
of those batches finds faster (:func:`dynapipe.schedule.placement.choose_placement_kind`);
each baseline also runs on the placement chosen the same way for its own micro-batches (its
batching at its tuned size, under its own schedule) and keeps the faster of the two
(``placement`` and ``splits_tried`` in its row);
``dynapipe-even-split`` is DynaPipe on Megatron's even split, the before. Cases with
chunks run every method on Megatron's interleaved split (GPT's
``--num-virtual-stages-per-pipeline-rank``); ``dynapipe-one-chunk`` is DynaPipe without them.

A baseline's micro-batch size is tuned once per case (the size with the best real
tokens/s over all its batches). ``compute_over_floor``: a method's compute over the batches'
compute floor (:mod:`dynapipe.cost.compute_floor`), how much of its compute the cut wastes.
Writes JSON and a Markdown table; prints the table.

Layers are priced as megatron-core's local ones (unfused attention, dropout 0.1) with a
backward the zero-bubble schedules can split; ``--fused-attention --no-split-backward`` prices
Transformer Engine's (flash or fused attention keeps no score matrix; its backward does not split).

    python scripts/bench_cluster.py                       # every case, 3 batches each (about 2.5 min on 2 cores)
    python scripts/bench_cluster.py --quick               # one case, one batch (seconds)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, replace

# Runnable as `python scripts/bench_cluster.py` from the repository root.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dynapipe.batching import plan_micro_batches  # noqa: E402
from dynapipe.config import (TensorParallelConfig, load_cluster_config, load_device_config,  # noqa: E402
                             load_model_config)
from dynapipe.advise import trained_model  # noqa: E402
from dynapipe.cost import build_cost_model  # noqa: E402
from dynapipe.cost.compute_floor import floor_over_batches, shapes_compute_ms  # noqa: E402
from dynapipe.errors import DynaPipeError, spelled_by  # noqa: E402
from dynapipe.method_compare import (SIZED_METHODS, BatchesResult, compare_over_batches,  # noqa: E402
                                     global_batch_of_tokens, method_cut, plan_shapes)
from dynapipe.pipeline_planner import plan_iteration  # noqa: E402
from dynapipe.schedule.placement import choose_placement_kind  # noqa: E402
from dynapipe.cost.chunked_placement import even_chunked_placement  # noqa: E402
from dynapipe.argparsing import StrictArgumentParser, print_error  # noqa: E402
from dynapipe.output_paths import check_distinct, check_output_file, write_output  # noqa: E402

METHODS = ("dynapipe", "dynapipe-1f1b", "dynapipe-per-sample", "packing", "packing-per-sample", "packing-search", "padding", "padding-mb")
# The DynaPipe paper (EuroSys 2024), best reported speed-up over packing on FLANv2.
PAPER_SPEEDUP = {"gpt": 3.25, "t5": 4.39}


@dataclass(frozen=True)
class Case:
    """One simulated configuration. ``zero``: Megatron's distributed optimizer (as the
    shipped run config for that model uses)."""

    model: str
    stages: int
    dp: int
    seq_length: int
    zero: bool = False
    tp: int = 1  # tensor-parallel ranks per stage (inside a node); figures are per TP rank
    # Model chunks a rank on Megatron's even interleaved split (GPT's --num-virtual-stages-per-pipeline-rank);
    # every method then runs interleaved 1F1B (DynaPipe: or its adaptive interleaved schedule).
    chunks: int = 1

    @property
    def label(self) -> str:
        tp = f"TP{self.tp} x " if self.tp > 1 else ""
        chunks = f", {self.chunks} chunks a rank (interleaved)" if self.chunks > 1 else ""
        return f"{self.model} {tp}PP{self.stages} x DP{self.dp}, seq {self.seq_length}{chunks}"


CASES = (
    # At 4,096 tokens packing's one-row micro-batch needs 19 MiB more on the last stage than
    # 40 GB leave beside 7B's model states at PP4, even under full recompute: the distributed
    # optimizer for every method, as for 13B.
    Case("gpt-7b", 4, 2, 2048), Case("gpt-7b", 4, 2, 4096, zero=True),
    Case("gpt-7b", 8, 2, 2048), Case("gpt-7b", 8, 2, 4096),
    # 13B's model states need the distributed optimizer on 40 GB at PP8 (configs/runs/gpt-13b-pp8-dp2-a100-40gb.yaml).
    Case("gpt-13b", 8, 2, 4096, zero=True),
    # T5-11B's decoder layers (269M parameters each) need the distributed optimizer too, or
    # their states leave the decoder stages no room for the layers a balanced split gives them.
    Case("t5-11b", 8, 2, 2048, zero=True),
    # 13B with TP inside a node, as configs/runs/gpt-13b-tp2-pp4-dp2-a100-40gb.yaml runs it.
    Case("gpt-13b", 4, 2, 4096, zero=True, tp=2),
    # The same 16 GPUs as t5-11b PP8 x DP2, half the stages each split over two GPUs of a node.
    Case("t5-11b", 4, 2, 2048, zero=True, tp=2),
    # The PP8 GPT cases at 4,096 tokens on Megatron's interleaved split: 4 chunks of 1 layer a rank (7b),
    # 5 of 1 (13b): the most interleaving Megatron allows, the strongest for packing here.
    Case("gpt-7b", 8, 2, 4096, chunks=4), Case("gpt-13b", 8, 2, 4096, zero=True, chunks=5),
)
QUICK_CASES = (Case("gpt-7b", 4, 2, 2048),)


def mean_compute_ms(batches, cost, method: str, micro_batch_size, encdec: bool, **kwargs) -> float:
    """``method``'s forward + backward ms per batch, summed over every stage (recompute none:
    the cost of the cut alone, to set against the compute floor). Baselines at their tuned
    micro-batch size; DynaPipe's micro-batches as it plans them."""
    total = 0.0
    for b in batches:
        if method == "dynapipe":
            shapes = plan_shapes(plan_iteration(b, cost, **kwargs), encdec)
        else:
            if method == "dynapipe-per-sample":
                mbs = plan_iteration(b, cost, method=method, **kwargs).batch_plan.micro_batches
            else:
                mbs = plan_micro_batches(b, cost, method=method, micro_batch_size=micro_batch_size,
                                         seq_length=kwargs["seq_length"]).micro_batches
            shapes = [(mb.mbs, mb.seqlen, mb.dec_seqlen) if encdec else (mb.mbs, mb.seqlen) for mb in mbs]
            total += shapes_compute_ms(cost, shapes, attention=[mb.attention for mb in mbs])
            continue
        total += shapes_compute_ms(cost, shapes)
    return total / len(batches)


def own_placement(sample, even_cost, method: str, tuned: BatchesResult, case: Case, cluster, kwargs):
    """The placement (a :class:`~dynapipe.schedule.placement.PlacementPlan`) chosen for
    ``method``'s own micro-batches of ``sample``: its batching at the size it was tuned to on
    DynaPipe's placement, contiguous or interleaved as its simulation under its own schedule
    (1F1B for the fixed-shape baselines) finds faster."""
    cut, schedule = method_cut(method, tuned.micro_batch_size)
    return choose_placement_kind(sample, even_cost, dp=case.dp, seq_length=case.seq_length, zero=case.zero,
                                 cluster=cluster, split_backward=kwargs["split_backward"], cut=cut,
                                 schedule=schedule)


def run_case(case: Case, args) -> dict:
    """Every method on the case's batches; the JSON record of the case."""
    # The vocabulary as Megatron-LM trains it at the case's TP size (padded to 128 x TP), as
    # the layout advisor prices it.
    model = trained_model(replace(load_model_config(case.model), fused_attention=args.fused_attention), case.tp)
    device, cluster = load_device_config(args.device), load_cluster_config(args.cluster)
    tp = TensorParallelConfig(case.tp, False, cluster.intra_node) if case.tp > 1 else None
    cost = build_cost_model(model, device, case.stages, None, tp)
    batches = [global_batch_of_tokens(args.tokens, args.seed + b, case.seq_length, model.is_encoder_decoder)
               for b in range(args.batches)]
    fewest = min(len(b) for b in batches)
    if fewest < case.dp:
        raise DynaPipeError(f"--tokens {args.tokens} draws a global batch of {fewest} sample(s), fewer than the "
                            f"{case.dp} data-parallel replicas of {case.label}; use --tokens "
                            f"{case.dp * case.seq_length} or more.")
    kwargs = dict(dp=case.dp, seq_length=case.seq_length, cluster=cluster, zero=case.zero, tp=case.tp,
                  split_backward=not args.no_split_backward)
    placement, sample = None, None
    if model.is_encoder_decoder:
        # Layers per stage chosen on batches drawn apart from the measured ones (other seeds),
        # then used by every method; DynaPipe on the even split is kept as the before.
        sample = [global_batch_of_tokens(args.tokens, args.seed + 1000 + b, case.seq_length, True)
                  for b in range(args.batches)]
        # Contiguous or interleaved (encoder and decoder chunks on every stage): the faster
        # in DynaPipe's simulation of the sample batches.
        placement = choose_placement_kind(sample, cost, dp=case.dp, seq_length=case.seq_length, zero=case.zero,
                                          cluster=cluster, split_backward=kwargs["split_backward"])
        even_cost, cost = cost, placement.cost_model
    elif case.chunks > 1:
        # Every method on the chunks; DynaPipe on one chunk a rank is kept as the before.
        even_cost, cost = cost, cost.with_placement(even_chunked_placement(cost, case.chunks))
    # Compile the simulator kernels and fill caches outside the timed planning.
    plan_iteration(batches[0], cost, **kwargs)
    results: dict[str, BatchesResult] = {}
    priced_by: dict[str, object] = {}  # the cost model (placement) each method ran on, when not `cost`'s
    own_placements: dict[str, str] = {}
    tried: dict[str, dict] = {}  # a baseline's real tokens/s on each split it ran on
    for method in args.methods:
        results[method] = compare_over_batches(batches, method, cost, **kwargs)
        if placement is not None and method in SIZED_METHODS:
            # A split chosen for DynaPipe's micro-batches need not suit a baseline's.
            tried[method] = {str(placement.chosen.placement): round(results[method].real_tokens_per_s, 1)}
            try:
                own = own_placement(sample, even_cost, method, results[method], case, cluster, kwargs)
                own_result = compare_over_batches(batches, method, own.cost_model, **kwargs)
            except DynaPipeError as e:  # nothing fits on its own split: it keeps DynaPipe's
                tried[method]["own split"] = str(e)
                continue
            tried[method][str(own.chosen.placement)] = round(own_result.real_tokens_per_s, 1)
            if own_result.real_tokens_per_s > results[method].real_tokens_per_s:
                results[method], priced_by[method] = own_result, own.cost_model
                own_placements[method] = str(own.chosen.placement)
    ref = results.get("packing")
    ref_per_sample = results.get("packing-per-sample")
    ref_search = results.get("packing-search")
    # The before: DynaPipe on Megatron's even split (encoder-decoder), or on one chunk a rank.
    before = "dynapipe-even-split" if placement is not None else "dynapipe-one-chunk"
    if (placement is not None or case.chunks > 1) and "dynapipe" in args.methods:
        results[before] = compare_over_batches(batches, "dynapipe", even_cost, **kwargs)
    rows = {}
    floors: dict[int, float] = {}  # one compute floor per cost model (the placed one, the even split)
    for name, res in results.items():
        row = res.summary()
        if ref is not None:
            row["vs_packing"] = round(res.real_tokens_per_s / ref.real_tokens_per_s, 3)
        if ref_per_sample is not None:
            row["vs_packing_per_sample"] = round(res.real_tokens_per_s / ref_per_sample.real_tokens_per_s, 3)
        if ref_search is not None:
            row["vs_packing_search"] = round(res.real_tokens_per_s / ref_search.real_tokens_per_s, 3)
        method = "dynapipe" if name == before else name
        if placement is not None:
            row["placement"] = own_placements.get(name, str(placement.chosen.placement) if name != before
                                                  else str(even_cost.placement))
            if name in tried:
                row["splits_tried"] = tried[name]
        if method in ("dynapipe", "dynapipe-per-sample", "packing", "packing-per-sample", "padding", "padding-mb"):
            priced = even_cost if name == before else priced_by.get(name, cost)
            if id(priced) not in floors:
                floors[id(priced)] = floor_over_batches(priced, batches)
            row["compute_over_floor"] = round(mean_compute_ms(
                batches, priced, method, res.micro_batch_size, model.is_encoder_decoder, **kwargs)
                / floors[id(priced)], 3)
        if res.sweep:
            row["sweep"] = res.sweep
        rows[name] = row
    return {"case": case.label, "model": case.model, "stages": case.stages, "dp": case.dp, "tp": case.tp,
            "seq_length": case.seq_length, "distributed_optimizer": case.zero, "chunks": case.chunks,
            "samples_per_batch": [len(b) for b in batches],
            "real_tokens_per_batch": [int(b.sum()) for b in batches], "methods": rows,
            "placement": placement.to_json() if placement is not None else None,
            "paper_speedup_vs_packing": PAPER_SPEEDUP["t5" if model.is_encoder_decoder else "gpt"]}


def markdown(records: list[dict]) -> str:
    """One table: a row per (case, method)."""
    lines = ["| case | method | mbs | recompute | schedule | iteration (ms) | real tokens/s | vs packing "
             "| vs per-sample packing | vs per-sample packing + search | bubble | padding eff. | attention share "
             "| compute / floor | planning (ms) |",
             "|---|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for rec in records:
        for name, r in rec["methods"].items():
            mbs = "-" if r["micro_batch_size"] is None else str(r["micro_batch_size"])
            vs = f"{r['vs_packing']:.2f}x" if "vs_packing" in r else "-"
            vs2 = f"{r['vs_packing_search']:.2f}x" if "vs_packing_search" in r else "-"
            vs3 = f"{r['vs_packing_per_sample']:.2f}x" if "vs_packing_per_sample" in r else "-"
            floor = f"{r['compute_over_floor']:.2f}x" if "compute_over_floor" in r else "-"
            lines.append(f"| {rec['case']} | {name} | {mbs} | {'/'.join(r['recompute'])} | "
                         f"{'/'.join(r['schedule'])} | {r['iteration_ms']:,.0f} | {r['real_tokens_per_s']:,.0f} | "
                         f"{vs} | {vs3} | {vs2} | {r['bubble_fraction']:.2f} | {r['padding_efficiency']:.2f} | "
                         f"{r['attention_share']:.3f} | {floor} | {r['planning_ms']:.1f} |")
    return "\n".join(lines)


# The planning layers' errors name this script's flags where it has them (the cases fix the rest).
SPELLING = {"tokens": "--tokens", "seed": "--seed"}


@spelled_by(SPELLING)  # the planning layers' errors name this script's flags
def main(argv=None) -> int:
    p = StrictArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output", default="out/bench_cluster.json", help="JSON results (default %(default)s)")
    p.add_argument("--markdown", default=None, help="Markdown table (default: the JSON path with .md)")
    p.add_argument("--batches", type=int, default=None, help="global batches per case (default 3; 1 with --quick)")
    p.add_argument("--tokens", type=int, default=65536, help="tokens per global batch (default 65,536)")
    p.add_argument("--seed", type=int, default=0, help="seed of the first batch (default 0)")
    p.add_argument("--device", default="a100-40gb")
    p.add_argument("--cluster", default="a100-8x")
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated, from " + ", ".join(METHODS))
    p.add_argument("--quick", action="store_true",
                   help="one case (gpt-7b PP4 x DP2, seq 2048), one batch unless --batches says otherwise")
    p.add_argument("--fused-attention", action="store_true",
                   help="price every model with a fused attention kernel (flash or cuDNN fused attention, as "
                        "Transformer Engine runs bf16), which keeps no score matrix; default: megatron-core's "
                        "local, unfused attention with dropout 0.1, which keeps 5 bytes a score")
    p.add_argument("--no-split-backward", action="store_true",
                   help="the stages cannot split their backward (Transformer Engine's layers): no method's search "
                        "tries zb-h1 or interleaved-zb")
    p.add_argument("--case", default=None, metavar="TEXT",
                   help="only the cases whose label contains TEXT, e.g. 't5-11b' (with --quick: one batch each)")
    args = p.parse_args(argv)
    try:
        text, args.methods = args.methods, [m.strip() for m in args.methods.split(",")]
        bad = [m for m in args.methods if m not in METHODS]
        if bad or len(set(args.methods)) != len(args.methods):
            raise DynaPipeError(f"--methods {text!r}: choose each at most once from {', '.join(METHODS)}.")
        if args.batches is None:
            args.batches = 1 if args.quick else 3
        if not 1 <= args.batches <= 32:
            # Every batch is planned and simulated by every method of every case.
            raise DynaPipeError(f"--batches {args.batches}: give 1 to 32 global batches.")
        if not 1 <= args.tokens <= 1 << 24:
            # The largest published global batches hold about 16M tokens; memory and time grow with it.
            raise DynaPipeError(f"--tokens {args.tokens}: give 1 to 16,777,216 tokens a global batch (default "
                                f"65536).")
        if args.seed < 0:
            raise DynaPipeError(f"--seed {args.seed}: the seed must be a non-negative integer.")
        load_device_config(args.device, "--device")
        load_cluster_config(args.cluster, "--cluster")
        cases = QUICK_CASES if args.quick and not args.case else CASES
        if args.case:
            cases = tuple(c for c in cases if args.case in c.label)
            if not cases:
                raise DynaPipeError(f"--case {args.case!r} matches no case; the cases are: "
                                    f"{'; '.join(c.label for c in CASES)}.")
        if args.markdown == "":
            raise DynaPipeError("--markdown '': an empty path; give a path, or leave it out for OUTPUT.md.")
        md_path = args.markdown or os.path.splitext(args.output)[0] + ".md"
        # Checked now, created only when written: a refused case must leave no empty folder.
        check_output_file(args.output, "--output")
        check_output_file(md_path, "--markdown")
        check_distinct([("--output", args.output), ("--markdown", md_path)])
        started = time.perf_counter()
        records = []
        for case in cases:
            t0 = time.perf_counter()
            records.append(run_case(case, args))
            print(f"{case.label}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    except DynaPipeError as e:
        print_error(str(e))
        return 2
    table = markdown(records)
    report = {"setup": {"device": args.device, "cluster": args.cluster, "tokens_per_batch": args.tokens,
                        "batches": args.batches, "seed": args.seed, "cost_model": "analytic",
                        "attention": "fused" if args.fused_attention else "unfused, dropout 0.1",
                        "split_backward": not args.no_split_backward,
                        "mixture": "synthetic FLAN-like (configs/data/flan-mixture.yaml)",
                        "simulated_ms": "makespan of the slowest replica's pipeline (forward, backward, "
                                        "point-to-point transfers); excludes the data-parallel gradient "
                                        "reduction and the optimizer step, the same for every method",
                        "planning_ms": "wall time of batching + schedule search + compiling every rank's "
                                       "plan for one batch, in this process (baseline sweeps excluded)"},
              "cases": records, "elapsed_s": round(time.perf_counter() - started, 1)}
    try:
        write_output(args.output, json.dumps(report, indent=1), "--output")
        write_output(md_path, table + "\n", "--markdown")
    except DynaPipeError as e:
        print_error(str(e))
        return 2
    print(table)
    print(f"wrote {args.output} and {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
