#!/usr/bin/env bash
# Configures and builds nonstop (two parallel jobs: the machines this project
# runs on have two cores; NONSTOP_BUILD_JOBS overrides).
#
#   scripts/build.sh [cmake args]                    ./build: everything (the README's test command)
#   scripts/build.sh --job [cmake args]              ./build: only the main job, nonstop and
#                                                    nonstop-train (the README's first command)
#   scripts/build.sh --sanitize address [cmake args] ./build-asan: ASan + UBSan (fatal)
#   scripts/build.sh --sanitize thread [cmake args]  ./build-tsan: TSan
#   scripts/build.sh --fuzz [cmake args]             ./build-fuzz: the libFuzzer targets (fuzz/)
#
# The sanitizer and fuzzing builds leave out the LibTorch trainer, the Python
# package and the benchmarks, and use clang++-16 (NONSTOP_CLANG overrides; scripts/setup.sh
# installs it): libFuzzer needs clang, and clang 14 cannot compile
# std::source_location with Debian 12's libstdc++. Extra arguments go to
# cmake; NONSTOP_BUILD_TARGETS (space-separated) builds only those targets.
set -euo pipefail
cd "$(dirname "$0")/.."

# ccache keys by paths relative to the checkout, so that a fresh clone in
# another folder (CI's) reuses what an earlier build on this machine compiled.
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$PWD}"
export CCACHE_NOHASHDIR="${CCACHE_NOHASHDIR:-1}"

dir=build
config=(-DCMAKE_BUILD_TYPE=RelWithDebInfo)
job=0
case "${1:-}" in
  --job)
    job=1
    shift
    ;;
  --sanitize)
    case "${2:-}" in
      # the labels scripts/test.sh's asan part runs: the other tests are not built
      address) dir=build-asan; config+=(-DNONSTOP_ENABLE_ASAN=ON "-DNONSTOP_TEST_LABELS=unit;chaos") ;;
      thread) dir=build-tsan; config+=(-DNONSTOP_ENABLE_TSAN=ON) ;;
      *) echo "build.sh: --sanitize takes 'address' (ASan + UBSan) or 'thread' (TSan), got '${2:-}'" >&2; exit 2 ;;
    esac
    shift 2
    ;;
  --fuzz)
    dir=build-fuzz
    config+=(-DNONSTOP_BUILD_FUZZERS=ON -DNONSTOP_BUILD_TESTS=OFF)
    shift
    ;;
esac
if [ "$dir" != build ]; then
  clang="${NONSTOP_CLANG:-clang++-16}"
  if ! command -v "$clang" >/dev/null 2>&1; then
    echo "build.sh: $dir needs $clang (HINT: run scripts/setup.sh)" >&2
    exit 2
  fi
  config+=(-DCMAKE_CXX_COMPILER="$clang" -DNONSTOP_BUILD_TRAIN=OFF -DNONSTOP_BUILD_BENCH=OFF -DNONSTOP_BUILD_PYTHON=OFF)
fi

generator=()
if command -v ninja >/dev/null 2>&1; then generator=(-G Ninja); fi
# A tree configured by --job (on a machine set up with scripts/setup.sh --job)
# did not find the benchmarks' and the Python package's dependencies: the
# whole build configures it again, now that scripts/setup.sh installed them.
job_marker="$dir/.configured-for-the-job-only"
if [ ! -f "$dir/CMakeCache.txt" ]; then
  echo "build.sh: configuring $dir"
  cmake -S . -B "$dir" "${generator[@]}" "${config[@]}" "$@"
  if [ $job -eq 1 ]; then touch "$job_marker"; fi
elif [ $# -gt 0 ] || { [ $job -eq 0 ] && [ -f "$job_marker" ]; }; then
  echo "build.sh: configuring $dir again"
  cmake -S . -B "$dir" "$@"
  if [ $job -eq 0 ]; then rm -f "$job_marker"; fi
fi
targets=()
for t in ${NONSTOP_BUILD_TARGETS:-}; do targets+=(--target "$t"); done
if [ $job -eq 1 ] && [ ${#targets[@]} -eq 0 ]; then
  if ! grep -q '^NONSTOP_BUILD_TRAIN:BOOL=ON' "$dir/CMakeCache.txt" || ! grep -q '^Torch_DIR:.*=/' "$dir/CMakeCache.txt"; then
    echo "build.sh: the main job needs the LibTorch trainer, which $dir was configured without (HINT: run scripts/setup.sh --job, then remove $dir)" >&2
    exit 2
  fi
  targets=(--target nonstop --target nonstop-train)
  echo "build.sh: building the main job only (nonstop, nonstop-train) in $dir; scripts/build.sh builds the tests and benchmarks too"
else
  echo "build.sh: building ${NONSTOP_BUILD_TARGETS:-everything} in $dir"
fi
cmake --build "$dir" -j "${NONSTOP_BUILD_JOBS:-2}" "${targets[@]}"
