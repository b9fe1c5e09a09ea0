#!/usr/bin/env bash
# Latency of torch.distributed's default store: torch's launcher's TCPStore against the job's
# store under `nonstop run` (docs/store.md), in one invocation, at world 3 on this machine:
# bench/pytorch_store.py under each, then a table with each nonstop/TCPStore ratio (the median
# over the ranks of each rank's median).
#
#   bash bench/pytorch_store.sh [--ops 200] [--nproc 3]
#
# Needs ./build (scripts/build.sh) and Debian's python3-torch; runs on 127.0.0.1 in a
# temporary directory, removed on exit.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
ops=200
nproc=3
while [ $# -gt 0 ]; do
  case "$1" in
    --ops) ops="$2"; shift 2 ;;
    --nproc) nproc="$2"; shift 2 ;;
    *) echo "usage: $0 [--ops N] [--nproc N]" >&2; exit 2 ;;
  esac
done
run=$(mktemp -d)
trap 'rm -rf "$run"' EXIT
py=/usr/bin/python3
port=$("$py" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
(cd "$run" && "$py" -m torch.distributed.run --nproc_per_node "$nproc" --master_addr 127.0.0.1 \
  --master_port "$port" --redirects 1 --tee 1 "$root/bench/pytorch_store.py" --backend gloo \
  --ops "$ops") > "$run/gloo.out" 2>&1 || { tail -30 "$run/gloo.out"; exit 1; }
(cd "$run" && PYTHONPATH="$root/build/python" "$root/build/bin/nonstop" run --nproc "$nproc" --spares 0 \
  --inject none -- "$py" "$root/bench/pytorch_store.py" --backend nonstop --ops "$ops") \
  > "$run/nonstop.out" 2>&1 || { tail -30 "$run/nonstop.out"; exit 1; }
"$py" - "$run/gloo.out" "$run/nonstop.out" <<'PY'
import json, re, statistics, sys
rows = {}
for path in sys.argv[1:]:
    for line in re.findall(r"RESULT (\{.*\})", open(path).read()):
        r = json.loads(line)
        rows.setdefault(r["op"], {}).setdefault(r["backend"], []).append(r["us"])
print(f"{'call':26} {'TCPStore us':>12} {'nonstop us':>11} {'ratio':>6}")
for op, r in rows.items():
    t, n = statistics.median(r["gloo"]), statistics.median(r["nonstop"])
    print(f"{op:26} {t:12.0f} {n:11.0f} {n / t:6.2f}x")
PY
