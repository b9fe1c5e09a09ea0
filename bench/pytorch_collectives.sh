#!/usr/bin/env bash
# Bus bandwidth of torch.distributed's all_reduce (float32, int64), all_gather and
# all_to_all_single over nonstop's group against Gloo's, in one invocation, at world 3
# on this machine (issue 51): bench/pytorch_collectives.py under torch's launcher
# (Gloo) and under `nonstop run`, then a table with each nonstop/Gloo ratio.
#
#   bash bench/pytorch_collectives.sh [--mib 1,16] [--iters 10] [--nproc 3]
#
# Needs ./build (scripts/build.sh) and Debian's python3-torch; runs on 127.0.0.1 in a
# temporary directory, removed on exit.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
mib=1,16
iters=10
nproc=3
while [ $# -gt 0 ]; do
  case "$1" in
    --mib) mib="$2"; shift 2 ;;
    --iters) iters="$2"; shift 2 ;;
    --nproc) nproc="$2"; shift 2 ;;
    *) echo "usage: $0 [--mib 1,16] [--iters N] [--nproc N]" >&2; exit 2 ;;
  esac
done
run=$(mktemp -d)
trap 'rm -rf "$run"' EXIT
py=/usr/bin/python3
args=(--mib "$mib" --iters "$iters")
port=$("$py" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
(cd "$run" && "$py" -m torch.distributed.run --nproc_per_node "$nproc" --master_addr 127.0.0.1 \
  --master_port "$port" --redirects 1 --tee 1 "$root/bench/pytorch_collectives.py" --backend gloo \
  "${args[@]}") > "$run/gloo.out" 2>&1 || { tail -30 "$run/gloo.out"; exit 1; }
(cd "$run" && PYTHONPATH="$root/build/python" "$root/build/bin/nonstop" run --nproc "$nproc" --spares 0 \
  --inject none -- "$py" "$root/bench/pytorch_collectives.py" --backend nonstop "${args[@]}") \
  > "$run/nonstop.out" 2>&1 || { tail -30 "$run/nonstop.out"; exit 1; }
"$py" - "$run/gloo.out" "$run/nonstop.out" <<'PY'
import json, re, sys
rows = {}
for path in sys.argv[1:]:
    for line in re.findall(r"RESULT (\{.*\})", open(path).read()):
        r = json.loads(line)
        rows.setdefault((r["op"], r["mib"]), {})[r["backend"]] = r
print(f"{'collective':28} {'MiB':>5} {'gloo GB/s':>10} {'nonstop GB/s':>13} {'ratio':>6}")
for (op, mib), r in rows.items():
    g, n = r["gloo"]["busbw_gbps"], r["nonstop"]["busbw_gbps"]
    print(f"{op:28} {mib:5g} {g:10.3f} {n:13.3f} {n / g:6.2f}x")
PY
