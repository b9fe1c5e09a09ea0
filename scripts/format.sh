#!/usr/bin/env bash
# Lays out every C++ file of the project as .clang-format says (clang-format-16,
# installed by scripts/setup.sh).
#
#   scripts/format.sh          rewrites the files that differ
#   scripts/format.sh --check  changes nothing; fails naming each file that differs
set -euo pipefail
cd "$(dirname "$0")/.."

tool="${NONSTOP_CLANG_FORMAT:-clang-format-16}"
if ! command -v "$tool" >/dev/null 2>&1; then
  echo "format.sh: $tool not found (HINT: run scripts/setup.sh)" >&2
  exit 2
fi
# The tracked files of a checkout; every file under the source folders otherwise (a tarball).
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  mapfile -t files < <(git ls-files '*.cc' '*.h')
else
  mapfile -t files < <(find src apps include tests bench fuzz examples -name '*.cc' -o -name '*.h' 2>/dev/null | sort)
fi
case "${1:-}" in
  --check)
    bad=()
    for f in "${files[@]}"; do
      if ! "$tool" --dry-run -Werror "$f" >/dev/null 2>&1; then bad+=("$f"); fi
    done
    if [ ${#bad[@]} -gt 0 ]; then
      printf 'format.sh: %d file(s) not laid out as .clang-format says:\n' "${#bad[@]}"
      printf '  %s\n' "${bad[@]}"
      echo "format.sh: HINT: bash scripts/format.sh rewrites them"
      exit 1
    fi
    echo "format.sh: all ${#files[@]} files laid out as .clang-format says"
    ;;
  "") "$tool" -i "${files[@]}" && echo "format.sh: laid out ${#files[@]} files" ;;
  *) echo "format.sh: unknown argument '$1' (none: rewrite; --check: only check)" >&2; exit 2 ;;
esac
