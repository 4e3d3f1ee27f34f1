"""What the NaN/Inf check reads of a rank, and how a rejected result is told.

Megatron-LM's ``--check-for-nan-in-loss-and-grad`` (on by default): a loss or a gradient
that is NaN or infinite means the run has diverged (a learning rate far too high, a
corrupted checkpoint, bad data) or a device computed wrongly, and every later step and
checkpoint would carry it on. :class:`megatron_integration.rerun.ResultValidator` gathers
every rank's :func:`local_values` after the backward pass and before ``optimizer.step()``
(collective, so every rank learns which ranks saw what and ends the same way; no rank is
left waiting in a collective), and stops with :class:`NonFiniteError` or computes the
iteration again as ``--rerun-mode`` says.

With fp16 and loss scaling, infinite gradients are an overflow of the scaled loss, not
a divergence: megatron-core's optimizer finds them, skips the step and lowers the
scale, and the log counts it in ``number of skipped iterations``. The check is off then
(as in Megatron-LM), unless a static ``--loss-scale`` is given.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch

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


def local_values(module: torch.nn.Module, loss_sum, device: torch.device) -> torch.Tensor:
    """``[has a loss, loss sum, gradient 2-norm]`` of this rank as a float64 tensor.

    ``loss_sum``: this rank's summed loss (a tensor or a float; None on ranks without a
    loss, i.e. every stage but the last: then the first two are 0). The norm is a 2-norm, as
    megatron-core's ``check_grads`` takes it, not element by element: it is NaN for a NaN anywhere
    and infinite for an infinite element or for finite ones whose squares overflow (a diverged run
    whose clipped steps still move Adam's moments). It is read where the caller reads it: the
    steppers read it after the data-parallel and embedding reductions, where megatron-core checks
    each bucket before its reduction, so a NaN of one replica is every replica's here.
    """
    values = torch.zeros(3, dtype=torch.float64, device=device)
    if loss_sum is not None:
        values[0] = 1.0
        values[1] = float(loss_sum.detach().double().sum()) if torch.is_tensor(loss_sum) else float(loss_sum)
    norms = [torch.linalg.vector_norm(g, dtype=torch.float32) for g in _grads(module)]
    if norms:
        # One device-to-host read for all parameters, not one per parameter.
        values[2] = torch.linalg.vector_norm(torch.stack(norms)).double()
    return values


def _ranks(column: torch.Tensor) -> list[int]:
    return [int(r) for r in torch.nonzero(column > 0).flatten().tolist()]


def ranks_text(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def rejection(iteration: int, all_flags: torch.Tensor) -> Optional[str]:
    """``iteration N: the loss is NaN or infinite on rank R ...`` for gathered ``[world, 2]``
    flags (``iteration`` 1-based), or None when all is finite."""
    loss_ranks, grad_ranks = _ranks(all_flags[:, 0]), _ranks(all_flags[:, 1])
    if not loss_ranks and not grad_ranks:
        return None
    what = []
    if loss_ranks:
        what.append(f"the loss is NaN or infinite on {ranks_text(loss_ranks)}")
    if grad_ranks:
        what.append(f"the gradient norm is NaN or infinite on {ranks_text(grad_ranks)}")
    return f"iteration {iteration}: {' and '.join(what)}"


def describe(iteration: int, all_flags: torch.Tensor) -> Optional[str]:
    """The one-line message for gathered ``[world, 2]`` flags, or None when all is finite.

    ``iteration`` is 1-based, as in the log lines.
    """
    what = rejection(iteration, all_flags)
    if what is None:
        return None
    return (f"{what}; stopped before the optimizer step, so no weight was "
            f"updated or saved from it. Lower --lr, check the data and the checkpoint loaded, or pass "
            f"--no-check-for-nan-in-loss-and-grad to train on regardless.")
