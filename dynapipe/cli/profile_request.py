"""What ``python -m dynapipe profile`` refuses before it measures anything.

Profiling takes minutes (hours for a large model's tensor-parallel grid), so a request it
could not honour is refused first, in one line naming the flag: Megatron training flags it
would not read, an ``--output`` it could not write, grid lengths beyond the ``--model``
config's, and a tensor-parallel size the model, the grid or this machine cannot split by.
"""
from __future__ import annotations

import os


# Megatron argument groups the profile reads nothing of (it measures layers, it does not
# train), and the flags of the other groups that it leaves unread too.
UNREAD_GROUPS = ("learning rate and optimizer", "checkpointing", "logging", "data-parallel gradient reduction",
                 "data splits and evaluation", "evaluation")
UNREAD_FLAGS = ("--micro-batch-size", "--global-batch-size", "--train-iters", "--train-samples", "--exit-interval",
                "--exit-duration-in-mins", "--manual-gc", "--manual-gc-interval", "--no-manual-gc-eval",
                "--check-for-nan-in-loss-and-grad", "--rerun-mode", "--error-injection-rate", "--error-injection-type",
                "--check-for-spiky-loss", "--check-for-large-grads",
                "--reset-position-ids", "--reset-attention-mask",
                "--recompute-granularity", "--recompute-method", "--recompute-num-layers", "--recompute-modules",
                "--recompute-activations", "--empty-unused-memory-level", "--calculate-per-token-loss",
                "--grad-reduce-in-bf16", "--accumulate-allreduce-grads-in-fp32",
                "--pipeline-model-parallel-size", "--num-layers-per-virtual-pipeline-stage",
                "--num-virtual-stages-per-pipeline-rank", "--decoder-first-pipeline-num-layers",
                "--decoder-last-pipeline-num-layers", "--account-for-embedding-in-pipeline-split",
                "--account-for-loss-in-pipeline-split", "--pipeline-model-parallel-layout",
                "--no-overlap-p2p-communication", "--data-path", "--mock-data", "--data-cache-path",
                "--no-mmap-bin-files", "--num-workers",
                # The profile picks its own backend (gloo on CPUs) and measures one TP group.
                "--distributed-backend", "--context-parallel-size", "--expert-model-parallel-size")


def refuse_unread_training_flags(args) -> None:
    """Refuse a Megatron training flag given to ``profile`` at another value than its default:
    the profile measures single layers at every recompute level over its own grid, so a
    batch size, a learning rate or a pipeline split would change nothing it writes."""
    import argparse

    from dynapipe.errors import DynaPipeError
    from megatron_integration.arguments import add_megatron_args

    parser = argparse.ArgumentParser(add_help=False)
    add_megatron_args(parser)
    defaults = vars(parser.parse_args([]))
    for group in parser._action_groups:
        for action in group._group_actions:
            flag = action.option_strings[0]
            if group.title not in UNREAD_GROUPS and flag not in UNREAD_FLAGS:
                continue
            value = getattr(args, action.dest, defaults[action.dest])
            if value == defaults[action.dest]:
                continue
            if isinstance(action, argparse.BooleanOptionalAction) and value is False:
                flag = action.option_strings[1]  # what was typed: --no-...
            shown = "" if action.nargs == 0 else " " + " ".join(map(str, value if isinstance(value, list) else [value]))
            raise DynaPipeError(f"{flag}{shown} is a training flag that profile does not read (it times single "
                                f"layers at every recompute level over --mbs x --seqlens); drop it.")


def check_output(path: str, args=None) -> None:
    """Refuse an ``--output`` the profile could not be written to, or that names a file the
    profile reads (``args``' ``--model`` config or a tokenizer's files), before measuring."""
    from dynapipe.errors import DynaPipeError
    from dynapipe.output_paths import check_output_file, check_outputs_apart, config_inputs

    if args is not None:
        check_outputs_apart(config_inputs(args, ("model", "vocab_file", "merge_file", "tokenizer_model")),
                            [("--output", path)])
    if os.path.isdir(path):
        raise DynaPipeError(f"--output {path}: is a directory; give a file path for the profile JSON, such as "
                            f"{os.path.join(path, 'profile.json')}.")
    # As every command's outputs: a missing folder is created when the profile is written.
    check_output_file(path, "--output")


def check_grid_lengths(model_name, seqlens: list[int], dec_seqlens: list[int],
                       flags: tuple[str, str] = ("--seqlens", "--dec-seqlens")) -> None:
    """Refuse grid lengths above the ``--model`` config's max_seq_length: the planner never
    prices longer sequences for it, and measuring one can need far more memory than the
    machine has (attention scores grow with the square of the length). ``flags``: what set
    each grid, as the error names it."""
    if model_name is None:
        return
    from dynapipe.config import load_model_config
    from dynapipe.errors import DynaPipeError

    cfg = load_model_config(model_name, flag="--model")
    for flag, grid in zip(flags, (seqlens, dec_seqlens)):
        if grid and max(grid) > cfg.max_seq_length:
            raise DynaPipeError(f"{flag} reaches {max(grid)} tokens, beyond the max_seq_length {cfg.max_seq_length} "
                                f"of --model {model_name}; measure lengths up to {cfg.max_seq_length}.")


def check_tensor_parallel(args, model, seqlens: list[int], dec_seqlens: tuple = ()) -> tuple[int, bool]:
    """The (tp, sequence_parallel) to measure, refused with the flag and the fix when the
    model, the grid (tokens; ``dec_seqlens``: a T5's decoder lengths) or this machine's GPUs
    cannot be split that way."""
    import torch

    from dynapipe.errors import DynaPipeError

    tp, sp = args.tensor_model_parallel_size, bool(args.sequence_parallel)
    if tp < 1:
        raise DynaPipeError(f"--tensor-model-parallel-size {tp}: must be at least 1.")
    if sp and tp == 1:
        raise DynaPipeError("--sequence-parallel needs --tensor-model-parallel-size 2 or more (it shards the "
                            "sequence over the tensor-parallel ranks); drop it or raise the TP size.")
    if tp > 1:
        cfg = model.to_model_config("profiled")
        for what, n in (("--num-attention-heads", cfg.num_attention_heads), ("--ffn-hidden-size", cfg.ffn_hidden_size),
                        ("--num-query-groups", cfg.num_query_groups or cfg.num_attention_heads)):
            if n % tp:
                raise DynaPipeError(f"--tensor-model-parallel-size {tp} does not divide {what} {n}; "
                                    f"use a tensor-parallel size that divides it.")
    bad = [(flag, s) for flag, grid in (("--seqlens", seqlens), ("--dec-seqlens", dec_seqlens))
           for s in grid if sp and s % tp]
    if bad:
        raise DynaPipeError(f"--sequence-parallel splits every sequence over the {tp} tensor-parallel ranks, but "
                            f"{bad[0][0]} holds {bad[0][1]}, not a multiple of {tp}; use multiples of {tp}.")
    if tp > 1 and torch.cuda.is_available() and torch.cuda.device_count() < tp:
        raise DynaPipeError(f"--tensor-model-parallel-size {tp} needs {tp} GPUs on this machine, which has "
                            f"{torch.cuda.device_count()}; profile with a TP size of at most that.")
    return tp, sp
