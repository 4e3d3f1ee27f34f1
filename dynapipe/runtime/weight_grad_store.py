"""Deferred weight gradients: what a split backward (zero-bubble schedules) keeps between
its input part and its weight part.

A zero-bubble schedule runs a micro-batch's backward in two instructions: the input part
(``BackwardPass.part == "input"``) computes the gradient the previous stage waits for, and
the weight part (``"weight"``) later computes the parameter gradients of the linear layers,
in what would otherwise be a pipeline bubble. Layers that can split their backward (see
``megatron_integration.split_backward``) ask :meth:`WeightGradStore.defer` during the
input part; the store keeps each deferred computation, with the tensors it needs, under
the micro-batch's key until :meth:`WeightGradStore.run` executes them in the weight part.
Everything else in the backward (norms, biases, embeddings, attention) runs in the input
part as usual.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Hashable, Iterable, Iterator, Optional

from dynapipe.errors import DynaPipeError


class WeightGradStore:
    """Per micro-batch, the weight-gradient computations its input part deferred.

    ``meter``: an :class:`~dynapipe.runtime.activation_meter.ActivationMeter` that counts
    the tensors a deferred computation keeps until it runs (autograd no longer does once
    the input part freed its graph), so a rank's measured activation memory includes them.
    """

    def __init__(self, meter=None) -> None:
        self._open: Optional[Hashable] = None
        self._pending: dict[Hashable, list[tuple[Callable[[], None], list[int]]]] = {}
        self.meter = meter
        #: Whether the layers that defer into this store take their split path at all. A run
        #: whose schedule may split (``auto``) clears it for iterations whose plan does not, so
        #: those run the layers' own backward, with no deferral machinery in the way.
        self.active = True

    @property
    def deferring(self) -> bool:
        """Whether a split backward's input part is running (layers should defer)."""
        return self._open is not None

    @contextmanager
    def input_part(self, key: Hashable) -> Iterator[None]:
        """Run the input part of micro-batch ``key``'s backward: layers' :meth:`defer` calls
        are kept under ``key`` until :meth:`run`."""
        if self._open is not None:
            raise DynaPipeError(f"the input part of micro-batch {key} started inside that of {self._open}.")
        if key in self._pending:
            raise DynaPipeError(f"micro-batch {key}'s input part ran twice before its weight part.")
        self._pending[key] = []
        self._open = key
        try:
            yield
        finally:
            self._open = None

    def defer(self, fn: Callable[[], None], tensors: Iterable = ()) -> None:
        """Keep ``fn`` (it computes and accumulates one weight gradient) for the weight part
        of the micro-batch whose input part is running; ``tensors``: what it keeps alive
        until then (counted by :attr:`meter`)."""
        if self._open is None:
            raise DynaPipeError("a layer deferred its weight gradient outside a split backward's input part.")
        keys = [self.meter.hold(t) for t in tensors] if self.meter is not None else []
        self._pending[self._open].append((fn, keys))

    def run(self, key: Hashable) -> int:
        """Run the weight part of micro-batch ``key``: every computation its input part
        deferred, in the order deferred. Returns how many ran."""
        fns = self._pending.pop(key, None)
        if fns is None:
            raise DynaPipeError(f"the weight part of micro-batch {key} runs before its input part.")
        for fn, keys in fns:
            fn()
            self._release(keys)
        return len(fns)

    def _release(self, keys: list[int]) -> None:
        if self.meter is not None:
            for k in keys:
                self.meter.drop(k)

    @property
    def pending(self) -> list:
        """Keys of the micro-batches whose weight part has not run."""
        return list(self._pending)

    def clear(self) -> None:
        """Drop whatever is pending (after a failed iteration: its gradients are discarded)."""
        for fns in self._pending.values():
            for _, keys in fns:
                self._release(keys)
        self._pending.clear()
        self._open = None
