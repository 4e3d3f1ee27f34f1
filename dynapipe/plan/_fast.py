"""Building many small immutable plan objects quickly."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc


def maker(cls):
    """A fast constructor for an instruction class: fills the frozen dataclass's
    ``__dict__`` directly (all fields, defaults included) instead of going through
    ``object.__setattr__`` field by field; equal and hashing equal to ``cls(**fields)``.
    A plan set holds tens of thousands of instructions, and this halves compile time."""
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    new = object.__new__

    def make(**fields):
        obj = new(cls)
        d = obj.__dict__
        d.update(defaults)
        d.update(fields)
        return obj
    return make



@contextlib.contextmanager
def gc_paused():
    """Pause the cyclic garbage collector while building many small immutable objects:
    a plan set holds tens of thousands of instructions, and the collections their
    allocation triggers find nothing to free but cost as much as the building itself."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def without_gc_pauses(fn):
    """``fn`` run under :func:`gc_paused` (same signature and docstring): for whole
    planning steps, whose objects (micro-batches, ops, plans) all stay alive."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        with gc_paused():
            return fn(*args, **kwargs)
    return run
