"""A DDP job whose ranks meet through the job's store while it trains (tests/python/test_store.py).

Each step every rank sets `step/<s>/rank/<r>`; at --takeover-step rank 0 kills the controller
(the pid in --job-file: `nonstop run` starts another, which takes the job over from the journal)
and adds 1 to `adds` at once (no controller leads: the add is sent again to the next one); 1.5 s
later it sets `late`, which the other ranks wait for with `get` meanwhile (their waits, held by the
dead controller, are sent again too); then they add 1 each. A worker killed by --inject is replaced by a spare, which reads the
keys its predecessor set; the others wait in the store for rank 1's key at that step when it is
killed (rank 1 goes on to its collective only once they set `waiting/<s>/<r>`), and their wait ends
with nonstop.Aborted (the step runs again). At the end each rank checks what the job's store holds and prints
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
    ap.add_argument("--wait-at-step", type=int, default=7,
                    help="the step whose rank 1 is killed (--inject): the others wait in the store")
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
    waits = [0]  # the waits of --wait-at-step this rank began (a wait cut short runs again)

    # A value of the most a key holds (1 MiB), from rank 0 to every rank.
    big = bytes(range(256)) * 4096
    if session.rank == 0 and not store.check(["big"]):
        store.set("big", big)
    if store.get("big") != big:
        print(f"[rank {session.rank}] store WRONG: the 1 MiB value came back altered", flush=True)

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
                store.add("adds", 1)  # sent while no controller leads, answered by the next one
                time.sleep(1.5)
                store.set("late", "1")
            else:
                print(f"[rank {rank}] late = {store.get('late')!r}", flush=True)
                store.add("adds", 1)
            if store.add("adds_counted", 1) == dist.get_world_size():
                store.set("adds_done", "1")
        if step == args.wait_at_step:
            # The others wait for rank 1's key before the step's collective, where rank 1 is killed
            # (--inject) before it sets it: their wait ends with nonstop.Aborted, the step runs
            # again, and the spare that took rank 1 sets it.
            # Rank 1 goes on to its collective (and its kill) only once both others are in the
            # wait: on a loaded machine one could otherwise see the abort before it began to wait.
            if rank == 1 and session.generation > 1:
                store.set(f"wait/{step}", "1")
            elif rank == 1:
                store.wait([f"waiting/{step}/{r}" for r in range(dist.get_world_size()) if r != 1])
            else:
                waits[0] += 1
                store.set(f"waiting/{step}/{rank}", "1")
                store.get(f"wait/{step}")
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
    print(f"[rank {rank}] waits at step {args.wait_at_step}: {waits[0]}", flush=True)
    dist.barrier()
    destroy_process_group()


if __name__ == "__main__":
    main()
