"""The buffers of a running plan, and the release of sent activations.

A plan names every buffer (``input``, ``act_in``, ``act_out``, ``grad_in``,
``grad_out`` of a micro-batch, see :func:`dynapipe.plan.instructions.buffer_name`) and
frees each exactly once. :class:`BufferTable` holds them between those points, counts
their bytes, and turns a use after free or a use of a buffer never filled into an error
naming the instruction, instead of a wrong result.

Once an activation has been sent its data is no longer needed on this stage: only the
autograd graph that produced it is, to run the backward when the gradient arrives.
:func:`release_data` drops the data and keeps the graph; :func:`backward_from` runs the
backward from such outputs (the public ``torch.autograd.backward`` would refuse them,
since their shape no longer matches their gradient's).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
from torch.autograd import Variable

from dynapipe.errors import ExecutorError


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes held by the data of ``t``."""
    return t.numel() * t.element_size()


def to_device(value: Any, device: torch.device) -> torch.Tensor:
    """``value`` (a tensor or numpy array) on ``device``, copied without waiting. To a GPU the
    host data is pinned first: a copy from pageable memory may hold the host until the copy
    has run, behind every kernel and transfer already queued, so the host could not launch
    ahead of the GPU, and a rank behind a receive from a failed peer would block in the driver
    instead of polling its failure reports. The caching host allocator keeps the pinned copy
    until the transfer is done."""
    t = torch.as_tensor(value)
    if device.type == "cuda" and t.device.type == "cpu" and not t.is_pinned():
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def release_data(t: torch.Tensor) -> int:
    """Replace the data of ``t`` by one element, keeping its autograd graph; bytes released.

    Only outputs of an autograd graph that own their storage are released: a view shares
    its base's storage (releasing it would free nothing) and a tensor outside any graph
    is simply dropped by its owner.
    """
    if t.grad_fn is None or t._base is not None or t.numel() <= 1:
        return 0
    freed = tensor_bytes(t)
    t.data = torch.empty((1,), dtype=t.dtype, device=t.device)
    return freed - t.element_size()


def reached_by_others(tensors: Sequence[torch.Tensor]) -> list[bool]:
    """For each tensor of one message, whether the autograd graph of another tensor of the
    message uses it (reaches its ``grad_fn``).

    Autograd saves an op's inputs by reference, so an op that produced one sent tensor
    from another (``b = a * w``: ``a`` is saved for ``w``'s gradient) would read whatever
    :func:`release_data` left in ``a``: a one-element placeholder that broadcasts without
    an error, and a wrong gradient. Such a tensor must keep its data. Nodes created before
    the one searched for cannot use it (autograd numbers the nodes a thread creates in
    order, and a stage's forward runs on one thread), so the search skips them; a message
    of one tensor needs no search.
    """
    fns = [t.grad_fn for t in tensors]
    out = [False] * len(tensors)
    for i, target in enumerate(fns):
        if target is None:
            continue
        floor = target._sequence_nr()
        roots = [f for j, f in enumerate(fns) if j != i and f is not None and f is not target]
        seen, stack = set(), list(roots)
        while stack and not out[i]:
            node = stack.pop()
            if node is target:
                out[i] = True
            elif node not in seen:
                seen.add(node)
                stack.extend(n for n, _ in node.next_functions
                             if n is not None and n not in seen and n._sequence_nr() >= floor)
    return out


def backward_from(roots: Sequence[torch.Tensor], grads: Sequence[Optional[torch.Tensor]]) -> None:
    """Backward from ``roots`` with gradients ``grads`` (``None``: a scalar root, gradient 1).

    Works on roots whose data :func:`release_data` dropped: the engine checks each
    gradient against the shape recorded when the graph was built, not the current data.
    Parameter gradients accumulate into ``.grad`` as with ``torch.autograd.backward``.
    """
    rs, gs = [], []
    for r, g in zip(roots, grads):
        if not r.requires_grad:
            continue
        rs.append(r)
        gs.append(torch.ones((), dtype=r.dtype, device=r.device) if g is None else g)
    if rs:
        Variable._execution_engine.run_backward(
            tuple(rs), tuple(gs), False, False, (), True, True)  # keep_graph, create_graph, inputs,
        # allow_unreachable, accumulate_grad


@dataclass
class BufferTable:
    """Live buffers by name, each a ``{tensor name: tensor}`` message.

    ``live_bytes``/``peak_bytes`` count the data held by live buffers (received and sent
    activations, gradients, loaded inputs); tensors saved inside autograd graphs are not
    counted, they belong to the model. ``meter`` (an
    :class:`~dynapipe.runtime.activation_meter.ActivationMeter`) is told of every buffer
    tensor held and dropped, so the rank's activation peak counts the buffers with what
    autograd saves, each storage once.
    """

    live: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    freed_at: dict[str, int] = field(default_factory=dict)
    live_bytes: int = 0
    peak_bytes: int = 0
    meter: Optional[Any] = None
    _keys: dict = field(default_factory=dict)  # buffer -> {tensor name: meter key}

    def put(self, name: str, tensors: dict[str, torch.Tensor], where: str) -> None:
        """Fill buffer ``name``; a buffer is filled once per iteration."""
        if name in self.live or name in self.freed_at:
            raise ExecutorError(f"{where}: buffer {name!r} is filled a second time in this iteration.")
        self.live[name] = tensors
        self.live_bytes += sum(tensor_bytes(t) for t in tensors.values())
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        if self.meter is not None:
            self._keys[name] = {k: self.meter.hold(t) for k, t in tensors.items()}

    def get(self, name: str, where: str) -> dict[str, torch.Tensor]:
        """The tensors of a live buffer; an error if it was freed or never filled."""
        if name in self.live:
            return self.live[name]
        if name in self.freed_at:
            raise ExecutorError(f"{where}: buffer {name!r} is used after instruction "
                                f"{self.freed_at[name]} freed it.")
        raise ExecutorError(f"{where}: buffer {name!r} is used before anything filled it.")

    def has(self, name: str) -> bool:
        return name in self.live

    def release(self, name: str, where: str) -> int:
        """Release the data of every tensor of live buffer ``name`` in place (see
        :func:`release_data`), keeping their graphs; bytes released. A tensor that another
        tensor of the message was computed from keeps its data (:func:`reached_by_others`)."""
        total = 0
        keys = self._keys.get(name, {})
        message = self.get(name, where)
        used = reached_by_others(list(message.values())) if len(message) > 1 else [False] * len(message)
        for (k, t), keep in zip(message.items(), used):
            n = 0 if keep else release_data(t)
            if n and self.meter is not None:
                self.meter.drop(keys.pop(k, 0))
            total += n
        self.live_bytes -= total
        return total

    def free(self, name: str, index: int, where: str) -> None:
        """Drop buffer ``name`` (instruction ``index`` frees it)."""
        if name not in self.live:
            self.get(name, where)  # raises with the reason
        tensors = self.live.pop(name)
        self.live_bytes -= sum(tensor_bytes(t) for t in tensors.values())
        self.freed_at[name] = index
        self._forget(name)

    def _forget(self, name: str) -> None:
        if self.meter is not None:
            for key in self._keys.pop(name, {}).values():
                self.meter.drop(key)

    def clear(self) -> list[str]:
        """Drop every buffer; returns the names the plan left unfreed."""
        left = sorted(self.live)
        for name in left:
            self._forget(name)
        self.live.clear()
        self.freed_at.clear()
        self.live_bytes = 0
        return left
