#include "controller/journal.h"

#include <sys/file.h>
#include <unistd.h>
#include <chrono>

#include <cerrno>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>

#include <fmt/format.h>

#include "common/logging.h"
#include "common/time.h"

namespace nonstop::controller {

Result<std::unique_ptr<Journal>> Journal::Open(const std::string& path) {
  std::filesystem::path p(path);
  std::error_code ec;
  if (p.has_parent_path()) std::filesystem::create_directories(p.parent_path(), ec);
  std::string rotated;
  if (std::filesystem::exists(p, ec) && std::filesystem::file_size(p, ec) > 0) {
    std::time_t t = std::time(nullptr);
    std::tm tm{};
    ::gmtime_r(&t, &tm);
    char stamp[32];
    std::strftime(stamp, sizeof(stamp), "%Y%m%dT%H%M%SZ", &tm);
    std::filesystem::path base = p.parent_path() / (p.stem().string() + "-" + stamp);
    std::filesystem::path to = base;
    to += p.extension();
    for (int n = 2; std::filesystem::exists(to, ec); ++n) {
      to = base;
      to += fmt::format("-{}{}", n, p.extension().string());
    }
    std::filesystem::rename(p, to, ec);
    if (ec) {
      return UnavailableError(
          fmt::format("cannot keep the earlier journal {}: renaming it to {} failed: {}", path,
                      to.string(), ec.message()));
    }
    rotated = to.string();
  } else {
    std::filesystem::remove(p, ec);  // an empty journal holds nothing to keep
  }
  // "x": never truncate a journal that appeared meanwhile (another job on the same path).
  std::FILE* f = std::fopen(path.c_str(), "wxe");
  if (f == nullptr) return ErrnoStatus(StatusCode::kUnavailable, "open journal " + path, errno);
  auto j = std::unique_ptr<Journal>(new Journal(path, f));
  j->rotated_to_ = rotated;
  NONSTOP_RETURN_IF_ERROR(j->Lock());
  return j;
}

Result<std::unique_ptr<Journal>> Journal::OpenForAppend(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "r+e");
  if (f == nullptr) return ErrnoStatus(StatusCode::kUnavailable, "open journal " + path, errno);
  auto j = std::unique_ptr<Journal>(new Journal(path, f));
  NONSTOP_RETURN_IF_ERROR(j->Lock());
  // Cut a torn last record (its writer was killed mid-line) back to the last
  // newline, so the records appended now start on a line of their own.
  std::string text;
  {
    std::ifstream in(path, std::ios::binary);
    text.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  size_t keep = text.rfind('\n') == std::string::npos ? 0 : text.rfind('\n') + 1;
  if (keep < text.size() && ::ftruncate(::fileno(f), static_cast<off_t>(keep)) != 0) {
    return ErrnoStatus(StatusCode::kUnavailable, "cut the torn last line of journal " + path,
                       errno);
  }
  std::fseek(f, 0, SEEK_END);
  return j;
}

Status Journal::Lock() {
  // One controller writes a journal: a second one (a standby that thinks it
  // leads, a --resume while the first still runs) is refused, not interleaved.
  if (::flock(::fileno(file_), LOCK_EX | LOCK_NB) != 0) {
    return FailedPreconditionError(
        fmt::format("journal {} is held by another controller (a running controller of this job?): "
                    "stop it first",
                    path_));
  }
  return OkStatus();
}

Journal::~Journal() {
  if (file_ != nullptr) std::fclose(file_);
}

void Journal::Append(nlohmann::json record) {
  record["time_us"] = WallMicros();
  record["mono_us"] = static_cast<int64_t>(MonotonicSeconds() * 1e6);
  std::string line = record.dump() + "\n";
  std::fwrite(line.data(), 1, line.size(), file_);
  unsynced_ = true;
  if (mirror_) mirror_(record);
}

void Journal::Copy(const nlohmann::json& record) {
  std::string line = record.dump() + "\n";
  std::fwrite(line.data(), 1, line.size(), file_);
  unsynced_ = true;
}

void Journal::Flush() { std::fflush(file_); }

void Journal::Sync() {
  // A full disk or a failed device: the records stay in this process's buffer or the page cache at
  // worst, and the orders go out (a controller that stopped issuing orders would stop the job); the
  // log says so once.
  const char* failed = nullptr;
  const auto t0 = std::chrono::steady_clock::now();
  if (std::fflush(file_) != 0) {
    failed = "write";
  } else if (unsynced_ && ::fdatasync(::fileno(file_)) != 0) {
    failed = "fdatasync";
  }
  // The caller's loop waited this long (the controller's: docs/thread-model.md): said when it is
  // long, at most once in 10 s, so that a detector that ran late can be told from a silent peer.
  const auto took = std::chrono::steady_clock::now() - t0;
  if (took >= std::chrono::milliseconds(100) &&
      std::chrono::steady_clock::now() >= next_slow_say_) {
    NONSTOP_LOG_WARNING("journal {}: writing and syncing took {} ms", path_,
                        std::chrono::duration_cast<std::chrono::milliseconds>(took).count());
    next_slow_say_ = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  }
  if (failed != nullptr && !sync_failed_) {
    sync_failed_ = true;
    NONSTOP_LOG_WARNING("journal {}: {}: {} (its latest records may be lost if this host fails)",
                        path_, failed, std::strerror(errno));
  }
  if (failed == nullptr) unsynced_ = false;
}

Result<std::vector<nlohmann::json>> Journal::Read(const std::string& path, bool* torn_tail) {
  std::ifstream in(path);
  if (!in) return NotFoundError("cannot open journal " + path);
  std::vector<nlohmann::json> out;
  std::string line;
  int n = 0;
  while (std::getline(in, line)) {
    ++n;
    if (line.empty()) continue;
    auto j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_discarded()) {
      // A controller killed while it wrote leaves its last line torn (no newline): that one record
      // is lost.
      if (in.eof() && torn_tail != nullptr) {
        *torn_tail = true;
        break;
      }
      return DataLossError(fmt::format("journal {} line {} is not JSON", path, n));
    }
    out.push_back(std::move(j));
  }
  return out;
}

}  // namespace nonstop::controller
