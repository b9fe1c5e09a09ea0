"""The smallest change that puts a PyTorch training script under nonstop: the
lines marked "+" are new, the one marked "~" changed. Run it with
    nonstop run --nproc 2 --spares 1 --inject kill:rank=1,step=60 -- /usr/bin/python3 examples/pytorch/minimal.py
"""
import torch
import nonstop, nonstop.torch                                     # +

torch.manual_seed(0)
torch.set_num_threads(1)
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
session = nonstop.join().register(model, optimizer)               # + state that survives faults
ddp = nonstop.torch.DataParallel(model, session)                  # + gradients summed over workers
STEPS, BATCH = 100, 64


def train_step(step):
    g = torch.Generator().manual_seed(step)                       # the step's global batch
    x = torch.randn(BATCH, 16, generator=g)
    y = x.sum(1, keepdim=True).sin()
    lo = BATCH * session.rank // session.world_size               # + this worker's share
    hi = BATCH * (session.rank + 1) // session.world_size         # +
    optimizer.zero_grad()
    loss = ((ddp(x[lo:hi]) - y[lo:hi]) ** 2).sum() / BATCH        # ~ ddp, and a sum over the global batch
    loss.backward()
    optimizer.step()
    return loss.item()


session.run(train_step, STEPS)                                    # ~ was: for step in range(STEPS): train_step(step)
if session.rank == 0:
    print(f"done: parameter checksum {session.checksum()}")
