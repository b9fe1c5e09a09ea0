#!/usr/bin/env bash
# Runs the whole test suite (unit, integration, chaos) with CTest.
set -euo pipefail
cd "$(dirname "$0")/.."
ctest --test-dir build --output-on-failure -j 2 "$@"
