"""How a training job's errors name the planning layers' parameters: by the Megatron-style flags
its user gave (``num_stages`` is ``--pipeline-model-parallel-size`` here, ``--stages`` to the
``plan`` command, itself from Python)."""
from __future__ import annotations

from dynapipe.errors import spelled_by

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
    "rerun_mode": "--rerun-mode", "error_injection_rate": "--error-injection-rate",
    "error_injection_type": "--error-injection-type",
}
# T5's sequence length is its encoder's.
T5_SPELLING = {**MEGATRON_SPELLING, "seq_length": "--encoder-seq-length"}

# Filling in, not overriding: a T5 job's spelling stays in force through the shared helpers it
# calls (data_summary_lines is spelled for GPT jobs).
#: ``fn`` with the errors raised while it runs naming Megatron's flags (planner worker processes
#: and spawned ranks it starts take the spelling over).
megatron_spelled = spelled_by(MEGATRON_SPELLING, fill_in=True)
#: :data:`megatron_spelled` for the T5 entry points (the sequence length is the encoder's).
t5_spelled = spelled_by(T5_SPELLING, fill_in=True)
