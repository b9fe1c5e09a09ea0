#include "coord/leadership.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <map>
#include <optional>
#include <random>
#include <utility>

#include <fmt/format.h>

#include "common/logging.h"
#include "common/role_keys.h"
#include "coord/leader_watch.h"
#include "coord/retry.h"
#include "coord/sealed_value.h"

namespace nonstop::coord {

namespace {

int64_t NowMicros() { return static_cast<int64_t>(MonotonicSeconds() * 1e6); }

constexpr size_t kMaxOpsPerTxn = 100;  // etcd's default limit is 128
// its default request limit is 1.5 MiB; base64 adds a third
constexpr size_t kMaxBytesPerTxn = 768 << 10;
// A record or snapshot over this is split into parts of this size: each part goes alone in a
// transaction well under etcd's request limit.
constexpr size_t kPartBytes = 512 << 10;
// Keys per page of the journal's read: each request stays bounded however long the journal
// (the compacted journal is a few hundred keys: one page or two). Not much smaller: etcd counts
// the rest of the range for every page, so a journal of n keys costs n²/page.
constexpr int64_t kReadPage = 512;

std::string SeqKey(const std::string& prefix, uint64_t seq) {
  return fmt::format("{}journal/{:016d}", prefix, seq);
}
std::string PartKey(const std::string& base, size_t part) {
  return fmt::format("{}/{:04d}", base, part);
}
std::string SnapshotBase(const std::string& prefix, uint64_t upto, int64_t epoch) {
  return fmt::format("{}snapshot/{:016d}.{:016d}", prefix, upto, epoch);
}
size_t PartsOf(const std::string& text) {
  return std::max<size_t>(1, (text.size() + kPartBytes - 1) / kPartBytes);
}

bool StartsWith(const std::string& s, const std::string& prefix) {
  return s.compare(0, prefix.size(), prefix) == 0;
}

// A standby's poll plus up to half of it at random: standbys do not ask in lockstep.
Millis Jittered(Millis poll) {
  thread_local std::mt19937_64 generator{std::random_device{}()};
  return poll + Millis(std::uniform_int_distribution<int64_t>(
                    0, std::max<int64_t>(0, poll.count() / 2))(generator));
}

}  // namespace

Status CheckJobName(const std::string& job) {
  bool ok = !job.empty() && job.size() <= 64 && job != "." && job != "..";
  for (char c : job)
    ok = ok && (std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-');
  if (!ok) {
    return InvalidArgumentError(
        fmt::format("job name '{}' is not 1-64 of [A-Za-z0-9._-] (HINT: --job run42, or "
                    "the Slurm job id)",
                    job));
  }
  return OkStatus();
}

std::string JobPrefix(const std::string& job) { return "/nonstop/" + job + "/"; }
std::string LeaderKey(const std::string& job) { return JobPrefix(job) + "leader"; }

Result<std::string> LookUpLeader(etcd::Client& client, const std::string& job, int* exit_code,
                                 const std::string* controller_public) {
  // The two keys, read as the agents' leader watch reads them (one interpretation of both).
  LeaderKeys keys;
  keys.job = job;
  NONSTOP_ASSIGN_OR_RETURN(auto kvs, client.Range(LeaderKey(job)));
  if (!kvs.empty()) {
    keys.leader = kvs[0].value;
    keys.leader_epoch = kvs[0].create_revision;
  } else {
    NONSTOP_ASSIGN_OR_RETURN(auto end, client.Range(JobPrefix(job) + "end"));
    if (!end.empty()) keys.end = end[0].value;
  }
  return InterpretLeaderKeys(keys, exit_code, controller_public);
}

LeadershipOptions WithDerivedTimes(LeadershipOptions o) {
  const Millis ttl(int64_t{std::max(o.ttl_seconds, 1)} * 1000);
  if (o.renew_every <= Millis(0)) o.renew_every = ttl / 5;
  if (o.request_timeout <= Millis(0))
    o.request_timeout = std::clamp<Millis>(ttl / 4, Millis(250), Millis(5'000));
  if (o.journal_timeout <= Millis(0)) o.journal_timeout = std::max<Millis>(Millis(2'000), ttl / 2);
  if (o.retry_max <= Millis(0))
    o.retry_max = std::clamp<Millis>(ttl / 10, Millis(100), Millis(2'000));
  return o;
}

Result<std::unique_ptr<Leadership>> Leadership::Connect(LeadershipOptions options) {
  if (options.ttl_seconds < 1)
    return InvalidArgumentError("the leader's lease TTL must be at least 1 s");
  NONSTOP_RETURN_IF_ERROR(CheckJobName(options.job));
  auto l = std::unique_ptr<Leadership>(new Leadership(WithDerivedTimes(std::move(options))));
  l->wake_.Reset(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!l->wake_.valid()) return ErrnoStatus(StatusCode::kInternal, "eventfd", errno);
  l->prefix_ = JobPrefix(l->options_.job);
  l->leader_key_ = LeaderKey(l->options_.job);
  l->own_ = std::make_unique<OwnRecords>(l->prefix_, etcd::PrefixEnd(l->prefix_), l->leader_key_);
  NONSTOP_ASSIGN_OR_RETURN(
      l->client_, etcd::Client::Create(l->options_.endpoints,
                                       {l->options_.request_timeout, l->options_.security}));
  return l;
}

Leadership::~Leadership() {
  keepalive_.request_stop();
  writer_.request_stop();
  { MutexLock lock(&mu_); }  // a waiter between its check and its sleep sees the stop
  cv_.NotifyAll();
  if (keepalive_.joinable()) keepalive_.join();
  if (writer_.joinable()) writer_.join();
  // The lease back, deposed or not (this process acts on it no more): a lease etcd still holds
  // (renewed by a request whose answer was lost) frees the leader key now, not a TTL later.
  if (lease_ != 0 && !revoked_) RevokeQuietly(lease_);
  if (unclaimed_lease_ != 0) RevokeQuietly(unclaimed_lease_);
}

void Leadership::RevokeQuietly(int64_t lease) {
  // NotFound (etcd let it go) or etcd unreachable (it runs out on its own): nothing to do either
  // way.
  (void)client_->LeaseRevoke(lease);
}

Status Leadership::Explain(const Status& s, const std::string& key) const {
  std::string hint;
  switch (s.code()) {
    case StatusCode::kFailedPrecondition:  // etcd::ErrorClass::kPermissionDenied
      hint = fmt::format(
          "give nonstop an etcd user (--etcd-auth-file FILE holding user:password) whose role may "
          "read and write {}* and grant leases, or a client certificate (--etcd-cert, --etcd-key) "
          "whose common name is such a user",
          prefix_);
      break;
    case StatusCode::kInvalidArgument:  // etcd::ErrorClass::kInvalid
      hint =
          "is every --etcd endpoint an etcd 3.4 or later client URL (its /v3 gateway, e.g. "
          "Debian's etcd-server)? "
          "etcd also refuses a request over its --max-request-bytes (1.5 MiB) or --max-txn-ops "
          "(128): raise them "
          "on every member";
      break;
    case StatusCode::kDataLoss:  // an answer that is not etcd's
      hint = "is every --etcd endpoint an etcd client URL (not a peer URL, nor another service)?";
      break;
    default:
      break;
  }
  std::string text = fmt::format("etcd key {}: {}", key, s.message());
  // (a TLS or auth-file error carries its own, which names the file)
  if (!hint.empty() && s.message().find("HINT:") == std::string::npos)
    text += " (HINT: " + hint + ")";
  return Status(s.code(), std::move(text));
}

Status Leadership::LostWhile(const std::string& doing, const Status& last) const {
  return UnavailableError(
      fmt::format("{}: this controller lost the lead meanwhile ({}); etcd's last error: {}", doing,
                  why_not_leading(), last.message()));
}

Result<int64_t> Leadership::Campaign(const std::function<bool()>& stop,
                                     const std::function<void(const std::string&)>& on_wait) {
  bool stopped = false;  // stop() may read a signal once: remember it
  std::function<bool()> should_stop = [&] { return stopped || (stopped = stop()); };
  std::string seen;
  etcd::Backoff backoff(Millis(100), options_.retry_max);
  etcd::OutageLog outage(
      fmt::format("campaign for job '{}' in etcd {}", options_.job, options_.endpoints),
      "standing by: retried with back-off, this controller campaigns as soon as etcd answers");
  while (!should_stop()) {
    auto led = CampaignOnce(&seen, on_wait);
    if (!led.ok()) {
      if (!etcd::IsTransient(led.status())) return Explain(led.status(), leader_key_);
      outage.Failed(led.status());
      etcd::SleepUnless(backoff.Next(), should_stop);
      continue;
    }
    outage.Succeeded();
    backoff.Reset();
    if (*led) return epoch_;
    etcd::SleepUnless(Jittered(options_.poll), should_stop);
  }
  return CancelledError("stopped while waiting to lead");
}

Result<bool> Leadership::CampaignOnce(std::string* seen,
                                      const std::function<void(const std::string&)>& on_wait) {
  if (options_.previous_lease != 0) {
    // This process's previous term: it may still hold the leader key (etcd was away when that term
    // ended). Given back first, so that the election need not wait it out.
    Status s = client_->LeaseRevoke(options_.previous_lease);
    // revoked, or gone already (NotFound)
    if (s.ok() || !etcd::IsTransient(s)) options_.previous_lease = 0;
  }
  NONSTOP_ASSIGN_OR_RETURN(auto current, client_->Range(leader_key_));
  if (!current.empty()) {
    const etcd::KeyValue& kv = current[0];
    if (unclaimed_lease_ != 0 && kv.lease == unclaimed_lease_) {
      int64_t lease = std::exchange(unclaimed_lease_, 0);
      if (NowMicros() < unclaimed_valid_until_us_) {
        // Our transaction landed though its answer was lost: this process leads.
        BecomeLeader(lease, kv.create_revision, unclaimed_valid_until_us_);
        return true;
      }
      RevokeQuietly(lease);  // ours, but found too late to lead on: free the key, campaign again
      return false;
    }
    if (kv.value != *seen) {
      *seen = kv.value;
      seen_epoch_ = kv.create_revision;
      on_wait(*seen);
    }
    return false;
  }
  if (unclaimed_lease_ != 0) {
    // The key is free, so that transaction did not land (and cannot once its lease is gone).
    RevokeQuietly(unclaimed_lease_);
    unclaimed_lease_ = 0;
  }
  // Nobody leads: try to be the one, on a lease of our own. Its clock
  // starts when etcd grants it: measured from before the request.
  int64_t sent_us = NowMicros();
  NONSTOP_ASSIGN_OR_RETURN(auto lease, client_->LeaseGrant(options_.ttl_seconds));
  const int64_t valid_until_us = sent_us + lease.second * 800'000;
  nlohmann::json me = {{"pid", static_cast<int64_t>(::getpid())}};
  auto txn = client_->Txn({etcd::Compare::CreateRevision(leader_key_, 0)},
                          {etcd::Op::Put(leader_key_, me.dump(), lease.first)},
                          {etcd::Op::Get(leader_key_)});
  if (!txn.ok()) {
    if (etcd::IsTransient(txn.status())) {
      unclaimed_lease_ = lease.first;  // the next look at the key says whether it landed
      unclaimed_valid_until_us_ = valid_until_us;
    } else {
      RevokeQuietly(lease.first);
    }
    return txn.status();
  }
  if (!txn->succeeded) {  // another controller was quicker
    RevokeQuietly(lease.first);
    return false;
  }
  // the revision is the key's create revision
  BecomeLeader(lease.first, txn->revision, valid_until_us);
  return true;
}

void Leadership::BecomeLeader(int64_t lease, int64_t epoch, int64_t valid_until_us) {
  lease_ = lease;
  epoch_ = epoch;
  valid_until_us_ = valid_until_us;
  keepalive_ = std::jthread([this](std::stop_token st) { KeepAlive(st); });
}

Result<JournalRead> Leadership::ReadJournal(const crypto::Key& job_key) {
  // A client of its own: the journal may be large, so its requests may take longer than a
  // renewal's.
  NONSTOP_ASSIGN_OR_RETURN(
      auto reader,
      etcd::Client::Create(options_.endpoints, {options_.journal_timeout, options_.security}));
  etcd::Backoff backoff(Millis(100), options_.retry_max);
  etcd::OutageLog outage(
      fmt::format("reading the journal of job '{}' from etcd {}", options_.job, options_.endpoints),
      "the takeover waits (training goes on), retried while this controller holds its lease");
  const std::function<bool()> lost = [this] { return deposed(); };
  // The job's every key, in pages, at one revision: the snapshot pointer, its parts, the tail and
  // the progress record as one consistent view.
  auto kvs = etcd::RetryTransient(
      [&] { return reader->RangeAll(prefix_, etcd::PrefixEnd(prefix_), kReadPage); }, backoff,
      outage, lost);
  if (!kvs.ok()) {
    return etcd::IsTransient(kvs.status()) ? LostWhile("reading the journal", kvs.status())
                                           : Explain(kvs.status(), prefix_ + "*");
  }
  sealing_key_ = SealingKey(job_key, options_.job);
  {
    MutexLock lock(&mu_);
    job_key_ = job_key;
    has_job_key_ = true;
  }
  JournalRead out;
  VerifyJournal(*kvs, &out);
  own_->Seed(*kvs);
  for (const JournalForgery& f : out.forgeries)
    NONSTOP_LOG_WARNING("etcd: not believed, a gap in the journal: {}", f.why);
  appended_ = first_seq_ - 1;
  durable_ = first_seq_ - 1;
  writer_ = std::jthread([this](std::stop_token st) { Write(st); });
  return out;
}

namespace {

// A snapshot found in etcd: its parts, each verified, under snapshot/<upto>.<epoch>/.
struct SnapshotParts {
  uint64_t upto = 0;
  int64_t epoch = 0;
  std::map<size_t, std::string> parts;  // verified
  uint64_t count = 0;                   // the parts' counter: how many there are
  bool bad = false;                     // a part did not verify, or the counts disagree
  bool complete() const { return !bad && count > 0 && parts.size() == count; }
  std::string Text() const {
    std::string text;
    for (const auto& [i, part] : parts) text += part;
    return text;
  }
};

}  // namespace

void Leadership::VerifyJournal(const std::vector<etcd::KeyValue>& kvs, JournalRead* out) {
  const std::string journal_prefix = prefix_ + "journal/";
  const std::string snapshot_prefix = prefix_ + "snapshot/";
  auto refuse = [&](const std::string& key, std::string why) {
    out->forgeries.push_back({key, std::move(why)});
  };
  // The value under kv.key, verified, of an epoch no later than this leader's; else a forgery.
  auto unseal = [&](const etcd::KeyValue& kv) -> std::optional<SealedValue> {
    Result<SealedValue> v = Unseal(sealing_key_, options_.job, kv.key, kv.value);
    if (!v.ok()) {
      refuse(kv.key, v.status().message());
      return std::nullopt;
    }
    if (v->epoch >= epoch_) {
      refuse(kv.key, fmt::format("etcd key {}: sealed by epoch {}, not before this leader's {}",
                                 kv.key, v->epoch, epoch_));
      return std::nullopt;
    }
    return std::move(*v);
  };
  const etcd::KeyValue* pointer = nullptr;
  const etcd::KeyValue* progress = nullptr;
  const etcd::KeyValue* plan = nullptr;
  std::vector<const etcd::KeyValue*> journal;
  std::map<std::string, SnapshotParts> snapshots;  // by base
  for (const auto& kv : kvs) {
    if (kv.key == leader_key_ || kv.key == prefix_ + "end") continue;
    ++out->keys;
    if (kv.key == prefix_ + "snapshot") pointer = &kv;
    if (kv.key == prefix_ + "progress") progress = &kv;
    if (kv.key == prefix_ + "plan") plan = &kv;
    if (StartsWith(kv.key, journal_prefix)) journal.push_back(&kv);
    if (!StartsWith(kv.key, snapshot_prefix)) continue;
    // snapshot/<upto>.<epoch>/<part>
    const size_t slash = kv.key.rfind('/');
    const std::string base = kv.key.substr(0, slash);
    SnapshotParts& sp = snapshots[base];
    auto v = unseal(kv);
    size_t part = 0;
    if (!v ||
        std::sscanf(base.c_str() + snapshot_prefix.size(), "%" SCNu64 ".%" SCNd64, &sp.upto,
                    &sp.epoch) != 2 ||
        std::sscanf(kv.key.c_str() + slash + 1, "%zu", &part) != 1 ||
        (sp.count != 0 && sp.count != v->counter) || v->epoch != sp.epoch) {
      if (v) refuse(kv.key, fmt::format("etcd key {}: not a part of snapshot {}", kv.key, base));
      sp.bad = true;
      continue;
    }
    sp.count = v->counter;
    sp.parts[part] = std::move(v->value);
  }
  // The snapshot: the pointer's, when it verifies and so do all its parts; else the newest whole
  // one (a pointer forged or put back, or a compaction whose switch never landed).
  const SnapshotParts* snapshot = nullptr;
  if (pointer != nullptr) {
    auto v = unseal(*pointer);
    auto p = v ? nlohmann::json::parse(v->value, nullptr, false) : nlohmann::json();
    if (v && (!p.is_object() || !p.contains("upto") || !p["upto"].is_number_unsigned() ||
              !p.contains("epoch") || !p["epoch"].is_number_integer() ||
              p["upto"].get<uint64_t>() != v->counter)) {
      refuse(pointer->key, fmt::format("etcd key {} is not a snapshot pointer", pointer->key));
    } else if (v) {
      auto it = snapshots.find(
          SnapshotBase(prefix_, p["upto"].get<uint64_t>(), p["epoch"].get<int64_t>()));
      if (it != snapshots.end() && it->second.complete()) {
        snapshot = &it->second;
      } else {
        refuse(pointer->key, fmt::format("etcd key {} names a snapshot whose parts are missing or "
                                         "do not verify",
                                         pointer->key));
      }
    }
  }
  if (snapshot == nullptr) {
    for (const auto& [base, sp] : snapshots) {
      if (sp.complete() && (snapshot == nullptr || sp.upto > snapshot->upto)) snapshot = &sp;
    }
  }
  uint64_t last = 0;
  int64_t epoch = 0;         // the epoch of the last record believed: later ones are of it or later
  uint64_t chain_start = 0;  // the seq its leader began at (its counter)
  if (snapshot != nullptr) {
    snapshot_ = snapshot->Text();
    auto j = nlohmann::json::parse(snapshot_, nullptr, false);
    if (j.is_object()) {
      out->records.push_back(std::move(j));
      last = snapshot->upto;
      epoch = snapshot->epoch;
    } else {
      refuse(SnapshotBase(prefix_, snapshot->upto, snapshot->epoch) + "/*",
             "a sealed snapshot that is not a JSON record");
      snapshot_.clear();
    }
  }
  snapshot_upto_ = last;
  // A compacted journal whose snapshot cannot be believed: nothing after it can be either. (Parts
  // of a snapshot no pointer names are a compaction that never switched: left out.)
  bool cut = snapshot == nullptr && pointer != nullptr;
  for (size_t i = 0; i < journal.size() && !cut;) {
    const std::string key = SeqKey(prefix_, last + 1);
    if (journal[i]->key < key) {  // covered by the snapshot (its switch never landed)
      ++i;
      continue;
    }
    if (StartsWith(journal[i]->key, key + "/")) {
      // Parts of a record whose header never landed (its leader was deposed while it wrote them):
      // nothing after them landed either. A record after them is a header deleted: a gap.
      orphans_ = true;
      auto after = std::find_if(journal.begin() + static_cast<std::ptrdiff_t>(i), journal.end(),
                                [&](const auto* kv) { return !StartsWith(kv->key, key + "/"); });
      if (after != journal.end()) {
        refuse(key, fmt::format("etcd key {} is missing, with parts of it and {} after them", key,
                                (*after)->key));
        cut = true;
      }
      break;
    }
    // Records last+1, last+2, … with nothing missing: anything else is a gap.
    if (journal[i]->key != key) {
      refuse(journal[i]->key, fmt::format("etcd key {} where the journal's record {} was expected",
                                          journal[i]->key, last + 1));
      cut = true;
      break;
    }
    auto v = unseal(*journal[i]);
    ++i;
    // A record's counter is the seq of its leader's first record: the same as the record
    // before it within one leader's run, its own seq where a leader begins (at most it, after a
    // snapshot that covers the beginning). So an earlier leader's records put back over its
    // successor's (each genuine) end where the successor's resume.
    const uint64_t seq = last + 1;
    std::string chain;
    const bool first_after_snapshot = tail_.empty() && snapshot != nullptr;
    if (v && v->epoch < epoch) {
      chain = fmt::format("a record of epoch {} after one of epoch {}", v->epoch, epoch);
    } else if (v && first_after_snapshot) {
      if (v->counter > seq) chain = fmt::format("a leader that began at record {}", v->counter);
    } else if (v && v->epoch == epoch && v->counter != chain_start) {
      chain = fmt::format(
          "a record of the leader that began at record {}, after one of the "
          "leader that began at record {}",
          v->counter, chain_start);
    } else if (v && v->epoch != epoch && v->counter != seq) {
      chain = fmt::format("the first record of epoch {}, of a leader that began at record {}",
                          v->epoch, v->counter);
    }
    if (!v || !chain.empty()) {
      if (v) refuse(key, fmt::format("etcd key {}: {} (an old record put back)", key, chain));
      cut = true;
      break;
    }
    chain_start = v->counter;
    std::string line = std::move(v->value);
    auto j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_object() && j.contains("split") && !j.contains("event")) {
      const auto& h = j["split"];
      const size_t parts =
          h.contains("parts") && h["parts"].is_number_unsigned() ? h["parts"].get<size_t>() : 0;
      line.clear();
      for (size_t part = 0; part < parts; ++part, ++i) {
        std::optional<SealedValue> p;
        if (i < journal.size() && journal[i]->key == PartKey(key, part)) p = unseal(*journal[i]);
        if (!p || p->counter != parts || p->epoch != v->epoch) {
          refuse(PartKey(key, part), fmt::format("etcd key {}: part {} of {} is missing or out "
                                                 "of place",
                                                 PartKey(key, part), part, parts));
          line.clear();
          break;
        }
        line += p->value;
      }
      j = nlohmann::json::parse(line, nullptr, false);
    }
    if (!j.is_object()) {
      refuse(key, fmt::format("etcd key {} is not a JSON journal record", key));
      cut = true;
      break;
    }
    ++last;
    epoch = v->epoch;
    tail_bytes_ += line.size();
    tail_.push_back(std::move(line));
    out->records.push_back(std::move(j));
  }
  nlohmann::json progress_record;  // the progress read, after the plan's copy in the records
  if (progress != nullptr) {
    auto v = unseal(*progress);
    auto j = v ? nlohmann::json::parse(v->value, nullptr, false) : nlohmann::json();
    if (v && v->counter < last) {
      refuse(progress->key, fmt::format("etcd key {}: written after record {}, older than the "
                                        "journal's record {} (an old value put back)",
                                        progress->key, v->counter, last));
    } else if (v && !j.is_object()) {
      refuse(progress->key, fmt::format("etcd key {} is not a JSON record", progress->key));
    } else if (v) {
      // Written after a record the journal does not hold: its tail was deleted or cut.
      if (v->counter > last) cut = true;
      progress_current_ = std::move(v->value);
      progress_record = std::move(j);
    }
  }
  if (cut) {
    out->cut = true;
    orphans_ = true;  // the first write deletes what lies after the prefix
    // The latest plan's copy, if it lies beyond the cut: the members' generation and ranks (of use
    // after a prefix that holds the job's start).
    if (plan != nullptr && !out->records.empty()) {
      auto v = unseal(*plan);
      auto j = v ? nlohmann::json::parse(v->value, nullptr, false) : nlohmann::json();
      if (v && v->counter > last && j.is_object() && j.value("event", "") == "plan")
        out->records.push_back(std::move(j));
    }
  }
  if (!progress_record.is_null()) out->records.push_back(std::move(progress_record));
  first_seq_ = last + 1;
  PlanCleanup(
      *out,
      snapshot != nullptr ? SnapshotBase(prefix_, snapshot->upto, snapshot->epoch) : std::string(),
      pointer != nullptr && snapshot != nullptr &&
          std::any_of(out->forgeries.begin(), out->forgeries.end(),
                      [&](const JournalForgery& f) { return f.key == pointer->key; }),
      snapshot != nullptr ? snapshot->count : 0);
}

void Leadership::PlanCleanup(const JournalRead& read, const std::string& base, bool put_pointer,
                             uint64_t parts) {
  // What this leader's first write deletes (never before it: Write): the records after a gap or
  // orphaned parts, and every value refused outside the journal (a forged pointer or progress,
  // snapshots other than the one read), so that the next takeover does not meet them again.
  const std::string journal = prefix_ + "journal/", snapshots = prefix_ + "snapshot/";
  if (orphans_)
    cleanup_.push_back(etcd::Op::Delete(SeqKey(prefix_, first_seq_), etcd::PrefixEnd(journal)));
  if (read.forgeries.empty()) return;
  for (const JournalForgery& f : read.forgeries) {
    if (StartsWith(f.key, journal) || StartsWith(f.key, snapshots) || cleanup_.size() >= 64)
      continue;
    if (f.key != prefix_ + "snapshot" || base.empty()) cleanup_.push_back(etcd::Op::Delete(f.key));
  }
  if (base.empty()) {
    cleanup_.push_back(etcd::Op::Delete(snapshots, etcd::PrefixEnd(snapshots)));
    return;
  }
  cleanup_.push_back(etcd::Op::Delete(snapshots, base));
  cleanup_.push_back(etcd::Op::Delete(etcd::PrefixEnd(base + "/"), etcd::PrefixEnd(snapshots)));
  if (put_pointer) {
    // The snapshot read without its pointer: the pointer again, naming it.
    const nlohmann::json pointer = {{"upto", snapshot_upto_},
                                    {"epoch", std::stoll(base.substr(base.rfind('.') + 1))},
                                    {"parts", parts},
                                    {"bytes", snapshot_.size()}};
    cleanup_.push_back(etcd::Op::Put(prefix_ + "snapshot",
                                     Sealed(prefix_ + "snapshot", snapshot_upto_, pointer.dump())));
  }
}

Status Leadership::Publish(const nlohmann::json& value, const crypto::Key& job_key) {
  nlohmann::json v = value;
  v["pid"] = static_cast<int64_t>(::getpid());
  // The epoch is the key's create revision: readers check both, so an old genuine value written
  // again into a later key is refused (docs/leader-discovery.md, "A forged leader key").
  v["epoch"] = epoch_;
  const std::string signed_value = SignLeaderValue(job_key, options_.job, v);
  etcd::Backoff backoff(Millis(100), options_.retry_max);
  etcd::OutageLog outage(
      fmt::format("publishing this controller's address in etcd {}", options_.endpoints),
      "workers and agents wait for it (training goes on), retried while this controller holds "
      "its lease");
  const std::function<bool()> lost = [this] { return deposed(); };
  // The same put again after an answer that was lost: it lands once or twice, alike.
  auto txn = etcd::RetryTransient(
      [&] {
        return client_->Txn({etcd::Compare::CreateRevision(leader_key_, epoch_)},
                            {etcd::Op::Put(leader_key_, signed_value, lease_)});
      },
      backoff, outage, lost);
  if (!txn.ok()) {
    return etcd::IsTransient(txn.status()) ? LostWhile("publishing the address", txn.status())
                                           : Explain(txn.status(), leader_key_);
  }
  if (!txn->succeeded) {
    SetDeposed(fmt::format("the leader key {} is no longer this controller's (epoch {})",
                           leader_key_, epoch_));
    return FailedPreconditionError(why_not_leading());
  }
  MutexLock lock(&mu_);
  published_ = signed_value;
  job_key_ = job_key;
  has_job_key_ = true;
  return OkStatus();
}

std::vector<LeaderKeyForgery> Leadership::TakeLeaderKeyForgeries() {
  MutexLock lock(&mu_);
  return std::exchange(forgeries_, {});
}

void Leadership::CheckOwnRecords(etcd::Client& client, int64_t sent_us) {
  // Within half the renewal interval of the renewal, so that the next one is not late.
  if (deposed() || NowMicros() - sent_us > options_.renew_every.count() * 500) return;
  auto found = own_->Check(client, etcd::Compare::CreateRevision(leader_key_, epoch_));
  if (found.empty() || deposed()) return;  // a fence that failed: the successor's keys
  MutexLock lock(&mu_);
  for (auto& f : found) record_forgeries_.push_back(std::move(f));
  Wake();
}

std::vector<RecordForgery> Leadership::TakeRecordForgeries() {
  MutexLock lock(&mu_);
  return std::exchange(record_forgeries_, {});
}

void Leadership::CheckLeaderKey(etcd::Client& client) {
  std::string published;
  crypto::Key key;
  {
    MutexLock lock(&mu_);
    published = published_;
    key = job_key_;
  }
  if (published.empty()) return;  // not published yet: the value is {"pid"}
  auto kvs = client.Range(leader_key_);
  // Unanswered: the next renewal looks again. Gone, or re-created: the fenced writes find out.
  if (!kvs.ok() || kvs->empty() || (*kvs)[0].create_revision != epoch_) return;
  const etcd::KeyValue& kv = (*kvs)[0];
  if (kv.value == published) return;
  LeaderKeyForgery f;
  f.value = kv.value.substr(0, 256);
  f.mod_revision = kv.mod_revision;
  Status why = VerifyLeaderValue(ControllerPublicKey(key), options_.job, kv.value, epoch_);
  f.why = why.ok() ? "a value of this epoch this leader did not write last" : why.message();
  // Back on this leader's lease, while the key is still this epoch's (a Put without a lease, as
  // an `etcdctl put` is, also took the key off the lease).
  auto txn = client.Txn({etcd::Compare::CreateRevision(leader_key_, epoch_),
                         etcd::Compare::ModRevision(leader_key_, kv.mod_revision)},
                        {etcd::Op::Put(leader_key_, published, lease_)});
  f.restored = txn.ok() && txn->succeeded;
  NONSTOP_LOG_WARNING(
      "the leader key {} was overwritten (revision {}) with a value this leader did not write: {}; "
      "{}",
      leader_key_, kv.mod_revision, f.why,
      f.restored ? "its own value is back" : "putting its own value back failed for now");
  {
    MutexLock lock(&mu_);
    forgeries_.push_back(std::move(f));
  }
  Wake();
}

void Leadership::Append(const nlohmann::json& record) {
  std::string line = record.dump();
  if (record.value("event", "") == "step") {
    queued_progress_ = std::move(line);  // only the latest step matters to a takeover
    return;
  }
  if (record.value("event", "") == "job_end") queued_end_ = line;
  queued_.emplace_back(++appended_, std::move(line));
  if (record.value("event", "") == "plan") queued_plan_ = appended_;
}

void Leadership::Flush() {
  if (queued_.empty() && queued_progress_.empty()) return;
  {
    MutexLock lock(&mu_);
    for (auto& e : queued_) pending_.push_back(std::move(e));
    if (!queued_progress_.empty()) progress_ = std::move(queued_progress_);
    if (queued_plan_ != 0) plan_seq_ = std::exchange(queued_plan_, 0);
    // Signed once the leader holds the job key (Publish): readers believe no other.
    if (!queued_end_.empty()) {
      end_ =
          has_job_key_ ? SignEndValue(job_key_, options_.job, queued_end_) : std::move(queued_end_);
    }
  }
  queued_end_.clear();
  queued_.clear();
  queued_progress_.clear();
  cv_.NotifyAll();
}

bool Leadership::deposed() const {
  if (deposed_.load()) return true;
  int64_t until = valid_until_us_.load();
  if (until == 0 || NowMicros() < until) return false;  // 0: not leading yet
  // The renew deadline passed: a lapse is a deposition, for every reader alike, and for good (a
  // renewal answered later does not undo it: agents and workers may have left this silent leader).
  deposed_.store(true);
  Wake();
  return true;
}

// 0: not (or no longer) leading
bool Leadership::Valid() const { return valid_until_us_.load() != 0 && !deposed(); }

std::string Leadership::why_not_leading() const {
  {
    MutexLock lock(&mu_);
    if (!why_.empty()) return why_;
  }
  return LapseReason();
}

std::string Leadership::LapseReason() const {
  return fmt::format(
      "no renewal of the lease of epoch {} was answered within 80% of its {} s TTL (etcd "
      "unreachable, "
      "slow or overloaded, or this process was paused): it stands down",
      epoch_, options_.ttl_seconds);
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

void Leadership::SetFinal(const Status& s) {
  NONSTOP_LOG_ERROR("etcd refuses this leader for good: {}", s.ToString());
  {
    MutexLock lock(&mu_);
    if (final_.ok()) final_ = s;
  }
  SetDeposed("etcd refused this leader: " + s.message());
}

Status Leadership::final_error() const {
  MutexLock lock(&mu_);
  return final_;
}

void Leadership::Wake() const {
  uint64_t one = 1;
  (void)!::write(wake_.get(), &one, sizeof(one));
}

void Leadership::Resign() {
  keepalive_.request_stop();
  { MutexLock lock(&mu_); }
  cv_.NotifyAll();
  if (keepalive_.joinable()) keepalive_.join();
  // deposed too: a lease etcd still holds frees the key now
  if (lease_ != 0) RevokeQuietly(lease_);
  revoked_ = true;
  SetDeposed("resigned");
}

void Leadership::KeepAlive(std::stop_token st) {
  auto client =
      etcd::Client::Create(options_.endpoints, {options_.request_timeout, options_.security});
  if (!client.ok()) return SetFinal(client.status());
  etcd::Backoff backoff(Millis(100), options_.retry_max);
  etcd::OutageLog outage(
      fmt::format("renewing the lease of epoch {} in etcd {}", epoch_, options_.endpoints),
      "training goes on, retried with back-off; this controller stands down if no renewal is "
      "answered within 80% of the TTL");
  while (!st.stop_requested() && !deposed()) {
    int64_t sent_us = NowMicros();
    auto ttl = (*client)->LeaseKeepAlive(lease_);
    Millis wait = options_.renew_every;
    if (ttl.ok()) {
      int64_t until = valid_until_us_.load();
      // Extended only while it holds: a renewal answered after the deadline is too late to lead on.
      if (deposed() || !valid_until_us_.compare_exchange_strong(until, sent_us + *ttl * 800'000))
        break;
      outage.Succeeded();
      backoff.Reset();
      CheckLeaderKey(**client);
      CheckOwnRecords(**client, sent_us);
      // The next renewal goes out renew_every after this one was sent, whatever the checks took.
      wait = std::max(Millis(0),
                      options_.renew_every - std::chrono::duration_cast<Millis>(
                                                 std::chrono::microseconds(NowMicros() - sent_us)));
    } else if (ttl.status().code() == StatusCode::kNotFound) {
      return SetDeposed(fmt::format(
          "the lease of epoch {} expired in etcd: another controller may lead", epoch_));
    } else if (!etcd::IsTransient(ttl.status())) {
      return SetFinal(
          Explain(ttl.status(), leader_key_ + fmt::format(" (its lease {:x})", lease_)));
    } else {
      outage.Failed(ttl.status());
      wait = backoff.Next();
    }
    MutexLock lock(&mu_);
    cv_.WaitFor(&mu_, wait, [&] { return st.stop_requested() || deposed_.load(); });
  }
  if (deposed() && !st.stop_requested()) SetDeposed(LapseReason());
}

bool Leadership::WriteFenced(etcd::Client& client, const std::vector<etcd::Op>& ops,
                             const std::string& what, etcd::Backoff& backoff,
                             etcd::OutageLog& outage, const std::stop_token& st) {
  while (true) {
    // Nothing more goes out once the leadership is lost (a lapse of the lease included).
    if (st.stop_requested() || deposed()) return false;
    // The same operations again after an answer that was lost: they land once or twice, alike.
    own_->BeginWrite();  // may wait for a check of OwnRecords: the leadership may be lost since
    if (st.stop_requested() || deposed()) {
      own_->EndWrite(ops, 0);
      return false;
    }
    auto txn = client.Txn({etcd::Compare::CreateRevision(leader_key_, epoch_)}, ops);
    own_->EndWrite(ops, txn.ok() && txn->succeeded ? txn->revision : 0);
    if (!txn.ok() && !etcd::IsTransient(txn.status())) {
      // etcd answered and refused (a record too large, a permission): retrying cannot help, and
      // a leader whose orders wait forever would hang the job. Step down, loudly, for good.
      SetFinal(Explain(txn.status(), what));
      return false;
    }
    if (!txn.ok()) {
      outage.Failed(txn.status());
      MutexLock lock(&mu_);
      cv_.WaitFor(&mu_, backoff.Next(), [&] { return st.stop_requested() || deposed_.load(); });
      continue;
    }
    if (!txn->succeeded) {
      SetDeposed(fmt::format(
          "etcd refused a journal write of epoch {}: the leader key {} is no longer this "
          "controller's (another controller leads)",
          epoch_, leader_key_));
      return false;
    }
    outage.Succeeded();
    backoff.Reset();
    return true;
  }
}

std::string Leadership::Sealed(const std::string& key, uint64_t counter,
                               const std::string& value) const {
  return Seal(sealing_key_, options_.job, key, epoch_, counter, value);
}

bool Leadership::WriteParts(etcd::Client& client, const std::string& base, const std::string& text,
                            etcd::Backoff& backoff, etcd::OutageLog& outage,
                            const std::stop_token& st) {
  std::vector<etcd::Op> ops;
  size_t bytes = 0;
  const size_t n = PartsOf(text);
  for (size_t part = 0; part < n; ++part) {
    std::string piece = text.substr(part * kPartBytes, kPartBytes);
    if (!ops.empty() && bytes + piece.size() > kMaxBytesPerTxn) {
      if (!WriteFenced(client, ops, base + "/*", backoff, outage, st)) return false;
      ops.clear();
      bytes = 0;
    }
    bytes += piece.size();
    // Each part sealed with the number of parts: a reader knows when it has them all.
    ops.push_back(etcd::Op::Put(PartKey(base, part), Sealed(PartKey(base, part), n, piece)));
  }
  return WriteFenced(client, ops, base + "/*", backoff, outage, st);
}

bool Leadership::MaybeCompact(etcd::Client& client, etcd::Backoff& backoff, etcd::OutageLog& outage,
                              const std::stop_token& st) {
  if (!options_.compact || tail_.size() < compact_retry_at_ ||
      (tail_.size() < options_.compact_records && tail_bytes_ < options_.compact_bytes)) {
    return true;
  }
  // A large snapshot (a job's store of megabytes) is written again only once the tail has grown
  // to half its size: etcd writes at most three times what the journal grew by.
  if (tail_bytes_ * 2 < snapshot_.size()) return true;
  std::vector<nlohmann::json> records;
  records.reserve(tail_.size() + 1);
  if (!snapshot_.empty()) records.push_back(nlohmann::json::parse(snapshot_, nullptr, false));
  for (const auto& line : tail_) records.push_back(nlohmann::json::parse(line, nullptr, false));
  auto snapshot = options_.compact(records);
  if (!snapshot.ok()) {
    // The tail stays (a job that ended keeps its job_end record as a record); tried again later.
    if (!std::exchange(compact_failure_said_, true)) {
      NONSTOP_LOG_INFO("the journal of job '{}' in etcd is not compacted for now: {}", options_.job,
                       snapshot.status().ToString());
    }
    compact_retry_at_ = tail_.size() + options_.compact_records;
    return true;
  }
  std::string text = snapshot->dump();
  const uint64_t upto = snapshot_upto_ + tail_.size();
  const std::string base = SnapshotBase(prefix_, upto, epoch_);
  if (!WriteParts(client, base, text, backoff, outage, st)) return false;
  // The switch: the pointer to the new snapshot, and what it replaces gone, in one transaction.
  nlohmann::json pointer = {
      {"upto", upto}, {"epoch", epoch_}, {"parts", PartsOf(text)}, {"bytes", text.size()}};
  const std::string snapshots = prefix_ + "snapshot/";
  std::vector<etcd::Op> ops = {
      etcd::Op::Put(prefix_ + "snapshot", Sealed(prefix_ + "snapshot", upto, pointer.dump())),
      etcd::Op::Delete(prefix_ + "journal/", SeqKey(prefix_, upto + 1)),
      etcd::Op::Delete(snapshots, base),
      etcd::Op::Delete(etcd::PrefixEnd(base + "/"), etcd::PrefixEnd(snapshots))};
  if (!WriteFenced(client, ops, prefix_ + "snapshot", backoff, outage, st)) return false;
  snapshot_ = std::move(text);
  snapshot_upto_ = upto;
  tail_.clear();
  tail_bytes_ = 0;
  compact_retry_at_ = 0;
  return true;
}

void Leadership::Write(std::stop_token st) {
  auto client =
      etcd::Client::Create(options_.endpoints, {options_.journal_timeout, options_.security});
  if (!client.ok()) return SetFinal(client.status());
  etcd::Backoff backoff(Millis(100), options_.retry_max);
  etcd::OutageLog outage(
      fmt::format("writing the journal of epoch {} to etcd {}", epoch_, options_.endpoints),
      "orders wait until it is written (training goes on), retried with back-off");
  const std::string journal_keys = prefix_ + "journal/*";
  bool cleaned = false;
  while (!st.stop_requested() && !deposed()) {
    std::vector<etcd::Op> ops;
    std::vector<std::string> lines;  // the records of this batch, for the tail
    uint64_t last = 0;
    size_t bytes = 0;
    std::pair<uint64_t, std::string> split;  // a record too large for one key: its parts first
    {
      MutexLock lock(&mu_);
      cv_.Wait(&mu_, [&]() NONSTOP_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return st.stop_requested() || deposed_.load() || !pending_.empty() || !progress_.empty() ||
               !end_.empty();
      });
      if (st.stop_requested() || deposed_.load()) return;
      for (const auto& [seq, line] : pending_) {
        if (line.size() > kPartBytes) {
          if (ops.empty()) split = {seq, line};
          break;  // after the records before it
        }
        // Three slots stay free: the plan's copy, progress and end.
        if (ops.size() + 3 >= kMaxOpsPerTxn ||
            (bytes > 0 && bytes + 2 * line.size() > kMaxBytesPerTxn))
          break;
        ops.push_back(
            etcd::Op::Put(SeqKey(prefix_, seq), Sealed(SeqKey(prefix_, seq), first_seq_, line)));
        // The latest plan again under P plan, with its sequence number: a takeover whose journal
        // was cut before it (a forged record) still learns the members' generation.
        if (seq == plan_seq_) {
          ops.push_back(etcd::Op::Put(prefix_ + "plan", Sealed(prefix_ + "plan", seq, line)));
        }
        lines.push_back(line);
        bytes += line.size();
        last = seq;
      }
      if (!split.second.empty()) {
        nlohmann::json header = {
            {"split", {{"parts", PartsOf(split.second)}, {"bytes", split.second.size()}}}};
        ops.push_back(
            etcd::Op::Put(SeqKey(prefix_, split.first),
                          Sealed(SeqKey(prefix_, split.first), first_seq_, header.dump())));
        last = split.first;
      }
      // The progress, sealed with the journal's last record once this batch lands: put again with
      // every batch, so that a reader can refuse one older than the journal (an old value put
      // back).
      if (!progress_.empty()) progress_current_ = progress_;
      if (!progress_current_.empty() && ops.size() < kMaxOpsPerTxn) {
        const uint64_t after = last > 0 ? last : durable_.load();
        ops.push_back(etcd::Op::Put(prefix_ + "progress",
                                    Sealed(prefix_ + "progress", after, progress_current_)));
      }
      // The end key goes with the batch that holds the job_end record (or a later one).
      if (!end_.empty() && ops.size() < kMaxOpsPerTxn &&
          (pending_.empty() || last == pending_.back().first)) {
        ops.push_back(etcd::Op::Put(prefix_ + "end", end_));
      }
    }
    // Before this leader's first write, not before: a controller that gives up after reading (a
    // missing token, nothing to take over) leaves etcd as it found it.
    if (!std::exchange(cleaned, true) && !cleanup_.empty() &&
        !WriteFenced(**client, cleanup_, journal_keys, backoff, outage, st)) {
      return;
    }
    // A split record's parts land before its header (in the batch): a reader never sees half.
    if (!split.second.empty() &&
        !WriteParts(**client, SeqKey(prefix_, split.first), split.second, backoff, outage, st)) {
      return;
    }
    if (!WriteFenced(**client, ops, journal_keys, backoff, outage, st)) return;
    if (!split.second.empty()) lines.push_back(std::move(split.second));
    {
      MutexLock lock(&mu_);
      while (!pending_.empty() && pending_.front().first <= last) pending_.pop_front();
      // The progress written is dropped unless a newer one came meanwhile.
      for (const auto& op : ops) {
        if (op.key == prefix_ + "progress" && progress_current_ == progress_) progress_.clear();
        if (op.key == prefix_ + "end") end_.clear();
      }
    }
    if (last > 0) {
      durable_ = last;
      Wake();
    }
    for (auto& line : lines) {
      tail_bytes_ += line.size();
      tail_.push_back(std::move(line));
    }
    if (!MaybeCompact(**client, backoff, outage, st)) return;
  }
}

}  // namespace nonstop::coord
