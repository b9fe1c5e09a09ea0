#include "controller/runtime.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <optional>
#include <set>
#include <thread>
#include <type_traits>
#include <variant>

#include <fmt/format.h>

#include "common/crypto.h"
#include "common/job_token.h"
#include "common/logging.h"
#include "common/signals.h"
#include "common/unique_fd.h"
#include "control/fault_spec.h"
#include "controller/control_server.h"
#include "controller/http_api.h"
#include "controller/job_metrics.h"
#include "controller/journal.h"
#include "controller/plan_wire.h"
#include "controller/progress_line.h"
#include "controller/takeover.h"
#include "launcher/output_writer.h"
#include "net/event_loop.h"
#include "nonstop/settings.h"

namespace nonstop::controller {

namespace {

// 128 bits from the operating system's generator (libcrypto's), in hex.
std::string RandomToken() { return crypto::Hex(crypto::RandomBytes(16)); }

// The CPU time this process (all its threads) has used.
Clock::duration ProcessCpuTime() {
  timespec ts{};
  ::clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return std::chrono::seconds(ts.tv_sec) + std::chrono::nanoseconds(ts.tv_nsec);
}

// A deposed controller's record lists at most this many of the orders it did not send.
constexpr size_t kDroppedOrdersListed = 64;
// A turn of the loop this long is logged (Runtime::Turn): a fifth of the default heartbeat timeout.
constexpr Millis kSlowTurn{200};
constexpr Millis kTickEvery{50};         // the detectors' period
constexpr Millis kPollWait{20};          // the most a turn waits for its sockets
constexpr Millis kJournalStall{10'000};  // an order waits no longer for the journal's sync

// One order as a deposed controller's record lists it: its kind and whom it was for.
nlohmann::json DescribeOrder(const Action& action) {
  return std::visit(
      [](const auto& a) -> nlohmann::json {
        using T = std::decay_t<decltype(a)>;
        if constexpr (std::is_same_v<T, SendPlan>) {
          return {{"order", "plan"}, {"worker_id", a.worker_id}};
        } else if constexpr (std::is_same_v<T, SendAbort>) {
          return {{"order", "abort"}, {"worker_id", a.worker_id}};
        } else if constexpr (std::is_same_v<T, SendDrain>) {
          return {{"order", "drain"}, {"worker_id", a.worker_id}};
        } else if constexpr (std::is_same_v<T, SendShutdown>) {
          return {{"order", "shutdown"}, {"worker_id", a.worker_id}};
        } else if constexpr (std::is_same_v<T, KillWorker>) {
          return {{"order", "kill"}, {"worker_id", a.worker_id}};
        } else if constexpr (std::is_same_v<T, SignalWorker>) {
          return {{"order", "signal"}, {"worker_id", a.worker_id}, {"signal", a.signal}};
        } else if constexpr (std::is_same_v<T, SpawnWorker>) {
          return {{"order", "spawn"}, {"worker_id", a.worker_id}, {"host", a.host}};
        } else if constexpr (std::is_same_v<T, CloseHost>) {
          return {{"order", "close_host"}, {"host", a.host_id}};
        } else if constexpr (std::is_same_v<T, EndJob>) {
          return {{"order", "end_job"}, {"exit_code", a.exit_code}};
        } else if constexpr (std::is_same_v<T, ScaleReply>) {
          return {{"order", "scale_reply"}, {"request_id", a.request_id}};
        } else if constexpr (std::is_same_v<T, SendStoreReply>) {
          return {{"order", "store_reply"}, {"worker_id", a.worker_id}};
        } else {
          static_assert(std::is_same_v<T, PrintLine> || std::is_same_v<T, AppendJournal>);
          return {{"order", "journal"}};  // not listed (StepDown leaves lines out)
        }
      },
      action);
}

// The runtime of one controller process: the Controller core, the I/O that
// feeds it events, and one handler per Action type (Do). One thread drives
// it (docs/thread-model.md); the callbacks of the event loop and the control
// server run on that thread and only queue events.
class Runtime {
 public:
  explicit Runtime(const RuntimeOptions& options)
      : o_(options), name_(o_.name), leadership_(o_.leadership), core_(o_.core) {}

  int Run();

 private:
  // ---- start-up, in order; each returns an exit code when the job cannot start
  std::optional<int> ReadHistory();
  std::optional<int> ReadEtcdHistory();
  std::optional<int> ReadResumedJournal();
  std::optional<int> OpenJournal();
  int64_t Epoch() const;
  std::optional<int> StartServers();
  std::optional<int> WriteJobFiles();
  // The job file (job.json), with job_file_torchrun_: written again when those change.
  void WriteJobFile();
  nlohmann::json TorchrunOfASpare() const;
  nlohmann::json job_file_torchrun_;  // as the job file says them
  // Where the token is written: --job-token-file, or job.token beside the journal.
  std::string TokenFile() const {
    return o_.token_file.empty() ? TokenFileFor(journal_->path()) : o_.token_file;
  }
  void PrintBanner();
  void JournalStart();
  void WatchSignals();

  // ---- the loop
  // One turn of the loop; an exit code when this controller stops leading.
  std::optional<int> Turn();
  void Tick();
  void SaySlowTurn(Clock::duration took);
  void Ping();
  void Handle(const Event& e);
  void RunPending();
  bool JournalStalled(Deadline queued_at);
  void DrainEvents();
  void PublishStatus();
  int StepDown(nlohmann::json record, const std::string& line, int code);
  int Finish();

  // ---- one handler per action
  void Execute(const Action& a) {
    std::visit([this](const auto& act) { Do(act); }, a);
  }
  void Do(const SendPlan& a);
  void Do(const SendShutdown& a);
  void Do(const SendAbort& a);
  void Do(const SendDrain& a);
  void Do(const ScaleReply& a);
  void Do(const SendStoreReply& a) {
    server_->Send(a.worker_id, control::kMsgStoreReply, control::Encode(a.msg));
  }
  void Do(const KillWorker& a);
  void Do(const SignalWorker& a) { Signal(a.worker_id, a.signal); }
  // Workers run on the hosts of agents: the start goes to the host's agent; one that cannot be
  // sent (the agent is gone) fails the start (ProcessExited, code 127).
  void Do(const SpawnWorker& a);
  void Do(const CloseHost& a);
  void Do(const AppendJournal& a);
  void Do(const PrintLine& a) { Print(fmt::format("[nonstop] {}\n", a.line)); }
  void Do(const EndJob& a);

  // ---- helpers of the handlers
  void Print(const std::string& text);
  // The variables every worker gets from the controller: its own (id, spare, resume) and the
  // job's (JobEnv); an agent adds its own (NONSTOP_CONTROLLER, NONSTOP_JOB_TOKEN, NONSTOP_HOST_ID,
  // NONSTOP_DATA_HOST).
  std::vector<std::pair<std::string, std::string>> WorkerEnv(int id, bool spare, bool resume) const;
  // What the job tells every worker, whoever starts it: the controller's spawns (WorkerEnv) and
  // `nonstop worker` (the job file's "env"). One list, so that the two cannot drift.
  std::vector<std::pair<std::string, std::string>> JobEnv() const;
  // Signals a worker through its host's agent.
  void Signal(int id, int sig);
  // Each agent learns which ranks its workers hold, to label their output:
  // every agent with each new plan (`only_host` empty), an agent that
  // (re)joins at once. Only labels: sent as they are decided.
  void SendRanksToAgents(uint32_t generation, const std::vector<int>& members,
                         const std::string& only_host);

  RuntimeOptions o_;
  const std::string& name_;
  // not owned; outlives the runtime (RuntimeOptions::leadership)
  coord::Leadership* const leadership_;
  std::optional<JournalTakeover> takeover_;
  // What ReadJournal could not believe in etcd, and whether the records stop at such a gap.
  std::vector<coord::JournalForgery> etcd_forgeries_;
  bool journal_cut_ = false;
  std::vector<nlohmann::json> history_;  // the records of the job so far (a takeover's)
  std::unique_ptr<Journal> journal_;
  int64_t epoch_ = 1;
  UniqueFd sigfd_;
  net::EventLoop loop_;
  std::deque<Event> events_;
  Controller core_;
  std::string token_;
  std::unique_ptr<ControlServer> server_;
  std::string controller_address_;
  std::unique_ptr<HttpApi> http_;
  std::map<int, std::unique_ptr<ScaleCall>> scale_calls_;
  // Everything this loop prints goes through bounded writers: a reader of our
  // output that does not keep up loses lines (counted), never stalls the job.
  // Log lines too (control-port refusals, lost workers): never a blocking write from the loop.
  std::optional<launcher::BoundedStdio> own_stdio_;  // unless the options name one (o_.stdio)
  launcher::OutputWriter* out_ = nullptr;            // o_.stdio's or own_stdio_'s stdout
  // With a progress line (a terminal), every line of ours clears it first and
  // it is drawn again under the line: the terminal keeps one live line at the bottom.
  std::string shown_progress_;
  JobMetrics metrics_;     // GET /metrics, from the journal's records as they are written
  ProgressLine progress_;  // the terminal's live line (o_.progress_line), from the same records
  // An elastic host's workers told to run at nice 0 (with their first plan). Its refills warm up at
  // o_.refill_nice, which the front end leaves 0 where the priority could not be raised back: a
  // worker stuck at nice 10 would be a straggler for the rest of the job.
  std::set<int> at_normal_priority_;

  std::optional<EndJob> ended_;
  Deadline agents_gone_by_ = kNoDeadline;
  bool interrupted_ = false;
  bool hand_over_ = false;  // SIGTERM with etcd: give the job to a standby instead of ending it
  // Every member of a generation gets the same plan (one PlanMsg shared by
  // their SendPlan actions): its agents are told the ranks once, and each of
  // its payloads (against no base, against the previous plan) is encoded once
  // for all the members it goes to (PlanWire).
  std::shared_ptr<const control::PlanMsg> ranks_sent_for_;
  PlanWire plan_wire_;
  std::shared_ptr<const control::AbortMsg> encoded_abort_;  // likewise the abort of a generation
  std::string encoded_abort_payload_;
  // Calls to core_.Handle so far: /status changes only when this does.
  uint64_t handled_ = 0;
  // Write before acting: records are queued at once, and the orders that
  // follow them wait until the records before them are on disk (the journal's
  // writer synced them: this loop does not wait for the disk, it goes on
  // reading heartbeats) and, with etcd, held by etcd, so that a controller
  // taking over knows every order that went out. With etcd an order also
  // waits while the lease is not known to be held. A line to print waits
  // only for the orders before it.
  struct Pending {
    uint64_t after;          // leadership_->appended() once its event's records were appended
    uint64_t journal_after;  // journal_->appended() then
    Deadline queued_at;
    Action action;
  };
  std::deque<Pending> pending_;
  // A journal whose sync has not come back for kJournalStall (a hung disk, a lost NFS mount) is
  // treated as failed: orders go out without waiting for it, said once, until it has synced what
  // it held then (stalled_upto_). A controller that held them back would stop the job while its
  // pings said it was alive.
  bool journal_stalled_ = false;
  bool stop_orders_held_ = false;  // what the core was last told (StopOrdersHeld)
  uint64_t stalled_upto_ = 0;
  uint64_t seen_durable_ = 0;                // journal_->durable() as this loop last saw it
  Deadline durable_grew_at_ = Clock::now();  // when that grew
  Deadline stall_suspected_at_ = kNoDeadline;
  Deadline leaderless_warn_at_ = kNoDeadline;
  // Slow turns not said yet (SaySlowTurn), the worst of them, and when the next may be.
  int slow_turns_ = 0;
  Clock::duration worst_turn_{};
  Deadline next_slow_say_{};
  // /status and /metrics are published after every loop turn that changed
  // the state, as long as building them is cheap. Status() lists every
  // worker: with many thousands it takes milliseconds, so it is then
  // published at most once per 20 × its cost (at most ~5% of the loop's
  // time goes to it; docs/scale.md).
  uint64_t published_ = ~uint64_t{0};
  Deadline next_publish_ = Clock::now();
  Deadline next_tick_ = Clock::now();
  // When the last tick ended, and the process's CPU time then (Tick: ControllerStalled).
  Deadline last_tick_at_{};
  Clock::duration last_tick_cpu_{};
  Deadline next_progress_ = Clock::now();
  Deadline next_ping_ = Clock::now();
};

// ---------------------------------------------------------------- start-up

std::optional<int> Runtime::ReadHistory() {
  if (leadership_ != nullptr) return ReadEtcdHistory();
  if (!o_.resume.empty()) return ReadResumedJournal();
  return std::nullopt;
}

std::optional<int> Runtime::ReadEtcdHistory() {
  // The job key seals what the leaders write to etcd: the first leader's token is made here.
  token_ = o_.token.empty() ? RandomToken() : o_.token;
  auto read = leadership_->ReadJournal(crypto::JobKey(token_));
  if (!read.ok()) {
    fmt::print(stderr, "{}: reading the job's journal from etcd: {}\n", name_,
               read.status().ToString());
    // Transient errors are retried inside ReadJournal until the lease is lost: then stand by again.
    return leadership_->deposed() ? kExitDeposed : 1;
  }
  if (read->keys > 0 && o_.token.empty()) {
    // Workers and agents hold the job's token: a leader with another would refuse them all (and
    // cannot read the journal, sealed with it).
    fmt::print(
        stderr,
        "{}: cannot take over the running job: its token file {} is not here (this controller "
        "needs the file the first one wrote, e.g. on a shared filesystem)\n",
        name_, o_.token_file);
    leadership_->Resign();
    return 1;
  }
  history_ = std::move(read->records);
  // Values in etcd nobody with the job key wrote: each a gap the takeover fills from what the
  // members and agents report; journaled once this leader's journal is open (JournalStart).
  etcd_forgeries_ = std::move(read->forgeries);
  journal_cut_ = read->cut;
  if (journal_cut_ && history_.empty()) {
    fmt::print(stderr,
               "{}: etcd holds the job's keys but no record of it that verifies with the job key "
               "(forged or corrupt): refusing to start it anew over its running workers\n",
               name_);
    leadership_->Resign();
    return 1;
  }
  for (const auto& r : history_) {
    if (!r.contains("event") || r["event"] != "job_end") continue;
    // A standby that wins after the job ended: nothing to lead.
    int code = r.contains("exit_code") && r["exit_code"].is_number_integer()
                   ? r["exit_code"].get<int>()
                   : 1;
    // never read as "deposed: campaign again"
    if (code == kExitDeposed || code < 0 || code > 255) code = 1;
    fmt::print(
        "{}: the job already ended (exit code {}): {}\n", name_, code,
        r.contains("reason") && r["reason"].is_string() ? r["reason"].get<std::string>() : "");
    leadership_->Resign();
    return code;
  }
  if (!history_.empty()) {
    auto t = TakeoverFromJournal(history_);
    if (!t.ok()) {
      fmt::print(stderr, "{}: taking over from etcd's journal: {}\n", name_, t.status().message());
      return 1;
    }
    takeover_ = std::move(*t);
    // The members may be generations ahead of a journal cut short by a forgery.
    takeover_->state.journal_cut = journal_cut_;
  }
  return std::nullopt;
}

std::optional<int> Runtime::ReadResumedJournal() {
  bool torn = false;
  auto records = Journal::Read(o_.resume, &torn);
  if (records.ok() && torn) {
    NONSTOP_LOG_WARNING(
        "--resume {}: its last line was torn (the controller died while writing it); left out",
        o_.resume);
  }
  if (!records.ok()) {
    fmt::print(stderr, "{}: --resume {}: {}\n", name_, o_.resume, records.status().ToString());
    return kExitUsage;
  }
  auto t = TakeoverFromJournal(*records);
  if (!t.ok()) {
    fmt::print(stderr, "{}: --resume {}: {}\n", name_, o_.resume, t.status().message());
    return kExitUsage;
  }
  takeover_ = std::move(*t);
  history_ = std::move(*records);
  if (o_.listen.port == 0) {
    auto where = net::ParseHostPort(takeover_->controller);
    if (!where.ok()) {
      fmt::print(stderr,
                 "{}: --resume {}: the journal's controller address '{}' is not usable ({}); pass "
                 "--listen\n",
                 name_, o_.resume, takeover_->controller, where.status().message());
      return kExitUsage;
    }
    o_.listen = *where;
  }
  return std::nullopt;
}

std::optional<int> Runtime::OpenJournal() {
  // The local journal goes on from its predecessors' records, as etcd holds them (once
  // compacted: a snapshot record and the records after it).
  auto journal =
      !o_.resume.empty() ? Journal::OpenForAppend(o_.resume) : Journal::Open(o_.journal, history_);
  if (!journal.ok()) {
    fmt::print(stderr, "{}: {}\n", name_, journal.status().ToString());
    return 1;
  }
  journal_ = std::move(*journal);
  if (leadership_ != nullptr) {
    // Only what a takeover reads goes to etcd (not ready, recovered, …).
    journal_->set_mirror([leadership = leadership_](const nlohmann::json& r) {
      if (TakeoverReads(r)) leadership->Append(r);
    });
  }
  return std::nullopt;
}

// This controller's epoch: a worker or agent never follows a controller of
// an older one. With etcd, the leader key's create revision; with a
// journal, one more than the controllers it records.
int64_t Runtime::Epoch() const {
  if (leadership_ != nullptr) return leadership_->epoch();
  int64_t epoch = 1;
  for (const auto& r : history_) {
    if (!r.contains("event") || (r["event"] != "job_start" && r["event"] != "controller_start"))
      continue;
    // Records from before epochs were journaled count as epoch 1.
    int64_t e =
        r.contains("epoch") && r["epoch"].is_number_integer() ? r["epoch"].get<int64_t>() : 1;
    epoch = std::max(epoch, e + 1);
  }
  return epoch;
}

std::optional<int> Runtime::StartServers() {
  if (token_.empty()) token_ = o_.token.empty() ? RandomToken() : o_.token;
  ControlServerOptions server_options;
  server_options.epoch = epoch_;
  auto server = ControlServer::Create(
      &loop_, o_.listen, token_, [this](Event e) { events_.push_back(std::move(e)); },
      server_options);
  if (!server.ok()) {
    fmt::print(stderr, "{}: cannot start the controller: {}\n", name_, server.status().ToString());
    return 1;
  }
  server_ = std::move(*server);
  if (leadership_ != nullptr) {
    // Fencing: output that waited in a queue past the lease is dropped, not flushed.
    server_->SetSendGate([leadership = leadership_] { return leadership->Valid(); });
  }
  controller_address_ = server_->address().ToString();
  if (!o_.advertise_address.empty()) {
    // [v6]:port
    controller_address_ = net::FormatHostPort(o_.advertise_address, server_->address().port);
  } else if (net::IsWildcardHost(server_->address().host)) {
    fmt::print(
        stderr,
        "{}: listening on {} needs --advertise-address: the address agents and workers dial\n",
        name_, server_->address().ToString());
    return kExitUsage;
  }
  auto http = HttpApi::Start(o_.http_host, o_.http_port, journal_->path(), HttpCredential(token_),
                             HttpTls{o_.http_cert, o_.http_key});
  if (!http.ok()) {
    fmt::print(stderr, "{}: {}\n", name_, http.status().ToString());
    return 1;
  }
  http_ = std::move(*http);
  loop_.Watch(http_->wake_fd(), POLLIN, [this](short) {
    for (auto& call : http_->TakeCalls()) {
      events_.push_back(ScaleRequest{call->id, call->body, call->source});
      scale_calls_[call->id] = std::move(call);
    }
  });
  if (leadership_ != nullptr) {
    // Workers and agents look the leader up in etcd: from now on they find this one.
    Status s = leadership_->Publish(
        {{"controller", controller_address_}, {"http", http_->address()}}, crypto::JobKey(token_));
    if (!s.ok()) {
      fmt::print(stderr, "{}: publishing this controller's address in etcd: {}\n", name_,
                 s.ToString());
      return leadership_->deposed() ? kExitDeposed : 1;
    }
  }
  return std::nullopt;
}

std::optional<int> Runtime::WriteJobFiles() {
  // The token first, in a file of its own (mode 0600, written through a fresh temporary name): the
  // job file names it, so whoever reads the job file finds it written.
  const std::string token_file = TokenFile();
  auto existing = ReadJobTokenFile(token_file);
  if (!existing.ok() || *existing != token_) {  // one that holds it already is left alone
    if (Status t = WritePrivateFile(token_file, token_ + "\n"); !t.ok()) {
      fmt::print(stderr, "{}: writing the job token file: {}\n", name_, t.ToString());
      return 1;
    }
  }
  const std::string http_token_file = HttpTokenFileFor(journal_->path());
  if (Status t = WritePrivateFile(http_token_file, HttpCredential(token_) + "\n"); !t.ok()) {
    fmt::print(stderr, "{}: writing the HTTP token file: {}\n", name_, t.ToString());
    return 1;
  }
  job_file_torchrun_ = TorchrunOfASpare();
  WriteJobFile();
  return std::nullopt;
}

void Runtime::WriteJobFile() {
  std::error_code ec;
  const std::string token_file = TokenFile();
  std::filesystem::path absolute = std::filesystem::absolute(token_file, ec);
  // The job file: how `nonstop status`, `nonstop scale` and `nonstop worker` find this job. It
  // names the token's file and holds no secret itself.
  const std::string http_token_file = HttpTokenFileFor(journal_->path());
  nlohmann::json job = {
      {"controller", controller_address_},
      {"http", http_->address()},
      {"token_file", ec ? token_file : absolute.string()},
      {"http_token_file", std::filesystem::absolute(http_token_file, ec).string()},
      {"journal", journal_->path()},
      {"pid", ::getpid()},
      {"env", nlohmann::json::object()}};
  for (const auto& [name, value] : JobEnv()) job["env"][name] = value;
  // torchrun's variables of a spare started now, as the agents' spares get them: `nonstop worker`
  // starts one (RANK = WORLD_SIZE until it takes a rank, when the session sets the live values).
  // Written again when they change (DrainEvents), so that the world they say is the job's.
  job["torchrun"] = job_file_torchrun_;
  // HTTPS: `nonstop status` and `nonstop scale` dial https:// and trust this certificate.
  if (!o_.http_cert.empty()) job["http_cert"] = std::filesystem::absolute(o_.http_cert).string();
  Status s = WritePrivateFile(JobFileFor(journal_->path()), job.dump(2) + "\n");
  if (!s.ok()) NONSTOP_LOG_WARNING("{}", s.ToString());
}

void Runtime::PrintBanner() {
  fmt::print("{}\n", name_);
  fmt::print("  {:<20} {}{}\n", "controller", server_->address().ToString(),
             controller_address_ != server_->address().ToString()
                 ? " (advertised as " + controller_address_ + ")"
                 : "");
  fmt::print("  {:<20} {}{}\n", "http", http_->address(),
             o_.http_cert.empty() ? "" : " (HTTPS, certificate " + o_.http_cert + ")");
  // The token rides in the fragment, which the browser never sends: the page reads it for GET
  // /events. Only a terminal sees it: a log file or CI output does not get the job's token.
  if (::isatty(STDOUT_FILENO)) {
    fmt::print("  {:<20} {}://{}/#token={}\n", "dashboard", http_->scheme(), http_->address(),
               HttpCredential(token_));
  } else {
    fmt::print("  {:<20} {}://{}/ (add #token=<the token in {}>)\n", "dashboard", http_->scheme(),
               http_->address(), HttpTokenFileFor(journal_->path()));
  }
  if (o_.core.world_size == 0) {  // no world asked for: the hosts' nproc say it
    fmt::print("  {:<20} {}{}\n", "hosts", o_.core.min_hosts,
               o_.core.max_hosts > 0 ? fmt::format(" to {}", o_.core.max_hosts) : " or more");
    // the world asked for (nonstop run --nproc, --spares: its agent, the job's one host, brings
    // them)
  } else {
    fmt::print("  {:<20} {}\n", "workers", o_.core.world_size);
    fmt::print("  {:<20} {}\n", "spares", o_.core.spares);
  }
  fmt::print("  {:<20} {}\n", "job token file", TokenFile());
  fmt::print("  {:<20} {} ms\n", "heartbeat timeout", o_.core.heartbeat_timeout.count());
  fmt::print("  {:<20} {} ms\n", "abort timeout", o_.core.abort_timeout.count());
  fmt::print("  {:<20} {}\n", "recovery", o_.recovery_name);
  fmt::print("  {:<20} {}\n", "elastic policy", core_.PolicyJson().dump());
  fmt::print("  {:<20} {}\n", "checkpoints",
             o_.checkpoint_dir.empty()
                 ? std::string("none")
                 : fmt::format("{} (every {})", o_.checkpoint_dir,
                               o_.checkpoint_every > 0
                                   ? std::to_string(o_.checkpoint_every) + " steps"
                                   : fmt::format("Young/Daly, MTBF {} s", o_.mtbf_seconds)));
  std::string fault_text;
  for (const auto& f : o_.core.faults)
    fault_text += (fault_text.empty() ? "" : "; ") + control::FormatFault(f);
  fmt::print("  {:<20} {}\n", "injected faults", fault_text.empty() ? "none" : fault_text);
  fmt::print("  {:<20} {}{}\n", "journal", journal_->path(),
             journal_->rotated_to().empty()
                 ? ""
                 : " (the previous one was kept as " + journal_->rotated_to() + ")");
  std::fflush(stdout);
}

void Runtime::JournalStart() {
  nlohmann::json start = {{"event", "job_start"},     {"world_size", o_.core.world_size},
                          {"spares", o_.core.spares}, {"controller", controller_address_},
                          {"http", http_->address()}, {"policy", core_.PolicyJson()}};
  start["min_hosts"] = o_.core.min_hosts;
  if (takeover_) {
    // The journal goes on: this controller's start is not the job's.
    start["event"] = "controller_start";
    start["resume"] = true;
  }
  start["epoch"] = epoch_;
  if (leadership_ != nullptr) start["etcd"] = leadership_->endpoints();
  journal_->Append(start);
  for (const coord::JournalForgery& f : etcd_forgeries_) {
    journal_->Append({{"event", "etcd_value_forged"}, {"key", f.key}, {"why", f.why}});
    Print(
        fmt::format("[nonstop] etcd: {}: not believed, the takeover goes on without it\n", f.why));
  }
}

void Runtime::WatchSignals() {
  if (!sigfd_.valid()) return;
  loop_.Watch(sigfd_.get(), POLLIN, [this](short) {
    signalfd_siginfo si;
    while (::read(sigfd_.get(), &si, sizeof(si)) == sizeof(si)) {
      if (leadership_ != nullptr && si.ssi_signo == SIGTERM) {
        hand_over_ = true;
      } else {
        interrupted_ = true;
      }
    }
  });
}

int Runtime::Run() {
  if (auto code = ReadHistory()) return *code;
  if (auto code = OpenJournal()) return *code;
  epoch_ = Epoch();
  // SIGINT/SIGTERM end the job cleanly through the loop.
  sigset_t mask = BlockTerminationSignals();
  sigfd_ = UniqueFd(::signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK));
  if (auto code = StartServers()) return *code;
  if (auto code = WriteJobFiles()) return *code;
  launcher::BoundedStdio* stdio = o_.stdio;
  if (stdio == nullptr) stdio = &own_stdio_.emplace();
  out_ = &stdio->out();
  PrintBanner();
  JournalStart();
  WatchSignals();
  loop_.Watch(journal_->wake_fd(), POLLIN, [this](short) {
    uint64_t n;
    while (::read(journal_->wake_fd(), &n, sizeof(n)) == sizeof(n)) {
    }
    RunPending();  // the orders that waited for their records
  });
  if (leadership_ != nullptr) {
    loop_.Watch(leadership_->wake_fd(), POLLIN, [this](short) {
      uint64_t n;
      while (::read(leadership_->wake_fd(), &n, sizeof(n)) == sizeof(n)) {
      }
      // Someone without the job token wrote the leader key (docs/leader-discovery.md).
      for (const auto& f : leadership_->TakeLeaderKeyForgeries()) {
        journal_->Append({{"event", "leader_key_forged"},
                          {"value", f.value},
                          {"mod_revision", f.mod_revision},
                          {"why", f.why},
                          {"restored", f.restored}});
      }
      // ... or changed, deleted or added a key of the job's journal (coord::OwnRecords).
      for (const auto& f : leadership_->TakeRecordForgeries()) {
        journal_->Append({{"event", "etcd_record_forged"},
                          {"key", f.key},
                          {"mod_revision", f.mod_revision},
                          {"why", f.why},
                          {"restored", f.restored}});
      }
      RunPending();
    });
  }
  // before any worker or agent is heard
  if (takeover_) Handle(Takeover{std::move(takeover_->state)});
  while (true) {
    if (auto code = Turn()) return *code;
    if (ended_ && (server_->agents().empty() || Clock::now() >= agents_gone_by_)) break;
  }
  return Finish();
}

// ---------------------------------------------------------------- the loop

std::optional<int> Runtime::Turn() {
  const auto turn_from = Clock::now();
  loop_.RunOnce(kPollWait);
  DrainEvents();
  if (leadership_ != nullptr && leadership_->deposed()) {
    // Another controller leads (etcd refused our epoch, or our lease expired
    // there): step down at once. Workers and agents find the new leader
    // through etcd; nothing of ours is killed, the job is the new leader's.
    std::string why = leadership_->why_not_leading();
    return StepDown(
        {{"event", "deposed"}, {"reason", why}},
        fmt::format(
            "this controller (epoch {}) no longer leads: {}; the job goes on under the next "
            "leader",
            epoch_, why),
        kExitDeposed);
  }
  if (leadership_ != nullptr && !leadership_->Valid()) {
    if (leaderless_warn_at_ == kNoDeadline || Clock::now() >= leaderless_warn_at_) {
      Print(fmt::format("[nonstop] orders wait: {}; training goes on\n",
                        leadership_->why_not_leading()));
      leaderless_warn_at_ = DeadlineAfter(Millis(5'000));
    }
  } else {
    leaderless_warn_at_ = kNoDeadline;
  }
  PublishStatus();
  if (hand_over_ && !ended_) {
    // A controller host going down for maintenance (systemd, Slurm, Kubernetes send SIGTERM): the
    // job is not over. Give the lease back at once so a standby leads within its poll, not a TTL.
    leadership_->Resign();
    return StepDown(
        {{"event", "handover"}},
        fmt::format(
            "SIGTERM: this controller (epoch {}) hands the job over to a standby; it goes on "
            "(SIGINT ends the job)",
            epoch_),
        kExitInterrupted);
  }
  if (interrupted_ && !ended_) {
    interrupted_ = false;
    Handle(Interrupted{leadership_ != nullptr ? "SIGINT" : "a signal (SIGINT or SIGTERM)"});
    RunPending();
  }
  if (Clock::now() >= next_tick_) Tick();
  if (Clock::now() >= next_ping_) Ping();
  // flushes the journal once per turn (what happened is on disk within ≤ 20 ms), then acts
  RunPending();
  SaySlowTurn(Clock::now() - turn_from);
  return std::nullopt;
}

// A turn's work never waits on a peer or the disk (docs/thread-model.md: the journal has a writer
// of its own); one that takes long anyway (a starved process) delays every detector, so it is
// said: the first, then at most one line every 10 s with how many and the worst.
void Runtime::SaySlowTurn(Clock::duration took) {
  if (took < kPollWait + kSlowTurn) return;
  ++slow_turns_;
  worst_turn_ = std::max(worst_turn_, took);
  if (Clock::now() < next_slow_say_) return;
  Print(
      fmt::format("[nonstop] {} of the controller's loop took up to {} ms (its status and "
                  "orders, or a starved process): its detectors ran that much late\n",
                  slow_turns_ == 1 ? std::string("a turn") : fmt::format("{} turns", slow_turns_),
                  std::chrono::duration_cast<Millis>(worst_turn_).count()));
  slow_turns_ = 0;
  worst_turn_ = {};
  next_slow_say_ = DeadlineAfter(Millis(10'000));
}

void Runtime::Tick() {
  // Silence is judged on what the sockets hold, not on this loop's own delays: a heartbeat that
  // arrived while the turn was busy (a status publish, a starved process) is read before the
  // detectors run, and again while reading itself took long.
  for (int round = 0; round < 4; ++round) {
    const auto t0 = Clock::now();
    loop_.RunOnce(Millis(0));
    DrainEvents();
    if (Clock::now() - t0 < Millis(50)) break;
  }
  server_->CheckTimers(Clock::now());
  DrainEvents();
  // Since the last tick, the time this process neither used the CPU nor waited for this tick: it
  // did not run (a starved process, a stalled machine or VM). Its own work (a long status publish)
  // counts as running. The peers' silence is not judged over that time.
  const Deadline now = Clock::now();
  const Clock::duration cpu = ProcessCpuTime();
  if (const auto away = (now - last_tick_at_) - (cpu - last_tick_cpu_) - kTickEvery;
      last_tick_at_ != Deadline{} && away > kSlowTurn) {
    Handle(controller::ControllerStalled{std::chrono::duration_cast<Millis>(away)});
  }
  Handle(controller::Tick{});
  RunPending();
  next_tick_ = DeadlineAfter(kTickEvery);
  last_tick_at_ = Clock::now();
  last_tick_cpu_ = ProcessCpuTime();
  if (o_.progress_line && progress_.changed() && Clock::now() >= next_progress_) {
    shown_progress_ = progress_.Text();
    winsize ws{};
    if (::ioctl(STDOUT_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 8 &&
        shown_progress_.size() >= ws.ws_col) {
      shown_progress_.resize(ws.ws_col - 1);  // a wrapped line could not be redrawn in place
    }
    out_->Write("\r\x1b[K" + shown_progress_);
    next_progress_ = DeadlineAfter(Millis(250));  // at most four redraws a second
  }
}

// Heartbeats the other way: a worker or agent that hears nothing for a while
// has lost its controller; one that hears pings waits as long as the job runs.
// A controller that may not lead (its lease is not known to be held) pings
// nobody: silence makes workers and agents look for the leader.
void Runtime::Ping() {
  if (leadership_ == nullptr || leadership_->Valid()) {
    const std::string& ping = server_->ping_payload();
    for (const auto& [id, w] : core_.workers()) {
      if (w.role != WorkerRole::kGone) server_->Send(id, control::kMsgPing, ping);
    }
    for (const auto& host : server_->agents()) server_->SendToAgent(host, control::kMsgPing, ping);
  }
  next_ping_ = DeadlineAfter(Millis(500));
}

void Runtime::Handle(const Event& e) {
  ++handled_;
  std::vector<Action> orders;
  for (Action& a : core_.Handle(e, Clock::now())) {
    if (auto* record = std::get_if<AppendJournal>(&a)) {
      metrics_.Observe(record->record);
      progress_.Observe(record->record);
      journal_->Append(std::move(record->record));
    } else {
      orders.push_back(std::move(a));
    }
  }
  // Every order waits for all of its event's records, those the core listed after it too (a
  // signal sent before its fault_injected record).
  const uint64_t after = leadership_ != nullptr ? leadership_->appended() : 0;
  for (Action& a : orders)
    pending_.push_back({after, journal_->appended(), Clock::now(), std::move(a)});
  // An agent that (re)joins after the plan went out (a takeover, a healed host) still labels right.
  if (const auto* joined = std::get_if<HostJoined>(&e)) {
    SendRanksToAgents(core_.generation(), core_.members(), joined->msg.host_id);
  }
}

// An order the members answer within the core's abort deadline (StopOrdersHeld).
bool IsStopOrder(const Action& a) {
  return std::holds_alternative<SendAbort>(a) || std::holds_alternative<SendDrain>(a);
}

void Runtime::RunPending() {
  // The orders go out after the records that describe them are on disk (a controller started with
  // --resume on this journal after this host crashed must know every order that was sent): the
  // journal's writer syncs them, and its wake_fd brings this loop back here when it has.
  // (A line to print is no order: it waits for no fdatasync.)
  const bool orders = std::any_of(pending_.begin(), pending_.end(), [](const Pending& p) {
    return !std::holds_alternative<PrintLine>(p.action);
  });
  if (orders) {
    journal_->Sync();
  } else {
    journal_->Flush();
  }
  if (leadership_ != nullptr) leadership_->Flush();
  const uint64_t durable = journal_->durable();
  if (durable != seen_durable_) {
    seen_durable_ = durable;
    durable_grew_at_ = Clock::now();
    stall_suspected_at_ = kNoDeadline;
  }
  if (journal_stalled_ && durable >= stalled_upto_) {
    journal_stalled_ = false;
    Print(fmt::format("[nonstop] the journal {} is synced again\n", journal_->path()));
  }
  bool stop_sent = false;  // an abort or drain went out: the core's deadline for answers starts now
  while (!pending_.empty()) {
    const Pending& next = pending_.front();
    if (leadership_ != nullptr && (next.after > leadership_->durable() || !leadership_->Valid()))
      break;
    if (!std::holds_alternative<PrintLine>(next.action) && next.journal_after > durable &&
        !JournalStalled(next.queued_at))
      break;
    Action a = std::move(pending_.front().action);
    pending_.pop_front();
    stop_sent |= IsStopOrder(a);
    Execute(a);
  }
  const bool held = std::any_of(pending_.begin(), pending_.end(),
                                [](const Pending& p) { return IsStopOrder(p.action); });
  if (held != stop_orders_held_ || (stop_sent && !held)) {
    stop_orders_held_ = held;
    events_.push_back(StopOrdersHeld{held});
  }
}

// True once an order has waited kJournalStall for the journal's sync, with the journal not synced
// anything meanwhile, and still so a second later (a process that was stopped, or starved, for
// that long resumes with its writer's sync about to return): from then on orders go out without
// it, until the journal has synced what it held then (said both times).
bool Runtime::JournalStalled(Deadline queued_at) {
  if (journal_stalled_) return true;
  const auto now = Clock::now();
  if (now - std::max(queued_at, durable_grew_at_) < kJournalStall) {
    stall_suspected_at_ = kNoDeadline;
    return false;
  }
  if (stall_suspected_at_ == kNoDeadline) stall_suspected_at_ = now;
  if (now - stall_suspected_at_ < Millis(1'000)) return false;
  journal_stalled_ = true;
  stalled_upto_ = journal_->appended();
  Print(fmt::format(
      "[nonstop] the journal {} has not synced anything for {} s (its disk hangs?): orders go out "
      "without waiting for it, and a controller that takes over from it may not know them\n",
      journal_->path(), kJournalStall.count() / 1000));
  return true;
}

void Runtime::DrainEvents() {
  bool handled = false;
  do {
    while (!events_.empty()) {
      Event e = std::move(events_.front());
      events_.pop_front();
      Handle(e);
      handled = true;
    }
    RunPending();  // may queue events (a spawn that failed)
  } while (!events_.empty());
  // After the orders went out, never before them: torchrun's variables of a spare changed (the
  // world, the hosts), which job.json keeps for `nonstop worker`. A recovery that replaces a rank
  // changes none of them and writes nothing. Only the core's events change them: a turn that
  // handled none compares nothing.
  if (!handled) return;
  if (nlohmann::json now = TorchrunOfASpare(); now != job_file_torchrun_) {
    job_file_torchrun_ = std::move(now);
    WriteJobFile();
  }
}

nlohmann::json Runtime::TorchrunOfASpare() const {
  nlohmann::json t = nlohmann::json::object();
  for (const auto& [name, value] : core_.TorchrunAtSpawn(-1, /*spare=*/true, "")) t[name] = value;
  return t;
}

void Runtime::PublishStatus() {
  if (handled_ == published_ || Clock::now() < next_publish_) return;
  auto t0 = Clock::now();
  nlohmann::json st = core_.Status();
  metrics_.SetStatus(st);
  std::string text = metrics_.Text();
  http_->Publish(std::move(st), std::move(text));
  published_ = handled_;
  auto cost = Clock::now() - t0;
  next_publish_ = cost < Millis(1) ? Clock::now() : Clock::now() + 20 * cost;
}

// This controller stops leading, the job goes on: the record says why in the local journal only
// (etcd's is the next leader's), with the orders held back.
int Runtime::StepDown(nlohmann::json record, const std::string& line, int code) {
  journal_->set_mirror(nullptr);
  record["epoch"] = epoch_;
  // What this controller had decided and not sent (the next leader decides afresh; a line it would
  // have printed is no order), and the bytes of messages it had queued and dropped instead of
  // flushing them.
  size_t orders = 0;
  nlohmann::json dropped = nlohmann::json::array();
  for (const Pending& p : pending_) {
    if (std::holds_alternative<PrintLine>(p.action)) continue;
    ++orders;
    if (dropped.size() < kDroppedOrdersListed) dropped.push_back(DescribeOrder(p.action));
  }
  record["orders_not_sent"] = orders;
  record["dropped_orders"] = std::move(dropped);
  record["dropped_bytes"] = server_ != nullptr ? server_->dropped_bytes() : 0;
  journal_->Append(std::move(record));
  journal_->Flush();
  Print(fmt::format("[nonstop] {}\n", line));
  return code;
}

int Runtime::Finish() {
  // The last orders (the agents' stop) may still wait for their records' sync: send them.
  journal_->Sync();
  Deadline synced_by = DeadlineAfter(Millis(5'000));
  while (journal_->durable() < journal_->appended() && Clock::now() < synced_by) {
    std::this_thread::sleep_for(Millis(1));
  }
  if (journal_->durable() < journal_->appended() && !journal_stalled_) {
    journal_stalled_ = true;
    stalled_upto_ = journal_->appended();
    Print(fmt::format(
        "[nonstop] the journal {} was not synced 5 s after the job ended: its last orders go out "
        "without it\n",
        journal_->path()));
  }
  RunPending();
  if (leadership_ != nullptr) {
    // The end is the job's: etcd must hold it before the lease is given back
    // (a standby that wins then reads it and leaves instead of taking over).
    leadership_->Flush();
    Deadline give_up = DeadlineAfter(Millis(5'000));
    while (leadership_->durable() < leadership_->appended() && Clock::now() < give_up &&
           !leadership_->deposed()) {
      std::this_thread::sleep_for(Millis(10));
    }
    if (leadership_->durable() < leadership_->appended()) {
      out_->Write(
          "[nonstop] the job's end could not be written to etcd: a standby may take over and find "
          "no one\n");
    }
    leadership_->Resign();
  }
  int code = ended_->exit_code;
  if (o_.progress_line) {
    shown_progress_ = progress_.Text() + "\n";  // the last state stays on the screen
    Print("");
    shown_progress_.clear();
  }
  out_->Write(
      fmt::format("[nonstop] job {}: {}\n", code == 0 ? "finished" : "FAILED", ended_->reason));
  out_->Write(fmt::format("[nonstop] journal: {}\n", journal_->path()));
  return code;
}

// ---------------------------------------------------------------- actions

void Runtime::Do(const SendPlan& a) {
  const std::string host = core_.HostOf(a.worker_id);
  if (auto h = core_.hosts().find(host);
      h != core_.hosts().end() && h->second.elastic && !at_normal_priority_.count(a.worker_id)) {
    // Once per worker and controller, whatever this controller knows of its start: one
    // started niced by a controller before a takeover takes its rank at normal priority too.
    if (server_->SendToAgent(host, control::kMsgAgentRenice,
                             control::Encode(control::AgentReniceMsg{a.worker_id, 0}))) {
      at_normal_priority_.insert(a.worker_id);
    }
  }
  if (a.plan != ranks_sent_for_) {
    ranks_sent_for_ = a.plan;
    std::vector<int> members;
    for (const auto& m : a.plan->members) members.push_back(m.worker_id);
    // sent before the plan: lines show the rank
    SendRanksToAgents(a.plan->generation, members, "");
  }
  // Against the plan the worker holds, or against none (docs/plan-wire.md).
  const uint64_t connection = server_->connection_of(a.worker_id);
  const PlanWire::Frame frame = plan_wire_.For(a.worker_id, connection, a.plan);
  plan_wire_.Sent(a.worker_id, connection, server_->Send(a.worker_id, frame.type, *frame.payload));
}

void Runtime::Do(const SendShutdown& a) {
  server_->Send(a.worker_id, control::kMsgShutdown, control::Encode(a.msg));
}

void Runtime::Do(const SendAbort& a) {
  if (a.msg != encoded_abort_) {
    encoded_abort_payload_ = control::Encode(*a.msg);
    encoded_abort_ = a.msg;
  }
  server_->Send(a.worker_id, control::kMsgAbort, encoded_abort_payload_);
}

void Runtime::Do(const SendDrain& a) {
  server_->Send(a.worker_id, control::kMsgDrain, control::Encode(a.msg));
}

void Runtime::Do(const ScaleReply& a) {
  if (auto it = scale_calls_.find(a.request_id); it != scale_calls_.end()) {
    it->second->reply.set_value({a.http_status, a.body});
    scale_calls_.erase(it);
  }
}

void Runtime::Do(const KillWorker& a) {
  Signal(a.worker_id, SIGKILL);
  // A worker may be cut off from its agent (a partition):
  // its control connection is closed, so nothing it sends counts.
  if (!core_.HostOf(a.worker_id).empty())
    server_->CloseWorker(a.worker_id, "killed by the controller");
}

void Runtime::Do(const SpawnWorker& a) {
  if (ended_) return;
  // A refill (started in the background while the job trains) warms up at a low priority, so that
  // it does not slow the job's steps, only on an elastic host (see refill_nice): another host's
  // agent may not be able to raise it back when the spare takes a rank.
  int nice = 0;
  auto h = core_.hosts().find(a.host);
  if (a.background && h != core_.hosts().end() && h->second.elastic && o_.refill_nice > 0) {
    nice = o_.refill_nice;  // back to 0 with its first plan (Do(SendPlan))
  }
  control::AgentStartMsg start{a.worker_id, a.spare, nice,
                               WorkerEnv(a.worker_id, a.spare, a.resume)};
  start.env.insert(start.env.end(), a.torchrun.begin(), a.torchrun.end());
  if (!server_->SendToAgent(a.host, control::kMsgAgentStart, control::Encode(start))) {
    // Fenced (the lease ran out since RunPending looked): not sent, and no fault of the spawn's.
    if (server_->fenced()) return;
    events_.push_back(ProcessExited{a.worker_id, 0, 127, 0, a.host});
  }
}

void Runtime::Do(const CloseHost& a) {
  server_->CloseAgent(a.host_id, a.reason, a.exit_code, /*send_shutdown=*/!a.fence);
}

void Runtime::Do(const AppendJournal& a) {
  metrics_.Observe(a.record);
  progress_.Observe(a.record);
  journal_->Append(a.record);
}

void Runtime::Do(const EndJob& a) {
  if (ended_) {
    // The first end stands, unless a member's script failed after it said success.
    if (ended_->exit_code == 0 && a.exit_code != 0) ended_ = a;
    return;
  }
  ended_ = a;
  // Agents stop their processes and leave; they get a while for it.
  for (const auto& host : server_->agents()) {
    server_->SendToAgent(host, control::kMsgShutdown,
                         control::Encode(control::ShutdownMsg{a.reason, a.exit_code}));
  }
  agents_gone_by_ = DeadlineAfter(Millis(20'000));
}

// ---------------------------------------------------------------- helpers

void Runtime::Print(const std::string& text) {
  if (!o_.progress_line) {
    out_->Write(text);
    return;
  }
  out_->Write("\r\x1b[K" + text + shown_progress_);
}

std::vector<std::pair<std::string, std::string>> Runtime::WorkerEnv(int id, bool spare,
                                                                    bool resume) const {
  namespace s = settings;
  std::vector<std::pair<std::string, std::string>> env = {
      {std::string(s::kWorkerId.env), std::to_string(id)},
      {std::string(s::kSpare.env), spare ? "1" : "0"}};
  if (resume) env.emplace_back(s::kResume.env, "1");
  for (auto& v : JobEnv()) env.push_back(std::move(v));
  return env;
}

std::vector<std::pair<std::string, std::string>> Runtime::JobEnv() const {
  namespace s = settings;
  std::vector<std::pair<std::string, std::string>> env;
  if (!o_.checkpoint_dir.empty()) {
    env.emplace_back(s::kTrainCheckpointDir.env, o_.checkpoint_dir);
    env.emplace_back(s::kTrainCheckpointEvery.env, std::to_string(o_.checkpoint_every));
    env.emplace_back(s::kTrainMtbfSeconds.env, fmt::format("{}", o_.mtbf_seconds));
  }
  // torchrun's variables that name the job (the agent adds the host's own; the spawn its rank):
  // nonstop restarts the workers only from a durable checkpoint, with no cap of torchrun's kind.
  env.emplace_back("ROLE_NAME", "default");
  env.emplace_back("TORCHELASTIC_RUN_ID", "nonstop:" + o_.journal);
  env.emplace_back("TORCHELASTIC_MAX_RESTARTS", "0");
  env.insert(env.end(), o_.worker_env.begin(), o_.worker_env.end());
  return env;
}

void Runtime::Signal(int id, int sig) {
  std::string host = core_.HostOf(id);
  if (host.empty()) return;  // no host (a worker joined by hand): no agent to signal it
  server_->SendToAgent(host, control::kMsgAgentSignal,
                       control::Encode(control::AgentSignalMsg{id, sig}));
}

void Runtime::SendRanksToAgents(uint32_t generation, const std::vector<int>& members,
                                const std::string& only_host) {
  if (core_.hosts().empty() || generation == 0) return;
  std::map<std::string, control::AgentRanksMsg> by_host;
  for (size_t r = 0; r < members.size(); ++r) {
    std::string host = core_.HostOf(members[r]);
    if (!host.empty()) by_host[host].ranks.push_back({members[r], static_cast<int>(r)});
  }
  for (const auto& [id, h] : core_.hosts()) {
    if (!h.alive || (!only_host.empty() && id != only_host)) continue;
    control::AgentRanksMsg& m = by_host[id];  // none of its workers is a member: an empty list
    m.generation = generation;
    server_->SendToAgent(id, control::kMsgAgentRanks, control::Encode(m));
  }
}

}  // namespace

namespace {
// A file of the job's beside its journal.
std::string BesideJournal(const std::string& journal_path, const char* name) {
  auto slash = journal_path.rfind('/');
  return (slash == std::string::npos ? std::string(".") : journal_path.substr(0, slash)) + "/" +
         name;
}
}  // namespace

std::string JobFileFor(const std::string& journal_path) {
  return BesideJournal(journal_path, "job.json");
}

std::string TokenFileFor(const std::string& journal_path) {
  return BesideJournal(journal_path, "job.token");
}

std::string HttpTokenFileFor(const std::string& journal_path) {
  return BesideJournal(journal_path, "job.http-token");
}

int RunController(const RuntimeOptions& options) {
  if (Status s = ValidateOptions(options.core); !s.ok()) {
    fmt::print(stderr, "{}: {}\n", options.name, s.message());
    return kExitUsage;
  }
  return Runtime(options).Run();
}

}  // namespace nonstop::controller
