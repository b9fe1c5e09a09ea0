#include "common/lifeline.h"

#include <fcntl.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <string>

#include <fmt/format.h>

#include "common/logging.h"
#include "nonstop/settings.h"

namespace nonstop {

namespace {

constexpr uint64_t kMagic = 0x6e6f6e73746f704cULL;  // "nonstopL"
constexpr int32_t kUnheld = 0;                      // the worker has not locked it (yet)
constexpr int32_t kHeld = 1;                        // locked by the worker's long-lived thread
constexpr int32_t kReleased = 2;                    // a clean end: nothing must fire
// How long one wait on the mutex lasts before the stop flag is looked at: the
// longest a watcher's destructor waits.
constexpr long kWaitSliceNs = 50'000'000;

pid_t Gettid() { return static_cast<pid_t>(::syscall(SYS_gettid)); }

}  // namespace

struct LifelineShared {
  uint64_t magic;
  std::atomic<int32_t> state;
  pthread_mutex_t mutex;
};
static_assert(std::atomic<int32_t>::is_always_lock_free, "the state is shared between processes");

// ------------------------------------------------------------------ watcher

Result<std::unique_ptr<LifelineWatcher>> LifelineWatcher::Create(DyingFn on_dying) {
  UniqueFd fd(static_cast<int>(::syscall(SYS_memfd_create, "nonstop-lifeline", MFD_CLOEXEC)));
  if (!fd.valid()) return ErrnoStatus(StatusCode::kInternal, "memfd_create (lifeline)", errno);
  if (fd.get() < 3) {  // never a standard stream's number in the child
    UniqueFd moved(::fcntl(fd.get(), F_DUPFD_CLOEXEC, 3));
    if (!moved.valid()) return ErrnoStatus(StatusCode::kInternal, "dup (lifeline)", errno);
    fd = std::move(moved);
  }
  if (::ftruncate(fd.get(), sizeof(LifelineShared)) != 0)
    return ErrnoStatus(StatusCode::kInternal, "ftruncate (lifeline)", errno);
  void* p =
      ::mmap(nullptr, sizeof(LifelineShared), PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
  if (p == MAP_FAILED) return ErrnoStatus(StatusCode::kInternal, "mmap (lifeline)", errno);
  auto* shared = new (p) LifelineShared{};
  shared->state.store(kUnheld);
  pthread_mutexattr_t attr;
  pthread_mutexattr_init(&attr);
  pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
  pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST);
  int rc = pthread_mutex_init(&shared->mutex, &attr);
  pthread_mutexattr_destroy(&attr);
  if (rc != 0) {
    ::munmap(p, sizeof(LifelineShared));
    return ErrnoStatus(StatusCode::kInternal, "pthread_mutex_init (lifeline)", rc);
  }
  shared->magic = kMagic;
  return std::unique_ptr<LifelineWatcher>(
      new LifelineWatcher(std::move(fd), shared, std::move(on_dying)));
}

LifelineWatcher::LifelineWatcher(UniqueFd fd, LifelineShared* shared, DyingFn on_dying)
    : fd_(std::move(fd)), shared_(shared), on_dying_(std::move(on_dying)) {
  thread_ = std::thread([this] { Watch(); });
}

LifelineWatcher::~LifelineWatcher() {
  RequestStop();
  thread_.join();
  // The mutex may still be locked by a live worker: the memory is only unmapped here (the
  // worker's own mapping and its robust list are its own).
  ::munmap(shared_, sizeof(LifelineShared));
}

void LifelineWatcher::RequestStop() {
  std::lock_guard<std::mutex> lock(stop_mu_);
  stop_ = true;
  stop_cv_.notify_all();
}

bool LifelineWatcher::SleepUnlessStopped(int ms) {
  std::unique_lock<std::mutex> lock(stop_mu_);
  stop_cv_.wait_for(lock, std::chrono::milliseconds(ms), [this] { return stop_; });
  return !stop_;
}

// Waits on the mutex in slices (the stop flag is looked at between them). Taking it means one of:
// the holder died holding it (EOWNERDEAD: report, unless it had released it), it released it
// (done), or nobody holds it yet: give it back and look again soon, backing off to kMaxIdleMs, so
// that a worker that never takes its lifeline costs a few wakeups a second. Asked to stop, it
// looks once more without waiting: a death the kernel has already marked is still reported (the
// launcher stops a watcher when it reaps the child, possibly before this thread woke up).
void LifelineWatcher::Watch() {
  constexpr int kMaxIdleMs = 50;
  int idle_ms = 2;
  while (true) {
    bool stopping;
    {
      std::lock_guard<std::mutex> lock(stop_mu_);
      stopping = stop_;
    }
    int rc;
    if (stopping) {
      rc = pthread_mutex_trylock(&shared_->mutex);
    } else {
      timespec deadline{};
      ::clock_gettime(CLOCK_REALTIME, &deadline);  // pthread_mutex_timedlock's clock
      deadline.tv_nsec += kWaitSliceNs;
      if (deadline.tv_nsec >= 1'000'000'000) {
        deadline.tv_sec += 1;
        deadline.tv_nsec -= 1'000'000'000;
      }
      rc = pthread_mutex_timedlock(&shared_->mutex, &deadline);
    }
    if (rc == ETIMEDOUT) continue;  // held: the worker lives
    if (rc == EBUSY) return;        // stopping while a live worker holds it
    if (rc == EOWNERDEAD) {
      // Not unlocked: no one takes it again (the worker is gone; the watcher stops here). And
      // TSan, which does not count a timedlock that returned EOWNERDEAD as an acquisition, would
      // call the unlock one of an unlocked mutex.
      const int32_t state = shared_->state.load();
      if (state == kHeld) {
        fired_.store(true);
        if (on_dying_) on_dying_();
      }
      return;
    }
    if (rc != 0) {  // ENOTRECOVERABLE, EINVAL: nothing more can be seen through it
      NONSTOP_LOG_WARNING(
          "lifeline: waiting on it failed ({}); the worker's death is seen through its pidfd",
          std::strerror(rc));
      return;
    }
    const int32_t state = shared_->state.load();
    pthread_mutex_unlock(&shared_->mutex);
    if (state == kReleased || stopping) return;  // a clean end, or nothing to see
    if (SleepUnlessStopped(idle_ms)) idle_ms = std::min(idle_ms * 2, kMaxIdleMs);
  }
}

// ------------------------------------------------------------------ holder

Result<std::unique_ptr<LifelineHold>> LifelineHold::TakeInherited() {
  const auto& setting = settings::kLifelineFd;
  static bool taken = false;  // one holder per process: the variable goes with the first
  if (taken) return std::unique_ptr<LifelineHold>();
  taken = true;
  const char* text = std::getenv(setting.env.data());
  if (text == nullptr || *text == '\0') return std::unique_ptr<LifelineHold>();
  const std::string name = text;
  ::unsetenv(setting.env.data());
  int fd = -1;
  try {
    size_t used = 0;
    fd = std::stoi(name, &used);
    if (used != name.size() || fd < 3) fd = -1;
  } catch (...) {
  }
  const std::string where = fmt::format("{}={}", setting.env, name);
  if (fd < 0) return InvalidArgumentError(where + ": not a file descriptor number (3 or above)");
  auto hold = Take(fd);
  if (!hold.ok()) {
    return Status(hold.status().code(),
                  fmt::format("{}: {} (HINT: unset it, or let the program between the launcher "
                              "and this one pass the descriptor on)",
                              where, hold.status().message()));
  }
  ::close(fd);  // mapped: no child of the worker inherits it
  return hold;
}

Result<std::unique_ptr<LifelineHold>> LifelineHold::Take(int fd) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return ErrnoStatus(StatusCode::kFailedPrecondition, "fstat", errno);
  if (!S_ISREG(st.st_mode) || st.st_size != static_cast<off_t>(sizeof(LifelineShared))) {
    return FailedPreconditionError(
        fmt::format("descriptor {} is not a lifeline a nonstop launcher made", fd));
  }
  void* p = ::mmap(nullptr, sizeof(LifelineShared), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return ErrnoStatus(StatusCode::kFailedPrecondition, "mmap", errno);
  auto* shared = static_cast<LifelineShared*>(p);
  if (shared->magic != kMagic) {
    ::munmap(p, sizeof(LifelineShared));
    return FailedPreconditionError(
        fmt::format("descriptor {} is not a lifeline a nonstop launcher made", fd));
  }
  // The watcher holds it only for an instant (looking whether it is held yet).
  int rc = pthread_mutex_lock(&shared->mutex);
  if (rc == EOWNERDEAD) rc = pthread_mutex_consistent(&shared->mutex);  // a watcher died in it
  if (rc != 0) {
    ::munmap(p, sizeof(LifelineShared));
    return ErrnoStatus(StatusCode::kFailedPrecondition, "pthread_mutex_lock (lifeline)", rc);
  }
  shared->state.store(kHeld);
  return std::unique_ptr<LifelineHold>(new LifelineHold(shared, Gettid()));
}

LifelineHold::LifelineHold(LifelineShared* shared, pid_t holder)
    : shared_(shared), holder_(holder) {}

LifelineHold::~LifelineHold() { Release(); }

void LifelineHold::MarkReleased() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!unmapped_) shared_->state.store(kReleased);
}

void LifelineHold::Release() {
  std::lock_guard<std::mutex> lock(mu_);
  if (unmapped_) return;
  shared_->state.store(kReleased);  // first: the watcher that takes the mutex next sees it
  if (Gettid() != holder_) return;  // only the holder may unlock a robust mutex
  pthread_mutex_unlock(&shared_->mutex);
  ::munmap(shared_, sizeof(LifelineShared));
  unmapped_ = true;
}

}  // namespace nonstop
