// Leadership of a job through etcd (docs/controller-failover.md): the
// election of one controller among standbys, the lease that keeps it
// leading, and the job's journal replicated to etcd so that the next leader
// resumes exactly where this one stopped.
//
// Keys, under the job's prefix P ("/nonstop/<job>/"):
//   P leader              {"controller": "host:port", "pid": …}: on the leader's lease.
//                         Its create revision is the leader's epoch: it only grows.
//   P journal/<seq>       one journal record (JSON), seq from 1, zero-padded to 16 digits.
//   P progress            the latest "step" record: steps are the journal's bulk, and
//                         a takeover needs only the last one.
//   P end                 the job_end record, once the job ended: agents and workers that
//                         look for a leader after the last one resigned learn it here.
//
// Fencing. Every write of the journal is a transaction that first compares
// the leader key's create revision with this leader's epoch: once the lease
// is gone (another controller may lead) nothing this process writes lands.
// Valid() tells the controller whether it may still issue orders: the lease
// was renewed less than 80% of its TTL ago, measured from when the renewal
// was sent, so a process paused (SIGSTOP, a swap storm) past its lease knows
// it on waking, before it sends anything.
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

#include "common/mutex.h"
#include "common/status.h"
#include "common/time.h"
#include "common/unique_fd.h"
#include "coord/etcd.h"

namespace nonstop::coord {

struct LeadershipOptions {
  std::string endpoints;  // etcd: host:port[,host:port…]
  std::string job = "default";
  int ttl_seconds = 2;  // the leader's lease: a dead leader is replaced within about this
  std::chrono::milliseconds poll{100};  // how often a standby looks at the leader key
};

// A job's name in etcd: 1-64 of [A-Za-z0-9._-] (so one job's keys are never inside another's).
Status CheckJobName(const std::string& job);
std::string JobPrefix(const std::string& job);       // "/nonstop/<job>/"
std::string LeaderKey(const std::string& job);       // "/nonstop/<job>/leader"

// Who leads `job` now, as its leader key says: the control address, or
// NotFound (nobody leads, or the leader has not published an address yet),
// or Aborted when the job ended (the message says how; *exit_code, if given,
// is the job's exit code).
Result<std::string> LookUpLeader(etcd::Client& client, const std::string& job, int* exit_code = nullptr);

class Leadership {
 public:
  // Connects and checks that etcd answers: an error names the endpoints.
  static Result<std::unique_ptr<Leadership>> Connect(LeadershipOptions options);
  ~Leadership();  // stops its threads and gives the lease back (a clean exit hands over at once)
  Leadership(const Leadership&) = delete;
  Leadership& operator=(const Leadership&) = delete;

  // Waits until this process leads the job (or stop() says to give up:
  // Cancelled). on_wait(leader) is called when another controller leads (its
  // key's value) and each time that changes. Returns the epoch.
  Result<int64_t> Campaign(const std::function<bool()>& stop, const std::function<void(const std::string&)>& on_wait);

  // The journal in etcd, in order: what the takeover replays (the progress
  // record last, if any). Read after Campaign won.
  Result<std::vector<nlohmann::json>> ReadJournal();

  // The leader key's value once this controller listens (its address).
  Status Publish(const nlohmann::json& value);

  // Queues one record (already stamped); Flush hands the queue to the writer.
  void Append(const nlohmann::json& record);
  void Flush();
  uint64_t appended() const { return appended_; }        // records queued so far (seq of the last)
  uint64_t durable() const { return durable_.load(); }   // records etcd holds so far

  // Readable (an eventfd) when durable() grew or the leadership was lost: the loop's cue to go on.
  int wake_fd() const { return wake_.get(); }
  bool Valid() const;                 // may this process issue orders now?
  bool deposed() const { return deposed_.load(); }
  std::string why_not_leading() const;  // why Valid() is false (for the journal and the log)
  int64_t epoch() const { return epoch_; }
  const std::string& endpoints() const { return options_.endpoints; }

  // Gives the lease back now (the job ended, or this process steps down).
  void Resign();

 private:
  explicit Leadership(LeadershipOptions o) : options_(std::move(o)) {}
  void KeepAlive(std::stop_token st);
  void Write(std::stop_token st);
  void SetDeposed(std::string why);

  void Wake();

  LeadershipOptions options_;
  UniqueFd wake_;
  std::string prefix_;
  std::string leader_key_;
  std::unique_ptr<etcd::Client> client_;  // the caller's thread: Campaign, ReadJournal, Publish, Resign
  // Not under mu_: set by Campaign before it starts the keep-alive thread
  // (the writer starts later still), fixed from then on.
  int64_t lease_ = 0;
  int64_t epoch_ = 0;
  // Atomics, not under mu_: Valid() and the accessors read them lock-free
  // from the loop. SetDeposed still stores them under mu_, so that a waiter
  // between its check and its sleep cannot miss the change.
  std::atomic<int64_t> valid_until_us_{0};  // monotonic µs
  std::atomic<bool> deposed_{false};
  std::atomic<uint64_t> durable_{0};
  // The loop's own (Append, Flush, appended()), not under mu_; ReadJournal
  // sets them before it starts the writer.
  uint64_t appended_ = 0;
  uint64_t first_seq_ = 1;  // the seq this leader's first record gets (after the journal it read)
  std::vector<std::pair<uint64_t, std::string>> queued_;  // not yet flushed
  std::string queued_progress_;
  std::string queued_end_;

  // What Flush hands to the writer thread, and why the leadership was lost.
  mutable Mutex mu_;
  CondVar cv_;
  std::deque<std::pair<uint64_t, std::string>> pending_ NONSTOP_GUARDED_BY(mu_);  // flushed, for the writer
  std::string progress_ NONSTOP_GUARDED_BY(mu_);  // the latest step record, for the writer
  std::string end_ NONSTOP_GUARDED_BY(mu_);       // the job_end record, for the writer
  std::string why_ NONSTOP_GUARDED_BY(mu_);

  std::jthread keepalive_;
  std::jthread writer_;
};

}  // namespace nonstop::coord
