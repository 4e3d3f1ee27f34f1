"""Helpers the fail-safety modules (``test_failsafe_*.py``) share.

Every bad input must end in one clear line (``error: ...``) and exit status 2; ``one_line_error``
is that check, in one place so that every module holds the same bar. The ``files`` fixture is
imported by the modules that point commands at bad files (a fixture lives where a test module
can import it; pytest finds it in the importing module's namespace).
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from dynapipe.cli import main as dynapipe_main

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
PY = sys.executable

# Valid arguments of a tiny GPT for scripts/pretrain_gpt.py: each case adds one bad flag.
TRAIN_BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --micro-batch-size 2 "
              "--global-batch-size 4 --train-iters 2 --lr 1e-3 --mock-data").split()


def one_line_error(rc, err: str, *needles: str) -> str:
    """The single error line of a failed command; asserts status 2 and no traceback."""
    assert rc == 2, f"exit status {rc}, stderr: {err!r}"
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one line, got {len(lines)}: {err!r}"
    assert lines[0].startswith("error: "), lines[0]
    for needle in needles:
        assert needle in lines[0], f"{needle!r} not in {lines[0]!r}"
    return lines[0]


def run_cli(capsys, argv):
    rc = dynapipe_main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Named bad (and a few good) input files."""
    d = tmp_path_factory.mktemp("inputs")
    f = {}

    def text(name, content):
        p = d / name
        p.write_text(content, encoding="utf-8")
        f[name] = str(p)

    def raw(name, content: bytes):
        p = d / name
        p.write_bytes(content)
        f[name] = str(p)

    raw("binary", bytes(range(256)) * 8)
    raw("empty", b"")
    (d / "a_dir").mkdir()
    f["a_dir"] = str(d / "a_dir")
    f["missing"] = str(d / "no-such-file")
    f["under_file"] = str(d / "binary" / "x")
    text("good_lengths", "100\n200\n50\n")
    text("deep.yaml", "a: " + "[" * 800 + "]" * 800 + "\n")
    text("deep.json", "[" * 100000 + "]" * 100000)
    return f


def fill_paths(args, files):
    """``args`` with ``{name}`` replaced by the path of that file of ``files``."""
    return [a.format(**files) if "{" in a else a for a in args]


def write_indexed(path, seqs, dtype=np.int32):
    from dynapipe.data.indexed import write_indexed_dataset

    write_indexed_dataset(str(path), [np.asarray(s) for s in seqs], dtype=dtype)
    return str(path)


def truncate_file(path, size):
    """Cut ``path`` to ``size`` bytes; a negative ``size`` removes that many from the end."""
    with open(path, "r+b") as f:
        f.truncate(size if size >= 0 else os.path.getsize(path) + size)


def flip_byte(path, offset, mask=0xFF):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([b ^ mask]))
