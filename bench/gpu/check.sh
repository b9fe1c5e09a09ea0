#!/usr/bin/env bash
# The device check of issue 30 (docs/gpu.md), for a machine with a GPU: builds
# what needs one, runs the tests labeled gpu, then a job of 4 workers and a
# spare sharing the GPU with their state on it, a rank killed, against the
# checksum of the same job with its state in host memory (and sharded over
# groups of 2 on the GPU); the NCCL job where
# there are two GPUs or more; the staged all-reduce's bandwidth; and the
# world-invariant sums on the GPU against another world's in host memory; the
# Python jobs on CUDA tensors (a torch with CUDA); and, on the machine's many
# cores, the state copy against raw TCP.
set -euo pipefail
cd "$(dirname "$0")/../.."
nvidia-smi -L || { echo "check.sh: no GPU here (nvidia-smi -L failed): nothing to check"; exit 2; }
bash scripts/build.sh
ctest --test-dir build --output-on-failure --no-tests=error -L gpu

out=$(mktemp -d)
# job NAME DEVICE PLANE [nonstop run options...]: prints the job's final checksum (WORKER_EXTRA: more
# options for the test worker)
job() {
  local name=$1 device=$2 plane=$3
  shift 3
  ./build/bin/nonstop run --journal "$out/$name.jsonl" "$@" -- \
    ./build/bin/nonstop-test-worker --steps 60 --elements 4000000 --sleep-ms 20 \
    --device "$device" --data-plane "$plane" ${WORKER_EXTRA:-} >"$out/$name.log" 2>&1 || {
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
host=$(job host host staged --nproc 4 --spares 1 --inject none) || exit 1
cuda=$(job cuda cuda staged --nproc 4 --spares 1 --inject kill:rank=2,step=30) || exit 1
grep -h '"event":"recovery_end"' "$out/cuda.jsonl" | head -1 ||
  { echo "check.sh: FAILED: the cuda job recorded no recovery_end (was rank 2 killed?)" >&2; exit 1; }
echo "check.sh: 4 workers and a spare on one GPU, 16 MB of state each on cuda:0, rank 2 killed at step 30:"
echo "  checksum ${cuda} (cuda, recovered) against ${host} (host memory, no fault)"
[[ "$host" == "$cuda" ]] || { echo "check.sh: FAILED: the checksums differ"; exit 1; }

# Sharded state on the GPU: the accumulator sharded over groups of 2 (a shard view on cuda:0),
# reduced with ReduceShardsOnDevice and gathered with GatherShardsOnDevice; the spare copies only
# shard 1 into its GPU memory.
sharded=$(WORKER_EXTRA="--shard-group 2" job sharded cuda staged --nproc 4 --spares 1 \
  --inject kill:rank=1,step=30) || exit 1
grep -h "re-sharded: copied shard" "$out/sharded.log" | head -1 ||
  { echo "check.sh: FAILED: no spare copied its shard in the sharded job" >&2; exit 1; }
echo "check.sh: the same, sharded over groups of 2 on cuda:0, rank 1 killed at step 30:"
echo "  checksum ${sharded} (cuda, sharded, recovered) against ${host}"
[[ "$host" == "$sharded" ]] || { echo "check.sh: FAILED: the sharded job's checksum differs"; exit 1; }

# The NCCL data plane: one rank per GPU (NCCL refuses two on one; a worker takes cuda:(id mod GPUs)).
gpus=$(nvidia-smi -L | grep -c '^GPU ' || true)
if [[ ! -f build/src/gpu/libnonstop_nccl.a ]]; then
  gpus_for_nccl=0
  echo "check.sh: NOT RUN: the NCCL data plane is not built here (CMake found no NCCL 2.27 or later)"
else
  gpus_for_nccl=$gpus
fi
if (( gpus_for_nccl >= 3 )); then
  n=$(( gpus - 1 < 4 ? gpus - 1 : 4 ))
  nccl=$(job nccl cuda nccl --nproc "$n" --spares 1 --inject kill:rank=1,step=30) || exit 1
  what="$n workers and a spare, one GPU each, rank 1 killed (the spare takes it)"
elif (( gpus_for_nccl == 2 )); then
  nccl=$(job nccl cuda nccl --nproc 2 --spares 0 --inject kill:rank=1,step=30) || exit 1
  what="2 workers on 2 GPUs, rank 1 killed (the job shrinks to one)"
fi
if (( gpus_for_nccl >= 2 )); then
  grep -h "NCCL communicator" "$out/nccl.log" | head -4 || true
  echo "check.sh: the NCCL data plane, $what: checksum ${nccl} against ${host}"
  [[ "$host" == "$nccl" ]] || { echo "check.sh: FAILED: the NCCL job's checksum differs"; exit 1; }
elif [[ -f build/src/gpu/libnonstop_nccl.a ]]; then
  echo "check.sh: NOT RUN: the NCCL data plane needs two GPUs or more (NCCL puts one rank on each);"
  echo "  this machine has $gpus. Its tests without a GPU ran in the unit tests (nccl_data_plane_test)."
fi

# The Python package with CUDA tensors (docs/gpu.md "Python"): 3 workers and a spare on cuda:0, the
# model, AdamW's state and the gradient buffer on it, rank 1 killed at step 20, against the same job
# without a fault. It needs a torch built with CUDA (Debian's python3-torch is not).
py=${NONSTOP_PYTHON:-/usr/bin/python3}
if PYTHONPATH=build/python "$py" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  # pyjob NAME [nonstop run options...]: prints every rank's final state digest, one per line
  # (PY_EXTRA: more options of the trainer)
  pyjob() {
    local name=$1
    shift
    ./build/bin/nonstop run --journal "$out/$name.jsonl" "$@" -- "$py" tests/python/trainer.py --steps 30 \
      --device cuda --wait-for-joins 4 --journal "$out/$name.jsonl" ${PY_EXTRA:-} >"$out/$name.log" 2>&1 || {
      tail -40 "$out/$name.log" >&2
      echo "check.sh: FAILED: the $name job (log above)" >&2
      exit 1
    }
    grep -o 'final rank=[0-9]* .* state=[0-9a-f]*' "$out/$name.log" | grep -o 'state=[0-9a-f]*' | sort -u
  }
  py_clean=$(pyjob py-clean --nproc 3 --spares 1 --inject none) || exit 1
  py_kill=$(pyjob py-kill --nproc 3 --spares 1 --heartbeat-timeout-ms 1000 --inject kill:rank=1,step=20) || exit 1
  echo "check.sh: Python, CUDA tensors, 3 workers and a spare on cuda:0, rank 1 killed at step 20:"
  echo "  ${py_kill} (recovered) against ${py_clean} (no fault)"
  [[ -n "$py_clean" && "$py_clean" == "$py_kill" && $(wc -l <<<"$py_kill") == 1 ]] ||
    { echo "check.sh: FAILED: the Python jobs' states differ"; exit 1; }
  # Sharded optimizer state (ZeRO-1) of a model on cuda:0, kept in host memory (docs/gpu.md): 4 workers
  # in groups of 2 and a spare, rank 1 killed; each shard's state against the job without a fault.
  export PY_EXTRA="--shard-group 2 --wait-for-joins 5"  # 4 workers and a spare: the last value wins
  sh_clean=$(pyjob py-shard-clean --nproc 4 --spares 1 --inject none) || exit 1
  sh_kill=$(pyjob py-shard-kill --nproc 4 --spares 1 --heartbeat-timeout-ms 1000 --inject kill:rank=1,step=20) ||
    exit 1
  unset PY_EXTRA
  echo "check.sh: Python, a sharded model on cuda:0, 4 workers and a spare, rank 1 killed at step 20:"
  echo "  $(tr '\n' ' ' <<<"$sh_kill")(recovered) against $(tr '\n' ' ' <<<"$sh_clean")(no fault)"
  [[ -n "$sh_clean" && "$sh_clean" == "$sh_kill" && $(wc -l <<<"$sh_kill") == 2 ]] ||
    { echo "check.sh: FAILED: the sharded Python jobs' states differ (or are not one per shard)"; exit 1; }
else
  echo "check.sh: NOT RUN: the Python job on CUDA tensors: $("$py" -c 'import torch; print("torch", torch.__version__)' \
    2>&1 | tail -1) has no CUDA here (Debian's python3-torch is built without it; NONSTOP_PYTHON names another)"
fi

# The staged all-reduce's bus bandwidth against the host ring, a device-host-device copy and raw TCP.
./build/bin/nonstop-bench-staged --device cuda --world 4 --sizes 4,64,256 --repeats 3

# The world-invariant sum on the GPU: items in tenths folded into tree partials on cuda:0 and summed
# by Session::AllReduceTreeOnDevice, 4 workers and a spare with a kill, against 3 workers in host
# memory without a fault (the bits depend on the order of the additions).
tree_host=$(WORKER_EXTRA=--tree job tree-host host staged --nproc 3 --spares 0 --inject none) || exit 1
tree_cuda=$(WORKER_EXTRA=--tree job tree-cuda cuda staged --nproc 4 --spares 1 \
  --inject kill:rank=2,step=30) || exit 1
echo "check.sh: world-invariant sums on cuda:0, 4 workers and a spare, rank 2 killed: checksum ${tree_cuda}"
echo "  against ${tree_host} (3 workers, host memory, no fault)"
[[ "$tree_host" == "$tree_cuda" ]] || { echo "check.sh: FAILED: the world-invariant checksums differ"; exit 1; }

# Not the GPU: the state copy against raw TCP on this machine's cores (issue 27, point 4), which the
# project's 2-core machines cannot show (two CRC passes and two kernel copies share their 2 cores).
echo "check.sh: the state copy against raw TCP on $(nproc) cores:"
./build/bin/nonstop-bench-state-copy --sizes 64,256,1024 --repeats 3
echo "check.sh: done. docs/gpu.md says what exists and what this does not check."
