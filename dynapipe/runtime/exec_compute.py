"""The compute instructions of a plan: load a micro-batch, forward, backward (whole, or
split into an input part and a weight part by zero-bubble schedules).

With an interleaved placement a rank runs several chunks (virtual stages ``chunk * P +
stage``); whether an op receives activations, returns the loss or receives a gradient
follows from its chunk's virtual stage, not from the rank's.

:class:`ComputeOps` is the part of :class:`~dynapipe.runtime.executor.Executor` that calls
the model's handlers and checks what they return against the plan; received activations
get ``requires_grad`` before the forward, their gradients are collected after the backward.
"""
from __future__ import annotations

from typing import Optional

import torch

from dynapipe.errors import ExecutorError
from dynapipe.plan.instructions import (BackwardPass, ForwardPass, LoadInput, buffer_name, is_first_virtual,
                                        is_last_virtual)
from dynapipe.runtime.buffers import backward_from
from dynapipe.runtime.p2p import check_tensor
from dynapipe.runtime.run_state import RunState, Where


class ComputeOps:
    """Load, forward and backward of :class:`~dynapipe.runtime.executor.Executor` (a mixin:
    it uses the executor's ``handlers``, ``device`` and ``config``)."""

    def _load(self, i: int, ins: LoadInput, run: RunState, where: Where) -> None:
        data = self.handlers.load(run.mbs[ins.mb], ins.tensors)
        if not isinstance(data, dict) or set(data) != {s.name for s in ins.tensors}:
            got = sorted(data) if isinstance(data, dict) else type(data).__name__
            raise ExecutorError(f"{where}: load returned {got}, the plan expects tensors "
                                f"{[s.name for s in ins.tensors]}.")
        run.buffers.put(buffer_name("input", ins.mb, ins.chunk),
                        {s.name: check_tensor(data[s.name], s, self.device, where.also(" load")) for s in ins.tensors},
                        where)

    def _usable(self, name: str, run: RunState, where: Where) -> dict[str, torch.Tensor]:
        if name in run.inflight:
            raise ExecutorError(f"{where}: buffer {name!r} is used before its receive finished.")
        return run.buffers.get(name, where)

    def _forward(self, i: int, ins: ForwardPass, run: RunState, where: Where) -> None:
        key, plan = (ins.mb, ins.chunk), run.plan
        inputs: dict[str, torch.Tensor] = {}
        received: dict[str, torch.Tensor] = {}
        if not is_first_virtual(plan, ins.chunk):
            for name, t in self._usable(buffer_name("act_in", *key), run, where).items():
                if t.is_floating_point():
                    t.requires_grad_(True)
                    received[name] = t
                inputs[name] = t
        loaded = buffer_name("input", *key)
        if run.buffers.has(loaded):
            for name, t in run.buffers.get(loaded, where).items():
                if name in inputs:
                    raise ExecutorError(f"{where}: loaded tensor {name!r} has the name of a received activation.")
                inputs[name] = t
        out = self.handlers.forward(run.mbs[ins.mb], inputs, ins)
        keep = run.backward and torch.is_grad_enabled()
        if keep:
            run.act_inputs[key] = received
        if is_last_virtual(plan, ins.chunk):
            if not isinstance(out, torch.Tensor) or out.numel() != 1 or not out.is_floating_point():
                raise ExecutorError(f"{where}: the last stage's forward must return the summed token loss as a "
                                    f"scalar float tensor, got {type(out).__name__}"
                                    f"{list(out.shape) if isinstance(out, torch.Tensor) else ''}.")
            run.losses[ins.mb] = out.detach().reshape(())
            scale = run.loss_tokens if self.config.normalise_loss else 1
            if keep:
                root = out.reshape(()) / scale
                grad_scale = getattr(self.handlers, "grad_scale", None)
                if grad_scale is not None:  # megatron-core's scale is a [1] tensor: keep the root a scalar
                    root = grad_scale(root).reshape(())
                run.roots[key] = ([root], [None])
            return
        specs = run.send_specs.get(key, ())
        if isinstance(out, torch.Tensor):
            if len(specs) != 1:
                raise ExecutorError(f"{where}: forward returned one tensor, the plan sends "
                                    f"{[s.name for s in specs]}; return a dict by name.")
            out = {specs[0].name: out}
        if not isinstance(out, dict) or set(out) != {s.name for s in specs}:
            got = sorted(out) if isinstance(out, dict) else type(out).__name__
            raise ExecutorError(f"{where}: forward returned {got}, the plan sends {[s.name for s in specs]}.")
        outs = {s.name: check_tensor(out[s.name], s, self.device, where.also(" forward output")) for s in specs}
        if keep:
            run.roots[key] = (list(outs.values()), list(outs))
        run.buffers.put(buffer_name("act_out", *key), outs, where)

    def _backward(self, i: int, ins: BackwardPass, run: RunState, where: Where) -> None:
        key, plan = (ins.mb, ins.chunk), run.plan
        if ins.part == "weight":
            # The weight part of a split backward: the layers' deferred weight gradients. The
            # input part already sent the input gradient and dropped the graph.
            self.handlers.backward_weight(run.mbs[ins.mb], ins)
            return
        if key not in run.roots:
            raise ExecutorError(f"{where}: backward of a micro-batch whose forward did not run on this rank.")
        roots, names = run.roots.pop(key)
        if is_last_virtual(plan, ins.chunk):
            grads: list[Optional[torch.Tensor]] = [None]
        else:
            got = self._usable(buffer_name("grad_in", *key), run, where)
            missing = [n for n in names if n not in got]
            if missing:
                raise ExecutorError(f"{where}: received gradients {sorted(got)} lack {missing}.")
            grads = [got[n] for n in names]
        custom = getattr(self.handlers, "backward", None)
        if custom is not None:
            custom(run.mbs[ins.mb], roots, grads, ins)
        else:
            backward_from(roots, grads)
        received = run.act_inputs.pop(key)
        specs = run.grad_specs.get(key)
        if specs is not None:
            grads_out = {}
            for s in specs:
                t = received.get(s.name)
                if t is None:
                    raise ExecutorError(f"{where}: the plan sends a gradient for {s.name!r}, which this stage "
                                        f"did not receive as a float activation.")
                g = t.grad if t.grad is not None else torch.zeros_like(t)
                grads_out[s.name] = check_tensor(g, s, self.device, where.also(" input gradient"))
                t.grad = None
            run.buffers.put(buffer_name("grad_out", *key), grads_out, where)
