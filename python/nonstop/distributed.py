"""nonstop.distributed: torch.distributed over a nonstop session.

``init_process_group(model, optimizer, loader)`` registers what must survive a
fault, joins the job and makes a process group backed by the session the
default one, so ``dist.all_reduce``, ``broadcast``, ``all_gather``,
``barrier`` and ``torch.nn.parallel.DistributedDataParallel`` run over
nonstop's own collectives. The group is a Python subclass of torch's
``ProcessGroup`` (torch's own extension point for backends written in
Python): nothing here links against PyTorch's C++ library.

A fault surfaces as :class:`nonstop.Aborted` at the step's reducing call
(``loss.backward()``); a function decorated with :func:`step` recovers and runs
again on the step's batch as re-dealt over the new world. After each recovery
the default group is formed again with the live rank and world, and the
torchrun variables (RANK, WORLD_SIZE, LOCAL_RANK, ...) are set anew.
docs/python.md ("torch.distributed over nonstop") says what each part does
and why.
"""

from __future__ import annotations

import collections
import functools
import os
import sys
import weakref
from typing import Any, Callable, Deque, List, Optional

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroup as _TorchProcessGroup
from torch._C._distributed_c10d import Work as _TorchWork

from . import Aborted, Session, _check_tensor, _collectives, _device, _p2p, join
from ._store import JobStore

__all__ = ["DistributedDataParallel", "ProcessGroup", "destroy_process_group", "init_process_group", "step", "store"]

BACKEND = "nonstop"

# The session the default group runs on (torch hands a backend's creator only a
# store, a rank and a size), and what init_process_group bound to it.
_session: Optional[Session] = None
_loader: Any = None
_model: Any = None
# A worker that joined a running job (a spare, a joiner) answers its collectives
# locally until its first step (ProcessGroup); set once, when it joins.
_before_first_step = False
# nonstop.torch.DistributedDataParallel sums its buckets through its hook: a
# collective inside a backward pass is then the model's own (SyncBatchNorm's),
# not one of stock DDP's buckets.
_hooked = False
# torch keeps a Python subclass's C++ half alive but not its Python half: a
# Work or a group whose Python object was collected answers from C++'s base
# class (a Work's wait() then never returns). These keep them.
_groups: List["ProcessGroup"] = []
# True while _form_default_group makes the default group; every other group torch makes is a
# subgroup (new_group), even one of every rank (it may have a timeout of its own).
_forming_default = False
_works: Deque["_Work"] = collections.deque(maxlen=1024)
_store: Optional[JobStore] = None  # the job's store, once joined (store())


class _Work(_TorchWork):
    """A collective's handle. A blocking collective's is complete when made and
    holds its tensors weakly (kept works must not keep a 250 MB broadcast
    bucket alive); a gradient bucket's is completed by the session's
    communication thread."""

    def __init__(self, result: List[Any], done: bool = True) -> None:
        super().__init__()
        self._future: Optional[torch.futures.Future] = None
        self._weak: List[Any] = []
        if done:
            self._weak = [weakref.ref(t) for t in _flat(result)]
            self._shape = [len(r) for r in result] if result and isinstance(result[0], list) else None
        else:
            self._future = torch.futures.Future()
            self._result = result
        _works.append(self)

    def _complete(self, ok: bool, message: str) -> None:
        # On the communication thread, with the GIL. The future always gets its
        # result, so that DDP's end of backward runs whole; a failure is
        # raised as Aborted at the end of backward (_BucketStep).
        result, self._result = self._result, None
        self._future.set_result(result)  # type: ignore[union-attr]

    def wait(self, timeout: Any = None) -> bool:
        if self._future is not None:
            # Started inside a backward pass (a bucket, SyncBatchNorm's sum): a failure is raised
            # at the backward's end (_BucketStep), not here, where it would leave DDP's reducer
            # half through the pass and unable to run the step again.
            self._future.wait()
        return True

    def get_future(self) -> torch.futures.Future:
        if self._future is None:  # a blocking collective's, asked for after it completed
            tensors = [w() for w in self._weak]
            if any(t is None for t in tensors):
                raise RuntimeError("the collective's tensors were freed before its future was asked for")
            result: Any = tensors
            if self._shape is not None:
                result, i = [], 0
                for n in self._shape:
                    result.append(tensors[i:i + n])
                    i += n
            self._future = torch.futures.Future()
            self._future.set_result(result)
        return self._future


def _flat(result: List[Any]) -> List[Any]:
    return [t for r in result for t in (r if isinstance(r, list) else [r])]


class _BucketStep:
    """The buckets of one backward pass: the first one queues the end of
    backward, which waits for them all after DDP's own end (it raises Aborted
    there, with DDP's state whole, so the next forward can run)."""

    active = False  # a backward's end is queued; cleared there, and when a step is run again
    # Buckets summed but not copied back to their GPU tensor (_device.completion): DDP has them
    # unreduced, so this worker leaves the job at the end of the backward (_end).
    copy_failures: List[str] = []

    @classmethod
    def enter(cls, session: Session) -> bool:
        """True when called inside a backward pass (the buckets' mode)."""
        if cls.active:
            return True
        try:
            torch.autograd.Variable._execution_engine.queue_callback(lambda: cls._after_ddp(session))
        except RuntimeError:  # "Final callbacks can only be installed during backward pass"
            return False
        cls.active = True
        session._maybe_inject()  # nonstop run --inject exception:...: before anything is started
        return True

    @classmethod
    def reset(cls, session: Session) -> None:
        """After a step raised: a backward that raised never ran its queued end
        (torch drops final callbacks then), so its buckets are waited for here."""
        if not cls.active:
            return
        cls.active = False
        try:
            session._wait_all()
        except Aborted:
            pass  # the step is lost either way; the caller recovers
        cls._leave_if_a_copy_failed(session)

    @classmethod
    def _after_ddp(cls, session: Session) -> None:
        # Queued again, so that it runs after the callbacks queued since (DDP's finalize).
        torch.autograd.Variable._execution_engine.queue_callback(lambda: cls._end(session))

    @classmethod
    def _end(cls, session: Session) -> None:
        cls.active = False
        _HookState.local_used_map = False
        session._wait_all()  # raises Aborted: the step is lost
        cls._leave_if_a_copy_failed(session)

    @classmethod
    def _leave_if_a_copy_failed(cls, session: Session) -> None:
        if not cls.copy_failures:
            return
        message = (f"{cls.copy_failures[0]}; DDP holds that bucket unreduced, so this worker leaves the job "
                   "(the controller replaces it)")
        cls.copy_failures.clear()
        session._core.report_failure(message, session._step_in_flight, 1)
        raise RuntimeError(message)


def _start_bucket(session: Session, tensor: Any) -> _Work:
    """Starts the sum of a gradient bucket on the communication thread."""
    work = _Work([tensor], done=False)
    twin = _device.Twin(tensor, "bucket")  # a GPU bucket: summed on its host twin, copied back before work completes
    done = (work._complete if twin.host is tensor else
            _device.completion(twin, work._complete, _BucketStep.copy_failures.append))
    session._core.start_allreduce(twin.host, twin.host.data_ptr(), tensor.numel(), done)
    return work


# Stock DDP's gradient buckets come through ProcessGroup.allreduce; the drop-in's
# through its communication hook. Stock DDP survives no change of membership.
_STOCK_DDP = ("torch.nn.parallel.DistributedDataParallel cannot go on after a change of membership: it divides "
              "the gradients by the world its group was made with, and it re-buckets after its first "
              "iteration, so a newcomer's buckets would pair with the survivors' other ones. Use "
              "nonstop.torch.DistributedDataParallel (the same constructor; docs/python.md)")


class ProcessGroup(_TorchProcessGroup):
    """The default group's backend: every collective goes to the session's
    live generation, whatever rank and size this object was made with (torch
    fixes those at construction; init_process_group makes a new group after a
    recovery). A worker that joined a running job (a spare, a joiner) answers
    the collectives it makes before its first step locally: its peers are in
    the middle of training and make no such call, and its state, copied from
    them, is already what a broadcast from rank 0 would give."""

    def __init__(self, session: Session, rank: int, size: int) -> None:
        super().__init__(rank, size)
        self._session = session
        _groups.append(self)

    def getBackendName(self) -> str:
        return BACKEND

    @property
    def _comm(self) -> _collectives.Comm:
        return _collectives.Comm(self._session)

    @property
    def _local(self) -> bool:
        return _before_first_step

    def allreduce(self, tensors: List[Any], opts: Any = None) -> _Work:
        tensor = _one(tensors, "all_reduce")
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        name = _collectives.op_name(op)
        average = name == "avg"
        session = self._session
        if name not in ("sum", "avg") or tensor.dtype not in (torch.float32, torch.int32, torch.int64, torch.float16,
                                                              torch.bfloat16):
            return self._reduce(tensor, op, "all_reduce")
        if tensor.dtype in (torch.int32, torch.int64) and not average:
            return self._allreduce_as_float32(tensor)
        if tensor.dtype in (torch.float16, torch.bfloat16):  # fp16_compress_hook's buckets
            return self._allreduce_as_float32(tensor, average)
        _check_tensor(tensor, "the tensor of all_reduce")
        if _BucketStep.enter(session):  # a gradient bucket of stock DDP, or SyncBatchNorm's sum
            if session.generation != 1 and not _hooked:
                raise RuntimeError(_STOCK_DDP)
            _first_step()
            work = _start_bucket(session, tensor)  # in order with the buckets started before it
            if _HookState.synchronous:
                # A script's hook: complete now, so that what it chains runs here, in order. A failure
                # is raised at the end of the backward (_BucketStep), with DDP's state whole.
                work.get_future().wait()
            return work
        if self._local:
            raise RuntimeError("all_reduce before this worker's first step: it joined a running job, whose members "
                               "make no such call now; reduce inside the training steps")
        _device.on_host(tensor, "allreduce", lambda host: session._core.allreduce(host.data_ptr(), host.numel()))
        if average:
            tensor.div_(session.world_size)
        return _Work(tensors)

    def _reduce(self, tensor: Any, op: Any, what: str) -> _Work:
        """Any reduction outside a backward pass, on the ring with the tensor's own type."""
        if self._local:
            raise RuntimeError(f"{what} before this worker's first step: it joined a running job, whose members "
                               "make no such call now; reduce inside the training steps")
        _collectives.reduce_in_place(self._comm, tensor, op, what)
        return _Work([tensor])

    def _allreduce_as_float32(self, tensor: Any, average: bool = False) -> _Work:
        """Inside a backward pass, the SUM of an int32 or int64 tensor (DDP's map of the parameters
        used, with find_unused_parameters), summed as float32, which is exact while every sum stays
        below 2**24; or of a float16 or bfloat16 one (fp16_compress_hook's buckets), summed as
        float32 and rounded once; started in order with the buckets. Outside one, the ring's
        reduction of the tensor's own type."""
        session = self._session
        if not _BucketStep.enter(session):
            return self._reduce(tensor, dist.ReduceOp.AVG if average else dist.ReduceOp.SUM, "all_reduce")
        integer = not tensor.is_floating_point()
        _check_bytes(tensor, "the tensor of all_reduce")
        if tensor.device.type != "cpu":
            raise ValueError(f"nonstop sums {tensor.dtype} tensors on the CPU, got one on {tensor.device}: "
                             "move it with .cpu()")
        bound = int(tensor.abs().max()) * session.world_size if integer and tensor.numel() else 0
        if bound >= 1 << 24:
            raise ValueError(f"an integer all_reduce whose sums may reach {bound}: nonstop sums integers as "
                             "float32, exact below 2**24; sum a float tensor instead")
        summed = tensor.to(torch.float32)

        def result() -> Any:
            return summed.round() if integer else summed.div_(session.world_size) if average else summed

        if integer and _HookState.local_used_map:
            _HookState.local_used_map = False  # a joiner's first static-graph iteration (DistributedDataParallel)
            return _Work([tensor])
        work = _Work([tensor], done=False)

        def done(ok: bool, message: str) -> None:
            if ok:
                tensor.copy_(result())
            work._complete(ok, message)

        session._core.start_allreduce(summed, summed.data_ptr(), summed.numel(), done)
        return work

    def broadcast(self, tensors: List[Any], opts: Any = None) -> _Work:
        tensor = _one(tensors, "broadcast")
        _check_bytes(tensor, "the tensor of broadcast")
        if not self._local:
            root = int(opts.rootRank) if opts is not None else 0
            _device.on_host(tensor, "broadcast", lambda host: self._comm.broadcast(host.data_ptr(), _nbytes(host), root))
        return _Work(tensors)

    def allgather(self, output_lists: List[List[Any]], inputs: List[Any], opts: Any = None) -> _Work:
        tensor = _one(inputs, "all_gather")
        if len(output_lists) != 1:
            raise ValueError(f"all_gather takes one output list per input tensor, got {len(output_lists)}")
        _check_bytes(tensor, "the tensor of all_gather")
        if self._local:
            for out in output_lists[0]:
                out.copy_(tensor)
            return _Work(output_lists)
        _collectives.allgather(self._comm, output_lists[0], tensor)
        return _Work(output_lists)

    def _allgather_base(self, output: Any, tensor: Any, opts: Any = None) -> _Work:
        self._refuse_local("all_gather_into_tensor")
        _collectives.allgather_into(self._comm, output, tensor, "all_gather_into_tensor")
        return _Work([output])

    def allgather_coalesced(self, output_lists: List[List[Any]], inputs: List[Any], opts: Any = None) -> _Work:
        self._refuse_local("all_gather_coalesced")
        if len(output_lists) != self._comm.world_size:
            raise ValueError(f"all_gather_coalesced takes one output list a rank, got {len(output_lists)}")
        for i, tensor in enumerate(inputs):
            _collectives.allgather(self._comm, [out[i] for out in output_lists], tensor, "all_gather_coalesced")
        return _Work(output_lists)

    def allreduce_coalesced(self, tensors: List[Any], opts: Any = None) -> _Work:
        self._refuse_local("all_reduce_coalesced")
        for tensor in tensors:
            _collectives.reduce_in_place(self._comm, tensor, opts.reduceOp, "all_reduce_coalesced")
        return _Work(tensors)

    def reduce(self, tensors: List[Any], opts: Any = None) -> _Work:
        self._refuse_local("reduce")
        _collectives.reduce(self._comm, tensors, opts)
        return _Work(tensors)

    def gather(self, output_lists: List[List[Any]], inputs: List[Any], opts: Any = None) -> _Work:
        self._refuse_local("gather")
        _collectives.gather(self._comm, output_lists, inputs, opts)
        return _Work(inputs)

    def scatter(self, outputs: List[Any], input_lists: List[List[Any]], opts: Any = None) -> _Work:
        self._refuse_local("scatter")
        _collectives.scatter(self._comm, outputs, input_lists, opts)
        return _Work(outputs)

    def reduce_scatter(self, outputs: List[Any], input_lists: List[List[Any]], opts: Any = None) -> _Work:
        self._refuse_local("reduce_scatter")
        if len(input_lists) != 1:
            raise ValueError(f"reduce_scatter takes one input list per output tensor, got {len(input_lists)}")
        _collectives.reduce_scatter(self._comm, _one(outputs, "reduce_scatter"), input_lists[0],
                                    opts.reduceOp, "reduce_scatter")
        return _Work(outputs)

    def _reduce_scatter_base(self, output: Any, tensor: Any, opts: Any = None) -> _Work:
        self._refuse_local("reduce_scatter_tensor")
        world = self._comm.world_size
        if tensor.numel() != world * output.numel():
            raise ValueError(f"reduce_scatter_tensor: the input has {tensor.numel()} elements for an output of "
                             f"{output.numel()} at a world of {world}")
        _collectives.reduce_scatter(self._comm, output, list(tensor.reshape(-1).chunk(world)) if output.numel()
                                    else [tensor] * world, opts.reduceOp, "reduce_scatter_tensor")
        return _Work([output])

    def alltoall(self, outputs: List[Any], inputs: List[Any], opts: Any = None) -> _Work:
        self._refuse_local("all_to_all")
        _collectives.alltoall(self._comm, outputs, inputs)
        return _Work(outputs)

    def alltoall_base(self, output: Any, tensor: Any, output_splits: List[int], input_splits: List[int],
                      opts: Any = None) -> _Work:
        self._refuse_local("all_to_all_single")
        _collectives.alltoall_base(self._comm, output, tensor, output_splits, input_splits)
        return _Work([output])

    def barrier(self, opts: Any = None) -> _Work:
        if not self._local:
            self._comm.barrier()
        return _Work([])

    def send(self, tensors: List[Any], dst: int, tag: int = 0) -> _p2p.Work:
        self._refuse_local("send")
        return _p2p.start(self._session, self._comm.world_rank(dst), _one(tensors, "send"), sending=True, tag=tag)

    def recv(self, tensors: List[Any], src: int, tag: int = 0) -> _p2p.Work:
        self._refuse_local("recv")
        return _p2p.start(self._session, self._comm.world_rank(src), _one(tensors, "recv"), sending=False, tag=tag)

    def monitored_barrier(self, timeout: Any = None, wait_all_ranks: bool = False) -> None:
        self._refuse_local("monitored_barrier")
        _p2p.monitored_barrier(self._session, self._comm, dist.default_pg_timeout if timeout is None else timeout,
                               wait_all_ranks)

    def recv_anysource(self, tensors: List[Any], tag: int = 0) -> _p2p.Work:
        self._refuse_local("recv")
        if self._comm.group:
            raise RuntimeError("a subgroup's recv takes its source: pass src= (a receive from any source is the "
                               "default group's)")
        return _p2p.start_any(self._session, _one(tensors, "recv"), tag)

    def _refuse_local(self, what: str) -> None:
        if self._local:
            raise RuntimeError(f"{what} before this worker's first step: it joined a running job, whose members "
                               "make no such call now; call it inside the training steps")


class _SubGroup(ProcessGroup):
    """A group of some of the world's ranks (new_group, new_subgroups): its collectives run on a
    communicator over them alone (Session::NewGroup), none of them a step's gradient sum. After a
    change of membership it works on while each of its ranks is held by the same worker; otherwise
    each call raises, naming the rank that changed."""

    def __init__(self, session: Session, ranks: List[int], rank: int, size: int, timeout: Any = None) -> None:
        super().__init__(session, rank, size)
        self._ranks = list(ranks)
        # new_group(timeout=...) bounds each of its calls; torch's default leaves the session's bound.
        default = getattr(dist, "default_pg_timeout", None)
        ms = int(timeout.total_seconds() * 1000) if timeout is not None and timeout != default else 0
        self._id = session._core.new_group(self._ranks, ms)

    @property
    def _comm(self) -> _collectives.Comm:
        return _collectives.Comm(self._session, self._id, self._ranks)

    def allreduce(self, tensors: List[Any], opts: Any = None) -> _Work:
        return self._reduce(_one(tensors, "all_reduce"), opts.reduceOp if opts is not None else dist.ReduceOp.SUM,
                            "all_reduce")


_torch_monitored_barrier = dist.monitored_barrier


def _monitored_barrier(group: Any = None, timeout: Any = None, wait_all_ranks: bool = False) -> None:
    """torch.distributed.monitored_barrier, which torch runs on Gloo groups alone, on nonstop's too."""
    pg = dist.distributed_c10d._get_default_group() if group is None else group
    if not isinstance(pg, ProcessGroup):
        return _torch_monitored_barrier(group, timeout, wait_all_ranks)
    if dist.distributed_c10d._rank_not_in_group(pg):
        return None
    return pg.monitored_barrier(timeout, wait_all_ranks)


dist.monitored_barrier = dist.distributed_c10d.monitored_barrier = _monitored_barrier


def _first_step() -> None:
    # The first step begins: a worker that joined a running job trains from the state it copied
    # from its peers, whatever the script's setup did to it since (Session.begin_training).
    global _before_first_step
    if _session is not None and _session._deferred:
        raise RuntimeError("the first step of a job whose state was never registered: after "
                           "init_process_group(backend=...), wrap the model in nonstop.torch.DistributedDataParallel "
                           "(it registers the model, its optimizer and the loader), or call "
                           "nonstop.torch.init_process_group(model, optimizer, loader) before training")
    _before_first_step = False
    if _session is not None:
        _session.begin_training()


_one = _collectives.one
_check_bytes = _collectives.check_bytes
_nbytes = _collectives.nbytes


def store() -> JobStore:
    """The job's store (docs/store.md): one key-value store shared by every
    worker of the job and kept through recoveries and controller takeovers; what
    the default group was given as its store. Available once the worker joined
    (init_process_group)."""
    if _store is None:
        raise RuntimeError("the job's store is nonstop's once this worker joined: call "
                           "nonstop.torch.init_process_group(...) first")
    return _store


def _create(store: Any, rank: int, size: int, timeout: Any) -> ProcessGroup:
    if _session is None:
        raise RuntimeError("the 'nonstop' backend is made by nonstop.torch.init_process_group(model, optimizer, "
                           "loader), which joins the job first: call that instead of dist.init_process_group")
    if _forming_default:
        if size != _session.world_size or rank != _session.rank:
            raise ValueError(f"nonstop's default group is the whole world ({_session.world_size} ranks), "
                             f"asked for rank {rank} of {size}")
        return ProcessGroup(_session, rank, size)
    return _SubGroup(_session, _ranks_of_the_group_being_made(size), rank, size, timeout)


def _ranks_of_the_group_being_made(size: int) -> List[int]:
    """torch hands a backend's creator the group's rank and size, not its ranks: they are the
    `global_ranks_in_group` of torch's _new_process_group_helper, which calls it."""
    frame = sys._getframe(1)
    while frame is not None:
        ranks = frame.f_locals.get("global_ranks_in_group")
        if ranks is not None and len(ranks) == size:
            return [int(r) for r in ranks]
        frame = frame.f_back
    raise RuntimeError("a nonstop group of fewer ranks than the world is made by torch.distributed.new_group "
                       f"(its ranks were not found among the callers); here {size} of {_session.world_size}")


def _job_store(session: Session) -> JobStore:
    # One per process, kept alive here: torch holds only its C++ half.
    global _store
    if _store is None:
        _store = JobStore(session._core.store, session.world_size)
    _store.set_world(session.world_size)
    return _store


def _form_default_group(session: Session) -> None:
    if not hasattr(dist.Backend, BACKEND.upper()):
        dist.Backend.register_backend(BACKEND, _create)
    # Torch's registry of groups is emptied with the default group; the script's subgroups are
    # kept in it (each says itself whether it still holds after the change).
    c10d = dist.distributed_c10d
    # torch 1.13 keeps its registry in module globals (_pg_map, ...), torch >= 2.1 in _world.
    registry, prefix = (c10d._world, "") if hasattr(c10d, "_world") else (c10d, "_")
    tables = [getattr(registry, prefix + name) for name in ("pg_map", "pg_names", "pg_group_ranks")
              if hasattr(registry, prefix + name)]
    kept = [(table, pg, table[pg]) for table in tables for pg in list(table) if isinstance(pg, _SubGroup)]
    named = getattr(registry, prefix + "group_count", 0)  # the next group's name: not one a kept group has
    global _forming_default
    if dist.is_initialized():
        dist.destroy_process_group()
    _forming_default = True
    try:
        dist.init_process_group(BACKEND, store=_job_store(session), rank=session.rank,
                                world_size=session.world_size)
    finally:
        _forming_default = False
    for table, pg, entry in kept:
        table[pg] = entry
    if hasattr(registry, prefix + "group_count"):
        setattr(registry, prefix + "group_count", max(getattr(registry, prefix + "group_count"), named))
    if _p2p.wait_all not in session._before_recover:
        session._before_recover.append(_p2p.wait_all)
    for name, value in session._core.torchrun_environment():
        os.environ[name] = value


def init_process_group(model: Any = None, optimizer: Any = None, loader: Any = None, *,
                       extra: Optional[dict] = None, session: Optional[Session] = None,
                       resume_from: Optional[str] = None, world_invariant: Optional[bool] = None,
                       micro_batch: Optional[int] = None, per_rank: Optional[dict] = None,
                       **torch_arguments: Any) -> Session:
    """Registers `model`, `optimizer` and the position of `loader` (a
    :class:`nonstop.data.DataLoader`), joins the job, and makes the default
    process group run over nonstop; sets RANK, WORLD_SIZE, LOCAL_RANK,
    LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR and MASTER_PORT as torchrun
    does. A spare waits here until it takes a rank and has copied the state.

    With a loader, each ``optimizer.step()`` completes the step of the batch
    the loader handed out: the position moves on and the controller is told
    (``report_step``). Without one, the script reports its steps itself.
    `per_rank`: each rank's own values (Session.register).
    `resume_from`: a directory of durable checkpoints (Session.save_checkpoint),
    the newest valid one loaded before joining.
    Pass `session` instead to use one already registered.

    `world_invariant` (default: the NONSTOP_WORLD_INVARIANT variable, off):
    each global batch is cut into micro-batches of `micro_batch` samples (the
    loader's batch_size by default) and DistributedDataParallel sums their
    gradients along one fixed tree, so a kill, a shrink and a grow end on the
    bits of the fault-free run where the loss is a mean and each world can be
    dealt whole micro-batches in powers of two (rank 0 says when not;
    docs/python.md, "World-invariant DDP")."""
    global _session, _loader, _model, _before_first_step
    if isinstance(model, str) or (model is None and optimizer is None and loader is None and session is None):
        if isinstance(model, str):
            torch_arguments["backend"] = model
        if extra or session or resume_from or world_invariant or micro_batch or per_rank:
            raise TypeError("init_process_group(backend=...) takes torch's arguments alone: pass the model, the "
                            "optimizer, the loader and nonstop's options once they exist instead")
        return _join_first(torch_arguments)
    if torch_arguments:
        raise TypeError(f"nonstop.torch.init_process_group(model, optimizer, loader) takes no torch arguments "
                        f"({', '.join(sorted(torch_arguments))}=): nonstop's backend forms the group")
    if _session is not None and not _session._deferred:
        raise RuntimeError("init_process_group was called twice: one job, one session")
    if _session is not None:  # the script made its group first: this registers the state
        session = _session
    if loader is not None and optimizer is None:
        raise ValueError("a loader needs the optimizer too: its update is what completes each step")
    if world_invariant is None:
        world_invariant = _env_flag("NONSTOP_WORLD_INVARIANT")
    if world_invariant:
        if loader is None:
            raise ValueError("world_invariant needs the loader: its batches are cut into the micro-batches whose "
                             "gradients are summed in a fixed order")
        micro_batch = loader.batch_size if micro_batch is None else int(micro_batch)
        if micro_batch < 1:
            raise ValueError(f"micro_batch must be at least 1 sample, got {micro_batch}")
        loader.micro_batch = micro_batch
    elif micro_batch is not None:
        raise ValueError("micro_batch is the world-invariant mode's: pass world_invariant=True too")
    joined_first = session is not None and session._deferred
    if session is None or joined_first:
        session = session or join()
        state = dict(extra or {})
        if loader is not None:
            state.update(loader._registered_defaults())
        session.register(model, optimizer, extra=state, per_rank=per_rank, resume_from=resume_from)
    else:
        session._joined()
    _session, _loader, _model = session, loader, model
    _before_first_step = session.last_change.reason != "start"
    if loader is not None:
        loader._bind(session)
        loader.on_batch = _first_step
        _complete_steps_on_update(optimizer, loader)
    _form_default_group(session)  # joined first: a recovery may have changed the rank meanwhile
    if not joined_first:
        session.on_membership_change(lambda change: _form_default_group(session))
    return session


# torch's init_process_group arguments that nonstop's backend stands in for.
_TORCH_ARGUMENTS = {"backend", "init_method", "timeout", "world_size", "rank", "store", "group_name", "pg_options"}


def _join_first(torch_arguments: dict) -> Session:
    """init_process_group(backend=...) before the model exists, as most scripts call it: joins the
    job now (this worker gets its rank and world, the default group and torchrun's variables; a
    spare waits here until it takes a rank) and registers the state when the script wraps its
    model in nonstop.torch.DistributedDataParallel (the model, the optimizer over its parameters,
    the nonstop.data.DataLoader the script made), or when it calls
    init_process_group(model, optimizer, loader) itself. A spare that takes a rank runs the
    script's setup between the two; the recovery that promoted it waits for that."""
    global _session, _before_first_step
    unknown = set(torch_arguments) - _TORCH_ARGUMENTS
    if unknown:
        raise TypeError(f"init_process_group got unexpected arguments {sorted(unknown)}")
    if _session is not None:
        raise RuntimeError("init_process_group was called twice: one job, one session")
    # What torchrun's variables said before the join: a script that passes rank=int(os.environ["RANK"])
    # read them as a spare (a rank past the members', the world it started in), not its rank.
    started = {"world_size": os.environ.get("WORLD_SIZE"), "rank": os.environ.get("RANK")}
    session = join()
    session._join_first()
    for name in ("world_size", "rank"):
        asked = torch_arguments.get(name, -1)
        have = session.world_size if name == "world_size" else session.rank
        if asked in (-1, None) or int(asked) == have:
            continue
        if str(asked) != started[name]:
            raise ValueError(f"init_process_group({name}={asked}): nonstop's job gives this worker {name} {have}; "
                             f"drop {name}= (torchrun's variables are set)")
        import warnings
        warnings.warn(f"init_process_group({name}={asked}): what this worker's variables said as it started (a "
                      f"spare's); it has {name} {have} now: read dist.get_{name}() or the variables after this "
                      "call, not a value read before it", stacklevel=3)
    _session = session
    _before_first_step = session.last_change.reason != "start"
    if torch_arguments.get("timeout") is not None:  # the store's too, as torch's rendezvous does
        _job_store(session).set_timeout(torch_arguments["timeout"])
    _form_default_group(session)
    session.on_membership_change(lambda change: _form_default_group(session))
    return session


def _register_what_ddp_wraps(module: Any) -> None:
    """The script made its group first (_join_first): registers `module`, the one optimizer over
    its parameters and the first nonstop.data.DataLoader the script made (the others evaluate)."""
    import gc
    import warnings

    from . import data

    params = {id(p) for p in module.parameters()}
    with warnings.catch_warnings():  # isinstance() on torch's deprecated reduce_op object warns
        warnings.simplefilter("ignore")
        optimizers = [o for o in gc.get_objects() if isinstance(o, torch.optim.Optimizer)
                      and any(id(p) in params for g in o.param_groups for p in g["params"])]
    explicit = ("nonstop.torch.init_process_group(model, optimizer, loader) once they exist, before wrapping the "
                "model (after init_process_group(backend=...) too: it registers the state of the job joined)")
    if len(optimizers) != 1:
        fix = "make the optimizer before wrapping the model, or call " if not optimizers else "say which one: call "
        raise RuntimeError(f"nonstop.torch.DistributedDataParallel registers the model with the one optimizer over its "
                           f"parameters, and found {len(optimizers)}: {fix}{explicit}")
    loaders = data.made_in_order()
    if not loaders:
        raise RuntimeError("nonstop.torch.DistributedDataParallel registers the model with the "
                           "nonstop.data.DataLoader the script made, and found none: make it before wrapping "
                           f"the model, or call {explicit}; a script with no DataLoader (its own sampling) calls "
                           "init_process_group(model, optimizer) and reports its steps (docs/python.md, "
                           "\"A script with no DataLoader\")")
    # The first one made trains (a training loader, then an evaluation one, as scripts make them);
    # the others evaluate (docs/python.md, "Evaluation loaders").
    init_process_group(module, optimizers[0], loaders[0])


def _env_flag(name: str) -> bool:
    value = os.environ.get(name, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{name}={os.environ[name]!r}: use 1 or 0 (true/false, yes/no, on/off)")


def _complete_steps_on_update(optimizer: Any, loader: Any) -> None:
    update = optimizer.step

    @functools.wraps(update)
    def step_and_complete(*args: Any, **kwargs: Any) -> Any:
        factor = loader.lr_factor()
        if factor == 1.0:
            result = update(*args, **kwargs)
        else:  # the batch policy's factor on whatever the script's schedule set, for this update only
            lrs = [group["lr"] for group in optimizer.param_groups]
            for group in optimizer.param_groups:
                group["lr"] = group["lr"] * factor
            try:
                result = update(*args, **kwargs)
            finally:
                for group, lr in zip(optimizer.param_groups, lrs):
                    group["lr"] = lr
        loader._updated()
        return result

    optimizer.step = step_and_complete


def destroy_process_group() -> None:
    """Tells the controller that training ended (after the last step
    completed) and waits until the job ends, recovering if a member fails
    meanwhile; then destroys the default group."""
    session = _session
    if session is None:
        if dist.is_initialized():
            dist.destroy_process_group()
        return
    last = (_loader._steps_done() if _loader is not None else session._step_in_flight) - 1
    while True:
        try:
            session.finish(last)
            break
        except Aborted:
            session.recover()
    if dist.is_initialized():
        dist.destroy_process_group()


def _is_abort(e: BaseException, session: Session) -> bool:
    return isinstance(e, Aborted) or (isinstance(e, RuntimeError) and session._core is not None and session.aborted)


def step(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorates a training step (forward, backward, ``optimizer.step()``) that
    takes the batch the loader yielded. When a member fails or the world
    changes, the step's reducing call raises Aborted: the wrapper recovers and,
    unless the step was already updated on (the fault came after
    ``optimizer.step()``) or its state was copied from peers that had
    completed it, runs it again on its batch as dealt over the new world (the
    arguments that are the loader's batch, or its elements, are replaced).
    Released (this worker is not needed any more) ends the process."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        session = _session
        if session is None or _loader is None:
            raise RuntimeError("nonstop.torch.step needs nonstop.torch.init_process_group(model, optimizer, loader) "
                               "first: the step's batch comes from the loader")
        if _loader.replayed_peek():  # no set_epoch: a spare replays the loop of an epoch the job finished
            return None
        while True:
            try:
                return fn(*args, **kwargs)
            except BaseException as e:
                _BucketStep.reset(session)  # a backward that raised never ran its end
                if not _is_abort(e, session):
                    raise
            resumed = session.recover()
            if _model is not None:
                for p in _model.parameters():
                    p.grad = None  # the lost step's gradients, half reduced
            pending = _loader._outstanding()
            if pending is None or resumed > pending:
                # Updated on before the fault, or the state copied from peers that completed the step.
                if pending is not None:  # with this worker's share in their sum: it had reached the reduction
                    print(f"[nonstop] epoch {_loader.sampler.epoch} step {pending}: completed by the peers whose "
                          f"state this worker copied, its share in their sum, so not run again here (samples "
                          f"{_loader.indices})", file=sys.stderr, flush=True)
                _loader._drop_outstanding()
                return None
            args, kwargs = _loader._redeal(resumed, args, kwargs)

    return run


class DistributedDataParallel(torch.nn.parallel.DistributedDataParallel):
    """torch's DistributedDataParallel with the same constructor and
    ``no_sync``, for what stock DDP cannot do under nonstop (docs/python.md):

    - gradients are weighted by this rank's share of the step's global batch
      (the loader's; 1/world without one), not divided by the world size the
      group was made with, so a shrink or a grow keeps the global mean;
    - its buckets are laid out once, at construction, in the parameters'
      reverse order, and never again (stock DDP re-buckets after its first
      iteration, and a spare's first iteration would then pair its buckets
      with the survivors' other ones)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # joined first: the registration in __init__ takes the mode from the environment
        invariant = (_loader is not None and _loader.micro_batch) or (
            _session is not None and _session._deferred and _env_flag("NONSTOP_WORLD_INVARIANT"))
        from ._invariant_ddp import _InvariantDDP  # made here: it subclasses this class

        if invariant and not issubclass(cls, _InvariantDDP):
            if cls is not DistributedDataParallel:
                raise TypeError(f"{cls.__name__} subclasses nonstop.torch.DistributedDataParallel, which the "
                                "world-invariant mode replaces by a module of its own: wrap the model in "
                                "nonstop.torch.DistributedDataParallel itself, or drop world_invariant")
            return super().__new__(_InvariantDDP)  # init_process_group(world_invariant=True)
        return super().__new__(cls)

    def __init__(self, module: Any, *args: Any, **kwargs: Any) -> None:
        _check_joined()
        if _session._deferred:
            _register_what_ddp_wraps(module)
        # A worker that joined a running job: its first iteration is not the job's (static_graph)
        self._joined_running = _before_first_step
        super().__init__(module, *args, **kwargs)
        global _hooked
        _hooked = True
        self._hook = _HookState()
        super().register_comm_hook(self._hook, _weighted_sum_hook)
        self._step_buffers: Any = None  # (step, the buffers as the step's forward found them)
        _session._before_recover.append(self._roll_back_buffers)
        # The layout of every member's DDP, whenever it was made: all parameters, reverse order.
        self.reducer._push_all_rebuilt_params()
        self.reducer._rebuild_buckets()

    def register_comm_hook(self, state: Any, hook: Callable[..., Any]) -> None:
        """A communication hook of the script's (torch's allreduce_hook, PowerSGD's,
        its own): each bucket reaches it weighted by this rank's share of the step's
        global batch times the world size, so a hook that averages over the world
        (as torch's do) sums the shares; its collectives run over nonstop."""
        if self._hook.user is not None:
            raise RuntimeError("register_comm_hook can only be called once (as in torch's DistributedDataParallel)")
        self._hook.user = (state, hook)
        _HookState.synchronous = True

    def _catch_up_hook_state(self) -> None:
        """A joiner's hook state starts afresh; one that counts iterations (PowerSGDState.iter,
        which decides when compression starts) takes the job's step, so its collectives match
        the survivors'. The rest of it (PowerSGD's error feedback) is the joiner's own."""
        state = self._hook.user[0] if self._hook.user is not None else None
        step_ = _loader._outstanding() if _loader is not None else None
        if step_ is not None and isinstance(getattr(state, "iter", None), int):
            state.iter = max(state.iter, step_)

    def register_builtin_comm_hook(self, comm_hook_type: Any) -> None:
        raise NotImplementedError("DDP's built-in C++ hooks bypass nonstop's share weighting: register torch's Python "
                                  "hook of the same name instead (torch.distributed.algorithms.ddp_comm_hooks."
                                  "default_hooks.allreduce_hook, fp16_compress_hook) with register_comm_hook")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        _first_step()  # DDP's forward may broadcast buffers: with the peers from now on
        if self._joined_running and self.num_iterations == 0:
            self._catch_up_hook_state()
        out = super().forward(*args, **kwargs)
        # With a static graph DDP's first iteration all-reduces its map of the parameters used;
        # the survivors made theirs in the job's first iteration, so a joiner's is its own.
        _HookState.local_used_map = bool(self.static_graph and self.num_iterations == 1 and self._joined_running)
        return out

    def _run_ddp_forward(self, *args: Any, **kwargs: Any) -> Any:
        # The module's forward updates its buffers (BatchNorm's running statistics): kept as they
        # are now, after DDP's broadcast of rank 0's, for a step that is lost and run again.
        step_ = _loader._outstanding() if _loader is not None else None
        fresh = self._step_buffers is None or self._step_buffers[0] != step_
        if torch.is_grad_enabled() and step_ is not None and fresh:  # a step's first forward (no_sync)
            self._step_buffers = (step_, [b.detach().clone() for _, b in _session._buffers])
        return super()._run_ddp_forward(*args, **kwargs)

    def _roll_back_buffers(self) -> None:
        """At a recovery's start: the step in flight is lost, and with it its forward's updates of
        the buffers; they go back to what that forward found (on every survivor the same where DDP
        broadcast rank 0's), before a spare copies them, so the step runs again on the fault-free
        run's bits. A step already updated on keeps them."""
        saved, self._step_buffers = self._step_buffers, None
        if saved is None or _loader is None or saved[0] != _loader._outstanding():
            return
        with torch.no_grad():
            for (_, b), value in zip(_session._buffers, saved[1]):
                b.copy_(value)


class _HookState:
    """nonstop's hook's state: the script's own hook, if it registered one."""
    # A joiner's first iteration of a static graph: DDP's map of the parameters used is not
    # all-reduced (ProcessGroup._allreduce_as_float32 answers it locally).
    local_used_map = False
    # A script's hook chains collectives on its futures (PowerSGD all-reduces P, then Q): each
    # completes before the call returns, so the chain runs on the training thread, in the same
    # order on every rank (chained on the communication thread it would wait on itself).
    synchronous = False

    def __init__(self) -> None:
        self.user: Any = None  # (state, hook)


def _weighted_sum_hook(state, bucket):  # type: ignore[no-untyped-def]  (DDP checks the annotations)
    session = _session
    buffer = bucket.buffer() if hasattr(bucket, "buffer") else bucket.get_tensor()
    _BucketStep.enter(session)
    share = _loader._share() if _loader is not None else None
    if state.user is not None:
        # the script's hook averages over the world: hand it the share times the world
        if share is not None:
            buffer.mul_(share * session.world_size)
        user_state, hook = state.user
        return hook(user_state, bucket)
    buffer.mul_(share if share is not None else 1.0 / session.world_size)
    return _start_bucket(session, buffer).get_future().then(lambda fut: fut.value()[0])


def _check_joined() -> None:
    if _session is None:
        raise RuntimeError("nonstop.torch.DistributedDataParallel needs nonstop.torch.init_process_group(...) "
                           "first: the state is registered and the job joined there")
