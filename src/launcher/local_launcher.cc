#include "launcher/local_launcher.h"

#include <fcntl.h>
#include <grp.h>
#include <pwd.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include <set>
#include <string_view>

#include <fmt/format.h>

#include "common/job_token.h"
#include "common/logging.h"

namespace nonstop::launcher {

namespace {

int PidfdOpen(pid_t pid) { return static_cast<int>(::syscall(SYS_pidfd_open, pid, 0)); }

void WriteAll(int fd, std::string_view s) {
  while (!s.empty()) {
    ssize_t n = ::write(fd, s.data(), s.size());
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    s.remove_prefix(static_cast<size_t>(n));
  }
}

}  // namespace

Result<RunAs> LookUpRunAs(const std::string& name_or_uid) {
  const std::string setting(settings::kWorkerUser.flag);
  if (::geteuid() != 0) {
    return FailedPreconditionError(fmt::format(
        "{} {}: only a launcher running as root can start workers as another user (this one "
        "runs as uid {}); run the launcher as root, or leave {} out",
        setting, name_or_uid, ::geteuid(), setting));
  }
  std::vector<char> buf(16384);
  struct passwd pw {};
  struct passwd* found = nullptr;
  // A name first (a name may be all digits), then a uid: decimal, in uid_t's range.
  int err = ::getpwnam_r(name_or_uid.c_str(), &pw, buf.data(), buf.size(), &found);
  if (found == nullptr && !name_or_uid.empty() && name_or_uid.size() <= 10 &&
      name_or_uid.find_first_not_of("0123456789") == std::string::npos) {
    const unsigned long long uid = std::stoull(name_or_uid);
    if (uid < static_cast<unsigned long long>(static_cast<uid_t>(-1))) {
      err = ::getpwuid_r(static_cast<uid_t>(uid), &pw, buf.data(), buf.size(), &found);
    }
  }
  if (err != 0 || found == nullptr) {
    return InvalidArgumentError(fmt::format(
        "{} {}: no such user{} (HINT: useradd --system --no-create-home nonstop-worker, then "
        "{} nonstop-worker)",
        setting, name_or_uid, err != 0 ? std::string(": ") + std::strerror(err) : "", setting));
  }
  if (pw.pw_uid == 0) {
    return FailedPreconditionError(
        fmt::format("{} {}: that is root, who can read every file: name an ordinary user", setting,
                    name_or_uid));
  }
  RunAs r{pw.pw_uid, pw.pw_gid, {}, pw.pw_name, pw.pw_dir != nullptr ? pw.pw_dir : "/"};
  int n = 64;
  r.groups.resize(static_cast<size_t>(n));
  if (::getgrouplist(pw.pw_name, pw.pw_gid, r.groups.data(), &n) < 0) {
    r.groups.resize(static_cast<size_t>(n));
    (void)::getgrouplist(pw.pw_name, pw.pw_gid, r.groups.data(), &n);
  }
  r.groups.resize(static_cast<size_t>(std::max(n, 0)));
  // The list holds its primary group too.
  if (r.gid == 0 || std::find(r.groups.begin(), r.groups.end(), gid_t{0}) != r.groups.end()) {
    return FailedPreconditionError(fmt::format(
        "{} {}: it is in root's group (gid 0), which may read root's files: name a user outside it",
        setting, name_or_uid));
  }
  return r;
}

void AddTorchrunHostVariables(std::map<std::string, std::string>* env) {
  namespace s = settings;
  const char* port = std::getenv(s::kMasterPort.env.data());  // a NUL-terminated literal
  if (auto job = env->find(std::string(s::kMasterPort.env)); job != env->end()) {
    (*env)["MASTER_PORT"] = job->second;
  } else {
    (*env)["MASTER_PORT"] =
        port != nullptr && *port != '\0' ? port : std::to_string(s::kMasterPort.default_value);
  }
  if (std::getenv("OMP_NUM_THREADS") == nullptr) (*env)["OMP_NUM_THREADS"] = "1";
}

LocalLauncher::LocalLauncher(net::EventLoop* loop, PrefixFn prefix, ExitFn on_exit, StopFn on_stop,
                             OutputWriter* out, OutputWriter* err)
    : loop_(loop),
      prefix_(std::move(prefix)),
      on_exit_(std::move(on_exit)),
      on_stop_(std::move(on_stop)) {
  if (out == nullptr) own_out_ = std::make_unique<OutputWriter>(STDOUT_FILENO);
  if (err == nullptr) own_err_ = std::make_unique<OutputWriter>(STDERR_FILENO);
  out_ = out != nullptr ? out : own_out_.get();
  err_ = err != nullptr ? err : own_err_.get();
}

LocalLauncher::~LocalLauncher() {
  for (auto& [id, c] : children_) {
    if (!c->exited) {
      ::kill(c->pid, SIGKILL);
      ::waitpid(c->pid, nullptr, 0);
    }
    loop_->Unwatch(c->pidfd.get());
    loop_->Unwatch(c->out.get());
    loop_->Unwatch(c->err.get());
    if (c->lifeline) c->lifeline->RequestStop();  // all at once; joined below
  }
  children_.clear();  // joins the watchers before what their threads touch goes
  if (dying_wake_.valid()) loop_->Unwatch(dying_wake_.get());
}

Status LocalLauncher::EnableLifelines(DyingFn on_dying) {
  if (!dying_wake_.valid()) {
    dying_wake_.Reset(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
    if (!dying_wake_.valid()) return ErrnoStatus(StatusCode::kInternal, "eventfd", errno);
    loop_->Watch(dying_wake_.get(), POLLIN, [this](short) { OnDyingWake(); });
  }
  on_dying_ = std::move(on_dying);
  return OkStatus();
}

void LocalLauncher::OnDyingWake() {
  uint64_t v;
  while (::read(dying_wake_.get(), &v, sizeof(v)) == sizeof(v)) {  // the eventfd, reset
  }
  std::vector<uint64_t> serials;
  {
    std::lock_guard<std::mutex> lock(dying_mu_);
    serials.swap(dying_);
  }
  for (uint64_t serial : serials) {
    for (auto& [id, c] : children_) {
      // An exit already reported says more than "dying": nothing to add then.
      if (c->serial == serial && !c->exited && on_dying_) on_dying_(c->worker_id, c->pid);
    }
  }
}

Result<pid_t> LocalLauncher::Spawn(const ChildSpec& spec) {
  NONSTOP_CHECK(!spec.argv.empty());
  int out_pipe[2], err_pipe[2];
  if (!spec.log_file.empty()) {
    // Both streams straight into the worker's log: nothing for this process to read.
    // Never through a link, nor into a file of another user: the directory may be one a worker's
    // user can write (a link there would have this process append to any file it names).
    int fd =
        ::open(spec.log_file.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC | O_NOFOLLOW, 0644);
    if (fd < 0) return ErrnoStatus(StatusCode::kFailedPrecondition, "open " + spec.log_file, errno);
    struct stat st {};
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_uid != ::geteuid() ||
        st.st_nlink != 1) {
      ::close(fd);
      return FailedPreconditionError(
          fmt::format("worker log {} is not a regular file of this user with one link: refused "
                      "(HINT: remove it)",
                      spec.log_file));
    }
    out_pipe[0] = -1;
    out_pipe[1] = fd;
    err_pipe[0] = -1;
    err_pipe[1] = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (err_pipe[1] < 0) {
      ::close(fd);
      return ErrnoStatus(StatusCode::kInternal, "dup", errno);
    }
  } else {
    if (::pipe2(out_pipe, O_CLOEXEC) != 0) return ErrnoStatus(StatusCode::kInternal, "pipe", errno);
    if (::pipe2(err_pipe, O_CLOEXEC) != 0) return ErrnoStatus(StatusCode::kInternal, "pipe", errno);
  }
  // The token's memfd: close-on-exec here (no other child, started meanwhile by another thread,
  // inherits it), inherited by this child alone (cleared in it after the fork).
  UniqueFd token_fd;
  if (!spec.secret.empty()) {
    auto memfd = JobTokenMemfd(spec.secret);
    if (!memfd.ok()) {
      if (out_pipe[0] >= 0) ::close(out_pipe[0]);
      if (err_pipe[0] >= 0) ::close(err_pipe[0]);
      ::close(out_pipe[1]);
      ::close(err_pipe[1]);
      return memfd.status();
    }
    token_fd = std::move(*memfd);
  }
  const uint64_t serial = next_serial_++;
  std::unique_ptr<LifelineWatcher> lifeline;
  if (on_dying_) {
    // Its thread only queues and wakes the loop: the report is made on the loop's thread.
    auto made = LifelineWatcher::Create([this, serial] {
      {
        std::lock_guard<std::mutex> lock(dying_mu_);
        dying_.push_back(serial);
      }
      uint64_t one = 1;
      (void)!::write(dying_wake_.get(), &one, sizeof(one));
    });
    if (!made.ok()) {  // not fatal: its death is still seen through its pidfd
      NONSTOP_LOG_WARNING("worker {}: no lifeline: {}", spec.worker_id, made.status().ToString());
    } else {
      lifeline = std::move(*made);
    }
  }
  // Build argv and env before fork: the child only execs.
  std::vector<std::string> env_strings;
  // The spec's variables replace inherited ones of the same name (getenv
  // returns the first match: an inherited NONSTOP_WORKER_ID must not win).
  std::set<std::string> overridden(spec.unset.begin(), spec.unset.end());
  for (const auto& [k, v] : spec.env) overridden.insert(k);
  if (spec.run_as) {
    for (const char* name : {"HOME", "USER", "LOGNAME"}) overridden.insert(name);
  }
  // Never the token itself in a child's environment; the descriptor's number only if passed.
  overridden.insert(std::string(settings::kJobToken.env));
  overridden.insert(std::string(settings::kJobTokenFd.env));
  overridden.insert(std::string(settings::kLifelineFd.env));
  for (char** e = environ; *e != nullptr; ++e) {
    std::string_view kv(*e);
    if (!overridden.count(std::string(kv.substr(0, kv.find('='))))) env_strings.emplace_back(kv);
  }
  for (const auto& [k, v] : spec.env) {
    if (spec.run_as && (k == "HOME" || k == "USER" || k == "LOGNAME")) continue;  // the user's
    if (k != settings::kJobToken.env && k != settings::kJobTokenFd.env &&
        k != settings::kLifelineFd.env)  // only the launcher's own lifeline
      env_strings.push_back(k + "=" + v);
  }
  if (token_fd.valid())
    env_strings.push_back(fmt::format("{}={}", settings::kJobTokenFd.env, token_fd.get()));
  if (spec.run_as) {
    env_strings.push_back("HOME=" + spec.run_as->home);
    env_strings.push_back("USER=" + spec.run_as->name);
    env_strings.push_back("LOGNAME=" + spec.run_as->name);
  }
  if (lifeline)
    env_strings.push_back(fmt::format("{}={}", settings::kLifelineFd.env, lifeline->fd()));
  std::vector<char*> envp, argv;
  for (auto& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::vector<std::string> args = spec.argv;
  for (auto& s : args) argv.push_back(s.data());
  argv.push_back(nullptr);
  pid_t parent = ::getpid();

  pid_t pid = ::fork();
  if (pid < 0) return ErrnoStatus(StatusCode::kInternal, "fork", errno);
  if (pid == 0) {
    sigset_t none;
    sigemptyset(&none);
    // before unblocking: one pending must not kill it
    for (int sig : spec.ignore_signals) ::signal(sig, SIG_IGN);
    // the launcher blocks signals it reads from a signalfd
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    if (spec.run_as) {
      // Groups, then the group, then the user (after which none of them can be changed back);
      // before PR_SET_PDEATHSIG, which a change of user clears.
      const RunAs& u = *spec.run_as;
      if (::setgroups(u.groups.size(), u.groups.data()) != 0 || ::setgid(u.gid) != 0 ||
          ::setuid(u.uid) != 0) {
        WriteAll(STDERR_FILENO, fmt::format("nonstop: cannot become user {} to start {}: {}\n",
                                            u.name, argv[0], std::strerror(errno)));
        _exit(127);
      }
    }
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (spec.nice != 0) (void)::setpriority(PRIO_PROCESS, 0, spec.nice);
    if (::getppid() != parent) _exit(127);  // the launcher died before prctl
    ::dup2(out_pipe[1], STDOUT_FILENO);
    ::dup2(err_pipe[1], STDERR_FILENO);
    if (token_fd.valid()) ::fcntl(token_fd.get(), F_SETFD, 0);  // this child inherits it
    if (lifeline) ::fcntl(lifeline->fd(), F_SETFD, 0);
    ::execvpe(argv[0], argv.data(), envp.data());
    std::string msg = fmt::format("nonstop: cannot start {}: {}\n", argv[0], std::strerror(errno));
    WriteAll(STDERR_FILENO, msg);
    _exit(127);
  }
  ::close(out_pipe[1]);
  ::close(err_pipe[1]);
  auto c = std::make_unique<Child>();
  c->worker_id = spec.worker_id;
  c->pid = pid;
  c->serial = serial;
  if (lifeline) lifeline->CloseFd();  // the child has its own; the mapping stays
  c->lifeline = std::move(lifeline);
  c->pidfd.Reset(PidfdOpen(pid));
  if (out_pipe[0] >= 0) c->out.Reset(out_pipe[0]);
  if (err_pipe[0] >= 0) c->err.Reset(err_pipe[0]);
  if (!c->pidfd.valid()) {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, nullptr, 0);
    return ErrnoStatus(StatusCode::kInternal, "pidfd_open (Linux 5.3 or newer is required)", errno);
  }
  Child* raw = c.get();
  if (raw->out.valid())
    loop_->Watch(raw->out.get(), POLLIN, [this, raw](short) { OnOutput(*raw, false); });
  if (raw->err.valid())
    loop_->Watch(raw->err.get(), POLLIN, [this, raw](short) { OnOutput(*raw, true); });
  loop_->Watch(raw->pidfd.get(), POLLIN, [this, raw](short) { OnExit(*raw); });
  children_[spec.worker_id] = std::move(c);
  return pid;
}

void LocalLauncher::Emit(Child& c, bool is_err, std::string_view text, bool flush) {
  std::string& partial = is_err ? c.err_partial : c.out_partial;
  partial.append(text);
  std::string out;
  size_t start = 0;
  std::string prefix = prefix_(c.worker_id);
  while (true) {
    size_t nl = partial.find('\n', start);
    if (nl == std::string::npos) break;
    out += prefix;
    out.append(partial, start, nl - start + 1);
    start = nl + 1;
  }
  partial.erase(0, start);
  if (flush && !partial.empty()) {
    out += prefix + partial + "\n";
    partial.clear();
  }
  if (!out.empty()) (is_err ? err_ : out_)->Write(out);
}

void LocalLauncher::OnOutput(Child& c, bool is_err) {
  int fd = is_err ? c.err.get() : c.out.get();
  char buf[8192];
  ssize_t n = ::read(fd, buf, sizeof(buf));
  if (n > 0) {
    Emit(c, is_err, std::string_view(buf, static_cast<size_t>(n)), false);
    return;
  }
  if (n < 0 && (errno == EINTR || errno == EAGAIN)) return;
  Emit(c, is_err, {}, true);
  loop_->Unwatch(fd);
}

void LocalLauncher::OnExit(Child& c) {
  int status = 0;
  pid_t r = ::waitpid(c.pid, &status, WNOHANG);
  if (r == 0) return;
  loop_->Unwatch(c.pidfd.get());
  // Its lifeline's watcher has returned already (the kernel released the mutex before the pidfd
  // became readable) or returns at once (the mutex is free): joining it does not hold up the
  // loop. Once joined, a death it saw is queued: reported now, before the exit, whichever of the
  // two wakeups the loop saw first.
  if (c.lifeline) {
    c.lifeline.reset();
    OnDyingWake();
  }
  c.exited = true;
  // Drain what the child wrote before it died.
  for (bool is_err : {false, true}) {
    int fd = is_err ? c.err.get() : c.out.get();
    if (!loop_->watching(fd)) continue;
    ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
    char buf[8192];
    ssize_t n;
    while ((n = ::read(fd, buf, sizeof(buf))) > 0)
      Emit(c, is_err, std::string_view(buf, static_cast<size_t>(n)), false);
    Emit(c, is_err, {}, true);
    loop_->Unwatch(fd);
  }
  // Its descriptors go now: a long job starts many processes.
  c.pidfd.Reset();
  c.out.Reset();
  c.err.Reset();
  int code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  int sig = WIFSIGNALED(status) ? WTERMSIG(status) : 0;
  on_exit_(c.worker_id, c.pid, code, sig);
}

void LocalLauncher::PollStopped() {
  for (auto& [id, c] : children_) {
    if (c->exited) continue;
    siginfo_t info{};
    // WSTOPPED | WCONTINUED without WEXITED: never reaps (exits go through the pidfd).
    if (::waitid(P_PID, static_cast<id_t>(c->pid), &info, WSTOPPED | WCONTINUED | WNOHANG) != 0)
      continue;
    if (info.si_pid == 0) continue;
    if (info.si_code == CLD_STOPPED && !c->stopped) {
      c->stopped = true;
      if (on_stop_) on_stop_(c->worker_id, c->pid, info.si_status);
    } else if (info.si_code == CLD_CONTINUED) {
      c->stopped = false;
    }
  }
}

void LocalLauncher::Signal(int worker_id, int sig) {
  auto it = children_.find(worker_id);
  if (it != children_.end() && !it->second->exited) ::kill(it->second->pid, sig);
}

Status LocalLauncher::Renice(int worker_id, int nice) {
  auto it = children_.find(worker_id);
  if (it == children_.end() || it->second->exited)
    return NotFoundError(fmt::format("no running worker {}", worker_id));
  // Every thread of the process: LibTorch and the session run several.
  std::error_code ec;
  for (const auto& e :
       std::filesystem::directory_iterator(fmt::format("/proc/{}/task", it->second->pid), ec)) {
    int tid = std::atoi(e.path().filename().c_str());
    if (::setpriority(PRIO_PROCESS, static_cast<id_t>(tid), nice) != 0) {
      return ErrnoStatus(StatusCode::kFailedPrecondition,
                         fmt::format("setpriority(worker {}, {})", worker_id, nice), errno);
    }
  }
  return OkStatus();
}

bool LocalLauncher::CanRestorePriority() {
  // RLIMIT_NICE lets an unprivileged process go down to nice 20 - rlim_cur.
  rlimit rl{};
  if (::getrlimit(RLIMIT_NICE, &rl) == 0 && (rl.rlim_cur == RLIM_INFINITY || rl.rlim_cur >= 20))
    return true;
  // CAP_SYS_NICE (bit 23) in the effective set; root has it unless dropped.
  std::FILE* f = std::fopen("/proc/self/status", "r");
  if (f == nullptr) return false;
  char line[256];
  bool can = false;
  while (std::fgets(line, sizeof(line), f) != nullptr) {
    unsigned long long caps = 0;
    if (std::sscanf(line, "CapEff: %llx", &caps) == 1) {
      can = (caps >> 23) & 1ULL;
      break;
    }
  }
  std::fclose(f);
  return can;
}

void LocalLauncher::SignalAll(int sig) {
  for (auto& [id, c] : children_) {
    if (!c->exited) ::kill(c->pid, sig);
  }
}

int LocalLauncher::running() const {
  int n = 0;
  for (const auto& [id, c] : children_) n += c->exited ? 0 : 1;
  return n;
}

pid_t LocalLauncher::pid(int worker_id) const {
  auto it = children_.find(worker_id);
  return it == children_.end() ? -1 : it->second->pid;
}

}  // namespace nonstop::launcher
