"""The batching flags of ``plan`` and ``trace`` (``--batching``, ``--micro-batch-size``,
``--max-tokens``) and the check that every flag given is one the chosen method reads.

Which method reads what: ``dynapipe`` and ``dynapipe-per-sample`` (its rows run with per-sample
attention, the padding tails skipped) size their micro-batches themselves (neither flag);
``padding``, ``padding-mb``, ``packing`` and ``packing-per-sample`` (the same rows run
with per-sample attention, priced at their attention density) take
``--micro-batch-size`` (samples, rows for packing); ``token-budget`` takes ``--max-tokens``, or without it
``--micro-batch-size x seq-length`` tokens (twice that for an encoder-decoder model, input and
target together). ``--seq-length`` is read by every method, and so is an encoder-decoder
model's ``--decoder-seq-length`` (the targets' own limit, as in Megatron-LM).
"""
from __future__ import annotations

import argparse
from typing import Optional

from dynapipe.batching import METHODS
from dynapipe.batching.planner import DP_METHODS
from dynapipe.batching.types import LengthLimit
from dynapipe.errors import DynaPipeError

SIZED_BY_COUNT = ("padding", "padding-mb", "packing", "packing-per-sample")
DEFAULT_MICRO_BATCH_SIZE = 1


def add_batching_arguments(p: argparse.ArgumentParser) -> None:
    """``--batching``, ``--micro-batch-size`` and ``--max-tokens``; both sizes default to
    ``None`` so that :func:`check_batching_flags` can tell a flag given from its default."""
    p.add_argument("--batching", choices=METHODS, default="dynapipe", help="batching method (default dynapipe)")
    p.add_argument("--micro-batch-size", type=int, default=None,
                   help="samples (packing: rows) a micro-batch for padding, padding-mb and the packings (default 1)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="padded tokens a micro-batch for token-budget, input and target together (default "
                        "micro-batch-size x seq-length; encoder-decoder models: micro-batch-size x (seq-length + "
                        "decoder-seq-length))")


def add_decoder_seq_length(p: argparse.ArgumentParser) -> None:
    """``--decoder-seq-length``: an encoder-decoder model's target limit (tokens)."""
    p.add_argument("--decoder-seq-length", type=int, default=None,
                   help="encoder-decoder models: truncate targets to this many tokens, and pad the padding and "
                        "packing baselines' decoder rows to it, as Megatron's --decoder-seq-length (default: "
                        "targets limited as inputs, by --seq-length, and padded to the batch's longest)")


def micro_batch_size(args: argparse.Namespace) -> int:
    """``--micro-batch-size`` as the batching reads it (its default when not given)."""
    return DEFAULT_MICRO_BATCH_SIZE if args.micro_batch_size is None else args.micro_batch_size


def check_batching_flags(args: argparse.Namespace) -> None:
    """Refuse a non-positive size, and a size flag that ``--batching`` would not read
    (rather than plan as if it had not been given)."""
    method, mbs, tokens = args.batching, args.micro_batch_size, args.max_tokens
    for flag, value, what in (("--micro-batch-size", mbs, "samples a micro-batch"),
                              ("--max-tokens", tokens, "padded tokens a micro-batch")):
        if value is not None and value < 1:
            raise DynaPipeError(f"{flag} {value}: must be a positive integer ({what}).")
    if tokens is not None and method != "token-budget":
        raise DynaPipeError(f"--max-tokens {tokens}: --batching {method} does not read it (only token-budget "
                            f"does); drop --max-tokens or use --batching token-budget.")
    if mbs is None:
        return
    if method in DP_METHODS:
        raise DynaPipeError(f"--micro-batch-size {mbs}: --batching {method} sizes every micro-batch itself and does "
                            f"not read it; drop --micro-batch-size or use --batching "
                            f"{', '.join(SIZED_BY_COUNT)} or token-budget.")
    if method == "token-budget" and tokens is not None:
        raise DynaPipeError(f"--micro-batch-size {mbs}: --batching token-budget reads it only to default "
                            f"--max-tokens (micro-batch-size x seq-length), and --max-tokens {tokens} is given; "
                            f"give one of the two.")


def cut_arguments(args: argparse.Namespace, setup) -> dict:
    """:func:`~dynapipe.batching.plan_micro_batches`'s arguments as ``plan``/``trace`` give them
    (all but the recompute level); ``setup``: the command's ``CostSetup`` (memory limits, MiB)."""
    return dict(method=args.batching, dp=args.dp, memory_limit_mib=setup.memory_limit_mib,
                reserved_mib=setup.reserved_mib, micro_batch_size=micro_batch_size(args),
                seq_length=length_limit(args, setup.model), max_tokens=args.max_tokens)


def length_limit(args: argparse.Namespace, model) -> Optional[LengthLimit]:
    """The planner's ``seq_length`` as the flags give it (tokens): ``--seq-length``, or with
    ``--decoder-seq-length`` the (input, target) pair; the latter is refused for a decoder-only
    ``model`` (a :class:`~dynapipe.config.ModelConfig`)."""
    seq, dec = getattr(args, "seq_length", None), getattr(args, "decoder_seq_length", None)
    if dec is None:
        return seq
    if not model.is_encoder_decoder:
        raise DynaPipeError(f"--decoder-seq-length {dec}: model {model.name!r} is decoder-only and has no targets "
                            f"of their own; drop it (--seq-length limits its samples).")
    return seq, dec
