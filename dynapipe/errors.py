"""User-facing errors.

A :class:`DynaPipeError` carries a message meant for the person running the job: it names
the offending value and says what would fix it. The command line prints it without a
traceback and exits with status 2; library callers can catch it like any exception.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Mapping, Optional

# How the running program spells the Python parameters its errors name: the command line and the
# training scripts map them to their flags (num_stages -> --stages); a library caller sees the
# parameter names it passed. Process-wide, as an entry point sets it once for its run.
_SPELLING: dict[str, str] = {}


def iteration_name(index: int) -> str:
    """``"iteration N"`` for the 0-based iteration ``index``. Messages count iterations from 1,
    as Megatron's log lines do; a plan's ``iteration`` field and the data loader count from 0."""
    return f"iteration {index + 1}"


class DynaPipeError(Exception):
    """Bad input or an impossible request, explained for the user (no traceback needed)."""


class RefusedArguments(DynaPipeError):
    """Several independent refusals of one command line, raised together so that one pass mends
    them all; ``errors`` holds each, and the message is one line per refusal."""

    def __init__(self, errors: list[DynaPipeError]):
        self.errors = list(errors)
        super().__init__("\n".join(" ".join(str(e).split()) for e in self.errors))


def raise_refused(errors: list[DynaPipeError]) -> None:
    """Raise nothing for no ``errors``, the error itself for one, :class:`RefusedArguments` for more."""
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise RefusedArguments(errors)


def refusal_of(text: str) -> DynaPipeError:
    """The error whose message is ``text`` (one line per refusal, as a rank posts
    ``"\\n".join(error_lines(e))`` to its peers): a :class:`RefusedArguments` for several lines."""
    lines = text.split("\n")
    return DynaPipeError(text) if len(lines) == 1 else RefusedArguments([DynaPipeError(x) for x in lines])


def error_lines(error: BaseException) -> list[str]:
    """The one-line messages of ``error`` as a user sees them: one per refusal of a
    :class:`RefusedArguments`, else its message with line breaks folded."""
    if isinstance(error, RefusedArguments):
        return str(error).split("\n")
    return [" ".join(str(error).split())]


class PlanError(DynaPipeError):
    """An execution plan that is malformed, corrupted or would deadlock."""


class NoScheduleFits(DynaPipeError):
    """No schedule of the micro-batches fits the memory limit at any recompute level (or,
    when asked to beat a time, none fits and runs faster): the cut itself must change."""


class ExecutorError(DynaPipeError):
    """A pipeline rank could not run its plan: a failed or timed-out transfer, a tensor that
    does not match the plan, a handler exception, or another rank's failure. The message
    names the rank, the instruction index and the peer."""


def arg(name: str, otherwise: Optional[str] = None) -> str:
    """How an error names the parameter ``name``: its command-line flag under an entry point
    that spelled it (:func:`spelled_as`), else ``otherwise`` (prose, for a fix that several
    functions reach under different parameter names) or ``name`` itself."""
    return _SPELLING.get(name, name if otherwise is None else otherwise)


def given(name: str, value) -> str:
    """The parameter ``name`` with the ``value`` it was given, as an error quotes them:
    ``--dp 0`` or ``--schedule zb-h1`` under the command line (as typed), ``dp=0`` or
    ``schedule='zb-h1'`` from Python."""
    return named(_SPELLING.get(name, name), value)


def named(label: str, value) -> str:
    """``label`` and ``value``: ``--flag value`` for a flag (a string quoted only when it is
    empty or holds a space), ``name=repr`` for a Python name."""
    # Floats as floats (2.0 where a whole number is wanted), numpy's without their type name.
    if isinstance(value, float):
        value = float(value)
    if label.startswith("-"):
        plain = isinstance(value, str) and value.strip() and not any(c.isspace() for c in value)
        return f"{label} {value if plain or not isinstance(value, str) else repr(value)}"
    return f"{label}={value!r}" if isinstance(value, (str, float)) else f"{label}={value}"


def shown(value, limit: int = 60) -> str:
    """``value`` as an error quotes a wrong argument: a config object by its type and name, any
    other by its repr, cut at ``limit`` characters (an ellipsis marks the cut)."""
    import dataclasses

    name = getattr(value, "name", None)
    if dataclasses.is_dataclass(value) and not isinstance(value, type) and isinstance(name, str):
        return f"{type(value).__name__}(name={name!r}, ...)"
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def spelling() -> dict[str, str]:
    """The current parameter-to-flag spelling (for worker processes to take over)."""
    return dict(_SPELLING)


def spelled_by(names: Mapping[str, str], fill_in: bool = False):
    """A decorator running the function under :func:`spelled_as` ``names`` (an entry point's
    ``main``); ``fill_in``: only the names the running program has not spelled already (a helper
    that a job spelling them its own way also calls)."""
    import functools

    def decorate(fn):
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            current = spelling() if fill_in else {}
            with spelled_as({k: v for k, v in names.items() if k not in current}):
                return fn(*args, **kwargs)
        return wrapped
    return decorate


@contextmanager
def spelled_as(names: Mapping[str, str]) -> Iterator[None]:
    """Within the block, errors name the parameters in ``names`` by their flags
    (``{"num_stages": "--stages"}``); the spelling before is restored afterwards."""
    before = dict(_SPELLING)
    _SPELLING.update(names)
    try:
        yield
    finally:
        _SPELLING.clear()
        _SPELLING.update(before)


def is_whole(value, at_least: int = 1) -> bool:
    """Whether ``value`` is a whole number (numpy's integers too; not a bool, a float or NaN)
    of at least ``at_least``."""
    import numbers

    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= at_least


def whole_number(name: str, value, at_least: int = 1) -> int:
    """``value`` as an int when it is a whole number of at least ``at_least`` (not a bool, a
    float or NaN), else a :class:`DynaPipeError` naming ``name`` and the value."""
    if not is_whole(value, at_least):
        raise DynaPipeError(f"{given(name, value)}: must be a whole number of at least {at_least}.")
    return int(value)


def real_number(name: str, value, at_least: float = 0.0, unlimited: bool = False) -> float:
    """``value`` as a float when it is a finite number of at least ``at_least`` (not a bool or
    a string; with ``unlimited``, +inf too, meaning no limit), else a :class:`DynaPipeError`
    naming ``name`` and the value."""
    import math

    if not _is_real(value) or (math.isinf(value) and not (unlimited and value > 0)) or value < at_least:
        raise DynaPipeError(f"{given(name, value)}: must be a finite number of at least {at_least:g}.")
    return float(value)


def positive_number(name: str, value, unit: str) -> float:
    """``value`` as a float when it is a finite number above 0 (not a bool or a string), else a
    :class:`DynaPipeError` naming ``name``, the value and its ``unit`` (``"s"``, ``"MiB"``)."""
    import math

    if not _is_real(value) or math.isinf(value) or value <= 0:
        raise DynaPipeError(f"{given(name, value)}: must be a finite number of {unit} above 0.")
    return float(value)


def _is_real(value) -> bool:
    """A real number that is not NaN (nor a bool, which Python counts as one)."""
    import math
    import numbers

    return not isinstance(value, bool) and isinstance(value, numbers.Real) and not math.isnan(value)


# Scalar field annotations (strings under postponed evaluation) and what each takes.
_FIELD_KINDS = {"int": "an integer", "float": "a number", "str": "a string", "bool": "true or false"}


def field_problem(name: str, value, annotation: str) -> Optional[str]:
    """Why ``value`` cannot be the dataclass field ``name`` annotated ``annotation`` (``int``,
    ``float``, ``str`` or ``bool``; others are not checked): the wrong type, a number that is not
    finite, or a ``name`` that is not one printable line. None when it can."""
    import math
    import numbers

    import numpy as np

    what = _FIELD_KINDS.get(annotation)
    if what is None:
        return None
    fits = {"int": lambda v: isinstance(v, numbers.Integral) and not isinstance(v, bool),
            "float": lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool),
            "str": lambda v: isinstance(v, str), "bool": lambda v: isinstance(v, (bool, np.bool_))}[annotation]
    if not fits(value):
        return f"{name}={value!r} must be {what}"
    if annotation in ("int", "float") and not math.isfinite(value):
        return f"{name}={value!r} must be a finite number"
    if name == "name" and not value.isprintable():
        # Names go into reports, traces and written run configs, one line each.
        return f"name={value!r} holds a line break or another control character; give a one-line name"
    return None


def check_fields(obj, source: str) -> None:
    """Refuse a config dataclass ``obj`` (built in code, say with ``dataclasses.replace``) whose
    scalar fields do not hold their annotated types, as loading it from YAML would; the
    error names ``source`` and the field."""
    import dataclasses

    for f in dataclasses.fields(obj):
        problem = field_problem(f.name, getattr(obj, f.name), f.type)
        if problem is not None:
            raise DynaPipeError(f"{source}: {problem}.")


def flag(name: str, value) -> bool:
    """``value`` when it is a bool (numpy's too), else a :class:`DynaPipeError`: a string such as
    ``"false"`` would otherwise count as true."""
    import numpy as np

    if not isinstance(value, (bool, np.bool_)):
        raise DynaPipeError(f"{given(name, value)}: must be True or False.")
    return bool(value)


def flags(**switches) -> None:
    """:func:`flag` for each keyword: ``flags(zero=zero, explain=explain)``."""
    for name, value in switches.items():
        flag(name, value)


@contextmanager
def file_read_errors(what: str, path: str, missing: str, directory: str, not_text: str) -> Iterator[None]:
    """Turn the errors of opening and reading ``path`` inside the block into one-line
    :class:`DynaPipeError` s that name the file as ``what 'path'``: missing (then ``missing``,
    the fix), a directory (then ``directory``), not decodable text (``not_text`` says what
    was expected), or any other OS error (its reason). Other exceptions pass through."""
    try:
        yield
    except FileNotFoundError:
        raise DynaPipeError(f"{what} {path!r} does not exist; {missing}") from None
    except IsADirectoryError:
        raise DynaPipeError(f"{what} {path!r} is a directory; {directory}") from None
    except UnicodeDecodeError:
        raise DynaPipeError(f"{what} {path!r} {not_text}") from None
    except OSError as e:
        raise DynaPipeError(f"{what} {path!r} cannot be read: {e.strerror}.") from None
