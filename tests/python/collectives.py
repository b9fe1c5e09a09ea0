"""torch.distributed's collectives in one script, printed as JSON per rank:
under torch's launcher over Gloo, or under `nonstop run` over nonstop
(test_distributed.py compares the two). Values are small integers, so every
order of addition gives the same float."""

import datetime
import json
import os

import torch
import torch.distributed as dist

if os.environ.get("NONSTOP_CONTROLLER"):
    import nonstop.torch

    torch.manual_seed(0)  # the members' registered state must agree when the job ends
    nonstop.torch.init_process_group(torch.nn.Linear(2, 1))
else:
    dist.init_process_group("gloo")

rank, world = dist.get_rank(), dist.get_world_size()
out = {"rank": rank, "world": world}
env = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")}
out["env"] = env

t = torch.arange(7, dtype=torch.float32) * (rank + 1)
dist.all_reduce(t)
out["all_reduce"] = t.tolist()

b = torch.full((5,), float(rank), dtype=torch.float32) + torch.arange(5, dtype=torch.float32)
dist.broadcast(b, src=world - 1)
out["broadcast"] = b.tolist()

i = torch.tensor([rank * 10, rank * 10 + 1], dtype=torch.int64)
dist.broadcast(i, src=0)
out["broadcast_int64"] = i.tolist()

gathered = [torch.zeros(3, dtype=torch.float32) for _ in range(world)]
dist.all_gather(gathered, torch.tensor([rank, rank * 2, rank * 3], dtype=torch.float32))
out["all_gather"] = [g.tolist() for g in gathered]

# Every operation on every type: the value, or "unsupported" where the backend refuses it.
ops = {"sum": dist.ReduceOp.SUM, "product": dist.ReduceOp.PRODUCT, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX,
       "band": dist.ReduceOp.BAND, "bor": dist.ReduceOp.BOR, "bxor": dist.ReduceOp.BXOR}
for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int16,
              torch.int32, torch.int64, torch.bool):
    for name, op in ops.items():
        v = ((torch.arange(9) * 5 + rank * 3) % 7 - 2)
        v = v.to(dtype) if dtype != torch.bool else v > 0
        try:
            dist.all_reduce(v, op=op)
            out[f"all_reduce {dtype} {name}"] = v.tolist()
        except (RuntimeError, ValueError, TypeError):
            out[f"all_reduce {dtype} {name}"] = "unsupported"

big = torch.full((3,), 2 ** 40 + rank, dtype=torch.int64)  # beyond float32's exact integers
dist.all_reduce(big)
out["all_reduce int64 large"] = big.tolist()

r = torch.arange(4, dtype=torch.float64) + rank
dist.reduce(r, dst=1)
out["reduce"] = r.tolist() if rank == 1 else "not the root"

g = torch.tensor([rank, rank + 10], dtype=torch.int32)
glist = [torch.zeros(2, dtype=torch.int32) for _ in range(world)] if rank == 0 else None
dist.gather(g, gather_list=glist, dst=0)
out["gather"] = [x.tolist() for x in glist] if rank == 0 else "not the root"

sc = torch.zeros(3)
dist.scatter(sc, scatter_list=[torch.full((3,), 10.0 * i) for i in range(world)] if rank == 2 else None, src=2)
out["scatter"] = sc.tolist()



def record(key, call, result):
    """out[key]: `result` after `call`, or "unsupported" where the backend refuses the call (Gloo's
    reduce_scatter and all_gather_into_tensor in torch 1.13)."""
    try:
        call()
        out[key] = result.tolist()
    except RuntimeError as e:
        if "does not support" not in str(e) and "no support" not in str(e):
            raise
        out[key] = "unsupported"


rs = torch.zeros(2, dtype=torch.int64)
record("reduce_scatter", lambda: dist.reduce_scatter(
    rs, [torch.tensor([rank + i, rank * i], dtype=torch.int64) for i in range(world)], op=dist.ReduceOp.MAX), rs)
into = torch.zeros(world * 2, dtype=torch.float64)
gather_into = getattr(dist, "all_gather_into_tensor", None) or dist._all_gather_base
record("all_gather_into_tensor", lambda: gather_into(into, torch.tensor([rank, -rank], dtype=torch.float64)), into)

splits_in = [(rank + j) % 3 + 1 for j in range(world)]  # rank r sends (r + j) % 3 + 1 rows to rank j
splits_out = [(s + rank) % 3 + 1 for s in range(world)]
a2a_in = torch.arange(sum(splits_in), dtype=torch.float32) + 100 * rank
a2a_out = torch.zeros(sum(splits_out))
dist.all_to_all_single(a2a_out, a2a_in, output_split_sizes=splits_out, input_split_sizes=splits_in)
out["all_to_all_single"] = a2a_out.tolist()

sub = dist.new_group([0, 2])  # a subgroup: its collectives over ranks 0 and 2 alone
if rank in (0, 2):
    product = torch.tensor([rank + 1, 3], dtype=torch.int64)
    dist.all_reduce(product, op=dist.ReduceOp.PRODUCT, group=sub)
    root = torch.tensor([rank * 1.5, 7.0])
    dist.broadcast(root, src=2, group=sub)
    parts = [torch.zeros(2) for _ in range(2)]
    dist.all_gather(parts, torch.tensor([rank, rank * rank], dtype=torch.float32), group=sub)
    dist.barrier(group=sub)
    out["subgroup"] = [product.tolist(), root.tolist(), [p.tolist() for p in parts]]
else:
    out["subgroup"] = "not a member"

# Point-to-point: a ring exchange in which every rank sends first, 4 MiB each way (a send that
# waited for its receive would deadlock), a batch the other way round, and a plain send and recv.
right, left = (rank + 1) % world, (rank - 1) % world
big_out, big_in = torch.full((1 << 20,), float(rank)), torch.zeros(1 << 20)
for w in [dist.isend(big_out, right), dist.irecv(big_in, left)]:
    w.wait()
out["isend_irecv"] = [big_in[0].item(), big_in[-1].item()]
batch_in = torch.zeros(2)
for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.tensor([rank * 2.0, 1.0]), left),
                                 dist.P2POp(dist.irecv, batch_in, right)]):
    w.wait()
out["batch_isend_irecv"] = batch_in.tolist()
if rank == 0:
    dist.send(torch.tensor([5, 6]), dst=1)
elif rank == 1:
    pair = torch.zeros(2, dtype=torch.int64)
    dist.recv(pair, src=0)
    out["send_recv"] = pair.tolist()

if rank == 0:  # a receive from any source: whoever sends first, each named with its bytes
    heard = []
    for _ in range(world - 1):
        got = torch.zeros(2)
        heard.append((dist.recv(got), got.tolist()))
    out["recv_any_source"] = sorted(heard)
else:
    dist.send(torch.tensor([rank, rank * 3.0]), dst=0)
# At once, no barrier: its parts must not be taken by the receives from any source above.
after_any = torch.zeros(world)
dist.all_to_all_single(after_any, torch.arange(world, dtype=torch.float32) + 10 * rank)
out["all_to_all_after_recv_any"] = after_any.tolist()
dist.monitored_barrier(timeout=datetime.timedelta(seconds=60))
out["monitored_barrier"] = True

objects = [None] * world
dist.all_gather_object(objects, {"rank": rank, "text": "x" * rank})
out["all_gather_object"] = objects

work = dist.all_reduce(torch.ones(4), async_op=True)
out["async_wait"] = bool(work.wait())
dist.barrier()
out["barrier"] = True

print("RESULT " + json.dumps(out, sort_keys=True), flush=True)
if os.environ.get("NONSTOP_CONTROLLER"):
    nonstop.torch.destroy_process_group()
else:
    dist.destroy_process_group()
