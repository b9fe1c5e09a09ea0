"""Sharded optimizer state from Python (ZeRO-1, docs/sharding.md, docs/python.md
"Sharded optimizer state"): the C++ trainer's `optimizer.shard_group` for a
PyTorch loop.

The world is cut into groups of `shard_group` ranks; the parameters and
gradients live in one flat buffer, padded to a multiple of the group size,
and rank r updates only shard r mod G of it, with optimizer state for that
shard alone (1/G of the whole). A step:

    ddp(inputs) ... loss.backward()   # local gradients; the first forward gathers the parameters
    ddp.reduce()                      # this rank's shard of the gradient: the world's sum
    optimizer.clip_grad_norm_(1.0)    # the norm over every shard
    optimizer.step()                  # this shard's update

After a fault, a spare (or a rank moved by a resize) copies its shard's
optimizer state from the shard's other holders; the parameters are gathered
whole again before the next forward.

The gather is a collective of the group, done at the first forward (or
`reduce()`, for a rank with no micro-batch) after `optimizer.step()` or a
recovery: that is the start of the next step on every rank, as the C++
trainer gathers at the start of each step (so a fault in it never follows an
update the controller has not heard of). A forward outside the step on some
ranks only (evaluation on rank 0) would gather alone: call ``ddp.gather()``
on every rank first. Every rank must use the same intra-op thread count
(``torch.set_num_threads``): the gradient norm's sum of squares is a torch
reduction, and the replicas of a shard must clip by the same factor.
"""

from __future__ import annotations

import math
from typing import Any, List, Optional

import torch

from . import Session, _check_tensor, _device, _one_device, _unique_parameters
from ._grads import adopt_grad, flat_views, point_grads, raise_if_aborted

__all__ = ["ShardedOptimizer", "ShardedDataParallel"]


class ShardedOptimizer:
    """`optimizer_class(params, **defaults)` over this rank's shard of the
    model's parameters, as one flat parameter; its state has 1/`shard_group`
    of the whole's size. Construct it before ``session.register(model,
    optimizer)``, which registers the shard state; then wrap the model in
    :class:`ShardedDataParallel`. One parameter group: the hyperparameters
    apply to every parameter."""

    def __init__(self, model: torch.nn.Module, optimizer_class: Any, shard_group: int, **defaults: Any) -> None:
        if not isinstance(shard_group, int) or shard_group < 1:
            raise ValueError(f"shard_group must be a positive int, got {shard_group!r}")
        params = _parameters(model)
        self.model = model
        self.shard_group = shard_group
        self.numel = sum(p.numel() for p in params)
        self.padded = math.ceil(self.numel / shard_group) * shard_group
        self.shard_len = self.padded // shard_group
        self.shard_param = torch.nn.Parameter(torch.zeros(self.shard_len))
        self.inner = optimizer_class([self.shard_param], **defaults)
        self._ddp: Optional[ShardedDataParallel] = None

    @property
    def param_groups(self) -> List[dict]:
        return self.inner.param_groups

    @property
    def state(self) -> Any:
        return self.inner.state

    def _attach(self, ddp: "ShardedDataParallel") -> None:
        self._ddp = ddp

    def _shard_span(self) -> slice:
        ddp = self._attached()
        shard = ddp._session._core.shard
        return slice(shard * self.shard_len, (shard + 1) * self.shard_len)

    def _attached(self) -> "ShardedDataParallel":
        if self._ddp is None:
            raise RuntimeError("wrap the model in nonstop.torch.ShardedDataParallel(model, session, optimizer) first")
        return self._ddp

    def zero_grad(self, set_to_none: bool = False) -> None:
        self._attached().zero_grad()

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Scales this rank's shard of the (reduced) gradient so that the
        whole gradient's norm is at most `max_norm`; returns the norm before.
        The group shares each shard's sum of squares (a collective: every rank
        calls it). Raises Aborted."""
        ddp = self._attached()
        core = ddp._session._core
        grad = ddp._grads[self._shard_span()]
        records = torch.zeros(self.shard_group, dtype=torch.float64)
        records[core.shard] = grad.double().pow(2).sum()
        core.gather_shards(records.data_ptr(), records.numel() * 8, 8)
        norm = math.sqrt(float(records.sum()))
        coef = max_norm / (norm + 1e-6)
        if coef < 1:
            grad.mul_(coef)
        return norm

    def step(self) -> None:
        """This shard's update (after ddp.reduce()); the parameters are
        gathered whole again at the next forward."""
        ddp = self._attached()
        span = self._shard_span()
        with torch.no_grad():
            self.shard_param.copy_(ddp._flat[span])
            self.shard_param.grad = ddp._grads[span]
            self.inner.step()
            ddp._flat[span].copy_(self.shard_param)
        ddp._stale = True


class ShardedDataParallel(torch.nn.Module):
    """Wraps `module` (registered with `session` together with a
    :class:`ShardedOptimizer`): gradients accumulate locally in one flat
    buffer; `reduce()` leaves this rank's shard of it holding the world's sum
    (`Session::ReduceShards`: a reduce-scatter in the group, then an
    all-reduce across the shard's replicas). Gradients are summed, not
    averaged: scale the loss by one over the global batch."""

    def __init__(self, module: torch.nn.Module, session: Session, optimizer: ShardedOptimizer) -> None:
        super().__init__()
        if not isinstance(optimizer, ShardedOptimizer):
            raise TypeError(f"optimizer must be a nonstop.torch.ShardedOptimizer, got {type(optimizer).__name__}")
        core = session._joined()
        if session._flat_padded is None or session._flat_padded.numel() != optimizer.padded:
            raise ValueError("register the model with its ShardedOptimizer first: session.register(model, optimizer)")
        if core.shard_group != optimizer.shard_group:
            raise RuntimeError(f"the session shards in groups of {core.shard_group}, the optimizer in groups of "
                               f"{optimizer.shard_group}")
        self.module = module
        self._session = session
        self._optimizer = optimizer
        self._flat = session._flat_padded  # host memory: the registered parameters
        # On a GPU (docs/gpu.md, "Sharded state on a GPU"): the model's parameters and gradients live
        # in buffers of their own there, the gradients copied down before each reduce() and the
        # gathered parameters copied up; None: the model's are _flat and _grads themselves.
        self._device_flat = session._device_flat
        on_gpu = self._device_flat is not None and self._device_flat.device.type == "cuda"
        self._grads = torch.zeros(optimizer.padded, dtype=torch.float32, pin_memory=on_gpu)  # reduced here
        # The buffer the model's gradients are views of: _grads, or one beside the model's parameters.
        self._model_grads = self._grads if self._device_flat is None else torch.zeros_like(self._device_flat)
        self._params = _parameters(module)
        self._views = flat_views(self._model_grads, self._params)
        self._stale = True  # the parameters must be gathered whole before the next forward
        session.on_membership_change(lambda _change: setattr(self, "_stale", True))
        session._before_finish.append(self.gather)
        optimizer._attach(self)
        self.zero_grad()

    def zero_grad(self, set_to_none: bool = False) -> None:
        self._model_grads.zero_()  # _grads, when it is another buffer, is overwritten by reduce()
        point_grads(self._params, self._views)

    def gather(self) -> None:
        """Every rank of the group holds the whole parameters again (each
        updated only its shard). The next forward does it by itself."""
        self._session._core.gather_shards(self._flat.data_ptr(), self._flat.numel() * 4, 4)
        if self._device_flat is not None:
            _device.copy(self._device_flat, self._flat, "shard.params")
        self._stale = False

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise_if_aborted(self._session)
        self._session.begin_training()  # a joiner: from the peers' state, not its setup's
        if self._stale:
            self.gather()
        return self.module(*args, **kwargs)

    def reduce(self) -> None:
        """This rank's shard of the gradient buffer holds the world's sum
        afterwards (the rest is scratch). Raises Aborted."""
        if self._stale:  # a rank that ran no forward this step: the group's gather, in the same order
            self.gather()
        for p, view in zip(self._params, self._views):  # a .grad replaced (set_to_none): back into the buffer
            adopt_grad(p, view)
        if self._model_grads is not self._grads:
            _device.copy(self._grads, self._model_grads, "shard.grads")
        self._session._maybe_inject()
        self._session._core.reduce_shards(self._grads.data_ptr(), self._grads.numel())


def _parameters(model: torch.nn.Module) -> List[torch.nn.Parameter]:
    """Every parameter of the model, each once, in register()'s order, checked."""
    params = _unique_parameters(model)
    if not params:
        raise ValueError("the model has no parameters")
    for i, p in enumerate(params):
        _check_tensor(p, f"parameter {i} of the model")
        if not p.requires_grad:
            raise ValueError(f"parameter {i} does not require gradients: a sharded optimizer updates every "
                             "parameter of the model (freeze nothing, or leave it out of the model)")
    _one_device(params, "the model's parameters")
    return params
