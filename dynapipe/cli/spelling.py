"""How the ``python -m dynapipe`` commands' errors name the planning layers' parameters: by
the flags of these commands (``num_stages`` is ``--stages``). ``bench`` and ``profile`` read
Megatron's arguments: ``bench`` spells its errors as a training job does, and ``profile``
names its Megatron flags."""
from __future__ import annotations

CLI_SPELLING = {
    "method": "--batching", "dp": "--dp", "micro_batch_size": "--micro-batch-size", "max_tokens": "--max-tokens",
    "seq_length": "--seq-length", "seq_length[0]": "--seq-length", "seq_length[1]": "--decoder-seq-length",
    "num_stages": "--stages", "gpus": "--gpus", "tp_sizes": "--tp-sizes", "tp": "--tp",
    "sequence_parallel": "--sequence-parallel", "memory_limit_mib": "--memory-limit-mb",
    "tokens_per_iteration": "--tokens-per-iteration", "batches": "--batches", "lengths": "--lengths",
    "schedule": "--schedule", "placement": "--placement", "recompute": "--recompute",
    "split_backward": "--no-split-backward", "samples": "--samples", "seed": "--seed",
}

#: Commands whose flags are Megatron's: their spelling instead of CLI_SPELLING.
COMMAND_SPELLING = {
    "bench": {},  # spelled by the command itself, as megatron_integration spells a training job's
    "profile": {"tp": "--tensor-model-parallel-size", "sequence_parallel": "--sequence-parallel",
                "seq_length": "--seq-length", "vocab_size": "--vocab-size"},
}


def spelling_of(command: str) -> dict:
    """The parameter-to-flag spelling of ``command``'s errors."""
    return COMMAND_SPELLING.get(command, CLI_SPELLING)
