"""Non-persistent checkpoints' flags, directories and the choice of the newer checkpoint, in one
process; saved and resumed by a real two-stage job in ``test_failsafe_faults.py``."""
import argparse
import os
import re

import pytest

from dynapipe.errors import DynaPipeError
from megatron_integration.non_persistent import (NonPersistentArgs, load_root, newer_load, non_persistent_from_args,
                                                 other_checkpoints, save_root)


def flags(**kw):
    base = dict(non_persistent_save_interval=None, non_persistent_ckpt_type=None,
                non_persistent_global_ckpt_dir=None, save="/ckpt", load=None)
    return argparse.Namespace(**{**base, **kw})


def test_the_flags_are_megatron_lms_and_what_would_do_nothing_is_refused():
    assert non_persistent_from_args(flags()) == NonPersistentArgs()
    assert non_persistent_from_args(flags(non_persistent_save_interval=5, non_persistent_ckpt_type="global")) == \
        NonPersistentArgs(5, "global", None)
    assert non_persistent_from_args(flags(non_persistent_save_interval=0)) == NonPersistentArgs()  # 0: off
    for kw, said in ((dict(non_persistent_save_interval=5), "needs --non-persistent-ckpt-type global"),
                     (dict(non_persistent_save_interval=5, non_persistent_ckpt_type="global", save=None),
                      "--save is not given"),
                     (dict(non_persistent_save_interval=-1, non_persistent_ckpt_type="global"), "(0: off)"),
                     (dict(non_persistent_global_ckpt_dir="/old", non_persistent_ckpt_type="global", load="/old"),
                      "is --load itself"),
                     (dict(non_persistent_ckpt_type="local"), "node-local checkpoints (nvidia-resiliency-ext) are "
                                                               "not built"),
                     (dict(non_persistent_global_ckpt_dir="/np"), "is read with --non-persistent-ckpt-type global"),
                     (dict(non_persistent_global_ckpt_dir="/ckpt", non_persistent_ckpt_type="global"),
                      "is --save itself")):
        with pytest.raises(DynaPipeError, match=re.escape(said)):
            non_persistent_from_args(flags(**kw))


def _cfg(tmp_path, **np):
    from dataclasses import replace

    from test_megatron_example_flags import GPT3, parse

    cfg = parse(GPT3)
    return replace(cfg, save=str(tmp_path / "save"), load=str(tmp_path / "save"), non_persistent=NonPersistentArgs(**np))


def _tracker(root, iteration):
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(iteration))


def test_the_newer_checkpoint_is_loaded_and_loads_own_on_a_tie(tmp_path):
    lines = []

    def choose(cfg):
        return newer_load(cfg, lines.append)
    cfg = _cfg(tmp_path, save_interval=1, ckpt_type="global")
    root = os.path.join(cfg.save, "non_persistent")
    assert save_root(cfg) == root and load_root(cfg) == root
    assert choose(cfg) is cfg and lines == []  # nothing saved yet
    _tracker(cfg.save, 4)
    _tracker(root, 5)
    assert choose(cfg).load == root
    assert lines[-1] == f"loading the non-persistent checkpoint of iteration 5 from {root} (--load's is of iteration 4)"
    _tracker(root, 4)  # a tie: --load's, whose checkpoint alone holds a rerun record
    assert choose(cfg) is cfg
    assert lines[-1] == (f"the non-persistent checkpoint of iteration 4 in {root} is not newer than --load's (of "
                         f"iteration 4): loading --load's")
    _tracker(cfg.save, "release")
    assert choose(cfg).load == root and lines[-1].endswith("(--load's is a release)")
    _tracker(root, "release")
    with pytest.raises(DynaPipeError, match="names a release checkpoint, which non-persistent checkpoints never are"):
        choose(cfg)
    # Without the type, or without --load, nothing non-persistent is loaded; another directory is read.
    assert load_root(_cfg(tmp_path)) is None
    from dataclasses import replace
    assert load_root(replace(cfg, load=None)) is None
    other = _cfg(tmp_path, ckpt_type="global", global_dir=str(tmp_path / "np"))
    assert save_root(other) == load_root(other) == str(tmp_path / "np")


def test_every_other_checkpoint_is_deleted_interrupted_and_stale_ones_included(tmp_path):
    for name in ("iter_0000001", "iter_0000002.saving", "iter_0000003", "iter_0000009", "iter_x",
                 "latest_checkpointed_iteration.txt"):
        (tmp_path / name).mkdir() if name.startswith("iter_") else (tmp_path / name).write_text("3")
    assert other_checkpoints(str(tmp_path), 3) == [str(tmp_path / n) for n in ("iter_0000001", "iter_0000002.saving",
                                                                               "iter_0000009")]
    assert other_checkpoints(str(tmp_path / "missing"), 3) == []
