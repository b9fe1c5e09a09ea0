"""The gradient buffer the data-parallel wrappers share (nonstop.torch's
DataParallel and InvariantDataParallel, nonstop.sharded's ShardedDataParallel, and
nonstop.distributed's world-invariant DistributedDataParallel):
every parameter's ``.grad`` is a view of one flat float32 buffer, so a
reduction or a fold reads one span. Private."""

from __future__ import annotations

from typing import Any, List

import torch

from . import Aborted, _check_tensor, _one_device, _unique_parameters


def _trainable(module: torch.nn.Module) -> List[torch.nn.Parameter]:
    """The module's parameters that require gradients, each once, checked."""
    params = [p for p in _unique_parameters(module) if p.requires_grad]
    if not params:
        raise ValueError("the module has no parameters that require gradients")
    for i, p in enumerate(params):
        _check_tensor(p, f"parameter {i} of the module")
    _one_device(params, "the module's parameters")
    return params


def grad_buffer(params: List[torch.nn.Parameter]) -> torch.Tensor:
    """The zeroed flat float32 buffer of `params`' gradients, on their device."""
    return torch.zeros(sum(p.numel() for p in params), dtype=torch.float32, device=params[0].device)


def flat_views(buffer: torch.Tensor, params: List[torch.nn.Parameter]) -> List[torch.Tensor]:
    """Each parameter's slice of `buffer`, in order, shaped like it."""
    views = []
    offset = 0
    for p in params:
        views.append(buffer[offset:offset + p.numel()].view_as(p))
        offset += p.numel()
    return views


def point_grads(params: List[torch.nn.Parameter], views: List[torch.Tensor]) -> None:
    """Every ``.grad`` the view of the buffer (after the buffer was zeroed)."""
    for p, view in zip(params, views):
        p.grad = view


def adopt_grad(p: torch.nn.Parameter, view: torch.Tensor) -> None:
    """Brings ``p.grad`` back into its view: ``optimizer.zero_grad(set_to_none=True)``
    or autograd replaced it with a new tensor (None: zeros)."""
    g = p.grad
    if g is None:
        view.zero_()
    elif g.data_ptr() != view.data_ptr():
        with torch.no_grad():
            view.copy_(g)
    p.grad = view


def raise_if_aborted(session: Any) -> None:
    """Aborted once the generation is: the step in flight is cut short."""
    if session._core.aborted():
        raise Aborted("the generation was aborted: the step in flight is lost; call session.recover()")
