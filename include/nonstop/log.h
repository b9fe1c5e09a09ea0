// Logging to stderr: one line per call, with wall-clock time, level and the
// process's role ("controller", "worker 3"). Lines are written with a single
// write(2) so that lines from several threads never interleave. A training
// program logs through the same macros as the runtime, so its lines carry the
// same role and format:
//
//   NONSTOP_LOG_WARNING("step {}: {}", step, status.ToString());
//
// Thread-safety: every function may be called from any thread; the settings
// (role, level, sink) are meant to be set once at start-up.
#pragma once

#include <functional>
#include <string>
#include <string_view>

#include <fmt/format.h>

namespace nonstop {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };

// Set once at process start-up; read by every log line.
void SetLogRole(std::string role);
void SetLogLevel(LogLevel level);
// Where log lines go instead of a blocking write(2) to stderr (nullptr: back
// to stderr). `nonstop run` points it at its bounded stderr writer, so that
// a log line on the controller's loop never blocks on a slow reader.
void SetLogSink(std::function<void(std::string_view line)> sink);
LogLevel GetLogLevel();
// Parses "debug", "info", "warning", "error"; false on anything else.
bool ParseLogLevel(std::string_view text, LogLevel* level);

void LogLine(LogLevel level, std::string_view message);

template <typename... Args>
void Log(LogLevel level, fmt::format_string<Args...> format, Args&&... args) {
  if (level < GetLogLevel()) return;
  LogLine(level, fmt::format(format, std::forward<Args>(args)...));
}

}  // namespace nonstop

#define NONSTOP_LOG_DEBUG(...) ::nonstop::Log(::nonstop::LogLevel::kDebug, __VA_ARGS__)
#define NONSTOP_LOG_INFO(...) ::nonstop::Log(::nonstop::LogLevel::kInfo, __VA_ARGS__)
#define NONSTOP_LOG_WARNING(...) ::nonstop::Log(::nonstop::LogLevel::kWarning, __VA_ARGS__)
#define NONSTOP_LOG_ERROR(...) ::nonstop::Log(::nonstop::LogLevel::kError, __VA_ARGS__)
