#!/usr/bin/env bash
# The device check of issue 30 (docs/gpu.md), for a machine with a GPU: builds
# what needs one, runs the tests labeled gpu, then a job of 4 workers and a
# spare sharing the GPU with their state on it, a rank killed, against the
# checksum of the same job with its state in host memory. What it does not
# check yet is said at the end: those parts are not built.
set -euo pipefail
cd "$(dirname "$0")/../.."
nvidia-smi -L || { echo "check.sh: no GPU here (nvidia-smi -L failed): nothing to check"; exit 2; }
bash scripts/build.sh
ctest --test-dir build --output-on-failure --no-tests=error -L gpu

out=$(mktemp -d)
job() {  # job NAME DEVICE [nonstop run options...]: prints the job's final checksum
  local name=$1 device=$2
  shift 2
  ./build/bin/nonstop run --nproc 4 --spares 1 --journal "$out/$name.jsonl" "$@" -- \
    ./build/bin/nonstop-test-worker --steps 60 --elements 4000000 --sleep-ms 20 \
    --device "$device" >"$out/$name.log" 2>&1 || {
    tail -40 "$out/$name.log" >&2
    echo "check.sh: FAILED: the $name job (log above, $out/$name.log)" >&2
    exit 1
  }
  local sum
  sum=$(grep '"event":"finished"' "$out/$name.jsonl" | grep -o '"checksum":"[0-9a-f]*"' | head -1 |
    cut -d'"' -f4 || true)
  [[ -n "$sum" ]] || { echo "check.sh: FAILED: the $name job recorded no finished checksum" >&2; exit 1; }
  echo "$sum"
}
host=$(job host host --inject none) || exit 1
cuda=$(job cuda cuda --inject kill:rank=2,step=30) || exit 1
grep -h '"event":"recovery_end"' "$out/cuda.jsonl" | head -1 ||
  { echo "check.sh: FAILED: the cuda job recorded no recovery_end (was rank 2 killed?)" >&2; exit 1; }
echo "check.sh: 4 workers and a spare on one GPU, 16 MB of state each on cuda:0, rank 2 killed at step 30:"
echo "  checksum ${cuda} (cuda, recovered) against ${host} (host memory, no fault)"
[[ "$host" == "$cuda" ]] || { echo "check.sh: FAILED: the checksums differ"; exit 1; }
echo "check.sh: not checked yet (not built): the staged all-reduce's bandwidth against a device-host-device"
echo "copy and raw TCP, the world-invariant checksum on the device, the NCCL data plane (needs two GPUs)."
echo "docs/gpu.md says what exists."
