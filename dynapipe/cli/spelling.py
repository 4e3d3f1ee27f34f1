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
    "split_backward": "--no-split-backward", "n": "--samples", "seed": "--seed",
}
#: advise's own flags (it has no --stages, --dp, --schedule, ...: its errors name none of them).
ADVISE_SPELLING = {
    "gpus": "--gpus", "tp_sizes": "--tp-sizes", "memory_limit_mib": "--memory-limit-mb",
    "tokens": "--tokens-per-iteration", "tokens_per_iteration": "--tokens-per-iteration", "count": "--batches",
    "pool": "--lengths", "seq_length": "--seq-length", "seed": "--seed",
}

#: Commands spelled otherwise than CLI_SPELLING: advise (fewer flags), bench and profile (Megatron's).
COMMAND_SPELLING = {
    "advise": ADVISE_SPELLING,
    "bench": {},  # spelled by the command itself, as megatron_integration spells a training job's
    "profile": {"tp": "--tensor-model-parallel-size", "sequence_parallel": "--sequence-parallel",
                "seq_length": "--seq-length", "vocab_size": "--vocab-size"},
}


def spelling_of(command: str) -> dict:
    """The parameter-to-flag spelling of ``command``'s errors."""
    return COMMAND_SPELLING.get(command, CLI_SPELLING)
