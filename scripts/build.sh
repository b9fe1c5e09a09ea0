#!/usr/bin/env bash
# Configures and builds nonstop into ./build (two parallel jobs: the machines
# this project runs on have two cores). Extra arguments go to cmake.
set -euo pipefail
cd "$(dirname "$0")/.."
generator=()
if command -v ninja >/dev/null 2>&1; then generator=(-G Ninja); fi
if [ ! -f build/CMakeCache.txt ]; then
  cmake -S . -B build "${generator[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo "$@"
elif [ $# -gt 0 ]; then
  cmake -S . -B build "$@"
fi
cmake --build build -j "${NONSTOP_BUILD_JOBS:-2}"
