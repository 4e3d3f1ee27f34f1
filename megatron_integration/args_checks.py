"""One-line errors shared by the argument modules: a required flag, a value out of range,
a Megatron-LM flag this build does not support. Each names the flag as typed on the
command line (``--global-batch-size``), so the message says what to change.

No torch or megatron import.
"""
from __future__ import annotations

from dynapipe.errors import DynaPipeError


def _need(args, flag: str, value):
    if value is None:
        raise DynaPipeError(f"--{flag} is required.")
    return value


def _positive(flag: str, value, allow_zero: bool = False):
    if value is None:
        return value
    if value < 0 or (value == 0 and not allow_zero):
        raise DynaPipeError(f"--{flag} {value}: must be {'non-negative' if allow_zero else 'positive'}.")
    return value


def _unsupported(flag: str, reason: str) -> DynaPipeError:
    return DynaPipeError(f"{flag} is a Megatron-LM flag that dynapipe-megatron does not support: {reason}")
