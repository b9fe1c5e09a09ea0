// Journal: the job's append-only event log, one JSON object per line
// (docs/journal.md). Every record gets "time_us" (wall clock, microseconds
// since the epoch) and "mono_us" (monotonic, for durations) when appended.
// Appended lines are buffered; the runtime calls Flush() once per turn of its
// loop (every ≤ 20 ms, and before it exits), so a reader (a report, a test, a
// benchmark) sees every event within a loop turn even if the job dies, and a
// recovery of 100,000 members does not pay 100,000 write calls
// (docs/scale.md). In a turn that sends orders it calls Sync() instead: the
// records reach the disk (fdatasync) before the orders they describe go out.
#pragma once

#include <chrono>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/status.h"

namespace nonstop::controller {

class Journal {
 public:
  // Starts a new journal at `path`. A journal already there (an earlier job's)
  // is never truncated: it is renamed to "<stem>-<UTC time>[-N]<ext>" beside it
  // first (rotated_to() names it), so every job's record is kept.
  static Result<std::unique_ptr<Journal>> Open(const std::string& path);
  // Goes on with the journal at `path` (a controller taking over the job):
  // records are appended to it; it must exist.
  static Result<std::unique_ptr<Journal>> OpenForAppend(const std::string& path);
  ~Journal();
  Journal(const Journal&) = delete;
  Journal& operator=(const Journal&) = delete;

  // Stamps the record (time_us, mono_us), writes it, and hands it to the mirror if one is set.
  void Append(nlohmann::json record);
  // Writes a record as it is (a predecessor's, copied from etcd): no stamp, no mirror.
  void Copy(const nlohmann::json& record);
  // Every record Append writes from now on also goes to `mirror` (etcd's copy of the journal).
  void set_mirror(std::function<void(const nlohmann::json&)> mirror) {
    mirror_ = std::move(mirror);
  }
  // Writes what Append buffered to the file.
  void Flush();
  // Flush, then fdatasync: what was appended survives the loss of this host
  // (the runtime syncs before it sends the orders the records describe).
  void Sync();
  const std::string& path() const { return path_; }
  // Where the previous journal at path() went; empty if there was none.
  const std::string& rotated_to() const { return rotated_to_; }

  // Reads a journal back (for reports and tests); malformed lines are errors naming the line.
  // With torn_tail, a last line that is not JSON (its writer was killed
  // mid-line) is left out and *torn_tail set, instead of an error.
  static Result<std::vector<nlohmann::json>> Read(const std::string& path,
                                                  bool* torn_tail = nullptr);

 private:
  Journal(std::string path, std::FILE* f) : path_(std::move(path)), file_(f) {}
  Status Lock();
  std::string path_;
  std::FILE* file_;
  std::string rotated_to_;
  bool unsynced_ = false;     // appended since the last Sync
  bool sync_failed_ = false;  // said once
  std::chrono::steady_clock::time_point
      next_slow_say_{};  // a slow Sync is said at most once in 10 s
  std::function<void(const nlohmann::json&)> mirror_;
};

}  // namespace nonstop::controller
