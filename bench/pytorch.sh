#!/usr/bin/env bash
# PyTorch from Python, side by side in one run (issue 11, docs/python.md): the
# llama-tiny of examples/pytorch/train_llama.py, the same data, global batch
# and steps, 4 workers, under
#   (a) torch DDP with Gloo, launched by torchrun (bench/pytorch_ddp_llama.py),
#       recovering by restart from a checkpoint written every 20 steps;
#   (b) nonstop from Python (train_llama.py: DataParallel, overlapped buckets),
#       with a spare;
#   (c) nonstop's C++ trainer (nonstop-train), with and without overlapped
#       reduction;
#   (d) (a)'s script itself, stock DistributedDataParallel over nonstop's
#       torch.distributed group (nonstop.torch.init_process_group);
#   (e) (b) in the world-invariant mode (train_llama.py --world-invariant:
#       InvariantDataParallel, a fixed reduction tree over the micro-batches).
# Each fault-free run gives its median step time and tokens/s. Then (a), (b) and (e)
# run again with rank 2 killed in step 30, once at each of three points: as the
# step starts, half-way through it, and at its reduction (as its backward starts
# reducing). The fault's cost is the faulted run's wall time minus the
# fault-free one's, and for (b) also the time lost the recovery report measures
# (docs/recovery.md "Time lost"), in ms and in normal steps; every run's
# checksum is printed beside it.
#
#   bash bench/pytorch.sh [--steps N] [--micro-batch K]
#       N: default 60, the kill is at step 30; K: samples per micro-batch in
#       every run, default 1, as nonstop-train's llama-tiny and train_llama.py
#       (the global batch is 32, so 32/K micro-batches a step, 8/K a rank:
#       salvage keeps whole ones, so K sets its grain)
#
# Needs ./build (scripts/build.sh) and Debian's python3-torch. Everything runs
# on 127.0.0.1; the run directory is removed on exit. About 13 min at 40 steps on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
steps=60
micro=1
while [ $# -gt 0 ]; do
  case "$1" in
    --steps) steps="$2"; shift 2 ;;
    --micro-batch) micro="$2"; shift 2 ;;
    *) echo "usage: $0 [--steps N] [--micro-batch K]" >&2; exit 2 ;;
  esac
done
case "$micro" in 1|2|4|8) ;; *) echo "pytorch: --micro-batch must divide a rank's 8 samples: 1, 2, 4 or 8" >&2; exit 2 ;; esac
[ "$steps" -ge 40 ] || { echo "pytorch: --steps must be at least 40 (the kill is at step 30)" >&2; exit 2; }
root=$PWD
bin=$root/build/bin
py=/usr/bin/python3
for need in "$bin/nonstop" "$bin/nonstop-train" "$py" "$root/build/python/nonstop/__init__.py"; do
  [ -e "$need" ] || { echo "pytorch: $need is missing (run scripts/setup.sh and scripts/build.sh)" >&2; exit 2; }
done
"$py" -c "import torch.distributed" 2>/dev/null || { echo "pytorch: $py has no torch (apt-get install python3-torch)" >&2; exit 2; }
export PYTHONPATH="$root/build/python${PYTHONPATH:+:$PYTHONPATH}"
dir=$(mktemp -d /tmp/nonstop-pytorch-XXXXXX)
trap 'rm -rf "$dir"' EXIT
ln -s "$root/data" "$dir/data"
# The data, prepared once before anything is timed.
"$py" -c "import nonstop.data as d; d.prepare(['/usr/share/games/fortunes'], '$root/data/fortunes', strip_fortune_separators=True)"

now() { date +%s.%N; }
results=$dir/results.jsonl

# ddp NAME [extra args]: one torchrun job; records its wall time and rank 0's JSON lines.
# (--redirects 1 --tee 1: torch 1.13's torchrun cannot parse "0" under Python 3.11, whose IntFlag
# no longer lists the zero member; stdout goes to its log files and, teed, here.)
ddp() {
  local name=$1; shift
  local t0 t1
  t0=$(now)
  (cd "$dir" && "$py" -m torch.distributed.run --standalone --nproc_per_node 4 --redirects 1 --tee 1 "$@" \
      "$root/bench/pytorch_ddp_llama.py" --steps "$steps" --micro-batch "$micro" --checkpoint-dir "$dir/ckpt-$name" --checkpoint-every 20 \
      ${DDP_KILL:+--kill-rank 2 --kill-step 30 --kill-at "$DDP_KILL"}) > "$dir/$name.out" 2>&1 || { tail -30 "$dir/$name.out"; exit 1; }
  t1=$(now)
  "$py" - "$name" "$t0" "$t1" "$dir/$name.out" >> "$results" <<'EOF'
import json, sys
name, t0, t1, out = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
attempts = [json.loads(l[l.index('{"attempt"'):]) for l in open(out) if '{"attempt"' in l]
last = attempts[-1]
# Rank 0 of an attempt that was killed prints nothing: the last line's attempt counts the restarts.
print(json.dumps({"name": name, "wall_s": t1 - t0, "median_step_s": last["median_step_s"],
                  "tokens_per_s": last["tokens_per_s"], "restarts": last["attempt"],
                  "redone_from": last["start_step"] if last["attempt"] > 0 else None}))
EOF
}

# nonstop_job NAME INJECT PROGRAM...: one `nonstop run`; records wall time, step times and the recovery.
nonstop_job() {
  local name=$1 inject=$2; shift 2
  local t0 t1
  t0=$(now)
  (cd "$dir" && "$bin/nonstop" run --nproc 4 --spares 1 --journal "$dir/$name.jsonl" --inject "$inject" -- "$@") \
      > "$dir/$name.out" 2>&1 || { tail -30 "$dir/$name.out"; exit 1; }
  t1=$(now)
  "$py" - "$name" "$t0" "$t1" "$dir/$name.jsonl" "$dir/$name.out" >> "$results" <<'EOF'
import json, re, statistics, sys
name, t0, t1, journal, out = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), sys.argv[4], sys.argv[5]
kept = [m.group(1) for m in re.finditer(r"kept the sums of (\d+ of \d+) micro-batches", open(out).read())]
records = [json.loads(l) for l in open(journal) if l.strip()]
steps = {r["step"]: r for r in records if r.get("event") == "step"}
secs = [steps[s]["step_seconds"] for s in sorted(steps)][1:]
checksum = [r["checksum"] for r in records if r.get("event") == "finished"][-1:]
rec = [r["recovery"] for r in records if r.get("event") == "recovery_end"]
median = statistics.median(secs)
print(json.dumps({"name": name, "wall_s": t1 - t0, "median_step_s": median,
                  "tokens_per_s": 32 * 64 / median, "checksum": checksum[0] if checksum else None,
                  "downtime_ms": rec[0].get("downtime_ms") if rec else None,
                  "time_lost_ms": rec[0].get("time_lost_ms") if rec else None,
                  "time_lost_split_ms": (rec[0].get("time_lost") or {}).get("split_ms") if rec else None,
                  "lost_steps": rec[0].get("lost_steps") if rec else None, "kept": kept[0] if kept else "none"}))
EOF
}

# The C++ trainer in the Python scripts' micro-batches (its built-in llama-tiny takes 1, for salvage).
recipe=$dir/llama-tiny-mb$micro.yaml
"$bin/nonstop-train" --print-recipe | sed "s/^  micro_batch: 1\$/  micro_batch: $micro/" > "$recipe"
grep -q "^  micro_batch: $micro\$" "$recipe" || { echo "pytorch: the built-in recipe's micro_batch is not 1" >&2; exit 1; }
echo "pytorch: $steps steps of llama-tiny (32 × 64 tokens, micro-batches of $micro), 4 workers, on $(nproc) cores; runs in $dir"
echo "  (a) torch DDP + Gloo (torchrun), fault-free";  ddp a-clean --max_restarts 0
echo "  (b) nonstop from Python, fault-free";           nonstop_job b-clean none "$py" "$root/examples/pytorch/train_llama.py" --steps "$steps" --micro-batch "$micro"
echo "  (c) nonstop C++ trainer, overlapped";           nonstop_job c-overlap none "$bin/nonstop-train" "$recipe" --steps "$steps"
echo "  (c) nonstop C++ trainer, not overlapped";       nonstop_job c-serial none "$bin/nonstop-train" "$recipe" --steps "$steps" --no-overlap
echo "  (d) stock DDP over nonstop, fault-free";        nonstop_job d-clean none "$py" "$root/bench/pytorch_ddp_llama.py" --steps "$steps" --micro-batch "$micro"
echo "  (e) nonstop from Python, world-invariant";      nonstop_job e-clean none "$py" "$root/examples/pytorch/train_llama.py" --steps "$steps" --micro-batch "$micro" --world-invariant
for point in start middle reduction; do
  case $point in start) spec=kill:rank=2,step=30,at=0 ;; middle) spec=kill:rank=2,step=30,at=0.5 ;; reduction) spec=kill:rank=2,step=30 ;; esac
  echo "  (a) with rank 2 killed in step 30, at its $point"; DDP_KILL=$point ddp "a-fault-$point" --max_restarts 1
  echo "  (b) with rank 2 killed in step 30, at its $point"
  nonstop_job "b-fault-$point" "$spec" "$py" "$root/examples/pytorch/train_llama.py" --steps "$steps" --micro-batch "$micro"
  echo "  (e) with rank 2 killed in step 30, at its $point"
  nonstop_job "e-fault-$point" "$spec" "$py" "$root/examples/pytorch/train_llama.py" --steps "$steps" --micro-batch "$micro" --world-invariant
done

"$py" - "$results" <<'EOF'
import json, sys
r = {j["name"]: j for j in map(json.loads, open(sys.argv[1]))}
base = r["a-clean"]["median_step_s"]
print()
print(f"{'run':<38} {'step (median)':>14} {'tokens/s':>9} {'vs (a)':>7}")
for name, label in (("a-clean", "(a) torch DDP + Gloo, torchrun"), ("b-clean", "(b) nonstop, Python, overlapped buckets"),
                    ("c-overlap", "(c) nonstop C++ trainer, overlapped"), ("c-serial", "(c) nonstop C++ trainer, not overlapped"),
                    ("d-clean", "(d) stock DDP over nonstop"), ("e-clean", "(e) nonstop, Python, world-invariant")):
    j = r[name]
    print(f"{label:<38} {j['median_step_s'] * 1000:>11.0f} ms {j['tokens_per_s']:>9.0f} {base / j['median_step_s']:>6.2f}×")
print(f"\noverlap in the C++ trainer: step {r['c-overlap']['median_step_s'] * 1000:.0f} ms overlapped, "
      f"{r['c-serial']['median_step_s'] * 1000:.0f} ms not (not overlapped / overlapped = "
      f"{r['c-serial']['median_step_s'] / r['c-overlap']['median_step_s']:.3f})")
a_step = r["a-clean"]["median_step_s"]
print("\nrank 2 killed in step 30 (time lost: what the fault added to the job; (a): its wall time less the fault-free run's,")
print("(b), (e): the recovery report's, the step across the fault less the job's normal step):")
print(f"{'kill at':<10} {'(a) torch elastic, restart':>28} {'nonstop':>22} {'/(a)':>8}  checksum / fault-free, parts")
for point in ("start", "middle", "reduction"):
    a = r[f"a-fault-{point}"]
    a_cost = a["wall_s"] - r["a-clean"]["wall_s"]
    for mode in ("b", "e"):
        b, clean = r[f"{mode}-fault-{point}"], r[f"{mode}-clean"]
        lost = b["time_lost_ms"] / 1000
        same = "bitwise" if b["checksum"] == clean["checksum"] else "DIFFERENT"
        first = f"{point:<10} {a_cost:>8.1f} s = {a_cost / a_step:>5.1f} steps {a['restarts']:>2} restart" if mode == "b" \
            else f"{'':<10} {'':>28}"
        print(f"{first} ({mode}) {lost * 1000:>6.0f} ms = {lost / clean['median_step_s']:.2f} step "
              f"{lost / a_cost * 100:>6.2f}%  {b['checksum']} {same}; kept {b['kept']}; "
              f"{ {k: round(v) for k, v in (b['time_lost_split_ms'] or {}).items()} }")
redo = r["a-fault-start"]["redone_from"]
print(f"(b) fault-free checksum {r['b-clean']['checksum']}; (a) restarted from its checkpoint (every 20 steps) "
      f"and redid the steps from {redo}")
EOF
