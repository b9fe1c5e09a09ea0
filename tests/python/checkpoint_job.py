"""A small AdamW job for test_checkpoint.py: saves a durable checkpoint after
--save-at (every rank calls; rank 0 writes), or resumes from --resume, and
prints its final state. --shard-group G: the optimizer state sharded."""

import argparse

import torch

import nonstop
import nonstop.torch

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, required=True)
ap.add_argument("--save-at", type=int, default=-1)
ap.add_argument("--checkpoint-dir", default="")
ap.add_argument("--resume", default="")
ap.add_argument("--shard-group", type=int, default=0)
ap.add_argument("--save-on-rank-0-only", action="store_true", help="misuse: a sharded save must be on every rank")
args = ap.parse_args()

torch.manual_seed(0)
torch.set_num_threads(1)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
if args.shard_group:
    optimizer = nonstop.torch.ShardedOptimizer(model, torch.optim.AdamW, args.shard_group, lr=1e-2)
else:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
session = nonstop.join().register(model, optimizer, extra={"seen": 0}, resume_from=args.resume or None)
if args.shard_group:
    ddp = nonstop.torch.ShardedDataParallel(model, session, optimizer)
else:
    ddp = nonstop.torch.DataParallel(model, session)
BATCH = 16
print(f"first step {session.resume_step}", flush=True)


def train_step(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(BATCH, 8, generator=g)
    y = x.sum(1, keepdim=True).cos()
    lo, hi = BATCH * session.rank // session.world_size, BATCH * (session.rank + 1) // session.world_size
    optimizer.zero_grad()
    loss = ((ddp(x[lo:hi]) - y[lo:hi]) ** 2).sum() / BATCH
    loss.backward()
    if args.shard_group:
        ddp.reduce()
    optimizer.step()
    session.extra["seen"] += 1
    return loss.item()


step = session.resume_step
while True:
    try:
        while step < args.steps:
            session.report_step(step, train_step(step))
            if step == args.save_at and (session.rank == 0 or not args.save_on_rank_0_only):
                print(session.save_checkpoint(args.checkpoint_dir), flush=True)
                session.wait_checkpoint()
            step += 1
        session.finish(args.steps - 1)
        break
    except nonstop.Aborted:
        step = session.recover()
print(f"final checksum {session.checksum()} seen {session.extra['seen']}", flush=True)
