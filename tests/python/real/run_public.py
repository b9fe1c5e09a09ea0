"""Runs a public script as it is (runpy), under a test's eyes:

- torch is seeded first, so that every rank, and the spare that replaces one,
  makes the same dataset and model: the DDP tutorial's MyTrainDataset draws
  torch.rand unseeded, so its ranks (and any two runs) would train on
  different data and no run could be compared with another;
- the tutorial's loss, `F.cross_entropy` over a model with one output, has
  a gradient of exactly zero (one class: its log-softmax is 0 whatever the
  input), so its weights never move and a bitwise comparison would prove
  nothing: `--mse` swaps in `F.mse_loss`, and the weights train;
- as the script calls `destroy_process_group()` (nonstop.torch's), each rank
  prints `[rank R] final params CRC` of the registered model's parameters
  and buffers.

    python3 run_public.py [--mse] SCRIPT ARGS...
"""
import os
import runpy
import sys
import zlib

import torch
import torch.nn.functional as F

import nonstop.distributed as nd
import nonstop.torch

if sys.argv[1] == "--mse":
    F.cross_entropy = F.mse_loss
    del sys.argv[1]
script = os.path.abspath(sys.argv[1])
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(script))
torch.manual_seed(0)
torch.set_num_threads(1)
_destroy = nonstop.torch.destroy_process_group


def destroy_process_group():
    state = list(nd._model.parameters()) + list(nd._model.buffers())
    flat = torch.cat([t.detach().reshape(-1).to(torch.float64) for t in state])
    print(f"[rank {nd._session.rank}] final params {zlib.crc32(flat.numpy().tobytes()):08x}", flush=True)
    _destroy()


nonstop.torch.destroy_process_group = destroy_process_group
runpy.run_path(script, run_name="__main__")
