"""megatron-core imported with its missing dependencies explained (dynapipe/megatron_core.py).

megatron-core 0.19 imports triton without declaring it, and a CPU-only torch build does not
bring it. Each case runs in a fresh interpreter where the import fails as it does on such a
machine (a finder raising the import system's own error for the module that is missing), and
the command or library call stops with one line naming what to install, not a traceback.
"""
import subprocess
import sys
import textwrap

import pytest

_MISSING = """
import sys

class Missing:
    # What the import system raises when a module imported by megatron-core is not installed.
    def __init__(self, importing, missing):
        self.importing, self.missing = importing, missing

    def find_spec(self, name, path=None, target=None):
        if name == self.importing:
            raise ModuleNotFoundError(f"No module named {{self.missing!r}}", name=self.missing)
        return None

sys.meta_path.insert(0, Missing({importing!r}, {missing!r}))
"""


def _run(importing: str, missing: str, body: str) -> str:
    code = _MISSING.format(importing=importing, missing=missing) + textwrap.dedent(body)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    return done.stdout + done.stderr


@pytest.mark.parametrize("missing, expect", [
    ("triton", "imports triton, which it does not declare"),
    ("einops", "it needs the module 'einops', which is not installed"),
])
def test_a_missing_megatron_dependency_names_what_to_install(missing, expect):
    out = _run("megatron.core", missing, """
        from dynapipe.errors import DynaPipeError
        from dynapipe.megatron_core import require_megatron_core
        try:
            require_megatron_core("the test")
        except DynaPipeError as e:
            print("ERROR:", e)
        """)
    assert "ERROR:" in out and expect in out, out
    if missing == "triton":
        assert "pip install triton" in out


def test_the_tokenizer_says_so_too_and_the_indexed_reader_does_not_need_megatron_core(tmp_path):
    import numpy as np

    from dynapipe.data.indexed import write_indexed_dataset

    write_indexed_dataset(str(tmp_path / "corpus"), [np.arange(2, 9), np.arange(3, 6)])
    out = _run("megatron.core", "triton", f"""
        import sys
        from dynapipe.errors import DynaPipeError
        from dynapipe.data.tokenizer import load_megatron_tokenizer
        from dynapipe.data.indexed import MegatronIndexedDataset
        from dynapipe.data.samples import LengthLimits
        try:
            load_megatron_tokenizer(metadata={{"library": "byte-level"}})
        except DynaPipeError as e:
            print("ERROR:", e)
        # What a planner worker does: open the files, read a planned sample's tokens.
        ds = MegatronIndexedDataset({str(tmp_path / "corpus")!r}, LengthLimits(64))
        print("READ:", ds[1].target_ids.tolist(), "megatron.core" in sys.modules)
        """)
    assert out.count("ERROR:") == 1 and "pip install triton" in out and "a Megatron tokenizer needs it" in out, out
    assert "READ: [3, 4, 5] False" in out, out


def test_without_megatron_core_the_error_says_to_install_it():
    from dynapipe.megatron_core import import_failure

    e = import_failure("megatron", "", "the bench")
    assert str(e).startswith("the bench needs megatron-core, which is not installed: pip install 'megatron-core>=0.16.1'")
    assert "pip install triton" in str(import_failure("triton", "0.19.2"))


def test_an_installed_megatron_core_imports():
    from dynapipe.megatron_core import require_megatron_core

    assert require_megatron_core().__name__ == "megatron.core"


@pytest.mark.parametrize("version, warned", [("0.15.3", True), ("0.16.1", False), ("0.19.2", False),
                                             ("0.20.0rc1", True), ("1.0.0", True), ("", False)])
def test_a_megatron_core_release_outside_the_tested_ones_is_warned_at_start_up(monkeypatch, version, warned):
    # The CPU shims skip what a release does not have: a later one installs cleanly and could fail
    # deep inside megatron-core, so the run says first that it is untested.
    from dynapipe import megatron_core

    monkeypatch.setattr(megatron_core, "installed_version", lambda: version)
    note = megatron_core.untested_release_note()
    assert (note is not None) == warned
    if warned:
        assert f"megatron-core {version} is outside the releases this build is tested with (0.16 to 0.19)" in note
        assert "'megatron-core>=0.16,<0.20'" in note
