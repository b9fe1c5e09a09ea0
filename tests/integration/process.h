// Test helper: runs a command as a real child process with its output in a
// file, so tests can watch it, signal it and read what it printed.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "common/check.h"
#include "controller/journal.h"

namespace nonstop::testing {

class ChildProcess {
 public:
  // env_add: "NAME=value" entries added to (or replacing in) the inherited environment.
  ChildProcess(std::vector<std::string> argv, const std::string& output_path,
               std::vector<std::string> env_add = {})
      : output_path_(output_path) {
    pid_ = ::fork();
    NONSTOP_CHECK_GE(pid_, 0);
    if (pid_ == 0) {
      int fd = ::open(output_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      ::dup2(fd, 1);
      ::dup2(fd, 2);
      for (auto& kv : env_add) ::putenv(kv.data());
      std::vector<char*> args;
      for (auto& a : argv) args.push_back(a.data());
      args.push_back(nullptr);
      ::execv(args[0], args.data());
      _exit(127);
    }
  }
  ~ChildProcess() {
    if (!exited_) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }

  // Waits up to `timeout`; returns the exit status (WEXITSTATUS or 128+signal), or -1 on timeout.
  int Wait(std::chrono::milliseconds timeout) {
    auto until = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < until) {
      int status = 0;
      pid_t r = ::waitpid(pid_, &status, WNOHANG);
      if (r == pid_) {
        exited_ = true;
        return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return -1;
  }

  std::string Output() const {
    std::ifstream in(output_path_);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }

  pid_t pid() const { return pid_; }

 private:
  std::string output_path_;
  pid_t pid_ = -1;
  bool exited_ = false;
};

// SIGSTOPs `pid` and waits until every thread of it is stopped (kill() only queues the signal: a
// busy machine may let the process answer a request or two before it stops). False when the
// process did not stop within `timeout` or cannot be seen in /proc.
inline bool StopProcess(pid_t pid, std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
  if (::kill(pid, SIGSTOP) != 0) return false;
  const std::string tasks = "/proc/" + std::to_string(pid) + "/task";
  for (auto until = std::chrono::steady_clock::now() + timeout;
       std::chrono::steady_clock::now() < until;
       std::this_thread::sleep_for(std::chrono::milliseconds(1))) {
    std::error_code ec;
    bool all = true, any = false;
    std::filesystem::directory_iterator it(tasks, ec), end;
    for (; !ec && it != end; it.increment(ec)) {
      std::ifstream in(it->path() / "stat");
      std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      // "pid (comm) S ...": the state follows the last ')' (comm may hold one)
      size_t close = stat.rfind(')');
      if (close == std::string::npos || close + 2 >= stat.size()) continue;  // gone meanwhile
      any = true;
      const char state = stat[close + 2];
      if (state == 'Z' || state == 'X') return false;  // exiting or exited: it will never stop
      all = all && (state == 'T' || state == 't');
    }
    if (ec) return false;  // the process is gone
    if (any && all) return true;
  }
  return false;
}

// The records of one kind ("step", "plan", …) in a journal; none if it cannot be read yet.
inline std::vector<nlohmann::json> JournalEvents(const std::string& journal,
                                                 const std::string& kind) {
  std::vector<nlohmann::json> out;
  auto all = controller::Journal::Read(journal);
  if (!all.ok()) return out;
  for (auto& j : *all) {
    if (j.value("event", "") == kind) out.push_back(j);
  }
  return out;
}

// The checksum of a journal's first `finished` record; empty if there is none.
inline std::string FinishedChecksum(const std::string& journal) {
  auto finished = JournalEvents(journal, "finished");
  return finished.empty() ? "" : finished[0].value("checksum", "");
}

// Waits until the journal holds at least `count` records of `kind`; false on timeout.
inline bool WaitForEvents(const std::string& journal, const std::string& kind, size_t count,
                          std::chrono::milliseconds timeout) {
  auto until = std::chrono::steady_clock::now() + timeout;
  while (JournalEvents(journal, kind).size() < count) {
    if (std::chrono::steady_clock::now() >= until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return true;
}

// The control address the controller wrote to the job file (job.json) in `dir`, waited for up
// to 10 s; "" if none came.
inline std::string ControllerAddress(const std::string& dir) {
  for (int i = 0; i < 500; ++i) {
    std::ifstream in(dir + "/job.json");
    std::stringstream text;
    text << in.rdbuf();
    auto job = nlohmann::json::parse(text.str(), nullptr, false);
    if (job.is_object() && job.contains("controller") && job["controller"].is_string())
      return job["controller"].get<std::string>();
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return "";
}

}  // namespace nonstop::testing
