"""Stop training on a non-finite loss or gradient, before the optimizer step uses it.

Megatron-LM's ``--check-for-nan-in-loss-and-grad`` (on by default): a loss or a gradient
that is NaN or infinite means the run has diverged (a learning rate far too high, a
corrupted checkpoint, bad data), and every later step and checkpoint would carry it on.
:func:`check_before_step` runs after the backward pass and before ``optimizer.step()``
on every rank (it is collective: each rank contributes two flags, so every rank learns
which ranks saw what and raises the same :class:`NonFiniteError`; no rank is left
waiting in a collective).

With fp16 and loss scaling, infinite gradients are an overflow of the scaled loss, not
a divergence: megatron-core's optimizer finds them, skips the step and lowers the
scale, and the log counts it in ``number of skipped iterations``. The check is off then
(as in Megatron-LM), unless a static ``--loss-scale`` is given.
"""
from __future__ import annotations

import math
from typing import Iterable, Optional

import torch
import torch.distributed as dist

from dynapipe.errors import DynaPipeError


class NonFiniteError(DynaPipeError):
    """The loss or the gradients of an iteration are NaN or infinite."""


def _grads(module: torch.nn.Module) -> Iterable[torch.Tensor]:
    for p in module.parameters():
        g = getattr(p, "main_grad", None)  # megatron-core DDP accumulates here
        if g is None:
            g = p.grad
        if g is not None:
            yield g


def local_flags(module: torch.nn.Module, loss_sum, device: torch.device) -> torch.Tensor:
    """``[loss not finite, gradient norm not finite]`` of this rank as a float tensor (0 or 1).

    ``loss_sum``: this rank's summed loss (a tensor or a float; None on ranks without a
    loss, i.e. every stage but the last).
    """
    loss_bad = 0.0
    if loss_sum is not None:
        value = float(loss_sum.detach().float().sum()) if torch.is_tensor(loss_sum) else float(loss_sum)
        loss_bad = 0.0 if math.isfinite(value) else 1.0
    flags = torch.tensor([loss_bad, 0.0], dtype=torch.float32, device=device)
    # The norm, as megatron-core's check_grads takes it (the 2-norm of the local gradients, not
    # each element): it is NaN for a NaN anywhere and infinite for an infinite element or for
    # finite ones whose squares overflow (a diverged run whose clipped steps still move Adam's
    # moments).
    norms = [torch.linalg.vector_norm(g, dtype=torch.float32) for g in _grads(module)]
    if norms:
        # One device-to-host read for all parameters, not one per parameter.
        flags[1] = (~torch.isfinite(torch.linalg.vector_norm(torch.stack(norms)))).float()
    return flags


def _ranks(column: torch.Tensor) -> list[int]:
    return [int(r) for r in torch.nonzero(column > 0).flatten().tolist()]


def _ranks_text(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def describe(iteration: int, all_flags: torch.Tensor) -> Optional[str]:
    """The one-line message for gathered ``[world, 2]`` flags, or None when all is finite.

    ``iteration`` is 1-based, as in the log lines.
    """
    loss_ranks, grad_ranks = _ranks(all_flags[:, 0]), _ranks(all_flags[:, 1])
    if not loss_ranks and not grad_ranks:
        return None
    what = []
    if loss_ranks:
        what.append(f"the loss is NaN or infinite on {_ranks_text(loss_ranks)}")
    if grad_ranks:
        what.append(f"the gradient norm is NaN or infinite on {_ranks_text(grad_ranks)}")
    return (f"iteration {iteration}: {' and '.join(what)}; stopped before the optimizer step, so no weight was "
            f"updated or saved from it. Lower --lr, check the data and the checkpoint loaded, or pass "
            f"--no-check-for-nan-in-loss-and-grad to train on regardless.")


def check_before_step(enabled: bool, module: torch.nn.Module, iteration: int,
                      loss_sum, device: torch.device, group=None) -> None:
    """Raise :class:`NonFiniteError` on every rank when any rank's loss or gradients are
    not finite. Collective over ``group`` (default: the whole job); a no-op when disabled
    (as under fp16 with dynamic loss scaling, see
    :func:`megatron_integration.model_flags.nan_check_enabled`).

    ``iteration``: 0-based index of the iteration being trained.
    """
    if not enabled:
        return
    flags = local_flags(module, loss_sum, device)
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if world > 1:
        gathered = [torch.zeros_like(flags) for _ in range(world)]
        dist.all_gather(gathered, flags, group=group)
        all_flags = torch.stack(gathered).cpu()
    else:
        all_flags = flags.cpu()[None]
    message = describe(iteration + 1, all_flags)
    if message is not None:
        raise NonFiniteError(message)

