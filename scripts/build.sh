#!/usr/bin/env bash
# Configures and builds nonstop (two parallel jobs: the machines this project
# runs on have two cores; NONSTOP_BUILD_JOBS overrides).
#
#   scripts/build.sh [cmake args]                    ./build: everything (the README's command)
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
case "${1:-}" in
  --sanitize)
    case "${2:-}" in
      address) dir=build-asan; config+=(-DNONSTOP_ENABLE_ASAN=ON) ;;
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
if [ ! -f "$dir/CMakeCache.txt" ]; then
  cmake -S . -B "$dir" "${generator[@]}" "${config[@]}" "$@"
elif [ $# -gt 0 ]; then
  cmake -S . -B "$dir" "$@"
fi
targets=()
for t in ${NONSTOP_BUILD_TARGETS:-}; do targets+=(--target "$t"); done
cmake --build "$dir" -j "${NONSTOP_BUILD_JOBS:-2}" "${targets[@]}"
