#!/usr/bin/env bash
# Installs the Debian packages nonstop needs. Idempotent: when everything is
# already installed it returns at once; otherwise it runs `apt-get update`
# first, then installs.
#
#   scripts/setup.sh        everything: the build, the tests, the benchmarks, the main job
#   scripts/setup.sh --job  only what configuring and building the main job needs
#                           (the README's first command: scripts/build.sh --job)
set -euo pipefail

# The main job: the compiler and build tools, the libraries the runtime and the
# reference trainer link (LibTorch), GoogleTest (CMake configures the tests even
# when only the job is built), the dashboard's dygraphs and the fortunes corpus.
JOB_PACKAGES=(
  build-essential cmake ninja-build ccache pkg-config
  libgtest-dev libgmock-dev
  libcli11-dev nlohmann-json3-dev libyaml-cpp-dev libfmt-dev libcpp-httplib-dev
  libisal-dev  # ISA-L: CRC-32C at memory speed, on every chunk, frame and checkpoint (src/common/crc32c.cc)
  libssl-dev openssl  # libcrypto: the handshake's HMACs and nonces; libssl: etcd and the dashboard over TLS; openssl(1): the tests' certificates
  libtorch-dev libgloo-dev
  fortunes
  prometheus-cpp-dev  # /metrics: histograms, counters and the exposition format (src/controller/job_metrics.cc)
  libjs-dygraphs      # the dashboard's and the report's charts, embedded in the binary (docs/dashboard.md)
)
# Everything else: the tests' services and browsers, the sanitizer builds,
# the benchmarks and the Python package.
PACKAGES=(
  "${JOB_PACKAGES[@]}"
  libbenchmark-dev
  iproute2  # `ip` and `tc`: the namespaces, bridge and veths of the multihost tests (tests/multihost/netns.h), etcd slowed by `tc`
  nftables  # `nft`: the firewall of tests/multihost/etcd_cluster_test.cc's job limited to --data-ports
  e2fsprogs util-linux  # mkfs.ext4, mount, fsfreeze: the hung disk under the journal (tests/integration/run_test.cc)
  clang-16 libclang-rt-16-dev llvm-16
  clang-format-16  # scripts/format.sh and the format part of scripts/test.sh (.clang-format)
  chromium  # the dashboard and report tests open the pages headless (tests/integration/dashboard_test.cc)
  etcd-server  # the controller's standbys coordinate through etcd (tests start a real one; docs/controller-failover.md)
  etcd-client  # `etcdctl`, which the docs' operator steps use (docs/controller-failover.md, docs/security.md)
  # The Python package (python/, src/python) and its tests and examples:
  # Debian's interpreter, pybind11 and PyTorch, and pytest.
  python3-dev pybind11-dev python3-torch python3-pytest
  # Its wheel, built offline and installed into a virtual environment (pyproject.toml, setup.py).
  python3-build python3-setuptools python3-wheel python3-venv python3-pip
  slurm-wlm munge  # tests/slurm/run.sh: a real Slurm in network namespaces (docs/slurm.md)
)
# clang-16 and libclang-rt-16-dev: the sanitizer builds and libFuzzer
# (scripts/build.sh --sanitize/--fuzz, scripts/fuzz.sh); Debian 12's default
# clang 14 cannot compile std::source_location with its libstdc++. llvm-16:
# its llvm-symbolizer, for readable sanitizer stacks.

case "${1:-}" in
  "") ;;
  --job) PACKAGES=("${JOB_PACKAGES[@]}") ;;
  *) echo "setup.sh: unknown argument '$1' (none: everything; --job: the main job's packages only)" >&2; exit 2 ;;
esac

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "setup: all ${#PACKAGES[@]} packages already installed"
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
echo "setup: installing ${#missing[@]} of ${#PACKAGES[@]} packages: ${missing[*]}"
$SUDO apt-get update -q
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${PACKAGES[@]}"
echo "setup: done"
