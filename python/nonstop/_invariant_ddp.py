"""nonstop.torch.DistributedDataParallel in the world-invariant mode
(init_process_group(world_invariant=True); docs/python.md, "World-invariant
DDP"): distributed.py makes one of these instead of the ring's."""

from __future__ import annotations

from typing import Any, List

import torch
import torch.distributed as dist

from . import _core, _device
from . import distributed as nd
from ._grads import _trainable, flat_views, grad_buffer, point_grads, raise_if_aborted

try:
    from torch.func import functional_call as _functional_call  # torch >= 2.0
except ImportError:  # torch 1.13
    from torch.nn.utils.stateless import functional_call as _functional_call

class _InvariantDDP(nd.DistributedDataParallel):
    """DistributedDataParallel when init_process_group(world_invariant=True):
    the forward runs the module once per micro-batch of this rank's share,
    each on its own leaves of the parameters (views of the same memory), so
    each micro-batch's gradient comes out alone; the end of backward folds
    them, in order, along the tree over the step's micro-batches
    (_core.TreeStep, nonstop-train's world-invariant code) and sums the
    members' partial sums along it. The loader deals each rank a number of
    micro-batches that is a power of two where the world allows, so a loss
    that is the mean over the rank's samples scales each micro-batch's
    gradient by a power of two only, which multiplying by the count undoes
    exactly: every world sums the same bits. Stock DDP's reducer is not used."""

    def __init__(self, module: Any, device_ids: Any = None, output_device: Any = None, dim: int = 0,
                 broadcast_buffers: bool = True, process_group: Any = None, **tuning: Any) -> None:
        nd._check_joined()
        if nd._session._deferred:
            nd._register_what_ddp_wraps(module)
        torch.nn.Module.__init__(self)
        if device_ids or output_device is not None or dim != 0 or process_group is not None:
            raise ValueError("the world-invariant DistributedDataParallel runs on the CPU over the whole world: "
                             "drop device_ids, output_device, dim and process_group")
        unknown = set(tuning) - {"bucket_cap_mb", "find_unused_parameters", "check_reduction",
                                 "gradient_as_bucket_view", "static_graph"}
        if unknown:
            raise TypeError(f"DistributedDataParallel got unexpected arguments {sorted(unknown)}")
        self.module = module
        self._params = _trainable(module)
        # Every name of every parameter (a tied weight has several): each one's leaf takes them all.
        index = {id(p): i for i, p in enumerate(self._params)}
        self._aliases = [(f"{prefix}.{name}" if prefix else name, index[id(p)])
                         for prefix, m in module.named_modules(remove_duplicate=False)
                         for name, p in m._parameters.items() if p is not None and id(p) in index]
        self._slices_of: Any = None  # (step, generation) of the forward whose backward is due
        self._grads = grad_buffer(self._params)
        self._views = flat_views(self._grads, self._params)
        self._trees: dict = {}  # micro-batches per step -> _core.TreeStep
        self._slices: List[Any] = []  # (micro-batch, its leaves) of the forward in flight
        self._queued = False
        with torch.no_grad():  # stock DDP's start: every member from rank 0's parameters and buffers
            for t in list(module.parameters()) + (list(module.buffers()) if broadcast_buffers else []):
                dist.broadcast(t.data, 0)

    def train(self, mode: bool = True) -> Any:
        return torch.nn.Module.train(self, mode)  # stock DDP's reaches for its reducer

    def no_sync(self) -> Any:
        raise NotImplementedError("no_sync in the world-invariant mode: each micro-batch's gradient is summed "
                                  "alone, so accumulating over several backward passes is not a step; "
                                  "make the loader's batch the whole step instead")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        micro, step_ = nd._loader.micro, nd._loader._outstanding()
        if not torch.is_grad_enabled() or micro is None or step_ is None:
            return self.module(*args, **kwargs)  # evaluation, or outside the loader's steps: the module alone
        nd._first_step()
        raise_if_aborted(nd._session)
        if self._slices and self._slices_of == (step_, nd._session.generation):
            raise RuntimeError("a second forward before the backward of the first: the world-invariant "
                               "DistributedDataParallel sums one forward's micro-batches per step")
        tree = self._trees.get(micro.micro_batches)
        if tree is None:
            tree = self._trees[micro.micro_batches] = _core.TreeStep(nd._session._joined(), micro.micro_batches,
                                                                     self._grads.numel(), False)
        planned = list(tree.plan(step_, micro.counts))
        if planned != list(range(micro.first, micro.first + len(micro.sizes))):
            raise RuntimeError(f"the tree planned micro-batches {planned}, the loader dealt "
                               f"{micro.first}..{micro.first + len(micro.sizes) - 1}")
        parts = _split_inputs(args, kwargs, micro.sizes)
        self._slices, outs = [], []
        for mb, (a, kw) in zip(planned, parts):
            leaves = [p.detach().requires_grad_() for p in self._params]
            outs.append(_functional_call(self.module, {name: leaves[i] for name, i in self._aliases}, a, kw))
            self._slices.append((mb, leaves))
        self._slices_of = (step_, nd._session.generation)
        out = _concat(outs)
        self._queued = False
        for t in _tensors(out):
            if t.requires_grad:
                t.register_hook(self._in_backward)
        return out

    def _in_backward(self, grad: Any) -> Any:
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        return grad

    def _end_of_backward(self) -> None:
        self._queued = False
        micro, s = nd._loader.micro, nd._loader.micro_batch
        mine, whole = nd._loader._share_of_batch
        tree = self._trees[micro.micro_batches]
        factor = float(mine) / s  # a power of two where the loader could deal so: exact
        for mb, leaves in self._slices:
            for view, leaf in zip(self._views, leaves):
                if leaf.grad is None:
                    view.zero_()
                else:
                    view.copy_(leaf.grad)
            if factor != 1.0:
                self._grads.mul_(factor)
            _device.on_host(self._grads, "tree.add", lambda host, mb=mb: tree.add(mb, host.data_ptr()),
                            write_back=False)
        self._slices = []
        # Aborted: the step runs again
        _device.on_host(self._grads, "tree.reduce", lambda host: tree.reduce(host.data_ptr()))
        self._grads.mul_(float(s) / whole)
        point_grads(self._params, self._views)


def _split_inputs(args: Any, kwargs: Any, sizes: List[int]) -> List[Any]:
    """The forward's arguments cut into micro-batches: tensors with the share's
    rows along dim 0, everything else passed to each whole."""
    rows = sum(sizes)
    found = False

    def cut(v: Any) -> Any:
        nonlocal found
        if torch.is_tensor(v) and v.dim() > 0 and v.size(0) == rows:
            found = True
            return list(torch.split(v, sizes))
        return [v] * len(sizes)

    cut_args = [cut(a) for a in args]
    cut_kwargs = {k: cut(v) for k, v in kwargs.items()}
    if not found:
        raise ValueError(f"none of the forward's tensors has this rank's {rows} samples along dim 0: the "
                         "world-invariant mode cuts the loader's batch into micro-batches")
    return [(tuple(a[j] for a in cut_args), {k: v[j] for k, v in cut_kwargs.items()}) for j in range(len(sizes))]


def _concat(outs: List[Any]) -> Any:
    first = outs[0]
    if torch.is_tensor(first):
        return first if len(outs) == 1 else torch.cat(outs)
    if isinstance(first, (tuple, list)):
        return type(first)(_concat([o[i] for o in outs]) for i in range(len(first)))
    if isinstance(first, dict):
        return {k: _concat([o[k] for o in outs]) for k in first}
    raise TypeError(f"the world-invariant mode joins the micro-batches' outputs along dim 0: a "
                    f"{type(first).__name__} cannot be joined")


def _tensors(out: Any) -> List[Any]:
    if torch.is_tensor(out):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _tensors(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in _tensors(o)]
    return []
