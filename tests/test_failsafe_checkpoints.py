"""Fail-safety battery, checkpoint files: flipped bits, truncation, missing or garbled checksum
files, a corrupted ``latest_checkpointed_iteration.txt``, an unusable ``--save`` directory.

A damaged checkpoint must be refused with one line naming the file, never loaded as if intact:
training would go on from wrong weights without a word. A whole job loading broken
checkpoints (every rank stops) is in ``test_failsafe_faults.py``.
"""
from __future__ import annotations

import os

import pytest

from dynapipe.errors import DynaPipeError

from failsafe_common import flip_byte, truncate_file


def _checkpoint_file(tmp_path, payload_bytes=4096):
    import torch

    from megatron_integration.checkpoint_files import save_with_checksum

    path = str(tmp_path / "model_optim_rng.pt")
    obj = {"w": torch.arange(payload_bytes // 4, dtype=torch.float32), "iteration": 3}
    save_with_checksum(lambda p: torch.save(obj, p), path)
    return path


def _load(path):
    import torch

    from megatron_integration.checkpoint_files import load_verified

    return load_verified(lambda p: torch.load(p, weights_only=True), path)


CORRUPTIONS = {
    "flip_first_byte": lambda p: flip_byte(p, 0),
    "flip_middle_byte": lambda p: flip_byte(p, os.path.getsize(p) // 2),
    "flip_last_byte": lambda p: flip_byte(p, os.path.getsize(p) - 1),
    "flip_one_bit": lambda p: flip_byte(p, os.path.getsize(p) // 3, 0x01),
    "flip_exponent_byte": lambda p: flip_byte(p, os.path.getsize(p) - 700, 0x40),
    "truncate_half": lambda p: truncate_file(p, os.path.getsize(p) // 2),
    "truncate_one": lambda p: truncate_file(p, -1),
    "truncate_to_one": lambda p: truncate_file(p, 1),
    "empty": lambda p: truncate_file(p, 0),
    "append": lambda p: open(p, "ab").write(b"\0"),
    "sidecar_missing": lambda p: os.remove(p + ".sha256"),
    "sidecar_garbage": lambda p: open(p + ".sha256", "w").write("zzz"),
    "sidecar_empty": lambda p: open(p + ".sha256", "w").close(),
    "sidecar_binary": lambda p: open(p + ".sha256", "wb").write(bytes(range(256))),
    "file_missing": lambda p: os.remove(p),
    "file_is_dir": lambda p: (os.remove(p), os.mkdir(p)),
    "replaced_by_other_checkpoint": lambda p: _replace_with_other(p),
}
CORRUPTION_NEEDLES = {"truncate_half": "truncated", "truncate_one": "truncated", "truncate_to_one": "truncated",
                      "empty": "empty", "append": "longer", "sidecar_missing": "no checksum",
                      "sidecar_garbage": "checksum file", "sidecar_empty": "checksum file",
                      "sidecar_binary": "checksum file", "file_missing": "missing", "file_is_dir": "directory"}


def _replace_with_other(path):
    import torch

    torch.save({"w": torch.zeros(3)}, path)


@pytest.mark.parametrize("name", sorted(CORRUPTIONS))
def test_corrupted_checkpoint_files_are_refused(tmp_path, name):
    path = _checkpoint_file(tmp_path)
    _load(path)  # intact: loads
    CORRUPTIONS[name](path)
    with pytest.raises(DynaPipeError) as e:
        _load(path)
    text = str(e.value)
    assert "\n" not in text and path in text
    assert CORRUPTION_NEEDLES.get(name, "corrupted") in text


LATEST = {"empty": b"", "word": b"abc", "negative": b"-1", "fullwidth": "\uff11\uff12".encode(), "binary": b"\xff\x00",
          "float": b"2.0", "underscore": b"1_0"}


@pytest.mark.parametrize("name", sorted(LATEST))
def test_corrupted_latest_iteration_file(tmp_path, name):
    from megatron_integration.checkpoint import LATEST as LATEST_NAME, latest_iteration

    (tmp_path / LATEST_NAME).write_bytes(LATEST[name])
    with pytest.raises(DynaPipeError, match="corrupted"):
        latest_iteration(str(tmp_path))


def test_latest_iteration_file_that_is_a_directory(tmp_path):
    from megatron_integration.checkpoint import LATEST as LATEST_NAME, latest_iteration

    (tmp_path / LATEST_NAME).mkdir()
    with pytest.raises(DynaPipeError, match="cannot be read"):
        latest_iteration(str(tmp_path))


def test_save_dir_is_checked_at_start_up(tmp_path):
    from megatron_integration.checkpoint_files import check_writable_dir

    check_writable_dir(str(tmp_path / "new" / "dir"))
    assert os.path.isdir(tmp_path / "new" / "dir") and os.listdir(tmp_path / "new" / "dir") == []
    (tmp_path / "f").write_text("x")
    for bad in (tmp_path / "f", tmp_path / "f" / "sub"):
        with pytest.raises(DynaPipeError, match="--save"):
            check_writable_dir(str(bad))


def test_a_saved_file_its_checksum_and_their_directory_reach_the_disk_before_anything_names_them(tmp_path,
                                                                                                  monkeypatch):
    # Renames and the tracker written after a save must not name data a node crash can lose.
    from megatron_integration.checkpoint_files import move_into_place, save_with_checksum

    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")) or real(fd))
    path = str(tmp_path / "model.pt")
    save_with_checksum(lambda p: open(p, "wb").write(b"weights"), path)
    assert synced == [path + ".tmp", path + ".sha256.tmp", str(tmp_path)], synced
    staging, iter_dir = tmp_path / "iter_0000001.saving", str(tmp_path / "iter_0000001")
    staging.mkdir()
    synced.clear()
    move_into_place(str(staging), iter_dir)
    assert synced == [str(tmp_path)]
