"""The baseline of bench/pytorch.sh: examples/pytorch/train_llama.py's model,
data, batch and optimizer under torch DDP with Gloo, launched by torch's own
elastic launcher (torchrun), and recovering the way such a job does: from a
checkpoint, after the launcher restarts every worker.

    python3 -m torch.distributed.run --nproc_per_node 4 --max_restarts 1 \\
        bench/pytorch_ddp_llama.py --steps 60 --checkpoint-dir CK --checkpoint-every 20 --kill-rank 2 --kill-step 30

Rank 0 writes a checkpoint (model, optimizer, step) every --checkpoint-every
steps. --kill-rank/--kill-step: that rank kills itself (SIGKILL) at that step
of the first attempt, --kill-at where in it: as the step starts, half-way
through (a timer at half the previous step's length) or at the reduction (as
the last micro-batch's backward readies its first gradient, when DDP starts
reducing); torchrun then restarts all workers, which load the
newest checkpoint and redo the steps after it. At the end rank 0 prints one
JSON line: the step times, the restarts and the wall time of each attempt.

Under `nonstop run` (bench/pytorch.sh's (d)) the same script runs stock
DistributedDataParallel over nonstop's torch.distributed group
(nonstop.torch.init_process_group, once the model and the optimizer exist),
and reports each step to the controller.
"""

import argparse
import json
import os
import pathlib
import signal
import statistics
import sys
import threading
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples" / "pytorch"))
from train_llama import Llama, learning_rate  # noqa: E402  the same model and schedule

import nonstop.data  # noqa: E402  the same data and sampler (no session: only the data half)
import nonstop.torch  # noqa: E402  under nonstop run: torch.distributed over nonstop

started = time.monotonic()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--global-batch", type=int, default=32)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--data", default="data/fortunes")
    ap.add_argument("--checkpoint-dir", default="")
    ap.add_argument("--checkpoint-every", type=int, default=20)
    ap.add_argument("--kill-rank", type=int, default=-1)
    ap.add_argument("--kill-step", type=int, default=-1)
    ap.add_argument("--kill-at", choices=("start", "middle", "reduction"), default="start")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    under_nonstop = bool(os.environ.get("NONSTOP_CONTROLLER"))
    if not under_nonstop:
        dist.init_process_group("gloo")
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    data = nonstop.data.Dataset(args.data, args.seq_len)
    sampler = nonstop.data.Sampler(data.num_samples, args.global_batch, args.micro_batch, seed=args.seed)
    model = Llama(seq=args.seq_len)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    start = 0
    session = None
    if under_nonstop:
        session = nonstop.torch.init_process_group(model, optimizer)
        start = session.resume_step
    rank, world = dist.get_rank(), dist.get_world_size()
    ckpt = pathlib.Path(args.checkpoint_dir) / "last.pt" if args.checkpoint_dir else None
    if ckpt and ckpt.exists():
        state = torch.load(ckpt)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"] + 1
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    tokens_per_step = args.global_batch * args.seq_len
    step_seconds = []
    first_step_at = None
    for step in range(start, args.steps):
        t0 = time.monotonic()
        kill_now = attempt == 0 and rank == args.kill_rank and step == args.kill_step
        if kill_now and args.kill_at == "start":
            os.kill(os.getpid(), signal.SIGKILL)
        if kill_now and args.kill_at == "middle":
            threading.Timer(step_seconds[-1] / 2, os.kill, (os.getpid(), signal.SIGKILL)).start()
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args.steps, args.lr, args.lr / 10, 20)
        mine = sampler.micro_batches(rank, world)
        optimizer.zero_grad()
        for i, mb in enumerate(mine):
            batch = data.batch(sampler.samples(step, mb))
            # DDP averages over the world: scale back to a sum over the global batch.
            loss = F.cross_entropy(ddp(batch[:, :-1]).reshape(-1, 256), batch[:, 1:].reshape(-1),
                                   reduction="sum") / tokens_per_step * world
            if kill_now and args.kill_at == "reduction" and i + 1 == len(mine):
                head = list(model.parameters())[-1]  # its gradient is the first one ready
                head.register_hook(lambda g: os.kill(os.getpid(), signal.SIGKILL))
            if i + 1 < len(mine):
                with ddp.no_sync():
                    loss.backward()
            else:
                loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if ckpt and rank == 0 and (step + 1) % args.checkpoint_every == 0:
            ckpt.parent.mkdir(parents=True, exist_ok=True)
            tmp = ckpt.with_suffix(".tmp")
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, tmp)
            os.replace(tmp, ckpt)
        step_seconds.append(time.monotonic() - t0)
        if session is not None:
            session.report_step(step, loss.item(), step_seconds=step_seconds[-1], tokens=tokens_per_step,
                                total_steps=args.steps)
        if first_step_at is None:
            first_step_at = time.monotonic() - started
    dist.barrier()
    if rank == 0:
        steady = step_seconds[1:] or step_seconds
        print(json.dumps({"attempt": attempt, "start_step": start, "steps_run": len(step_seconds),
                          "median_step_s": statistics.median(steady), "tokens_per_s": tokens_per_step / statistics.median(steady),
                          "setup_s": first_step_at - step_seconds[0] if first_step_at else None,
                          "wall_s": time.monotonic() - started}), flush=True)
    if session is not None:
        nonstop.torch.destroy_process_group()
    else:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
