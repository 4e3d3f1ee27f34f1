"""Fail-safety battery, plan files and store payloads: every byte region of a real plan set
(through ``dynapipe validate``) and of a store payload flipped or cut; plan files swapped,
dropped or replaced by foreign ones.

Each must be refused with one line: an accepted damaged plan would run a wrong schedule on
every rank. The plan format's own tests (``test_plan_bytes.py``) cover each mechanism; here
real files are attacked through the paths a user or a rank takes.
"""
from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from dynapipe.cli import main as dynapipe_main
from dynapipe.errors import DynaPipeError

from failsafe_common import one_line_error


@pytest.fixture(scope="module")
def plan_set(tmp_path_factory):
    """A complete plan set (2 replicas x 2 stages, gpt-tiny) written by ``plan --plan-out``."""
    d = tmp_path_factory.mktemp("plans")
    lengths = d / "lengths.txt"
    lengths.write_text("\n".join(str(n) for n in (37, 120, 64, 250, 18, 90, 300, 75, 140, 33, 61, 210)) + "\n")
    out = d / "set"
    assert dynapipe_main(["plan", "--lengths", str(lengths), "--model", "gpt-tiny", "--device", "cpu",
                          "--stages", "2", "--dp", "2", "--plan-out", str(out), "--output", str(d / "plan.json")]) == 0
    names = sorted(os.listdir(out))
    assert len(names) == 4
    return out, names


def _validate_copy(capsys, plan_set, tmp_path, mutate):
    src, names = plan_set
    dst = tmp_path / "set"
    shutil.copytree(src, dst)
    mutate(dst, names)
    capsys.readouterr()
    rc = dynapipe_main(["validate", str(dst)])
    _, err = capsys.readouterr()
    return rc, err


def _flip_plan_byte(fraction):
    def mutate(d, names):
        path = d / names[-1]
        data = bytearray(path.read_bytes())
        data[min(int(len(data) * fraction), len(data) - 1)] ^= 0x10
        path.write_bytes(bytes(data))
    return mutate


def _cut_plan(fraction):
    def mutate(d, names):
        path = d / names[0]
        data = path.read_bytes()
        path.write_bytes(data[:int(len(data) * fraction)])
    return mutate


@pytest.mark.parametrize("fraction", [i / 24 for i in range(24)] + [0.999], ids=lambda f: f"at{f:.3f}")
def test_a_flipped_plan_file_bit_is_refused(capsys, plan_set, tmp_path, fraction):
    one_line_error(*_validate_copy(capsys, plan_set, tmp_path, _flip_plan_byte(fraction)))


@pytest.mark.parametrize("fraction", [0.0, 0.01, 0.05, 0.2, 0.5, 0.8, 0.95, 0.999])
def test_a_truncated_plan_file_is_refused(capsys, plan_set, tmp_path, fraction):
    one_line_error(*_validate_copy(capsys, plan_set, tmp_path, _cut_plan(fraction)))


@pytest.mark.parametrize("index", range(4))
def test_a_plan_set_missing_a_rank_is_refused(capsys, plan_set, tmp_path, index):
    rc, err = _validate_copy(capsys, plan_set, tmp_path, lambda d, names: os.remove(d / names[index]))
    one_line_error(rc, err)


@pytest.mark.parametrize("pair", [(0, 1), (0, 2), (1, 3), (2, 3)])
def test_swapped_plan_files_are_refused(capsys, plan_set, tmp_path, pair):
    def mutate(d, names):
        a, b = (d / names[i] for i in pair)
        da, db = a.read_bytes(), b.read_bytes()
        a.write_bytes(db)
        b.write_bytes(da)
    one_line_error(*_validate_copy(capsys, plan_set, tmp_path, mutate), "belongs in")


@pytest.mark.parametrize("kind", ["directory", "appended", "prepended", "other-set"])
def test_foreign_plan_files_are_refused(capsys, plan_set, tmp_path, kind):
    def mutate(d, names):
        path = d / names[1]
        if kind == "directory":
            path.unlink()
            path.mkdir()
        elif kind == "appended":
            path.write_bytes(path.read_bytes() + b"\0" * 7)
        elif kind == "prepended":
            path.write_bytes(b"#" + path.read_bytes())
        else:  # a plan of another layout in place of this one
            (d / "replica002-stage000.plan").write_bytes((d / names[0]).read_bytes())
    one_line_error(*_validate_copy(capsys, plan_set, tmp_path, mutate))


@pytest.fixture(scope="module")
def payload_bytes(plan_set):
    from dynapipe.runtime.plan_payload import encode_payload

    src, names = plan_set
    plan_bytes = (src / names[0]).read_bytes()
    tensors = {0: {"tokens": np.arange(96, dtype=np.int64).reshape(4, 24),
                   "loss_mask": np.ones((4, 24), np.float32)}}
    return encode_payload(0, 0, 0, plan_bytes, tensors, {"global_loss_tokens": 96})


@pytest.mark.parametrize("fraction", [i / 32 for i in range(32)] + [0.999], ids=lambda f: f"at{f:.3f}")
def test_a_flipped_payload_bit_is_refused(payload_bytes, fraction):
    from dynapipe.runtime.plan_payload import decode_payload

    bad = bytearray(payload_bytes)
    bad[min(int(len(bad) * fraction), len(bad) - 1)] ^= 0x04
    with pytest.raises(DynaPipeError) as e:
        decode_payload(bytes(bad))
    assert str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("fraction", [0.0, 0.001, 0.01, 0.1, 0.3, 0.5, 0.7, 0.9, 0.99])
def test_a_truncated_payload_is_refused(payload_bytes, fraction):
    from dynapipe.runtime.plan_payload import decode_payload

    with pytest.raises(DynaPipeError) as e:
        decode_payload(payload_bytes[:int(len(payload_bytes) * fraction)])
    assert str(e.value) and "\n" not in str(e.value)
