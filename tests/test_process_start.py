"""How local ranks start: forked from a server that imported torch and megatron-core once and
froze what the imports made, so no rank's garbage collector walks it."""
import gc

import pytest


def _rank_gc_state() -> dict:
    import megatron.core.models.gpt  # noqa: F401  (preloaded by the launcher's server)

    gc.collect()
    return dict(frozen=gc.get_freeze_count(), tracked=len(gc.get_objects()))


def test_ranks_fork_from_a_server_whose_imports_are_frozen():
    from dynapipe.runtime.process_start import rank_start_method
    from megatron_integration.launch import spawn

    if rank_start_method() != "forkserver":
        pytest.skip("ranks are spawned where CUDA is available")
    for state in spawn(_rank_gc_state, 2, timeout_s=120):
        # torch and megatron-core leave a few hundred thousand objects; unfrozen, every full
        # collection of every rank walks them (about 0.3 s each on a 2-core host).
        assert state["frozen"] > 100_000 and state["tracked"] < state["frozen"] // 20, state
