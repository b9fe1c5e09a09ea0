"""A DDP job whose ranks meet through the job's store while it trains (tests/python/test_store.py).

Each step every rank sets `step/<s>/rank/<r>`; at --takeover-step rank 0 kills the controller
(the pid in --job-file: `nonstop run` starts another, which takes the job over from the journal)
and, 1.5 s later, sets `late`, which the other ranks wait for with `get` meanwhile; then every
rank adds 1 to `adds`, once. A worker killed by --inject is replaced by a spare, which reads the
keys its predecessor set. At the end each rank checks what the job's store holds and prints
`[rank R] store ok <keys>` or `[rank R] store WRONG: ...`.
"""
import argparse
import json
import os
import signal
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import Dataset

import nonstop.torch
from nonstop.data import DataLoader, DistributedSampler
from nonstop.torch import DistributedDataParallel as DDP
from nonstop.torch import destroy_process_group


class Samples(Dataset):
    def __len__(self):
        return 240  # 10 steps of 3 ranks

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return torch.randn(8, generator=g), torch.randn(1, generator=g)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--job-file", required=True)
    ap.add_argument("--takeover-step", type=int, default=3)
    ap.add_argument("--step-sleep", type=float, default=0.1)
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    session = nonstop.torch.init_process_group(backend="nonstop")
    store = nonstop.torch.store()
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    data = DataLoader(Samples(), batch_size=8, shuffle=False, sampler=DistributedSampler(Samples(), shuffle=False))
    ddp = DDP(model)
    steps = len(data)

    @nonstop.torch.step
    def run_batch(source, target):
        step, rank = session._step_in_flight, session.rank
        store.set(f"step/{step}/rank/{rank}", str(step))
        if step == args.takeover_step and not store.check(["adds_done"]):
            if rank == 0:
                with open(args.job_file) as f:
                    controller = json.load(f)["pid"]
                os.kill(controller, signal.SIGKILL)
                print(f"[rank 0] killed the controller (pid {controller}) at step {step}", flush=True)
                time.sleep(1.5)
                store.set("late", "1")
            else:
                print(f"[rank {rank}] late = {store.get('late')!r}", flush=True)
            store.add("adds", 1)
            if store.add("adds_counted", 1) == dist.get_world_size():
                store.set("adds_done", "1")
        optimizer.zero_grad()
        F.mse_loss(ddp(source), target).backward()
        optimizer.step()
        time.sleep(args.step_sleep)

    for source, target in data:
        run_batch(source, target)
    rank, world = session.rank, dist.get_world_size()
    store.set(f"done/{rank}", "1")
    store.wait([f"done/{r}" for r in range(world)])
    wrong = []
    missing = [f"step/{s}/rank/{r}" for s in range(steps) for r in range(world)
               if not store.check([f"step/{s}/rank/{r}"])]
    if missing:
        wrong.append(f"missing {missing}")
    if store.get("late") != b"1":
        wrong.append(f"late = {store.get('late')!r}")
    if int(store.get("adds")) != world:
        wrong.append(f"adds = {store.get('adds')!r}, not {world}: a write was lost or applied twice")
    print(f"[rank {rank}] store " + (f"WRONG: {'; '.join(wrong)}" if wrong else f"ok {store.num_keys()}"),
          flush=True)
    dist.barrier()
    destroy_process_group()


if __name__ == "__main__":
    main()
