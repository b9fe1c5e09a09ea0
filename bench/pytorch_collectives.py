"""Bus bandwidth of torch.distributed's collectives, one rank of a job: run by
bench/pytorch_collectives.sh under torch's launcher over Gloo and under
`nonstop run` over nonstop's group, the same calls and sizes, so the two print
comparable lines (issue 51; docs/python.md, "torch.distributed over nonstop").

Bus bandwidth as nccl-tests defines it, from the time of one call (the median
of --iters after a warm-up): all_reduce moves 2(W-1)/W of its bytes through
each rank, all_gather and all_to_all (W-1)/W of their output.

    python3 bench/pytorch_collectives.py --backend gloo|nonstop [--mib 1,16] [--iters 10]
"""
import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist


def timed(call, iters):
    for _ in range(2):
        call()
    dist.barrier()
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        call()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", choices=["gloo", "nonstop"], required=True)
    ap.add_argument("--mib", default="1,16", help="sizes in MiB, comma-separated (of the all_reduce's buffer, "
                                                  "of the all_gather's and all_to_all's output)")
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.backend == "nonstop":
        import nonstop.torch

        torch.manual_seed(0)
        nonstop.torch.init_process_group(torch.nn.Linear(2, 1))  # a job's state: nothing to train
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    for mib in (float(m) for m in args.mib.split(",")):
        size = int(mib * (1 << 20))
        f32 = torch.ones(size // 4)
        i64 = torch.ones(size // 8, dtype=torch.int64)
        part = torch.ones(size // 4 // world)
        parts = [torch.empty_like(part) for _ in range(world)]
        a2a_in, a2a_out = torch.ones(size // 4 // world * world), torch.empty(size // 4 // world * world)
        cases = [("all_reduce float32", size, 2 * (world - 1) / world, lambda: dist.all_reduce(f32)),
                 ("all_reduce int64", size, 2 * (world - 1) / world, lambda: dist.all_reduce(i64)),
                 ("all_gather float32", part.numel() * 4 * world, (world - 1) / world,
                  lambda: dist.all_gather(parts, part)),
                 ("all_to_all_single float32", a2a_out.numel() * 4, (world - 1) / world,
                  lambda: dist.all_to_all_single(a2a_out, a2a_in))]
        for name, nbytes, factor, call in cases:
            seconds = timed(call, args.iters)
            if rank == 0:
                print("RESULT " + json.dumps({"backend": args.backend, "op": name, "mib": mib, "world": world,
                                              "seconds": seconds, "busbw_gbps": nbytes * factor / seconds / 1e9}),
                      flush=True)
    if args.backend == "nonstop":
        nonstop.torch.destroy_process_group()
    else:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
