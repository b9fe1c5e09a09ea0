#include "nonstop/log.h"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <ctime>

#include "common/mutex.h"

namespace nonstop {
namespace {

// atomic: read on every log line, no lock
std::atomic<int> g_level{static_cast<int>(LogLevel::kInfo)};
Mutex g_role_mu;
std::string g_role NONSTOP_GUARDED_BY(g_role_mu) = "nonstop";
// Held while the sink runs: SetLogSink(nullptr) then returns only once no
// thread is still inside the old sink (BoundedStdio destroys its writers next).
Mutex g_sink_mu;
std::function<void(std::string_view)> g_sink NONSTOP_GUARDED_BY(g_sink_mu);

char LevelChar(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug:
      return 'D';
    case LogLevel::kInfo:
      return 'I';
    case LogLevel::kWarning:
      return 'W';
    case LogLevel::kError:
      return 'E';
  }
  return '?';
}

}  // namespace

void SetLogRole(std::string role) {
  MutexLock lock(&g_role_mu);
  g_role = std::move(role);
}

void SetLogLevel(LogLevel level) { g_level.store(static_cast<int>(level)); }

void SetLogSink(std::function<void(std::string_view)> sink) {
  MutexLock lock(&g_sink_mu);
  g_sink = std::move(sink);
}
LogLevel GetLogLevel() { return static_cast<LogLevel>(g_level.load()); }

bool ParseLogLevel(std::string_view text, LogLevel* level) {
  if (text == "debug")
    *level = LogLevel::kDebug;
  else if (text == "info")
    *level = LogLevel::kInfo;
  else if (text == "warning")
    *level = LogLevel::kWarning;
  else if (text == "error")
    *level = LogLevel::kError;
  else
    return false;
  return true;
}

void LogLine(LogLevel level, std::string_view message) {
  auto now = std::chrono::system_clock::now();
  std::time_t secs = std::chrono::system_clock::to_time_t(now);
  int millis = static_cast<int>(
      std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count() % 1000);
  std::tm tm{};
  localtime_r(&secs, &tm);
  std::string role;
  {
    MutexLock lock(&g_role_mu);
    role = g_role;
  }
  std::string line = fmt::format("{}{:02}:{:02}:{:02}.{:03} {}] {}\n", LevelChar(level), tm.tm_hour,
                                 tm.tm_min, tm.tm_sec, millis, role, message);
  {
    MutexLock lock(&g_sink_mu);
    if (g_sink) {
      g_sink(line);
      return;
    }
  }
  const char* p = line.data();
  size_t left = line.size();
  while (left > 0) {
    ssize_t n = ::write(STDERR_FILENO, p, left);
    if (n <= 0) break;
    p += n;
    left -= static_cast<size_t>(n);
  }
}

}  // namespace nonstop
