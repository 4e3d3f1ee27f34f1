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


def _one_of(args, flag_a: str, flag_b: str):
    """The value of ``--flag_a`` or of ``--flag_b``, two spellings of one Megatron-LM setting
    (``--num-layers`` / ``--encoder-num-layers``): both given is refused, as Megatron-LM does;
    neither given is None."""
    a, b = getattr(args, flag_a.replace("-", "_"), None), getattr(args, flag_b.replace("-", "_"), None)
    if a is not None and b is not None:
        raise DynaPipeError(f"--{flag_a} {a} and --{flag_b} {b} were both given; they are the same setting "
                            f"(as in Megatron-LM), give one.")
    return a if a is not None else b


def typed_flag(args, flag_a: str, flag_b: str) -> str:
    """``--flag_a`` where the user typed it, else ``--flag_b``: of two spellings of one setting
    (see :func:`_one_of`), the one an error should name."""
    return f"--{flag_a}" if getattr(args, flag_a.replace("-", "_"), None) is not None else f"--{flag_b}"


def _unsupported(flag: str, reason: str) -> DynaPipeError:
    return DynaPipeError(f"{flag} is a Megatron-LM flag that dynapipe-megatron does not support: {reason}")


def _unsupported_value(flag: str, value, reason: str) -> DynaPipeError:
    """A value of a flag this build takes that it cannot honour (the flag itself is supported)."""
    return DynaPipeError(f"{flag} {value} is not supported by dynapipe-megatron: {reason}")


def _fraction(flag: str, value: float, low_open: bool = False, high_open: bool = True, default=None) -> float:
    """``value`` of ``--flag`` inside the unit interval, each end open or closed as Megatron-LM
    reads that flag; ``default`` (Megatron-LM's) is named in the error when given."""
    if (value > 0.0 if low_open else value >= 0.0) and (value < 1.0 if high_open else value <= 1.0):
        return value
    interval = f"{'(' if low_open else '['}0, 1{')' if high_open else ']'}"
    hint = f" (Megatron-LM's default {default})" if default is not None else ""
    raise DynaPipeError(f"--{flag} {value}: must be in {interval}{hint}.")
