"""llama-tiny in plain PyTorch, trained data-parallel under nonstop.

    nonstop run --nproc 4 --spares 1 --inject kill:rank=2,step=30 -- \\
        /usr/bin/python3 examples/pytorch/train_llama.py

The model (RMSNorm, rotary embeddings, SwiGLU, grouped-query attention), the
optimizer (torch.optim.AdamW) and the loss are ordinary PyTorch. What nonstop
adds is marked "nonstop:": the session, the registration of the state, the
DataParallel wrapper whose gradient buckets are summed while backward runs,
the deterministic sampler, and the recovery in the training loop.

The data are the fortunes shipped by Debian (`fortunes`), as byte-level
tokens, prepared on first use. `--steps`, `--global-batch`, `--micro-batch`,
`--lr` and `--threads` change the run; `--grow-at` / `--shrink-at` are not
here: the world changes from outside (`nonstop scale`, a fault with no spare).
"""

import argparse
import math
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import nonstop  # nonstop: `nonstop run` puts the package on PYTHONPATH
import nonstop.data
import nonstop.torch


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary_tables(seq, head_dim, theta):
    inv = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    freqs = torch.outer(torch.arange(seq, dtype=torch.float64), inv)
    emb = torch.cat([freqs, freqs], -1)
    return emb.cos().float(), emb.sin().float()


def rotate(x, cos, sin):
    half = x.size(-1) // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    s = x.size(2)
    return x * cos[:s] + rotated * sin[:s]


class Attention(nn.Module):
    def __init__(self, dim, n_heads, n_kv, seq, theta):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = n_heads, n_kv, dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)
        cos, sin = rotary_tables(seq, self.head_dim, theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = rotate(q, self.cos, self.sin), rotate(k, self.cos, self.sin)
        if self.n_kv != self.n_heads:  # grouped-query attention
            k = k.repeat_interleave(self.n_heads // self.n_kv, dim=1)
            v = v.repeat_interleave(self.n_heads // self.n_kv, dim=1)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
        out = torch.softmax(scores, -1) @ v
        return self.wo(out.transpose(1, 2).contiguous().view(b, s, -1))


class Block(nn.Module):
    def __init__(self, dim, n_heads, n_kv, ffn, seq, theta):
        super().__init__()
        self.attn_norm = RMSNorm(dim)
        self.attn = Attention(dim, n_heads, n_kv, seq, theta)
        self.ffn_norm = RMSNorm(dim)
        self.ffn = SwiGLU(dim, ffn)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.ffn(self.ffn_norm(x))


class SwiGLU(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, h):
        return self.w2(F.silu(self.w1(h)) * self.w3(h))


class Llama(nn.Module):
    def __init__(self, vocab=256, dim=128, n_layers=4, n_heads=4, n_kv=2, ffn=352, seq=64, theta=10000.0):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = []
        for i in range(n_layers):  # named as nonstop-train names them: each loads the other's checkpoints
            self.blocks.append(Block(dim, n_heads, n_kv, ffn, seq, theta))
            self.add_module(f"block{i}", self.blocks[-1])
        self.norm = RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def learning_rate(step, steps, lr, min_lr, warmup):
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * progress))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--global-batch", type=int, default=32, help="samples per step, whatever the world size")
    ap.add_argument("--micro-batch", type=int, default=1,
                    help="samples per micro-batch (a fault keeps whole micro-batches: 1 keeps the most, as nonstop-train's "
                         "llama-tiny)")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads per worker")
    ap.add_argument("--data", default="data/fortunes", help="token shards (prepared from --prepare-from if missing)")
    ap.add_argument("--prepare-from", default="/usr/share/games/fortunes")
    ap.add_argument("--bucket-mb", type=float, default=1.0, help="gradient bucket size")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--world-invariant", action="store_true",
                    help="nonstop.torch.InvariantDataParallel: the same bits at every world size, and after a fault "
                         "only the micro-batches no worker holds are computed again, over every worker")
    ap.add_argument("--checkpoint-dir", default="", help="write durable checkpoints here (nonstop-train's format)")
    ap.add_argument("--checkpoint-every", type=int, default=50, help="steps between checkpoints")
    ap.add_argument("--resume-from", default="",
                    help="resume from the newest valid checkpoint in this directory (this script's or nonstop-train's)")
    ap.add_argument("--no-salvage", action="store_true",
                    help="after a fault, compute the step in flight again whole, instead of keeping the micro-batches "
                         "each worker had completed")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)  # every worker builds the same initial model

    session = nonstop.join()  # nonstop: this worker's membership, from nonstop run's environment

    if not os.path.exists(os.path.join(args.data, "manifest.json")):
        nonstop.data.prepare([args.prepare_from], args.data, strip_fortune_separators=True)
    data = nonstop.data.Dataset(args.data, args.seq_len)
    sampler = nonstop.data.Sampler(data.num_samples, args.global_batch, args.micro_batch, seed=args.seed)

    model = Llama(seq=args.seq_len)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    # nonstop: what must survive a fault. A spare waits here until it takes a
    # rank, then copies this state from the healthy workers.
    session.register(model, optimizer, extra={"tokens_seen": 0}, resume_from=args.resume_from or None)
    if args.world_invariant:
        ddp = nonstop.torch.InvariantDataParallel(model, session, sampler.micro_batches_per_step,
                                                  salvage=not args.no_salvage)
    else:
        # nonstop: planned steps, so a fault keeps the micro-batches every survivor had completed
        ddp = nonstop.torch.DataParallel(model, session, bucket_cap_mb=args.bucket_mb, salvage=not args.no_salvage,
                                         micro_batches=sampler.micro_batches_per_step)
    session.on_membership_change(lambda c: session.rank == 0 and print(
        f"{'resized' if c.reason.startswith('resize') else 'recovered'}: generation {c.generation}, "
        f"world {c.old_world} → {c.new_world}, resuming at step {c.resume_step}", flush=True))
    tokens_per_step = args.global_batch * args.seq_len
    if session.rank == 0:
        n = sum(p.numel() for p in model.parameters())
        print(f"llama-tiny (PyTorch {torch.__version__}): {n / 1e6:.2f} M parameters, {session.world_size} workers, "
              f"{args.steps} steps of {args.global_batch} samples, {data.num_samples} samples of data", flush=True)
        if session.resume_step:
            print(f"starting at step {session.resume_step}, parameter checksum {session.checksum()}", flush=True)

    def train_step(step):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args.steps, args.lr, args.lr / 10, 20)
        # nonstop: this rank's micro-batches (its block; after a fault, what no worker holds a sum of)
        local = torch.zeros(1)
        for mb in ddp.plan(step):
            batch = data.batch(sampler.samples(step, mb))
            inputs, targets = batch[:, :-1], batch[:, 1:]
            # Summed over the tokens and divided by the global batch's: the
            # gradient sums to the same whatever the world size.
            loss = F.cross_entropy(ddp(inputs).reshape(-1, 256), targets.reshape(-1), reduction="sum") / tokens_per_step
            if args.world_invariant:
                loss.backward()  # folded into the fixed tree
                local += loss.detach()
            else:
                ddp.backward(loss)  # nonstop: the last one sums the buckets across workers while it runs
        if args.world_invariant:
            ddp.reduce()  # the tree's sum over every worker; may raise Aborted
        else:
            local = ddp.reduce()  # nonstop: the sum over every worker; this rank's loss; may raise Aborted
        session.allreduce(local)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        session.extra["tokens_seen"] += tokens_per_step
        return float(local)

    step = session.resume_step
    start = time.monotonic()
    while True:
        try:
            while step < args.steps:
                t0 = time.monotonic()
                loss = train_step(step)
                secs = time.monotonic() - t0
                session.report_step(step, loss, step_seconds=secs, tokens=tokens_per_step, total_steps=args.steps)
                if args.checkpoint_dir and ((step + 1) % args.checkpoint_every == 0 or step + 1 == args.steps):
                    session.save_checkpoint(args.checkpoint_dir)  # nonstop: every rank calls, rank 0 writes
                if session.rank == 0 and (step % args.log_every == 0 or step + 1 == args.steps):
                    print(f"step {step:>5}/{args.steps} | loss {loss:.4f} | {tokens_per_step / secs:>6.0f} tok/s | "
                          f"{secs:.3f} s/step | world {session.world_size}", flush=True)
                step += 1
            session.finish(args.steps - 1)
            session.wait_checkpoint()
            break
        except nonstop.Aborted:  # nonstop: a peer failed or the world changes; nothing is restarted
            step = session.recover()
    if session.rank == 0:
        print(f"done: {args.steps} steps in {time.monotonic() - start:.1f} s; parameter checksum {session.checksum()}; "
              f"{session.extra['tokens_seen']} tokens seen", flush=True)


if __name__ == "__main__":
    main()
