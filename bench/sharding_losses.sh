#!/usr/bin/env bash
# The loss curve of sharded optimizer state against the unsharded run
# (docs/sharding.md): a micro Llama recipe on the fortunes corpus, 4 ranks,
# 200 steps, with optimizer.shard_group 1, 2 and 4, in fast and in
# world-invariant determinism; prints, per G, the largest relative difference
# of a step's loss from the unsharded run's and how many are bitwise equal.
#
#   bash bench/sharding_losses.sh [steps]        (after scripts/build.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
steps="${1:-200}"
bin="$PWD/build/bin"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python=/usr/bin/python3  # Debian's: the journals are read with its json module
for mode in fast world-invariant; do
  cat > "$work/$mode.yaml" <<RECIPE
name: micro-$mode
model: {arch: llama, vocab_size: 256, dim: 32, n_layers: 2, n_heads: 4, n_kv_heads: 2, ffn_hidden: 48, seq_len: 16}
train: {steps: $steps, global_batch: 16, micro_batch: 2, seed: 7, log_every: 50, determinism: $mode}
optimizer: {lr: 3.0e-3, min_lr: 3.0e-4, warmup_steps: 3}
data: {shards: $work/data, prepare_from: /usr/share/games/fortunes, strip_fortune_separators: true}
RECIPE
  for g in 1 2 4; do
    "$bin/nonstop" run --nproc 4 --spares 0 --journal "$work/$mode-g$g.jsonl" -- \
      "$bin/nonstop-train" "$work/$mode.yaml" --shard-group "$g" > "$work/$mode-g$g.log" 2>&1 ||
      { echo "the $mode run with shard_group $g failed:"; tail -20 "$work/$mode-g$g.log"; exit 1; }
  done
done
"$python" - "$work" "$steps" <<'PY'
import json, sys
work, steps = sys.argv[1], int(sys.argv[2])
def losses(path):
    return {j["step"]: j["loss"] for j in map(json.loads, open(path)) if j.get("event") == "step"}
for mode in ["fast", "world-invariant"]:
    base = losses(f"{work}/{mode}-g1.jsonl")
    for g in [2, 4]:
        got = losses(f"{work}/{mode}-g{g}.jsonl")
        if sorted(got) != sorted(base) or len(base) != steps:
            sys.exit(f"{mode} G={g}: {len(got)} steps against {len(base)}")
        worst = max(abs(got[s] - base[s]) / base[s] for s in base)
        same = sum(got[s] == base[s] for s in base)
        print(f"{mode:>15} G={g}: {steps} steps, largest relative loss difference {worst:.3g}, "
              f"{same}/{steps} losses bitwise equal (loss {base[0]:.4f} at step 0, {base[steps - 1]:.4f} at the last)")
PY
