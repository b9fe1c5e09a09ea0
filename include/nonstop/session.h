// nonstop::Session: one worker's membership in an elastic data-parallel job.
//
// A training program registers what must survive a fault, joins with one
// call, and then calls the Session once per step: reduce gradients, report
// the step. The Session owns the connection to the controller (with
// heartbeats on an internal I/O thread), the data-plane connections to peers
// and the collectives of the current generation.
//
//   nonstop::state::StateRegistry state;       // params, optimizer moments, step
//   state.Register("params", ...);
//   auto session = nonstop::Session::Join(options, &state).value();
//   int64_t step = session->resume_step();
//   while (true) {
//     for (; step < steps; ++step) {
//       ... forward/backward on this rank's micro-batches of `step` ...
//       if (!session->AllReduce(grads).ok()) {      // a fault: in-process recovery
//         step = session->Recover().value() - 1;    // state is current again
//         continue;
//       }
//       ... optimizer update ...
//       session->ReportStep({step, loss, ...});     // after the update, before the next collective
//     }
//     if (session->Finish(steps - 1, checksum).code() != nonstop::StatusCode::kAborted) break;
//     step = session->Recover().value();            // a fault at the very end
//   }
//
// Elasticity: when the world grows or shrinks, the controller asks every
// member to stop at the next step boundary; AllReduce then returns ABORTED
// without losing the step, Recover() adopts the new membership (a joiner
// copies the state from the members), and last_change() tells the loop what
// changed. A released member's Recover() returns CANCELLED: exit cleanly.
//
// Recovery: when any member fails, the controller aborts the generation; the
// collective in flight returns ABORTED or UNAVAILABLE at once. Recover()
// reports the step this worker's state holds, waits for the next
// generation's plan, reuses the connections to surviving peers, copies the
// state from healthy peers if this worker is behind (or serves it to those
// that are), and returns the step to run next. Nothing is rebuilt: the model,
// optimizer, data and threads of a healthy worker stay as they are.
//
// A spare (SessionOptions::spare) joins without a rank: Join() blocks, warm,
// until the controller gives it one (having copied the state it needs), or
// returns CANCELLED if the job ends first.
//
// Thread-safety: a Session is driven by one training thread. No user callback
// ever runs on the internal I/O thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "nonstop/reduce.h"
#include "nonstop/settings.h"
#include "nonstop/state.h"
#include "nonstop/status.h"
#include "nonstop/store.h"

namespace nonstop::collective {
class DataPlane;
}
namespace nonstop::net {
class AbortSignal;
}

namespace nonstop {

// The defaults and the variables FromEnvironment reads are the settings
// registry's (nonstop/settings.h, the entries named beside each field).
struct SessionOptions {
  // "host:port", or several separated by commas (a leader and its standbys,
  // tried in turn); required (settings::kControllerAddress, NONSTOP_CONTROLLER).
  std::string controller_address;
  // Required: the credential this worker's launcher made for it (its keys, never the job token:
  // docs/security.md, "Keys by role"), or the job token itself for a worker started by hand
  // (kJobTokenFd, kJobToken).
  std::string secret;
  int worker_id = settings::kWorkerId.default_value;  // required, unique in the job (kWorkerId)
  // join without a rank (kSpare: NONSTOP_SPARE=1)
  bool spare = settings::kSpare.default_value;
  // The program registers its state after the join (a script that makes its
  // process group before its model): Join returns once this worker has its
  // rank in a plan, with the registry as it is (empty, typically), and copies
  // no state; the program registers its regions in the same registry, then
  // calls Session::CompleteJoin, which copies the peers' state into them where
  // this worker joined a running job (the recovery that promoted it waits for
  // that). Not with sharded state or a resumed checkpoint.
  bool defer_state = false;
  // The address its data port listens on (kDataHost, NONSTOP_DATA_HOST).
  std::string data_host{settings::kDataHost.default_value};
  // The address peers dial (kWorkerAdvertiseAddress). Empty: data_host, or,
  // when data_host is a wildcard (0.0.0.0, ::), the local address of the
  // connection to the controller: the interface that reaches the cluster.
  std::string advertise_address;
  // The range its data port is taken from, both ends included: the first
  // free port, so that a firewall between the hosts can let only these
  // through (kDataPorts, NONSTOP_DATA_PORTS="40000-40099"; docs/ports.md).
  // 0, 0: a port from the OS.
  uint16_t data_port_lo = 0;
  uint16_t data_port_hi = 0;
  std::string host_id;  // the host whose agent started it (kHostId, NONSTOP_HOST_ID); empty: none
  // Where to find the controller that leads when the one it followed is lost:
  // etcd's endpoints (kEtcd, NONSTOP_ETCD) and the job's name there (kEtcdJob,
  // NONSTOP_ETCD_JOB). Empty: the controller_address list is dialed in turn.
  std::string etcd_endpoints;
  std::string etcd_job{settings::kEtcdJob.default_value};
  // The agent's leader file (kLeaderFile, NONSTOP_LEADER_FILE): read instead of asking etcd.
  std::string leader_file;
  // etcd's TLS and user when the worker asks etcd itself (docs/etcd-security.md): kEtcdCacert,
  // kEtcdCert, kEtcdKey, kEtcdAuthFile (paths), kEtcdAllowPlaintext.
  std::string etcd_cacert;
  std::string etcd_cert;
  std::string etcd_key;
  std::string etcd_auth_file;
  bool etcd_allow_plaintext = false;
  // Bound on reaching the controller and being accepted (dial + hello). Once
  // joined, a worker or spare waits for its plan as long as the controller
  // lives: the controller pings every connected worker, and a worker that
  // hears nothing from it for `controller_timeout` has lost it. Between
  // tries the worker backs off exponentially, with jitter (100 ms to 1 s,
  // plus up to half of it at random; docs/controller-failover.md).
  // kConnectTimeoutMs and kWorkerControllerTimeoutMs.
  std::chrono::milliseconds join_timeout{settings::kConnectTimeoutMs.default_value};
  std::chrono::milliseconds controller_timeout{settings::kWorkerControllerTimeoutMs.default_value};
  // A worker that lost its controller keeps training (collectives are peer
  // to peer) and dials again until a controller leads; membership cannot
  // change meanwhile. After this long without one it gives up: it aborts its
  // collective and fails (kLeaderlessTimeoutMs). docs/controller-failover.md.
  std::chrono::milliseconds leaderless_timeout{settings::kLeaderlessTimeoutMs.default_value};
  // Interval of heartbeats to the controller; the controller's heartbeat
  // timeout should be several of these.
  std::chrono::milliseconds heartbeat_interval{200};
  // Bound on one collective. Faults are detected far sooner (connection
  // resets, the controller); this only guards against a silent network.
  std::chrono::milliseconds timeout_collective{300'000};
  // Replica agreement (docs/integrity.md): every this many steps, before the
  // step's first collective, the members compare a CRC of each registered
  // region; a member that differs from the majority copies the majority's
  // state (a fault of kind state_diverged); no majority ends the job with
  // exit 11 naming the region and step. 0: never. The same on every worker
  // (kReplicaCheckEvery, NONSTOP_REPLICA_CHECK_EVERY).
  int replica_check_every = settings::kReplicaCheckEvery.default_value;
  // Checked collectives (docs/integrity.md): a CRC-32C on every piece of the
  // ring and the tree, a damaged piece fetched again from its sender
  // (kCheckedCollectives, NONSTOP_CHECKED_COLLECTIVES).
  bool checked_collectives = settings::kCheckedCollectives.default_value;
  // The sealed state copy (docs/security.md): an AES-GMAC tag on every chunk a state copy sends
  // (kSealedStateCopy, NONSTOP_SEALED_STATE_COPY).
  bool sealed_state_copy = settings::kSealedStateCopy.default_value;
  // MASTER_PORT of TorchrunEnvironment() (kMasterPort, NONSTOP_MASTER_PORT).
  int master_port = settings::kMasterPort.default_value;
  // The device whose memory AllReduceOnDevice sums (issue 30, docs/gpu.md):
  // its buffers are staged through host memory over the TCP collectives. Null:
  // host memory only. State on it is registered with RegisterOnDevice.
  std::shared_ptr<const state::DeviceMemory> device;
  // More devices for Join to health-check (DeviceMemory::Check), beside `device` and those of the
  // registered state: memory the program computes in without registering it (a sharded model's
  // parameters on a GPU, whose registered state is a host copy of them: docs/gpu.md). A worker
  // whose device fails does not join, so a spare with a broken GPU is never promoted.
  std::vector<std::shared_ptr<const state::DeviceMemory>> checked_devices;
  // A spare checks these devices again every this long while it waits for a rank (0 or less: not
  // while it waits), and once more as it is promoted. Either failure is reported to the
  // controller and fails Join: a spare whose device fails while it waits leaves the job (the
  // controller starts another, for up to 3 such failures of a host or of `nonstop run`'s spare
  // pool), one whose device fails as it is
  // promoted fails as a member would (the controller recovers again, without it). kSpareCheckMs,
  // NONSTOP_SPARE_CHECK_MS (1 ms to a day).
  std::chrono::milliseconds spare_check_interval{settings::kSpareCheckMs.default_value};
  // The data plane that moves the device's memory, made from the TCP one and the process's abort
  // signal, for the device `device` names (its index()): gpu::NcclDataPlaneMaker sums it with
  // NCCL (src/gpu/nccl_data_plane.h), gpu::StagedDataPlaneMaker stages it with CUDA streams;
  // with either, the work that writes a buffer must be done (synchronized) before it is passed,
  // as their streams do not wait for the caller's. Null: staged through host memory over the TCP
  // collectives with the device's synchronous copies (which synchronize the device).
  std::function<Result<std::unique_ptr<collective::DataPlane>>(
      std::unique_ptr<collective::DataPlane> tcp, net::AbortSignal* abort)>
      device_data_plane;

  // Reads the variables that `nonstop run` and the agents set for each worker
  // (the registry's worker entries).
  static Result<SessionOptions> FromEnvironment();
};

struct StepReport {
  int64_t step = 0;
  double loss = 0;
  double step_seconds = 0;
  double tokens_per_second = 0;
  // the steps the run will do, if known (0: not): `nonstop run`'s progress line and ETA
  int64_t total_steps = 0;
};

// What the last adopted generation changed, for the training loop to log or
// to adjust its own settings (no collective call needed).
struct MembershipChange {
  uint32_t generation = 0;
  int old_world = 0;  // 0 before the first generation
  int new_world = 0;
  int old_rank = -1;
  int new_rank = -1;
  int64_t resume_step = 0;
  std::string reason;  // "start", "recovery", "resize: shrink on request (…)", "restart"
  // This member's state was copied in from its peers (a spare, a member that
  // was behind or whose state diverged): whatever it kept of the step in
  // flight was computed from another state, and must not be salvaged.
  bool state_copied = false;
};

class SessionImpl;

class Session {
 public:
  // `state` holds what must survive a fault; it must outlive the Session.
  // `state_step` is the step it holds when joining: -1 for the initial
  // state, or the step of a durable checkpoint the program loaded.
  //
  // Started by a launcher (NONSTOP_LIFELINE_FD), Join locks this worker's
  // lifeline ON THE CALLING THREAD and holds it until Finish or the Session's
  // destruction (docs/recovery.md): if the process dies, the kernel releases
  // it as the exit begins and the launcher reports the death at once. The
  // kernel does so when that thread ends, too: call Join on a thread that
  // lives as long as the process (the training thread, the main thread).
  static Result<std::unique_ptr<Session>> Join(SessionOptions options, state::StateRegistry* state,
                                               int64_t state_step = -1);
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  // Call once the program's setup is done, before the forward of its first
  // step. A worker that joined a running job (a spare that took a rank, a
  // newcomer) copied the peers' state in Join and holds that copy until now:
  // whatever the setup did to the registered state meanwhile (its own
  // snapshot load, a re-initialisation) is undone here, so it trains from
  // exactly the peers' state. A no-op for the job's first generation and a
  // restart from a checkpoint (their setup's state stands), and after the
  // first call. A program that never calls it keeps what its setup did (the
  // copy is let go at the first step's collective): nonstop-train adjusts
  // the state it copied to the new world on purpose.
  void BeginTraining();
  // SessionOptions::defer_state: the state is registered now (in the registry
  // given to Join). A worker that joined a running job copies it from its
  // peers here and holds it until BeginTraining, as Join does otherwise; a
  // failure while copying waits for the next plan. FAILED_PRECONDITION without
  // defer_state or when called twice; CANCELLED when the job ended first.
  Status CompleteJoin();

  int rank() const;
  int world_size() const;
  uint32_t generation() const;
  int64_t resume_step() const;  // the first step this generation runs
  int worker_id() const;

  // Sums `data` ([n] fp32) across the members, in place. Bitwise identical on
  // every rank and run to run at a fixed world size.
  Status AllReduce(std::span<float> data);
  // AllReduce of `device_data`, [n] fp32 in the memory of SessionOptions::device
  // (FAILED_PRECONDITION without one): staged through host memory in pieces, with
  // the bits AllReduce gives the same values in host memory. Members may mix the
  // two calls in one collective. With a device_data_plane that sums on the device
  // (NCCL) they may not: every member passes device memory and the bits are NCCL's
  // (docs/gpu.md). With any device_data_plane the work that wrote the buffer must be
  // done (synchronized) before the call.
  Status AllReduceOnDevice(std::span<float> device_data);
  // Overlapped reduction: a step's gradient in buckets, reduced on the
  // Session's communication thread while the caller still computes (the
  // rest of backward). StartAllReduce queues `data` ([n] fp32, summed in
  // place like AllReduce) and returns at once; buckets are reduced one after
  // another in the order they were started, which must be the same on every
  // rank. `data` must stay valid and untouched until WaitAll returns.
  // WaitAll blocks until every started bucket is reduced and returns the
  // first error (ABORTED or UNAVAILABLE: the generation ended). Then no
  // bucket of the step may be used: the step is dropped whole and Recover()
  // redoes it, so the bitwise invariants hold as with AllReduce. Between the
  // two calls the training thread may compute, start more buckets and read
  // aborted(); the other calls wait for the buckets first or must not be made.
  // `done`, if given, is called on the communication thread once the bucket
  // is reduced or skipped, with the first error of the step so far (OK: this
  // bucket holds the sum); it must not call into the Session, and WaitAll
  // returns only after every `done` returned.
  void StartAllReduce(std::span<float> data, std::function<void(const Status&)> done = {});
  // StartAllReduce of `device_data`, [n] fp32 in the memory of SessionOptions::device, summed as
  // AllReduceOnDevice sums it (its copies run on the communication thread too, overlapping the
  // caller's work); host and device buckets may be mixed in one step. Without a device the
  // bucket fails with FAILED_PRECONDITION (WaitAll returns it). With a device_data_plane the work
  // that writes the buffer must be done (synchronized) before the call.
  void StartAllReduceOnDevice(std::span<float> device_data,
                              std::function<void(const Status&)> done = {});
  Status WaitAll();
  // The world-invariant sum (docs/determinism.md): the step's m micro-batches
  // are split over the ranks, ranges[q] = rank q's [first, last); `partials`
  // are this rank's collective::TreeFolder sums for its range. `out` gets the
  // sum over all m in one fixed binary tree: the same bits at every world
  // size. A step boundary, like AllReduce.
  Status AllReduceTree(int m, std::span<const std::pair<int, int>> ranges,
                       std::span<const std::vector<float>> partials, std::span<float> out);
  // The same with every rank's tree nodes given as (level, index) pairs:
  // nodes_of[q] is rank q's list, left to right, and `partials` one sum per
  // node of this rank's list. A step salvaged after a fault needs it: a rank
  // then holds partial sums kept from the step in flight beside those it
  // computes again (collective::PlanTreeStep, docs/determinism.md).
  Status AllReduceTree(int m, std::span<const std::vector<std::pair<int, int>>> nodes_of,
                       std::span<const std::vector<float>> partials, std::span<float> out);
  // The world-invariant sum of partial sums in the memory of SessionOptions::device
  // (FAILED_PRECONDITION without one): `device_partials` (one per node of this rank's range,
  // each out's length) and `device_out` are device buffers; the tree's additions are those of
  // AllReduceTree, made on the host between a copy up and a copy down, so `device_out` gets the
  // same bits. Every data plane stages the tree, NCCL's too (docs/gpu.md).
  Status AllReduceTreeOnDevice(int m, std::span<const std::pair<int, int>> ranges,
                               std::span<const std::span<const float>> device_partials,
                               std::span<float> device_out);
  // The element-wise `op` (nonstop/reduce.h) of every member's `data`, a whole
  // number of `dtype` elements, in place: the same bytes on every rank, and at
  // a fixed world the same bits run to run. A program's own reduction (a token
  // count, a flag, a metric): not a step boundary. INVALID_ARGUMENT, having
  // moved nothing, where `op` does not apply to `dtype` or the size is not a
  // whole number of elements.
  //
  // `group`, here and in the four calls below: 0 for the world, or an id from
  // NewGroup, whose ranks alone take part (`root` and `rank` are then ranks of
  // the group).
  Status AllReduce(std::span<std::byte> data, DType dtype, ReduceOp op, int group = 0);
  // The same reduction, after which this rank holds its chunk of it, elements
  // [rank·n/W, (rank+1)·n/W) of the n; the other chunks are unspecified.
  Status ReduceScatter(std::span<std::byte> data, DType dtype, ReduceOp op, int group = 0);
  // Every member contributes one record of `record_bytes`: `data` holds
  // world_size() records, this rank's at rank() × record_bytes; afterwards
  // each holds its rank's. Not a step boundary.
  Status AllGather(std::span<std::byte> data, size_t record_bytes, int group = 0);
  Status Broadcast(std::span<std::byte> data, int root, int group = 0);
  // Point-to-point (torch.distributed's send and recv): `data` to rank `to` of
  // the world; Recv takes rank `from`'s next Send to this rank into `data`, of
  // the same size. Each direction between two ranks keeps its own order, on a
  // connection of its own, CRC-checked. One thread at a time per peer and
  // direction, on the training thread or beside it, all returned before
  // Recover(); a fault makes them return ABORTED or UNAVAILABLE like a
  // collective. Not a step boundary. INVALID_ARGUMENT for a rank out of the
  // world or this rank's own.
  //
  // `channel` 0 carries the script's own messages, 1 those of collectives made
  // of point-to-point calls (all_to_all, monitored_barrier): a receive of one
  // never takes a message of the other.
  Status Send(int to, std::span<const std::byte> data, int channel = 0);
  Status Recv(int from, std::span<std::byte> data, int channel = 0);
  // Recv from whichever of the world's ranks `from` (others than this one)
  // sends first on channel 0 (torch's recv without a source); returns its
  // rank. It reads each of those peers' direction towards this rank: no Recv
  // from one of them may run beside it.
  Result<int> RecvFromAny(std::span<const int> from, std::span<std::byte> data);
  // A subgroup of this generation's ranks (torch.distributed's new_group):
  // `ranks`, distinct, in the group's rank order, this rank among them; only
  // they call it, each in the same order as the others of the group. Returns
  // the group's id for the collectives' `group`. After a change of membership
  // a group works on while each of its ranks is held by the worker that held
  // it when the group was made; otherwise its collectives return
  // FAILED_PRECONDITION naming the rank that changed (make it again).
  // `timeout` bounds each of its collectives (DEADLINE_EXCEEDED past it; zero:
  // the world's bound, SessionOptions::timeout_collective).
  Result<int> NewGroup(std::vector<int> ranks,
                       std::chrono::milliseconds timeout = std::chrono::milliseconds(0));

  // The job's key-value store (nonstop/store.h): one for the whole job, kept by the controller
  // through recoveries and takeovers. Any thread may use it, for as long as the Session lives.
  Store& store();

  // Sharded optimizer state (ZeRO-1, docs/sharding.md). With a registry whose
  // sharded regions use groups of G (StateRegistry::RegisterShard), the world
  // is world_size() / G groups of G ranks; rank r holds shard r mod G, and
  // Join/Recover leave the registry holding it (a spare or a rank moved by a
  // resize copies it from the shard's holders). 0 / 0 without sharding.
  int shard_group() const;
  int shard() const;
  // The step's gradient reduction with sharded state, a step boundary like
  // AllReduce: `data` (a multiple of G floats, n) is reduce-scattered in this
  // rank's group and its shard all-reduced across the shard's replicas, so
  // that [shard()·n/G, (shard()+1)·n/G) holds the world's sum (bitwise the
  // same on every replica); the rest of `data` is scratch.
  Status ReduceShards(std::span<float> data);
  // All-gather in this rank's group: each rank's shard() of `data` (a
  // multiple of G elements of `element_bytes`) goes to the others; afterwards
  // every rank of the group holds the whole. Not a step boundary.
  Status GatherShards(std::span<std::byte> data, size_t element_bytes);
  // The same two over buffers in the memory of SessionOptions::device
  // (FAILED_PRECONDITION without one; issue 30, docs/gpu.md): staged through
  // host memory over the TCP collectives, with the bits of the host calls.
  // The group's reduce-scatter and all-gather copy the buffer up whole and
  // down again; the replicas' all-reduce then stages the shard in pieces.
  // The sub-groups of nonstop's device data planes (the default,
  // StagedDataPlaneMaker, NcclDataPlaneMaker) stage; a device_data_plane of
  // your own must give sub-groups that do. The work that wrote a buffer must
  // be done (synchronized) before the call.
  Status ReduceShardsOnDevice(std::span<float> device_data);
  Status GatherShardsOnDevice(std::span<std::byte> device_data, size_t element_bytes);
  Status Barrier(int group = 0);

  // True once the current generation has been aborted (a member failed): the
  // step in flight is lost, so a loop can stop computing it and call
  // Recover() at once instead of at its next collective. Cheap; call it
  // between micro-batches.
  bool aborted() const;

  // Tells the controller that `report.step` completed: the registered state
  // now holds that step. Cheap; never blocks on a peer.
  void ReportStep(const StepReport& report);

  // After a collective failed (or Finish returned ABORTED): takes part in the
  // recovery and returns the step to run next. Fails only when the job ended
  // (CANCELLED, with shutdown_exit_code()) or this worker cannot continue.
  Result<int64_t> Recover();

  // Tells the controller that training ended after `last_step` with these
  // final parameters, and waits until the controller ends the job. ABORTED:
  // a member failed before the job ended; call Recover().
  Status Finish(int64_t last_step, const std::string& checksum);

  // Fault injection (nonstop run --inject exception:...): true once when this
  // rank should throw from its training loop at `step`.
  bool InjectedExceptionAt(int64_t step);
  // Tells the controller this worker hit a fault it cannot handle itself.
  // `traceback`: where the script raised (printed once if the job ends for a
  // failure that recurs: docs/errors.md, exit 12); at most 32 KiB are sent.
  void ReportFailure(const Status& status, int64_t step, int exit_code,
                     std::string_view traceback = {});

  // A rank-local section that its peers may wait for (an evaluation, a
  // snapshot save on rank 0): until EndBusy, or `bound` after this call, the
  // controller does not count the others' wait against this worker however
  // long it lasts, and /status, the dashboard and the progress line name
  // `label` (1 to 200 bytes). Without a section a live rank is declared hung
  // only past the job's busy timeout (--busy-timeout-ms, 60 s). Sections do
  // not nest: a second BeginBusy replaces the first. INVALID_ARGUMENT for a
  // bad label or a bound that is not positive.
  Status BeginBusy(std::string_view label,
                   std::chrono::milliseconds bound = std::chrono::minutes(30));
  void EndBusy();

  // The membership change that the last Join/Recover adopted.
  MembershipChange last_change() const;

  // The variables torchrun sets for a worker, for the generation the last
  // Join/Recover adopted (docs/python.md, "The environment contract"): RANK,
  // WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE (the members whose data
  // plane is on this worker's host, in rank order), GROUP_RANK and
  // GROUP_WORLD_SIZE (the hosts, in the order of their first rank), ROLE_RANK
  // and ROLE_WORLD_SIZE (= RANK and WORLD_SIZE), MASTER_ADDR (rank 0's host)
  // and MASTER_PORT (SessionOptions::master_port: nothing of nonstop's
  // listens there; a program's own torch store may).
  std::vector<std::pair<std::string, std::string>> TorchrunEnvironment() const;

  // The exit code the controller asked for when it ended the job (0 if none yet).
  int shutdown_exit_code() const;

 private:
  explicit Session(std::unique_ptr<SessionImpl> impl);
  std::unique_ptr<SessionImpl> impl_;
};

}  // namespace nonstop
