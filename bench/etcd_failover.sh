#!/usr/bin/env bash
# The controller-failover benchmark of docs/controller-failover.md, on the
# reference trainer: llama-tiny, 4 workers and a spare under one agent, two
# `nonstop controller --etcd` and a real etcd on loopback. The leader is
# killed (kill -9) at step 30; the script prints how long until the standby
# took over and the workers rejoined, whether a recovery happened, and
# whether the run ends bitwise equal to the same job run by `nonstop run`.
#
#   bash bench/etcd_failover.sh [--lease-ttl-s N] [--kill-at-step S]
#
# Needs ./build (scripts/build.sh) and etcd (scripts/setup.sh). Everything it
# starts listens on 127.0.0.1 only, on ports the OS picks; it cleans up on exit.
set -euo pipefail
cd "$(dirname "$0")/.."
ttl=2
kill_at=30
while [ $# -gt 0 ]; do
  case "$1" in
    --lease-ttl-s) ttl="$2"; shift 2 ;;
    --kill-at-step) kill_at="$2"; shift 2 ;;
    *) echo "usage: $0 [--lease-ttl-s N] [--kill-at-step S]" >&2; exit 2 ;;
  esac
done
bin=$PWD/build/bin
py=/usr/bin/python3
for need in "$bin/nonstop" "$bin/nonstop-train" /usr/bin/etcd "$py"; do
  [ -x "$need" ] || { echo "etcd_failover: $need is missing (run scripts/setup.sh and scripts/build.sh)" >&2; exit 2; }
done
dir=$(mktemp -d /tmp/nonstop-etcd-bench-XXXXXX)
pids=()
cleanup() { for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$dir"; }
trap cleanup EXIT
free_port() { "$py" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
events() {  # events JOURNAL KIND: the records of one kind, one JSON per line
  "$py" -c 'import json,sys
for l in open(sys.argv[1]):
    try: r=json.loads(l)
    except ValueError: continue
    if r.get("event")==sys.argv[2]: print(json.dumps(r))' "$1" "$2" 2>/dev/null || true
}
train=("$bin/nonstop-train" recipes/llama-tiny.yaml)

echo "reference: nonstop run --nproc 4 --spares 1 (no fault)"
"$bin/nonstop" run --nproc 4 --spares 1 --journal "$dir/ref/journal.jsonl" -- "${train[@]}" > "$dir/ref.out" 2>&1
reference=$(events "$dir/ref/journal.jsonl" finished | head -1 | "$py" -c 'import json,sys; print(json.loads(sys.stdin.read())["checksum"])')

cport=$(free_port); pport=$(free_port)
etcd --name bench --data-dir "$dir/etcd" --listen-client-urls "http://127.0.0.1:$cport" \
  --advertise-client-urls "http://127.0.0.1:$cport" --listen-peer-urls "http://127.0.0.1:$pport" \
  --initial-advertise-peer-urls "http://127.0.0.1:$pport" --initial-cluster "bench=http://127.0.0.1:$pport" \
  --heartbeat-interval 50 --election-timeout 500 --log-level warn > "$dir/etcd.out" 2>&1 &
pids+=($!)
endpoint=127.0.0.1:$cport
for _ in $(seq 100); do curl -s "http://$endpoint/health" | grep -q true && break; sleep 0.1; done

controller() {
  "$bin/nonstop" controller --etcd "$endpoint" --job bench --lease-ttl-s "$ttl" --nnodes 1 \
    --job-token-file "$dir/token" --journal "$dir/$1/journal.jsonl" > "$dir/$1.out" 2>&1 &
  pids+=($!)
}
controller a
for _ in $(seq 200); do [ -s "$dir/token" ] && break; sleep 0.05; done
leader=${pids[-1]}
controller b
"$bin/nonstop" agent --etcd "$endpoint" --job bench --job-token-file "$dir/token" --host-id h1 \
  --nproc-per-host 4 --spares-per-host 1 -- "${train[@]}" > "$dir/agent.out" 2>&1 &
agent=$!
pids+=($agent)
until [ "$(events "$dir/a/journal.jsonl" step | wc -l)" -ge "$kill_at" ]; do sleep 0.05; done
killed_us=$("$py" -c 'import time; print(int(time.time()*1e6))')
kill -9 "$leader"
echo "leader killed at step $(events "$dir/a/journal.jsonl" step | tail -1 | "$py" -c 'import json,sys; print(json.loads(sys.stdin.read())["step"])')"
wait "$agent" || true
for _ in $(seq 100); do [ -n "$(events "$dir/b/journal.jsonl" job_end)" ] && break; sleep 0.1; done
"$py" - "$dir/b/journal.jsonl" "$killed_us" "$reference" <<'PY'
import json, sys
recs = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
killed, reference = int(sys.argv[2]), sys.argv[3]
def first(kind): return next((r for r in recs if r.get("event") == kind), None)
take = first("takeover")
rejoins = [r for r in recs if r.get("event") == "rejoin"]
fin = first("finished")
print(f"leader back (takeover) {(take['time_us'] - killed) / 1000:.0f} ms after the kill" if take else "no takeover")
if rejoins:
    print(f"all {len(rejoins)} rejoined {(max(r['time_us'] for r in rejoins) - killed) / 1000:.0f} ms after the kill; "
          f"their state at the rejoin: step {max(r['state_step'] for r in rejoins)}")
print(f"recoveries: {sum(r.get('event') == 'recovery_start' for r in recs)}")
same = fin is not None and fin["checksum"] == reference
print(f"final checksum {fin['checksum'] if fin else '-'} vs reference {reference}: {'bitwise equal' if same else 'DIFFERENT'}")
sys.exit(0 if same and take else 1)
PY
