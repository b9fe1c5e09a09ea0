#!/usr/bin/env bash
# Builds the libFuzzer targets (./build-fuzz, by scripts/build.sh --fuzz) and
# fuzzes each for a bounded time from its seed corpus fuzz/corpus/<target>/.
#
#   scripts/fuzz.sh [seconds-per-target] [target...]    (default: 20 s, every target)
#
# Targets: frame hello control token_shard checkpoint recipe (fuzz/README.md).
# New inputs that reach new code go to build-fuzz/corpus/<target>/, never into
# the repository. Exits non-zero if any target crashes, leaks, hits undefined
# behaviour, takes over 10 s on one input or over 2 GiB of memory: the input
# is saved under build-fuzz/artifacts/<target>/ and the command that replays
# it is printed. NONSTOP_FUZZ_SEED fixes libFuzzer's random seed.
set -euo pipefail
cd "$(dirname "$0")/.."

all_targets=(frame hello control token_shard checkpoint recipe)
seconds="${1:-20}"
if ! [[ "$seconds" =~ ^[1-9][0-9]*$ ]]; then
  echo "fuzz.sh: seconds per target must be a positive integer, got '$seconds'" >&2
  echo "usage: scripts/fuzz.sh [seconds-per-target] [target...]  (targets: ${all_targets[*]})" >&2
  exit 2
fi
shift $(( $# > 0 ? 1 : 0 ))
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then targets=("${all_targets[@]}"); fi
for t in "${targets[@]}"; do
  if [ ! -d "fuzz/corpus/$t" ]; then
    echo "fuzz.sh: unknown target '$t' (targets: ${all_targets[*]})" >&2
    exit 2
  fi
done

echo "fuzz: building the libFuzzer targets into build-fuzz"
NONSTOP_BUILD_TARGETS="$(printf 'fuzz_%s ' "${targets[@]}")" bash scripts/build.sh --fuzz

# llvm-symbolizer from clang 16 (Debian's default, 14, prints bare addresses for its debug info).
export PATH="/usr/lib/llvm-16/bin:$PATH"
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
seed=()
if [ -n "${NONSTOP_FUZZ_SEED:-}" ]; then seed=(-seed="$NONSTOP_FUZZ_SEED"); fi

failed=()
summary=()
for t in "${targets[@]}"; do
  work="build-fuzz/corpus/$t"
  artifacts="build-fuzz/artifacts/$t/"
  log="build-fuzz/logs/$t.log"
  mkdir -p "$work" "$artifacts" "$(dirname "$log")"
  rm -f "$artifacts"*
  dict=()
  if [ -f "fuzz/$t.dict" ]; then dict=(-dict="fuzz/$t.dict"); fi
  echo "fuzz: fuzz_$t for ${seconds}s (seeds: fuzz/corpus/$t, log: $log)"
  start=$(date +%s%N)
  set +e
  "build-fuzz/bin/fuzz_$t" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
    -artifact_prefix="$artifacts" "${dict[@]}" "${seed[@]}" "$work" "fuzz/corpus/$t" >"$log" 2>&1
  rc=$?
  set -e
  elapsed_ms=$(( ($(date +%s%N) - start) / 1000000 ))
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)
  cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1 | awk '{print $2}')
  line=$(printf '%-12s %-4s %4d.%01ds %10s execs %8s/s  cov %s' "$t" "$([ $rc -eq 0 ] && echo ok || echo FAIL)" \
           $((elapsed_ms / 1000)) $((elapsed_ms % 1000 / 100)) "${execs:-?}" "${rate:-?}" "${cov:-?}")
  summary+=("$line")
  if [ $rc -ne 0 ]; then
    failed+=("$t")
    echo "fuzz: fuzz_$t FAILED (exit $rc); the end of its log:"
    tail -n 60 "$log" | sed 's/^/  | /'
    for a in "$artifacts"*; do
      [ -f "$a" ] && echo "fuzz: replay with: build-fuzz/bin/fuzz_$t $a"
    done
  fi
done

echo "fuzz: summary (target, result, time, executions, executions per second, coverage)"
printf '  %s\n' "${summary[@]}"
if [ ${#failed[@]} -gt 0 ]; then
  echo "fuzz: FAILED: ${failed[*]}"
  exit 1
fi
echo "fuzz: all ${#targets[@]} targets ran ${seconds}s each without a failure"
