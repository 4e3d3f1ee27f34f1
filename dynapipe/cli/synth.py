"""``python -m dynapipe synth``: a lengths file from the synthetic mixture."""
from __future__ import annotations


from dynapipe.output_paths import check_distinct, check_output_file, write_output
from dynapipe.data.synthetic import load_mixture, resolve_mixture, sample_lengths

HELP = "write a lengths file drawn from the synthetic multi-task mixture"


def add_arguments(p) -> None:
    """Add the ``synth`` command's flags to ``p``."""
    p.add_argument("--samples", type=int, required=True, help="number of samples")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--seq-length", type=int, default=1024, help="clip lengths at this many tokens (default 1024)")
    p.add_argument("--encoder-decoder", action="store_true",
                   help="write 'input target' pairs (two integers a line) instead of one length")
    p.add_argument("--mixture", default=None,
                   help="mixture: a YAML path or a name shipped in configs/data (default flan-mixture)")
    p.add_argument("--output", default="-", help="output file (default: stdout)")


def run(args) -> int:
    """Run ``synth`` with parsed ``args``; the process exit status (0: done)."""
    check_output_file(args.output, "--output", stdout=True)
    mixture = resolve_mixture(args.mixture, flag="--mixture")
    check_distinct([("--mixture", mixture), ("--output", args.output)])
    lengths = sample_lengths(args.samples, args.seed, args.seq_length, args.encoder_decoder, load_mixture(mixture))
    lines = "\n".join(" ".join(map(str, row)) if lengths.ndim == 2 else str(row) for row in lengths.tolist())
    write_output(args.output, lines + "\n", "--output")
    return 0
