"""How a training job's errors name the planning layers' parameters: by the Megatron-style flags
its user gave (``num_stages`` is ``--pipeline-model-parallel-size`` here, ``--stages`` to the
``plan`` command, itself from Python)."""
from __future__ import annotations

import functools
from typing import Callable, TypeVar

from dynapipe.errors import spelled_as, spelling

MEGATRON_SPELLING = {
    "num_stages": "--pipeline-model-parallel-size", "tp": "--tensor-model-parallel-size",
    "sequence_parallel": "--sequence-parallel", "micro_batch_size": "--micro-batch-size",
    "global_batch_size": "--global-batch-size", "seq_length": "--seq-length",
    "seq_length[0]": "--encoder-seq-length", "seq_length[1]": "--decoder-seq-length",
    "vocab_size": "--vocab-size",
    "method": "--dynapipe-batching", "schedule": "--dynapipe-schedule", "placement": "--dynapipe-placement",
    "recompute": "--dynapipe-recompute", "memory_limit_mib": "--dynapipe-memory-limit-mb",
    "max_tokens": "--dynapipe-max-tokens", "tokens_per_global_batch": "--dynapipe-tokens-per-global-batch",
    "num_workers": "--dynapipe-planner-workers", "prefetch": "--dynapipe-prefetch",
    "planner_nodes": "--dynapipe-planner-nodes", "kv_backend": "--dynapipe-kv-backend",
    "redis_host": "--dynapipe-redis-host", "redis_port": "--dynapipe-redis-port",
    "store_retry_s": "--dynapipe-store-retry-s", "n": "--dynapipe-mock-samples", "overlong": "--dynapipe-overlong",
    "dec_seq_length": "--decoder-seq-length",
}
# T5's sequence length is its encoder's.
T5_SPELLING = {**MEGATRON_SPELLING, "seq_length": "--encoder-seq-length"}

F = TypeVar("F", bound=Callable)


def megatron_spelled(fn: F) -> F:
    """``fn`` with the errors raised while it runs naming Megatron's flags (planner worker
    processes and spawned ranks it starts take the spelling over)."""
    return _spelled(fn, MEGATRON_SPELLING)


def t5_spelled(fn: F) -> F:
    """:func:`megatron_spelled` for the T5 entry points (the sequence length is the encoder's)."""
    return _spelled(fn, T5_SPELLING)


def _spelled(fn: F, names: dict) -> F:
    # Filling in, not overriding: a T5 job's spelling stays in force through the shared helpers
    # it calls (data_summary_lines is spelled for GPT jobs).
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        current = spelling()
        with spelled_as({k: v for k, v in names.items() if k not in current}):
            return fn(*args, **kwargs)
    return wrapped  # type: ignore[return-value]
