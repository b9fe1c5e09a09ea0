#!/usr/bin/env bash
# A real Slurm on this machine (issue 15): munge, slurmctld, and one slurmd per
# network namespace (own hostname and address, on one bridge), then
# examples/slurm/nonstop.sbatch submitted with sbatch, four times:
#   1. fault-free;
#   2. with every process of one node's job step killed mid-run, and again
#      with the node marked down by Slurm (scontrol): each job must finish
#      bitwise equal to the fault-free run, the spare node taking the lost
#      ranks;
#   4. on two nodes, with examples/slurm/capacity.sbatch submitted to a
#      low-priority partition: its node joins and the world grows to 3; a
#      high-priority job then preempts it (SIGTERM, GraceTime), its workers are
#      released at a step boundary and the world shrinks to 2, with no fault and
#      no step lost. The recipe is world-invariant (docs/determinism.md), so
#      every step's loss and the final parameters must equal the fault-free
#      run's bit for bit.
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
PreemptType=preempt/partition_prio
PreemptMode=CANCEL
PartitionName=main Nodes=$(IFS=,; echo "${nodes[*]}") Default=YES MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF
PartitionName=capacity Nodes=$(IFS=,; echo "${nodes[*]}") MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=CANCEL GraceTime=30
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
  [ "$(sinfo -h -o '%T' -t idle | wc -l)" -ge 1 ] && [ "$(sinfo -h -N -p main -o '%N %T' | grep -c idle)" -eq 3 ] && break
  sleep 0.2
done
sinfo -h -N -p main -o '%N %T' | grep -c idle | grep -qx 3 || fail "the nodes did not come up: $(sinfo -N 2>&1)"
echo "slurm test: Slurm $(slurmctld -V | awk '{print $2}') up; nodes: $(sinfo -h -N -p main -o '%N@%o' | tr '\n' ' ')"

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
  steps: 150
  global_batch: 16
  micro_batch: 2
  seed: 7
  log_every: 10
  determinism: world-invariant
optimizer:
  lr: 3.0e-3
  min_lr: 3.0e-4
  warmup_steps: 3
data:
  shards: $dir/data
  prepare_from: $dir/corpus.txt
EOF
"$bin/nonstop" data prepare "$dir/corpus.txt" --output "$dir/data" > /dev/null

train=("$bin/nonstop-train" "$dir/recipe.yaml" --throttle-ms 100)
# submit NAME [sbatch options]: the main job (on all three nodes unless the
# options say otherwise); prints the job id.
submit() {
  local name=$1
  shift
  NONSTOP_BIN=$bin NONSTOP_RUN_DIR=$dir/$name sbatch --parsable --nodes=3 --chdir="$dir" --output="$dir/$name.out" \
    "$@" "$root/examples/slurm/nonstop.sbatch" -- "${train[@]}"
}
# The journal's readers (scripts/journal.py; a journal not written yet reads as empty).
journal() { /usr/bin/python3 "$root/scripts/journal.py" "$@"; }
journal_field() { journal field "$@"; }  # JOURNAL EVENT FIELD: the field of the last such record
count() { journal count "$@"; }          # JOURNAL EVENT: how many such records
world() { journal world "$@"; }          # JOURNAL: the newest plan's world size (0: none yet)
losses() { journal losses "$@"; }        # JOURNAL: "step loss" per step record, every bit
last_step() { journal last-step "$@"; }  # JOURNAL: the highest completed step (-1: none)
# until_true SECONDS WHAT CONDITION: evaluates the condition (a string, anew each time) every 0.2 s.
until_true() {
  for _ in $(seq $(($1 * 5))); do eval "$3" && return 0; sleep 0.2; done
  local f tails=""
  for f in "$dir"/elastic.out "$dir"/capacity.out; do [ -f "$f" ] && tails+=$'\n'"--- $f:"$'\n'"$(tail -15 "$f")"; done
  fail "$2 within $1 s$tails"
}
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

# node_fault NAME HOW: a job whose second node fails at step 15, HOW: "kill"
# (every process of its job step SIGKILLed, slurmd lives on) or "down" (Slurm
# marks the node down and kills its task itself). It must finish on the
# fault-free checksum after one recovery.
node_fault() {
  local name=$1 how=$2 job sum
  job=$(submit "$name")
  echo "slurm test: job $job submitted; node ${nodes[1]} fails at step 15 ($how)"
  until_true 120 "the job did not reach step 15" '[ "$(last_step "$dir/$name/journal.jsonl")" -ge 15 ]'
  if [ "$how" = kill ]; then
    local slurmd_pid p killed=()
    slurmd_pid=$(cat "$dir/spool/${nodes[1]}.pid")
    for p in $(ip netns pids "${nodes[1]}"); do
      [ "$p" = "$slurmd_pid" ] && continue
      kill -9 "$p" 2>/dev/null && killed+=("$p")
    done
    echo "slurm test: killed ${#killed[@]} process(es) of node ${nodes[1]} (its job step: slurmstepd, the agent, its worker)"
  else
    scontrol update "nodename=${nodes[1]}" state=down reason=nonstop-test
    echo "slurm test: node ${nodes[1]} marked down (slurmctld: $(grep -o "node ${nodes[1]} state set to DOWN" \
      "$dir/log/slurmctld.log" | tail -1))"
  fi
  wait_done "$job" "$name"
  sum=$(journal_field "$dir/$name/journal.jsonl" finished checksum)
  grep -E "host .* lost|fault:|generation [0-9]+:|recovery report|handled:|job finished" "$dir/$name.out" |
    sed 's/^/  /' || true
  [ -n "$sum" ] || fail "the job with the node fault ($how) did not finish: $(tail -30 "$dir/$name.out")"
  echo "slurm test: parameter checksum $sum with the node fault ($how), $clean_sum without"
  [ "$sum" = "$clean_sum" ] || fail "the checksums differ"
  grep -q "recovery report: 1 recovery" "$dir/$name.out" || fail "no recovery was reported: $(tail -30 "$dir/$name.out")"
}
node_fault faulty kill
node_fault down down
# A node marked down comes back (ReturnToService=2) once its slurmd answers.
until_true 60 "node ${nodes[1]} did not return to service" \
  '[ "$(sinfo -h -N -p main -n "${nodes[1]}" -o %T)" = idle ]'

# ---- elastic capacity: a preemptible job grows the job, a preemption shrinks it ----
ej=$dir/elastic/journal.jsonl
elastic=$(NONSTOP_SPARE_NODES=0 NONSTOP_CONTROLLER_FLAGS="--max-world 3" submit elastic --nodes=2 \
  "--nodelist=${nodes[0]},${nodes[1]}")
echo "slurm test: job $elastic submitted on ${nodes[0]} and ${nodes[1]} (world 2, up to 3)"
until_true 120 "the elastic job did not train" '[ "$(last_step "$ej")" -ge 2 ]'
cap=$(NONSTOP_BIN=$bin NONSTOP_RUN_DIR=$dir/elastic sbatch --parsable --partition=capacity \
  "--nodelist=${nodes[2]}" --chdir="$dir" --output="$dir/capacity.out" "$root/examples/slurm/capacity.sbatch" -- \
  "${train[@]}")
echo "slurm test: capacity job $cap submitted to the low-priority partition on ${nodes[2]}"
until_true 120 "the world did not grow to 3" '[ "$(world "$ej")" -eq 3 ]'
grown=$(last_step "$ej")
echo "slurm test: the world grew to 3 at step $grown"
until_true 60 "no step completed at world 3" '[ "$(last_step "$ej")" -ge $((grown + 3)) ]'
[ "$(count "$ej" finished)" -eq 0 ] || fail "the job finished before the preemption: give it more steps"
high=$(sbatch --parsable --partition=main "--nodelist=${nodes[2]}" --chdir="$dir" --output=/dev/null \
  --job-name=nonstop-high --wrap "sleep 1")
echo "slurm test: high-priority job $high submitted on ${nodes[2]}: it preempts the capacity job"
until_true 60 "the capacity job's agent did not ask to leave" '[ "$(count "$ej" host_leaving)" -ge 1 ]'
until_true 60 "the world did not shrink to 2" '[ "$(world "$ej")" -eq 2 ]'
echo "slurm test: the world shrank to 2 at step $(last_step "$ej")"
wait_done "$elastic" elastic
wait_done "$cap" capacity
grep -E "host .* (registered|leaves|left)|resize:|generation [0-9]+:|recovery report|handled:" "$dir/elastic.out" |
  sed 's/^/  /' || true
grep -E "left the job" "$dir/capacity.out" | sed 's/^/  /' || true
grep -q "left the job (SIGTERM): its workers were released" "$dir/capacity.out" ||
  fail "the capacity job's agent did not leave cleanly: $(tail -20 "$dir/capacity.out")"
[ "$(count "$ej" step)" -eq 150 ] || fail "the elastic job's journal has $(count "$ej" step) step records, not 150"
[ "$(count "$ej" fault)" -eq 0 ] || fail "the elastic job saw a fault: $(grep fault: "$dir/elastic.out")"
[ "$(count "$ej" recovery_start)" -eq 0 ] || fail "the elastic job ran a recovery"
[ "$(count "$ej" host_left)" -eq 1 ] || fail "the capacity host did not leave as planned"
grep -q "recovery report: 0 recoveries, 2 resizes, 0 completed steps lost" "$dir/elastic.out" ||
  fail "expected 2 resizes and nothing lost: $(grep -A3 'recovery report' "$dir/elastic.out")"
sum=$(journal_field "$ej" finished checksum)
[ -n "$sum" ] || fail "the elastic job did not finish: $(tail -30 "$dir/elastic.out")"
losses "$dir/clean/journal.jsonl" > "$dir/clean.losses"
losses "$ej" > "$dir/elastic.losses"
[ "$(wc -l < "$dir/clean.losses")" -eq 150 ] || fail "the fault-free job journaled $(wc -l < "$dir/clean.losses") steps, not 150"
cmp -s "$dir/clean.losses" "$dir/elastic.losses" ||
  fail "the losses differ from the fault-free run's: $(diff "$dir/clean.losses" "$dir/elastic.losses" | head -5)"
echo "slurm test: all 150 losses bitwise equal to the fault-free run's; parameter checksum $sum, $clean_sum without"
[ "$sum" = "$clean_sum" ] || fail "the checksums differ"
echo "slurm test: PASSED"
