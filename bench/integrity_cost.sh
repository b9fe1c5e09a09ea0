#!/usr/bin/env bash
# What integrity costs (issue 28, docs/integrity.md), in one invocation: the
# same recipe and world trained with the replicas never compared
# (--replica-check-every 0), compared before every step (1) and at the
# default (50), and with checked collectives (--checked-collectives, K = 0),
# run after run, in rounds whose order alternates (forward, then backward:
# A B C D D C B A ...) so that a drift of the machine's speed falls on all
# alike. Prints each one's median step time (the first step left out), its
# ratio to the run with neither, and each round's median, to show the drift.
#
#   bash bench/integrity_cost.sh [--steps N (default 60: K = 50 checks once)] [--world W] [--rounds R] [--recipe llama-tiny]
#
# Needs ./build (scripts/build.sh). Everything runs on 127.0.0.1; the run
# directory is removed on exit. About 19 min at the defaults on two cores.
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
  order="k0 k1 k50 checked"
  [ $((round % 2)) -eq 0 ] && order="checked k50 k1 k0"
  for run in $order; do
    case "$run" in
      checked) flags=(--replica-check-every 0 --checked-collectives) ;;
      *) flags=(--replica-check-every "${run#k}") ;;
    esac
    echo "[$recipe] world $world, round $round, ${flags[*]}" >&2
    "$bin/nonstop" run --nproc "$world" --spares 0 --journal "$dir/$run-$round.jsonl" -- \
      "$bin/nonstop-train" "recipes/$recipe.yaml" --steps "$steps" "${flags[@]}" \
      > "$dir/$run-$round.out" 2>&1 ||
      { echo "integrity_cost: the run with ${flags[*]} failed:" >&2; tail -20 "$dir/$run-$round.out" >&2; exit 1; }
  done
done
"$py" - "$dir" "$recipe" "$steps" "$world" "$rounds" <<'EOF'
import glob, json, statistics, sys
d, recipe, steps, world, rounds = sys.argv[1:]
med, per_round, share = {}, {}, {}
runs = ("k0", "k1", "k50", "checked")
for k in runs:
    secs = []
    for path in sorted(glob.glob(f"{d}/{k}-*.jsonl")):
        rec = [json.loads(l) for l in open(path) if l.strip()]
        by_step = {r["step"]: r["step_seconds"] for r in rec if r.get("event") == "step"}
        run = [by_step[s] for s in sorted(by_step)][1:]
        per_round.setdefault(k, []).append(statistics.median(run))
        secs += run
        # The checks' own time, measured by the workers (the journal's replica_check_ms).
        checks = [(r["replica_check_ms"] / 1000, r.get("replica_crc_ms", 0) / 1000) for r in rec
                  if r.get("event") == "step" and "replica_check_ms" in r]
        share.setdefault(k, [0.0, 0.0, 0.0, 0])
        share[k][0] += sum(c for c, _ in checks)
        share[k][1] += sum(c for _, c in checks)
        share[k][2] += sum(by_step.values())
        share[k][3] += len(checks)
    med[k] = statistics.median(secs)
print(f"\n{recipe}, world {world}, {steps} steps × {rounds} rounds per setting")
print("| setting | median step ms | ratio to neither | median ms of round 1, 2, … |")
print("|---|---|---|---|")
names = {"k0": "--replica-check-every 0 (never)", "k1": "--replica-check-every 1 (every step)",
         "k50": "--replica-check-every 50 (the default)",
         "checked": "--checked-collectives, --replica-check-every 0"}
for k in runs:
    rounds_ms = ", ".join(f"{m * 1000:.1f}" for m in per_round[k])
    print(f"| {names[k]} | {med[k] * 1000:.1f} | {med[k] / med['k0']:.4f} | {rounds_ms} |")
print("\nThe replica checks' own time (each member's, as the journal reports it), against the step time:")
print("(a check's time includes the wait for the slowest member's record, which the step's")
print("all-reduce would wait for anyway; its CRC pass is the part only the check costs)")
for k in ("k1", "k50"):
    check_s, crc_s, step_s, n = share[k]
    if n:
        print(f"- {names[k]}: {n} checks, {check_s / n * 1000:.2f} ms each "
              f"({check_s / step_s * 100:.3f} % of the run's step time), of which the CRC pass "
              f"{crc_s / n * 1000:.2f} ms ({crc_s / step_s * 100:.3f} %)")
EOF
