"""``python -m dynapipe advise``: rank the parallel layouts of a model on a cluster by simulation."""
from __future__ import annotations

import argparse
import json

import numpy as np

from dynapipe.cli.advise_run_config import config_ref, launch_shape, run_config_text
from dynapipe.errors import DynaPipeError
from dynapipe.argparsing import strict_int
from dynapipe.output_paths import check_distinct, check_output_file, config_inputs, write_output

HELP = "rank parallel layouts (TP, PP, interleaving, DP, distributed optimizer) for a model and cluster by simulation"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add the ``advise`` command's flags to ``p``."""
    p.add_argument("--model", required=True, help="model config (shipped name such as gpt-13b, or a YAML path)")
    p.add_argument("--device", required=True, help="device config (a100-40gb, h100-80gb, cpu, or a YAML path)")
    p.add_argument("--cluster", required=True, help="cluster config: GPUs per node and links (a100-8x, ...)")
    p.add_argument("--gpus", type=int, required=True, help="GPUs of the job")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--lengths", help="lengths file to draw the global batches from (one length a line)")
    src.add_argument("--mixture", help="synthetic mixture to draw them from: a name in configs/data or a YAML path")
    p.add_argument("--tokens-per-iteration", type=int, default=1 << 20,
                   help="tokens of a global batch (default 1048576)")
    p.add_argument("--seq-length", type=int, default=None,
                   help="samples are clipped to this many tokens (default: the model's max_seq_length)")
    p.add_argument("--tp-sizes", type=_int_list, default=None,
                   help="tensor-parallel sizes to try, comma-separated (default: the powers of two up to the GPUs "
                        "of a node that divide the GPUs and the model's heads and FFN width)")
    p.add_argument("--vpp-sizes", type=_int_list, default=[1],
                   help="model chunks a pipeline rank to try with PP > 1 as well as the plain pipeline "
                        "(Megatron's interleaved pipeline, --num-virtual-stages-per-pipeline-rank), comma-separated, "
                        "such as 2 (default: none; each chunked layout plans several times slower)")
    p.add_argument("--no-sequence-parallel", action="store_true",
                   help="price TP > 1 without Megatron's --sequence-parallel (default: with it)")
    p.add_argument("--batches", type=int, default=2, help="global batches simulated per layout (default 2)")
    p.add_argument("--memory-limit-mb", type=float, default=None,
                   help="memory per GPU the plans may use, MiB (default: the device config's)")
    p.add_argument("--top", type=int, default=10, help="layouts shown (default 10)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampled batches (default 0)")
    p.add_argument("--no-packing", action="store_true", help="skip the tuned-packing comparison (faster)")
    p.add_argument("--packing-attention", choices=("per-sample", "mask"), default=None,
                   help="the packing compared with: rows whose attention runs on each sample alone (per-sample, "
                        "as Transformer Engine's THD format or a varlen kernel runs packing on a GPU; the default, "
                        "the strongest) or Megatron's masked rows, whose attention spans every row (mask)")
    p.add_argument("--packing-schedule", choices=("1f1b", "search"), default=None,
                   help="the packing's schedule: Megatron's 1F1B (default), or DynaPipe's schedule search "
                        "(schedule, order and recompute per stage: the same freedom as DynaPipe; per-sample "
                        "attention only; slower)")
    p.add_argument("--output", default=None, help="write the best layout as a run config (YAML) here")
    p.add_argument("--json", default=None, help="write every ranked layout as JSON here")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress on stderr (a bar on a terminal with tqdm installed, else a line per layout)")


def _int_list(text: str) -> list[int]:
    entries = text.split(",")
    if any(not x.strip() for x in entries):
        raise argparse.ArgumentTypeError(f"{text!r}: an entry is empty; expected comma-separated integers "
                                         f"such as 1,2,4")
    try:
        values = [strict_int(x.strip()) for x in entries]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers such as 1,2,4") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive integers such as 1,2,4")
    return values


# Caps on the size of a request. Every data-parallel replica and every sample of every batch
# is planned on every layout, so time and memory grow with all three: at 16,384 GPUs and
# 16,777,216 tokens, one batch on gpt-tiny's three TP1 layouts took 160 s and 5.4 GB on the
# 2-core machine; at 65,536 GPUs and 2^27 tokens a run passed 23 GB and was killed. The
# documented cases stay far below (64 GPUs, 2 x 1,048,576 tokens).
CAPS = {
    "gpus": (16_384, "the largest published training jobs; every data-parallel replica of every layout is "
                     "planned, so time and memory grow with it"),
    "batches": (32, "each global batch is planned and simulated on every layout, so the run time grows with it"),
    "tokens-per-iteration": (1 << 24, "the 16M-token global batches of the largest published runs; every sample "
                                      "of a batch is planned on every layout"),
}


def _positive(name: str, value, minimum: int = 1) -> None:
    if value is not None and value < minimum:
        raise DynaPipeError(f"--{name} {value}: must be at least {minimum}.")
    cap, why = CAPS.get(name, (None, ""))
    if cap is not None and value is not None and value > cap:
        raise DynaPipeError(f"--{name} {value}: at most {cap:,} ({why}).")


def _check_tokens_per_iteration(tokens: int, seq: int, model, seq_by_default: bool) -> None:
    """Refuse a global batch (tokens) smaller than one sample at the clip: a sample longer than
    the budget still goes into a batch (alone), so the simulated batches would hold more
    tokens than asked, and the ranking would be of another workload than the one given."""
    sides = 2 if model.is_encoder_decoder else 1  # T5 clips input and target at seq-length each
    minimum = sides * seq
    if tokens < minimum:
        whose = f"the model's max_seq_length {seq}" if seq_by_default else f"--seq-length {seq}"
        one = f"{seq} input + {seq} target tokens" if sides == 2 else f"{seq} tokens"
        raise DynaPipeError(f"--tokens-per-iteration {tokens} is below one sample at the clip ({one}, from "
                            f"{whose}); give at least {minimum}, or a smaller --seq-length.")


def _report_layouts(bar):
    """:func:`dynapipe.advise.advise`'s progress callback on a shared
    :class:`~dynapipe.progress.Progress`: one step per layout, labelled while it is simulated."""
    def report(done: int, total: int, layout) -> None:
        if done:
            bar.step()
        if layout is not None:
            bar.begin(f"simulating {layout.label()}")
    return report


def _gib(mib: float) -> str:
    return f"{mib / 1024:.1f}"


def format_table(advice, top: int) -> list[str]:
    """The ranked table as text lines."""
    head = (f"{'rank':>4}  {'layout':<24} {'tokens/s':>10} {'iter ms':>9} {'DP sync':>8} {'bubble':>6}  "
            f"{'peak GiB per stage':<28} {'recompute':<12} {'schedule':<10} {'plan ms':>8}  "
            f"{'packing tokens/s (mbs)':>22} {'vs packing':>10}")
    lines = [head, "-" * len(head)]
    for i, r in enumerate(advice.results[:top], 1):
        d = r.dynapipe.summary()
        peaks = r.stage_peak_mib
        peak = "/".join(_gib(p) for p in peaks) if len(peaks) <= 6 else f"max {_gib(max(peaks))} of {len(peaks)}"
        if r.packing is not None:
            p = r.packing.summary()
            pack = f"{p['real_tokens_per_s']:,.0f} ({p['micro_batch_size']})"
            vs = f"{r.speedup_vs_packing:.2f}x"
        else:
            pack, vs = "-", "-"
        lines.append(f"{i:>4}  {r.layout.label():<24} {d['real_tokens_per_s']:>10,.0f} {d['iteration_ms']:>9.1f} "
                     f"{d['step_ms']:>8.1f} {d['bubble_fraction']:>6.3f}  {peak:<28} {','.join(d['recompute']):<12} "
                     f"{','.join(d['schedule']):<10} {d['planning_ms']:>8.1f}  {pack:>22} {vs:>10}")
    return lines


def packing_method(args) -> str:
    """The :data:`~dynapipe.advise.PACKING_METHODS` entry ``--packing-attention`` and
    ``--packing-schedule`` name."""
    if args.packing_schedule == "search":
        return "packing-search"
    return "packing" if args.packing_attention == "mask" else "packing-per-sample"


def run(args) -> int:
    """Run ``advise`` with parsed ``args``; the process exit status (0: done)."""
    from dynapipe.advise import advise, enumerate_layouts, gpu_capacity_mib, leave_out_idle_replicas, sample_batches
    from dynapipe.batching.lengths import read_lengths_for
    from dynapipe.config import load_cluster_config, load_device_config, load_model_config
    from dynapipe.progress import Progress

    for name in ("gpus", "tokens-per-iteration", "batches", "top", "seq-length"):
        _positive(name, getattr(args, name.replace("-", "_")))
    _positive("seed", args.seed, 0)
    if args.memory_limit_mb is not None and not args.memory_limit_mb > 0:
        raise DynaPipeError(f"--memory-limit-mb {args.memory_limit_mb}: must be a positive number of MiB.")
    # As every command does: refused before sampling, a missing folder created at the write.
    for flag in ("output", "json"):  # both files: advise prints its report to stdout
        if getattr(args, flag) is not None:
            check_output_file(getattr(args, flag), f"--{flag}")
    check_distinct(config_inputs(args, ("model", "device", "cluster", "mixture"))
                   + [("--lengths", args.lengths), ("--output", args.output), ("--json", args.json)])
    model, device = load_model_config(args.model, flag="--model"), load_device_config(args.device, flag="--device")
    gpu_capacity_mib(device, args.memory_limit_mb)
    cluster = load_cluster_config(args.cluster, flag="--cluster")
    if args.output is not None:
        launch_shape(args.gpus, cluster)  # refused before minutes of simulation, not after
    seq = args.seq_length or model.max_seq_length
    if seq > model.max_seq_length:
        raise DynaPipeError(f"--seq-length {seq} exceeds the model's max_seq_length {model.max_seq_length}.")
    _check_tokens_per_iteration(args.tokens_per_iteration, seq, model, args.seq_length is None)
    mixture_path = None
    if args.mixture is not None:
        from dynapipe.data.synthetic import load_mixture, resolve_mixture

        mixture_path = resolve_mixture(args.mixture, flag="--mixture")
        batches = sample_batches(args.tokens_per_iteration, args.batches, args.seed, seq,
                                 encoder_decoder=model.is_encoder_decoder, mixture=load_mixture(mixture_path))
    else:
        batches = sample_batches(args.tokens_per_iteration, args.batches, args.seed, seq,
                                 pool=read_lengths_for(args.lengths, model.name, model.is_encoder_decoder))
    # No distributed optimizer on CPUs (megatron-core's needs CUDA); T5's is left out by enumerate_layouts.
    layouts = enumerate_layouts(model, args.gpus, cluster, tp_sizes=args.tp_sizes, chunk_counts=args.vpp_sizes,
                                seq_length=seq,
                                zero=False if device.name == "cpu" else None,
                                sequence_parallel=not args.no_sequence_parallel)
    unused = sorted(set(args.vpp_sizes) - {1} - {l.chunks for l in layouts})
    if unused:
        if model.is_encoder_decoder:
            raise DynaPipeError(f"--vpp-sizes {','.join(map(str, unused))}: encoder-decoder models interleave "
                                f"through their planned placement (each layout's auto placement weighs an "
                                f"interleaved split), not a chunk count; drop --vpp-sizes.")
        why = f"no pipeline size here splits the {model.total_layers} layers into that many chunks a rank"
        raise DynaPipeError(f"--vpp-sizes {','.join(map(str, unused))}: {why}; drop it or give a count that does.")
    if args.no_sequence_parallel and not any(l.tp > 1 and not seq % l.tp for l in layouts):
        # Sequence parallelism is only ever on where TP > 1 shards the sequence evenly.
        raise DynaPipeError(f"--no-sequence-parallel: no layout here could use sequence parallelism (TP sizes "
                            f"{','.join(str(t) for t in sorted({l.tp for l in layouts}))} at --seq-length {seq}); "
                            f"drop it.")
    for flag, value in (("--packing-attention", args.packing_attention), ("--packing-schedule", args.packing_schedule)):
        if args.no_packing and value is not None:
            raise DynaPipeError(f"{flag} {value}: --no-packing skips the packing comparison it would set; drop one "
                                f"of the two.")
    if args.packing_schedule == "search" and args.packing_attention == "mask":
        raise DynaPipeError("--packing-schedule search gives DynaPipe's schedule search to per-sample packing, the "
                            "strongest packing; with --packing-attention mask use --packing-schedule 1f1b.")
    # Before the bar, which counts only the layouts simulated (advise leaves out the same).
    shown, _ = leave_out_idle_replicas(layouts, batches)
    kw = dict(cluster=cluster, seq_length=seq, memory_limit_mib=args.memory_limit_mb, layouts=layouts,
              compare_packing=not args.no_packing,
              packing_method=packing_method(args))
    if args.no_progress:  # nothing on stderr: the lines only name layouts, the table follows
        advice = advise(batches, model, device, args.gpus, **kw)
    else:
        with Progress(len(shown), "advise") as bar:
            advice = advise(batches, model, device, args.gpus, progress=_report_layouts(bar), **kw)
    best = advice.best
    # The tokens the layouts were simulated on: samples clipped at the sequence length (each side).
    mean_tokens = sum(int(np.minimum(b, seq).sum()) for b in batches) / len(batches)
    left = f"{len(advice.left_out)} left out, " if advice.left_out else ""
    print(f"{model.name} on {args.gpus} x {device.name} ({cluster.name}): {len(layouts)} layouts, {left}"
          f"{len(advice.results)} fit; {len(batches)} global batch(es) of ~{mean_tokens:,.0f} tokens "
          f"(seq-length {seq}); {advice.elapsed_ms / 1e3:.1f} s")
    tps = sorted({l.tp for l in layouts})
    vpps = sorted({l.chunks for l in layouts} - {1})
    print(f"TP {', '.join(map(str, tps))}" + (" (with sequence parallelism)" if any(l.sp for l in layouts) else "")
          + (f"; interleaved with VPP {', '.join(map(str, vpps))} chunks a rank too" if vpps else "")
          + ("; encoder-decoder: the planned stage placement, no distributed optimizer (T5 stages refuse it)"
             if model.is_encoder_decoder else "")
          + "; tokens/s: real (non-pad) tokens, simulated"
          + ("." if args.no_packing else
             "; packing: the best packed micro-batch size "
             + ("with DynaPipe's schedule search" if args.packing_schedule == "search" else "under 1F1B")
             + (", rows masked (attention over every row)." if args.packing_attention == "mask" else
                ", attention per sample.")))
    for line in format_table(advice, args.top):
        print(line)
    rival = advice.best_packing
    if rival is not None:
        # Each method on its own best layout: what choosing DynaPipe gains over choosing packing.
        print(f"best layout for packing: {rival.layout.label()}, {rival.packing.real_tokens_per_s:,.0f} tokens/s "
              f"(mbs {rival.packing.micro_batch_size}); DynaPipe's best layout is "
              f"{best.real_tokens_per_s / rival.packing.real_tokens_per_s:.2f}x it")
    if model.is_encoder_decoder:
        print("placements (layers per stage, encoder+decoder; | separates the chunks of an interleaved one): "
              + "; ".join(f"{r.layout.label()}: {r.placement or 'even'}"
                          + (f" (packing: {r.packing_placement})" if r.packing_placement else "")
                          for r in advice.results[:args.top]))
    if advice.left_out:
        print(f"left out ({len(advice.left_out)}), {advice.left_out[0][1]}: "
              + ", ".join(l.label() for l, _ in advice.left_out))
    if advice.refused:
        print(f"refused ({len(advice.refused)}): " + "; ".join(
            f"{l.label()}: {why.split('; ')[0].split('. ')[0]}" for l, why in advice.refused[:6])
              + (" ..." if len(advice.refused) > 6 else ""))
    if args.output is not None:
        text = run_config_text(best, model, config_ref(args.device), config_ref(args.cluster), cluster, args.gpus,
                               args.tokens_per_iteration,
                               seq, args.memory_limit_mb, mixture_path, batches)
        write_output(args.output, text, "--output")
        print(f"best layout written to {args.output}")
    if args.json is not None:
        best_packing = None if rival is None else {
            "layout": rival.layout.label(), "method": rival.packing.method,
            "micro_batch_size": rival.packing.micro_batch_size,
            "real_tokens_per_s": round(rival.packing.real_tokens_per_s, 1),
            "dynapipe_best_vs_it": round(best.real_tokens_per_s / rival.packing.real_tokens_per_s, 3)}
        write_output(args.json, json.dumps({"layouts": [r.to_json() for r in advice.results],
                                      "best_packing": best_packing,
                                      "refused": [{"layout": l.label(), "reason": why} for l, why in advice.refused],
                                      "left_out": [{"layout": l.label(), "reason": why}
                                                   for l, why in advice.left_out]},
                                     indent=1) + "\n", "--json")
    return 0

