#include "controller/journal.h"

#include <fcntl.h>
#include <sys/eventfd.h>
#include <sys/file.h>
#include <unistd.h>

#include <chrono>

#include <cerrno>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>

#include <fmt/format.h>

#include "common/check.h"
#include "common/logging.h"
#include "common/time.h"

namespace nonstop::controller {

namespace {

// "<stem>-<UTC time>[-N]<ext>" beside `p`: a name no file has yet.
std::filesystem::path RotatedName(const std::filesystem::path& p) {
  std::error_code ec;
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
  return to;
}

Status WriteAll(int fd, const std::string& text, const std::string& path) {
  for (size_t done = 0; done < text.size();) {
    ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return ErrnoStatus(StatusCode::kUnavailable, "write journal " + path, errno);
    done += static_cast<size_t>(n);
  }
  return OkStatus();
}

}  // namespace

Result<std::unique_ptr<Journal>> Journal::Open(const std::string& path,
                                               const std::vector<nlohmann::json>& history) {
  std::filesystem::path p(path);
  std::error_code ec;
  if (p.has_parent_path()) std::filesystem::create_directories(p.parent_path(), ec);
  // The new journal, history included, is written beside the path and then renamed over it: a
  // reader (a report, the dashboard, a test) finds the earlier journal or the whole new one, never
  // an empty or half-copied file.
  const std::string fresh = fmt::format("{}.new-{}", path, ::getpid());
  std::filesystem::remove(fresh, ec);  // a leftover of this pid's predecessor, killed here
  UniqueFd fd(::open(fresh.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_APPEND | O_CLOEXEC, 0644));
  if (!fd.valid()) return ErrnoStatus(StatusCode::kUnavailable, "open journal " + fresh, errno);
  auto discard = [&](Status why) {
    std::filesystem::remove(fresh, ec);
    return why;
  };
  std::string text;
  for (const auto& r : history) text += r.dump() + "\n";
  if (Status s = WriteAll(fd.get(), text, fresh); !s.ok()) return discard(s);
  std::string rotated;
  if (std::filesystem::exists(p, ec) && std::filesystem::file_size(p, ec) > 0) {
    // Kept under a second name first (a hard link): the path is never without a journal. Where
    // the filesystem has no hard links it is renamed, and the path is empty for a moment.
    std::filesystem::path to = RotatedName(p);
    if (::link(path.c_str(), to.c_str()) != 0 && ::rename(path.c_str(), to.c_str()) != 0) {
      return discard(UnavailableError(
          fmt::format("cannot keep the earlier journal {}: moving it to {} failed: {}", path,
                      to.string(), std::strerror(errno))));
    }
    rotated = to.string();
  }
  if (::rename(fresh.c_str(), path.c_str()) != 0) {
    const int err = errno;
    if (!rotated.empty() && std::filesystem::exists(p, ec)) std::filesystem::remove(rotated, ec);
    return discard(ErrnoStatus(StatusCode::kUnavailable, "rename journal " + fresh, err));
  }
  auto j = std::unique_ptr<Journal>(new Journal(path, std::move(fd)));
  j->rotated_to_ = rotated;
  NONSTOP_RETURN_IF_ERROR(j->Lock());
  return j;
}

Result<std::unique_ptr<Journal>> Journal::OpenForAppend(const std::string& path) {
  UniqueFd fd(::open(path.c_str(), O_WRONLY | O_APPEND | O_CLOEXEC));
  if (!fd.valid()) return ErrnoStatus(StatusCode::kUnavailable, "open journal " + path, errno);
  const int raw = fd.get();
  auto j = std::unique_ptr<Journal>(new Journal(path, std::move(fd)));
  NONSTOP_RETURN_IF_ERROR(j->Lock());
  // Cut a torn last record (its writer was killed mid-line) back to the last
  // newline, so the records appended now start on a line of their own.
  std::string text;
  {
    std::ifstream in(path, std::ios::binary);
    text.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  size_t keep = text.rfind('\n') == std::string::npos ? 0 : text.rfind('\n') + 1;
  if (keep < text.size() && ::ftruncate(raw, static_cast<off_t>(keep)) != 0) {
    return ErrnoStatus(StatusCode::kUnavailable, "cut the torn last line of journal " + path,
                       errno);
  }
  return j;  // O_APPEND: the records go after the cut
}

Status Journal::Lock() {
  // One controller writes a journal: a second one (a standby that thinks it
  // leads, a --resume while the first still runs) is refused, not interleaved.
  if (::flock(fd_.get(), LOCK_EX | LOCK_NB) != 0) {
    return FailedPreconditionError(
        fmt::format("journal {} is held by another controller (a running controller of this job?): "
                    "stop it first",
                    path_));
  }
  return OkStatus();
}

Journal::Journal(std::string path, UniqueFd fd)
    : path_(std::move(path)),
      fd_(std::move(fd)),
      wake_(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)),
      writer_([this](std::stop_token stop) { Run(std::move(stop)); }) {
  NONSTOP_CHECK(wake_.valid()) << "eventfd: " << std::strerror(errno);
}

Journal::~Journal() {
  Sync();  // what a reader finds once the controller is gone: everything, on disk
  writer_.request_stop();
  writer_.join();
}

void Journal::Append(nlohmann::json record) {
  record["time_us"] = WallMicros();
  record["mono_us"] = static_cast<int64_t>(MonotonicSeconds() * 1e6);
  queued_ += record.dump();
  queued_ += '\n';
  ++appended_;
  if (mirror_) mirror_(record);
}

void Journal::Flush() {
  if (queued_.empty()) return;
  MutexLock l(&mu_);
  if (handed_.empty()) {
    handed_.swap(queued_);
  } else {
    handed_ += queued_;
    queued_.clear();
  }
  handed_upto_ = appended_;
  cv_.NotifyOne();
}

void Journal::Sync() {
  Flush();
  MutexLock l(&mu_);
  if (sync_upto_ >= appended_) return;
  sync_upto_ = appended_;
  cv_.NotifyOne();
}

void Journal::Run(std::stop_token stop) {
  while (true) {
    std::string text;
    uint64_t upto = 0;
    bool sync = false;
    {
      MutexLock l(&mu_);
      auto work = [this]() NONSTOP_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return !handed_.empty() || sync_upto_ > durable_.load();
      };
      cv_.Wait(&mu_, stop, work);
      if (!work()) return;  // stopped, with nothing left (the destructor's Sync came first)
      text.swap(handed_);
      upto = handed_upto_;
      sync = sync_upto_ > durable_.load();
    }
    WriteOut(text);
    if (!sync) continue;
    SyncOut();
    // Everything handed over by now is written: the sync covered it (Sync hands over before it
    // asks, so upto >= what it asked for).
    durable_.store(upto);
    const uint64_t one = 1;
    [[maybe_unused]] ssize_t n = ::write(wake_.get(), &one, sizeof(one));
  }
}

void Journal::WriteOut(const std::string& text) {
  // A batch that fails part-way (a full disk) is cut back to where it began: the file stays whole
  // lines, and the next batch does not land in the middle of one (Read would refuse the journal).
  if (torn_at_ >= 0 && ::ftruncate(fd_.get(), torn_at_) == 0) torn_at_ = -1;  // cut it back now
  const off_t start = ::lseek(fd_.get(), 0, SEEK_END);
  size_t done = 0;
  while (done < text.size()) {
    ssize_t n = ::write(fd_.get(), text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const std::string why = n < 0 ? std::strerror(errno) : "nothing written";
      const bool cut = done > 0 && start >= 0 && ::ftruncate(fd_.get(), start) == 0;
      if (done > 0 && !cut) torn_at_ = start;  // tried again before the next batch
      if (!write_failed_said_) {
        write_failed_said_ = true;
        NONSTOP_LOG_WARNING("journal {}: write: {} ({} bytes of records lost{})", path_, why,
                            cut ? text.size() : text.size() - done,
                            done > 0 && !cut ? "; its last line is torn" : "");
      }
      return;
    }
    done += static_cast<size_t>(n);
  }
}

void Journal::SyncOut() {
  const auto t0 = std::chrono::steady_clock::now();
  if (::fdatasync(fd_.get()) != 0 && !sync_failed_said_) {
    sync_failed_said_ = true;
    NONSTOP_LOG_WARNING(
        "journal {}: fdatasync: {} (its latest records may be lost if this host "
        "fails)",
        path_, std::strerror(errno));
  }
  // Orders wait this long (not the loop: it goes on meanwhile), said when it is long, at most
  // once in 10 s.
  const auto took = std::chrono::steady_clock::now() - t0;
  if (took >= std::chrono::milliseconds(100) &&
      std::chrono::steady_clock::now() >= next_slow_say_) {
    NONSTOP_LOG_WARNING(
        "journal {}: a sync took {} ms (orders waited for it; the controller's "
        "loop did not)",
        path_, std::chrono::duration_cast<std::chrono::milliseconds>(took).count());
    next_slow_say_ = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  }
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
