#!/usr/bin/env bash
# etcd's request rate during a controller failover (docs/leader-discovery.md):
# a real etcd on loopback, two `nonstop controller --etcd` (lease 2 s), one
# `nonstop agent --etcd` with 4 workers (nonstop-test-worker). The leader is
# killed (kill -9) at step 30; the script reads etcd's /metrics
# (grpc_server_started_total, per gRPC method) at the kill and again when the
# standby's takeover record is written, and prints the requests per second in
# between, per method and in all: what the agent, its workers and the standby
# asked of etcd while nobody led. The same window in steady state (before the
# kill) is printed too, for comparison.
#
#   bash bench/leader_discovery_rate.sh [--workers N]
#
# NONSTOP_BIN (default ./build/bin) picks the binaries: point it at an older
# build to measure before a change. Everything listens on 127.0.0.1 only, on
# ports the OS picks; it cleans up on exit.
set -euo pipefail
cd "$(dirname "$0")/.."
workers=4
while [ $# -gt 0 ]; do
  case "$1" in
    --workers) workers="$2"; shift 2 ;;
    *) echo "usage: $0 [--workers N]" >&2; exit 2 ;;
  esac
done
bin=${NONSTOP_BIN:-$PWD/build/bin}
py=/usr/bin/python3
for need in "$bin/nonstop" "$bin/nonstop-test-worker" /usr/bin/etcd "$py"; do
  [ -x "$need" ] || { echo "leader_discovery_rate: $need is missing (scripts/setup.sh, scripts/build.sh)" >&2; exit 2; }
done
dir=$(mktemp -d /tmp/nonstop-leader-rate-XXXXXX)
pids=()
cleanup() { for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$dir"; }
trap cleanup EXIT
free_port() { "$py" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
count() {  # count JOURNAL KIND: how many records of one kind
  "$py" -c 'import json,sys
n=0
for l in open(sys.argv[1]):
    try: n+=json.loads(l).get("event")==sys.argv[2]
    except ValueError: pass
print(n)' "$1" "$2" 2>/dev/null || echo 0
}
metrics() { curl -s "http://$endpoint/metrics" | grep '^grpc_server_started_total' > "$1"; }
now() { date +%s.%N; }

cport=$(free_port); pport=$(free_port)
etcd --name rate --data-dir "$dir/etcd" --listen-client-urls "http://127.0.0.1:$cport" \
  --advertise-client-urls "http://127.0.0.1:$cport" --listen-peer-urls "http://127.0.0.1:$pport" \
  --initial-advertise-peer-urls "http://127.0.0.1:$pport" --initial-cluster "rate=http://127.0.0.1:$pport" \
  --heartbeat-interval 50 --election-timeout 500 --log-level warn > "$dir/etcd.out" 2>&1 &
pids+=($!)
endpoint=127.0.0.1:$cport
for _ in $(seq 100); do curl -s "http://$endpoint/health" | grep -q true && break; sleep 0.1; done

controller() {
  "$bin/nonstop" controller --etcd "$endpoint" --job rate --lease-ttl-s 2 --nnodes 1 \
    --heartbeat-timeout-ms 1000 --job-token-file "$dir/token" --journal "$dir/$1/journal.jsonl" \
    > "$dir/$1.out" 2>&1 &
  pids+=($!)
}
controller a
for _ in $(seq 200); do grep -q "  journal " "$dir/a.out" 2>/dev/null && break; sleep 0.1; done
controller b
for _ in $(seq 200); do grep -q "standing by" "$dir/b.out" 2>/dev/null && break; sleep 0.1; done
NONSTOP_CONTROLLER_TIMEOUT_MS=1500 "$bin/nonstop" agent --etcd "$endpoint" --job rate \
  --job-token-file "$dir/token" --host-id h1 --nproc-per-host "$workers" --spares-per-host 0 \
  --controller-timeout-ms 1500 -- "$bin/nonstop-test-worker" --steps 100000 --sleep-ms 20 \
  > "$dir/agent.out" 2>&1 &
pids+=($!)
for _ in $(seq 600); do [ "$(count "$dir/a/journal.jsonl" step)" -ge 30 ] && break; sleep 0.1; done

# steady state: 3 s while a leads
metrics "$dir/m0"; t0=$(now); sleep 3; metrics "$dir/m1"; t1=$(now)
kill -9 "${pids[1]}"
metrics "$dir/m2"; t2=$(now)
for _ in $(seq 300); do [ "$(count "$dir/b/journal.jsonl" takeover)" -ge 1 ] && break; sleep 0.02; done
metrics "$dir/m3"; t3=$(now)
[ "$(count "$dir/b/journal.jsonl" takeover)" -ge 1 ] || { echo "no takeover"; tail -20 "$dir/b.out" "$dir/agent.out"; exit 1; }

"$py" - "$dir" "$t0" "$t1" "$t2" "$t3" "$workers" <<'EOF'
import re, sys
d, t0, t1, t2, t3, workers = sys.argv[1], *map(float, sys.argv[2:6]), sys.argv[6]
def read(name):
    out = {}
    for l in open(f"{d}/{name}"):
        m = re.match(r'grpc_server_started_total\{grpc_method="(\w+)".*\} (\d+)', l)
        if m: out[m.group(1)] = out.get(m.group(1), 0) + int(m.group(2))
    return out
def rates(a, b, secs):
    a, b = read(a), read(b)
    per = {k: (b.get(k, 0) - a.get(k, 0)) / secs for k in b}
    return {k: v for k, v in per.items() if v > 0}, sum(per.values())
for title, a, b, secs in (("steady (a leads)", "m0", "m1", t1 - t0),
                          ("failover (kill -> takeover)", "m2", "m3", t3 - t2)):
    per, total = rates(a, b, secs)
    detail = ", ".join(f"{k} {v:.1f}" for k, v in sorted(per.items()))
    print(f"{title}: {secs:.2f} s, {total:.1f} etcd requests/s ({detail}); 1 agent, {workers} workers")
EOF
