// Controller ↔ worker messages (docs/protocol.md). Each is one control frame
// whose payload is a JSON object; the frame type says which message it is.
// Decoding never trusts the peer: a missing or ill-typed field is an
// INVALID_ARGUMENT that names the field, never an exception or a crash.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "control/fault_spec.h"
#include "nonstop/status.h"

namespace nonstop::control {

enum MessageType : uint16_t {
  kMsgJoin = 10,       // worker → controller: who I am
  kMsgPlan = 11,       // controller → worker: generation, members, resume step
  kMsgHeartbeat = 12,  // worker → controller: alive, last completed step
  kMsgProgress = 13,   // worker → controller: a step completed, with metrics
  kMsgFinished = 14,   // worker → controller: training done, final checksum
  kMsgFailure = 15,    // worker → controller: I saw a fault
  kMsgShutdown = 16,   // controller → worker: the job is over, exit
  kMsgAbort = 17,      // controller → worker: generation g is over, abort what is in flight
  kMsgReady = 18,      // worker → controller: aborted; my state holds step s
  kMsgRecovered = 19,  // worker → controller: adopted generation g (connections, state copied)
  kMsgInjected = 20,   // worker → controller: I am carrying out injected fault f now
  // controller → worker: generation g ends at the step boundary after step s (a resize)
  kMsgDrain = 21,
  // controller → worker or agent: the controller is alive, and its epoch (PingMsg); a
  // worker that hears nothing for SessionOptions::controller_timeout has lost its controller
  kMsgPing = 22,
  // controller → worker: a plan written against the one this worker received last on this
  // connection, or against none (EncodePlanDelta; docs/plan-wire.md)
  kMsgPlanDelta = 23,
  // worker → controller: a request to the job's store (StoreRequestMsg; docs/store.md)
  kMsgStore = 24,
  // controller → worker: its answer (StoreReplyMsg)
  kMsgStoreReply = 25,
  // Controller ↔ agent (one agent per host; docs/protocol.md "Agents"). The
  // agent decides nothing: it registers its host, starts and signals processes
  // when told, and reports what happens to them at once.
  // agent → controller: my host, its capacity, the address its workers advertise
  kMsgAgentRegister = 30,
  // controller → agent: start worker w (a spare or not) with these NONSTOP_* variables
  kMsgAgentStart = 31,
  kMsgAgentSignal = 32,  // controller → agent: send signal s to worker w
  kMsgAgentRenice = 33,  // controller → agent: set worker w's niceness
  // agent → controller: worker w runs as pid p (or could not be started: error)
  kMsgAgentStarted = 34,
  kMsgAgentExited = 35,   // agent → controller: worker w's process ended
  kMsgAgentStopped = 36,  // agent → controller: worker w's process was stopped (SIGSTOP: frozen)
  kMsgAgentHeartbeat = 37,  // agent → controller: the agent is alive (payload: running processes)
  // controller → agent: the ranks its workers hold in a new generation (output prefixes)
  kMsgAgentRanks = 38,
  // agent → controller: release this host's workers at the next step boundary (preempted)
  kMsgAgentLeaving = 39,
  // agent → controller: worker w's process is dying now: the lifeline it held fired as the
  // kernel began its exit (common/lifeline.h); its exit (kMsgAgentExited) follows
  kMsgAgentDying = 40,
};
static_assert(kMsgJoin == 10 && kMsgShutdown == 16 && kMsgInjected == 20 && kMsgDrain == 21 &&
                  kMsgPlanDelta == 23,
              "wire numbers are pinned");

struct JoinMsg {
  int worker_id = -1;
  int64_t pid = 0;
  std::string data_address;
  bool spare = false;
  // the step its state holds (a resumed checkpoint), -1: the initial state
  int64_t state_step = -1;
  // the host whose agent started it (NONSTOP_HOST_ID); empty: not started by an agent
  std::string host_id{};
  // A worker that lost its controller and joins the one that leads now:
  // the generation it is a member of (0: none, a first join or a spare), and
  // whether it has left that generation and waits for the next plan (it
  // answered Ready with state_step). docs/controller-failover.md.
  uint32_t generation = 0;
  bool waiting = false;
  // Sharded optimizer state (docs/sharding.md): the group size G of its
  // registry (0: nothing sharded), and the shard its state holds
  // (state::kEveryShard: every one, the initial state; kNoShard: none).
  int shard_group = 0;
  int held_shard = -1;
  // Whether it seals its state copies (NONSTOP_SEALED_STATE_COPY): every worker of a job must
  // agree, or every copy between two that differ fails.
  bool sealed_copy = false;
};

// ---- controller ↔ agent ----

struct AgentRegisterMsg {
  std::string host_id;  // unique in the job
  int nproc = 0;        // workers this host contributes to the world
  int spares = 0;       // spares it keeps warm
  std::string address;  // the address its workers advertise to peers
  int64_t pid = 0;      // the agent's process
  int running = 0;      // processes it still supervises
  // Those processes, by worker id and pid (an agent that kept its workers
  // while its controller was away; the controller adopts the ones it knows
  // and orders the others killed). Present whenever running > 0.
  std::vector<std::pair<int, int64_t>> workers{};
  // Its capacity follows the job: the agent that `nonstop run` runs for its
  // own machine, the job's only host. The controller then starts there the
  // workers and spares the job needs (a grow beyond nproc included), not a
  // fixed number of slots. Absent: false.
  bool elastic = false;
};

struct AgentStartMsg {
  int worker_id = -1;
  bool spare = false;
  int nice = 0;  // 0: normal priority; >0: a refill warming up in the background
  // Variables for the process, on top of the agent's own (NONSTOP_CONTROLLER,
  // NONSTOP_JOB_TOKEN, NONSTOP_HOST_ID, NONSTOP_DATA_HOST). Only names that
  // start with NONSTOP_, and torchrun's of kOrderedTorchrunVariables, are
  // accepted: an order can never set LD_PRELOAD.
  std::vector<std::pair<std::string, std::string>> env;
};

// The torchrun variables a start order carries (the worker's rank and world,
// the job's name); the agent adds its host's own (MASTER_PORT, OMP_NUM_THREADS,
// TORCHELASTIC_ERROR_FILE).
inline constexpr std::string_view kOrderedTorchrunVariables[] = {"RANK",
                                                                 "WORLD_SIZE",
                                                                 "LOCAL_RANK",
                                                                 "LOCAL_WORLD_SIZE",
                                                                 "GROUP_RANK",
                                                                 "GROUP_WORLD_SIZE",
                                                                 "ROLE_RANK",
                                                                 "ROLE_WORLD_SIZE",
                                                                 "ROLE_NAME",
                                                                 "MASTER_ADDR",
                                                                 "TORCHELASTIC_RUN_ID",
                                                                 "TORCHELASTIC_RESTART_COUNT",
                                                                 "TORCHELASTIC_MAX_RESTARTS"};

struct AgentSignalMsg {
  int worker_id = -1;
  int signal = 0;
};

struct AgentReniceMsg {
  int worker_id = -1;
  int nice = 0;
};

struct AgentStartedMsg {
  int worker_id = -1;
  int64_t pid = 0;    // 0 when it could not be started
  std::string error;  // why it could not be started
};

struct AgentExitedMsg {
  int worker_id = -1;
  int64_t pid = 0;
  int exit_code = 0;
  int signal = 0;  // 0: exited normally
};

struct AgentDyingMsg {
  int worker_id = -1;
  int64_t pid = 0;
};

struct AgentStoppedMsg {
  int worker_id = -1;
  int64_t pid = 0;
  int signal = 0;
};

struct AgentHeartbeatMsg {
  int running = 0;  // processes the agent supervises
};

// Sent before the plan of each generation reaches the workers: which of the
// agent's workers hold which rank (the others hold none). The agent only
// labels their output with it ("[rank 3] …"); it decides nothing by it.
struct AgentRanksMsg {
  uint32_t generation = 0;
  std::vector<std::pair<int, int>> ranks;  // (worker id, rank)
};

// The host is being taken back (Slurm preempts its job: SIGTERM, or the
// --signal sent ahead of it): its workers should leave at the next step
// boundary, a planned shrink rather than a fault (docs/slurm.md).
struct AgentLeavingMsg {
  std::string reason;  // what the agent was told ("SIGTERM")
};

struct PlanMember {
  int worker_id = -1;
  std::string address;
};

// A member that lacks the state of step resume_step - 1 copies it from `sources`.
struct PlanTransfer {
  int receiver = -1;         // worker id
  std::vector<int> sources;  // worker ids holding the state, striped over in this order
};

// Sharded optimizer state (docs/sharding.md): a member that does not hold
// the shard of its rank copies it, at resume_step - 1, from `sources`. The
// controller decides every move (controller::PlanShardMoves); the workers
// carry them out and check them, never plan them again.
struct PlanShardMove {
  int receiver = -1;  // worker id
  int shard = -1;     // the shard it ends holding: its rank mod shard_group
  // worker ids holding that shard, striped over in this order; empty: every copy is lost
  std::vector<int> sources;
};

struct PlanMsg {
  uint32_t generation = 0;
  std::vector<PlanMember> members;  // index = rank
  int64_t resume_step = 0;          // the first step to run
  std::vector<PlanTransfer> transfers;
  std::vector<FaultSpec> faults;  // injected faults not fired yet (tests, demos)
  std::string reason;             // "start", "recovery", …
  // Sharded state: the job's optimizer.shard_group (0: nothing sharded; on
  // the wire only when > 0) and the shard moves, in rank order of the
  // receivers (on the wire only when there are some).
  int shard_group = 0;
  std::vector<PlanShardMove> shard_moves;
};

// A controller's ping. The epoch orders the controllers that led the job
// (docs/controller-failover.md): a worker or agent never follows a
// controller of an epoch older than one it has seen. 0: no epoch (a payload "{}").
struct PingMsg {
  int64_t epoch = 0;
};

struct AbortMsg {
  uint32_t generation = 0;
  std::string reason;
};

struct DrainMsg {
  uint32_t generation = 0;
  int64_t after_step = 0;  // stop at the first step boundary at or after this step
  std::string reason;
};

struct ReadyMsg {
  uint32_t generation = 0;  // the generation this worker aborted
  int64_t step = -1;        // the step its state holds; -1: no valid state
  std::string reason;       // what it saw ("peer reset", "controller abort")
  int held_shard = -2;      // sharded state: the shard it holds (JoinMsg::held_shard); absent: none
};

struct RecoveredMsg {
  uint32_t generation = 0;
  double connect_seconds = 0;
  double transfer_seconds = 0;
  uint64_t bytes_received = 0;
  int sources = 0;
  int refetched_chunks = 0;
  int connections = 0;         // data-plane connections open now (ring neighbours, transfer peers)
  int connections_opened = 0;  // opened since the worker started (the rest were reused)
};

struct InjectedMsg {
  int fault_id = 0;
  std::string description;
};

struct HeartbeatMsg {
  int64_t step = -1;        // last completed step, -1 before the first
  int64_t waiting_ms = -1;  // time blocked in the current collective; -1: not in one (computing)
  // A section the script marked busy (Session::Busy; optional on the wire):
  // its label ("" : none, at most kMaxBusyLabel bytes), how long it has run
  // and how long it may.
  std::string busy{};
  int64_t busy_ms = 0;
  int64_t busy_bound_ms = 0;
};
inline constexpr size_t kMaxBusyLabel = 200;

// The step a worker's state holds when it has none that is valid (a state
// transfer into it was interrupted).
inline constexpr int64_t kNoValidState = -2;

// The largest optimizer.shard_group a join may name.
inline constexpr int kMaxShardGroup = 1024;

struct ProgressMsg {
  int64_t step = 0;
  double loss = 0;
  double step_seconds = 0;
  double tokens_per_second = 0;
  int world_size = 0;
  // the run's steps, if the worker knows them (0: not; optional on the wire)
  int64_t total_steps = 0;
  // how long the replica check before this step took (docs/integrity.md),
  // waiting for the other members' records included, and of that the CRC
  // pass over this member's state; -1: none ran (optional on the wire)
  double replica_check_ms = -1;
  double replica_crc_ms = -1;
};

struct FinishedMsg {
  int64_t step = 0;
  std::string checksum;
};

struct FailureMsg {
  uint32_t generation = 0;
  int64_t step = 0;
  std::string reason;  // "ValueError: bad sample 17": what recurs when the script is at fault
  int exit_code = 10;
  // The script's traceback, if it raised (optional on the wire; at most kMaxTraceback bytes).
  std::string traceback{};
};
inline constexpr size_t kMaxTraceback = 32 * 1024;

struct ShutdownMsg {
  std::string reason;
  int exit_code = 0;
};

// ---- the job's store (docs/store.md) ----
// The controller keeps one key-value store for the job (controller/job_store.h); a worker's
// requests and the answers travel on its control connection. Values are bytes (base64 on the
// wire); keys are UTF-8 text.
enum class StoreOp { kSet, kGet, kAdd, kCompareSet, kAppend, kWait, kCheck, kDeleteKey, kNumKeys };
const char* StoreOpName(StoreOp op);
// Whether the op changes the store (then journaled, and applied once however often it is sent).
bool StoreOpWrites(StoreOp op);
inline constexpr size_t kMaxStoreKeyBytes = 4096;
inline constexpr size_t kMaxStoreValueBytes = 1u << 20;
inline constexpr size_t kMaxStoreKeysPerRequest = 1024;
inline constexpr size_t kMaxStoreKeyBytesPerRequest = 64u << 10;         // the keys of one request
inline constexpr int64_t kMaxStoreTimeoutMs = 100LL * 24 * 3600 * 1000;  // 100 days
inline constexpr size_t kMaxStoreClientId = 64;

struct StoreRequestMsg {
  // The client's (a worker process's store client: a random id) numbering, from 1: the answer
  // names it, and a write sent again after a lost connection is applied once.
  std::string client;
  int64_t seq = 0;
  StoreOp op = StoreOp::kGet;
  // wait and check: 1 to kMaxStoreKeysPerRequest keys; num_keys: none; the others: one.
  std::vector<std::string> keys;
  std::string value;       // set, append: the bytes; compare_set: the desired value
  std::string expected;    // compare_set
  int64_t amount = 0;      // add
  int64_t timeout_ms = 0;  // get, wait: how long the keys are waited for
};

struct StoreReplyMsg {
  int64_t seq = 0;
  // Empty: done. Otherwise what went wrong, and its class: "timeout" (a key did not appear),
  // "limit" (the store is full, a wait too many), "invalid" (add to a value that is no integer).
  std::string error{};
  std::string code{};
  std::string value{};  // get, compare_set: the bytes
  int64_t number = 0;   // add: the new value; num_keys; check and delete_key: 1 or 0
};

std::string Encode(const StoreRequestMsg& m);
std::string Encode(const StoreReplyMsg& m);
Result<StoreRequestMsg> DecodeStoreRequest(std::string_view payload);
Result<StoreReplyMsg> DecodeStoreReply(std::string_view payload);

std::string Encode(const JoinMsg& m);
std::string Encode(const PlanMsg& m);
std::string Encode(const HeartbeatMsg& m);
std::string Encode(const ProgressMsg& m);
std::string Encode(const FinishedMsg& m);
std::string Encode(const FailureMsg& m);
std::string Encode(const ShutdownMsg& m);
std::string Encode(const PingMsg& m);
std::string Encode(const AbortMsg& m);
std::string Encode(const DrainMsg& m);
std::string Encode(const ReadyMsg& m);
std::string Encode(const RecoveredMsg& m);
std::string Encode(const InjectedMsg& m);
std::string Encode(const AgentRegisterMsg& m);
std::string Encode(const AgentStartMsg& m);
std::string Encode(const AgentSignalMsg& m);
std::string Encode(const AgentReniceMsg& m);
std::string Encode(const AgentStartedMsg& m);
std::string Encode(const AgentExitedMsg& m);
std::string Encode(const AgentStoppedMsg& m);
std::string Encode(const AgentDyingMsg& m);
std::string Encode(const AgentHeartbeatMsg& m);
std::string Encode(const AgentRanksMsg& m);
std::string Encode(const AgentLeavingMsg& m);

Result<JoinMsg> DecodeJoin(std::string_view payload);
Result<PlanMsg> DecodePlan(std::string_view payload);

// ---- plans on the wire (docs/plan-wire.md) ----
// A full plan (kMsgPlan) lists every member's worker id and address, so
// sending it to each of N members costs O(N²) bytes: 4.9 GB per recovery at
// 10,000 workers, 493 GB at 100,000. The controller sends kMsgPlanDelta
// instead: the member list written against a base, the plan the worker
// received last on its connection (runs of the base's ranks plus the members
// that are new or moved), or against none (every member an entry: a spare's,
// a first plan); and, with a base, only the transfers the worker takes part
// in (as receiver or source: the others are no concern of it). The rest is
// as in a full plan: the shard moves all of them (every member checks them
// all). The worker rebuilds the PlanMsg a full plan would decode to (with a
// base: its own transfers only), so what follows decoding is unchanged.

// The version of the delta format; a delta of any other version is refused.
// 2: a base is named by fields present only with one (1 read base_generation 0
// as none), and every delta carries the digest of the member list it rebuilds.
inline constexpr int kPlanDeltaVersion = 2;

// A digest of a member list (FNV-1a 64 over worker ids and addresses): a
// delta names its base by generation and this, so a worker that holds
// another member list refuses it instead of rebuilding a wrong one; and it
// carries the digest of the list it rebuilds, so a wrong rebuild (an encoder
// bug, a stale cache at the controller) is refused instead of adopted.
uint64_t MembersDigest(const std::vector<PlanMember>& members);

// A plan's member list written against a base: computed once per plan and
// base, written into every delta of that plan.
struct PlanMemberRun {
  size_t copy_from = 0;  // count > 0: the base's ranks [copy_from, copy_from + count)
  size_t count = 0;      // 0: `member`, an entry of its own
  PlanMember member;
};
struct PlanMembersDelta {
  bool has_base = false;  // false: no base, every member an entry
  uint32_t base_generation = 0;
  uint64_t base_digest = 0;
  std::vector<PlanMemberRun> runs;
};
PlanMembersDelta DiffMembers(const PlanMsg& plan, const PlanMsg* base);

// `plan` with `members` (DiffMembers(plan, …)) and `transfers` in place of
// the plan's own (with a base: the receiving worker's). `members_digest` is
// MembersDigest(plan.members), which a caller encoding many deltas of one
// plan computes once (from the plan, not from `members`: a `members` of
// another plan is then caught at the worker); the three-argument form
// computes it, O(members).
std::string EncodePlanDelta(const PlanMsg& plan, const PlanMembersDelta& members,
                            const std::vector<PlanTransfer>& transfers, uint64_t members_digest);
std::string EncodePlanDelta(const PlanMsg& plan, const PlanMembersDelta& members,
                            const std::vector<PlanTransfer>& transfers);

// Rebuilds a plan from a delta and the plan the worker holds (nullptr:
// none). INVALID_ARGUMENT names what is wrong: another version, a base this
// worker does not hold (generation or digest), a run outside the base or
// copying a base rank twice, a rebuilt member list whose digest is not the
// delta's, a field as DecodePlan's. A delta can never make a worker hold more
// members than its base has plus the delta's own entries.
Result<PlanMsg> DecodePlanDelta(std::string_view payload, const PlanMsg* base);

Result<HeartbeatMsg> DecodeHeartbeat(std::string_view payload);
Result<ProgressMsg> DecodeProgress(std::string_view payload);
Result<FinishedMsg> DecodeFinished(std::string_view payload);
Result<FailureMsg> DecodeFailure(std::string_view payload);
Result<ShutdownMsg> DecodeShutdown(std::string_view payload);
Result<PingMsg> DecodePing(std::string_view payload);
Result<AbortMsg> DecodeAbort(std::string_view payload);
Result<DrainMsg> DecodeDrain(std::string_view payload);
Result<ReadyMsg> DecodeReady(std::string_view payload);
Result<RecoveredMsg> DecodeRecovered(std::string_view payload);
Result<InjectedMsg> DecodeInjected(std::string_view payload);
Result<AgentRegisterMsg> DecodeAgentRegister(std::string_view payload);
Result<AgentStartMsg> DecodeAgentStart(std::string_view payload);
Result<AgentSignalMsg> DecodeAgentSignal(std::string_view payload);
Result<AgentReniceMsg> DecodeAgentRenice(std::string_view payload);
Result<AgentStartedMsg> DecodeAgentStarted(std::string_view payload);
Result<AgentExitedMsg> DecodeAgentExited(std::string_view payload);
Result<AgentStoppedMsg> DecodeAgentStopped(std::string_view payload);
Result<AgentDyingMsg> DecodeAgentDying(std::string_view payload);
Result<AgentHeartbeatMsg> DecodeAgentHeartbeat(std::string_view payload);
Result<AgentRanksMsg> DecodeAgentRanks(std::string_view payload);
Result<AgentLeavingMsg> DecodeAgentLeaving(std::string_view payload);

// A host id: 1 to 64 characters from [A-Za-z0-9._-] (it appears in logs,
// journal records and process environments). OK, or INVALID_ARGUMENT saying
// what is wrong with it.
Status CheckHostId(std::string_view host_id);

}  // namespace nonstop::control
