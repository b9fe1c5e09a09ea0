#!/usr/bin/env bash
# What `determinism: world-invariant` costs (issue 13, docs/determinism.md), in
# one invocation: for each world size, the same recipe trained with the default
# (the ring, gradient buckets overlapped with backward) and with the fixed
# reduction tree, back to back: median step time of each and their ratio. Then
# the bytes each rank sends per step for a gradient of the recipe's size, from
# nonstop-bench-allreduce --tree (the most any rank sends: the tree's shares
# are uneven), for the ring and the tree at the same world sizes.
#
#   bash bench/determinism_cost.sh [--steps N] [--worlds "2 3 4"] [--recipe llama-tiny]
#
# Needs ./build (scripts/build.sh). Everything runs on 127.0.0.1; the run
# directory is removed on exit. About 6 min at 40 steps on two cores.
set -euo pipefail
cd "$(dirname "$0")/.."
steps=40
worlds="2 3 4"
recipe=llama-tiny
while [ $# -gt 0 ]; do
  case "$1" in
    --steps) steps="$2"; shift 2 ;;
    --worlds) worlds="$2"; shift 2 ;;
    --recipe) recipe="$2"; shift 2 ;;
    *) echo "usage: $0 [--steps N] [--worlds \"2 3 4\"] [--recipe NAME]" >&2; exit 2 ;;
  esac
done
bin=$PWD/build/bin
py=/usr/bin/python3
for need in "$bin/nonstop" "$bin/nonstop-train" "$bin/nonstop-bench-allreduce" "$py" "recipes/$recipe.yaml"; do
  [ -e "$need" ] || { echo "determinism_cost: $need is missing (run scripts/setup.sh and scripts/build.sh)" >&2; exit 2; }
done
dir=$(mktemp -d /tmp/nonstop-determinism-cost-XXXXXX)
trap 'rm -rf "$dir"' EXIT
sed 's/^train:$/train:\n  determinism: world-invariant/' "recipes/$recipe.yaml" > "$dir/invariant.yaml"
grep -q 'determinism: world-invariant' "$dir/invariant.yaml" || { echo "determinism_cost: no train: section in $recipe" >&2; exit 1; }

median() {  # median JOURNAL: median step seconds, the first step left out (warm-up)
  "$py" - "$1" <<'EOF'
import json, statistics, sys
secs = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
secs = {r["step"]: r["step_seconds"] for r in secs if r.get("event") == "step"}
print(statistics.median([secs[s] for s in sorted(secs)][1:]))
EOF
}
params=0
for w in $worlds; do
  for mode in ring tree; do
    file=recipes/$recipe.yaml
    [ "$mode" = tree ] && file=$dir/invariant.yaml
    echo "[$recipe] world $w, $mode" >&2
    "$bin/nonstop" run --nproc "$w" --spares 0 --journal "$dir/$mode$w.jsonl" -- \
      "$bin/nonstop-train" "$file" --steps "$steps" > "$dir/$mode$w.out" 2>&1 ||
      { echo "determinism_cost: the $mode run at world $w failed:" >&2; tail -20 "$dir/$mode$w.out" >&2; exit 1; }
    echo "$w $mode $(median "$dir/$mode$w.jsonl")" >> "$dir/times.txt"
    [ "$params" -gt 0 ] || params=$(grep -o 'built its model ([0-9]* parameters' "$dir/$mode$w.out" | head -1 | grep -o '[0-9]*')
  done
done
bytes=$(((params + 1) * 4))  # the gradient and the loss slot
m=$(grep -E '^ *global_batch:' "recipes/$recipe.yaml" | grep -o '[0-9]*')
mb=$(grep -E '^ *micro_batch:' "recipes/$recipe.yaml" | grep -o '[0-9]*')
echo "[$recipe] bytes per step: a $bytes-byte gradient, $((m / mb)) micro-batches" >&2
"$bin/nonstop-bench-allreduce" --tree "$((m / mb))" --worlds "$(echo $worlds | tr ' ' ,)" \
  --min-bytes "$bytes" --max-bytes "$bytes" --json "$dir/bytes.json" > "$dir/bytes.out" 2>&1 ||
  { echo "determinism_cost: the allreduce bench failed:" >&2; tail -20 "$dir/bytes.out" >&2; exit 1; }

"$py" - "$dir/times.txt" "$dir/bytes.json" "$recipe" "$steps" <<'EOF'
import json, sys
times = {}
for line in open(sys.argv[1]):
    w, mode, s = line.split()
    times[(int(w), mode)] = float(s)
doc = json.load(open(sys.argv[2]))
by_world = {}
for r in doc["results"]:
    by_world[r["world"]] = r
print(f"\n{sys.argv[3]}, {sys.argv[4]} steps per run: world-invariant (fixed tree) against the default ring")
print("| world | ring step ms | tree step ms | tree / ring | ring bytes sent per step | tree bytes sent per step |")
print("|---|---|---|---|---|---|")
for w in sorted({w for w, _ in times}):
    ring, tree = times[(w, "ring")], times[(w, "tree")]
    b = by_world.get(w, {})
    rb = b.get("ring_bytes_sent_per_rank", float("nan"))
    tb = b.get("tree_bytes_sent_per_rank", float("nan"))
    print(f"| {w} | {ring * 1000:.0f} | {tree * 1000:.0f} | {tree / ring:.3f} | {rb / 1e6:.2f} MB | {tb / 1e6:.2f} MB |")
EOF
