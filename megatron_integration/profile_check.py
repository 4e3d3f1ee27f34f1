"""Start-up checks of a ``--dynapipe-cost-model`` profile against the run, before any model is built.

The planner prices every micro-batch from the profile's tables; a profile of another model,
precision, tensor-parallel layout or device would misprice all of them without a word. The
planning layers refuse what they can see (layer shape, dtype, TP, device class,
:class:`dynapipe.cost.profile.ProfileCostModel`); this module runs those checks at argument
time and adds what only Megatron's arguments carry (dropout, position embeddings), so a wrong
profile stops the job in one line before minutes of model and data set-up.
"""
from __future__ import annotations

from typing import Any, Mapping

from dynapipe.config import ModelConfig
from dynapipe.errors import DynaPipeError


def check_profile_for_run(path: str, model: ModelConfig, num_stages: int, tp: int,
                          sequence_parallel: bool, device: str, device_given: bool, layer_spec: str) -> None:
    """Refuse the profile at ``path`` for this run: ``model`` the planner's model (its layer shape,
    dtype, dropout and positions are compared with what the profile measured), ``device`` the ``--dynapipe-device`` config (``device_given``: named on the command line, so the
    GPU model is compared too), ``layer_spec`` the layers the stages are built from (``local`` or
    ``transformer_engine``). Raises :class:`DynaPipeError` naming the value and the fix."""
    from dynapipe.config import load_device_config
    from dynapipe.cost.profile import ProfileCostModel
    from dynapipe.cost.profile_checks import read_profile
    from dynapipe.cost.profile_device import check_profile_device
    from dynapipe.runtime.plan_source import tensor_parallel_of

    source = f"--dynapipe-cost-model {path}"
    data = read_profile(path)
    if isinstance(data, dict):  # anything else is refused by ProfileCostModel, naming the file
        check_profile_device(data, load_device_config(device), source,
                             "--dynapipe-device" if device_given else "the default --dynapipe-device",
                             compare_model=device_given)
    ProfileCostModel(model, data, num_stages, source=source, tp=tensor_parallel_of(tp, sequence_parallel))
    measured = data.get("layer_spec")
    if measured is not None and measured != layer_spec:
        # Transformer Engine's fused layers and megatron-core's local ones differ in time and memory.
        how = "--no-transformer-engine" if layer_spec == "local" else "on a GPU with Transformer Engine installed"
        raise DynaPipeError(f"{source}: the profile was measured on {measured!r} layers, this run builds "
                            f"{layer_spec!r} ones (--transformer-impl); profile those (`python -m dynapipe profile` "
                            f"{how}) or use --dynapipe-cost-model analytic.")


def check_threads_at_start(cost_model: str, enabled: bool, on_cpu: bool = True) -> None:
    """On a training rank whose threads are set (after start-up, not at argument parse: a bench
    parses its methods' arguments in a parent with other threads), :func:`check_measured_threads`
    of the ``--dynapipe-cost-model`` profile; nothing without ``--use-dynapipe`` or a profile, or
    on a run whose ranks compute on GPUs (``on_cpu`` False)."""
    from dynapipe.cost.profile_checks import read_profile

    if not enabled or cost_model == "analytic" or not on_cpu:
        return
    data = read_profile(cost_model)
    if isinstance(data, dict):
        check_measured_threads(data, f"--dynapipe-cost-model {cost_model}")


def check_measured_threads(profile: Mapping[str, Any], source: str) -> None:
    """Refuse a CPU profile measured with another number of torch threads than this rank
    computes with, on a CPU run. Why: a CPU layer's time scales with its threads, and not by one
    factor (small ops barely gain), so the micro-batches and the schedule would be cut for another
    machine. A profile that does not record its threads is not compared."""
    import torch

    measured = profile.get("threads")
    if profile.get("device") != "cpu" or measured is None:
        return
    if not isinstance(measured, int) or isinstance(measured, bool) or measured < 1:
        raise DynaPipeError(f"{source}: 'threads' {measured!r} must be a whole number of CPU threads, 1 or more "
                            f"(profiles write the threads they measured with); measure the profile again.")
    mine = torch.get_num_threads()
    if measured != mine:
        raise DynaPipeError(f"{source}: the profile was measured with {measured} CPU thread(s), this rank computes "
                            f"with {mine} (torch's threads: OMP_NUM_THREADS, which torchrun sets to 1 per rank "
                            f"unless given); its times would price another machine. Profile with the rank's threads "
                            f"(`python -m dynapipe profile ... --threads {mine}`), run the ranks with "
                            f"OMP_NUM_THREADS={measured}, or use --dynapipe-cost-model analytic.")


# The profile command's flag that measures each length axis of a profile.
PROFILE_FLAG = {"seqlen": "--seqlens", "dec_seqlen": "--dec-seqlens"}


def extrapolation_lines(cost_model: str, enabled: bool, lengths: Mapping[str, tuple[str, int]]) -> list[str]:
    """Start-up notes for rank 0: each run length (``{profile axis: (flag, tokens)}``, e.g.
    ``{"seqlen": ("--seq-length", 4096)}``) beyond the profile's longest measured one, which the
    planner then prices by extrapolation; none without ``--use-dynapipe`` or a profile."""
    from dynapipe.cost.profile_checks import read_profile

    if not enabled or cost_model == "analytic":
        return []
    data = read_profile(cost_model)
    lines = []
    t5 = "--t5 " if isinstance(data, dict) and data.get("kind") == "encoder-decoder" else ""
    for axis, (flag, length) in lengths.items():
        grid = data.get(axis) if isinstance(data, dict) else None
        if isinstance(grid, list) and grid and length > max(grid):
            # Memory is extrapolated too: from two lengths below what a longer micro-batch keeps, from
            # more possibly above it (a peak that rises in allocator steps).
            lines.append(f" > cost profile {cost_model}: {flag} {length} is beyond its longest measured length "
                         f"{max(grid)}; longer micro-batches are priced by extrapolation from its last lengths, "
                         f"which can miss their time and activation memory either way (measure up to {length} with "
                         f"`python -m dynapipe profile {t5}{PROFILE_FLAG.get(axis, '--seqlens')} ...` to price them "
                         f"from measurements)")
    return lines
