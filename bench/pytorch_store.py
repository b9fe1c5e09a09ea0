"""Latency of torch.distributed's default store, one rank of a job: run by
bench/pytorch_store.sh under torch's launcher (the store is its TCPStore) and
under `nonstop run` (the job's store, docs/store.md), the same calls, so the two
print comparable lines.

Each rank times --ops calls of each kind on keys of its own, all ranks at once
(the median of one call, after a warm-up): set, get, add, wait for a key that is set, and a meeting
(rank 0 sets a key each round, the others wait for it with get). Writes under
nonstop are journaled (fdatasync) before they are answered; TCPStore keeps
them in its server's memory.

    python3 bench/pytorch_store.py --backend gloo|nonstop [--ops 200]
"""
import argparse
import json
import statistics
import time

import torch.distributed as dist


def timed(calls):
    samples = []
    for call in calls:
        t0 = time.perf_counter()
        call()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples[len(samples) // 10:])  # the first tenth warms up


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", choices=["gloo", "nonstop"], required=True)
    ap.add_argument("--ops", type=int, default=200)
    args = ap.parse_args()
    if args.backend == "nonstop":
        import nonstop.torch
        nonstop.torch.init_process_group(backend="nonstop")
    else:
        dist.init_process_group("gloo")
    store = dist.distributed_c10d._get_default_store()
    rank, n = dist.get_rank(), args.ops
    value = b"x" * 64
    results = {
        "set": timed([lambda i=i: store.set(f"bench/{rank}/{i}", value) for i in range(n)]),
        "get": timed([lambda i=i: store.get(f"bench/{rank}/{i}") for i in range(n)]),
        "add": timed([lambda: store.add(f"bench/{rank}/counter", 1) for _ in range(n)]),
        "wait (set key)": timed([lambda i=i: store.wait([f"bench/{rank}/{i}"]) for i in range(n)]),
    }
    dist.barrier()
    meet = []
    for i in range(n // 4):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            store.set(f"bench/meet/{i}", value)
        else:
            store.get(f"bench/meet/{i}")
        meet.append(time.perf_counter() - t0)
    results["meet (set, others get)"] = statistics.median(meet)
    for op, seconds in results.items():
        print("RESULT " + json.dumps({"backend": args.backend, "rank": rank, "op": op, "us": seconds * 1e6}),
              flush=True)
    dist.barrier()
    if args.backend == "nonstop":
        nonstop.torch.destroy_process_group()
    else:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
