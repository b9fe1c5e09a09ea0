// Leadership of a job through etcd (docs/controller-failover.md): the
// election of one controller among standbys, the lease that keeps it
// leading, and the job's journal replicated to etcd so that the next leader
// resumes exactly where this one stopped.
//
// Keys, under the job's prefix P ("/nonstop/<job>/"):
//   P leader              {"controller": "host:port", "http", "pid", "epoch", "mac"}: on the
//                         leader's lease. Its create revision is the leader's epoch: it only
//                         grows. "mac" authenticates the value with the job key (SignLeaderValue,
//                         leader_watch.h); until Publish the value is {"pid"} alone.
//   P journal/<seq>       one journal record (JSON), seq from 1, zero-padded to 16 digits;
//                         a record over 512 KiB is split: P journal/<seq> holds
//                         {"split": {"parts": n, "bytes": b}}, P journal/<seq>/<part> its
//                         parts (written first, in transactions of their own).
//   P snapshot            {"upto": n, "epoch": e, "parts": k, "bytes": b}: records 1..n were
//                         compacted into one snapshot record (LeadershipOptions::compact), kept
//                         in P snapshot/<n>.<e>/<part> (0000, 0001, …); the tail, records n+1..,
//                         is under P journal/. The pointer is switched, and the records and
//                         snapshots it replaces are deleted, in one transaction written after
//                         every part: a reader sees one whole snapshot or the previous one.
//   P progress            the latest "step" record: steps are the journal's bulk, and
//                         a takeover needs only the last one.
//   P end                 the job_end record, once the job ended: agents and workers that
//                         look for a leader after the last one resigned learn it here.
//   P plan                the latest plan record again, written with it (one under 512 KiB):
//                         a takeover whose journal was cut before it still learns the plan.
//
// Every value but the leader and end keys (which carry their own MACs) is sealed with the job key
// (sealed_value.h: bound to the job, the key, the writer's epoch and a counter); a reader takes the
// journal up to the first value that does not verify (docs/security.md, "What nonstop keeps in
// etcd"). `progress` is written again with every batch, sealed with the journal's last record.
//
// A bounded journal (docs/controller-failover.md, "A bounded journal in etcd"): once the tail
// holds compact_records records or compact_bytes bytes, the writer folds the snapshot and the
// tail into a new snapshot and deletes what it covers, so that what a takeover reads stays
// small however long the job runs. The journal is read in pages (etcd::Client::RangeAll), all at
// one revision.
//
// Fencing. Every write of the journal is a transaction that first compares
// the leader key's create revision with this leader's epoch: once the lease
// is gone (another controller may lead) nothing this process writes lands.
// Valid() tells the controller whether it may still issue orders: the lease
// was renewed less than 80% of its TTL ago, measured from when the renewal
// was sent, so a process paused (SIGSTOP, a swap storm) past its lease knows
// it on waking, before it sends anything. That 80% is the renew deadline (as
// Kubernetes' leader election has one): once it passes, the leadership is
// lost for good (deposed()), even if etcd still holds the lease, because a
// leader that may not order stops pinging, and agents and workers leave it.
//
// etcd trouble (docs/controller-failover.md). No call to etcd ends the
// process on a transient failure (etcd::IsTransient: unreachable, paused,
// overloaded, timed out): each is retried with back-off and full jitter
// (etcd::Backoff), and each outage is logged once (etcd::OutageLog). A
// standby stays a standby through any outage. A leader deposes itself when
// etcd says the lease is gone or at the renew deadline, and campaigns again
// (`nonstop controller --etcd`). ReadJournal and Publish retry until they
// succeed or the leadership is lost (then deposed() is true). Final failures
// (etcd::ErrorClass kPermissionDenied, kInvalid) are returned, or, from the
// threads, depose the leader with final_error() set: the message names the
// key and the fix.
//
// Timing (docs/controller-failover.md, "Timing"): the lease is renewed every
// TTL/5, each renewal waits at most TTL/4 for its answer, a failed one is
// retried after a back-off capped at TTL/10. So an etcd outage or overload
// of up to 0.6 TTL (the renew deadline, 0.8 TTL, less one renewal period)
// costs nothing but orders held back; a longer one costs a takeover.
//
// Threads: Campaign runs on the caller's; then one thread renews the lease
// and one writes the journal (each with its own etcd client). Append, Flush
// and the accessors may be called from the controller's loop at any time.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/crypto.h"
#include "common/mutex.h"
#include "common/time.h"
#include "common/unique_fd.h"
#include "coord/etcd.h"
#include "coord/own_records.h"
#include "coord/retry.h"
#include "nonstop/settings.h"
#include "nonstop/status.h"

namespace nonstop::coord {

struct LeadershipOptions {
  std::string endpoints;    // etcd: host:port[,host:port…]
  etcd::Security security;  // TLS, the etcd user (--etcd-cacert, …; etcd_security.h)
  std::string job = "default";
  // The leader's lease: a dead leader is replaced within about this plus 1 s (--lease-ttl-s).
  int ttl_seconds = settings::kLeaseTtlS.default_value;
  // how often a standby looks at the leader key (plus up to half of it at random)
  Millis poll{100};
  // Zero: derived from the TTL (docs/controller-failover.md, "Timing").
  Millis renew_every{0};      // a renewal of the lease after each success: TTL/5
  Millis request_timeout{0};  // one campaign or renewal request: TTL/4, within [250 ms, 5 s]
  Millis journal_timeout{0};  // one read or write of the journal, the publish: max(2 s, TTL/2)
  // the back-off's cap after a transient failure: TTL/10, within [100 ms, 2 s]
  Millis retry_max{0};
  // A lease of this process's previous term that etcd may still hold (it could not be given back
  // while etcd was away): revoked at the campaign's first contact, so the election need not wait
  // it out. `nonstop controller --etcd` passes it when it stands by again.
  int64_t previous_lease = 0;
  // The journal's compaction: given etcd's journal in order (a snapshot record first, if there is
  // one, then the records after it; not the progress record), one record that stands for all of
  // them (a takeover that reads it, then later records, learns what it would from them all). An
  // error leaves the tail as it is (tried again once it grew by compact_records). Unset: etcd keeps
  // every record. The controller's is controller::CompactJournal (coord does not know records).
  std::function<Result<nlohmann::json>(const std::vector<nlohmann::json>&)> compact;
  size_t compact_records = 512;      // compacted once the tail holds this many records,
  size_t compact_bytes = 256 << 10;  // or this many bytes, and half the snapshot's size
};

// The options with every zero derived from the TTL.
LeadershipOptions WithDerivedTimes(LeadershipOptions o);

// A job's name in etcd: 1-64 of [A-Za-z0-9._-] (so one job's keys are never inside another's).
Status CheckJobName(const std::string& job);
std::string JobPrefix(const std::string& job);  // "/nonstop/<job>/"
std::string LeaderKey(const std::string& job);  // "/nonstop/<job>/leader"

// Who leads `job` now, as its leader key says: the control address, or
// NotFound (nobody leads, or the leader has not published an address yet),
// or Aborted when the job ended (the message says how; *exit_code, if given,
// is the job's exit code). With controller_public (ControllerPublicKey), a value that does not
// verify is NotFound (InterpretLeaderKeys): not followed.
Result<std::string> LookUpLeader(etcd::Client& client, const std::string& job,
                                 int* exit_code = nullptr,
                                 const std::string* controller_public = nullptr);

// The leader key found overwritten under a leader by a value it did not write (and cannot
// verify): what the controller's journal records (a "leader_key_forged" record).
struct LeaderKeyForgery {
  std::string value;  // what the key held (its first 256 bytes)
  int64_t mod_revision = 0;
  std::string why;        // why it does not verify
  bool restored = false;  // this leader's value was put back
};

// A value in the job's keys that ReadJournal could not believe (sealed_value.h): its key, and why.
struct JournalForgery {
  std::string key;
  std::string why;
};

struct JournalRead {
  // The verified prefix: the snapshot record (if any), the tail after it, the progress record last.
  std::vector<nlohmann::json> records;
  std::vector<JournalForgery> forgeries;
  size_t keys = 0;   // the job's keys besides the leader and end keys: 0 for a job not begun
  bool cut = false;  // the records stop at a gap: the members may be ahead of them
};

class Leadership {
 public:
  // Checks the options and makes the etcd client: no request yet (an etcd
  // that does not answer is the campaign's to wait for). Errors are final:
  // malformed endpoints, a bad job name, a TTL under 1 s.
  static Result<std::unique_ptr<Leadership>> Connect(LeadershipOptions options);
  ~Leadership();  // stops its threads and gives the lease back (a clean exit hands over at once)
  Leadership(const Leadership&) = delete;
  Leadership& operator=(const Leadership&) = delete;

  // Waits until this process leads the job, through any etcd outage (logged
  // once per outage). on_wait(leader) is called when another controller
  // leads (its key's value) and each time that changes. Returns the epoch;
  // Cancelled once stop() said so; a final error (it names the key and the
  // fix).
  Result<int64_t> Campaign(const std::function<bool()>& stop,
                           const std::function<void(const std::string&)>& on_wait);

  // The journal in etcd, in order: what the takeover replays (the progress
  // record last, if any). Read after Campaign won; retried through
  // transient failures while this process leads. An error is final, or
  // (deposed() true) the leadership was lost meanwhile. Every value is
  // unsealed with `job_key` (sealed_value.h): the records are the verified
  // prefix, up to the first value that does not verify or is out of place
  // (each such a forgery: a gap), and this leader seals what it writes with
  // the same key. A leader whose journal was cut deletes the records after
  // the prefix with its first write.
  Result<JournalRead> ReadJournal(const crypto::Key& job_key);

  // The leader key's value once this controller listens (its address), with
  // the epoch and the controllers' signature (SignLeaderValue, from job_key); retried like
  // ReadJournal. deposed() is true after an error that lost the leadership.
  // From then on the keep-alive thread reads the key after each renewal: a
  // value this leader did not write is put back (while the lease holds) and
  // reported (TakeLeaderKeyForgeries, then wake_fd()).
  Status Publish(const nlohmann::json& value, const crypto::Key& job_key);
  // The overwrites of the leader key found since the last call (the loop journals them).
  std::vector<LeaderKeyForgery> TakeLeaderKeyForgeries() NONSTOP_LOCKS_EXCLUDED(mu_);
  // After each renewal too, once ReadJournal read them: the job's other keys changed, deleted or
  // added behind this leader's back are undone (OwnRecords) and reported here (then wake_fd()).
  std::vector<RecordForgery> TakeRecordForgeries() NONSTOP_LOCKS_EXCLUDED(mu_);
  // The create revision of the leader key whose value Campaign last passed to on_wait (a
  // standby's check of it: VerifyLeaderValue).
  int64_t seen_epoch() const { return seen_epoch_; }

  // Queues one record (already stamped); Flush hands the queue to the writer.
  void Append(const nlohmann::json& record);
  void Flush();
  uint64_t appended() const { return appended_; }       // records queued so far (seq of the last)
  uint64_t durable() const { return durable_.load(); }  // records etcd holds so far

  // Readable (an eventfd) when durable() grew or the leadership was lost: the loop's cue to go on.
  int wake_fd() const { return wake_.get(); }
  // may this process issue orders now? It leads and is not deposed()
  bool Valid() const;
  // Deposed: etcd says another leads or the lease is gone, this process resigned, or no renewal
  // was answered within 80% of the TTL (the renew deadline: a lapse). For good, once true.
  bool deposed() const;
  // Why etcd refused this leader for good (a final error from the keep-alive
  // or the writer, which deposed it): OK if it did not. A controller stands by
  // again after a deposition, but not after this: it would be refused again.
  Status final_error() const;
  std::string why_not_leading() const;  // why Valid() is false (for the journal and the log)
  int64_t epoch() const { return epoch_; }
  int64_t lease() const { return lease_; }  // 0 before Campaign won
  const std::string& endpoints() const { return options_.endpoints; }

  // Gives the lease back now (the job ended, or this process steps down).
  void Resign();

 private:
  explicit Leadership(LeadershipOptions o) : options_(std::move(o)) {}
  // One look at the leader key, and a try to take it if it is free: true if this process leads now.
  Result<bool> CampaignOnce(std::string* seen,
                            const std::function<void(const std::string&)>& on_wait);
  void BecomeLeader(int64_t lease, int64_t epoch, int64_t valid_until_us);
  void KeepAlive(std::stop_token st);
  void Write(std::stop_token st);
  // One fenced transaction of the writer, retried through transient failures: false if it did not
  // land and the writer stops (stopped, deposed, or refused for good: then deposed too).
  bool WriteFenced(etcd::Client& client, const std::vector<etcd::Op>& ops, const std::string& what,
                   etcd::Backoff& backoff, etcd::OutageLog& outage, const std::stop_token& st);
  // `value` sealed for `key` (sealed_value.h) with this leader's epoch.
  std::string Sealed(const std::string& key, uint64_t counter, const std::string& value) const;
  // The journal's key-value pairs as read: the verified prefix into `out` (ReadJournal).
  void VerifyJournal(const std::vector<etcd::KeyValue>& kvs, JournalRead* out);
  // cleanup_ for a read (VerifyJournal): `base` the snapshot read (empty: none), `put_pointer` when
  // its pointer was refused, `parts` its parts.
  void PlanCleanup(const JournalRead& read, const std::string& base, bool put_pointer,
                   uint64_t parts);
  // `text` in parts of at most 512 KiB under base/<part>: false as WriteFenced.
  bool WriteParts(etcd::Client& client, const std::string& base, const std::string& text,
                  etcd::Backoff& backoff, etcd::OutageLog& outage, const std::stop_token& st);
  // Folds the snapshot and the tail into a new snapshot if the tail passed its bound: false as
  // WriteFenced.
  bool MaybeCompact(etcd::Client& client, etcd::Backoff& backoff, etcd::OutageLog& outage,
                    const std::stop_token& st);
  void SetDeposed(std::string why);
  void SetFinal(const Status& s);  // deposes, for good
  // After a renewal: the leader key still holds the published value, or it is put back.
  void CheckLeaderKey(etcd::Client& client);
  // After a renewal sent at `sent_us`, time left: the job's other keys (OwnRecords::Check).
  void CheckOwnRecords(etcd::Client& client, int64_t sent_us);
  // A final error of a request about `key`, with what to do about it.
  Status Explain(const Status& s, const std::string& key) const;
  // What ReadJournal and Publish return when the leadership was lost while they retried.
  Status LostWhile(const std::string& doing, const Status& last) const;
  void RevokeQuietly(int64_t lease);
  std::string LapseReason() const;  // why a leader whose renew deadline passed stands down

  void Wake() const;

  LeadershipOptions options_;
  UniqueFd wake_;
  std::string prefix_;
  std::string leader_key_;
  // the caller's thread: Campaign, ReadJournal, Publish, Resign
  std::unique_ptr<etcd::Client> client_;
  // Not under mu_: set by Campaign before it starts the keep-alive thread
  // (the writer starts later still), fixed from then on.
  int64_t lease_ = 0;
  int64_t epoch_ = 0;
  int64_t seen_epoch_ = 0;  // the campaign's: see seen_epoch()
  // The campaign's: a lease granted for a leader key whose transaction got
  // no answer (it may have landed: the key on this lease is ours), with
  // the validity its grant gave.
  int64_t unclaimed_lease_ = 0;
  int64_t unclaimed_valid_until_us_ = 0;
  bool revoked_ = false;  // Resign gave the lease back (the caller's thread)
  // Atomics, not under mu_: Valid() and the accessors read them lock-free
  // from the loop. SetDeposed still stores them under mu_, so that a waiter
  // between its check and its sleep cannot miss the change.
  std::atomic<int64_t> valid_until_us_{0};    // monotonic µs
  mutable std::atomic<bool> deposed_{false};  // latched by deposed() at a lapse
  std::atomic<uint64_t> durable_{0};
  // The loop's own (Append, Flush, appended()), not under mu_; ReadJournal
  // sets them before it starts the writer.
  uint64_t appended_ = 0;
  uint64_t first_seq_ = 1;  // the seq this leader's first record gets (after the journal it read)
  std::vector<std::pair<uint64_t, std::string>> queued_;  // not yet flushed
  std::string queued_progress_;
  std::string queued_end_;
  uint64_t queued_plan_ = 0;  // the seq of the latest plan record queued, 0: none since Flush

  // The writer's own (ReadJournal sets them before it starts the writer): etcd's journal as the
  // writer left it, for the compaction.
  std::string snapshot_;           // the latest snapshot record (JSON), empty if none
  uint64_t snapshot_upto_ = 0;     // the seq of the last record it covers
  std::vector<std::string> tail_;  // records snapshot_upto_ + 1 … durable()
  size_t tail_bytes_ = 0;
  size_t compact_retry_at_ = 0;  // after a failed compaction: the tail's size to try again at
  bool compact_failure_said_ = false;
  // Parts of a split record that never got its header (its writer was deposed meanwhile), or
  // records after a gap, after the verified prefix: deleted by this leader's first write.
  bool orphans_ = false;
  // ReadJournal's, fixed before the writer starts: what every value written is sealed with, and
  // what the first write deletes (or puts back) of what the read refused.
  crypto::Key sealing_key_{};
  std::vector<etcd::Op> cleanup_;
  // The writer's: the latest progress record, put again (sealed with the journal's last record as
  // its counter) with every batch, so that the progress in etcd is never older than the journal.
  std::string progress_current_;

  // What Flush hands to the writer thread, and why the leadership was lost.
  mutable Mutex mu_;
  CondVar cv_;
  // flushed, for the writer
  std::deque<std::pair<uint64_t, std::string>> pending_ NONSTOP_GUARDED_BY(mu_);
  std::string progress_ NONSTOP_GUARDED_BY(mu_);   // the latest step record, for the writer
  std::string end_ NONSTOP_GUARDED_BY(mu_);        // the job_end record, for the writer
  uint64_t plan_seq_ NONSTOP_GUARDED_BY(mu_) = 0;  // the latest plan record's seq (P plan)
  std::string why_ NONSTOP_GUARDED_BY(mu_);
  Status final_ NONSTOP_GUARDED_BY(mu_);
  std::string published_ NONSTOP_GUARDED_BY(mu_);  // the leader key's value, once published
  crypto::Key job_key_ NONSTOP_GUARDED_BY(mu_){};
  bool has_job_key_ NONSTOP_GUARDED_BY(mu_) = false;  // Publish gave job_key_
  std::vector<LeaderKeyForgery> forgeries_ NONSTOP_GUARDED_BY(mu_);
  std::vector<RecordForgery> record_forgeries_ NONSTOP_GUARDED_BY(mu_);
  std::unique_ptr<OwnRecords> own_;  // the job's keys as this leader wrote them

  std::jthread keepalive_;
  std::jthread writer_;
};

}  // namespace nonstop::coord
