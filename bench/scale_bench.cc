// nonstop-bench-scale: how the control plane behaves as the job grows (issue 9).
//
// Two parts (docs/scale.md):
//
// hosts: real processes on hosts that are Linux network namespaces
//   (tests/multihost/netns.h): `nonstop controller` in one namespace, an agent
//   per worker host (up to 8), and a spare host whose spares equal one host's
//   workers; jobs of N = 4, 16 and 64 LibTorch-free test workers. For each N:
//   the time from the controller's start to the first completed step, the
//   data-plane connections per rank (journal "connections"), the downtime
//   after SIGKILLing a whole host by phase (journal recovery_end, and from
//   this program's own kill timestamp), then, on the same job once the lost
//   host's agent has come back with spares, the same for one SIGKILLed worker.
//   Needs root (namespaces) and a build with the tests (NONSTOP_BUILD_TESTS).
//
// sim: the Controller state machine alone, driven in-process, without
//   processes or sockets, at 1,000, 10,000 and 100,000 simulated workers on
//   hosts of 8 plus one spare host of 8: every host registers, every
//   SpawnWorker is answered with a join, members report a few steps, then one
//   host is lost and every survivor answers the abort. Measured: each Handle
//   call of the recovery, the time from the fault to the published plan (the
//   Handle calls plus encoding the plan and the aborts the way the runtime
//   sends them; and with the journal appends the runtime makes meanwhile),
//   the runtime's per-turn Status(), a Tick, and memory (RSS before/after the
//   job is built). The plans go out through the runtime's controller::PlanWire
//   (docs/plan-wire.md): the bytes on the wire per recovery (summed over the
//   members, and what full plans to every member would be), the time to encode
//   them, and one worker's decoding. Each size runs in a child process with a memory limit and
//   a time limit, so that a size that does not fit says so instead of taking
//   the machine down.
//
// Every size runs --repeat times. Output: tables on stdout (every run, then
// the medians) and results.json in --out.
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "bench/bench_util.h"
#include "common/time.h"
#include "control/messages.h"
#include "controller/controller.h"
#include "controller/journal.h"
#include "controller/plan_wire.h"
#include "controller/takeover.h"
#include "coord/leadership.h"
#include "tests/integration/etcd_server.h"
#ifdef NONSTOP_SCALE_HOSTS
#include "tests/multihost/netns.h"
#endif

namespace nonstop::bench {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using SteadyClock = std::chrono::steady_clock;

double MsSince(SteadyClock::time_point t) {
  return std::chrono::duration<double, std::milli>(SteadyClock::now() - t).count();
}

// Resident set size of this process, in KiB (/proc/self/statm: pages).
int64_t RssKib() {
  std::ifstream in("/proc/self/statm");
  int64_t size = 0, resident = 0;
  in >> size >> resident;
  return resident * (::sysconf(_SC_PAGESIZE) / 1024);
}

std::string Num(const json& v, const char* fmt_spec = "{:.1f}") {
  if (v.is_null()) return "-";
  if (v.is_number()) return fmt::format(fmt::runtime(fmt_spec), v.get<double>());
  return v.dump();
}

// The value at `path` (keys separated by '/') in j, or null.
json Path(const json& j, const std::string& path) {
  const json* at = &j;
  size_t start = 0;
  while (start <= path.size()) {
    size_t slash = path.find('/', start);
    if (slash == std::string::npos) slash = path.size();
    std::string key = path.substr(start, slash - start);
    if (!at->is_object() || !at->contains(key)) return nullptr;
    at = &(*at)[key];
    start = slash + 1;
  }
  return *at;
}

// ======================================================================= sim

struct SimOptions {
  int spare_hosts = 1;          // hosts of 8 spares each, beside the N/8 worker hosts
  int steps = 3;                // steps every member reports before the fault
  double encode_budget_s = 20;  // encoding the plans once per member stops here and extrapolates
  uint64_t seed = 1;
  // etcd in the loop (--sim-etcd): every record the takeover reads goes to a real etcd through a
  // coord::Leadership, as `nonstop controller --etcd` mirrors its journal, and the plan counts as
  // published once etcd holds its records (the runtime's orders wait for that).
  std::string etcd;
};

// The SendPlan's plan, whatever the action's shape (a PlanMsg, or a pointer to one shared by all
// members).
template <typename P>
const control::PlanMsg& PlanOf(const P& p) {
  if constexpr (requires { p.plan->generation; }) {
    return *p.plan;
  } else {
    return p.plan;
  }
}

// Likewise the SendAbort's message.
template <typename A>
const control::AbortMsg& AbortOf(const A& a) {
  if constexpr (requires { a.msg->generation; }) {
    return *a.msg;
  } else {
    return a.msg;
  }
}

// One size of the simulation. Writes one JSON object per phase to `progress` (a line each,
// flushed), so that the parent keeps what was measured if this child runs out of time or memory.
class Sim {
 public:
  Sim(int n, const SimOptions& o, std::FILE* progress, std::string journal)
      : n_(n), o_(o), progress_(progress), rng_(o.seed), journal_(std::move(journal)) {}

  void Run() {
    using namespace controller;
    const int hosts = n_ / 8;
    ControllerOptions co;
    co.min_hosts = hosts + o_.spare_hosts;
    // Simulated time barely moves: no timer may fire on its own.
    co.heartbeat_timeout = Millis(3'600'000);
    co.abort_timeout = Millis(3'600'000);
    co.forming_timeout = Millis(36'000'000);
    co.join_timeout = Millis(36'000'000);
    co.busy_timeout = Millis(3'600'000);
    Put({{"phase", "start"},
         {"n", n_},
         {"hosts", hosts},
         {"spare_hosts", o_.spare_hosts},
         {"rss_kib", RssKib()}});
    const int64_t rss_before = RssKib();
    if (!o_.etcd.empty()) {
      if (Status st = LeadInEtcd(); !st.ok()) {
        Put({{"phase", "error"}, {"error", "--sim-etcd: " + st.ToString()}});
        return;
      }
    }
    Controller c(co);

    // 1. Hosts register; the last one places the job: every worker and spare is spawned.
    std::vector<SpawnWorker> spawns;
    auto t = SteadyClock::now();
    double place_ms = 0;
    for (int h = 0; h < hosts + o_.spare_hosts; ++h) {
      bool spare_host = h >= hosts;
      std::string id = spare_host ? fmt::format("s{}", h - hosts) : fmt::format("h{}", h);
      control::AgentRegisterMsg m;
      m.host_id = id;
      m.nproc = spare_host ? 0 : 8;
      m.spares = spare_host ? 8 : 0;
      m.address = HostAddress(h);
      m.pid = 1000 + h;
      address_[id] = HostAddress(h);
      auto t1 = SteadyClock::now();
      auto out = Do(c, HostJoined{m});
      double ms = MsSince(t1);
      for (auto& a : out) {
        if (auto* s = std::get_if<SpawnWorker>(&a)) spawns.push_back(*s);
      }
      if (!spawns.empty() && place_ms == 0) place_ms = ms;
    }
    double register_ms = MsSince(t);
    Put({{"phase", "register"},
         {"ms", register_ms},
         {"placing_handle_ms", place_ms},
         {"spawns", spawns.size()}});

    // 2. The agents start them; they join. The join that completes the world forms generation 1.
    t = SteadyClock::now();
    for (const auto& s : spawns)
      Do(c, WorkerStarted{s.host, {s.worker_id, 100000 + s.worker_id, ""}});
    double started_ms = MsSince(t);
    t = SteadyClock::now();
    double form_ms = 0, slowest_join_ms = 0;
    std::vector<Action> form_actions;
    for (const auto& s : spawns) {
      control::JoinMsg m{s.worker_id,
                         100000 + s.worker_id,
                         fmt::format("{}:{}", address_[s.host], 40000 + s.worker_id % 20000),
                         s.spare,
                         -1,
                         s.host};
      auto t1 = SteadyClock::now();
      auto out = Do(c, WorkerJoined{m});
      double ms = MsSince(t1);
      slowest_join_ms = std::max(slowest_join_ms, ms);
      if (HasPlan(out)) {
        form_ms = ms;
        form_actions = std::move(out);
      }
    }
    double joins_ms = MsSince(t);
    const int64_t rss_after = RssKib();
    Put({{"phase", "form"},
         {"started_handles_ms", started_ms},
         {"join_handles_ms", joins_ms},
         {"slowest_join_ms", slowest_join_ms},
         {"forming_handle_ms", form_ms},
         {"world", c.world_size()},
         {"generation", c.generation()},
         {"rss_before_kib", rss_before},
         {"rss_after_kib", rss_after},
         {"rss_job_kib", rss_after - rss_before}});
    if (c.phase() != JobPhase::kRunning || static_cast<int>(c.world_size()) != n_) {
      Put({{"phase", "error"},
           {"error", fmt::format("the job did not form: world {}", c.world_size())}});
      return;
    }
    json enc0 = Encode(form_actions);
    form_actions.clear();
    Put({{"phase", "form_encode"}, {"encode", enc0}});

    // 3. Steady state: every member reports a few steps; one Tick; the runtime's Status() per loop
    // turn.
    std::vector<int> members;
    for (const auto& [id, w] : c.workers()) {
      if (w.role == WorkerRole::kMember) members.push_back(id);
    }
    t = SteadyClock::now();
    for (int step = 0; step < o_.steps; ++step) {
      Advance(100);
      std::shuffle(members.begin(), members.end(), rng_);
      for (int id : members) Do(c, ProgressReceived{id, {step, 1.0, 0.1, 100, n_}});
    }
    double progress_ms = MsSince(t) / std::max(1, o_.steps);
    std::vector<double> ticks;
    size_t tick_actions = 0;
    for (int i = 0; i < 9; ++i) {
      Advance(10);
      t = SteadyClock::now();
      tick_actions += Do(c, Tick{}).size();
      ticks.push_back(MsSince(t));
    }
    double tick_ms = Percentile(ticks, 50);
    t = SteadyClock::now();
    json st = c.Status();
    double status_ms = MsSince(t);
    t = SteadyClock::now();
    std::string st_text = st.dump(2);
    double status_dump_ms = MsSince(t);
    Put({{"phase", "steady"},
         {"progress_round_ms", progress_ms},
         {"progress_per_event_us", progress_ms * 1000 / n_},
         {"tick_ms", tick_ms},
         {"tick_actions", tick_actions},
         {"status_ms", status_ms},
         {"status_dump_ms", status_dump_ms},
         {"status_bytes", st_text.size()}});
    st = json();
    st_text.clear();

    if (leadership_ != nullptr) {
      // the job so far, in etcd before the fault (not timed as the recovery's)
      const uint64_t records = leadership_->appended();
      const double ms = FlushToEtcd();
      Put({{"phase", "etcd_setup"}, {"records", records}, {"flush_ms", ms}});
    }

    // 4. The fault: one worker host is lost. Survivors answer the abort (in a random order, as the
    // network would deliver them); the last answer publishes the plan.
    Advance(10);
    const std::string lost = "h3";
    t = SteadyClock::now();
    const uint64_t etcd_before_fault = leadership_ != nullptr ? leadership_->appended() : 0;
    auto fault_out = Do(c, HostLost{lost, "connection reset by peer"});
    double fault_ms = MsSince(t);
    const auto fault_at = SteadyClock::now();
    if (leadership_ != nullptr) leadership_->Flush();  // the end of the fault's loop turn
    size_t aborts = Count<SendAbort>(fault_out);
    json fault_journal = JournalCost(fault_out);
    json abort_encode = EncodeAborts(fault_out);
    // every journal record from the fault to the plan, for the journal's cost
    std::vector<json> records;
    Keep(&fault_out, &records);
    std::vector<int> survivors;
    for (int id : members) {
      if (c.RankOf(id) >= 0) survivors.push_back(id);
    }
    std::shuffle(survivors.begin(), survivors.end(), rng_);
    Put({{"phase", "fault"},
         {"host_lost_handle_ms", fault_ms},
         {"aborts", aborts},
         {"survivors", survivors.size()},
         {"journal", fault_journal},
         {"abort_encode", abort_encode}});
    Advance(5);
    std::vector<Action> plan_out;
    double readys_ms = 0, plan_ms = 0, slowest_ready_ms = 0;
    const uint32_t gen = c.generation();
    t = SteadyClock::now();
    for (size_t i = 0; i < survivors.size(); ++i) {
      auto t1 = SteadyClock::now();
      auto out = Do(c, ReadyReceived{survivors[i], {gen, o_.steps - 1, "controller abort"}});
      double ms = MsSince(t1);
      if (HasPlan(out)) {
        plan_ms = ms;
        plan_out = std::move(out);
      } else {
        readys_ms += ms;
        slowest_ready_ms = std::max(slowest_ready_ms, ms);
        Keep(&out, &records);
      }
    }
    double all_readys_ms = MsSince(t);
    const int64_t rss_plan = RssKib();
    size_t plans = Count<SendPlan>(plan_out);
    json plan_info;
    for (const auto& a : plan_out) {
      if (const auto* p = std::get_if<SendPlan>(&a)) {
        const auto& plan = PlanOf(*p);
        size_t sources = 0;
        for (const auto& tr : plan.transfers) sources += tr.sources.size();
        plan_info = {{"members", plan.members.size()},
                     {"transfers", plan.transfers.size()},
                     {"transfer_sources", sources},
                     {"generation", plan.generation}};
        break;
      }
    }
    Put({{"phase", "plan"},
         {"ready_handles_ms", readys_ms},
         {"slowest_ready_ms", slowest_ready_ms},
         {"plan_handle_ms", plan_ms},
         {"all_ready_wall_ms", all_readys_ms},
         {"send_plans", plans},
         {"plan", plan_info},
         {"rss_at_plan_kib", rss_plan}});
    json journal = JournalCost(plan_out);
    Put({{"phase", "plan_journal"}, {"journal", journal}});
    json enc = Encode(plan_out);
    Keep(&plan_out, &records);
    json appended = AppendAll(&records);
    Put({{"phase", "fault_journal"}, {"journal", appended}});
    Put({{"phase", "plan_encode"}, {"encode", enc}});
    if (leadership_ != nullptr) {
      // The plan goes out once etcd holds its records: the wait after the last answer, and the
      // whole time from the fault's handling to then (the answers' handling included).
      const uint64_t records = leadership_->appended() - etcd_before_fault;
      const double wait_ms = FlushToEtcd();
      Put({{"phase", "etcd_plan"},
           {"records", records},
           {"wait_after_plan_ms", wait_ms},
           {"fault_to_durable_plan_ms", wait_ms < 0 ? -1 : fault_ms + MsSince(fault_at)}});
    }

    // 5. The rest of the recovery: every member reports its connections and state, then completes
    // the resume step (recovery_end); then the Tick that refills the lost host's slots elsewhere
    // (none here: it is gone).
    std::vector<int> next;
    for (const auto& [id, w] : c.workers()) {
      if (w.role == WorkerRole::kMember) next.push_back(id);
    }
    std::shuffle(next.begin(), next.end(), rng_);
    Advance(20);
    t = SteadyClock::now();
    for (int id : next) Do(c, RecoveredReceived{id, {c.generation(), 0.01, 0.0, 0, 0, 0, 4, 4}});
    double recovered_ms = MsSince(t);
    Advance(100);
    t = SteadyClock::now();
    bool closed = false;
    for (int id : next) {
      auto out = Do(c, ProgressReceived{id, {o_.steps, 1.0, 0.1, 100, n_}});
      for (const auto& a : out) {
        if (const auto* j = std::get_if<AppendJournal>(&a))
          closed |= j->record.value("event", "") == "recovery_end";
      }
    }
    double resumed_ms = MsSince(t);
    Advance(10);
    t = SteadyClock::now();
    auto tick2 = Do(c, Tick{});
    double tick2_ms = MsSince(t);
    Put({{"phase", "recovered"},
         {"recovered_handles_ms", recovered_ms},
         {"resume_step_handles_ms", resumed_ms},
         {"recovery_end", closed},
         {"tick_after_ms", tick2_ms},
         {"world", c.world_size()},
         {"generation", c.generation()},
         {"rss_end_kib", RssKib()}});
    Put({{"phase", "done"}});
  }

 private:
  // Host h's address, 10.x.y.z: unique over 16M hosts.
  static std::string HostAddress(int h) {
    return fmt::format("10.{}.{}.{}", (h >> 16) & 255, (h >> 8) & 255, (h & 255) + 1);
  }

  std::vector<controller::Action> Do(controller::Controller& c, const controller::Event& e) {
    auto out = c.Handle(e, now_);
    if (leadership_ != nullptr) {
      for (const auto& a : out) {
        const auto* j = std::get_if<controller::AppendJournal>(&a);
        if (j != nullptr && controller::TakeoverReads(j->record)) leadership_->Append(j->record);
      }
    }
    return out;
  }

  // Leads a job of its own in etcd (--sim-etcd), with the journal compacted as the controller's is.
  Status LeadInEtcd() {
    coord::LeadershipOptions lo;
    lo.endpoints = o_.etcd;
    lo.job = fmt::format("sim-{}-{}", n_, ::getpid());
    lo.compact = controller::CompactJournal;
    NONSTOP_ASSIGN_OR_RETURN(leadership_, coord::Leadership::Connect(lo));
    NONSTOP_RETURN_IF_ERROR(
        leadership_->Campaign([] { return false; }, [](const std::string&) {}).status());
    NONSTOP_RETURN_IF_ERROR(leadership_->ReadJournal(crypto::JobKey("bench")).status());
    return OkStatus();
  }
  // Hands the queue to etcd and waits until it holds all of it: the time that took (ms); -1 if the
  // leadership was lost or 60 s passed.
  double FlushToEtcd() {
    auto t = SteadyClock::now();
    leadership_->Flush();
    while (leadership_->durable() < leadership_->appended() && !leadership_->deposed() &&
           MsSince(t) < 60'000) {
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    return leadership_->durable() >= leadership_->appended() ? MsSince(t) : -1;
  }
  void Advance(int ms) { now_ += Millis(ms); }

  static bool HasPlan(const std::vector<controller::Action>& out) {
    return std::any_of(out.begin(), out.end(), [](const auto& a) {
      return std::holds_alternative<controller::SendPlan>(a);
    });
  }
  template <typename T>
  static size_t Count(const std::vector<controller::Action>& out) {
    return static_cast<size_t>(std::count_if(
        out.begin(), out.end(), [](const auto& a) { return std::holds_alternative<T>(a); }));
  }

  // Moves the journal records among `out` to `records`, and clears `out`.
  static void Keep(std::vector<controller::Action>* out, std::vector<json>* records) {
    for (auto& a : *out) {
      if (auto* j = std::get_if<controller::AppendJournal>(&a))
        records->push_back(std::move(j->record));
    }
    out->clear();
  }

  // Appends `records` to a journal the way the runtime does (controller::Journal: buffered lines,
  // one flush at the end of the loop turn), then clears them.
  json AppendAll(std::vector<json>* records) const {
    auto journal = controller::Journal::Open(journal_);
    if (!journal.ok()) return {{"error", journal.status().ToString()}};
    auto t = SteadyClock::now();
    for (auto& r : *records) (*journal)->Append(std::move(r));
    double ms = MsSince(t);
    size_t n = records->size();
    records->clear();
    journal->reset();
    std::error_code ec;
    auto bytes = fs::file_size(journal_, ec);
    fs::remove(journal_, ec);
    return {{"records", n}, {"append_ms", ms}, {"bytes", bytes}};
  }

  // Encoding the aborts the way the runtime does: once per distinct message (once per member before
  // they were shared). Measures one and counts.
  static json EncodeAborts(const std::vector<controller::Action>& out) {
    std::set<const void*> distinct;
    const control::AbortMsg* first = nullptr;
    size_t n = 0;
    for (const auto& a : out) {
      if (const auto* s = std::get_if<controller::SendAbort>(&a)) {
        const control::AbortMsg* m = &AbortOf(*s);
        if (first == nullptr) first = m;
        distinct.insert(m);
        ++n;
      }
    }
    if (first == nullptr) return nullptr;
    auto t = SteadyClock::now();
    std::string one;
    for (int i = 0; i < 100; ++i) one = control::Encode(*first);
    double one_ms = MsSince(t) / 100;
    return {{"aborts", n},
            {"distinct", distinct.size()},
            {"bytes", one.size()},
            {"encode_one_ms", one_ms},
            {"runtime_encode_ms", one_ms * static_cast<double>(distinct.size())}};
  }

  // What the runtime does with the journal records and printed lines among `out`: serialise each.
  static json JournalCost(const std::vector<controller::Action>& out) {
    auto t = SteadyClock::now();
    size_t bytes = 0, records = 0, printed = 0;
    for (const auto& a : out) {
      if (const auto* j = std::get_if<controller::AppendJournal>(&a)) {
        bytes += j->record.dump().size();
        ++records;
      } else if (const auto* p = std::get_if<controller::PrintLine>(&a)) {
        printed += p->line.size();
      }
    }
    return {{"records", records},
            {"bytes", bytes},
            {"dump_ms", MsSince(t)},
            {"printed_bytes", printed}};
  }

  // Sends the SendPlan actions among `out` the way the runtime does (controller::PlanWire: the
  // full plan, or a delta to a member that holds the previous plan; each payload encoded once),
  // each simulated worker on a control connection of its own that never drops. Measured: the
  // bytes on the wire, the time to pick and encode them, and one worker's decoding of each kind;
  // and, as a baseline, the full plan to every member (how plans went out before deltas). Stops
  // after encode_budget_s and extrapolates.
  json Encode(const std::vector<controller::Action>& out) {
    std::vector<const controller::SendPlan*> sends;
    for (const auto& a : out) {
      if (const auto* p = std::get_if<controller::SendPlan>(&a)) sends.push_back(p);
    }
    if (sends.empty()) return nullptr;
    std::set<const control::PlanMsg*> distinct;
    for (const auto* p : sends) distinct.insert(&PlanOf(*p));
    auto t = SteadyClock::now();
    const std::string full = control::Encode(PlanOf(*sends.front()));
    const double one_ms = MsSince(t);
    t = SteadyClock::now();
    size_t done = 0, bytes = 0, deltas = 0, delta_bytes = 0, whole_bytes = 0;
    bool extrapolated = false;
    std::string delta, whole;  // one payload of each kind: against the previous plan, and none
    for (const auto* p : sends) {
      if (std::chrono::duration<double>(SteadyClock::now() - t).count() > o_.encode_budget_s) {
        extrapolated = true;
        break;
      }
      const uint64_t connection = static_cast<uint64_t>(p->worker_id) + 1;
      controller::PlanWire::Frame f = wire_.For(p->worker_id, connection, p->plan);
      wire_.Sent(p->worker_id, connection, true);
      bytes += f.payload->size();
      if (f.delta) {
        ++deltas;
        if (delta.empty() || f.payload->size() < delta.size()) delta = *f.payload;
        delta_bytes = std::max(delta_bytes, f.payload->size());
      } else if (whole.empty()) {
        whole = *f.payload;
        whole_bytes = whole.size();
      }
      ++done;
    }
    double ms = MsSince(t);
    const double scale = static_cast<double>(sends.size()) / static_cast<double>(done);
    // What one worker spends on each: the full plan parsed (as before deltas), the plan against no
    // base, or a delta applied to the plan it holds (the one sent before this).
    t = SteadyClock::now();
    bool decoded = control::DecodePlan(full).ok();
    const double decode_full_ms = MsSince(t);
    json decode_whole_ms = nullptr, decode_delta_ms = nullptr;
    if (!whole.empty()) {
      t = SteadyClock::now();
      decoded = decoded && control::DecodePlanDelta(whole, nullptr).ok();
      decode_whole_ms = MsSince(t);
    }
    if (!delta.empty() && held_ != nullptr) {
      t = SteadyClock::now();
      decoded = decoded && control::DecodePlanDelta(delta, held_.get()).ok();
      decode_delta_ms = MsSince(t);
    }
    held_ = sends.front()->plan;
    const double before = static_cast<double>(full.size()) * static_cast<double>(sends.size());
    const double after = extrapolated ? static_cast<double>(bytes) * scale : bytes;
    return {{"send_plans", sends.size()},
            {"distinct_plans", distinct.size()},
            {"plan_bytes", full.size()},
            {"encode_one_ms", one_ms},
            {"encodes_done", done},
            {"runtime_encode_ms", extrapolated ? ms * scale : ms},
            {"extrapolated", extrapolated},
            {"delta_frames", deltas},
            {"whole_frames", done - deltas},
            {"delta_bytes", delta_bytes},
            {"whole_bytes", whole_bytes},
            {"decoded", decoded},
            {"decode_full_ms", decode_full_ms},
            {"decode_whole_ms", decode_whole_ms},
            {"decode_delta_ms", decode_delta_ms},
            {"bytes_sent", after},
            {"bytes_sent_full_plans", before},
            // the controller's link at 10 Gbit/s, every byte through it
            {"wire_s_at_10gbps", after * 8 / 1e10},
            {"wire_s_at_10gbps_full_plans", before * 8 / 1e10}};
  }

  void Put(json j) {
    std::fprintf(progress_, "%s\n", j.dump().c_str());
    std::fflush(progress_);
  }

  const int n_;
  const SimOptions o_;
  std::FILE* progress_;
  std::mt19937_64 rng_;
  Clock::time_point now_ = Clock::time_point() + std::chrono::hours(1);
  std::map<std::string, std::string> address_;
  const std::string journal_;  // where the fault's records are appended, as the runtime does
  controller::PlanWire wire_;  // the runtime's, across the generations
  std::unique_ptr<coord::Leadership> leadership_;  // --sim-etcd
  std::shared_ptr<const control::PlanMsg> held_;   // the plan sent last: the base of the next delta
};

// Runs one size in a child process limited to `memory_gib` of address space and `timeout_s`;
// returns what it measured, phase by phase ({"phase": {...}}), with "outcome": done, timeout, out
// of memory, or a crash.
json RunSimSize(int n, int run, const SimOptions& o, double memory_gib, double timeout_s,
                const std::string& dir) {
  std::string path = fmt::format("{}/sim-{}-run{}.jsonl", dir, n, run);
  pid_t pid = ::fork();
  if (pid < 0) return {{"n", n}, {"outcome", "fork failed"}};
  if (pid == 0) {
    rlimit lim{};
    lim.rlim_cur = lim.rlim_max = static_cast<rlim_t>(memory_gib * (1ull << 30));
    ::setrlimit(RLIMIT_AS, &lim);
    std::FILE* f = std::fopen(path.c_str(), "w");
    if (f == nullptr) _exit(3);
    try {
      Sim(n, o, f, fmt::format("{}/sim-{}-run{}-journal.jsonl", dir, n, run)).Run();
    } catch (const std::bad_alloc&) {
      std::fprintf(f, "{\"phase\":\"error\",\"error\":\"out of memory\"}\n");
      std::fflush(f);
      _exit(4);
    }
    std::fclose(f);
    _exit(0);
  }
  auto start = SteadyClock::now();
  int status = 0;
  std::string outcome;
  while (true) {
    pid_t done = ::waitpid(pid, &status, WNOHANG);
    if (done == pid) break;
    if (MsSince(start) > timeout_s * 1000) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      outcome = fmt::format("timeout: stopped after {:.0f} s", timeout_s);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  json r = {{"n", n}, {"run", run}, {"wall_s", MsSince(start) / 1000}};
  std::ifstream in(path);
  std::string line;
  std::string last_phase;
  while (std::getline(in, line)) {
    auto j = json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.contains("phase")) continue;
    std::string phase = j["phase"];
    if (phase == "error") {
      r["error"] = j.value("error", "");
      continue;
    }
    last_phase = phase;
    r[phase] = j;
  }
  if (outcome.empty()) {
    if (last_phase == "done")
      outcome = "done";
    else if (r.contains("error"))
      outcome = fmt::format("{} after phase {}", r["error"].get<std::string>(), last_phase);
    else if (WIFSIGNALED(status))
      outcome = fmt::format("killed by signal {} after phase {}", WTERMSIG(status), last_phase);
    else
      outcome = fmt::format("exited {} after phase {}", WEXITSTATUS(status), last_phase);
  }
  r["outcome"] = outcome;
  r["last_phase"] = last_phase;
  return r;
}

// A value from a sim result: r[phase][key], or null.
json At(const json& r, const char* phase, const char* key) {
  if (!r.contains(phase) || !r[phase].contains(key)) return nullptr;
  return r[phase][key];
}
json At2(const json& r, const char* phase, const char* obj, const char* key) {
  if (!r.contains(phase) || !r[phase].contains(obj) || !r[phase][obj].is_object() ||
      !r[phase][obj].contains(key)) {
    return nullptr;
  }
  return r[phase][obj][key];
}
double D(const json& v) { return v.is_number() ? v.get<double>() : 0; }

// Derived numbers: the fault→plan time (Handle calls + encoding), the total of the recovery's
// Handle calls.
void Derive(json* r) {
  json& x = *r;
  if (!x.contains("plan")) return;
  double handles = D(At(x, "fault", "host_lost_handle_ms")) + D(At(x, "plan", "ready_handles_ms")) +
                   D(At(x, "plan", "plan_handle_ms"));
  x["fault_to_plan_handles_ms"] = handles;
  if (x.contains("plan_encode")) {
    double enc = D(At2(x, "plan_encode", "encode", "runtime_encode_ms")) +
                 D(At2(x, "fault", "abort_encode", "runtime_encode_ms"));
    x["fault_to_plan_published_ms"] = handles + enc;
    if (x.contains("fault_journal")) {
      x["fault_to_plan_with_journal_ms"] =
          handles + enc + D(At2(x, "fault_journal", "journal", "append_ms"));
    }
  }
  if (x.contains("recovered")) {
    x["recovery_handles_ms"] = handles + D(At(x, "recovered", "recovered_handles_ms")) +
                               D(At(x, "recovered", "resume_step_handles_ms"));
  }
}

// --sim-etcd: the journal's records through a real etcd, per run.
void PrintEtcdTable(const json& results) {
  fmt::print(
      "\nwith etcd in the loop (--sim-etcd): records mirrored before the fault and the time etcd "
      "took them;\n  from the fault, records to etcd, the wait for them after the plan was "
      "decided, and the fault → a plan etcd holds (ms)\n");
  fmt::print("{:>8} {:>4} {:>14} {:>12} {:>14} {:>14} {:>18}\n", "workers", "run", "setup records",
             "setup ms", "fault records", "wait ms", "fault→durable plan");
  for (const json& r : results) {
    fmt::print("{:>8} {:>4} {:>14} {:>12} {:>14} {:>14} {:>18}\n", r.value("n", 0),
               r.value("run", 0), Num(At(r, "etcd_setup", "records"), "{:.0f}"),
               Num(At(r, "etcd_setup", "flush_ms")), Num(At(r, "etcd_plan", "records"), "{:.0f}"),
               Num(At(r, "etcd_plan", "wait_after_plan_ms")),
               Num(At(r, "etcd_plan", "fault_to_durable_plan_ms")));
  }
}

void PrintSimTable(const json& results, const json& medians) {
  fmt::print(
      "\nB. controller-only simulation (hosts of 8 + one spare host of 8; one host lost), ms\n");
  fmt::print(
      "{:>7} {:>8} {:>8} {:>8} {:>8} {:>10} {:>8} {:>10} {:>9} {:>8} {:>8} {:>6} {:>6}  {}\n",
      "workers", "HostLost", "Readys", "plan", "encode", "fault→plan", "journal", "+journal",
      "recovery", "plan", "Status", "Tick", "RSS", "outcome");
  fmt::print("{:>7} {:>8} {:>8} {:>8} {:>8} {:>10} {:>8} {:>10} {:>9} {:>8} {:>8} {:>6} {:>6}\n",
             "", "call", "(all)", "call", "", "published", "appends", "", "handles", "MB", "+dump",
             "", "MiB");
  for (const auto& r : results) {
    json enc = At2(r, "plan_encode", "encode", "runtime_encode_ms");
    bool extrap = At2(r, "plan_encode", "encode", "extrapolated") == json(true);
    double encode = D(enc) + D(At2(r, "fault", "abort_encode", "runtime_encode_ms"));
    json status = r.contains("steady")
                      ? json(D(At(r, "steady", "status_ms")) + D(At(r, "steady", "status_dump_ms")))
                      : json();
    json plan_mb = At2(r, "plan_encode", "encode", "plan_bytes");
    fmt::print(
        "{:>7} {:>8} {:>8} {:>8} {:>8} {:>10} {:>8} {:>10} {:>9} {:>8} {:>8} {:>6} {:>6.0f}  {}\n",
        fmt::format("{}#{}", r["n"].get<int>(), r.value("run", 1)),
        Num(At(r, "fault", "host_lost_handle_ms")), Num(At(r, "plan", "ready_handles_ms")),
        Num(At(r, "plan", "plan_handle_ms")),
        enc.is_null() ? "-" : fmt::format("{:.1f}{}", encode, extrap ? "*" : ""),
        Num(r.value("fault_to_plan_published_ms", json())) + (extrap ? "*" : ""),
        Num(At2(r, "fault_journal", "journal", "append_ms")),
        Num(r.value("fault_to_plan_with_journal_ms", json())) + (extrap ? "*" : ""),
        Num(r.value("recovery_handles_ms", json())),
        plan_mb.is_null() ? "-" : fmt::format("{:.2f}", D(plan_mb) / 1e6), Num(status),
        Num(At(r, "steady", "tick_ms")), D(At(r, "form", "rss_job_kib")) / 1024,
        r.value("outcome", "?"));
  }
  fmt::print("\n  median of the runs, ms (RSS: MiB)\n");
  fmt::print("{:>7} {:>5} {:>10} {:>10} {:>8} {:>8} {:>8} {:>8} {:>8} {:>9} {:>8} {:>6} {:>6}\n",
             "workers", "runs", "fault→plan", "+journal", "HostLost", "Readys", "plan", "encode",
             "journal", "recovery", "Status", "Tick", "RSS");
  for (const auto& m : medians) {
    fmt::print(
        "{:>7} {:>5} {:>10} {:>10} {:>8} {:>8} {:>8} {:>8} {:>8} {:>9} {:>8} {:>6} {:>6}\n",
        m["n"].get<int>(), m["runs"].get<int>(), Num(m["fault_to_plan_published_ms"]),
        Num(m["fault_to_plan_with_journal_ms"]), Num(m["fault/host_lost_handle_ms"]),
        Num(m["plan/ready_handles_ms"]), Num(m["plan/plan_handle_ms"]),
        Num(m["plan_encode/encode/runtime_encode_ms"]), Num(m["fault_journal/journal/append_ms"]),
        Num(m["recovery_handles_ms"]),
        m["steady/status_ms"].is_null()
            ? "-"
            : Num(D(m["steady/status_ms"]) + D(m["steady/status_dump_ms"])),
        Num(m["steady/tick_ms"]),
        m["form/rss_job_kib"].is_null() ? "-" : Num(D(m["form/rss_job_kib"]) / 1024, "{:.0f}"));
  }
  fmt::print(
      "  fault→plan published: the HostLost call + every Ready call + encoding the plan and the "
      "aborts as the\n"
      "  runtime sends them; +journal: and appending the journal records of those calls (one flush "
      "each).\n"
      "  * extrapolated: the plan encoded once per member, cut off after --sim-encode-budget-s.\n");
  fmt::print(
      "  forming (ms): the HostJoined calls / the joins / the join that forms generation 1; bytes "
      "of plans on the wire (full plans to every member before deltas)\n");
  for (const auto& r : results) {
    fmt::print(
        "{:>7} {:>10} {:>10} {:>10}   generation 1: {} B, after the fault: {} B (was {} B)\n",
        fmt::format("{}#{}", r["n"].get<int>(), r.value("run", 1)), Num(At(r, "register", "ms")),
        Num(At(r, "form", "join_handles_ms")), Num(At(r, "form", "forming_handle_ms")),
        Num(At2(r, "form_encode", "encode", "bytes_sent"), "{:.3g}"),
        Num(At2(r, "plan_encode", "encode", "bytes_sent"), "{:.3g}"),
        Num(At2(r, "plan_encode", "encode", "bytes_sent_full_plans"), "{:.3g}"));
  }
  fmt::print(
      "\n  the recovery's plan on the wire (docs/plan-wire.md): frames against no base (whole) and "
      "against the previous plan (delta); bytes of\n  the full plan (before deltas), of one whole "
      "plan and of the largest delta; the sum over members now and with the full plan to each; "
      "the controller's\n  time to pick and encode them (ms); one worker's decoding (ms): full "
      "plan, whole, delta; the sum's time through a 10 Gbit/s link (s), now and before\n");
  fmt::print(
      "{:>8} {:>6} {:>6} {:>9} {:>9} {:>7} {:>9} {:>9} {:>7} {:>7} {:>7} {:>7} {:>7} {:>7}\n",
      "workers", "whole", "delta", "full B", "whole B", "delta B", "wire B", "was B", "send",
      "dec f", "dec w", "dec d", "10G s", "was s");
  for (const auto& r : results) {
    auto e = [&](const char* key) { return At2(r, "plan_encode", "encode", key); };
    fmt::print(
        "{:>8} {:>6} {:>6} {:>9} {:>9} {:>7} {:>9} {:>9} {:>7} {:>7} {:>7} {:>7} {:>7} {:>7}\n",
        fmt::format("{}#{}", r["n"].get<int>(), r.value("run", 1)),
        Num(e("whole_frames"), "{:.0f}"), Num(e("delta_frames"), "{:.0f}"),
        Num(e("plan_bytes"), "{:.0f}"), Num(e("whole_bytes"), "{:.0f}"),
        Num(e("delta_bytes"), "{:.0f}"), Num(e("bytes_sent"), "{:.3g}"),
        Num(e("bytes_sent_full_plans"), "{:.3g}"), Num(e("runtime_encode_ms")),
        Num(e("decode_full_ms")), Num(e("decode_whole_ms")), Num(e("decode_delta_ms"), "{:.2f}"),
        Num(e("wire_s_at_10gbps"), "{:.3f}"), Num(e("wire_s_at_10gbps_full_plans")));
  }
}

// ======================================================================= hosts

#ifdef NONSTOP_SCALE_HOSTS

using testing::NetnsCluster;

json Stats(std::vector<double> v) {
  if (v.empty()) return {{"n", 0}};
  std::sort(v.begin(), v.end());
  return {{"n", v.size()}, {"min", v.front()}, {"median", Percentile(v, 50)}, {"max", v.back()}};
}

struct HostsOptions {
  std::string bin;
  std::string out;
  int elements = 256;
  int sleep_ms = 50;
  int heartbeat_timeout_ms = 3000;
  int warm_steps = 20;  // steps after the first before the host is killed
  // steps after a recovery (and the healed host's spares) before the next kill
  int settle_steps = 15;
  double phase_timeout_s = 120;
};

std::vector<json> ReadRecords(const std::string& journal) {
  auto all = controller::Journal::Read(journal);
  return all.ok() ? *all : std::vector<json>{};
}

std::string ReadText(const std::string& path) {
  std::ifstream in(path);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// One job of n workers on real namespaces.
class HostsRun {
 public:
  HostsRun(int n, int run, const HostsOptions& o) : n_(n), run_(run), o_(o) {
    hosts_ = std::min(8, n);
    per_host_ = n / hosts_;
    dir_ = fmt::format("{}/hosts-{}-run{}", o.out, n, run);
    journal_ = dir_ + "/journal.jsonl";
  }

  json Run() {
    json r = {{"n", n_},
              {"run", run_},
              {"worker_hosts", hosts_},
              {"workers_per_host", per_host_},
              {"spare_host_spares", per_host_},
              {"elements", o_.elements},
              {"sleep_ms", o_.sleep_ms},
              {"heartbeat_timeout_ms", o_.heartbeat_timeout_ms}};
    std::error_code ec;
    fs::remove_all(dir_, ec);
    fs::create_directories(dir_, ec);
    auto c = NetnsCluster::Create(hosts_ + 2);
    if (!c.ok()) {
      r["outcome"] = "no cluster: " + c.status().ToString();
      return r;
    }
    cluster_ = std::move(*c);
    std::string error = Drive(&r);
    r["outcome"] = error.empty() ? "done" : error;
    if (controller_pid_ > 0 && !controller_exit_) {
      ::kill(controller_pid_, SIGTERM);
      auto st = cluster_->WaitForExit(controller_pid_, std::chrono::seconds(30));
      if (st) controller_exit_ = WIFEXITED(*st) ? WEXITSTATUS(*st) : 128 + WTERMSIG(*st);
    }
    r["controller_exit"] = controller_exit_ ? json(*controller_exit_) : json(nullptr);
    Status s = cluster_->Destroy();
    if (!s.ok()) r["cluster_destroy"] = s.ToString();
    Analyze(&r);
    return r;
  }

 private:
  // The job, its two faults and its end; "" or what went wrong.
  std::string Drive(json* r) {
    const std::string kBin = o_.bin;
    std::vector<std::string> argv = {kBin + "/nonstop",
                                     "controller",
                                     "--listen",
                                     cluster_->address(0) + ":0",
                                     "--nnodes",
                                     std::to_string(hosts_ + 1),
                                     "--job-token-file",
                                     dir_ + "/token",
                                     "--journal",
                                     journal_,
                                     "--heartbeat-timeout-ms",
                                     std::to_string(o_.heartbeat_timeout_ms)};
    controller_start_us_ = WallMicros();
    auto pid = cluster_->Spawn(0, argv, {}, dir_ + "/controller.out");
    if (!pid.ok()) return "cannot start the controller: " + pid.status().ToString();
    controller_pid_ = *pid;
    std::string controller_address;
    if (!WaitFor(
            [&] {
              auto job = json::parse(ReadText(dir_ + "/job.json"), nullptr, false);
              if (!job.is_discarded() && job.contains("controller"))
                controller_address = job["controller"];
              return !controller_address.empty();
            },
            20)) {
      return "the controller wrote no job file: " + ReadText(dir_ + "/controller.out");
    }
    controller_address_ = controller_address;
    for (int h = 1; h <= hosts_; ++h) StartAgent(h, fmt::format("h{}", h), per_host_, 0);
    StartAgent(hosts_ + 1, "hs", 0, per_host_);
    if (!WaitFor([&] { return HighestStep() >= 0; }, o_.phase_timeout_s)) return "no first step";
    if (!WaitFor([&] { return HighestStep() >= o_.warm_steps; }, o_.phase_timeout_s))
      return "no steady steps";

    // Host crash: the agent and every worker of host h2 at once.
    const int victim = std::min(2, hosts_);
    const std::string victim_id = fmt::format("h{}", victim);
    host_kill_us_ = WallMicros();
    int killed = cluster_->KillHost(victim);
    (*r)["host_kill"] = {{"host", victim_id}, {"processes_killed", killed}};
    if (auto it = agents_.find(victim_id); it != agents_.end()) {
      cluster_->WaitForExit(it->second, std::chrono::seconds(5));
    }
    if (!WaitFor([&] { return CompletedRecoveriesAfter(host_kill_us_) >= 1; },
                 o_.phase_timeout_s)) {
      return "the host loss did not complete a recovery";
    }
    // The host comes back (its agent again): its slots return as spares, for the single kill's
    // replacement.
    int64_t heal_us = WallMicros();
    StartAgent(victim, victim_id, per_host_, 0);
    if (!WaitFor([&] { return SpareJoinsSince(heal_us, victim_id) >= per_host_; },
                 o_.phase_timeout_s)) {
      return "the healed host's spares did not join";
    }
    int64_t at = HighestStep();
    if (!WaitFor([&] { return HighestStep() >= at + o_.settle_steps; }, o_.phase_timeout_s))
      return "no progress";

    // One worker: a member on host h1, SIGKILLed.
    auto [worker_id, worker_pid] = MemberOn("h1");
    if (worker_pid <= 0) return "no member on h1 to kill";
    single_kill_us_ = WallMicros();
    if (::kill(static_cast<pid_t>(worker_pid), SIGKILL) != 0)
      return fmt::format("kill({}) failed", worker_pid);
    (*r)["single_kill"] = {{"worker_id", worker_id}, {"pid", worker_pid}, {"host", "h1"}};
    if (!WaitFor([&] { return CompletedRecoveriesAfter(single_kill_us_) >= 1; },
                 o_.phase_timeout_s)) {
      return "the single kill did not complete a recovery";
    }
    at = HighestStep();
    WaitFor([&] { return HighestStep() >= at + 5; }, 30);
    // The end: the controller is told to stop; agents stop their workers.
    ::kill(controller_pid_, SIGTERM);
    auto st = cluster_->WaitForExit(controller_pid_, std::chrono::seconds(30));
    if (st) controller_exit_ = WIFEXITED(*st) ? WEXITSTATUS(*st) : 128 + WTERMSIG(*st);
    for (const auto& [id, p] : agents_) cluster_->WaitForExit(p, std::chrono::seconds(10));
    return "";
  }

  void StartAgent(int host, const std::string& id, int nproc, int spares) {
    std::vector<std::string> argv = {o_.bin + "/nonstop",
                                     "agent",
                                     "--controller",
                                     controller_address_,
                                     "--job-token-file",
                                     dir_ + "/token",
                                     "--host-id",
                                     id,
                                     "--nproc-per-host",
                                     std::to_string(nproc),
                                     "--spares-per-host",
                                     std::to_string(spares),
                                     "--join-timeout-ms",
                                     "60000",
                                     "--",
                                     o_.bin + "/nonstop-test-worker",
                                     "--steps",
                                     "1000000",
                                     "--elements",
                                     std::to_string(o_.elements),
                                     "--sleep-ms",
                                     std::to_string(o_.sleep_ms)};
    auto pid = cluster_->Spawn(host, argv, {}, dir_ + "/agent-" + id + ".out");
    agents_[id] = pid.ok() ? *pid : -1;
  }

  bool WaitFor(const std::function<bool()>& cond, double seconds) {
    auto until = SteadyClock::now() + std::chrono::duration<double>(seconds);
    while (!cond()) {
      if (SteadyClock::now() > until) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return true;
  }

  int64_t HighestStep() const {
    int64_t h = -1;
    for (const auto& j : ReadRecords(journal_)) {
      if (j.value("event", "") == "step") h = std::max<int64_t>(h, j["step"].get<int64_t>());
    }
    return h;
  }

  int CompletedRecoveriesAfter(int64_t us) const {
    int n = 0;
    for (const auto& j : ReadRecords(journal_)) {
      if (j.value("event", "") == "recovery_end" && j.value("time_us", int64_t{0}) > us &&
          j["recovery"].value("outcome", "") == "completed") {
        ++n;
      }
    }
    return n;
  }

  int SpareJoinsSince(int64_t us, const std::string& host) const {
    int n = 0;
    for (const auto& j : ReadRecords(journal_)) {
      if (j.value("event", "") == "join" && j.value("time_us", int64_t{0}) > us &&
          j.value("host", "") == host && j.value("spare", false)) {
        ++n;
      }
    }
    return n;
  }

  // A member of the latest plan on `host`: (worker id, pid), from the plan and join records.
  std::pair<int, int64_t> MemberOn(const std::string& host) const {
    std::map<int, std::pair<std::string, int64_t>> joined;
    json plan;
    for (const auto& j : ReadRecords(journal_)) {
      std::string ev = j.value("event", "");
      if (ev == "join")
        joined[j["worker_id"].get<int>()] = {j.value("host", ""), j.value("pid", int64_t{0})};
      if (ev == "plan") plan = j;
    }
    if (plan.is_null()) return {-1, 0};
    for (const auto& m : plan["members"]) {
      int id = m.get<int>();
      if (joined.count(id) && joined[id].first == host) return {id, joined[id].second};
    }
    return {-1, 0};
  }

  // The recovery the kill at `kill_us` caused: its journal numbers and ours.
  json FaultReport(const std::vector<json>& recs, int64_t kill_us, double normal_step_ms) const {
    if (kill_us == 0) return nullptr;
    json start, end, plan;
    int64_t start_us = 0, end_us = 0, plan_us = 0, first_step_us = 0;
    for (const auto& j : recs) {
      int64_t t = j.value("time_us", int64_t{0});
      if (t < kill_us) continue;
      std::string ev = j.value("event", "");
      if (ev == "recovery_start" && start.is_null()) {
        start = j;
        start_us = t;
      } else if (ev == "plan" && plan.is_null() && !start.is_null()) {
        plan = j;
        plan_us = t;
      } else if (ev == "recovery_end" && end.is_null() &&
                 j["recovery"].value("outcome", "") == "completed") {
        end = j;
        end_us = t;
      }
    }
    if (end.is_null()) return {{"error", "no completed recovery after the kill"}};
    const json& rec = end["recovery"];
    int64_t resume = rec.value("resume_step", int64_t{-1});
    for (const auto& j : recs) {
      if (j.value("event", "") == "step" && j.value("time_us", int64_t{0}) >= kill_us &&
          j.value("step", int64_t{-1}) >= resume) {
        first_step_us = j["time_us"].get<int64_t>();
        break;
      }
    }
    auto ms = [&](int64_t us) { return us > 0 ? json((us - kill_us) / 1000.0) : json(nullptr); };
    int recoveries = 0;
    for (const auto& j : recs) {
      if (j.value("event", "") == "recovery_start" && j.value("time_us", int64_t{0}) >= kill_us &&
          j.value("time_us", int64_t{0}) <= end_us) {
        ++recoveries;
      }
    }
    return {{"journal",
             {{"ms_after_detection", rec["ms_after_fault"]},
              {"downtime_ms", rec.value("downtime_ms", 0.0)},
              {"causes", rec["causes"]},
              {"replacements", rec["replacements"]},
              {"old_world", rec["old_world"]},
              {"new_world", rec["new_world"]},
              {"lost_steps", rec["lost_steps"]},
              {"bytes_copied", rec["bytes_copied"]},
              {"sources", rec["sources"]},
              {"connect_ms", rec["connect_ms"]},
              {"transfer_ms", rec["transfer_ms"]}}},
            {"recoveries_started", recoveries},
            {"ms_after_kill",
             {{"detected", ms(start_us)},
              {"plan_published", ms(plan_us)},
              {"first_step_completed", ms(first_step_us)},
              {"recovery_end", ms(end_us)}}},
            {"downtime_from_kill_ms", std::max(0.0, (end_us - kill_us) / 1000.0 - normal_step_ms)},
            {"normal_step_ms", normal_step_ms}};
  }

  void Analyze(json* r) const {
    auto recs = ReadRecords(journal_);
    int64_t job_start_us = 0, first_step_us = 0, plan1_us = 0;
    std::vector<double> intervals;
    int64_t prev_step_us = 0;
    for (const auto& j : recs) {
      std::string ev = j.value("event", "");
      int64_t t = j.value("time_us", int64_t{0});
      if (ev == "job_start" && job_start_us == 0) job_start_us = t;
      if (ev == "plan" && plan1_us == 0) plan1_us = t;
      if (ev == "step") {
        if (first_step_us == 0) first_step_us = t;
        if (prev_step_us > 0 && (host_kill_us_ == 0 || t < host_kill_us_)) {
          intervals.push_back((t - prev_step_us) / 1e3);
        }
        prev_step_us = t;
      }
    }
    // The steps before the first kill, less the first few (connections being made).
    if (intervals.size() > 5) intervals.erase(intervals.begin(), intervals.begin() + 3);
    double normal_step_ms = Percentile(intervals, 50);
    auto s = [](int64_t a, int64_t b) {
      return a > 0 && b > 0 ? json((b - a) / 1e6) : json(nullptr);
    };
    (*r)["startup"] = {{"controller_start_to_first_step_s", s(controller_start_us_, first_step_us)},
                       {"job_start_to_first_step_s", s(job_start_us, first_step_us)},
                       {"controller_start_to_first_plan_s", s(controller_start_us_, plan1_us)},
                       {"normal_step_ms", normal_step_ms}};
    // Connections per rank, by generation.
    std::map<int, std::vector<double>> open, opened;
    for (const auto& j : recs) {
      if (j.value("event", "") != "connections") continue;
      int g = j.value("generation", 0);
      open[g].push_back(j.value("open", 0));
      opened[g].push_back(j.value("opened_total", 0));
    }
    json conns = json::array();
    for (const auto& [g, v] : open) {
      conns.push_back({{"generation", g}, {"open", Stats(v)}, {"opened_total", Stats(opened[g])}});
    }
    (*r)["connections"] = conns;
    (*r)["host_loss"] = FaultReport(recs, host_kill_us_, normal_step_ms);
    (*r)["single_kill_recovery"] = FaultReport(recs, single_kill_us_, normal_step_ms);
    // Host loss over single kill: from this program's clock, and the journal's downtime_ms.
    auto ratio = [&](const char* path) {
      json a = Path(*r, std::string("host_loss/") + path),
           b = Path(*r, std::string("single_kill_recovery/") + path);
      return a.is_number() && b.is_number() && b.get<double>() > 0
                 ? json(a.get<double>() / b.get<double>())
                 : json(nullptr);
    };
    (*r)["ratio_host_loss_to_single_kill"] = ratio("downtime_from_kill_ms");
    (*r)["ratio_journal_downtime"] = ratio("journal/downtime_ms");
  }

  const int n_;
  const int run_;
  const HostsOptions o_;
  int hosts_ = 0, per_host_ = 0;
  std::string dir_, journal_;
  std::unique_ptr<NetnsCluster> cluster_;
  pid_t controller_pid_ = -1;
  std::optional<int> controller_exit_;
  std::string controller_address_;
  std::map<std::string, pid_t> agents_;
  int64_t controller_start_us_ = 0, host_kill_us_ = 0, single_kill_us_ = 0;
};

std::string RunLabel(const json& r) {
  return fmt::format("{}#{}", r["n"].get<int>(), r.value("run", 1));
}

void PrintHostsTable(const json& results, const json& medians) {
  fmt::print(
      "\nA. real processes on network namespaces (test workers; a whole host SIGKILLed, later one "
      "worker)\n");
  fmt::print("{:>6} {:>6} {:>9} {:>8}  {}\n", "N#run", "hosts", "1st step", "step",
             "connections per rank by generation: open median/max, opened_total median/max");
  for (const auto& r : results) {
    std::string conns;
    for (const auto& c : r.value("connections", json::array())) {
      conns += fmt::format(
          "g{} {}/{} {}/{}   ", c["generation"].get<int>(), Num(Path(c, "open/median"), "{:.0f}"),
          Num(Path(c, "open/max"), "{:.0f}"), Num(Path(c, "opened_total/median"), "{:.0f}"),
          Num(Path(c, "opened_total/max"), "{:.0f}"));
    }
    fmt::print("{:>6} {:>6} {:>8}s {:>6}ms  {}\n", RunLabel(r),
               fmt::format("{}+1", r.value("worker_hosts", 0)),
               Num(Path(r, "startup/controller_start_to_first_step_s"), "{:.2f}"),
               Num(Path(r, "startup/normal_step_ms"), "{:.0f}"), conns);
  }
  fmt::print(
      "\n  ms after the kill (this program's clock)              | journal: ms after the "
      "detection\n");
  fmt::print("{:>6} {:<11} {:>6} {:>6} {:>8} {:>8} {:>8} | {:>6} {:>6} {:>6} {:>8} {:>4}\n",
             "N#run", "fault", "detect", "plan", "1st step", "rec.end", "downtime", "abort", "plan",
             "state", "1st step", "recs");
  for (const auto& r : results) {
    for (const char* key : {"host_loss", "single_kill_recovery"}) {
      const char* label = std::string(key) == "host_loss" ? "host" : "one worker";
      if (!r.contains(key) || !r[key].is_object() || !r[key].contains("ms_after_kill")) {
        fmt::print("{:>6} {:<11} {}\n", RunLabel(r), label, r.value("outcome", "?"));
        continue;
      }
      const json& f = r[key];
      const json& k = f["ms_after_kill"];
      const json& p = f["journal"]["ms_after_detection"];
      fmt::print(
          "{:>6} {:<11} {:>6} {:>6} {:>8} {:>8} {:>8} | {:>6} {:>6} {:>6} {:>8} {:>4}\n",
          RunLabel(r), label, Num(k["detected"], "{:.0f}"), Num(k["plan_published"], "{:.0f}"),
          Num(k["first_step_completed"], "{:.0f}"), Num(k["recovery_end"], "{:.0f}"),
          Num(f["downtime_from_kill_ms"], "{:.0f}"), Num(p.value("aborted", json()), "{:.0f}"),
          Num(p.value("plan_published", json()), "{:.0f}"),
          Num(p.value("state_ready", json()), "{:.0f}"),
          Num(p.value("first_step_completed", json()), "{:.0f}"), f.value("recoveries_started", 0));
    }
  }
  fmt::print(
      "  downtime: from the kill to recovery_end (every member completed the resume step), less a "
      "normal "
      "step\n");
  fmt::print(
      "\n  median of the runs, ms: from the kill (this program's clock); state ready from the "
      "detection "
      "(journal)\n");
  fmt::print(
      "{:>4} {:>4} {:>9} {:>6} | {:>6} {:>6} {:>8} {:>6} | {:>6} {:>6} {:>8} {:>6} | {:>10}\n", "N",
      "runs", "1st step", "step", "host:", "plan", "downtime", "state", "one:", "plan", "downtime",
      "state", "host/one");
  for (const auto& m : medians) {
    fmt::print(
        "{:>4} {:>4} {:>8}s {:>6} | {:>6} {:>6} {:>8} {:>6} | {:>6} {:>6} {:>8} {:>6} | {:>10}\n",
        m["n"].get<int>(), m["runs"].get<int>(),
        Num(m["startup/controller_start_to_first_step_s"], "{:.2f}"),
        Num(m["startup/normal_step_ms"], "{:.0f}"), "",
        Num(m["host_loss/ms_after_kill/plan_published"], "{:.0f}"),
        Num(m["host_loss/downtime_from_kill_ms"], "{:.0f}"),
        Num(m["host_loss/journal/ms_after_detection/state_ready"], "{:.0f}"), "",
        Num(m["single_kill_recovery/ms_after_kill/plan_published"], "{:.0f}"),
        Num(m["single_kill_recovery/downtime_from_kill_ms"], "{:.0f}"),
        Num(m["single_kill_recovery/journal/ms_after_detection/state_ready"], "{:.0f}"),
        Num(m["ratio_host_loss_to_single_kill"], "{:.2f}"));
  }
}

#endif  // NONSTOP_SCALE_HOSTS

// For each size: the median over its runs of each of `paths` (null where no run has it).
json Medians(const json& runs, const std::vector<std::string>& paths) {
  std::map<int, std::map<std::string, std::vector<double>>> values;
  std::map<int, int> count;
  for (const auto& r : runs) {
    int n = r["n"].get<int>();
    ++count[n];
    for (const auto& p : paths) {
      json v = Path(r, p);
      if (v.is_number()) values[n][p].push_back(v.get<double>());
    }
  }
  json out = json::array();
  for (const auto& [n, runs_of_n] : count) {
    json m = {{"n", n}, {"runs", runs_of_n}};
    for (const auto& p : paths) {
      auto it = values[n].find(p);
      m[p] = it == values[n].end() ? json(nullptr) : json(Percentile(it->second, 50));
    }
    out.push_back(m);
  }
  return out;
}

const std::vector<std::string> kSimSummary = {"fault_to_plan_published_ms",
                                              "fault_to_plan_with_journal_ms",
                                              "fault/host_lost_handle_ms",
                                              "plan/ready_handles_ms",
                                              "plan/plan_handle_ms",
                                              "plan_encode/encode/runtime_encode_ms",
                                              "fault_journal/journal/append_ms",
                                              "recovery_handles_ms",
                                              "steady/status_ms",
                                              "steady/status_dump_ms",
                                              "steady/tick_ms",
                                              "form/rss_job_kib",
                                              "register/ms",
                                              "form/join_handles_ms",
                                              "form/forming_handle_ms"};

const std::vector<std::string> kHostsSummary = {
    "startup/controller_start_to_first_step_s",
    "startup/normal_step_ms",
    "host_loss/ms_after_kill/detected",
    "host_loss/ms_after_kill/plan_published",
    "host_loss/ms_after_kill/recovery_end",
    "host_loss/downtime_from_kill_ms",
    "host_loss/journal/ms_after_detection/plan_published",
    "host_loss/journal/ms_after_detection/state_ready",
    "host_loss/journal/ms_after_detection/first_step_completed",
    "single_kill_recovery/ms_after_kill/detected",
    "single_kill_recovery/ms_after_kill/plan_published",
    "single_kill_recovery/ms_after_kill/recovery_end",
    "single_kill_recovery/downtime_from_kill_ms",
    "single_kill_recovery/journal/ms_after_detection/plan_published",
    "single_kill_recovery/journal/ms_after_detection/state_ready",
    "single_kill_recovery/journal/ms_after_detection/first_step_completed",
    "ratio_host_loss_to_single_kill",
    "ratio_journal_downtime"};

std::vector<int> ParseSizes(const std::string& text) {
  std::vector<int> out;
  size_t start = 0;
  while (start < text.size()) {
    size_t comma = text.find(',', start);
    if (comma == std::string::npos) comma = text.size();
    out.push_back(std::stoi(text.substr(start, comma - start)));
    start = comma + 1;
  }
  return out;
}

int Main(int argc, char** argv) {
  CLI::App app{
      "Scale: the control plane with many workers: real processes on namespaces, and the "
      "controller "
      "alone at up to 100,000 simulated workers (docs/scale.md)"};
  std::string part = "all";
  std::string out = "bench-results/scale";
  std::string sim_sizes = "1000,10000,100000";
  std::string host_sizes = "4,16,64";
  SimOptions so;
  double sim_memory_gib = 8, sim_timeout_s = 300;
  int repeat = 3;
  app.add_option("--part", part, "all, sim or hosts")
      ->capture_default_str()
      ->check(CLI::IsMember({"all", "sim", "hosts"}));
  app.add_option("--out", out, "Output directory (results.json, journals, logs)")
      ->capture_default_str();
  app.add_option("--repeat", repeat, "Runs of each size (tables show every run and the medians)")
      ->capture_default_str()
      ->check(CLI::Range(1, 100));
  app.add_option("--sim-sizes", sim_sizes, "Simulated workers (multiples of 8), comma-separated")
      ->capture_default_str();
  app.add_option("--sim-memory-gib", sim_memory_gib, "Address-space limit of each simulated size")
      ->capture_default_str()
      ->check(CLI::Range(0.5, 1024.0));
  app.add_option("--sim-timeout-s", sim_timeout_s, "Time limit of each simulated size")
      ->capture_default_str()
      ->check(CLI::Range(1.0, 1e6));
  app.add_option("--sim-encode-budget-s", so.encode_budget_s,
                 "Encoding one plan per member stops after this long and is extrapolated")
      ->capture_default_str();
  app.add_option("--sim-spare-hosts", so.spare_hosts, "Spare hosts of 8 spares in the simulation")
      ->capture_default_str()
      ->check(CLI::Range(0, 1000));
  app.add_option("--seed", so.seed, "Order of the simulated answers")->capture_default_str();
  app.add_option(
      "--sim-etcd", so.etcd,
      "etcd in the loop: host:port of an etcd, or 'start' for one of Debian's etcd-server "
      "in --out; the plan is published once etcd holds its records");
#ifdef NONSTOP_SCALE_HOSTS
  HostsOptions ho;
  app.add_option("--host-sizes", host_sizes,
                 "Test workers per job (spread over up to 8 hosts), comma-separated")
      ->capture_default_str();
  app.add_option("--elements", ho.elements, "The test worker's --elements")->capture_default_str();
  app.add_option("--sleep-ms", ho.sleep_ms, "The test worker's --sleep-ms (a step's compute)")
      ->capture_default_str();
  app.add_option("--heartbeat-timeout-ms", ho.heartbeat_timeout_ms,
                 "The controller's --heartbeat-timeout-ms")
      ->capture_default_str();
  app.add_option("--bin", ho.bin,
                 "Directory holding nonstop and nonstop-test-worker (default: this program's)");
#endif
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  std::error_code ec;
  fs::create_directories(out, ec);
  if (ec) {
    fmt::print(stderr, "nonstop-bench-scale: cannot create --out {}: {}\n", out, ec.message());
    return 2;
  }
  json doc = {{"benchmark", "scale"}};
  bool ok = true;

  if (part == "all" || part == "hosts") {
#ifdef NONSTOP_SCALE_HOSTS
    if (ho.bin.empty()) ho.bin = SelfDir();
    ho.out = out;
    for (const std::string& p : {ho.bin + "/nonstop", ho.bin + "/nonstop-test-worker"}) {
      if (::access(p.c_str(), X_OK) != 0) {
        fmt::print(
            stderr,
            "nonstop-bench-scale: {} is not an executable (HINT: --bin DIR, e.g. build/bin)\n", p);
        return 2;
      }
    }
    json results = json::array();
    for (int n : ParseSizes(host_sizes)) {
      for (int run = 1; run <= repeat; ++run) {
        fmt::print("hosts: N = {}, run {} ...\n", n, run);
        std::fflush(stdout);
        auto t = SteadyClock::now();
        json r = HostsRun(n, run, ho).Run();
        r["wall_s"] = MsSince(t) / 1000;
        fmt::print("hosts: N = {}, run {}: {} in {:.0f} s\n", n, run, r.value("outcome", "?"),
                   r["wall_s"].get<double>());
        ok &= r.value("outcome", "") == "done";
        results.push_back(r);
        std::ofstream(out + "/results.json")
            << json({{"benchmark", "scale"}, {"hosts", results}}).dump(2) << "\n";
      }
    }
    doc["hosts"] = results;
    doc["hosts_median"] = Medians(results, kHostsSummary);
    PrintHostsTable(results, doc["hosts_median"]);
#else
    fmt::print(
        "hosts: not built in (this build has no tests/multihost harness: configure with "
        "NONSTOP_BUILD_TESTS=ON)\n");
    doc["hosts"] = "not built";
    if (part == "hosts") return 2;
#endif
  }

  if (part == "all" || part == "sim") {
    std::unique_ptr<nonstop::testing::EtcdServer> etcd;
    if (so.etcd == "start") {
      etcd = std::make_unique<nonstop::testing::EtcdServer>(out);
      if (etcd->endpoint().empty()) {
        fmt::print(stderr, "nonstop-bench-scale: --sim-etcd start: etcd did not start\n{}\n",
                   etcd->Output());
        return 1;
      }
      so.etcd = etcd->endpoint();
    }
    json results = json::array();
    for (int n : ParseSizes(sim_sizes)) {
      if (n < 16 || n % 8 != 0) {
        fmt::print(stderr,
                   "nonstop-bench-scale: --sim-sizes: {} is not a multiple of 8 of at least 16\n",
                   n);
        return 2;
      }
      for (int run = 1; run <= repeat; ++run) {
        fmt::print("sim: {} workers, run {} ...\n", n, run);
        std::fflush(stdout);
        json r = RunSimSize(n, run, so, sim_memory_gib, sim_timeout_s, out);
        Derive(&r);
        fmt::print("sim: {} workers, run {}: {} in {:.1f} s\n", n, run, r.value("outcome", "?"),
                   r["wall_s"].get<double>());
        std::fflush(stdout);
        ok &= r.value("outcome", "") == "done";
        results.push_back(r);
      }
    }
    doc["sim"] = results;
    doc["sim_median"] = Medians(results, kSimSummary);
    PrintSimTable(results, doc["sim_median"]);
    if (!so.etcd.empty()) PrintEtcdTable(results);
  }
  std::ofstream(out + "/results.json") << doc.dump(2) << "\n";
  fmt::print("\nwrote {}/results.json\n", out);
  return ok ? 0 : 1;
}

}  // namespace
}  // namespace nonstop::bench

int main(int argc, char** argv) { return nonstop::bench::Main(argc, argv); }
