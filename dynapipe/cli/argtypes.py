"""Strict argument parsing for the command line: see :mod:`dynapipe.argparsing`, where it lives."""
from dynapipe.argparsing import StrictArgumentParser, print_error, strict_float, strict_int

__all__ = ["StrictArgumentParser", "print_error", "strict_float", "strict_int"]
