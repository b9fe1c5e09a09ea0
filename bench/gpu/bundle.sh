#!/usr/bin/env bash
# Builds here what bench/gpu/check.sh --prebuilt runs on a lent GPU machine,
# into one folder of at most 64 MiB (what a call to that machine carries):
#
#   bench/gpu/bundle.sh [DIR]     (default: build-gpu-bundle, which git ignores)
#
# DIR/bin: nonstop, the test worker, the two benchmarks and the GPU tests,
# stripped. DIR/lib: every library they load that the lent machine's image may
# lack (it has CUDA, NCCL and PyTorch but none of Debian's packages), stripped;
# not glibc's or the compiler's (libstdc++, libgcc_s: the machine's own, at
# least as new on any system whose glibc is), not the driver's (libcuda) and
# not NCCL's: check.sh takes the machine's own NCCL, which matches its driver. DIR/python: the Python package,
# usable only by the Python it was built for (check.sh says NOT RUN for
# another). DIR/MANIFEST: the commit, the glibc the binaries need, the sizes.
set -euo pipefail
caller=$PWD
cd "$(dirname "$0")/../.."

case "${1:-}" in
  -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
  -*) echo "bundle.sh: unknown option '$1' (usage: bench/gpu/bundle.sh [DIR])" >&2; exit 2 ;;
esac
out="${1:-build-gpu-bundle}"  # a DIR given is the caller's; the default, the checkout's
if [[ -n "${1:-}" && "$out" != /* ]]; then out="$caller/$out"; fi
# The folder is emptied first: only a new one, or an earlier bundle.
if [[ -e "$out" && ! -f "$out/MANIFEST" ]] && [[ -n "$(ls -A "$out" 2>/dev/null)" ]]; then
  echo "bundle.sh: $out exists and is not a bundle (no MANIFEST): name a new folder" >&2
  exit 2
fi
limit=$((64 << 20))
bins=(nonstop nonstop-test-worker nonstop-bench-staged nonstop-bench-state-copy
  cuda_runtime_test cuda_copier_test nccl_data_plane_test nccl_gpu_test)

if ! grep -q '^CUDAToolkit_BIN_DIR:.*=/' build/CMakeCache.txt 2>/dev/null && [[ -f build/CMakeCache.txt ]]; then
  echo "bundle.sh: ./build was configured without the CUDA toolkit: the bundle needs the GPU sources" >&2
  exit 2
fi
# The targets this build has (a fresh one: every target, the NCCL ones where NCCL was found).
targets=()
for b in "${bins[@]}"; do
  if [[ ! -f build/build.ninja ]] || grep -q "^build $b: phony" build/build.ninja; then targets+=("$b"); fi
done
NONSTOP_BUILD_TARGETS="${targets[*]} nonstop_python" bash scripts/build.sh
for b in cuda_runtime_test cuda_copier_test nonstop-bench-staged; do
  [[ -x "build/bin/$b" ]] || { echo "bundle.sh: build/bin/$b was not built: no CUDA toolkit found?" >&2; exit 2; }
done

rm -rf "$out"
mkdir -p "$out/bin" "$out/lib"
for b in "${bins[@]}"; do
  if [[ -x "build/bin/$b" ]]; then
    strip --strip-all -o "$out/bin/$b" "build/bin/$b"
  else
    echo "bundle.sh: $b is not built here (the NCCL parts need NCCL 2.27 or later): left out"
  fi
done
if [[ -d build/python/nonstop ]]; then
  mkdir -p "$out/python"
  cp -rL build/python/nonstop "$out/python/"
  find "$out/python" -name '*.so' -exec strip --strip-unneeded {} +
  find "$out/python" -name '__pycache__' -prune -exec rm -rf {} +
fi

# The libraries every binary and the Python module load, but those of glibc, the driver and NCCL.
skip='^(libc|libm|libdl|libpthread|librt|libresolv|libutil|ld-linux-x86-64|libstdc\+\+|libgcc_s|libcuda|libnccl|libpython3[.0-9]*)\.so'
mapfile -t libs < <(find "$out/bin" "$out/python" -type f \( -perm -u+x -o -name '*.so' \) -print0 |
  xargs -0 ldd 2>/dev/null | awk '$2 == "=>" && $3 ~ /^\// {print $1 " " $3}' | sort -u)
for entry in "${libs[@]}"; do
  name=${entry%% *}
  path=${entry#* }
  if [[ "$name" =~ $skip ]]; then continue; fi
  if [[ "$path" == */torch/lib/* ]]; then continue; fi  # the Python module's torch: the machine's own
  cp -L "$path" "$out/lib/$name"
  strip --strip-unneeded "$out/lib/$name" 2>/dev/null || true
done

glibc=$(find "$out" -type f \( -perm -u+x -o -name '*.so*' \) -print0 | xargs -0 objdump -T 2>/dev/null |
  grep -o 'GLIBC_[0-9.]*' | sed 's/GLIBC_//' | sort -uV | tail -1)
size=$(du -sb "$out" | cut -f1)
{
  echo "nonstop GPU bundle of $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- src include apps tests bench || echo ' (with uncommitted changes)'), made $(date -u +%Y-%m-%dT%H:%MZ) on $(. /etc/os-release && echo "$PRETTY_NAME")"
  echo "glibc needed: $glibc"
  echo "CUDA runtime: $(sed -n 's/^#define CUDART_VERSION \([0-9]*\)/\1/p' "$(dirname "$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)")/../include/cuda_runtime_api.h" | awk '{printf "%d.%d (the driver must be as new)", $1 / 1000, ($1 % 1000) / 10}')"
  echo "python module: $(ls "$out"/python/nonstop/*.so 2>/dev/null | xargs -r -n1 basename | tr '\n' ' ')(Python $(ls "$out"/python/nonstop/*.so 2>/dev/null | sed -n 's/.*cpython-\([0-9]\)\([0-9]*\)-.*/\1.\2/p' | head -1) only)"
  echo "size: $size bytes (limit $limit)"
  (cd "$out" && find bin lib python -type f -printf '%s %p\n' | sort -rn | awk '{printf "  %6.1f MiB  %s\n", $1 / 1048576, $2}')
} >"$out/MANIFEST"
cat "$out/MANIFEST"
if (( size > limit )); then
  echo "bundle.sh: $out is $size bytes, over the $limit a call to the GPU machine carries" >&2
  exit 1
fi
echo "bundle.sh: $out is ready: carry it to a GPU machine and run bench/gpu/check.sh --prebuilt $out"
