"""What a run prints at start and end, in the shape Megatron-LM prints it.

* :func:`argument_dump`: every parsed argument, one per line, dotted to a column and sorted
  case-insensitively, between Megatron's ``arguments`` rules (printed by rank 0; the values
  validation derived filled in by :func:`resolved_args`, :func:`t5_resolved_args` for a T5).
* :func:`parameter_count_line`: Megatron's per-stage count, printed by the first data-parallel
  rank of every (tensor, pipeline) coordinate, since only that stage knows its parameters.
* :func:`training_summary_lines`: iterations, samples, tokens, time and throughput of the run,
  printed by the rank that prints the iteration lines (the last stage, where Megatron-LM logs),
  right after its last one; every rank holds the same step results.
No torch import.
"""
from __future__ import annotations

import argparse
import time
from typing import Sequence

TITLE = "arguments"
NAME_COLUMN = 48  # argument names are dotted out to this column, as Megatron-LM does


def argument_dump(args: argparse.Namespace, title: str = TITLE) -> list[str]:
    """Megatron-LM's start-up block of ``args``: a rule, ``  name ..... value`` lines, a closing rule."""
    lines = [f"  {name} {'.' * max(NAME_COLUMN - len(name), 1)} {value}" for name, value in vars(args).items()
             if not name.startswith("_")]  # this project's own bookkeeping, not an argument
    return ([f"------------------------ {title} ------------------------"]
            + sorted(lines, key=str.lower)
            + [f"-------------------- end of {title} ---------------------"])


def resolved_args(args: argparse.Namespace, cfg) -> argparse.Namespace:
    """``args`` as Megatron-LM dumps them after ``validate_args``: under its names, with the values
    it derives filled in (:func:`megatron_integration.megatron_resolved.megatron_resolved_args`).
    ``cfg``: the run's DynaPipeTrainingConfig."""
    from megatron_integration.megatron_resolved import dumped_names, megatron_resolved_args

    plain = {k: v for k, v in vars(args).items() if not k.startswith("_")}
    return argparse.Namespace(**dumped_names(megatron_resolved_args(plain, cfg)))


def t5_resolved_args(args: argparse.Namespace, cfg) -> argparse.Namespace:
    """:func:`resolved_args` of a T5 run (``cfg``: a T5TrainingConfig), with the lengths and depths
    under Megatron-LM's T5 names: ``num_layers`` and ``seq_length`` are the encoder's, as
    Megatron-LM's validation makes them whichever of the two spellings was given."""
    derived = dict(num_layers=cfg.encoder_layers, encoder_num_layers=cfg.encoder_layers,
                   decoder_num_layers=cfg.decoder_layers, seq_length=cfg.encoder_seq_length,
                   encoder_seq_length=cfg.encoder_seq_length, decoder_seq_length=cfg.decoder_seq_length)
    return argparse.Namespace(**{**vars(resolved_args(args, cfg.base)), **derived})


def write_line(stream, line: str) -> None:
    """Write ``line`` with its newline in one call, then flush. The ranks of a job share its
    stdout, and ``print`` writes the text and the newline apart, which an unbuffered stream
    (``PYTHONUNBUFFERED``, as many launchers set) passes on as two writes: another rank's line
    could land between them and leave this one mid-line."""
    stream.write(line + "\n")
    stream.flush()


def parameter_count_line(tp_rank: int, pp_rank: int, count: int) -> str:
    """Megatron-LM's line for the parameters one model-parallel rank holds."""
    return f" > number of parameters on (tensor, pipeline) model parallel rank ({tp_rank}, {pp_rank}): {count}"


def training_summary_lines(results: Sequence, start_iteration: int, consumed_samples: int,
                           elapsed_s: float, exited: bool = False, skipped_iterations: int = 0,
                           skipped_samples: int = 0) -> list[str]:
    """The end-of-training lines: Megatron's ``[after training is done]`` stamp (``[exiting
    program at iteration N]`` when ``--exit-interval`` stopped it, ``exited``), then what the run
    did: ``results`` are the trained iterations' StepResults (times in ms, tokens over the global
    batch), ``skipped_iterations`` the iterations consumed untrained (``--iterations-to-skip``,
    ``skipped_samples`` samples); ``elapsed_s``: the training time (s), evaluations and checkpoints
    left out as in the log lines."""
    done = len(results) + skipped_iterations
    real = sum(r.real_tokens for r in results)
    padded = sum(r.padded_tokens for r in results)
    loss_tokens = sum(r.loss_tokens for r in results)
    skipped = sum(int(r.skipped) for r in results)
    ms_per_iter = elapsed_s * 1e3 / max(len(results), 1)
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    label = f"exiting program at iteration {start_iteration + done}" if exited else "after training is done"
    if not done:  # resumed at or past --train-iters: nothing was left to train
        return [f"[{label}] datetime: {stamp} ",
                f" > training summary: no iteration left to train (resumed at iteration {start_iteration}) | "
                f"consumed samples: {consumed_samples}"]
    return [
        f"[{label}] datetime: {stamp} ",
        f" > training summary: iterations {start_iteration + 1}-{start_iteration + done} ({done}) | "
        f"consumed samples: {consumed_samples} | "
        + (f"skipped samples: {skipped_samples} ({skipped_iterations} iteration"
           f"{'s' if skipped_iterations > 1 else ''} of --iterations-to-skip) | " if skipped_iterations else "")
        + f"real tokens: {real} | padded tokens: {padded} | "
        f"loss tokens: {loss_tokens} | skipped iterations: {skipped} | time (s): {elapsed_s:.1f} | "
        f"elapsed time per iteration (ms): {ms_per_iter:.1f} | "
        f"real tokens/s: {real / max(elapsed_s, 1e-9):.1f} | padding efficiency: {real / max(padded, 1):.3f}",
    ]
