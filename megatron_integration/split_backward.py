"""megatron-core's linear layers with a backward that can be split in two (zero-bubble
schedules, ``--dynapipe-schedule zb-h1``).

megatron-core's ``ColumnParallelLinear`` and ``RowParallelLinear`` compute their input and
weight gradients in one autograd function. :func:`install_split_backward` gives every such
layer of a stage's transformer layers (the output layer keeps its whole backward in the input
part, as the cost model prices it: its vocabulary-wide logit gradients are not worth keeping)
a function with the same forward and the same maths whose backward, while
the :class:`~dynapipe.runtime.weight_grad_store.WeightGradStore` runs a split backward's
input part, computes only the input gradient (and the bias gradient, which is a cheap sum)
and hands the weight-gradient GEMM to the store; the plan's weight part runs it later and
accumulates the result through the parameter's own gradient accumulator, so megatron-core's
DDP sees it exactly as if autograd had produced it. Outside a split backward (evaluation has
none) the function accumulates both gradients at once, as megatron-core's computes them.

The weight enters the function detached: its gradient reaches the parameter only through
that accumulation, never as autograd's own ``None`` in the input part. megatron-core's DDP
hooks on the accumulator would otherwise run in the input part too, with no gradient, which
``--overlap-grad-reduce`` refuses (and which would count the weight ready before its
gradient exists).

Tensor parallelism is kept: the column-parallel input gradient is all-reduced, or under
sequence parallelism reduce-scattered, in the input part (the previous stage needs it); the
sequence-parallel all-gather of the layer's input is repeated in the weight part (every
tensor-parallel rank of a stage runs the same plan, so the collectives line up). Refused:
Transformer Engine layers (their weight gradients would not be deferred), and what
megatron-core's linear function can do that this one does not (fused gradient
accumulation into ``main_grad``, deferred embedding gradients, GTP-sharded weights), none
of which this build's stages use.
"""
from __future__ import annotations

import functools

import torch

from dynapipe.errors import DynaPipeError
from dynapipe.runtime.weight_grad_store import WeightGradStore


def _gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """``x``'s sequence shards of every tensor-parallel rank, concatenated along dim 0."""
    from megatron.core.tensor_parallel.layers import dist_all_gather_func

    out = torch.empty((x.shape[0] * group.size(), *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist_all_gather_func(out, x.contiguous(), group=group)
    return out


def _accumulate(param: torch.Tensor, grad: torch.Tensor) -> None:
    """Add ``grad`` to ``param``'s gradient through its autograd accumulator: the hooks
    megatron-core's DDP registered there (copy into ``main_grad``, bucket bookkeeping) run
    as in any backward."""
    torch.autograd.backward(param, grad)


class _SplitLinear(torch.autograd.Function):
    """``y = x W^T + b`` with megatron-core's tensor-parallel gradient reductions and a
    weight gradient the store may defer."""

    @staticmethod
    def forward(ctx, input, weight, param, bias, allreduce_dgrad, sequence_parallel, tp_group, store):
        # ``weight``: the parameter detached (see the module docstring); ``param``: a 1-tuple
        # holding the parameter itself, out of autograd's sight (a tensor argument would be an
        # input of the function), for the accumulation.
        ctx.save_for_backward(input, weight)
        ctx.param = param[0]
        ctx.use_bias = bias is not None
        ctx.allreduce_dgrad = allreduce_dgrad
        ctx.sequence_parallel = sequence_parallel
        ctx.tp_group = tp_group
        ctx.store = store
        total = _gather_sequence(input, tp_group) if sequence_parallel else input
        out = torch.matmul(total, weight.t())
        return out + bias if bias is not None else out

    @staticmethod
    def backward(ctx, grad_output):
        input, weight = ctx.saved_tensors
        # Under full recompute the saved input carries its recomputation graph, whose leaves
        # hold the layer's input and its gradient: kept until the weight part runs, they held
        # 2 x mbs x seq x hidden a layer beyond the stash the planner prices. The weight
        # gradient needs the values only.
        input = input.detach()
        grad_input = grad_output.matmul(weight)
        if ctx.allreduce_dgrad:
            torch.distributed.all_reduce(grad_input, group=ctx.tp_group)
        if ctx.sequence_parallel:
            from megatron.core.tensor_parallel.layers import dist_reduce_scatter_func

            shard = torch.empty(input.shape, dtype=input.dtype, device=input.device)
            dist_reduce_scatter_func(shard, grad_input.contiguous(), group=ctx.tp_group)
            grad_input = shard
        go = grad_output.reshape(-1, grad_output.shape[-1])
        grad_bias = go.sum(dim=0) if ctx.use_bias else None
        sequence_parallel, group = ctx.sequence_parallel, ctx.tp_group

        def weight_grad() -> torch.Tensor:
            total = _gather_sequence(input, group) if sequence_parallel else input
            return go.t().matmul(total.reshape(-1, total.shape[-1]))

        param = ctx.param

        def deferred() -> None:
            # As inside autograd's backward: no graph is recorded (gloo's all-gather writes
            # into views of its output, which grad mode would refuse).
            with torch.no_grad():
                grad = weight_grad()
            _accumulate(param, grad)

        store: WeightGradStore = ctx.store
        if store.deferring:
            store.defer(deferred, (input, go))
        else:
            deferred()
        return grad_input, None, None, grad_bias, None, None, None, None


def _split_forward_impl(layer, original, store: WeightGradStore, input, weight, *args, **kwargs):
    """The layer's ``_forward_impl`` with :class:`_SplitLinear` in place of megatron-core's
    linear function. megatron-core's path is kept where no gradient of the weight could be
    deferred: an iteration whose plan does not split (``store.active`` cleared), frozen
    weights, no grad mode (evaluation), and a layer none of whose other inputs needs a
    gradient (its graph would not reach the weight once that enters detached)."""
    bias = kwargs.get("bias")
    if not (store.active and weight.requires_grad and torch.is_grad_enabled()
            and (input.requires_grad or (bias is not None and bias.requires_grad))):
        return original(input, weight, *args, **kwargs)
    # What megatron-core could ask of the layer that this function does not do. This build
    # never sets them (the fused accumulation and the deferred embedding gradient are off in
    # its configs, GTP sharding is not built); a megatron-core that did would stop here.
    unsupported = [k for k, on in (("positional arguments", bool(args)),
                                   ("gradient_accumulation_fusion", bool(kwargs.get("gradient_accumulation_fusion"))),
                                   ("grad_output_buffer", kwargs.get("grad_output_buffer") is not None),
                                   ("gtp_remat_size", int(kwargs.get("gtp_remat_size") or 1) > 1)) if on]
    if unsupported:
        raise DynaPipeError(f"{type(layer).__name__} asks the split backward for {', '.join(unsupported)}, which "
                            f"it does not implement; use --dynapipe-schedule auto or 1f1b.")
    return _SplitLinear.apply(input, weight.detach(), (weight,), bias, bool(kwargs.get("allreduce_dgrad")),
                              bool(kwargs.get("sequence_parallel")), kwargs.get("tp_group"), store)


def install_split_backward(modules, store: WeightGradStore) -> int:
    """Give every megatron-core column/row-parallel linear layer of the transformer layers in
    ``modules`` (a stage's model chunks; not the output layer) a backward that defers its
    weight gradient into ``store`` during a split backward's input part. Returns how many layers were changed; raises
    :class:`DynaPipeError` when the stage has linear layers whose backward cannot be split."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    changed, foreign = 0, set()
    for chunk in modules:
        for name, mod in chunk.named_modules():
            if isinstance(mod, (ColumnParallelLinear, RowParallelLinear)):
                if name.split(".")[-1] == "output_layer":
                    # Its whole backward stays in the input part: deferring its weight gradient
                    # would keep the vocabulary-wide logit gradients until the weight part.
                    continue
                if getattr(mod, "_split_backward_store", None) is store:
                    continue
                original = type(mod)._forward_impl.__get__(mod)
                mod._forward_impl = functools.partial(_split_forward_impl, mod, original, store)
                mod._split_backward_store = store
                changed += 1
            elif type(mod).__name__.startswith("TE") and any(p.requires_grad for p in mod.parameters(recurse=False)):
                foreign.add(type(mod).__name__)
    if foreign:
        raise DynaPipeError(f"--dynapipe-schedule zb-h1 splits the backward of megatron-core's own linear layers; "
                            f"this stage has Transformer Engine layers ({', '.join(sorted(foreign))}), whose weight "
                            f"gradients would not be deferred. Use --transformer-impl local, or another schedule.")
    return changed
