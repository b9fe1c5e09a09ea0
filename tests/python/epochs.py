"""A script shaped like PyTorch's DDP tutorial (epochs over a DistributedSampler,
DDP, rank 0 saving a snapshot after each epoch), ported as docs/python.md says,
with the two things real scripts do that the issue on real scripts names:

  --save-seconds S   rank 0 spends S seconds "saving its snapshot" after each epoch
                     (a large model's torch.save, an evaluation on rank 0) while the
                     others go on to the next epoch's first all-reduce and wait;
  --spin             ... spinning on a core instead of sleeping;
  --busy             ... inside `with session.busy("snapshot")`;
  --raise-at-step N  raise ValueError at step N, on --raise-ranks (a bug in the
                     script, or in one rank's data), whichever worker holds the rank;
  --ddp-options A,B  DDP's keyword flags set True (find_unused_parameters adds a layer
                     the forward never uses; static_graph, gradient_as_bucket_view);
  --norm batch|sync  a BatchNorm1d layer in the model, whose running statistics are
                     module buffers (--no-broadcast-buffers: DDP's broadcast_buffers=False),
                     or a normalization with SyncBatchNorm's collectives (SyncNorm);
  --comm-hook H      DDP's communication hook: torch's allreduce, fp16_compress or PowerSGD hook;
  --no-set-epoch     never call set_epoch (every epoch in epoch 0's order, as torch's);
  --shuffle          the sampler shuffles;
  --collective K     each step also runs one collective of kind K (all_gather, broadcast,
                     all_to_all, send_recv, reduce_scatter, subgroup_all_reduce) on values of
                     the rank's batch, whose result scales the loss;
  --die-in-collective S  rank 2 kills itself (SIGKILL) as it enters that collective at step S,
                     once (--die-marker names the file that says it did): its peers are inside;
  --join-first       nanoGPT's test for a distributed run (`RANK` other than -1, else it trains
                     alone: exit 3 here), then init_process_group(backend="gloo", rank=RANK,
                     world_size=WORLD_SIZE) as torch's form, before the model exists; DDP
                     registers the state;
  --eval N           a second nonstop.data.DataLoader over N samples of another set, made after
                     the training loader (an evaluation loader): after each epoch every rank
                     evaluates its share without gradients and the sums are all-reduced,
                     printed as `[rank R] eval epoch E: N samples, loss L`;
  --count-samples    a per-rank counter of the samples this rank trained on (plus its rank
                     at each step), registered
                     with per_rank= (its value differs by rank: the replica check must
                     not compare it).

It prints `[rank R] final params CRC` and `[rank R] final buffers CRC` at the end.
"""
import argparse
import os
import signal
import time
import zlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import Dataset

import nonstop.torch
from nonstop.data import DataLoader, DistributedSampler
from nonstop.torch import DistributedDataParallel as DDP
from nonstop.torch import destroy_process_group


class Samples(Dataset):
    def __init__(self, size, seed=1234):
        g = torch.Generator().manual_seed(seed)
        self.sources = torch.rand(size, 20, generator=g)
        self.targets = self.sources.sum(1, keepdim=True).sin()

    def __len__(self):
        return len(self.sources)

    def __getitem__(self, index):
        return self.sources[index], self.targets[index]


class _SyncNorm(torch.autograd.Function):
    """SyncBatchNorm's collectives on the CPU (Debian's torch 1.13 takes SyncBatchNorm on GPU
    modules only): the forward all-gathers each rank's (sum, sum of squares, count), the backward
    all-reduces the gradient's two sums inside the backward pass, as torch's
    nn/modules/_functions.py SyncBatchNorm does (with async_op=False)."""

    @staticmethod
    def forward(ctx, x):
        local = torch.cat([x.sum(0), (x * x).sum(0), torch.tensor([float(len(x))])])
        gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, local)
        total = torch.stack(gathered).sum(0)
        c, n = x.shape[1], total[-1]
        mean = total[:c] / n
        invstd = (total[c:2 * c] / n - mean * mean + 1e-5).rsqrt()
        ctx.save_for_backward(x, mean, invstd)
        ctx.n = n
        return (x - mean) * invstd

    @staticmethod
    def backward(ctx, grad):
        x, mean, invstd = ctx.saved_tensors
        xmu, c = x - mean, x.shape[1]
        combined = torch.cat([grad.sum(0), (grad * xmu).sum(0)])
        dist.all_reduce(combined, dist.ReduceOp.SUM, async_op=False)
        sum_dy, sum_dy_xmu = combined[:c], combined[c:]
        return invstd * (grad - sum_dy / ctx.n - xmu * invstd * invstd * sum_dy_xmu / ctx.n)


class SyncNorm(torch.nn.Module):
    def forward(self, x):
        return _SyncNorm.apply(x) if self.training else x


class Net(torch.nn.Module):
    def __init__(self, unused, norm=""):
        super().__init__()
        layers = [torch.nn.Linear(20, 32)] + ([torch.nn.BatchNorm1d(32)] if norm == "batch" else
                                              [SyncNorm()] if norm == "sync" else [])
        self.body = torch.nn.Sequential(*layers, torch.nn.Tanh(), torch.nn.Linear(32, 1))
        if unused:
            self.unused = torch.nn.Linear(4, 4)  # registered, never in the forward

    def forward(self, x):
        return self.body(x)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--samples", type=int, default=96)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--save-seconds", type=float, default=0.0)
    ap.add_argument("--spin", action="store_true")
    ap.add_argument("--busy", action="store_true")
    ap.add_argument("--raise-at-step", type=int, default=-1)
    ap.add_argument("--raise-ranks", default="1", help="comma-separated ranks, or 'all'")
    ap.add_argument("--ddp-options", default="")
    ap.add_argument("--norm", choices=["", "batch", "sync"], default="")
    ap.add_argument("--no-broadcast-buffers", action="store_true")
    ap.add_argument("--comm-hook", choices=["", "allreduce", "fp16", "powersgd"], default="")
    ap.add_argument("--count-samples", action="store_true")
    ap.add_argument("--join-first", action="store_true")
    ap.add_argument("--eval", type=int, default=0)
    ap.add_argument("--no-set-epoch", action="store_true", help="never call set_epoch (torch: epoch 0's order)")
    ap.add_argument("--shuffle", action="store_true")
    ap.add_argument("--collective", choices=["", *_COLLECTIVES], default="")
    ap.add_argument("--die-in-collective", type=int, default=-1)
    ap.add_argument("--die-marker", default="died-in-collective")
    args = ap.parse_args()
    if args.join_first:
        if int(os.environ.get("RANK", -1)) == -1:  # nanoGPT: `ddp = ... != -1`, else one process alone
            print("RANK is -1: not a distributed run, training alone", flush=True)
            raise SystemExit(3)
        session = nonstop.torch.init_process_group(backend="gloo", rank=int(os.environ["RANK"]),
                                                   world_size=int(os.environ["WORLD_SIZE"]))
    options = {name: True for name in args.ddp_options.split(",") if name}
    if args.no_broadcast_buffers:
        options["broadcast_buffers"] = False
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = Net(unused=bool(options.get("find_unused_parameters")), norm=args.norm)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    data = DataLoader(Samples(args.samples), batch_size=args.batch_size, shuffle=False,
                      sampler=DistributedSampler(Samples(args.samples), shuffle=args.shuffle))
    held_out = Samples(args.eval, seed=4321) if args.eval else None
    evaluation = DataLoader(held_out, batch_size=4, sampler=DistributedSampler(held_out, shuffle=False)) \
        if args.eval else None
    if not args.join_first:
        session = nonstop.torch.init_process_group(model, optimizer, data,
                                                   per_rank={"samples": 0} if args.count_samples else None)
    ddp = DDP(model, **options)
    if args.comm_hook == "allreduce":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    elif args.comm_hook == "fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif args.comm_hook == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
        state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2)
        ddp.register_comm_hook(state, powersgd.powerSGD_hook)

    @nonstop.torch.step
    def run_batch(source, targets):
        rank = session.rank
        if session._step_in_flight == args.raise_at_step and (
                args.raise_ranks == "all" or str(rank) in args.raise_ranks.split(",")):
            raise ValueError(f"sample of step {args.raise_at_step} on rank {rank} is malformed")
        optimizer.zero_grad()
        loss = F.mse_loss(ddp(source), targets)
        if args.collective:
            if rank == 2 and session._step_in_flight == args.die_in_collective and not os.path.exists(args.die_marker):
                open(args.die_marker, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)  # its peers are in the collective, waiting for it
            loss = loss * (1 + 1e-3 * _COLLECTIVES[args.collective](source[:, :4].sum(0), session).sum())
        loss.backward()
        optimizer.step()
        if args.count_samples:  # and the rank, so that the value differs by rank
            session.per_rank["samples"] += len(source) + session.rank

    for epoch in range(args.epochs):
        if not args.no_set_epoch:
            data.sampler.set_epoch(epoch)
        first, done = None, data._steps_done()
        for source, targets in data:
            run_batch(source, targets)
            first = first or list(data.indices)
        if data._steps_done() > done:  # a spare's replay of a finished epoch trains no batch
            print(f"[rank {session.rank}] epoch {epoch} began with samples {first}", flush=True)
        if evaluation is not None:
            totals, batches = torch.zeros(2, dtype=torch.float64), 0
            with torch.no_grad():
                for source, targets in evaluation:  # nothing while a spare replays a finished epoch
                    totals += torch.tensor([len(source), F.mse_loss(ddp(source), targets, reduction="sum").item()],
                                           dtype=torch.float64)
                    batches += 1
            if data.replayed:
                print(f"[rank {session.rank}] eval epoch {epoch} replayed: {batches} batches", flush=True)
        if evaluation is not None and not data.replayed:  # its peers are past that epoch
            dist.all_reduce(totals)
            print(f"[rank {session.rank}] eval epoch {epoch}: {int(totals[0])} samples, loss {totals[1]:.6f}", flush=True)
        if session.rank == 0 and args.save_seconds > 0:
            with session.busy("snapshot") if args.busy else _nothing():
                print(f"[rank 0] saving the snapshot of epoch {epoch} for {args.save_seconds} s", flush=True)
                end = time.monotonic() + args.save_seconds
                while time.monotonic() < end:
                    if not args.spin:
                        time.sleep(0.05)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    print(f"[rank {session.rank}] final params {zlib.crc32(flat.numpy().tobytes()):08x}", flush=True)
    buffers = b"".join(b.detach().numpy().tobytes() for b in model.buffers())
    print(f"[rank {session.rank}] final buffers {zlib.crc32(buffers):08x}", flush=True)
    if args.count_samples:
        print(f"[rank {session.rank}] trained on {session.per_rank['samples']} samples", flush=True)
    destroy_process_group()


def _all_gather(x, session):
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x)
    return torch.stack(parts).sum(0)


def _broadcast(x, session):
    x = x.clone()
    dist.broadcast(x, src=dist.get_world_size() - 1)
    return x


def _all_to_all(x, session):
    world = dist.get_world_size()
    out = torch.empty(world * len(x))
    dist.all_to_all_single(out, torch.cat([x * (j + 1) for j in range(world)]))
    return out.view(world, -1).sum(0)


def _send_recv(x, session):  # a ring: every rank sends first
    rank, world = dist.get_rank(), dist.get_world_size()
    got = torch.empty_like(x)
    for work in [dist.isend(x.clone(), (rank + 1) % world), dist.irecv(got, (rank - 1) % world)]:
        work.wait()
    return got


def _reduce_scatter(x, session):
    world = dist.get_world_size()
    out = torch.empty_like(x)
    dist.reduce_scatter(out, [x * (j + 1) for j in range(world)])
    return out


_subgroup = {}


def _subgroup_all_reduce(x, session):  # ranks 1 and 2, made again after each change of membership
    if _subgroup.get("generation") != session.generation:
        _subgroup.update(generation=session.generation, group=dist.new_group([1, 2]))
    x = x.clone()
    if dist.get_rank() in (1, 2):
        dist.all_reduce(x, group=_subgroup["group"])
    return x


_COLLECTIVES = {"all_gather": _all_gather, "broadcast": _broadcast, "all_to_all": _all_to_all,
                "send_recv": _send_recv, "reduce_scatter": _reduce_scatter,
                "subgroup_all_reduce": _subgroup_all_reduce}


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    main()
