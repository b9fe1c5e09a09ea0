#!/usr/bin/env bash
# What replica agreement costs (issue 28, docs/integrity.md), in one
# invocation: the same recipe and world trained with the replicas never
# compared (--replica-check-every 0), compared before every step (1) and at
# the default (50), run after run, rounds of the three interleaved so that
# the machine's drift falls on all alike. Prints each one's median step time
# (the first step left out) and its ratio to the unchecked run's.
#
#   bash bench/integrity_cost.sh [--steps N (default 60: K = 50 checks once)] [--world W] [--rounds R] [--recipe llama-tiny]
#
# Needs ./build (scripts/build.sh). Everything runs on 127.0.0.1; the run
# directory is removed on exit. About 14 min at the defaults on two cores.
set -euo pipefail
cd "$(dirname "$0")/.."
steps=60
world=4
rounds=2
recipe=llama-tiny
while [ $# -gt 0 ]; do
  case "$1" in
    --steps) steps="$2"; shift 2 ;;
    --world) world="$2"; shift 2 ;;
    --rounds) rounds="$2"; shift 2 ;;
    --recipe) recipe="$2"; shift 2 ;;
    *) echo "usage: $0 [--steps N] [--world W] [--rounds R] [--recipe NAME]" >&2; exit 2 ;;
  esac
done
bin=$PWD/build/bin
py=/usr/bin/python3
for need in "$bin/nonstop" "$bin/nonstop-train" "$py" "recipes/$recipe.yaml"; do
  [ -e "$need" ] || { echo "integrity_cost: $need is missing (run scripts/setup.sh and scripts/build.sh)" >&2; exit 2; }
done
dir=$(mktemp -d /tmp/nonstop-integrity-cost-XXXXXX)
trap 'rm -rf "$dir"' EXIT
for round in $(seq "$rounds"); do
  for k in 0 1 50; do
    echo "[$recipe] world $world, round $round, --replica-check-every $k" >&2
    "$bin/nonstop" run --nproc "$world" --spares 0 --journal "$dir/k$k-$round.jsonl" -- \
      "$bin/nonstop-train" "recipes/$recipe.yaml" --steps "$steps" --replica-check-every "$k" \
      > "$dir/k$k-$round.out" 2>&1 ||
      { echo "integrity_cost: the run with K=$k failed:" >&2; tail -20 "$dir/k$k-$round.out" >&2; exit 1; }
  done
done
"$py" - "$dir" "$recipe" "$steps" "$world" "$rounds" <<'EOF'
import glob, json, statistics, sys
d, recipe, steps, world, rounds = sys.argv[1:]
med = {}
for k in (0, 1, 50):
    secs = []
    for path in sorted(glob.glob(f"{d}/k{k}-*.jsonl")):
        rec = [json.loads(l) for l in open(path) if l.strip()]
        by_step = {r["step"]: r["step_seconds"] for r in rec if r.get("event") == "step"}
        secs += [by_step[s] for s in sorted(by_step)][1:]
    med[k] = statistics.median(secs)
print(f"\n{recipe}, world {world}, {steps} steps × {rounds} rounds per setting")
print("| --replica-check-every | median step ms | ratio to unchecked |")
print("|---|---|---|")
for k in (0, 1, 50):
    name = {0: "0 (never)", 1: "1 (every step)", 50: "50 (the default)"}[k]
    print(f"| {name} | {med[k] * 1000:.1f} | {med[k] / med[0]:.4f} |")
EOF
