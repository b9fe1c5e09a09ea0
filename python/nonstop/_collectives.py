"""torch.distributed's collectives beyond the gradient sum, over a nonstop session.

ProcessGroup (distributed.py) hands each call here with the ranks it runs over (Comm).
Every reduction runs on nonstop's ring with the tensor's own type and
operation (Session.AllReduce of any type, nonstop/reduce.h); the others are
made of the ring's all-gather, reduce-scatter and broadcast. All are
deterministic at a fixed world, and a fault inside any of them raises
nonstop.Aborted, so the step that made it is run again. docs/python.md
("torch.distributed over nonstop") lists what each call is made of.
"""

from __future__ import annotations

from typing import Any, List, Sequence

import torch
import torch.distributed as dist

from . import _device

# torch's element types that nonstop reduces, by the names nonstop/reduce.h gives them.
_DTYPES = {
    torch.float32: "float32", torch.float64: "float64", torch.float16: "float16", torch.bfloat16: "bfloat16",
    torch.int8: "int8", torch.uint8: "uint8", torch.int16: "int16", torch.int32: "int32", torch.int64: "int64",
    torch.bool: "bool",
}
_OPS = [("SUM", "sum"), ("AVG", "avg"), ("PRODUCT", "product"), ("MIN", "min"), ("MAX", "max"),
        ("BAND", "band"), ("BOR", "bor"), ("BXOR", "bxor")]


class Comm:
    """The ranks a collective runs over: the world's (group 0), or a subgroup's (Session.new_group's
    id and the world ranks it was made of, in its rank order)."""

    def __init__(self, session: Any, group: int = 0, ranks: Sequence[int] = ()) -> None:
        self.session, self.group, self.ranks = session, group, list(ranks)

    @property
    def rank(self) -> int:
        return self.ranks.index(self.session.rank) if self.group else self.session.rank

    @property
    def world_size(self) -> int:
        return len(self.ranks) if self.group else self.session.world_size

    def world_rank(self, rank: int) -> int:
        """The world's rank of this group's `rank`."""
        return self.ranks[rank] if self.group else rank

    def reduce(self, address: int, size: int, dtype: str, op: str, scatter: bool = False) -> None:
        self.session._core.reduce(address, size, dtype, op, scatter, group=self.group)

    def allgather(self, address: int, record_bytes: int) -> None:
        self.session._core.allgather(address, record_bytes, self.world_size, group=self.group)

    def broadcast(self, address: int, size: int, root: int) -> None:
        self.session._core.broadcast(address, size, root, group=self.group)

    def barrier(self) -> None:
        self.session._core.barrier(group=self.group)


def op_name(op: Any) -> str:
    """nonstop's name of a torch ReduceOp ("sum", "avg", ...)."""
    for attr, name in _OPS:
        if hasattr(dist.ReduceOp, attr) and op == getattr(dist.ReduceOp, attr):
            return name
    raise ValueError(f"nonstop reduces with SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR and BXOR; got {op}")


def check_bytes(t: Any, what: str) -> None:
    _device.device_index(t, what)
    if not t.is_contiguous():
        raise ValueError(f"{what} is not contiguous: pass .contiguous()")


def nbytes(t: Any) -> int:
    return t.numel() * t.element_size()


def reduce_in_place(comm: Any, tensor: Any, op: Any, what: str, scatter: bool = False) -> None:
    """`tensor` reduced across the world in place by `op` (a torch ReduceOp); with `scatter`,
    only this rank's chunk of it (rank·n/W to (rank+1)·n/W) is the reduction's."""
    name = op_name(op)
    if tensor.dtype not in _DTYPES:
        raise TypeError(f"nonstop's {what} reduces {', '.join(str(d) for d in _DTYPES)} tensors, got {tensor.dtype}")
    average = name == "avg"
    if average and not tensor.is_floating_point():
        raise ValueError(f"{what} with ReduceOp.AVG takes a floating-point tensor, got {tensor.dtype}: "
                         "sum it and divide")
    check_bytes(tensor, f"the tensor of {what}")
    dtype, reduce_op = _DTYPES[tensor.dtype], "sum" if average else name
    _device.on_host(tensor, what, lambda host: comm.reduce(host.data_ptr(), nbytes(host), dtype, reduce_op, scatter))
    if average:
        tensor.div_(comm.world_size)


def reduce(comm: Any, tensors: List[Any], opts: Any) -> None:
    """reduce: the world's reduction on the root; every other rank's tensor is left as it was."""
    tensor = one(tensors, "reduce")
    root = int(opts.rootRank)
    work = tensor if comm.rank == root else tensor.clone()
    reduce_in_place(comm, work, opts.reduceOp, "reduce")


def allgather_into(comm: Any, output: Any, tensor: Any, what: str) -> None:
    """`output` (world × tensor's elements, contiguous) gets every rank's `tensor` in rank order."""
    world = comm.world_size
    if output.dtype != tensor.dtype or output.numel() != world * tensor.numel():
        raise ValueError(f"{what}: the output is {output.dtype} x {output.numel()} for an input of {tensor.dtype} x "
                         f"{tensor.numel()} at a world of {world}: it must hold {world} inputs")
    check_bytes(tensor, f"the input of {what}")
    check_bytes(output, f"the output of {what}")
    flat = output.view(-1)
    flat[comm.rank * tensor.numel():(comm.rank + 1) * tensor.numel()].copy_(tensor.reshape(-1))
    if nbytes(tensor):
        _device.on_host(output, what, lambda host: comm.allgather(host.data_ptr(), nbytes(tensor)))


def allgather(comm: Any, outputs: List[Any], tensor: Any, what: str = "all_gather") -> None:
    world = comm.world_size
    check_parts(outputs, world, tensor, what, "output", "input")
    gathered = torch.empty((world, tensor.numel()), dtype=tensor.dtype)
    allgather_into(comm, gathered, tensor.contiguous().cpu(), what)
    for i, out in enumerate(outputs):
        out.copy_(gathered[i].view_as(out))


def gather(comm: Any, outputs: List[List[Any]], inputs: List[Any], opts: Any) -> None:
    """gather: the ring's all-gather, kept by the root alone."""
    tensor = one(inputs, "gather")
    root = int(opts.rootRank)
    if comm.rank == root:
        if len(outputs) != 1:
            raise ValueError(f"gather's root takes one gather_list, got {len(outputs)}")
        allgather(comm, outputs[0], tensor, "gather")
    else:
        if outputs and outputs[0]:
            raise ValueError(f"gather: only the root (rank {root}) passes a gather_list")
        scratch = [torch.empty_like(tensor, device="cpu") for _ in range(comm.world_size)]
        allgather(comm, scratch, tensor, "gather")


def scatter(comm: Any, outputs: List[Any], inputs: List[List[Any]], opts: Any) -> None:
    """scatter: the root's list broadcast whole; each rank keeps its own part."""
    tensor = one(outputs, "scatter")
    root, world = int(opts.rootRank), comm.world_size
    whole = torch.empty((world, tensor.numel()), dtype=tensor.dtype)
    if comm.rank == root:
        if len(inputs) != 1:
            raise ValueError(f"scatter's root takes one scatter_list, got {len(inputs)}")
        check_parts(inputs[0], world, tensor, "scatter", "scatter_list tensor", "output")
        for i, part in enumerate(inputs[0]):
            whole[i].copy_(part.reshape(-1))
    elif inputs and inputs[0]:
        raise ValueError(f"scatter: only the root (rank {root}) passes a scatter_list")
    if nbytes(whole):
        comm.broadcast(whole.data_ptr(), nbytes(whole), root)
    tensor.copy_(whole[comm.rank].view_as(tensor))


def reduce_scatter(comm: Any, output: Any, inputs: Sequence[Any], op: Any, what: str) -> None:
    """reduce_scatter: the ring's reduce-scatter over the inputs laid end to end."""
    world = comm.world_size
    check_parts(inputs, world, output, what, "input", "output")
    whole = torch.cat([t.reshape(-1).cpu() for t in inputs]) if output.numel() else output.new_empty(0)
    reduce_in_place(comm, whole, op, what, scatter=True)
    n = output.numel()
    output.copy_(whole[comm.rank * n:(comm.rank + 1) * n].view_as(output))


def alltoall(comm: Any, outputs: List[Any], inputs: List[Any]) -> None:
    """all_to_all: rank r's input j goes to rank j's output r, each part on its own, by the
    point-to-point connections (every pair at once: each peer and direction has its thread)."""
    from . import _p2p

    world = comm.world_size
    if len(inputs) != world or len(outputs) != world:
        raise ValueError(f"all_to_all takes {world} input and {world} output tensors, got "
                         f"{len(inputs)} and {len(outputs)}")
    dtype = inputs[0].dtype
    if any(t.dtype != dtype for t in list(inputs) + list(outputs)):
        raise ValueError("all_to_all's tensors must all have one dtype")
    for i, t in enumerate(outputs):
        check_bytes(t, f"all_to_all's output {i}")
    me = comm.rank
    if outputs[me].numel() != inputs[me].numel():
        raise ValueError(f"all_to_all: this rank's output {me} holds {outputs[me].numel()} elements, its input "
                         f"{me} {inputs[me].numel()}: they must match")
    outputs[me].copy_(inputs[me].reshape(outputs[me].shape))
    works = [_p2p.start(comm.session, comm.world_rank(j), inputs[j].contiguous(), sending=True, channel=1)
             for j in range(world) if j != me]
    works += [_p2p.start(comm.session, comm.world_rank(s), outputs[s], sending=False, channel=1)
              for s in range(world) if s != me]
    for work in works:
        work.wait()


def alltoall_base(comm: Any, output: Any, tensor: Any, output_splits: List[int], input_splits: List[int]) -> None:
    """all_to_all_single: equal splits of the first dimension, or the ones given."""
    world = comm.world_size

    def parts(t: Any, splits: List[int], what: str) -> List[Any]:
        if t.dim() == 0:
            raise ValueError(f"all_to_all_single: the {what} is a scalar; it splits along its first dimension")
        if not splits:
            if t.shape[0] % world:
                raise ValueError(f"all_to_all_single: the {what}'s first dimension ({t.shape[0]}) is not a multiple "
                                 f"of the world ({world}): pass its split sizes")
            splits = [t.shape[0] // world] * world
        if len(splits) != world or sum(splits) != t.shape[0]:
            raise ValueError(f"all_to_all_single: {what} split sizes {list(splits)} do not cut its {t.shape[0]} "
                             f"rows into {world} parts")
        return list(torch.split(t, list(splits)))

    alltoall(comm, parts(output, output_splits, "output"), parts(tensor, input_splits, "input"))


def check_parts(parts: Sequence[Any], world: int, like: Any, what: str, part: str, other: str) -> None:
    """`parts` are one tensor a rank, each of `like`'s dtype and size (ValueError naming the first
    that is not)."""
    if len(parts) != world:
        raise ValueError(f"{what} takes {world} {part}s (one a rank), got {len(parts)}")
    for i, t in enumerate(parts):
        if t.dtype != like.dtype or t.numel() != like.numel():
            raise ValueError(f"{what}'s {part} {i} is {t.dtype} x {t.numel()}, the {other} "
                             f"{like.dtype} x {like.numel()}: they must match")


def one(tensors: List[Any], what: str) -> Any:
    if len(tensors) != 1:
        raise ValueError(f"nonstop's {what} takes one tensor per process, got {len(tensors)}")
    return tensors[0]
