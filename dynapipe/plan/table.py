"""Instructions as columns: one int32 row per instruction, objects built only on demand.

A plan set at cluster scale holds about a million instructions (PP8 x DP64, 100,000
samples). Building a Python object for each costs more than planning itself, yet the
compiler, the binary encoding and most checks only need the numbers. An
:class:`InstructionTable` stores them as one ``(n, NCOLS)`` int32 array plus a string
table and a table of tensor lists; it behaves as a read-only sequence of
:class:`~dynapipe.plan.instructions.Instruction` objects (built on first access, once),
so code that iterates a plan's instructions is unchanged.

Columns (:data:`COLUMNS`): ``op`` (index into :data:`OPCODES`), ``mb``, ``chunk``, ``peer``,
``group``, ``buffer``, ``tensors``, ``mbs``, ``seqlen``, ``dec_seqlen``, ``recompute``,
``part``. String columns hold an index into ``strings``; ``buffer`` may instead hold
``-1 - k``, meaning the canonical name ``buffer_name(BUFFER_KINDS[k], mb, chunk)`` of
the row, so the compiler never formats a buffer name. ``tensors`` indexes
``tensor_lists`` (-1: none). Columns a row's class does not have are 0.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from dynapipe.errors import PlanError
from dynapipe.plan._fast import gc_paused, maker
from dynapipe.plan.instructions import BUFFER_KINDS, INSTRUCTION_TYPES, Instruction, TensorSpec

OPCODES = tuple(INSTRUCTION_TYPES)
OPCODE_INDEX = {op: i for i, op in enumerate(OPCODES)}
COLUMNS = ("op", "mb", "chunk", "peer", "group", "buffer", "tensors", "mbs", "seqlen", "dec_seqlen",
           "recompute", "part")
NCOLS = len(COLUMNS)
COL = {c: i for i, c in enumerate(COLUMNS)}
_STR_FIELDS = ("buffer", "recompute", "part")
_INT32 = (-(1 << 31), (1 << 31) - 1)


def _class_fields(cls) -> tuple[str, ...]:
    names = tuple(f.name for f in dataclasses.fields(cls) if f.init)
    unknown = [n for n in names if n not in COL]
    if unknown:
        raise PlanError(f"instruction {cls.__name__} has field(s) {unknown} the plan table cannot hold.")
    return names


_CLASSES = [INSTRUCTION_TYPES[op] for op in OPCODES]
_FIELDS = [_class_fields(c) for c in _CLASSES]
_MAKERS = [maker(c) for c in _CLASSES]


class InstructionTable(Sequence):
    """A read-only sequence of instructions stored as columns (see the module docstring)."""

    __slots__ = ("rows", "strings", "tensor_lists", "_objects")

    def __init__(self, rows: np.ndarray, strings: Sequence[str], tensor_lists: Sequence[tuple[TensorSpec, ...]]):
        self.rows = rows
        self.strings = tuple(strings)
        self.tensor_lists = tuple(tensor_lists)
        self._objects = None

    # -- sequence of Instruction objects ------------------------------------------------
    def __len__(self) -> int:
        return self.rows.shape[0]

    def objects(self) -> tuple[Instruction, ...]:
        """Every instruction as an object (built once, then cached)."""
        if self._objects is None:
            self._objects = self._build()
        return self._objects

    def __getitem__(self, k):
        return self.objects()[k]

    def __iter__(self):
        return iter(self.objects())

    def __add__(self, other):
        """Concatenation gives a tuple of instructions, as it would for a tuple."""
        if isinstance(other, (tuple, InstructionTable)):
            return self.objects() + tuple(other)
        return NotImplemented

    def __radd__(self, other):
        if isinstance(other, tuple):
            return other + self.objects()
        return NotImplemented

    def __eq__(self, other) -> bool:
        if isinstance(other, InstructionTable):
            if other is self:
                return True
            return tuple(self) == tuple(other)
        if isinstance(other, tuple):
            return self.objects() == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.objects())

    def __repr__(self) -> str:
        return f"InstructionTable({len(self)} instructions)"

    def _build(self) -> tuple[Instruction, ...]:
        # Class by class: each field's column is read once as a Python list, then the
        # objects of that class are made in one loop (about a microsecond each).
        strings, lists = self.strings, self.tensor_lists
        rows = self.rows
        out: list = [None] * len(rows)
        ops = rows[:, 0]
        with gc_paused():
            for op in np.unique(ops).tolist():
                where = np.flatnonzero(ops == op)
                sub = rows[where]
                names = _FIELDS[op]
                values = []
                for name in names:
                    col = sub[:, COL[name]].tolist()
                    if name == "tensors":
                        col = [lists[v] if v >= 0 else () for v in col]
                    elif name == "buffer":
                        mbs, chunks = sub[:, 1].tolist(), sub[:, 2].tolist()
                        col = [strings[v] if v >= 0 else f"{BUFFER_KINDS[-1 - v]}:{m}:{c}"
                               for v, m, c in zip(col, mbs, chunks)]
                    elif name in _STR_FIELDS:
                        col = [strings[v] for v in col]
                    values.append(col)
                make = _MAKERS[op]
                for k, vals in zip(where.tolist(), zip(*values)):
                    out[k] = make(**dict(zip(names, vals)))
        return tuple(out)

    # -- checks on the columns ----------------------------------------------------------
    def check(self, what: str = "instruction table") -> None:
        """Raise :class:`PlanError` unless every column holds a value its row can use."""
        r = self.rows
        if r.ndim != 2 or r.shape[1] != NCOLS:
            raise PlanError(f"{what}: expected {NCOLS} columns, got shape {list(r.shape)}.")
        if not len(r):
            return
        op = r[:, 0]
        bad = np.flatnonzero((op < 0) | (op >= len(OPCODES)))
        if bad.size:
            raise PlanError(f"{what}: instruction {bad[0]} has unknown opcode number {op[bad[0]]}.")
        ns, nt = len(self.strings), len(self.tensor_lists)
        buf = r[:, COL["buffer"]]
        checks = [("buffer", (buf >= ns) | (buf < -len(BUFFER_KINDS)), f"a string index below {ns}"),
                  ("tensors", (r[:, COL["tensors"]] < -1) | (r[:, COL["tensors"]] >= nt),
                   f"a tensor-list index below {nt}"),
                  ("recompute", (r[:, COL["recompute"]] < 0) | (r[:, COL["recompute"]] >= ns),
                   f"a string index below {ns}"),
                  ("part", (r[:, COL["part"]] < 0) | (r[:, COL["part"]] >= ns), f"a string index below {ns}")]
        for name, mask, want in checks:
            has = _has_field(op, name)
            bad = np.flatnonzero(mask & has)
            if bad.size:
                k = int(bad[0])
                raise PlanError(f"{what}: instruction {k} ({OPCODES[op[k]]}) field {name!r} is "
                                f"{int(r[k, COL[name]])}, not {want}.")


def _has_field(op: np.ndarray, name: str) -> np.ndarray:
    classes = np.array([name in f for f in _FIELDS])
    return classes[op]


def table_of(instructions: Sequence[Instruction]) -> InstructionTable:
    """The instructions as an :class:`InstructionTable` (itself when it already is one)."""
    if isinstance(instructions, InstructionTable):
        return instructions
    strings: dict[str, int] = {}
    lists: dict = {}
    list_by_id: dict[int, int] = {}
    rows = []
    for k, inst in enumerate(instructions):
        op = OPCODE_INDEX.get(getattr(type(inst), "OPCODE", None))
        if op is None or type(inst) is not _CLASSES[op]:
            raise PlanError(f"instruction {k} ({inst!r}) is not a plan instruction.")
        row = [0] * NCOLS
        row[0] = op
        for name in _FIELDS[op]:
            v = getattr(inst, name)
            if name == "tensors":
                j = list_by_id.get(id(v))
                if j is None:
                    if type(v) is not tuple or not all(type(t) is TensorSpec for t in v):
                        raise PlanError(f"instruction {k} ({inst.OPCODE}) field 'tensors' must be a tuple of "
                                        f"TensorSpec, got {v!r}.")
                    j = lists.setdefault(v, len(lists))
                    list_by_id[id(v)] = j
                v = j
            elif name in _STR_FIELDS:
                if type(v) is not str:
                    raise PlanError(f"instruction {k} ({inst.OPCODE}) field {name!r} must be a string, got {v!r}.")
                v = strings.setdefault(v, len(strings))
            elif type(v) is not int or not _INT32[0] <= v <= _INT32[1]:
                raise PlanError(f"instruction {k} ({inst.OPCODE}) field {name!r} must be a 32-bit integer, "
                                f"got {v!r}.")
            row[COL[name]] = v
        rows.append(row)
    arr = np.array(rows, dtype=np.int32).reshape(len(rows), NCOLS)
    table = InstructionTable(arr, tuple(strings), tuple(lists))
    if isinstance(instructions, tuple):
        table._objects = instructions
    return table
