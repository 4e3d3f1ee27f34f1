"""DynaPipe on the interleaved GPT pipeline against DynaPipe on the plain one, side by side.

One spawned job trains the same DynaPipe run (the tiny bench preset unless flags say
otherwise) alternately on the plain pipeline and on ``--chunks`` model chunks a rank
(``--num-virtual-stages-per-pipeline-rank``), ``--rounds`` times each, so both see the same
machine load. Reported: real tokens/s of each run over its iterations after the first (the
slowest rank's iteration time: the loader's wait for the plan, executor, gradient finaliser,
optimizer step), each round's interleaved/plain ratio and the median. Both runs plan with
the same cost model: give a measured one (``--dynapipe-cost-model PROFILE``; ``python -m
dynapipe bench`` leaves one beside its output as ``*.profile.json``), since the analytic
model prices a CPU poorly.

    python scripts/bench_gpt_interleaved.py --dynapipe-cost-model bench.profile.json
    python scripts/bench_gpt_interleaved.py --rounds 5 --output interleaved.json --dynapipe-cost-model P
"""
from __future__ import annotations

import json
import os
import re
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_integration.bench_presets import PRESETS, fill_defaults, host_defaults, with_defaults  # noqa: E402
from dynapipe.argparsing import StrictArgumentParser, print_error  # noqa: E402
from dynapipe.errors import DynaPipeError  # noqa: E402
from dynapipe.output_paths import check_output_file, write_output  # noqa: E402


def tokens_per_s(ranks: list[dict], skip: int = 1) -> float:
    """Real tokens/s of one run: its iterations after the first ``skip``, each timed on its slowest rank."""
    n = len(ranks[0]["iteration_ms"])
    keep = range(min(skip, n - 1), n)
    ms = sum(max(r["iteration_ms"][i] for r in ranks) for i in keep)
    return sum(ranks[0]["real_tokens"][i] for i in keep) / (ms / 1e3)


def check_training_args(runs: list[list[str]], nproc: int, chunks: int, prog: str) -> None:
    """Parse every run's training command line as each rank will, before any rank starts:
    a typo'd or refused flag otherwise ends the spawned job in a traceback. Raises a
    DynaPipeError in this script's flags, or SystemExit(2) after the parser's one line."""
    from megatron_integration.arguments import build_parser, parse_training_args

    # The world size and the chunks a rank are what --nproc and --chunks set here.
    ours = ((rf"\bworld size {nproc}\b", f"--nproc {nproc}"),
            (rf"--num-virtual-stages-per-pipeline-rank {chunks}\b", f"--chunks {chunks}"))
    for argv in runs:
        try:
            parse_training_args(argv, nproc, parser=build_parser(prog=prog))
        except DynaPipeError as e:
            text = str(e)
            for pattern, flag in ours:
                text = re.sub(pattern, flag, text)
            raise DynaPipeError(text) from None


def main(argv=None) -> int:
    parser = StrictArgumentParser(description=__doc__.split("\n\n")[0],
                                  epilog="Any other argument is a training flag passed on to both runs, for example "
                                         "--dynapipe-cost-model PROFILE.json (a profile from `python -m dynapipe "
                                         "bench`) or another Megatron model flag.")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of the two runs (default 3)")
    parser.add_argument("--chunks", type=int, default=2, help="model chunks a rank of the interleaved run (default 2)")
    parser.add_argument("--nproc", type=int, default=2, help="ranks (default 2: the preset's 2 stages)")
    parser.add_argument("--output", default=None, help="write the figures as JSON here")
    args, train = parser.parse_known_args(argv)
    if args.rounds < 1 or args.chunks < 2:
        parser.error(f"--rounds {args.rounds} / --chunks {args.chunks}: give at least 1 round and 2 chunks.")
    if args.nproc < 1:
        parser.error(f"--nproc {args.nproc}: must be at least 1 (the ranks each run spawns)")
    base = fill_defaults(with_defaults(["--use-dynapipe"] + train, "tiny"),
                         host_defaults(args.nproc, PRESETS["tiny"].cpu_pretouch_mb))
    chunked = base + ["--num-virtual-stages-per-pipeline-rank", str(args.chunks)]
    try:
        if args.output is not None:
            check_output_file(args.output, "--output")
        check_training_args([base, chunked], args.nproc, args.chunks, parser.prog)
    except DynaPipeError as e:
        print_error(str(e))
        return 2
    except SystemExit as e:  # the training parser's own one-line refusal (a typo'd flag), already printed
        return e.code if isinstance(e.code, int) else 2
    from megatron_integration.jobs import run_trainings

    print(f"training {args.rounds} round(s) of DynaPipe plain and on {args.chunks} chunks a rank, alternately ...",
          flush=True)
    runs = run_trainings([base, chunked] * args.rounds, args.nproc, timeout_s=600.0 * args.rounds)
    plain = [tokens_per_s(runs[2 * k]) for k in range(args.rounds)]
    inter = [tokens_per_s(runs[2 * k + 1]) for k in range(args.rounds)]
    ratios = [b / a for a, b in zip(plain, inter)]
    for k, (a, b, r) in enumerate(zip(plain, inter, ratios)):
        print(f"round {k}: plain {a:,.0f} real tokens/s, {args.chunks} chunks {b:,.0f} -> {r:.2f}x")
    print(f"interleaved / plain: {statistics.median(ratios):.2f}x (median of {args.rounds} rounds)")
    if args.output:
        report = {"argv": base, "chunks": args.chunks, "plain_real_tokens_per_s": plain,
                  "interleaved_real_tokens_per_s": inter, "ratios": ratios, "median_ratio": statistics.median(ratios),
                  "losses_equal": all(runs[2 * k][0]["losses"] == runs[2 * k + 1][0]["losses"]
                                      for k in range(args.rounds))}
        try:
            write_output(args.output, json.dumps(report, indent=1), "--output")
        except DynaPipeError as e:
            print_error(str(e))
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
