"""torch.distributed's collectives in one script, printed as JSON per rank:
under torch's launcher over Gloo, or under `nonstop run` over nonstop
(test_distributed.py compares the two). Values are small integers, so every
order of addition gives the same float."""

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

work = dist.all_reduce(torch.ones(4), async_op=True)
out["async_wait"] = bool(work.wait())
dist.barrier()
out["barrier"] = True

print("RESULT " + json.dumps(out, sort_keys=True), flush=True)
if os.environ.get("NONSTOP_CONTROLLER"):
    nonstop.torch.destroy_process_group()
else:
    dist.destroy_process_group()
