#include "coord/leadership.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>

#include <fmt/format.h>

#include "common/logging.h"

namespace nonstop::coord {

namespace {

int64_t NowMicros() { return static_cast<int64_t>(MonotonicSeconds() * 1e6); }

constexpr size_t kMaxOpsPerTxn = 100;        // etcd's default limit is 128
constexpr size_t kMaxBytesPerTxn = 768 << 10;  // its default request limit is 1.5 MiB; base64 adds a third

std::string SeqKey(const std::string& prefix, uint64_t seq) { return fmt::format("{}journal/{:016d}", prefix, seq); }

}  // namespace

Status CheckJobName(const std::string& job) {
  bool ok = !job.empty() && job.size() <= 64 && job != "." && job != "..";
  for (char c : job) ok = ok && (std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-');
  if (!ok) {
    return InvalidArgumentError(fmt::format("job name '{}' is not 1-64 of [A-Za-z0-9._-] (HINT: --job run42, or "
                                            "the Slurm job id)",
                                            job));
  }
  return OkStatus();
}

std::string JobPrefix(const std::string& job) { return "/nonstop/" + job + "/"; }
std::string LeaderKey(const std::string& job) { return JobPrefix(job) + "leader"; }

Result<std::string> LookUpLeader(etcd::Client& client, const std::string& job, int* exit_code) {
  NONSTOP_ASSIGN_OR_RETURN(auto kvs, client.Range(LeaderKey(job)));
  if (kvs.empty()) {
    NONSTOP_ASSIGN_OR_RETURN(auto end, client.Range(JobPrefix(job) + "end"));
    if (!end.empty()) {
      auto r = nlohmann::json::parse(end[0].value, nullptr, false);
      int code = r.is_object() && r.contains("exit_code") && r["exit_code"].is_number_integer()
                     ? r["exit_code"].get<int>()
                     : 1;
      if (exit_code != nullptr) *exit_code = code;
      return AbortedError(fmt::format("job '{}' ended (exit code {}): {}", job, code,
                                      r.is_object() ? r.value("reason", "") : std::string()));
    }
    return NotFoundError(fmt::format("no controller leads job '{}' now", job));
  }
  auto v = nlohmann::json::parse(kvs[0].value, nullptr, false);
  if (!v.is_object() || !v.contains("controller") || !v["controller"].is_string()) {
    return NotFoundError(fmt::format("the leader of job '{}' has not published its address yet", job));
  }
  return v["controller"].get<std::string>();
}

Result<std::unique_ptr<Leadership>> Leadership::Connect(LeadershipOptions options) {
  if (options.ttl_seconds < 1) return InvalidArgumentError("the leader's lease TTL must be at least 1 s");
  NONSTOP_RETURN_IF_ERROR(CheckJobName(options.job));
  auto l = std::unique_ptr<Leadership>(new Leadership(std::move(options)));
  l->wake_.Reset(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!l->wake_.valid()) return ErrnoStatus(StatusCode::kInternal, "eventfd", errno);
  l->prefix_ = JobPrefix(l->options_.job);
  l->leader_key_ = LeaderKey(l->options_.job);
  NONSTOP_ASSIGN_OR_RETURN(l->client_, etcd::Client::Create(l->options_.endpoints));
  auto probe = l->client_->Range(l->leader_key_);
  if (!probe.ok()) {
    return probe.status().WithContext(fmt::format("etcd at {} does not answer (is etcd running there? HINT: "
                                                  "etcd --listen-client-urls http://HOST:2379 ...)",
                                                  l->options_.endpoints));
  }
  return l;
}

Leadership::~Leadership() {
  keepalive_.request_stop();
  writer_.request_stop();
  { MutexLock lock(&mu_); }  // a waiter between its check and its sleep sees the stop
  cv_.NotifyAll();
  if (keepalive_.joinable()) keepalive_.join();
  if (writer_.joinable()) writer_.join();
  if (lease_ != 0 && !deposed_.load()) (void)client_->LeaseRevoke(lease_);
}

Result<int64_t> Leadership::Campaign(const std::function<bool()>& stop,
                                     const std::function<void(const std::string&)>& on_wait) {
  std::string seen;
  Deadline warn_at = kNoDeadline;
  while (!stop()) {
    auto current = client_->Range(leader_key_);
    if (!current.ok()) {
      if (warn_at == kNoDeadline || Clock::now() >= warn_at) {
        NONSTOP_LOG_WARNING("waiting to lead: {}", current.status().ToString());
        warn_at = DeadlineAfter(Millis(5'000));
      }
      std::this_thread::sleep_for(options_.poll);
      continue;
    }
    warn_at = kNoDeadline;
    if (!current->empty()) {
      if ((*current)[0].value != seen) {
        seen = (*current)[0].value;
        on_wait(seen);
      }
      std::this_thread::sleep_for(options_.poll);
      continue;
    }
    // Nobody leads: try to be the one, on a lease of our own. Its clock
    // starts when etcd grants it: measured from before the request.
    int64_t sent_us = NowMicros();
    auto lease = client_->LeaseGrant(options_.ttl_seconds);
    if (!lease.ok()) {
      std::this_thread::sleep_for(options_.poll);
      continue;
    }
    nlohmann::json me = {{"pid", static_cast<int64_t>(::getpid())}};
    auto txn = client_->Txn({etcd::Compare::CreateRevision(leader_key_, 0)},
                            {etcd::Op::Put(leader_key_, me.dump(), lease->first)}, {etcd::Op::Get(leader_key_)});
    if (!txn.ok() || !txn->succeeded) {
      (void)client_->LeaseRevoke(lease->first);
      std::this_thread::sleep_for(options_.poll);
      continue;
    }
    lease_ = lease->first;
    epoch_ = txn->revision;  // the leader key's create revision
    valid_until_us_ = sent_us + lease->second * 800'000;
    keepalive_ = std::jthread([this](std::stop_token st) { KeepAlive(st); });
    return epoch_;
  }
  return CancelledError("stopped while waiting to lead");
}

Result<std::vector<nlohmann::json>> Leadership::ReadJournal() {
  std::vector<nlohmann::json> out;
  NONSTOP_ASSIGN_OR_RETURN(auto kvs, client_->Prefix(prefix_ + "journal/"));
  uint64_t last = 0;
  for (const auto& kv : kvs) {
    // Records 1, 2, 3, … with nothing missing: anything else is not this job's journal as it was written.
    if (kv.key != SeqKey(prefix_, last + 1)) {
      return DataLossError(fmt::format("etcd key {} where the journal's record {} was expected ({}): not a journal "
                                       "this controller can take over",
                                       kv.key, last + 1, SeqKey(prefix_, last + 1)));
    }
    ++last;
    auto j = nlohmann::json::parse(kv.value, nullptr, false);
    if (!j.is_object()) return DataLossError(fmt::format("etcd key {} is not a JSON journal record", kv.key));
    out.push_back(std::move(j));
  }
  NONSTOP_ASSIGN_OR_RETURN(auto progress, client_->Range(prefix_ + "progress"));
  if (!progress.empty()) {
    auto j = nlohmann::json::parse(progress[0].value, nullptr, false);
    if (!j.is_object()) return DataLossError(fmt::format("etcd key {}progress is not a JSON record", prefix_));
    out.push_back(std::move(j));
  }
  first_seq_ = last + 1;
  appended_ = last;
  durable_ = last;
  writer_ = std::jthread([this](std::stop_token st) { Write(st); });
  return out;
}

Status Leadership::Publish(const nlohmann::json& value) {
  nlohmann::json v = value;
  v["pid"] = static_cast<int64_t>(::getpid());
  v["epoch"] = epoch_;
  NONSTOP_ASSIGN_OR_RETURN(auto txn, client_->Txn({etcd::Compare::CreateRevision(leader_key_, epoch_)},
                                                  {etcd::Op::Put(leader_key_, v.dump(), lease_)}));
  if (!txn.succeeded) {
    SetDeposed(fmt::format("the leader key {} is no longer this controller's (epoch {})", leader_key_, epoch_));
    return FailedPreconditionError(why_not_leading());
  }
  return OkStatus();
}

void Leadership::Append(const nlohmann::json& record) {
  std::string line = record.dump();
  if (record.value("event", "") == "step") {
    queued_progress_ = std::move(line);  // only the latest step matters to a takeover
    return;
  }
  if (record.value("event", "") == "job_end") queued_end_ = line;
  queued_.emplace_back(++appended_, std::move(line));
}

void Leadership::Flush() {
  if (queued_.empty() && queued_progress_.empty()) return;
  {
    MutexLock lock(&mu_);
    for (auto& e : queued_) pending_.push_back(std::move(e));
    if (!queued_progress_.empty()) progress_ = std::move(queued_progress_);
    if (!queued_end_.empty()) end_ = std::move(queued_end_);
  }
  queued_end_.clear();
  queued_.clear();
  queued_progress_.clear();
  cv_.NotifyAll();
}

bool Leadership::Valid() const { return !deposed_.load() && NowMicros() < valid_until_us_.load(); }

std::string Leadership::why_not_leading() const {
  MutexLock lock(&mu_);
  if (!why_.empty()) return why_;
  int64_t late_ms = (NowMicros() - valid_until_us_.load()) / 1000;
  return fmt::format("the lease of epoch {} could not be renewed in time ({} ms overdue: etcd unreachable, or this "
                     "process was paused)",
                     epoch_, std::max<int64_t>(0, late_ms));
}

void Leadership::SetDeposed(std::string why) {
  {
    MutexLock lock(&mu_);  // under mu_: the writer's wait cannot miss it
    if (why_.empty()) why_ = std::move(why);
    valid_until_us_ = 0;
    deposed_ = true;
  }
  cv_.NotifyAll();
  Wake();
}

void Leadership::Wake() {
  uint64_t one = 1;
  (void)!::write(wake_.get(), &one, sizeof(one));
}

void Leadership::Resign() {
  keepalive_.request_stop();
  { MutexLock lock(&mu_); }
  cv_.NotifyAll();
  if (keepalive_.joinable()) keepalive_.join();
  if (lease_ != 0 && !deposed_.load()) (void)client_->LeaseRevoke(lease_);
  SetDeposed("resigned");
}

void Leadership::KeepAlive(std::stop_token st) {
  auto client = etcd::Client::Create(options_.endpoints, {Millis(std::max(200, options_.ttl_seconds * 250))});
  if (!client.ok()) return SetDeposed(client.status().ToString());
  const Millis every(options_.ttl_seconds * 1000 / 4);
  bool warned = false;
  while (!st.stop_requested() && !deposed_.load()) {
    int64_t sent_us = NowMicros();
    auto ttl = (*client)->LeaseKeepAlive(lease_);
    if (ttl.ok()) {
      valid_until_us_ = sent_us + *ttl * 800'000;
      if (warned) NONSTOP_LOG_WARNING("etcd answers again: the lease of epoch {} is renewed", epoch_);
      warned = false;
    } else if (ttl.status().code() == StatusCode::kNotFound) {
      return SetDeposed(fmt::format("the lease of epoch {} expired in etcd: another controller may lead", epoch_));
    } else if (NowMicros() > valid_until_us_.load() + options_.ttl_seconds * 1'000'000) {
      // Past the lease by a whole TTL: etcd has let it go, whoever leads now.
      return SetDeposed(fmt::format("cut off from etcd past the lease of epoch {}: {}", epoch_,
                                    ttl.status().ToString()));
    } else if (!warned) {
      NONSTOP_LOG_WARNING("cannot renew the leader's lease: {}; training goes on, orders stop when it runs out",
                          ttl.status().ToString());
      warned = true;
    }
    auto wait = ttl.ok() ? every : Millis(100);
    MutexLock lock(&mu_);
    cv_.WaitFor(&mu_, wait, [&] { return st.stop_requested() || deposed_.load(); });
  }
}

void Leadership::Write(std::stop_token st) {
  auto client = etcd::Client::Create(options_.endpoints);
  if (!client.ok()) return SetDeposed(client.status().ToString());
  bool warned = false;
  while (!st.stop_requested() && !deposed_.load()) {
    std::vector<etcd::Op> ops;
    uint64_t last = 0;
    size_t bytes = 0;
    {
      MutexLock lock(&mu_);
      cv_.Wait(&mu_, [&]() NONSTOP_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return st.stop_requested() || deposed_.load() || !pending_.empty() || !progress_.empty() || !end_.empty();
      });
      if (st.stop_requested() || deposed_.load()) return;
      for (const auto& [seq, line] : pending_) {
        // Two slots stay free: progress and end.
        if (ops.size() + 2 >= kMaxOpsPerTxn || (bytes > 0 && bytes + line.size() > kMaxBytesPerTxn)) break;
        ops.push_back(etcd::Op::Put(SeqKey(prefix_, seq), line));
        bytes += line.size();
        last = seq;
      }
      if (!progress_.empty() && ops.size() < kMaxOpsPerTxn) ops.push_back(etcd::Op::Put(prefix_ + "progress", progress_));
      // The end key goes with the batch that holds the job_end record (or a later one).
      if (!end_.empty() && ops.size() < kMaxOpsPerTxn && (pending_.empty() || last == pending_.back().first)) {
        ops.push_back(etcd::Op::Put(prefix_ + "end", end_));
      }
    }
    auto txn = (*client)->Txn({etcd::Compare::CreateRevision(leader_key_, epoch_)}, ops);
    if (!txn.ok() && txn.status().code() != StatusCode::kUnavailable) {
      // etcd answered and refused (no space left, a record too large): retrying cannot help, and
      // a leader whose orders wait forever would hang the job. Step down, loudly.
      NONSTOP_LOG_ERROR("etcd refused the journal: {}", txn.status().ToString());
      return SetDeposed("etcd refused the journal: " + txn.status().message());
    }
    if (!txn.ok()) {
      if (!warned) {
        NONSTOP_LOG_WARNING("cannot write the journal to etcd: {}; orders wait until it is written",
                            txn.status().ToString());
        warned = true;
      }
      MutexLock lock(&mu_);
      cv_.WaitFor(&mu_, Millis(100), [&] { return st.stop_requested() || deposed_.load(); });
      continue;
    }
    if (!txn->succeeded) {
      return SetDeposed(fmt::format("etcd refused a journal write of epoch {}: the leader key {} is no longer this "
                                    "controller's (another controller leads)",
                                    epoch_, leader_key_));
    }
    if (warned) NONSTOP_LOG_WARNING("the journal reaches etcd again");
    warned = false;
    {
      MutexLock lock(&mu_);
      while (!pending_.empty() && pending_.front().first <= last) pending_.pop_front();
      // The progress written is dropped unless a newer one came meanwhile.
      for (const auto& op : ops) {
        if (op.key == prefix_ + "progress" && op.value == progress_) progress_.clear();
        if (op.key == prefix_ + "end") end_.clear();
      }
    }
    if (last > 0) {
      durable_ = last;
      Wake();
    }
  }
}

}  // namespace nonstop::coord
