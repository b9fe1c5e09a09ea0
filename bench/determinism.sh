#!/usr/bin/env bash
# The runs of docs/determinism.md (issue 13), on the reference trainer with
# `determinism: world-invariant`: for each recipe, fixed worlds of 4, 1 and 3
# workers, an elastic run 4 → 2 → 4 → 3 → 4 (a release of two, a grow, a
# kill with no spare, a grow), and a run resumed at world 2 from a checkpoint
# written at world 4. It prints each run's parameter checksum, whether every
# step's loss is bitwise the one of the fixed 4-worker run, and the mean step
# time beside the same recipe in the default (fast, ring) mode at world 4.
#
#   bash bench/determinism.sh [--steps N] [--recipes "llama-tiny gpt-oss-tiny"]
#
# Needs ./build (scripts/build.sh). Everything runs on 127.0.0.1; the run
# directory is removed on exit. About 2 × 20 min on two cores at 200 steps.
set -euo pipefail
cd "$(dirname "$0")/.."
steps=200
recipes="llama-tiny gpt-oss-tiny"
while [ $# -gt 0 ]; do
  case "$1" in
    --steps) steps="$2"; shift 2 ;;
    --recipes) recipes="$2"; shift 2 ;;
    *) echo "usage: $0 [--steps N] [--recipes \"llama-tiny gpt-oss-tiny\"]" >&2; exit 2 ;;
  esac
done
[ "$steps" -ge 60 ] || { echo "determinism: --steps must be at least 60 (the elastic run changes the world 4 times)" >&2; exit 2; }
bin=$PWD/build/bin
py=/usr/bin/python3
for need in "$bin/nonstop" "$bin/nonstop-train" "$py"; do
  [ -x "$need" ] || { echo "determinism: $need is missing (run scripts/setup.sh and scripts/build.sh)" >&2; exit 2; }
done
dir=$(mktemp -d /tmp/nonstop-determinism-XXXXXX)
pids=()
cleanup() { for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$dir"; }
trap cleanup EXIT

# summary JOURNAL: "checksum steps mean_step_s worlds" from a journal.
summary() {
  "$py" - "$1" <<'EOF'
import json, sys
checksum, steps, secs, worlds = "none", {}, [], []
for line in open(sys.argv[1]):
    try:
        r = json.loads(line)
    except ValueError:
        continue
    e = r.get("event")
    if e == "finished" and checksum == "none":
        checksum = r["checksum"]
    elif e == "step":
        steps[r["step"]] = r["loss"]
        if "step_seconds" in r:
            secs.append(r["step_seconds"])
    elif e == "plan":
        worlds.append(len(r["members"]))
mean = sorted(secs)[len(secs) // 2] if secs else float("nan")
json.dump({"checksum": checksum, "losses": steps, "median_step_s": mean, "worlds": worlds}, sys.stdout)
EOF
}
# world JOURNAL: the world size of the newest plan; step JOURNAL: the highest step (scripts/journal.py).
world() { "$py" scripts/journal.py world "$1"; }
step() { "$py" scripts/journal.py last-step "$1"; }
wait_for() {  # wait_for DESCRIPTION 'CONDITION': evaluates the condition anew every 0.1 s, for up to 30 min
  local what=$1 condition=$2
  for _ in $(seq 18000); do eval "$condition" && return 0; sleep 0.1; done
  echo "determinism: timed out waiting for $what" >&2; exit 1
}

for recipe in $recipes; do
  r=$dir/$recipe
  mkdir -p "$r"
  sed 's/^train:$/train:\n  determinism: world-invariant/' "recipes/$recipe.yaml" > "$r/invariant.yaml"
  grep -q 'determinism: world-invariant' "$r/invariant.yaml" || { echo "determinism: no train: section in $recipe" >&2; exit 1; }
  run() {  # run NAME NPROC [nonstop run flags...] -- [trainer flags...]
    local name=$1 nproc=$2; shift 2
    local flags=() train=()
    while [ $# -gt 0 ] && [ "$1" != -- ]; do flags+=("$1"); shift; done
    [ $# -gt 0 ] && shift
    train=("$@")
    echo "[$recipe] $name: $nproc worker(s) ${flags[*]} ${train[*]}" >&2
    "$bin/nonstop" run --nproc "$nproc" --spares 0 --journal "$r/$name/journal.jsonl" "${flags[@]}" -- \
      "$bin/nonstop-train" "$r/invariant.yaml" --steps "$steps" "${train[@]}" > "$r/$name.out" 2>&1 ||
      { echo "determinism: run $name failed; its output:" >&2; tail -20 "$r/$name.out" >&2; exit 1; }
  }
  run fixed4 4
  run fixed1 1
  run fixed3 3
  # The default mode beside it, for the step time.
  echo "[$recipe] fast4: 4 worker(s), the ring" >&2
  "$bin/nonstop" run --nproc 4 --spares 0 --journal "$r/fast4/journal.jsonl" -- \
    "$bin/nonstop-train" "recipes/$recipe.yaml" --steps "$steps" > "$r/fast4.out" 2>&1

  # Elastic: 4 → 2 (release 2) → 4 (grow) → 3 (a kill, no spare) → 4 (grow).
  q1=$((steps * 15 / 100)); q2=$((steps * 30 / 100)); q3=$((steps * 50 / 100)); q4=$((steps * 65 / 100))
  echo "[$recipe] elastic: 4 → 2 at step $q1, → 4 at $q2, a kill of rank 3 at $q3, → 4 at $q4" >&2
  j=$r/elastic/journal.jsonl
  "$bin/nonstop" run --nproc 4 --spares 0 --max-world 4 --journal "$j" --inject "kill:rank=3,step=$q3" -- \
    "$bin/nonstop-train" "$r/invariant.yaml" --steps "$steps" > "$r/elastic.out" 2>&1 &
  job=$!
  pids+=($job)
  scale() { "$bin/nonstop" scale --job "$r/elastic/job.json" "$@" > /dev/null; }
  wait_for "step $q1" '[ "$(step "$j")" -ge "$q1" ]'
  scale --release 2
  wait_for "world 2" '[ "$(world "$j")" -eq 2 ]'
  wait_for "step $q2" '[ "$(step "$j")" -ge "$q2" ]'
  scale --world-size 4
  wait_for "world 4" '[ "$(world "$j")" -eq 4 ]'
  wait_for "the kill's shrink to 3" '[ "$(world "$j")" -eq 3 ]'
  wait_for "step $q4" '[ "$(step "$j")" -ge "$q4" ]'
  scale --world-size 4
  wait "$job" || { echo "determinism: the elastic run failed; its output:" >&2; tail -20 "$r/elastic.out" >&2; exit 1; }

  # A checkpoint written at world 4, resumed at world 2.
  every=$((steps / 4))
  run saved4 4 --checkpoint-dir "$r/ckpt" --checkpoint-every "$every"
  keep=$(ls -d "$r"/ckpt/step-* | sort | head -1)  # the oldest kept: the resume redoes the most steps
  for d in "$r"/ckpt/step-*; do [ "$d" \> "$keep" ] && rm -rf "$d"; done
  run resumed2 2 -- --resume "$r/ckpt"

  for name in fixed4 fixed1 fixed3 elastic resumed2 fast4; do summary "$r/$name/journal.jsonl" > "$r/$name.json"; done
  "$py" - "$recipe" "$r" "$(basename "$keep")" <<'EOF'
import json, sys
recipe, r, resumed_from = sys.argv[1], sys.argv[2], sys.argv[3]
runs = {n: json.load(open(f"{r}/{n}.json")) for n in ["fixed4", "fixed1", "fixed3", "elastic", "resumed2", "fast4"]}
ref = runs["fixed4"]
print(f"\n{recipe}: determinism world-invariant")
print(f"| run | worlds | checksum | losses = fixed 4 | median step s |")
print(f"|---|---|---|---|---|")
for name in ["fixed4", "fixed1", "fixed3", "elastic", "resumed2", "fast4"]:
    x = runs[name]
    common = [s for s in x["losses"] if s in ref["losses"]]
    same = all(x["losses"][s] == ref["losses"][s] for s in common)
    label = name if name != "resumed2" else f"resumed2 (from {resumed_from}, written at world 4)"
    if name == "fast4":
        label = "fast4 (the ring, for the step time)"
    print(f"| {label} | {'→'.join(map(str, x['worlds']))} | {x['checksum']} | "
          f"{'yes' if same else 'NO'} ({len(common)} steps) | {x['median_step_s']:.3f} |")
inv = [runs[n]["checksum"] for n in ["fixed4", "fixed1", "fixed3", "elastic", "resumed2"]]
print(f"\nall world-invariant runs on one checksum: {'yes' if len(set(inv)) == 1 else 'NO'} ({', '.join(inv)})")
print(f"step time, world-invariant / ring at world 4: {runs['fixed4']['median_step_s'] / runs['fast4']['median_step_s']:.2f}")
EOF
done
