// Journal: the job's append-only event log, one JSON object per line
// (docs/journal.md). Every record gets "time_us" (wall clock, microseconds
// since the epoch) and "mono_us" (monotonic, for durations) when appended.
//
// The file is written by a thread of the journal's own, so the controller's
// loop, which carries the job's liveness (heartbeats, detectors), never waits
// on the disk (docs/thread-model.md): a journal on a slow or shared disk
// (NFS, a disk busy with checkpoints) delays orders, not detection.
// Appended lines are queued; the runtime calls Flush() once per turn of its
// loop (every <= 20 ms, and before it exits), which hands them to the writer,
// so a reader (a report, a test, a benchmark) sees every event within a loop
// turn even if the job dies, and a recovery of 100,000 members does not pay
// 100,000 write calls (docs/scale.md). In a turn that decides orders it calls
// Sync() instead, and each order waits until durable() has reached the records
// before it (fdatasync): the records reach the disk before the orders they
// describe go out. wake_fd() says when durable() grew.
//
// Thread-safety: one thread (the controller's loop) calls everything but
// durable() and wake_fd(), which any thread may.
#pragma once

#include <sys/types.h>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <stop_token>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/mutex.h"
#include "common/unique_fd.h"
#include "nonstop/status.h"

namespace nonstop::controller {

class Journal {
 public:
  // Starts a new journal at `path`. A journal already there (an earlier job's)
  // is never truncated: it is renamed to "<stem>-<UTC time>[-N]<ext>" beside it
  // first (rotated_to() names it), so every job's record is kept. The new one starts with
  // `history` (a predecessor's records, as etcd holds them: no stamp, no mirror); the path always
  // names a whole journal, the earlier one until the new one has its history.
  static Result<std::unique_ptr<Journal>> Open(const std::string& path,
                                               const std::vector<nlohmann::json>& history = {});
  // Goes on with the journal at `path` (a controller taking over the job):
  // records are appended to it; it must exist.
  static Result<std::unique_ptr<Journal>> OpenForAppend(const std::string& path);
  // Writes and syncs everything appended, then stops the writer.
  ~Journal();
  Journal(const Journal&) = delete;
  Journal& operator=(const Journal&) = delete;

  // Stamps the record (time_us, mono_us), queues it, and hands it to the mirror if one is set.
  void Append(nlohmann::json record);
  // Every record Append queues from now on also goes to `mirror` (etcd's copy of the journal).
  void set_mirror(std::function<void(const nlohmann::json&)> mirror) {
    mirror_ = std::move(mirror);
  }
  // Hands what was queued to the writer: in the file within moments, not synced.
  void Flush();
  // Flush, and asks the writer to fdatasync once it has written them: durable() then reaches
  // appended(), and the records survive the loss of this host. A disk that fails is said once,
  // and durable() goes on (a controller that stopped issuing orders would stop the job).
  void Sync();
  uint64_t appended() const { return appended_; }       // records queued so far (seq of the last)
  uint64_t durable() const { return durable_.load(); }  // records synced (or failed to) so far
  // Readable (an eventfd) when durable() grew: the loop's cue to send what waited for it.
  int wake_fd() const { return wake_.get(); }
  const std::string& path() const { return path_; }
  // Where the previous journal at path() went; empty if there was none.
  const std::string& rotated_to() const { return rotated_to_; }

  // Reads a journal back (for reports and tests); malformed lines are errors naming the line.
  // With torn_tail, a last line that is not JSON (its writer was killed
  // mid-line) is left out and *torn_tail set, instead of an error.
  static Result<std::vector<nlohmann::json>> Read(const std::string& path,
                                                  bool* torn_tail = nullptr);

 private:
  Journal(std::string path, UniqueFd fd);
  Status Lock();
  // The writer thread: writes what Flush handed over, syncs what Sync asked for, until stopped
  // with nothing left.
  void Run(std::stop_token stop);
  void WriteOut(const std::string& text);  // the writer's: all of it, or says why not (once)
  void SyncOut();                          // the writer's: fdatasync, said when slow or failed

  std::string path_;
  UniqueFd fd_;  // O_APPEND
  UniqueFd wake_;
  std::string rotated_to_;
  // The loop's (Append, Flush, Sync).
  std::string queued_;
  uint64_t appended_ = 0;
  std::function<void(const nlohmann::json&)> mirror_;

  Mutex mu_;
  CondVar cv_;
  std::string handed_ NONSTOP_GUARDED_BY(mu_);        // lines for the writer
  uint64_t handed_upto_ NONSTOP_GUARDED_BY(mu_) = 0;  // seq of the last record handed over
  uint64_t sync_upto_ NONSTOP_GUARDED_BY(mu_) = 0;    // Sync asked durable() to reach this
  std::atomic<uint64_t> durable_{0};
  // The writer's.
  off_t torn_at_ = -1;  // a torn batch not cut back yet began here: cut before the next (WriteOut)
  bool write_failed_said_ = false;                         // a failed write is said once
  bool sync_failed_said_ = false;                          // and a failed sync
  std::chrono::steady_clock::time_point next_slow_say_{};  // a slow one at most once in 10 s
  std::jthread writer_;  // last: started once the members it uses exist
};

}  // namespace nonstop::controller
