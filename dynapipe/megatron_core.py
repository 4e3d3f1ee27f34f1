"""Importing megatron-core with the missing-dependency failures users hit explained.

megatron-core is a dependency, but its import can still fail on a machine that installed it:
0.19 imports ``triton`` at load (its pipeline schedules reach a MoE kernel module) without
declaring it, and PyPI's CPU-only torch builds do not bring it, so on such a machine every
``import megatron.core`` raises ``No module named 'triton'``. Callers that need megatron-core
import it through :func:`require_megatron_core` first and stop with what to install.
"""
from __future__ import annotations

from importlib import metadata
from typing import Optional

from dynapipe.errors import DynaPipeError


def installed_version() -> str:
    """The installed megatron-core's version, or "" where none is installed."""
    try:
        return metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        return ""


def installed_release() -> Optional[tuple[int, int]]:
    """(major, minor) of the installed megatron-core, or None where it cannot be read."""
    try:
        major, minor = installed_version().split(".")[:2]
        return int(major), int("".join(c for c in minor if c.isdigit()) or 0)
    except ValueError:
        return None


# The releases this build's tests have run on: 0.16 (Python 3.11) to 0.19 (Python 3.12).
TESTED_RELEASES = ((0, 16), (0, 19))


def untested_release_note() -> Optional[str]:
    """A start-up warning when the installed megatron-core is outside :data:`TESTED_RELEASES`
    (None inside it, or where none is installed): the CPU shims and the checkpoint code follow
    megatron-core's internals, which move between releases."""
    release = installed_release()
    low, high = TESTED_RELEASES
    if release is None or low <= release <= high:
        return None
    return (f" > warning: megatron-core {installed_version()} is outside the releases this build is tested with "
            f"({low[0]}.{low[1]} to {high[0]}.{high[1]}); if a run fails inside megatron-core, install "
            f"'megatron-core>={low[0]}.{low[1]},<{high[0]}.{high[1] + 1}'")


def import_failure(missing: str, version: str, needed_for: str = "this command") -> DynaPipeError:
    """The error for an import of megatron-core that failed because the module ``missing`` is
    not installed, megatron-core ``version`` being installed ("": none)."""
    if not version:
        return DynaPipeError(f"{needed_for} needs megatron-core, which is not installed: pip install "
                             f"'megatron-core>=0.16.1' (next to torch; see the README's Installing by hand).")
    if missing == "triton":
        return DynaPipeError(f"megatron-core {version} imports triton, which it does not declare and which a CPU-only "
                             f"torch build does not bring; {needed_for} needs it: pip install triton (or "
                             f"megatron-core 0.16.1, which does not import it).")
    return DynaPipeError(f"megatron-core {version} cannot be imported: it needs the module {missing!r}, which is not "
                         f"installed ({needed_for} needs megatron-core).")


def require_megatron_core(needed_for: str = "this command"):
    """The ``megatron.core`` module; raises :class:`DynaPipeError` naming what to install when
    it or a dependency of it is missing (``needed_for``: what the import was for)."""
    try:
        import megatron.core as core
    except ModuleNotFoundError as e:
        raise import_failure(e.name or str(e), installed_version(), needed_for) from None
    return core
