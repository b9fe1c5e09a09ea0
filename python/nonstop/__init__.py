"""nonstop: checkpointless recovery and live elasticity for PyTorch training.

An ordinary data-parallel PyTorch script gains both with a few lines, and runs
under ``nonstop run``::

    import nonstop, nonstop.torch

    session = nonstop.join()
    model, optimizer = build()                      # as before
    session.register(model, optimizer)              # what must survive a fault
    ddp = nonstop.torch.DataParallel(model, session)
    step = session.resume_step
    while True:
        try:
            for step in range(step, steps):
                loss = ddp(batch(step)).sum() / global_batch
                loss.backward()                     # gradients summed while backward runs
                optimizer.step()
                optimizer.zero_grad()
                session.report_step(step, loss.item())
            session.finish(steps - 1)
            break
        except nonstop.Aborted:                     # a peer failed, or the world changes
            step = session.recover()                # state is current again

When a worker dies or hangs, the others keep their processes, models and
data: the reducing call raises :class:`Aborted`, :meth:`Session.recover`
waits for the new membership (a spare takes the lost rank and copies its state
from healthy peers), and the loop redoes the step it was on. Nothing is
restarted and nothing is read from disk.

The package does not link against PyTorch's C++ library: tensors reach the
native half by address, after the checks here (CPU, contiguous, float32), so
one build works with whichever torch is installed. See docs/python.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
import traceback
from array import array
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Tuple

from . import _core, _device

# Importing _core took the job token (from the memfd NONSTOP_JOB_TOKEN_FD names, or from
# NONSTOP_JOB_TOKEN) and removed both from the C environment; os.environ, Python's copy made at
# start-up, drops them too, so that no process this script starts sees them (docs/security.md).
for _name in ("NONSTOP_JOB_TOKEN", "NONSTOP_JOB_TOKEN_FD"):
    os.environ.pop(_name, None)

__all__ = [
    "Aborted",
    "Extra",
    "Released",
    "JobEnded",
    "InjectedFault",
    "MembershipChange",
    "Session",
    "join",
]

Aborted = _core.Aborted


class Released(SystemExit):
    """This worker is no longer needed: the world shrank without it, or the job
    ended before a spare was given a rank. Uncaught, it exits with status 0."""

    def __init__(self, message: str) -> None:
        super().__init__(0)
        self.message = message

    def __str__(self) -> str:
        return self.message


class JobEnded(SystemExit):
    """The controller ended the job with an error; uncaught, the process exits
    with the job's exit code."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(exit_code)
        self.message = message

    def __str__(self) -> str:
        return self.message


class InjectedFault(RuntimeError):
    """The exception that ``nonstop run --inject exception:rank=R,step=S`` raises
    in rank R's reducing call of step S. Uncaught, it ends the process, which
    is the fault being injected."""


@dataclasses.dataclass(frozen=True)
class MembershipChange:
    """What the last join or recovery changed."""

    generation: int
    old_world: int  # 0 before the first generation
    new_world: int
    old_rank: int
    new_rank: int
    resume_step: int
    reason: str  # "start", "recovery", "resize: ...", "restart"


def _check_tensor(t: Any, what: str) -> None:
    """Raises TypeError/ValueError unless `t` is a contiguous float32 tensor on the CPU or a GPU."""
    if not hasattr(t, "data_ptr") or not hasattr(t, "is_contiguous"):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    _device.device_index(t, what)
    if str(t.dtype) != "torch.float32":
        raise TypeError(f"{what} has dtype {t.dtype}; nonstop reduces torch.float32 tensors: convert with .float()")
    if not t.is_contiguous():
        raise ValueError(f"{what} is not contiguous (strides {tuple(t.stride())}): pass {what}.contiguous(), "
                         "and reduce into that tensor")


def _span(t: Any) -> Tuple[int, int]:
    """(address, bytes) of a contiguous tensor's memory."""
    return t.data_ptr(), t.numel() * t.element_size()


# A registered region as nonstop._core takes it: (name, address, bytes, kind,
# shape, device: -1 for host memory, N for cuda:N, whose bytes the native half
# reads and writes through CUDA).
_Region = Tuple[str, int, int, str, List[int], int]


def _region(name: str, t: Any, kind: str, shape: List[int]) -> _Region:
    """The region of tensor `t`'s memory."""
    return (name, *_span(t), kind, shape, _device.device_index(t, name))


def _one_device(tensors: List[Any], what: str) -> Any:
    """The device every tensor of `tensors` is on; ValueError naming two that differ."""
    devices = {str(t.device): t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(f"{what} are on {', '.join(sorted(devices))}: nonstop registers them in one buffer, on "
                         "one device; move them to one (model.to(device)) before registering")
    return next(iter(devices.values()))


class Extra:
    """Python numbers that must survive a fault (counters, the position in an
    epoch), kept in registered memory. Keys are fixed at registration; ints
    stay ints (64-bit) and floats stay floats."""

    def __init__(self, values: Mapping[str, Any], name: str = "extra", per_rank: bool = False) -> None:
        self._name = name  # of the regions, and of the argument in messages
        self._per_rank = per_rank
        self._kind: Dict[str, Tuple[str, int]] = {}
        self._ints = array("q")
        self._floats = array("d")
        for key, value in values.items():
            if not isinstance(key, str):
                raise TypeError(f"{name} keys are strings, got {key!r}")
            if isinstance(value, bool) or isinstance(value, int):
                self._kind[key] = ("q", len(self._ints))
                self._ints.append(int(value))
            elif isinstance(value, float):
                self._kind[key] = ("d", len(self._floats))
                self._floats.append(value)
            else:
                raise TypeError(f"{name}[{key!r}] is a {type(value).__name__}; nonstop keeps ints and floats "
                                "(keep tensors with register(tensors={...}))")

    def __getitem__(self, key: str) -> Any:
        kind, i = self._slot(key)
        return self._ints[i] if kind == "q" else self._floats[i]

    def __setitem__(self, key: str, value: Any) -> None:
        kind, i = self._slot(key)
        if kind == "q":
            if not isinstance(value, int):
                raise TypeError(f"{self._name}[{key!r}] was registered as an int; got {type(value).__name__}")
            self._ints[i] = value
        else:
            self._floats[i] = float(value)

    def __contains__(self, key: object) -> bool:
        return key in self._kind

    def keys(self) -> Iterable[str]:
        return self._kind.keys()

    def as_dict(self) -> Dict[str, Any]:
        return {k: self[k] for k in self._kind}

    def __repr__(self) -> str:
        return f"Extra({self.as_dict()!r})"

    def _slot(self, key: str) -> Tuple[str, int]:
        if key not in self._kind:
            raise KeyError(f"{key!r} was not registered; the keys are {sorted(self._kind)} "
                           f"(register every key with session.register({self._name}={{...}}))")
        return self._kind[key]

    def _regions(self) -> List[_Region]:
        regions = []
        marked = ":per_rank" if self._per_rank else ""
        if len(self._ints):
            address, n = self._ints.buffer_info()
            regions.append((f"{self._name}.int", address, n * self._ints.itemsize, "I64" + marked, [n], -1))
        if len(self._floats):
            address, n = self._floats.buffer_info()
            regions.append((f"{self._name}.float", address, n * self._floats.itemsize, "F64" + marked, [n], -1))
        return regions


# Optimizers whose state, created lazily at their first step, starts as zeros:
# nonstop creates it up front (a step on zero gradients, then the parameters
# restored and the state zeroed) so that it can be registered before training.
_ZERO_INITIALISED_OPTIMIZERS = ("Adam", "AdamW", "SGD")


class Session:
    """One worker's membership in a nonstop job. Made by :func:`join`."""

    def __init__(self) -> None:
        # The job token is checked as the session joins: it is in no variable any more by now.
        missing = [v for v in ("NONSTOP_CONTROLLER", "NONSTOP_WORKER_ID") if not os.environ.get(v)]
        if missing:
            raise RuntimeError(f"{', '.join(missing)} not set: start this script under `nonstop run`, e.g. "
                               f"`nonstop run --nproc 4 --spares 1 -- {os.path.basename(sys.executable)} "
                               f"{os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else 'train.py'}`")
        self._core: Optional[Any] = None
        self._keep: List[Any] = []  # what the registered regions point into
        self._params: Optional[Any] = None  # the flat parameter tensor
        self._step_in_flight = 0
        self._last_report: Optional[Tuple[int, int, float]] = None  # (step, generation, time.monotonic())
        self._held_recovery: Any = None  # see _recover_in_place
        self._flat_padded: Optional[Any] = None  # sharded: the parameters, padded to the shard group
        self._device_flat: Optional[Any] = None  # sharded, on a GPU: the model's, of which _flat_padded is the copy
        self._shard_group = 0
        self._before_finish: List[Callable[[], None]] = []  # collectives due before the final checksum
        # Run at a recovery's start, before any state is copied: DDP puts back the buffers the lost
        # step's forward changed (DistributedDataParallel._roll_back_buffers).
        self._before_recover: List[Callable[[], None]] = []
        self._callbacks: List[Callable[[MembershipChange], None]] = []
        self._reserved: List[Tuple[int, int, str]] = []  # (begin, end, what) of registered memory
        self._twins: List[Any] = []  # the host twins of GPU buckets in flight (_start_allreduce)
        self._watch: List[Tuple[Callable[[], Any], int, str]] = []  # (tensor getter, registered address, what)
        self._named: List[Tuple[str, Any]] = []  # the parameters by the model's names, in the flat buffer's order
        self._optimizer: Any = None
        self._tensor_regions: List[_Region] = []  # tensors={...} and per_rank's tensors
        self._buffers: List[Tuple[str, Any]] = []  # the model's buffers by its names for them
        self._ckpt_step: Any = None  # the checkpoint's "step": steps completed (set when one is saved)
        self._resumed_wholes: Dict[str, Any] = {}  # sharded, resumed: whole state per key until adopted
        self.extra = Extra({})
        self.per_rank = Extra({}, "per_rank", per_rank=True)
        self._deferred = False  # joined before registering (join_first); register() completes the join

    # ---- joining ----

    def register(self, model: Any = None, optimizer: Any = None, extra: Optional[Mapping[str, Any]] = None, *,
                 tensors: Optional[Mapping[str, Any]] = None, per_rank: Optional[Mapping[str, Any]] = None,
                 resume_from: Optional[str] = None) -> "Session":
        """Registers what must survive a fault, then joins the job.

        - `model`: its parameters are moved into one flat buffer (each
          parameter becomes a view into it), so a recovering worker copies
          them in one striped transfer. Its buffers (BatchNorm's running
          statistics) are registered in place, as per-rank state.
        - `optimizer`: its state (AdamW's moments and step) is created now if
          it does not exist yet, and moved into one flat buffer too.
        - `extra`: Python ints and floats, read and written afterwards as
          ``session.extra["key"]``.
        - `tensors`: other CPU tensors kept in place (contiguous).
        - `per_rank`: ints, floats and tensors that are each rank's own (a
          sample counter, an RNG state), read and written as
          ``session.per_rank["key"]`` (numbers) or in place (tensors). Never
          compared by the replica check; a spare that takes a rank gets a
          survivor's values (docs/python.md, "Per-rank state").
        - `resume_from`: a directory of durable checkpoints (save_checkpoint):
          the newest valid one is loaded into the registered state before
          joining; none there, the job starts afresh.

        A spare blocks here, warm, until it is given a rank; its state is then
        copied from the healthy workers before this returns. Raises
        :class:`Released` if the job ends first.
        """
        if self._core is not None and not self._deferred:
            raise RuntimeError("register() was called twice: a session registers its state once, before training")
        try:
            self._register(model, optimizer, extra, tensors, per_rank, resume_from)
        except BaseException:
            # Nothing half-registered is left behind: a retry starts afresh.
            self._reserved.clear()
            self._keep.clear()
            self._watch.clear()
            self._named.clear()
            self._tensor_regions.clear()
            self._buffers.clear()
            self._resumed_wholes.clear()
            self._optimizer = None
            self._params = None
            self._flat_padded = None
            self._device_flat = None
            self._shard_group = 0
            self._before_finish.clear()
            raise
        self._step_in_flight = self._core.resume_step
        self._after_resume()
        _install_failure_report(self)
        return self

    def _register(self, model: Any, optimizer: Any, extra: Optional[Mapping[str, Any]],
                  tensors: Optional[Mapping[str, Any]], per_rank: Optional[Mapping[str, Any]],
                  resume_from: Optional[str] = None) -> None:
        from .sharded import ShardedOptimizer

        regions: List[_Region] = []
        params: List[Any] = []
        sharded = isinstance(optimizer, ShardedOptimizer)
        if model is not None:
            params = _unique_parameters(model)
            if not params:
                raise ValueError("the model has no parameters to register")
            names = {}
            for n, p in model.named_parameters():
                names.setdefault(id(p), n)
            self._named = [(names[id(p)], p) for p in params]
            for i, p in enumerate(params):
                _check_tensor(p, f"parameter {i} of the model")
            flat = _flatten_parameters(params, optimizer.padded if sharded else 0)
            if sharded and _device.staged(flat):
                # Sharded state lives in host memory (docs/gpu.md): the registered parameters are a
                # host copy of the GPU's, which ShardedDataParallel copies up after each gather.
                self._device_flat = flat
                self._reserve(flat, "the model's parameters on their device")
                flat = _device.host_copy(flat, "shard.params")
            self._params = flat[:sum(p.numel() for p in params)]
            self._reserve(flat, "the model's parameters")
            for i, p in enumerate(params):
                self._watch.append((lambda p=p: p, p.data_ptr(), f"parameter {i}"))
            if sharded:
                if optimizer.model is not model:
                    raise ValueError("the ShardedOptimizer was made for another model: register the model it updates")
                self._flat_padded = flat
                self._shard_group = optimizer.shard_group
                regions.append(_region("params", flat, "SHARD_VIEW", [flat.numel()]))
            else:
                regions.append(_region("params", flat, "F32", [flat.numel()]))
        if optimizer is not None:
            if model is None:
                raise ValueError("register(optimizer=...) needs the model too: the optimizer's state is kept per parameter")
            self._optimizer = optimizer
            regions += (self._register_shards(optimizer, bool(resume_from)) if sharded
                        else self._register_optimizer(optimizer, params))
        if model is not None:
            regions += self._register_buffers(model)
        if extra:
            self.extra = Extra(extra)
            regions += self.extra._regions()
        for name, t in (tensors or {}).items():
            self._register_tensor(name, t, "tensors", "tensor")
        per_rank = dict(per_rank or {})
        numbers = {k: v for k, v in per_rank.items() if not hasattr(v, "data_ptr")}
        if numbers:
            self.per_rank = Extra(numbers, "per_rank", per_rank=True)
            regions += self.per_rank._regions()
        for name, t in per_rank.items():
            if hasattr(t, "data_ptr"):
                self._register_tensor(name, t, "per_rank", "per_rank.tensor", ":per_rank")
        regions += self._tensor_regions
        self._keep += [self.extra, self.per_rank]
        import torch

        self._ckpt_step = torch.zeros(1, dtype=torch.int64)
        if self._deferred:
            if resume_from or self._shard_group:
                raise ValueError("a script that made its process group before its model resumes no checkpoint and "
                                 "shards no optimizer state: call nonstop.torch.init_process_group(model, optimizer, "
                                 "loader, resume_from=...) once they exist, instead of init_process_group(backend=...)")
            try:
                self._core.complete_join(regions)
            except _core.Cancelled as e:
                raise Released(str(e)) from None
            self._deferred = False
            return
        layout = self._checkpoint_layout(self._resumed_wholes) if resume_from else []
        try:
            self._core = _core.Session.join(regions, resume_from=os.fspath(resume_from) if resume_from else "",
                                            shard_group=self._shard_group, checkpoint=layout,
                                            required=self._required_in_checkpoints() if resume_from else [],
                                            optional=[name for name, _ in self._buffers],
                                            on_loaded=self._on_checkpoint_loaded,
                                            cuda_devices=self._unregistered_cuda_devices())
        except _core.Cancelled as e:
            raise Released(str(e)) from None

    def _register_tensor(self, name: str, t: Any, argument: str, prefix: str, marked: str = "") -> None:
        if not hasattr(t, "data_ptr"):
            raise TypeError(f"{argument}[{name!r}] must be a torch.Tensor, got {type(t).__name__}")
        _device.device_index(t, f"{argument}[{name!r}]")
        if not t.is_contiguous():
            raise ValueError(f"{argument}[{name!r}] must be contiguous (strides {tuple(t.stride())}): pass "
                             f"{argument}[{name!r}].contiguous() and keep using that tensor")
        self._reserve(t, f"{argument}[{name!r}]")
        self._keep.append(t.detach())  # the memory, even if `t` is later pointed elsewhere
        self._watch.append((lambda t=t: t, t.data_ptr(), f"{argument}[{name!r}]"))
        kind = "F32" if str(t.dtype) == "torch.float32" else "U8"
        self._tensor_regions.append(_region(f"{prefix}.{name}", t, kind + marked,
                                            [t.numel()] if kind == "F32" else []))

    def _register_buffers(self, model: Any) -> List[_Region]:
        """The model's persistent buffers (BatchNorm's running statistics and its count), each in
        place, as per-rank state: every rank updates them with its own batch in the forward, so they
        differ at a step's end even where DDP broadcasts rank 0's at the next forward's start. A
        non-persistent buffer (a mask) is the setup's to make, as torch's state_dict leaves it out."""
        regions: List[_Region] = []
        seen = set()
        for prefix, module in model.named_modules():
            for key, b in list(module._buffers.items()):
                if b is None or id(b) in seen or b.numel() == 0 or key in module._non_persistent_buffers_set:
                    continue  # shared: registered once; non-persistent (a mask): the setup makes it
                seen.add(id(b))
                name = f"{prefix}.{key}" if prefix else key
                if not b.is_contiguous():  # before training: its module holds the copy from now on
                    b = module._buffers[key] = b.contiguous()
                _device.device_index(b, f"buffer {name!r}")
                self._reserve(b, f"the model's buffer {name!r}")
                self._keep.append(b)
                self._watch.append((lambda m=module, k=key: m._buffers[k], b.data_ptr(), f"the model's buffer {name!r}"))
                self._buffers.append((name, b))
                kind = "F32" if str(b.dtype) == "torch.float32" else "U8"
                regions.append(_region(f"buffer.{name}", b, kind + ":per_rank", [b.numel()] if kind == "F32" else []))
        return regions

    def _join_first(self) -> None:
        """Joins the job before the state exists (a script that makes its process group before its
        model): this worker gets its rank (a spare waits here until it takes one); register()
        then registers the state and copies the peers' into it, where this worker joined a
        running job (the recovery that promoted it waits for that)."""
        if self._core is not None:
            raise RuntimeError("this session joined already")
        try:
            self._core = _core.Session.join([], defer_state=True)
        except _core.Cancelled as e:
            raise Released(str(e)) from None
        self._deferred = True
        self._step_in_flight = self._core.resume_step
        _install_failure_report(self)

    def _unregistered_cuda_devices(self) -> List[int]:
        """The GPUs the program computes on whose memory is not registered (a sharded model's,
        whose registered parameters are a host copy): the join health-checks them, as it does the
        devices of registered state, so a spare with a broken GPU never joins."""
        if self._device_flat is None or self._device_flat.device.type != "cuda":
            return []
        return [_device.device_index(self._device_flat, "the model's parameters")]

    def _check_registered_memory(self) -> None:
        """The registered state must still be what training uses: a tensor
        pointed elsewhere (`p.data = ...`, `optimizer.load_state_dict`) would
        be left out of every recovery, silently."""
        for get, address, what in self._watch:
            try:
                now = get().data_ptr()
            except (KeyError, AttributeError):
                now = None
            if now != address:
                raise RuntimeError(f"{what} no longer lives in the memory registered with nonstop (it was replaced "
                                   "after register(): `.data = ...`, `load_state_dict`, `share_memory`...); its "
                                   "recovery would restore stale values. Change tensors in place, or load before "
                                   "register().")

    def _reserve(self, t: Any, what: str) -> None:
        begin, size = _span(t)
        for b, e, other in self._reserved:
            if begin < e and b < begin + size:
                raise ValueError(f"{what} overlaps {other}, which is registered already: "
                                 "a tensor is registered once")
        self._reserved.append((begin, begin + size, what))

    def _register_shards(self, optimizer: Any, resume: bool) -> List[_Region]:
        """A ShardedOptimizer's state: its shard-sized tensors as this member's
        shard of sharded regions, the rest (AdamW's step count) whole. To
        resume, the shard-sized ones are views of whole buffers that the
        checkpoint fills (every shard is there) until the member knows its
        shard and adopts it (_after_resume), as nonstop-train does."""
        import torch

        inner, shard = optimizer.inner, optimizer.shard_param
        if not inner.state.get(shard):
            _materialize_state(inner, [shard])
        regions: List[_Region] = []
        for key in sorted(inner.state[shard]):
            value = inner.state[shard][key]
            if value is None:
                continue
            if not torch.is_tensor(value):
                raise ValueError(f"optimizer state {key!r} is a Python {type(value).__name__}, which nonstop cannot "
                                 "keep in registered memory")
            value = value.contiguous()
            inner.state[shard][key] = value
            self._keep.append(value)
            self._reserve(value, f"optimizer state {key!r}")
            self._watch.append((lambda key=key: inner.state[shard][key], value.data_ptr(), f"optimizer state {key!r}"))
            if value.shape == shard.shape:  # per element of the shard: this member's shard of it
                if value.dtype != torch.float32:
                    raise ValueError(f"optimizer state {key!r} is {value.dtype}: sharded state must be float32")
                if resume:
                    whole = self._resumed_wholes[key] = torch.zeros(optimizer.padded)
                    regions.append(_region(f"optimizer.{key}", whole, "SHARD_VIEW", [whole.numel()]))
                else:
                    regions.append(_region(f"optimizer.{key}", value, "SHARD", [value.numel()]))
            elif value.dtype == torch.float32:
                regions.append(_region(f"optimizer.{key}", value, "F32", [value.numel()]))
            else:
                regions.append(_region(f"optimizer.{key}", value, "U8", []))
        return regions

    def _register_optimizer(self, optimizer: Any, params: List[Any]) -> List[_Region]:
        import torch

        index = {id(p): i for i, p in enumerate(params)}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in index:
                    raise ValueError("the optimizer holds a parameter that is not the model's: register the model "
                                     "whose parameters the optimizer updates")
        with_state = [p for group in optimizer.param_groups for p in group["params"] if optimizer.state.get(p)]
        if not with_state:
            _materialize_state(optimizer, params)
        elif len(with_state) != sum(len(g["params"]) for g in optimizer.param_groups):
            raise ValueError("some of the optimizer's parameters have state and others not yet: register before "
                             "the optimizer's first step, or once every parameter has state")
        float_states: List[Tuple[Any, str, Any]] = []
        regions: List[_Region] = []
        for p in params:
            state = optimizer.state.get(p, {})
            for key in sorted(state):
                value = state[key]
                if value is None:
                    continue  # e.g. SGD's momentum_buffer without momentum
                if not torch.is_tensor(value):
                    raise ValueError(f"optimizer state {key!r} of parameter {index[id(p)]} is a Python "
                                     f"{type(value).__name__}, which nonstop cannot keep in registered memory; "
                                     "keep such values in extra={...}")
                _device.device_index(value, f"optimizer state {key!r} of parameter {index[id(p)]}")
                if value.dtype == torch.float32:
                    float_states.append((p, key, value))
                else:
                    value = value.contiguous()
                    state[key] = value
                    self._keep.append(value)
                    self._reserve(value, f"optimizer state {key!r} of parameter {index[id(p)]}")
                    self._watch.append((lambda p=p, key=key: optimizer.state[p][key], value.data_ptr(),
                                        f"optimizer state {key!r} of parameter {index[id(p)]}"))
                    regions.append(_region(f"optimizer.{index[id(p)]}.{key}", value, "U8", []))
        if float_states:
            total = sum(v.numel() for _, _, v in float_states)
            # On the parameters' device, whatever device each state was made on: torch keeps Adam's
            # scalar `step` on the CPU next to moments on the GPU, and one buffer keeps the region
            # names of a CPU member and a GPU member the same.
            flat = torch.empty(total, dtype=torch.float32, device=params[0].device)
            offset = 0
            for p, key, value in float_states:
                n = value.numel()
                view = flat[offset:offset + n].view_as(value)
                view.copy_(value)
                optimizer.state[p][key] = view
                self._watch.append((lambda p=p, key=key: optimizer.state[p][key], view.data_ptr(),
                                    f"optimizer state {key!r} of parameter {index[id(p)]}"))
                offset += n
            self._keep.append(flat)
            self._reserve(flat, "the optimizer's state")
            regions.insert(0, _region("optimizer", flat, "F32", [total]))
        return regions

    # ---- durable checkpoints ----

    def _checkpoint_layout(self, wholes: Mapping[str, Any]) -> List[_Region]:
        """The durable checkpoint's tensors, by nonstop-train's names where it
        has the same thing: each parameter by the model's name for it, each
        optimizer state per parameter as `<optimizer>.<key>.<name>`
        (`adamw.exp_avg.<name>`), `step` (steps completed), then the extras
        and the registered tensors. `wholes`: a ShardedOptimizer's state per
        key, whole (gathered, or to be loaded into)."""
        import torch

        from ._grads import flat_views

        regions: List[_Region] = []
        params = [p for _, p in self._named]
        # A sharded model on a GPU: its registered parameters are the host copy (_flat_padded),
        # which the checkpoint fills and the next gather copies up.
        held = params if self._device_flat is None else flat_views(self._flat_padded, params)
        for (name, p), h in zip(self._named, held):
            regions.append(_region(name, h, "F32", list(p.shape)))
        opt = self._optimizer
        if opt is not None:
            prefix = _optimizer_prefix(opt)
            for name, p, key, value in self._optimizer_states(wholes):
                float32 = value.dtype == torch.float32
                shape = list(p.shape) if value.numel() == p.numel() else list(value.shape)
                regions.append(_region(f"{prefix}.{key}.{name}", value, "F32" if float32 else "U8",
                                shape if float32 else []))
        for name, b in self._buffers:
            float32 = str(b.dtype) == "torch.float32"
            regions.append(_region(name, b, "F32" if float32 else "U8", list(b.shape) if float32 else []))
        regions.append(_region("step", self._ckpt_step, "I64", []))
        return regions + self.extra._regions() + self.per_rank._regions() + self._tensor_regions

    def _optimizer_states(self, wholes: Mapping[str, Any]) -> List[Tuple[str, Any, str, Any]]:
        """(parameter name, parameter, state key, the parameter's state tensor),
        in the parameters' order and each one's keys sorted."""
        from .sharded import ShardedOptimizer

        out = []
        opt = self._optimizer
        if isinstance(opt, ShardedOptimizer):
            state = opt.inner.state[opt.shard_param]
            offset = 0
            for name, p in self._named:
                for key in sorted(state):
                    if key in wholes:  # per element: the parameter's part of the whole buffer
                        out.append((name, p, key, wholes[key][offset:offset + p.numel()]))
                    elif state[key] is not None:  # shared by the shard (AdamW's step)
                        out.append((name, p, key, state[key]))
                offset += p.numel()
            return out
        for name, p in self._named:
            state = opt.state.get(p, {})
            out += [(name, p, key, state[key]) for key in sorted(state) if state[key] is not None]
        return out

    def _required_in_checkpoints(self) -> List[str]:
        """What a checkpoint of nonstop-train must hold to be loaded here: the
        parameters and the optimizer's per-element state (its moments)."""
        names = [name for name, _ in self._named]
        if self._optimizer is not None:
            prefix = _optimizer_prefix(self._optimizer)
            names += [f"{prefix}.{key}.{name}" for name, p, key, value in self._optimizer_states(self._resumed_wholes)
                      if value.numel() == p.numel() and value.numel() > 1]
        return names

    def _on_checkpoint_loaded(self, info: Dict[str, Any]) -> None:
        """Before joining, once resume_from loaded a checkpoint: one that
        nonstop-train wrote (loaded by name: parameters and moments) sets the
        optimizer's step counts from its `step`, as nonstop-train keeps one.
        Before joining, so that state a joiner then copies from its peers
        replaces these too."""
        if not info["by_name"]:
            return
        counts = [v for _, _, key, v in self._optimizer_states(self._resumed_wholes) if key == "step"] \
            if self._optimizer is not None else []
        for value in counts:
            value.fill_(info["step"] + 1)
        print(f"[nonstop] resumed from {info['path']}, written by {info['writer']}: loaded by name (parameters "
              f"and optimizer moments); kept this worker's own {_summary(info['kept'])}"
              f"{'; optimizer step counts set to ' + str(info['step'] + 1) if counts else ''}; not loaded: "
              f"{_summary(info['ignored'])}", file=sys.stderr, flush=True)

    def _after_resume(self) -> None:
        """After joining from a checkpoint with a ShardedOptimizer: the member
        keeps its shard of the whole state loaded (or copied from its peers
        into the views while joining) and frees the rest."""
        core = self._core
        for key, whole in self._resumed_wholes.items():
            value = self._optimizer.inner.state[self._optimizer.shard_param][key]
            core.adopt_shard(f"optimizer.{key}", value.data_ptr(), value.numel() * value.element_size())
        self._resumed_wholes.clear()

    def _gather_moments(self) -> Dict[str, Any]:
        """A ShardedOptimizer's per-element state, whole, on this rank of the
        first shard group: each member's shard gathered (a collective of the
        group), with the parameters gathered whole first."""
        import torch

        opt, core = self._optimizer, self._core
        # Every rank of the group must be here, at the same step: a rank that is not would pair these
        # gathers with its training's. A tagged record first: a mismatch raises before anything moves.
        records = torch.zeros(2 * opt.shard_group, dtype=torch.int64)
        records[2 * core.shard:2 * core.shard + 2] = torch.tensor([_SAVE_TAG, self._step_in_flight])
        core.gather_shards(records.data_ptr(), records.numel() * 8, 16)
        if records.tolist() != [_SAVE_TAG, self._step_in_flight] * opt.shard_group:
            raise RuntimeError("save_checkpoint with a ShardedOptimizer is a collective of the first shard group: "
                               "call it on every rank, at the same step (a peer was elsewhere: its training's "
                               "collectives and this one no longer line up)")
        ddp = opt._attached()
        if ddp._stale:
            ddp.gather()
        span = opt._shard_span()
        out = {}
        for key, value in sorted(opt.inner.state[opt.shard_param].items()):
            if torch.is_tensor(value) and value.shape == opt.shard_param.shape:
                whole = torch.zeros(opt.padded)
                whole[span].copy_(value)
                core.gather_shards(whole.data_ptr(), whole.numel() * 4, 4)
                out[key] = whole
        return out

    # ---- where this worker stands ----

    def _joined(self) -> Any:
        if self._core is None:
            raise RuntimeError("call session.register(model, optimizer) first: the rank and the world are known "
                               "once the state is registered and the session joined (a spare gets its rank then)")
        return self._core

    def begin_training(self) -> None:
        """Says the script's setup is done and its first step begins (call it
        before the first forward; nonstop.torch's DDP, DataParallel and the
        loader call it). A worker that joined a running job (a spare, a
        newcomer) copied its peers' state as it registered: whatever the setup
        did to the registered tensors since (the script's own snapshot load, a
        re-initialisation) is undone here, so it trains from exactly the
        peers' state. A no-op in the job's first generation, after a restart
        from a checkpoint, and after the first call."""
        if self._core is not None:
            self._core.begin_training()

    @property
    def rank(self) -> int:
        return self._joined().rank

    @property
    def world_size(self) -> int:
        return self._joined().world_size

    @property
    def generation(self) -> int:
        return self._joined().generation

    @property
    def resume_step(self) -> int:
        """The first step this generation runs."""
        return self._joined().resume_step

    @property
    def worker_id(self) -> int:
        return self._joined().worker_id

    @property
    def aborted(self) -> bool:
        """True once the generation was aborted: the step in flight is lost, so
        a loop may stop computing it and recover at once. Cheap."""
        return self._joined().aborted()

    @property
    def last_change(self) -> MembershipChange:
        return MembershipChange(**self._joined().last_change())

    @property
    def state_bytes(self) -> int:
        return self._joined().state_bytes

    @contextlib.contextmanager
    def busy(self, label: str, timeout: float = 1800.0) -> Iterator[None]:
        """Marks a rank-local section its peers may wait for (an evaluation, a
        snapshot save on rank 0)::

            with session.busy("evaluation"):
                evaluate(model)

        Until it ends, or `timeout` seconds after it began, the controller does
        not count the others' wait against this rank, and the progress line,
        /status and the dashboard name `label`. Without a section a live rank
        is declared hung only past the job's busy timeout (--busy-timeout-ms,
        60 s). Sections do not nest."""
        if not isinstance(label, str):
            raise TypeError(f"Session.busy: the label is a str, got {type(label).__name__}")
        if not timeout > 0:
            raise ValueError(f"Session.busy: the timeout is in seconds and positive, got {timeout!r}")
        core = self._joined()
        core.begin_busy(label, float(timeout))
        try:
            yield
        finally:
            core.end_busy()

    def on_membership_change(self, callback: Callable[[MembershipChange], None]) -> None:
        """Calls `callback(change)` after each recovery or resize that recover() adopts."""
        self._callbacks.append(callback)

    # ---- collectives ----

    def allreduce(self, tensor: Any) -> Any:
        """Sums `tensor` (contiguous, float32, on the CPU or a GPU) across the
        workers, in place, and returns it. Bitwise the same on every rank.
        Raises Aborted. A GPU tensor is summed in host memory: torch's current
        stream is synchronized, the tensor copied down and the sum copied back."""
        _check_tensor(tensor, "the tensor")
        core = self._joined()
        self._maybe_inject()
        _device.on_host(tensor, "allreduce", lambda host: core.allreduce(host.data_ptr(), host.numel()))
        return tensor

    def _start_allreduce(self, tensor: Any) -> None:
        # For DataParallel: `tensor` was checked when its buckets were made. A GPU bucket is
        # reduced on its host twin, copied back up once _wait_all has waited for it.
        twin = _device.Twin(tensor, "bucket")
        self._core.start_allreduce(twin.host, twin.host.data_ptr(), tensor.numel())
        if twin.host is not tensor:
            self._twins.append(twin)

    def _wait_all(self) -> None:
        twins, self._twins = self._twins, []
        self._core.wait_all()
        for twin in twins:
            twin.up()

    def _maybe_inject(self) -> None:
        if self._core.injected_exception_at(self._step_in_flight):
            raise InjectedFault(f"injected exception at step {self._step_in_flight} (nonstop run --inject)")

    # ---- steps ----

    def report_step(self, step: int, loss: float = 0.0, *, step_seconds: float = 0.0, tokens: float = 0.0,
                    total_steps: int = 0) -> None:
        """Tells the controller that `step` completed: the registered state
        holds it now. Call it after the optimizer's update. `tokens`: how many
        the step trained on (for tokens/s); `total_steps`: for the progress line.
        `step_seconds`: the step's time; left out, the time since the report of
        the step before in this generation (the job's pace, which a fault's cost
        and the hang timeouts are measured against)."""
        core = self._joined()
        self._check_registered_memory()  # before the controller counts the step as held
        now, generation = time.monotonic(), core.generation
        last = self._last_report
        if step_seconds <= 0 and last is not None and last[:2] == (int(step) - 1, generation):
            step_seconds = now - last[2]
        self._last_report = (int(step), generation, now)
        rate = tokens / step_seconds if step_seconds > 0 and tokens else 0.0
        core.report_step(int(step), float(loss), float(step_seconds), rate, int(total_steps))
        self._step_in_flight = int(step) + 1

    def recover(self) -> int:
        """After Aborted: takes part in the recovery and returns the step to run
        next; the registered state holds the step before it. Raises Released
        when the world shrank without this worker, JobEnded when the job ended."""
        held, self._held_recovery = self._held_recovery, None
        self._twins = []  # buckets of the step cut short: never copied back
        core = self._joined()
        if held is not None:  # DataParallel recovered in place already, then could not keep its sum
            generation, outcome = held
            if isinstance(outcome, BaseException):
                raise outcome
            if generation == core.generation and not core.aborted():
                return outcome
            # another fault since: that recovery is over, take part in this one
        for undo in self._before_recover:
            undo()
        try:
            step = core.recover()
        except _core.Cancelled as e:
            code = core.shutdown_exit_code
            if code:
                raise JobEnded(str(e), code) from None
            raise Released(str(e)) from None
        self._step_in_flight = step
        change = self.last_change
        for callback in self._callbacks:
            callback(change)
        return step

    def _recover_in_place(self) -> Optional[int]:
        # For DataParallel's salvage, inside a reducing call: recovers now. None: recover() raised,
        # and the script's recover() (after the Aborted the caller raises) raises it again; a
        # caller that raises Aborted for another reason holds the step (_hold_recovery) for it.
        try:
            return self.recover()
        except (Exception, Released, JobEnded) as e:  # re-raised by the script's recover()
            self._held_recovery = (None, e)
            return None

    def _hold_recovery(self, step: int) -> None:
        self._held_recovery = (self._core.generation, step)

    def finish(self, last_step: int, checksum: Optional[str] = None) -> None:
        """Tells the controller that training ended after `last_step` and waits
        until the job ends. Raises Aborted if a member failed first: recover()
        and carry on. `checksum` defaults to checksum()."""
        core = self._joined()
        if self._shard_group and checksum is not None:
            raise ValueError("finish(checksum=...) with a ShardedOptimizer: each rank updated only its shard, so a "
                             "checksum taken before finish() differs by rank; finish() gathers the parameters "
                             "and takes it itself")
        for gather in self._before_finish:  # sharded: every rank holds the whole parameters again
            gather()
        core.finish(int(last_step), checksum if checksum is not None else self.checksum())

    def save_checkpoint(self, directory: str, keep: int = 3) -> str:
        """Saves the registered state, as of the last reported step, as a
        durable checkpoint in `directory` (docs/formats.md: safetensors and a
        manifest, the format and tensor names nonstop-train writes): the
        state is copied now and written in the background; a checkpoint due
        while the previous write is in flight is skipped. The last `keep` are
        kept. Call it at a step boundary on every rank: rank 0 writes. With a
        ShardedOptimizer the first shard group gathers the optimizer state
        whole first (a collective of its ranks; a rank that is not there makes
        it raise). Returns what it did."""
        core = self._joined()
        wholes: Dict[str, Any] = {}
        if self._shard_group:
            if core.rank >= self._shard_group:
                return f"rank {core.rank}: the first shard group gathers the state and rank 0 writes it"
            wholes = self._gather_moments()
        if core.rank != 0:
            return f"rank {core.rank}: rank 0 writes"
        self._ckpt_step[0] = self._step_in_flight
        return core.save_checkpoint(os.fspath(directory), int(keep), self._step_in_flight - 1, self.checksum(),
                                    self._checkpoint_layout(wholes))

    def wait_checkpoint(self) -> None:
        """Waits for the checkpoint write in flight; raises if it failed."""
        self._joined().wait_checkpoint()

    def checksum(self) -> str:
        """CRC-32C of the registered parameters, as 8 hex digits."""
        if self._params is None:
            return self._joined().state_digest()
        return _device.on_host(self._params, "checksum", lambda host: _core.crc32c(*_span(host)), write_back=False)

    def run(self, train_step: Callable[[int], Optional[float]], steps: int) -> None:
        """The training loop, for the common case: calls `train_step(step)` for
        each step from resume_step to `steps`-1 (it does forward, backward and
        the optimizer's update, and returns the loss), reports each step,
        recovers from faults and resizes, and finishes. Returns when the job
        ended; this worker's release ends the process (Released)."""
        step = self.resume_step
        while True:
            try:
                while step < steps:
                    t0 = time.monotonic()
                    loss = train_step(step)
                    self.report_step(step, float(loss or 0.0), step_seconds=time.monotonic() - t0,
                                     total_steps=steps)
                    step += 1
                self.finish(steps - 1)
                return
            except Aborted:
                step = self.recover()


def join() -> Session:
    """The session of this worker, from the environment `nonstop run` sets.
    Register the state next (:meth:`Session.register`): that joins the job."""
    return Session()


def _unique_parameters(model: Any) -> List[Any]:
    seen = set()
    params = []
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            params.append(p)
    return params


def _flatten_parameters(params: List[Any], padded: int = 0) -> Any:
    """One flat buffer (of `padded` floats, zeros past the parameters, when
    larger) of which every parameter becomes a view."""
    import torch

    total = sum(p.numel() for p in params)
    flat = torch.zeros(max(total, padded), dtype=torch.float32, device=_one_device(params, "the model's parameters"))
    offset = 0
    with torch.no_grad():
        for p in params:
            n = p.numel()
            view = flat[offset:offset + n].view_as(p)
            view.copy_(p.data)
            p.data = view
            offset += n
    return flat


def _summary(names: List[str]) -> str:
    """Tensor names for a log line: the per-parameter ones of a kind (three or
    more sharing their first two parts) as one `adamw.step.* (38)`."""
    groups: Dict[str, List[str]] = {}
    for name in names:
        groups.setdefault(".".join(name.split(".")[:2]), []).append(name)
    parts = [f"{key}.* ({len(group)})" if len(group) >= 3 else ", ".join(group) for key, group in groups.items()]
    return ", ".join(parts) or "nothing"


_SAVE_TAG = 0x4E53434B  # "NSCK": the record a sharded save_checkpoint's ranks exchange first


def _optimizer_prefix(optimizer: Any) -> str:
    """The name a checkpoint gives an optimizer's state: "adamw" for torch's Adam
    and AdamW (nonstop-train's AdamW keeps the same moments), else the class's
    name in lower case."""
    inner = getattr(optimizer, "inner", optimizer)  # a ShardedOptimizer's
    name = type(inner).__name__.lower()
    return "adamw" if name in ("adam", "adamw") else name


def _materialize_state(optimizer: Any, params: List[Any]) -> None:
    import torch

    name = type(optimizer).__name__
    known = tuple(getattr(torch.optim, n) for n in _ZERO_INITIALISED_OPTIMIZERS)
    if type(optimizer) not in known:  # a subclass may initialise its state otherwise
        raise ValueError(f"{name}'s state is created at its first step, and nonstop does not know its initial "
                         f"values; register after one optimizer step, or use one of "
                         f"torch.optim.{', torch.optim.'.join(_ZERO_INITIALISED_OPTIMIZERS)}")
    if name == "SGD" and any(g.get("momentum", 0) and g.get("dampening", 0) for g in optimizer.param_groups):
        raise ValueError("SGD with momentum and dampening starts its momentum from the first gradient, not from "
                         "zeros: register after one optimizer step")
    saved = [p.detach().clone() for p in params]
    grads = [p.grad for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    # The class's step, not the instance's: an LR scheduler wraps the latter to count steps.
    type(optimizer).step(optimizer)
    with torch.no_grad():
        for p, value, grad in zip(params, saved, grads):
            p.copy_(value)
            p.grad = grad
        for state in optimizer.state.values():
            for value in state.values():
                if torch.is_tensor(value):
                    value.zero_()


_reporting: List[Session] = []  # the session whose controller hears of an uncaught exception


def _write_error_file(message: str, trace: str) -> None:
    """The failure the controller was told of, also in torchelastic's error file
    (TORCHELASTIC_ERROR_FILE, which `nonstop run` and the agents set), in the
    format of torch.distributed.elastic's @record, for tools that read it."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    import json

    record = {"message": {"message": message,
                          "extraInfo": {"py_callstack": trace, "timestamp": str(int(time.time()))}}}
    # Whole or not at all: a reader (or this process's end) never meets half a file.
    partial = f"{path}.{os.getpid()}.partial"
    with open(partial, "w") as f:
        json.dump(record, f)
    os.replace(partial, path)


def _install_failure_report(session: Session) -> None:
    """An uncaught exception ends the process; tell the controller at once, so
    it recovers without waiting for the exit to be noticed."""
    first = not _reporting
    _reporting[:] = [session]
    if not first:
        return
    previous = sys.excepthook

    def report(kind, value, tb):  # type: ignore[no-untyped-def]
        try:
            s = _reporting[0] if _reporting else None
            if s is not None and s._core is not None and not issubclass(kind, KeyboardInterrupt):
                trace = "".join(traceback.format_exception(kind, value, tb))
                # The file first: once the controller is told, it may end the job and this process.
                _write_error_file(f"{kind.__name__}: {value}", trace)
                s._core.report_failure(f"{kind.__name__}: {value}", s._step_in_flight, 1, trace)
        except Exception:  # the report is best effort; the traceback below matters more
            pass
        finally:
            previous(kind, value, tb)

    sys.excepthook = report
