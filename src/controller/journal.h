// Journal: the job's append-only event log, one JSON object per line
// (docs/journal.md). Every record gets "time_us" (wall clock, microseconds
// since the epoch) and "mono_us" (monotonic, for durations) when appended.
// Lines are flushed at once so that a reader (a report, a test, a benchmark)
// sees every event even if the job dies.
#pragma once

#include <cstdio>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/status.h"

namespace nonstop::controller {

class Journal {
 public:
  static Result<std::unique_ptr<Journal>> Open(const std::string& path);
  ~Journal();
  Journal(const Journal&) = delete;
  Journal& operator=(const Journal&) = delete;

  void Append(nlohmann::json record);
  const std::string& path() const { return path_; }

  // Reads a journal back (for reports and tests); malformed lines are errors naming the line.
  static Result<std::vector<nlohmann::json>> Read(const std::string& path);

 private:
  Journal(std::string path, std::FILE* f) : path_(std::move(path)), file_(f) {}
  std::string path_;
  std::FILE* file_;
};

}  // namespace nonstop::controller
