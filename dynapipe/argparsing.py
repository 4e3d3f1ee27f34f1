"""Strict argument parsing shared by every command line of the project.

A plain module below the command line, so that layers the command line calls (the
Megatron argument parser, the bench) can use it without importing ``dynapipe.cli``.

Python's ``int()`` accepts ``1_000``, surrounding blanks and any Unicode digit
(``"١٢"`` is 12), and ``float()`` accepts ``nan``, ``inf`` and ``1_0.5``: none of these is
what a person meant to type for a batch size or a learning rate, so they are refused
with one line naming the flag and the value. :class:`StrictArgumentParser` applies these
types to every ``type=int`` / ``type=float`` argument (through argparse's type registry,
so argument groups and subcommands get them too) and reports a bad command line in one
line (exit status 2) instead of argparse's usage block.
"""
from __future__ import annotations

import argparse
import math
import re
import sys
from typing import NoReturn

_INT = re.compile(r"[+-]?[0-9]+\Z")
_FLOAT = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?\Z")


def strict_int(text: str) -> int:
    """An integer written in ASCII digits (optional sign), nothing else."""
    if not isinstance(text, str) or not _INT.match(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer (write ASCII digits only, e.g. 1000)")
    return int(text, 10)


def strict_float(text: str) -> float:
    """A finite decimal number (``1e-3``, ``0.5``, ``12``); no nan, inf or underscores."""
    if not isinstance(text, str) or not _FLOAT.match(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number (write e.g. 0.001 or 1e-3)")
    value = float(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is out of range for a number (at most about 1.8e308)")
    return value


strict_int.__name__ = "integer"
strict_float.__name__ = "number"


class StrictArgumentParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` with strict ``int``/``float`` types, one-line errors, and whole
    flags only (no prefixes, as Megatron-LM's parser: a prefix would silently become whichever
    flag it starts, and another one added later would turn it into an error)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.register("type", int, strict_int)
        self.register("type", float, strict_float)

    def parse_known_args(self, args=None, namespace=None):
        # Kept for error(): whether a flag's value is missing or only looks like a flag.
        self._argv = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def _value_looks_like_a_flag(self, flag: str) -> bool:
        """Whether the word after ``flag`` on the command line starts with '-' and is none of this
        parser's flags: a value read as a flag, not a value left out (``--model --device cpu``)."""
        argv = getattr(self, "_argv", None) or []
        after = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == flag]
        return bool(after) and after[-1].startswith("-") and after[-1].split("=")[0] not in self._option_string_actions

    def error(self, message: str) -> NoReturn:
        """Print ``error: PROG: MESSAGE`` on one line and exit with status 2."""
        text = " ".join(message.split())
        flag = re.match(r"argument (\S+?)(?:/\S+)?: expected one argument\Z", text)
        if flag and flag.group(1).startswith("--") and self._value_looks_like_a_flag(flag.group(1)):
            # The value was there but starts with '-' (--shape -1,512), so argparse read it as a flag.
            text += f" (a value starting with '-' is written {flag.group(1)}=VALUE)"
        self.exit(2, f"error: {self.prog}: {text}; see {self.prog} --help.\n")


def print_error(message: str) -> None:
    """Print a user-facing error as one line on stderr (newlines folded)."""
    print("error: " + " ".join(str(message).split()), file=sys.stderr)
