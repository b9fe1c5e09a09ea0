"""A small PyTorch trainer for the Python tests: an MLP with AdamW, several
gradient buckets, micro-batches with no_sync, and the registered state of a
real script (parameters, lazily created optimizer state, a Python counter).

It prints one line a test can parse at set-up and one at the end:
    setup worker=W pid=P
    final rank=R worker=W pid=P generation=G world=N params=C state=D tokens=T setups=S
"""

import argparse
import os
import time

import torch

import nonstop
import nonstop.torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--global-batch", type=int, default=24)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--throttle-ms", type=int, default=0, help="sleep per step (room to resize mid-run)")
    ap.add_argument("--bucket-mb", type=float, default=0.004)
    ap.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw",
                    help="sgd: an update that scales with the gradient (AdamW's does not)")
    ap.add_argument("--wait-for-joins", type=int, default=0,
                    help="before the first step, wait until the journal (--journal) has this many joins: a test "
                         "whose fault needs the spare warm first")
    ap.add_argument("--hold-for-joins", type=int, default=0,
                    help="while the world is smaller than the first one, hold each step's update until the "
                         "journal (--journal) has this many joins: a test that grows the world back needs the "
                         "joiner to arrive before the job ends, however long its start takes on a busy machine")
    ap.add_argument("--journal", default="")
    ap.add_argument("--no-salvage", action="store_true",
                    help="DataParallel(salvage=False) (True otherwise: this loop's first collective of a step is "
                         "its buckets); InvariantDataParallel(salvage=False)")
    ap.add_argument("--clip-norm", type=float, default=0.0, help="clip the gradient's norm to this (0: no clipping)")
    ap.add_argument("--shard-group", type=int, default=0,
                    help="ShardedOptimizer/ShardedDataParallel (AdamW) with optimizer state in groups of this many")
    ap.add_argument("--pause-after-micro-batch-ms", type=int, default=0,
                    help="world-invariant or planned: sleep after each micro-batch (a timed fault lands between them)")
    ap.add_argument("--pause-rank", type=int, default=-1,
                    help="the pause after each micro-batch on this rank alone (-1: every rank): a fault at its "
                         "reduction then finds the others' blocks complete, however loaded the machine")
    ap.add_argument("--pause-step", type=int, default=-1, help="the pause in this step alone (-1: every step)")
    ap.add_argument("--planned", action="store_true",
                    help="DataParallel(micro_batches=...): plan(step), backward(loss) per micro-batch, reduce()")
    ap.add_argument("--world-invariant", action="store_true",
                    help="InvariantDataParallel: the same bits at every world size")
    ap.add_argument("--device", default="cpu", help="where the model and its state live (cuda: docs/gpu.md)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(7)

    session = nonstop.join()
    print(f"setup worker={os.environ['NONSTOP_WORKER_ID']} pid={os.getpid()}", flush=True)
    model = torch.nn.Sequential(torch.nn.Linear(16, 48), torch.nn.Tanh(), torch.nn.Linear(48, 48), torch.nn.Tanh(),
                                torch.nn.Linear(48, 1)).to(args.device)
    if args.shard_group:
        optimizer = nonstop.torch.ShardedOptimizer(model, torch.optim.AdamW, args.shard_group, lr=1e-2,
                                                   weight_decay=0.05)
    elif args.optimizer == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    session.register(model, optimizer, extra={"samples": 0, "setups": 1})
    micro_per_step = args.global_batch // args.micro_batch
    if args.shard_group:
        ddp = nonstop.torch.ShardedDataParallel(model, session, optimizer)
        print(f"worker={session.worker_id} shard={session._core.shard} of {session._core.shard_group} optimizer "
              f"state floats={sum(v.numel() for v in optimizer.state[optimizer.shard_param].values())}", flush=True)
    elif args.world_invariant:
        ddp = nonstop.torch.InvariantDataParallel(model, session, micro_per_step, salvage=not args.no_salvage)
    else:
        ddp = nonstop.torch.DataParallel(model, session, bucket_cap_mb=args.bucket_mb, salvage=not args.no_salvage,
                                         micro_batches=micro_per_step if args.planned else None)
        print(f"worker={session.worker_id} buckets={ddp.num_buckets} ", flush=True)

    def train_step(step):
        gen = torch.Generator().manual_seed(1000 + step)
        x = torch.randn(args.global_batch, 16, generator=gen).to(args.device)
        y = (x[:, :4].sum(1, keepdim=True)).sin()
        begin = micro_per_step * session.rank // session.world_size
        end = micro_per_step * (session.rank + 1) // session.world_size
        ddp.zero_grad()
        total = torch.zeros(1, device=args.device)

        def pause():
            if args.pause_rank in (-1, session.rank) and args.pause_step in (-1, step):
                time.sleep(args.pause_after_micro_batch_ms / 1000)

        def loss_of(mb):
            rows = slice(mb * args.micro_batch, (mb + 1) * args.micro_batch)
            return ((ddp(x[rows]) - y[rows]) ** 2).sum() / args.global_batch

        if args.world_invariant:
            for mb in ddp.plan(step):  # after a fault: what no member holds
                loss = loss_of(mb)
                loss.backward()
                total += loss.detach()
                pause()
            ddp.reduce()
            return update(total)
        if args.planned:  # after a fault: what no member holds, and the blocks' tails lent out
            for mb in ddp.plan(step):
                ddp.backward(loss_of(mb))
                pause()
            return update(ddp.reduce())
        if args.shard_group:  # a rank with no micro-batch reduces zeros (reduce() gathers first)
            for mb in range(begin, end):
                loss = loss_of(mb)
                loss.backward()
                total += loss.detach()
            ddp.reduce()
            if args.clip_norm:
                optimizer.clip_grad_norm_(args.clip_norm)
            return update(total)
        for mb in range(begin, end):
            loss = loss_of(mb)
            if mb + 1 < end:
                with ddp.no_sync():
                    loss.backward()
            else:
                loss.backward()
            total += loss.detach()
        if begin == end:  # more ranks than micro-batches: zeros, in every bucket's sum
            ddp.reduce_without_backward()
        return update(total)

    def update(total):
        session.allreduce(total)  # the loss, for the log (a ring sum: its bits depend on the world)
        if args.clip_norm and not args.shard_group:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_norm)
        optimizer.step()
        session.extra["samples"] += args.global_batch
        if args.throttle_ms:
            time.sleep(args.throttle_ms / 1000)
        if args.hold_for_joins and session.world_size < first_world:
            wait_for_joins(args.hold_for_joins)
        return float(total)

    def wait_for_joins(count):
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                with open(args.journal) as f:
                    joins = sum(1 for line in f if '"event":"join"' in line.replace(" ", ""))
            except FileNotFoundError:
                joins = 0
            if joins >= count:
                return
            time.sleep(0.05)

    first_world = session.world_size
    if args.wait_for_joins and session.resume_step == 0:
        wait_for_joins(args.wait_for_joins)
    session.run(train_step, args.steps)
    print(f"final rank={session.rank} worker={session.worker_id} pid={os.getpid()} generation={session.generation} "
          f"world={session.world_size} params={session.checksum()} state={session._core.state_digest()} "
          f"tokens={session.extra['samples']} setups={session.extra['setups']}", flush=True)


if __name__ == "__main__":
    main()
