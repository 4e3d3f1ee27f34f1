"""Let megatron-core train on a machine without CUDA (development, CI, the CPU benchmark).

megatron-core assumes a GPU in a handful of places: it allocates buffers on
``torch.cuda.current_device()`` or ``device="cuda"`` (global memory buffer, RoPE
frequencies, default causal mask, schedule token counters, p2p receive buffers, DDP
gradient buffers), synchronises or waits on CUDA streams, and keeps the model-parallel
RNG tracker's states as CUDA generator states. None of this is about the maths.

:func:`apply` redirects exactly those requests in exactly the megatron modules that make
them, and only when CUDA is unavailable:

* each listed module's global name ``torch`` is replaced by :class:`_CpuTorch`, a thin
  view of the real ``torch`` whose ``cuda`` namespace answers with the CPU (current
  device = cpu, synchronize/streams/events = no-ops, RNG = the CPU generator) and whose
  tensor factories turn a CUDA ``device=`` into the CPU. Every other attribute is the
  real torch object, so types, autograd and ``torch.distributed`` are untouched;
* the RNG tracker's ``_get_cuda_rng_state`` / ``_set_cuda_rng_state`` read and write the
  CPU generator, so ``fork()`` (entered by attention even at dropout 0) really isolates
  and restores the state, as it does on a GPU;
* ``Tensor.cuda()`` returns the tensor itself during the two methods that call it
  (tied-embedding set-up with PP > 1, the fp16 loss scaler's checkpoint load);
* ``Tensor.type()`` names a CPU tensor's CUDA counterpart during the one method that sorts
  parameters by those names (the half-precision optimizer's set-up of its fp32 main copies);
* gradient clipping, which asserts its gradients are CUDA tensors, is replaced by the
  same scaling without that assertion.

On a machine with CUDA nothing is changed. Calling :func:`apply` twice is harmless.
Modules or attributes that a megatron-core version lacks are skipped with a debug log,
so the layer keeps working across 0.16 to 0.19.
"""
from __future__ import annotations

import contextlib
import importlib
import logging
import types
from typing import Any

import torch

log = logging.getLogger(__name__)

# megatron modules that request CUDA devices, streams or RNG states on the paths the
# project uses (GPTModel with the local spec, 1F1B schedules, p2p, DDP, optimizer).
PATCHED_MODULES = (
    "megatron.core.utils",  # GlobalMemoryBuffer.get_tensor (local attention)
    "megatron.core.tensor_parallel.random",  # RNG tracker
    "megatron.core.tensor_parallel.layers",  # weights on the current device
    "megatron.core.tensor_parallel.mappings",  # sequence-parallel gather/scatter outputs
    "megatron.core.models.common.embeddings.rotary_pos_embedding",  # inv_freq
    "megatron.core.transformer.utils",  # get_default_causal_mask
    "megatron.core.pipeline_parallel.schedules",  # token counters
    "megatron.core.pipeline_parallel.p2p_communication",  # receive buffers, synchronize
    "megatron.core.distributed.param_and_grad_buffer",  # gradient buffers
    "megatron.core.distributed.distributed_data_parallel",  # streams (0.19)
    "megatron.core.distributed.finalize_model_grads",
    "megatron.core.optimizer.optimizer",  # found-inf flags, grad norms
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.grad_scaler",  # fp16 loss scale, found-inf flags
    "megatron.core.optimizer.optimizer_config",
    "megatron.core.models.common.language_module.language_module",
)

# Methods that move tensors with ``Tensor.cuda()`` (which the module view cannot redirect):
# during these calls ``Tensor.cuda`` returns the tensor itself.
# (module, class, method)
TENSOR_CUDA_METHODS = (
    # Tied embeddings with PP > 1: the last stage's copy is all-reduced from the first's.
    ("megatron.core.models.common.language_module.language_module", "LanguageModule",
     "setup_embeddings_and_output_layer"),
    # fp16: a checkpoint's loss scale is moved back to the GPU on load.
    ("megatron.core.optimizer.grad_scaler", "DynamicGradScaler", "load_state_dict"),
)

# Methods that sort parameters by ``Tensor.type()`` names and know only CUDA ones: during
# these calls a CPU tensor's type name is its CUDA counterpart's (the maths is the same).
# (module, class, method)
TENSOR_TYPE_METHODS = (
    # bf16/fp16: the mixed-precision optimizer keeps fp32 main copies of "torch.cuda.BFloat16Tensor"s
    # and "torch.cuda.HalfTensor"s.
    ("megatron.core.optimizer.optimizer", "Float16OptimizerWithFloat16Params", "__init__"),
)

_TENSOR_FACTORIES = ("empty", "zeros", "ones", "full", "tensor", "arange", "rand", "randn",
                     "randint", "as_tensor", "empty_strided", "linspace", "eye")


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, int) and not isinstance(device, bool):
        return True  # a bare index means a CUDA ordinal in megatron's calls
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


def _cpu_factory(fn):
    def factory(*args, **kwargs):
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        # Pinned memory needs an accelerator; it is only a transfer optimisation.
        kwargs.pop("pin_memory", None)
        return fn(*args, **kwargs)

    factory.__name__ = getattr(fn, "__name__", "factory")
    factory.__doc__ = getattr(fn, "__doc__", None)
    return factory


class _NoopStream:
    """Stands in for a CUDA stream or event: every operation completes at once."""

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        return lambda *args, **kwargs: None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def query(self) -> bool:
        return True

    def elapsed_time(self, other) -> float:
        return 0.0


def _make_cpu_cuda_namespace() -> types.SimpleNamespace:
    """A ``torch.cuda`` lookalike whose device is the CPU."""
    ns = types.SimpleNamespace()
    # Attributes not listed here fall back to the real torch.cuda (see _CpuTorch).
    ns.is_available = lambda: False
    ns.current_device = lambda: torch.device("cpu")
    ns.device_count = lambda: 0
    ns.synchronize = lambda *a, **k: None
    ns.empty_cache = lambda: None
    ns.current_stream = lambda *a, **k: _NoopStream()
    ns.default_stream = lambda *a, **k: _NoopStream()
    ns.Stream = _NoopStream
    ns.Event = _NoopStream
    ns.stream = lambda *a, **k: contextlib.nullcontext()
    ns.device = lambda *a, **k: contextlib.nullcontext()
    ns.nvtx = types.SimpleNamespace(range_push=lambda *a, **k: None, range_pop=lambda *a, **k: None,
                                    range=lambda *a, **k: contextlib.nullcontext(), mark=lambda *a, **k: None)
    ns.memory_allocated = lambda *a, **k: 0
    ns.max_memory_allocated = lambda *a, **k: 0
    ns.memory_reserved = lambda *a, **k: 0
    # The CPU generator plays the CUDA generator's part.
    ns.get_rng_state = lambda *a, **k: torch.get_rng_state()
    ns.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    ns.manual_seed = lambda seed: torch.manual_seed(seed)
    ns.manual_seed_all = lambda seed: torch.manual_seed(seed)
    ns.random = types.SimpleNamespace(get_rng_state=ns.get_rng_state, set_rng_state=ns.set_rng_state,
                           manual_seed=ns.manual_seed)
    ns.default_generators = (torch.default_generator,)
    return ns


class _CpuTorch(types.ModuleType):
    """The real ``torch`` module, except for CUDA device requests (see module docstring)."""

    def __init__(self):
        super().__init__("torch")
        self.__dict__["cuda"] = _CpuCudaProxy(_make_cpu_cuda_namespace())
        for name in _TENSOR_FACTORIES:
            if hasattr(torch, name):
                self.__dict__[name] = _cpu_factory(getattr(torch, name))
        self.__dict__["_dynapipe_cpu_view"] = True

    def __getattr__(self, name):
        value = getattr(torch, name)
        # Cache so later lookups cost a plain attribute access.
        self.__dict__[name] = value
        return value


class _CpuCudaProxy(types.ModuleType):
    """``torch.cuda`` answering with the CPU (see :func:`_make_cpu_cuda_namespace`)."""

    def __init__(self, ns: types.SimpleNamespace):
        super().__init__("torch.cuda")
        self.__dict__.update(vars(ns))

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


_CPU_TORCH: _CpuTorch | None = None
_APPLIED = False


def cuda_available() -> bool:
    """Whether a CUDA device can be used (the compatibility layer is only for when it cannot)."""
    return torch.cuda.is_available()


def _cpu_get_rng_state(device="cuda", clone: bool = False, graph_safe: bool = False):
    state = torch.get_rng_state()
    return state.clone() if clone else state


def _cpu_set_rng_state(new_state, device: int = -1, graph_safe: bool = False):
    torch.set_rng_state(new_state)


def _cpu_clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad: bool = False):
    """megatron's gradient clipping without its CUDA-tensor-type assertion: scale every
    fp32 gradient by ``max_norm / total_norm`` when that is below 1."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr).detach() for p in parameters if getattr(p, attr, None) is not None]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        for g in grads:
            g.mul_(clip_coeff)


# (module, attribute, CPU replacement). A module that imported the function by name
# holds its own reference, so each such module is listed.
FUNCTION_REPLACEMENTS = (
    ("megatron.core.optimizer.clip_grads", "clip_grad_by_total_norm_fp32", _cpu_clip_grad_by_total_norm_fp32),
    ("megatron.core.optimizer.optimizer", "clip_grad_by_total_norm_fp32", _cpu_clip_grad_by_total_norm_fp32),
)


def _replace_function(module_name: str, attr: str, replacement) -> bool:
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        log.debug("cpu_compat: skipping %s (%s)", module_name, e)
        return False
    if not hasattr(module, attr):
        log.debug("cpu_compat: %s.%s missing; skipped", module_name, attr)
        return False
    setattr(module, attr, replacement)
    return True


def _patch_module(name: str) -> bool:
    try:
        module = importlib.import_module(name)
    except Exception as e:  # a module this megatron-core version does not have
        log.debug("cpu_compat: skipping %s (%s)", name, e)
        return False
    if getattr(getattr(module, "torch", None), "_dynapipe_cpu_view", False):
        return True
    if getattr(module, "torch", None) is not torch:
        log.debug("cpu_compat: %s does not use the global name 'torch'; skipped", name)
        return False
    module.torch = _CPU_TORCH
    return True


def _patch_rng() -> None:
    try:
        random = importlib.import_module("megatron.core.tensor_parallel.random")
    except Exception as e:
        log.debug("cpu_compat: no tensor_parallel.random (%s)", e)
        return
    for attr, replacement in (("_get_cuda_rng_state", _cpu_get_rng_state),
                              ("_set_cuda_rng_state", _cpu_set_rng_state)):
        if hasattr(random, attr):
            setattr(random, attr, replacement)
        else:
            log.debug("cpu_compat: tensor_parallel.random.%s missing; skipped", attr)


@contextlib.contextmanager
def _tensor_cuda_is_identity():
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        torch.Tensor.cuda = original


@contextlib.contextmanager
def _tensor_type_names_cuda():
    original = torch.Tensor.type

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs and not self.is_cuda:
            return original(self).replace("torch.", "torch.cuda.", 1)
        return original(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = type_
    try:
        yield
    finally:
        torch.Tensor.type = original


def _wrap_tensor_cuda_method(module_name: str, class_name: str, method_name: str,
                             context=_tensor_cuda_is_identity) -> bool:
    try:
        module = importlib.import_module(module_name)
        cls = getattr(module, class_name)
        method = getattr(cls, method_name)
    except Exception as e:
        log.debug("cpu_compat: skipping %s.%s.%s (%s)", module_name, class_name, method_name, e)
        return False
    if getattr(method, "_dynapipe_cpu_wrapped", False):
        return True

    def wrapped(self, *args, **kwargs):
        with context():
            return method(self, *args, **kwargs)

    wrapped._dynapipe_cpu_wrapped = True
    wrapped.__name__, wrapped.__doc__ = method.__name__, method.__doc__
    setattr(cls, method_name, wrapped)
    return True


class _DropExpectedRngWarning(logging.Filter):
    """The tracker warns when the CPU generator moves inside ``fork()``; on a CPU machine
    the CPU generator *is* the forked generator, so that move is the expected one."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


def apply(force: bool = False) -> bool:
    """Install the CPU redirects when CUDA is unavailable (or ``force``); idempotent.

    Returns True when the redirects are in place, False on a CUDA machine.
    """
    global _CPU_TORCH, _APPLIED
    if cuda_available() and not force:
        return False
    if _APPLIED:
        return True
    _CPU_TORCH = _CpuTorch()
    patched = [name for name in PATCHED_MODULES if _patch_module(name)]
    _patch_rng()
    logging.getLogger("megatron.core.tensor_parallel.random").addFilter(_DropExpectedRngWarning())
    for spec in TENSOR_CUDA_METHODS:
        _wrap_tensor_cuda_method(*spec)
    for spec in TENSOR_TYPE_METHODS:
        _wrap_tensor_cuda_method(*spec, context=_tensor_type_names_cuda)
    for spec in FUNCTION_REPLACEMENTS:
        _replace_function(*spec)
    log.debug("cpu_compat: patched %s", patched)
    _APPLIED = True
    return True


def is_applied() -> bool:
    """Whether :func:`apply` has installed the redirects in this process."""
    return _APPLIED
