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
                     the forward never uses; static_graph, gradient_as_bucket_view).

It prints `[rank R] final params CRC` at the end.
"""
import argparse
import time
import zlib

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

import nonstop.torch
from nonstop.data import DataLoader, DistributedSampler
from nonstop.torch import DistributedDataParallel as DDP
from nonstop.torch import destroy_process_group


class Samples(Dataset):
    def __init__(self, size):
        g = torch.Generator().manual_seed(1234)
        self.sources = torch.rand(size, 20, generator=g)
        self.targets = self.sources.sum(1, keepdim=True).sin()

    def __len__(self):
        return len(self.sources)

    def __getitem__(self, index):
        return self.sources[index], self.targets[index]


class Net(torch.nn.Module):
    def __init__(self, unused):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
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
    args = ap.parse_args()
    options = {name: True for name in args.ddp_options.split(",") if name}
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = Net(unused=bool(options.get("find_unused_parameters")))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    data = DataLoader(Samples(args.samples), batch_size=args.batch_size, shuffle=False,
                      sampler=DistributedSampler(Samples(args.samples)))
    session = nonstop.torch.init_process_group(model, optimizer, data)
    ddp = DDP(model, **options)

    @nonstop.torch.step
    def run_batch(source, targets):
        rank = session.rank
        if session._step_in_flight == args.raise_at_step and (
                args.raise_ranks == "all" or str(rank) in args.raise_ranks.split(",")):
            raise ValueError(f"sample of step {args.raise_at_step} on rank {rank} is malformed")
        optimizer.zero_grad()
        loss = F.mse_loss(ddp(source), targets)
        loss.backward()
        optimizer.step()

    for epoch in range(args.epochs):
        data.sampler.set_epoch(epoch)
        for source, targets in data:
            run_batch(source, targets)
        if session.rank == 0 and args.save_seconds > 0:
            with session.busy("snapshot") if args.busy else _nothing():
                print(f"[rank 0] saving the snapshot of epoch {epoch} for {args.save_seconds} s", flush=True)
                end = time.monotonic() + args.save_seconds
                while time.monotonic() < end:
                    if not args.spin:
                        time.sleep(0.05)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    print(f"[rank {session.rank}] final params {zlib.crc32(flat.numpy().tobytes()):08x}", flush=True)
    destroy_process_group()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    main()
