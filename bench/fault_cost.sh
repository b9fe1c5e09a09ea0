#!/usr/bin/env bash
# What one fault costs the job, by mode and by where in the step it lands (issue 27):
# nonstop-bench-recovery for
#   - the default (ring) mode, with and without salvage of the step in flight,
#   - the world-invariant mode (determinism: world-invariant), with and without salvage,
# each with rank 2 killed at step K as the step starts (at=0), half-way through it (at=0.5) and just
# before its reduction (the default kill), with a spare; every bench run also times the fault-free
# job and checkpoint-restart on the same machine. Prints, per case, the time lost per fault (the
# step across the fault less a normal step, from the journal) in ms and as a fraction of a normal
# step, beside the goal for the default mode with a spare (the lost rank's share, 1/W of a step,
# plus 0.1 s), and every run's final checksum. torch's elastic launcher with DDP is bench/pytorch.sh.
#
#   bash bench/fault_cost.sh [--steps N] [--kill-step K] [--nproc W] [--recipe FILE]
#
# Needs ./build (scripts/build.sh). About 4 runs × 6 cases of N steps each (default 24 steps:
# about 25 minutes on 2 cores). Output: bench-results/fault-cost/{table.txt,results.jsonl}.
set -euo pipefail
cd "$(dirname "$0")/.."
steps=24 kill_step=14 nproc=4 recipe=recipes/llama-tiny.yaml
while [ $# -gt 0 ]; do
  case "$1" in
    --steps) steps="$2"; shift 2 ;;
    --kill-step) kill_step="$2"; shift 2 ;;
    --nproc) nproc="$2"; shift 2 ;;
    --recipe) recipe="$2"; shift 2 ;;
    *) echo "usage: $0 [--steps N] [--kill-step K] [--nproc W] [--recipe FILE]" >&2; exit 2 ;;
  esac
done
[ "$kill_step" -ge 3 ] && [ "$kill_step" -lt $((steps - 3)) ] ||
  { echo "fault_cost: --kill-step must be at least 3 and 4 below --steps (a normal step before it, the recovery after)" >&2; exit 2; }
bin=$PWD/build/bin
for need in "$bin/nonstop-bench-recovery" "$bin/nonstop-train" "$recipe"; do
  [ -e "$need" ] || { echo "fault_cost: $need is missing (run scripts/setup.sh and scripts/build.sh)" >&2; exit 2; }
done
out=$PWD/bench-results/fault-cost
rm -rf "$out" && mkdir -p "$out"
sed 's/^train:$/train:\n  determinism: world-invariant/' "$recipe" > "$out/invariant.yaml"
grep -q 'determinism: world-invariant' "$out/invariant.yaml" ||
  { echo "fault_cost: $recipe has no train: section" >&2; exit 1; }
results=$out/results.jsonl
for mode in ring invariant; do
  r=$recipe; [ "$mode" = invariant ] && r=$out/invariant.yaml
  for point in start middle reduction; do
    case $point in
      start) fault="kill:rank=2,step=$kill_step,at=0" ;;
      middle) fault="kill:rank=2,step=$kill_step,at=0.5" ;;
      reduction) fault="kill:rank=2,step=$kill_step" ;;
    esac
    echo "fault_cost: $mode, $fault"
    "$bin/nonstop-bench-recovery" --nproc "$nproc" --spares 1 --steps "$steps" --faults "$fault" \
      --compare-salvage --out "$out/$mode-$point" -- "$bin/nonstop-train" "$r" > "$out/$mode-$point.txt" 2>&1 ||
      { tail -30 "$out/$mode-$point.txt"; exit 1; }
    /usr/bin/python3 - "$mode" "$point" "$out/$mode-$point/results.json" >> "$results" <<'EOF'
import json, sys
mode, point, path = sys.argv[1:4]
j = json.load(open(path))
print(json.dumps({"mode": mode, "point": point, "normal_step_s": j["summary"]["normal_step_s"],
                  "runs": [{k: r.get(k) for k in ("name", "exit_code", "wall_s", "mean_time_lost_ms",
                                                   "mean_downtime_ms", "checksum")} for r in j["runs"]]}))
EOF
  done
done
/usr/bin/python3 - "$results" "$nproc" <<'EOF' | tee "$out/table.txt"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
w = int(sys.argv[2])
print(f"\ntime lost per fault (one kill of rank 2, {w} workers and a spare; the step across the fault less a normal step)")
print(f"{'mode':<10} {'kill':<10} {'run':<27} {'time lost':>10} {'of a step':>9} {'goal':>6} {'wall s':>7}  checksum")
for c in rows:
    normal = c["normal_step_s"]
    goal = (1 / w + 0.1 / normal) if normal > 0 else None
    for r in c["runs"]:
        if r["name"] == "fault-free":
            print(f"{c['mode']:<10} {c['point']:<10} {r['name']:<27} {'-':>10} {'-':>9} {'':>6} {r['wall_s']:>7.1f}  {r['checksum']}")
            continue
        t = r["mean_time_lost_ms"]
        frac = t / 1000 / normal if t is not None and normal > 0 else None
        g = f"{goal:.2f}" if goal is not None and c["mode"] == "ring" and r["name"] == "checkpointless" else ""
        print(f"{c['mode']:<10} {c['point']:<10} {r['name']:<27} {t if t is None else round(t):>10} "
              f"{'-' if frac is None else f'{frac:.2f}':>9} {g:>6} {r['wall_s']:>7.1f}  {r['checksum']}")
    print(f"{'':<10} {'':<10} (a normal step {normal * 1000:.0f} ms)")
EOF
