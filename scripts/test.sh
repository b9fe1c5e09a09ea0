#!/usr/bin/env bash
# Runs the whole test suite (CI runs exactly this, after scripts/build.sh):
#
#   format every C++ file laid out as .clang-format says (scripts/format.sh
#          --check: names each file that differs; scripts/format.sh fixes them)
#   main   every test (unit, integration, chaos) in ./build; arguments given
#          to this script go to this ctest (e.g. -R Plan)
#   asan   the unit and chaos suites under ASan + UBSan, in ./build-asan
#   tsan   the collectives, session, control server, controller and
#          recovery tests under TSan, in ./build-tsan
#   fuzz   each libFuzzer target for NONSTOP_FUZZ_SECONDS (20) seconds
#          (scripts/fuzz.sh), in ./build-fuzz
#
# The asan, tsan and fuzz parts build their own trees first (ccache makes a
# rebuild cheap). NONSTOP_TEST_PARTS picks parts: "format main asan tsan fuzz" by
# default, "main" alone when arguments are given (they select main tests);
# NONSTOP_TEST_PARTS=main is the quick run. Every part runs even when an
# earlier one failed; the script fails if any did, and ends with each
# part's result and time.
#
# Sanitizer reports of every process, the test workers and controllers a test
# starts included, go to files under build-*/sanitizer-reports/: a report
# fails the part even when the process that wrote it was a child whose exit
# the test tolerated, and the reports are printed.
set -euo pipefail
cd "$(dirname "$0")/.."

default_parts="format main asan tsan fuzz"
if [ $# -gt 0 ]; then default_parts=main; fi
parts="${NONSTOP_TEST_PARTS:-$default_parts}"
results=()
details=()  # why a part failed, repeated in the summary (CI shows a log's tail)
failed=0

# The tests each sanitizer part runs (ctest -L / -R). TSan runs the test
# executables of the threaded code, collectives, session, controller and
# recovery (tsan_targets, built alone), and the suites they hold (tsan_tests,
# gtest suite names: a parameterized one is "Instance/Suite.Test").
asan_labels='^(unit|chaos)$'
tsan_targets="collective_test peer_mesh_test session_test state_transfer_test controller_test recovery_chaos_test etcd_test"
tsan_tests='(^|/)(CommunicatorTest|AllReduceTest|PeerMeshTest|SessionTest|ExchangeShardsTest|RunStateTransfersTest|ControlServerTest|ControllerTest|JournalTest|RecoveryTest|LeadershipTest|EtcdClientRealTest)\.'

# llvm-symbolizer from the clang that built the sanitizer trees: an older
# one (Debian's default, 14) prints bare addresses for clang 16's debug info.
llvm_bin=/usr/lib/llvm-16/bin

banner() { printf '\n==== test.sh: %s ====\n' "$*"; }

# run_part NAME COMMAND...: runs one part, records its result and time.
run_part() {
  local name="$1"
  shift
  local start=$SECONDS rc=0
  "$@" || rc=$?
  local took=$((SECONDS - start))
  if [ $rc -eq 0 ]; then
    results+=("$(printf '%-6s ok     %4ds' "$name" "$took")")
  else
    results+=("$(printf '%-6s FAILED %4ds (exit %d)' "$name" "$took" "$rc")")
    failed=1
    collect_details "$name"
  fi
}

# collect_details PART: the failed tests and the sanitizer reports of a
# failed part, one line each, for the summary.
collect_details() {
  local name="$1" dir=build
  case "$name" in asan) dir=build-asan ;; tsan) dir=build-tsan ;; fuzz) dir=build-fuzz ;; format) return 0 ;; esac
  local failed_log="$dir/Testing/Temporary/LastTestsFailed.log"
  if [ -f "$failed_log" ]; then
    while IFS= read -r line; do details+=("$name: failed test ${line#*:}"); done < <(head -n 20 "$failed_log")
    # pytest's short summary (-rfE): which test of a failed file, and its assertion
    local run_log="$dir/Testing/Temporary/LastTest.log"
    if [ -f "$run_log" ]; then
      while IFS= read -r line; do details+=("$name:   $line"); done < <(grep -E '^(FAILED|ERROR) ' "$run_log" | cut -c1-240 | head -n 10)
    fi
  fi
  shopt -s nullglob
  local r
  for r in "$dir"/sanitizer-reports/*; do
    local first
    first=$(grep -m1 -E 'ERROR|WARNING|runtime error' "$r" || head -n 1 "$r")
    details+=("$name: report $r: $(printf '%s' "$first" | cut -c1-160)")
  done
  shopt -u nullglob
}

# clear_failed DIR: forgets the failed tests of an earlier ctest run in DIR.
clear_failed() { rm -f "$1/Testing/Temporary/LastTestsFailed.log"; }

# lsan_note_only FILE: whether FILE holds nothing but LeakSanitizer's note
# that it could not read a thread's registers. LSan writes it when ptrace
# finds the thread gone (ESRCH: the thread ended, or a test killed the
# process during its exit-time leak check) and goes on with the check: a
# leak it then finds follows in the same file, so such a file has more lines.
lsan_note_only() {
  [ -s "$1" ] && ! grep -qvE '^==[0-9]+==Unable to get registers from thread [0-9]+\.$' "$1"
}

# check_reports DIR: fails, printing them, if sanitizers wrote any reports.
# Files with LeakSanitizer's note alone are printed as notes and moved to
# DIR/../sanitizer-notes: they report no finding.
check_reports() {
  local dir="$1" r
  shopt -s nullglob
  local files=("$dir"/*)
  shopt -u nullglob
  local reports=()
  for r in "${files[@]}"; do
    if lsan_note_only "$r"; then
      echo "test.sh: note, not a finding: $(basename "$r"): $(head -n 1 "$r") (LeakSanitizer went on without that thread)"
      mkdir -p "$dir/../sanitizer-notes" && mv "$r" "$dir/../sanitizer-notes/"
    else
      reports+=("$r")
    fi
  done
  if [ ${#reports[@]} -eq 0 ]; then return 0; fi
  echo "test.sh: ${#reports[@]} sanitizer report(s) in $dir:"
  for r in "${reports[@]}"; do
    echo "---- $r"
    head -n 80 "$r"
  done
  return 1
}

part_format() {
  banner "format: every C++ file as .clang-format lays it out"
  local out rc=0
  out=$(bash scripts/format.sh --check 2>&1) || rc=$?
  if [ -n "$out" ]; then echo "$out"; fi
  if [ $rc -ne 0 ]; then
    local line
    while IFS= read -r line; do details+=("format: $line"); done < <(printf '%s\n' "$out" | head -n 12)
  fi
  return $rc
}

part_main() {
  banner "main: every test in ./build"
  clear_failed build
  # The GPU tests (label gpu, issue 30) need a device: compiled here, run where one is.
  local gpu_tests
  gpu_tests=$(ctest --test-dir build -N -L gpu 2>/dev/null | sed -n 's/^Total Tests: //p')
  if [ "${gpu_tests:-0}" != 0 ]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
      echo "test.sh: a GPU is here: the ${gpu_tests} tests labeled gpu run too"
    else
      echo "test.sh: NOT RUN: the ${gpu_tests} tests labeled gpu (compiled; no GPU on this machine;" \
        "bench/gpu/check.sh runs them on one)"
      set -- -LE gpu "$@"
    fi
  fi
  ctest --test-dir build --output-on-failure -j 2 "$@"
}

part_asan() {
  banner "asan: unit and chaos tests under ASan + UBSan (./build-asan)"
  bash scripts/build.sh --sanitize address || return
  local reports="$PWD/build-asan/sanitizer-reports"
  rm -rf "$reports" "$reports/../sanitizer-notes" && mkdir -p "$reports"
  local rc=0
  clear_failed build-asan
  PATH="$llvm_bin:$PATH" ASAN_OPTIONS="detect_leaks=1:log_path=$reports/asan" \
  UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:log_path=$reports/ubsan" \
    ctest --test-dir build-asan --output-on-failure -j 2 -L "$asan_labels" || rc=$?
  check_reports "$reports" || rc=1
  return $rc
}

part_tsan() {
  banner "tsan: collectives, session, control server, controller and recovery tests under TSan (./build-tsan)"
  NONSTOP_BUILD_TARGETS="$tsan_targets" bash scripts/build.sh --sanitize thread || return
  local reports="$PWD/build-tsan/sanitizer-reports"
  rm -rf "$reports" "$reports/../sanitizer-notes" && mkdir -p "$reports"
  local rc=0
  clear_failed build-tsan
  PATH="$llvm_bin:$PATH" \
  TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:log_path=$reports/tsan" \
    ctest --test-dir build-tsan --output-on-failure -j 2 -R "$tsan_tests" || rc=$?
  check_reports "$reports" || rc=1
  return $rc
}

part_fuzz() {
  banner "fuzz: each libFuzzer target for ${NONSTOP_FUZZ_SECONDS:-20}s (./build-fuzz)"
  bash scripts/fuzz.sh "${NONSTOP_FUZZ_SECONDS:-20}"
}

for part in $parts; do
  case "$part" in
    format) run_part format part_format ;;
    main) run_part main part_main "$@" ;;
    asan) run_part asan part_asan ;;
    tsan) run_part tsan part_tsan ;;
    fuzz) run_part fuzz part_fuzz ;;
    *) echo "test.sh: unknown part '$part' in NONSTOP_TEST_PARTS (format main asan tsan fuzz)" >&2; exit 2 ;;
  esac
done

banner "summary"
printf '  %s\n' "${results[@]}"
nfailed=$(printf '%s\n' "${results[@]}" | grep -c FAILED || true)
echo "parts: $(( ${#results[@]} - nfailed )) passed, $nfailed failed"
if [ ${#details[@]} -gt 0 ]; then printf '  %s\n' "${details[@]}"; fi
exit $failed
