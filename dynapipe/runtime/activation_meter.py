"""Measured activation memory of one rank: what autograd keeps for the backward, plus buffers.

On a CPU there are no allocator statistics, and an op-level tracker would slow training
down several times. What the plan budgets between ops is measurable cheaply instead:

* every tensor autograd saves for a backward passes through a
  ``torch.autograd.graph.saved_tensors_hooks`` pack hook; its storage is counted until
  autograd releases it (after the backward of the node that saved it), parameters
  excluded;
* every tensor an executor buffer holds (received activations and gradients, loaded
  inputs, outputs not yet sent) is counted from the buffer's fill to its free or to the
  release of its data after the send.

A storage is counted once however many saved tensors and buffers share it (a received
activation is also the first layer's saved input). The recomputation of a checkpointed
layer in the backward saves tensors too, so the transient memory of recompute is in the
peak. Transient tensors no one saves (an op's temporaries, gradients flowing backward)
are not: on CUDA the allocator's peak measures those (see :class:`CudaPeak`).
"""
from __future__ import annotations

import contextlib
from typing import Iterable, Iterator, Optional

import torch

MIB = float(1 << 20)


def storage_key(t: torch.Tensor) -> int:
    """Identity of the memory ``t`` views (0 for tensors without storage)."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return 0


class _Saved:
    """What the pack hook hands autograd: the tensor plus a release notice when autograd drops it."""

    __slots__ = ("tensor", "meter", "key")

    def __init__(self, tensor: torch.Tensor, meter: "ActivationMeter", key: int):
        self.tensor, self.meter, self.key = tensor, meter, key

    def __del__(self):
        self.meter._drop(self.key)


class ActivationMeter:
    """Live and peak bytes of activations held on this rank (see the module docstring).

    ``exclude``: tensors never counted (the model's parameters). Use :meth:`saving` around
    the forward and backward passes, :meth:`hold`/:meth:`drop_tensor` for buffers.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self._exclude = {storage_key(p) for p in exclude}
        self._refs: dict[int, list[int]] = {}  # storage -> [references, bytes]
        self.live_bytes = 0
        self.peak_bytes = 0

    @property
    def peak_mib(self) -> float:
        return self.peak_bytes / MIB

    def reset_peak(self) -> None:
        """Start a new peak from what is held now."""
        self.peak_bytes = self.live_bytes

    def exclude(self, tensors: Iterable[torch.Tensor]) -> None:
        """Never count these tensors' storages (e.g. parameters created after construction)."""
        self._exclude.update(storage_key(t) for t in tensors)

    def _add(self, t: torch.Tensor) -> int:
        key = storage_key(t)
        if not key or key in self._exclude:
            return 0
        entry = self._refs.get(key)
        if entry is None:
            nbytes = t.untyped_storage().nbytes()
            self._refs[key] = [1, nbytes]
            self.live_bytes += nbytes
            if self.live_bytes > self.peak_bytes:
                self.peak_bytes = self.live_bytes
        else:
            entry[0] += 1
        return key

    def _drop(self, key: int) -> None:
        entry = self._refs.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self.live_bytes -= entry[1]
            del self._refs[key]

    def held_bytes(self, tensors: Iterable[torch.Tensor]) -> int:
        """Bytes of the distinct storages of ``tensors`` that this meter counts now."""
        keys = {storage_key(t) for t in tensors}
        return sum(self._refs[k][1] for k in keys if k in self._refs)

    def holds(self, key: int) -> bool:
        """Whether the storage ``key`` is counted now."""
        return key in self._refs

    def hold(self, t: torch.Tensor) -> int:
        """Count ``t`` as held by a buffer; returns the key to pass to :meth:`drop` (0: not counted)."""
        return self._add(t)

    def drop(self, key: int) -> None:
        """A buffer stopped holding the storage ``key`` (from :meth:`hold`)."""
        if key:
            self._drop(key)

    def _pack(self, t: torch.Tensor):
        key = self._add(t)
        # A detached alias, not ``t`` itself: the executor releases a sent activation by swapping
        # the data of its tensor object (release_data), and the backward of an op that saved its
        # own output (tanh, exp) must still read the storage it saved.
        return _Saved(t.detach(), self, key) if key else t

    @staticmethod
    def _unpack(x):
        return x.tensor if isinstance(x, _Saved) else x

    @contextlib.contextmanager
    def saving(self) -> Iterator["ActivationMeter"]:
        """Count what autograd saves for the backward while inside (forward and backward)."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield self


# The caching allocator's peaks (bytes) since the run started: CudaPeak resets torch's peak
# statistics every iteration to measure activations, so it folds them in here first. Process-wide,
# as the allocator's own statistics are.
_run_peak_bytes = {"allocated": 0, "reserved": 0}


def _fold_cuda_peaks(device: torch.device) -> None:
    _run_peak_bytes["allocated"] = max(_run_peak_bytes["allocated"], torch.cuda.max_memory_allocated(device))
    _run_peak_bytes["reserved"] = max(_run_peak_bytes["reserved"], torch.cuda.max_memory_reserved(device))


def reset_cuda_peaks(device: torch.device) -> None:
    """Start counting :func:`cuda_memory_mib`'s maxima afresh (at the start of a training run)."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    _run_peak_bytes.update(allocated=0, reserved=0)


def cuda_memory_mib(device: torch.device) -> dict:
    """The caching allocator's ``allocated``, ``max_allocated``, ``reserved`` and ``max_reserved``
    memory on ``device`` (MiB), as Megatron-LM's memory report reads them: maxima since the last
    :func:`reset_cuda_peaks`, across :class:`CudaPeak`'s per-iteration resets. ``reserved`` above
    ``allocated`` is the allocator's cache (fragmentation under variable shapes included).
    ``device_usage``: the device's own count (MiB), None where torch cannot read it."""
    torch.cuda.synchronize(device)
    _fold_cuda_peaks(device)
    return {"allocated": torch.cuda.memory_allocated(device) / MIB,
            "max_allocated": _run_peak_bytes["allocated"] / MIB,
            "reserved": torch.cuda.memory_reserved(device) / MIB,
            "max_reserved": _run_peak_bytes["reserved"] / MIB,
            "device_usage": _device_usage_mib(device)}


def _device_usage_mib(device: torch.device) -> Optional[float]:
    """The device's own count of its used memory (MiB; every process's, the CUDA context
    included), which Megatron-LM's report adds where torch can read it; None where it cannot
    (torch reads it through NVML, an optional package)."""
    try:
        return torch.cuda.device_memory_used(device) / MIB
    except Exception:  # noqa: BLE001 - no NVML, or a torch without the call: the field is left out
        return None


class CudaPeak:
    """Peak activation memory on a GPU: the allocator's peak minus what was allocated at the
    start (parameters, gradients, optimizer states: the model states)."""

    def __init__(self, device: torch.device):
        self.device = device
        torch.cuda.synchronize(device)
        self.base = torch.cuda.memory_allocated(device)
        _fold_cuda_peaks(device)
        torch.cuda.reset_peak_memory_stats(device)

    def peak_mib(self) -> float:
        torch.cuda.synchronize(self.device)
        return max(0, torch.cuda.max_memory_allocated(self.device) - self.base) / MIB


@contextlib.contextmanager
def measure_activations(module: Optional[torch.nn.Module], device: torch.device,
                        meter: Optional[ActivationMeter] = None) -> Iterator[dict]:
    """Measure one iteration's activation peak; the yielded dict gets ``peak_mib`` on exit.

    CUDA: allocator peak minus the memory allocated on entry. Otherwise: an
    :class:`ActivationMeter` (``meter`` if given, so an executor's buffers count too) with
    ``module``'s parameters excluded.
    """
    out: dict = {"peak_mib": 0.0}
    if device.type == "cuda":
        peak = CudaPeak(device)
        yield out
        out["peak_mib"] = peak.peak_mib()
        return
    meter = meter or ActivationMeter()
    if module is not None:
        meter.exclude(module.parameters())
    meter.reset_peak()
    with meter.saving():
        yield out
    out["peak_mib"] = meter.peak_mib
