#!/usr/bin/env bash
# The device check (docs/gpu.md), for a machine with a GPU:
#
#   bench/gpu/check.sh                  builds here (scripts/build.sh), then checks
#   bench/gpu/check.sh --prebuilt DIR   checks from a bundle that bench/gpu/bundle.sh made on
#                                       another machine (no build: a lent GPU machine has minutes)
#
# The parts: the GPU tests (the fake CUDA runtime's and NCCL's without a GPU run everywhere); a
# job of 4 workers and a spare sharing the GPU with their state on it, a rank killed, against the
# checksum of the same job with its state in host memory (and sharded over groups of 2 on the
# GPU); the NCCL job where there are two GPUs or more; the Python jobs on CUDA tensors (a torch
# with CUDA, and a Python the package was built for); the staged all-reduce's bandwidth; the
# world-invariant sums on the GPU against another world's in host memory; and, on the machine's
# many cores, the state copy against raw TCP. Every part runs, a failed one too, and the summary
# at the end says PASS, FAILED or NOT RUN (and why) for each. Without a GPU the jobs run on the
# test worker's stand-in device (host memory reached only through copies), which checks the
# script and the bundle, not a GPU.
set -uo pipefail
usage() {
  sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'
  echo "Environment: NONSTOP_CHECK_LOGS (the folder for the logs), NONSTOP_CHECK_SECONDS (the budget," \
    "280), NONSTOP_PYTHON (the Python of the Python jobs)."
}
bundle=""
case "${1:-}" in
  --prebuilt)
    if [[ -z "${2:-}" ]]; then
      echo "check.sh: --prebuilt takes the folder bench/gpu/bundle.sh made" >&2
      exit 2
    fi
    bundle=$(realpath -- "$2")
    [[ -f "$bundle/MANIFEST" ]] ||
      { echo "check.sh: $2 has no MANIFEST: not a bundle of bench/gpu/bundle.sh" >&2; exit 2; } ;;
  -h | --help) usage; exit 0 ;;
  "") ;;
  *) echo "check.sh: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
esac
cd "$(dirname "$0")/../.."

gpus=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  nvidia-smi -L
  gpus=$(nvidia-smi -L | grep -c '^GPU ' || true)
fi
device=cuda
if (( gpus == 0 )); then
  device=stand-in
  echo "check.sh: no GPU here (nvidia-smi -L): the jobs run on the stand-in device; what needs a GPU is NOT RUN"
fi

if [[ -n "$bundle" ]]; then
  bin="$bundle/bin"
  pythonpath="$bundle/python"
  cat "$bundle/MANIFEST"
  # The bundle's libraries, and NCCL from this machine (the bundle carries none: the device's own
  # matches its driver): a Python's nvidia-nccl wheel, else the loader's.
  nccl_dir=""
  for py in python3 /usr/bin/python3; do
    nccl_dir=$("$py" -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' \
      2>/dev/null) && [[ -f "$nccl_dir/libnccl.so.2" ]] && break
    nccl_dir=""
  done
  if [[ -z "$nccl_dir" ]]; then
    nccl_dir=$(ldconfig -p 2>/dev/null | awk '/libnccl\.so\.2 /{print $NF; exit}' | xargs -r dirname)
  fi
  if [[ -z "$nccl_dir" ]]; then  # a wheel's copy under another layout, or a toolkit's
    nccl_dir=$(find /opt /usr/local /usr/lib -name libnccl.so.2 2>/dev/null | head -1 | xargs -r dirname)
  fi
  echo "check.sh: NCCL from ${nccl_dir:-nowhere (no libnccl.so.2 here)}"
  export LD_LIBRARY_PATH="$bundle/lib${nccl_dir:+:$nccl_dir}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  need=$(sed -n 's/^glibc needed: //p' "$bundle/MANIFEST")
  have=$(getconf GNU_LIBC_VERSION | awk '{print $2}')
  if [[ -n "$need" && "$(printf '%s\n%s\n' "$need" "$have" | sort -V | head -1)" != "$need" ]]; then
    echo "check.sh: the bundle needs glibc $need; this machine has $have: build the bundle on an older system" >&2
    exit 2
  fi
else
  bin=build/bin
  pythonpath=build/python
  bash scripts/build.sh || exit 1
fi
# Every binary must load here (the libraries, NCCL, libstdc++): if not, the loader says why, once.
for b in nonstop nonstop-test-worker; do
  if ! loaded=$("$bin/$b" --help 2>&1 >/dev/null); then
    echo "check.sh: $bin/$b does not start here: $(head -3 <<<"$loaded")" >&2
    exit 2
  fi
done
if (( gpus > 0 )); then
  echo "check.sh: driver $(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1);" \
    "the binaries carry the CUDA runtime they were built with (the driver must be as new)"
fi

# NONSTOP_CHECK_LOGS: where the logs go (a folder that comes back from the lent machine)
out=${NONSTOP_CHECK_LOGS:-$(mktemp -d)}
mkdir -p "$out"
results=()
check_start=$SECONDS
budget=${NONSTOP_CHECK_SECONDS:-280}  # the whole check: a lent machine's minutes are few
failed=0
# part NAME COMMAND...: runs one part (in what is left of the check's budget, 120 s at most), records
# PASS or FAILED and its time; a part that cannot run here prints "NOT RUN: why" and exits 3; what a
# part that passed left out is in $out/note.
part() {
  local name=$1 start=$SECONDS rc=0
  shift
  local left=$((budget - (SECONDS - check_start)))
  (( left < 120 )) || left=120
  printf '\n==== check.sh: %s ====\n' "$name"
  if (( left < 10 )); then
    echo "out of the check's ${budget} s" >"$out/why"
    rc=3
  else
    timeout "$left" bash -o pipefail -c '"$@"' part "$@" || rc=$?
  fi
  local took=$((SECONDS - start))
  case $rc in
    0) results+=("$(printf '%-16s PASS     %4ds  %s' "$name" "$took" "$(cat "$out/note" 2>/dev/null)")") ;;
    3) results+=("$(printf '%-16s NOT RUN  %4ds  %s' "$name" "$took" "$(cat "$out/why" 2>/dev/null)")") ;;
    *) results+=("$(printf '%-16s FAILED   %4ds  (exit %d%s)' "$name" "$took" "$rc" \
         "$( ((rc == 124)) && echo ", stopped after ${left} s")")"); failed=1 ;;
  esac
  rm -f "$out/why" "$out/note"
}
not_run() { echo "NOT RUN: $*"; echo "$*" >"$out/why"; exit 3; }
# left_out WHAT: a part that passes says what of it did not run
left_out() { echo "NOT RUN: $*"; printf '(not run: %s) ' "$*" >>"$out/note"; }
export -f not_run left_out
export out bin device gpus pythonpath

# gtest BINARY: one test binary of the bundle or the build; its skipped tests are named (a skip is
# left out, not passed).
gtest() {
  if [[ ! -x "$bin/$1" ]]; then
    left_out "$1 (not built: the NCCL ones need NCCL 2.27 or later)"
    return 0
  fi
  "$bin/$1" 2>&1 | tee "$out/$1.log" | grep -E '^\[ *(OK|FAILED|SKIPPED|PASSED) *\]|Skipped|error'
  local rc=${PIPESTATUS[0]}
  local skipped
  skipped=$(grep -c '^\[  SKIPPED \] [A-Z]' "$out/$1.log")
  if (( skipped > 0 )); then left_out "$skipped test(s) of $1 skipped (its log says why)"; fi
  return "$rc"
}
export -f gtest

# job NAME DEVICE PLANE [nonstop run options...]: runs a job of the test worker and writes its final
# checksum to $out/NAME.sum (WORKER_EXTRA: more options for the test worker)
job() {
  local name=$1 dev=$2 plane=$3
  shift 3
  "$bin/nonstop" run --journal "$out/$name.jsonl" "$@" -- \
    "$bin/nonstop-test-worker" --steps 60 --elements 4000000 --sleep-ms 20 \
    --device "$dev" --data-plane "$plane" ${WORKER_EXTRA:-} >"$out/$name.log" 2>&1 || {
    tail -40 "$out/$name.log" >&2
    echo "check.sh: FAILED: the $name job (log above, $out/$name.log)" >&2
    return 1
  }
  rm -f "$out/job.token" "$out/job.http-token"  # the job's secrets stay here, not with the logs
  grep '"event":"finished"' "$out/$name.jsonl" | grep -o '"checksum":"[0-9a-f]*"' | head -1 |
    cut -d'"' -f4 >"$out/$name.sum"
  [[ -s "$out/$name.sum" ]] || { echo "check.sh: FAILED: the $name job recorded no finished checksum" >&2; return 1; }
}
export -f job
# same NAME OTHER: NAME's checksum equals OTHER's
same() {
  echo "  checksum $(cat "$out/$1.sum") ($1) against $(cat "$out/$2.sum" 2>/dev/null) ($2)"
  cmp -s "$out/$1.sum" "$out/$2.sum" || { echo "check.sh: FAILED: the checksums differ" >&2; return 1; }
}
export -f same
# expect FILE PATTERN WHAT: prints FILE's first line matching PATTERN, or fails saying WHAT is missing
expect() {
  grep -h "$2" "$1" | head -1 || { echo "check.sh: FAILED: $3" >&2; return 1; }
}
export -f expect

tests_part() {
  local rc=0
  gtest cuda_runtime_test || rc=1
  gtest nccl_data_plane_test || rc=1
  if (( gpus == 0 )); then
    left_out "cuda_copier_test (no GPU here)"
  else
    gtest cuda_copier_test || rc=1
  fi
  if (( gpus < 2 )); then
    left_out "nccl_gpu_test (needs two GPUs; this machine has $gpus)"
  else
    gtest nccl_gpu_test || rc=1
  fi
  return $rc
}
export -f tests_part
part "gpu tests" tests_part

recovered_part() {
  job host host staged --nproc 4 --spares 1 --inject none || return 1
  job device "$device" staged --nproc 4 --spares 1 --inject kill:rank=2,step=30 || return 1
  expect "$out/device.jsonl" '"event":"recovery_end"' \
    "the $device job recorded no recovery_end (was rank 2 killed?)" || return 1
  echo "check.sh: 4 workers and a spare, 16 MB of state each on $device:0, rank 2 killed at step 30:"
  same device host
}
export -f recovered_part
part "recovered job" recovered_part

# Sharded state on the device: the accumulator sharded over groups of 2 (a shard view), reduced
# with ReduceShardsOnDevice and gathered with GatherShardsOnDevice; the spare copies only shard 1
# into its device memory.
sharded_part() {
  [[ -s "$out/host.sum" ]] || not_run "the host job of the part before failed"
  WORKER_EXTRA="--shard-group 2" job sharded "$device" staged --nproc 4 --spares 1 \
    --inject kill:rank=1,step=30 || return 1
  expect "$out/sharded.log" "re-sharded: copied shard" "no spare copied its shard in the sharded job" ||
    return 1
  echo "check.sh: the same, sharded over groups of 2 on $device:0, rank 1 killed at step 30:"
  same sharded host
}
export -f sharded_part
part "sharded job" sharded_part

# The NCCL data plane: one rank per GPU (NCCL refuses two on one; a worker takes cuda:(id mod GPUs)).
nccl_part() {
  [[ -x "$bin/nccl_gpu_test" ]] || not_run "the NCCL data plane is not built (CMake found no NCCL 2.27 or later)"
  (( gpus >= 2 )) || not_run "the NCCL data plane needs two GPUs or more (one rank on each); this machine has $gpus"
  [[ -s "$out/host.sum" ]] || not_run "the host job failed"
  local what
  if (( gpus >= 3 )); then
    local n=$(( gpus - 1 < 4 ? gpus - 1 : 4 ))
    job nccl cuda nccl --nproc "$n" --spares 1 --inject kill:rank=1,step=30 || return 1
    what="$n workers and a spare, one GPU each, rank 1 killed (the spare takes it)"
  else
    job nccl cuda nccl --nproc 2 --spares 0 --inject kill:rank=1,step=30 || return 1
    what="2 workers on 2 GPUs, rank 1 killed (the job shrinks to one)"
  fi
  grep -h "NCCL communicator" "$out/nccl.log" | head -4 || true
  echo "check.sh: the NCCL data plane, $what:"
  same nccl host
}
export -f nccl_part
part "nccl job" nccl_part

# The Python package with CUDA tensors (docs/gpu.md "Python"): 3 workers and a spare on cuda:0,
# the model, AdamW's state and the gradient buffer on it, rank 1 killed at step 20, against the same
# job without a fault; then a model sharded over groups of 2 (ZeRO-1) with its state in host memory.
python_part() {
  local py=${NONSTOP_PYTHON:-python3}
  [[ -n "$bundle" ]] || py=${NONSTOP_PYTHON:-/usr/bin/python3}
  (( gpus > 0 )) || not_run "the Python jobs on CUDA tensors need a GPU"
  local module suffix
  module=$(ls "$pythonpath"/nonstop/_core*.so 2>/dev/null | head -1)
  [[ -n "$module" ]] || not_run "no Python package in $pythonpath"
  suffix=$("$py" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))' 2>/dev/null)
  [[ "$module" == *"$suffix" ]] ||
    not_run "the package was built for another Python ($(basename "$module")); $py takes *$suffix"
  PYTHONPATH="$pythonpath" "$py" -c 'import nonstop' ||
    { echo "check.sh: FAILED: $py cannot import the package built for it" >&2; return 1; }
  PYTHONPATH="$pythonpath" "$py" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' ||
    not_run "$("$py" -c 'import torch; print("torch", torch.__version__)' 2>&1 | tail -1) has no CUDA here (NONSTOP_PYTHON names another Python)"
  pyjob() {  # NAME [nonstop run options...]: every rank's final state digest, one per line
    local name=$1
    shift
    "$bin/nonstop" run --journal "$out/$name.jsonl" "$@" -- "$py" tests/python/trainer.py --steps 30 \
      --device cuda --wait-for-joins 4 --journal "$out/$name.jsonl" ${PY_EXTRA:-} >"$out/$name.log" 2>&1 || {
      tail -40 "$out/$name.log" >&2
      echo "check.sh: FAILED: the $name job (log above)" >&2
      return 1
    }
    grep -o 'final rank=[0-9]* .* state=[0-9a-f]*' "$out/$name.log" | grep -o 'state=[0-9a-f]*' | sort -u
  }
  export PYTHONPATH="$pythonpath"
  local clean kill sh_clean sh_kill
  clean=$(pyjob py-clean --nproc 3 --spares 1 --inject none) || return 1
  kill=$(pyjob py-kill --nproc 3 --spares 1 --heartbeat-timeout-ms 1000 --inject kill:rank=1,step=20) || return 1
  echo "check.sh: Python, CUDA tensors, 3 workers and a spare on cuda:0, rank 1 killed at step 20:"
  echo "  ${kill} (recovered) against ${clean} (no fault)"
  [[ -n "$clean" && "$clean" == "$kill" && $(wc -l <<<"$kill") == 1 ]] ||
    { echo "check.sh: FAILED: the Python jobs' states differ"; return 1; }
  export PY_EXTRA="--shard-group 2 --wait-for-joins 5"  # 4 workers and a spare: the last value wins
  sh_clean=$(pyjob py-shard-clean --nproc 4 --spares 1 --inject none) || return 1
  sh_kill=$(pyjob py-shard-kill --nproc 4 --spares 1 --heartbeat-timeout-ms 1000 --inject kill:rank=1,step=20) ||
    return 1
  echo "check.sh: Python, a sharded model on cuda:0, 4 workers and a spare, rank 1 killed at step 20:"
  echo "  $(tr '\n' ' ' <<<"$sh_kill")(recovered) against $(tr '\n' ' ' <<<"$sh_clean")(no fault)"
  [[ -n "$sh_clean" && "$sh_clean" == "$sh_kill" && $(wc -l <<<"$sh_kill") == 2 ]] ||
    { echo "check.sh: FAILED: the sharded Python jobs' states differ (or are not one per shard)"; return 1; }
}
export -f python_part
export bundle
part "python jobs" python_part

# The staged all-reduce's bus bandwidth against the host ring, a device-host-device copy and raw TCP.
staged_part() {
  (( gpus > 0 )) || not_run "the staged all-reduce's bandwidth needs a GPU"
  "$bin/nonstop-bench-staged" --device cuda --world 4 --sizes 4,64,256 --repeats 3
}
export -f staged_part
part "staged bench" staged_part

# The world-invariant sum on the device: items in tenths folded into tree partials and summed by
# Session::AllReduceTreeOnDevice, 4 workers and a spare with a kill, against 3 workers in host
# memory without a fault (the bits depend on the order of the additions).
tree_part() {
  WORKER_EXTRA=--tree job tree-host host staged --nproc 3 --spares 0 --inject none || return 1
  WORKER_EXTRA=--tree job tree-device "$device" staged --nproc 4 --spares 1 \
    --inject kill:rank=2,step=30 || return 1
  echo "check.sh: world-invariant sums on $device:0, 4 workers and a spare, rank 2 killed, against 3 workers"
  echo "  in host memory without a fault:"
  same tree-device tree-host
}
export -f tree_part
part "tree sums" tree_part

# Not the GPU: the state copy against raw TCP on this machine's cores (issue 27, point 4), which the
# project's 2-core machines cannot show (two CRC passes and two kernel copies share their 2 cores).
copy_part() {
  echo "check.sh: the state copy against raw TCP on $(nproc) cores:"
  "$bin/nonstop-bench-state-copy" --sizes 64,256,1024 --repeats 3
}
export -f copy_part
part "state copy" copy_part

printf '\n==== check.sh: summary (%s, %d GPU(s), jobs on %s; logs in %s) ====\n' \
  "$([[ -n "$bundle" ]] && echo "bundle $bundle" || echo build)" "$gpus" "$device" "$out"
printf '%s\n' "${results[@]}"
echo "docs/gpu.md says what exists and what this does not check."
exit $failed
