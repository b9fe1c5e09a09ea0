#!/usr/bin/env bash
# A real Slurm on this machine (issue 15): munge, slurmctld, and one slurmd per
# network namespace (own hostname and address, on one bridge), then
# examples/slurm/nonstop.sbatch submitted with sbatch, twice: fault-free, and
# with every process of one node's job step killed mid-run. The job must finish
# bitwise equal to its fault-free run, the spare node taking the lost ranks.
#
#   bash tests/slurm/run.sh          (root; scripts/setup.sh and scripts/build.sh first)
#
# It never passes silently: a Slurm that cannot start fails the run, saying why.
# Traffic stays on the namespaces' bridge; everything it made is removed on exit.
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
bin=$root/build/bin
fail() { echo "slurm test: FAILED: $*" >&2; exit 1; }
[ "$(id -u)" -eq 0 ] || fail "needs root (network namespaces, slurmd)"
for tool in slurmctld slurmd munged sbatch squeue scontrol ip nsenter unshare; do
  command -v "$tool" > /dev/null || fail "$tool is missing (apt-get install slurm-wlm munge iproute2)"
done
for need in "$bin/nonstop" "$bin/nonstop-train"; do [ -x "$need" ] || fail "$need is missing (scripts/build.sh)"; done

tag=ns$$
net=10.$((200 + $$ % 50)).$(($$ % 250)).
dir=$(mktemp -d /tmp/nonstop-slurm-XXXXXX)
chmod 755 "$dir"
nodes=(${tag}a ${tag}b ${tag}c)
cleanup() {
  set +e
  SLURM_CONF=$dir/slurm.conf scancel --quiet --full "--name=nonstop" 2>/dev/null
  for p in $(cat "$dir"/*.pid 2>/dev/null); do kill -9 "$p" 2>/dev/null; done
  for n in "${nodes[@]}"; do
    for p in $(ip netns pids "$n" 2>/dev/null); do kill -9 "$p" 2>/dev/null; done
    ip netns del "$n" 2>/dev/null
  done
  ip link del "br$tag" 2>/dev/null
  [ -n "${KEEP:-}" ] || rm -rf "$dir"
}
trap cleanup EXIT

# ---- the nodes: a bridge, and a namespace per node ----
ip link add "br$tag" type bridge || fail "cannot create a bridge"
ip addr add "${net}1/24" dev "br$tag"
ip link set "br$tag" up
i=10
for n in "${nodes[@]}"; do
  i=$((i + 1))
  ip netns add "$n" || fail "cannot create network namespace $n"
  ip link add "v$n" type veth peer name eth0 netns "$n"
  ip link set "v$n" master "br$tag"
  ip link set "v$n" up
  ip -n "$n" addr add "${net}$i/24" dev eth0
  ip -n "$n" link set eth0 up
  ip -n "$n" link set lo up
done

# ---- munge and Slurm ----
head -c 1024 /dev/urandom > "$dir/munge.key"
chmod 400 "$dir/munge.key"
mkdir -p "$dir/state" "$dir/spool" "$dir/log"
munged --force --key-file "$dir/munge.key" --socket "$dir/munge.sock" --pid-file "$dir/munged.pid" \
  --log-file "$dir/log/munged.log" --seed-file "$dir/munge.seed" || fail "munged did not start: $(tail -3 "$dir/log/munged.log")"
cat > "$dir/slurm.conf" <<EOF
ClusterName=nonstoptest
SlurmctldHost=$(hostname -s)(${net}1)
SlurmctldPort=$((20000 + $$ % 10000))
SlurmdPort=6818
AuthType=auth/munge
AuthInfo=socket=$dir/munge.sock
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/spool/%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/%n.log
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/builtin
SelectType=select/linear
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SlurmdTimeout=30
KillWait=5
$(i=10; for n in "${nodes[@]}"; do i=$((i + 1)); echo "NodeName=$n NodeAddr=${net}$i CPUs=2 State=UNKNOWN"; done)
PartitionName=main Nodes=$(IFS=,; echo "${nodes[*]}") Default=YES MaxTime=INFINITE State=UP
EOF
export SLURM_CONF=$dir/slurm.conf
slurmctld -i -f "$SLURM_CONF" || fail "slurmctld did not start: $(tail -3 "$dir/log/slurmctld.log")"
for n in "${nodes[@]}"; do
  mkdir -p "$dir/spool/$n"
  # nsenter (not `ip netns exec`, which mounts a fresh /sys without the cgroup
  # hierarchies slurmd needs), and a UTS namespace for the node's hostname.
  nsenter "--net=/run/netns/$n" unshare --uts sh -c "hostname $n; exec slurmd -N $n -f $SLURM_CONF" ||
    fail "slurmd $n did not start: $(tail -3 "$dir/log/$n.log")"
done
for _ in $(seq 100); do
  [ "$(sinfo -h -o '%T' -t idle | wc -l)" -ge 1 ] && [ "$(sinfo -h -N -o '%N %T' | grep -c idle)" -eq 3 ] && break
  sleep 0.2
done
sinfo -h -N -o '%N %T' | grep -c idle | grep -qx 3 || fail "the nodes did not come up: $(sinfo -N 2>&1)"
echo "slurm test: Slurm $(slurmctld -V | awk '{print $2}') up; nodes: $(sinfo -h -N -o '%N@%o' | tr '\n' ' ')"

# ---- the job: a micro Llama on generated text, 2 workers and a spare node ----
for i in $(seq 400); do echo "The quick brown fox $i jumps over the lazy dog; pack my box with five dozen liquor jugs."; done > "$dir/corpus.txt"
cat > "$dir/recipe.yaml" <<EOF
name: micro
model:
  arch: llama
  vocab_size: 256
  dim: 32
  n_layers: 2
  n_heads: 4
  n_kv_heads: 2
  ffn_hidden: 48
  seq_len: 16
train:
  steps: 40
  global_batch: 16
  micro_batch: 2
  seed: 7
  log_every: 10
optimizer:
  lr: 3.0e-3
  min_lr: 3.0e-4
  warmup_steps: 3
data:
  shards: $dir/data
  prepare_from: $dir/corpus.txt
EOF
"$bin/nonstop" data prepare "$dir/corpus.txt" --output "$dir/data" > /dev/null

# submit NAME: sbatch on all three nodes; prints the job id.
submit() {
  NONSTOP_BIN=$bin NONSTOP_RUN_DIR=$dir/$1 sbatch --parsable --nodes=3 --chdir="$dir" --output="$dir/$1.out" \
    "$root/examples/slurm/nonstop.sbatch" -- "$bin/nonstop-train" "$dir/recipe.yaml" --throttle-ms 100
}
journal_field() {  # journal_field JOURNAL EVENT FIELD: the field of the last such record
  /usr/bin/python3 -c 'import json,sys
v=""
for l in open(sys.argv[1]):
    try: r=json.loads(l)
    except ValueError: continue
    if r.get("event")==sys.argv[2]: v=r.get(sys.argv[3],"")
print(v)' "$@" 2>/dev/null
}
last_step() { /usr/bin/python3 -c 'import json,sys
s=-1
for l in open(sys.argv[1]):
    try: r=json.loads(l)
    except ValueError: continue
    if r.get("event")=="step": s=max(s,r["step"])
print(s)' "$1" 2>/dev/null || echo -1; }
wait_done() {  # wait_done JOBID NAME
  for _ in $(seq 1200); do
    [ -z "$(squeue -h -j "$1" 2>/dev/null)" ] && return 0
    sleep 0.25
  done
  fail "job $2 ($1) did not end in 5 minutes: $(tail -20 "$dir/$2.out")"
}

clean=$(submit clean)
echo "slurm test: fault-free job $clean submitted"
wait_done "$clean" clean
clean_sum=$(journal_field "$dir/clean/journal.jsonl" finished checksum)
[ -n "$clean_sum" ] || fail "the fault-free job did not finish: $(tail -20 "$dir/clean.out")"
echo "slurm test: fault-free job finished, parameter checksum $clean_sum"

faulty=$(submit faulty)
echo "slurm test: job $faulty submitted; node ${nodes[1]}'s processes are killed at step 15"
for _ in $(seq 1200); do [ "$(last_step "$dir/faulty/journal.jsonl")" -ge 15 ] && break; sleep 0.25; done
[ "$(last_step "$dir/faulty/journal.jsonl")" -ge 15 ] || fail "the job did not reach step 15: $(tail -20 "$dir/faulty.out")"
slurmd_pid=$(cat "$dir/spool/${nodes[1]}.pid")
killed=()
for p in $(ip netns pids "${nodes[1]}"); do
  [ "$p" = "$slurmd_pid" ] && continue
  kill -9 "$p" 2>/dev/null && killed+=("$p")
done
echo "slurm test: killed ${#killed[@]} process(es) of node ${nodes[1]} (its job step: slurmstepd, the agent, its worker)"
wait_done "$faulty" faulty
sum=$(journal_field "$dir/faulty/journal.jsonl" finished checksum)
grep -E "host .* lost|fault:|generation [0-9]+:|recovery report|handled:|job finished" "$dir/faulty.out" | sed 's/^/  /' || true
[ -n "$sum" ] || fail "the job with the node kill did not finish: $(tail -30 "$dir/faulty.out")"
echo "slurm test: parameter checksum $sum with the node kill, $clean_sum without"
[ "$sum" = "$clean_sum" ] || fail "the checksums differ"
grep -q "recovery report: 1 recovery" "$dir/faulty.out" || fail "no recovery was reported: $(tail -30 "$dir/faulty.out")"
echo "slurm test: PASSED"
