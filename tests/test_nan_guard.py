"""The NaN guard's local check (one process): it reads the gradients' norm, as megatron-core's
``check_grads`` does, so finite gradients whose norm overflows stop the run too."""
import math

import torch

from megatron_integration.nan_guard import describe, local_values


def local_flags(module, loss_sum, device) -> torch.Tensor:
    """[loss not finite, gradient norm not finite] of one rank, from what the check reads of it."""
    has_loss, loss, norm = (float(v) for v in local_values(module, loss_sum, device))
    return torch.tensor([float(has_loss > 0 and not math.isfinite(loss)), float(not math.isfinite(norm))])


def _module(grad: torch.Tensor, main_grad: bool = False) -> torch.nn.Module:
    """Two layers, healthy gradients on the first and ``grad`` on the second's weight (the
    check must read every parameter, not the first)."""
    m = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(grad.shape[1], grad.shape[0], bias=False))
    for p, g in ((m[0].weight, torch.ones(3, 3)), (m[0].bias, torch.ones(3)), (m[1].weight, grad)):
        if main_grad:  # megatron-core's DDP accumulates into main_grad and leaves .grad empty
            p.main_grad = g
        else:
            p.grad = g
    return m


def test_a_finite_loss_and_gradient_norm_pass():
    flags = local_flags(_module(torch.full((4, 8), 1e3)), torch.tensor(2.5), torch.device("cpu"))
    assert flags.tolist() == [0.0, 0.0]
    assert describe(3, flags[None]) is None


def test_nan_infinite_and_overflowing_gradients_are_caught_wherever_they_accumulate():
    cpu = torch.device("cpu")
    for main_grad in (False, True):
        nan = torch.ones(4, 8)
        nan[1, 2] = float("nan")
        assert local_flags(_module(nan, main_grad), None, cpu).tolist() == [0.0, 1.0]
        # Every element finite, their squares not: megatron-core's bucket norm is infinite.
        huge = torch.full((4, 8), 1e25)
        assert torch.isfinite(huge).all()
        assert local_flags(_module(huge, main_grad), None, cpu).tolist() == [0.0, 1.0]
    flags = local_flags(_module(torch.ones(4, 8)), float("inf"), cpu)
    assert flags.tolist() == [1.0, 0.0]
    message = describe(2, torch.stack([flags, torch.tensor([0.0, 1.0])]))
    assert message.startswith("iteration 2: the loss is NaN or infinite on rank 0 and the gradient norm is NaN or "
                              "infinite on rank 1; stopped before the optimizer step")
