"""multigpu_torchrun.py ported to nonstop as docs/python.md's porting guide
says ("Porting a DDP script"): beyond the imports, the training step is
decorated so that a fault re-runs it after the recovery. `ddp_setup()` joins
the job (nonstop.torch.init_process_group(backend=...)), and DDP registers the
model, its optimizer and the loader as the state that survives a fault.
It runs under nonstop's launcher:

    nonstop run --nproc 4 --spares 1 --inject kill:rank=2,step=30 -- \
        /usr/bin/python3 multigpu_nonstop.py 3 1 --batch_size 8
"""
import argparse
import os
import zlib

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset
from nonstop.data import DataLoader, DistributedSampler
from nonstop.torch import DistributedDataParallel as DDP
from nonstop.torch import init_process_group, destroy_process_group
import nonstop.torch


class MyTrainDataset(Dataset):
    """Random regression data, the same in every process; items are (index, source, target)."""

    def __init__(self, size):
        g = torch.Generator().manual_seed(1234)
        self.sources = torch.rand(size, 20, generator=g)
        self.targets = self.sources.sum(1, keepdim=True).sin()

    def __len__(self):
        return len(self.sources)

    def __getitem__(self, index):
        return index, self.sources[index], self.targets[index]


def ddp_setup():
    init_process_group(backend="gloo")


class Trainer:
    def __init__(self, model, train_data, optimizer, save_every):
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.global_rank = int(os.environ["RANK"])
        self.model = DDP(model)
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.epoch = 0

    @nonstop.torch.step
    def _run_batch(self, ids, source, targets):
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.mse_loss(output, targets)
        loss.backward()
        self.optimizer.step()
        print(f"[rank {self.global_rank}] epoch {self.epoch} samples {ids.tolist()}", flush=True)

    def _run_epoch(self, epoch):
        self.epoch = epoch
        self.train_data.sampler.set_epoch(epoch)
        for ids, source, targets in self.train_data:
            self._run_batch(ids, source, targets)

    def train(self, max_epochs):
        for epoch in range(max_epochs):
            self._run_epoch(epoch)
            if self.global_rank == 0 and epoch % self.save_every == 0:
                print(f"Epoch {epoch} | Training done", flush=True)


def load_train_objs():
    torch.manual_seed(0)
    torch.set_num_threads(1)
    train_set = MyTrainDataset(1024)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    return train_set, model, optimizer


def prepare_dataloader(dataset, batch_size):
    return DataLoader(dataset, batch_size=batch_size, pin_memory=False, shuffle=False,
                      sampler=DistributedSampler(dataset))


def checksum(model):
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return f"{zlib.crc32(flat.numpy().tobytes()):08x} norm {flat.norm().item():.9g}"


def main(save_every, total_epochs, batch_size):
    ddp_setup()
    dataset, model, optimizer = load_train_objs()
    train_data = prepare_dataloader(dataset, batch_size)
    trainer = Trainer(model, train_data, optimizer, save_every)
    trainer.train(total_epochs)
    print(f"[rank {trainer.global_rank}] final params {checksum(model)}", flush=True)
    destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="simple distributed training job")
    parser.add_argument("total_epochs", type=int, help="Total epochs to train the model")
    parser.add_argument("save_every", type=int, help="How often to save a snapshot")
    parser.add_argument("--batch_size", default=8, type=int, help="Input batch size on each device (default: 8)")
    args = parser.parse_args()
    main(args.save_every, args.total_epochs, args.batch_size)
