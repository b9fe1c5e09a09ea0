// The lifeline: a worker's death seen as it begins, before the kernel frees
// the dying process's memory (docs/recovery.md "Detection and abort,
// measured").
//
// When a process is killed, the kernel tears down its memory (milliseconds for
// a large worker: ~10 ms for 210 MB, ~47 ms for 1 GB) before it closes the
// process's sockets and before its pidfd becomes readable, so neither can
// report the death sooner. But each exiting thread's robust futex list is
// processed first (exit_mm → mm_release → exit_robust_list, before the memory
// goes): a process-shared robust mutex the thread holds is marked owner-dead
// and its waiter is woken, with EOWNERDEAD.
//
// So a launcher creates, per worker, a small shared memfd holding such a
// mutex (LifelineWatcher) and passes it in NONSTOP_LIFELINE_FD; the worker
// maps it and locks it (LifelineHold) on a thread that lives as long as the
// process (Session::Join's caller, the training thread); a watcher thread in
// the launcher waits for it and reports EOWNERDEAD as "dying now". A clean end
// (Release, MarkReleased) says so in the shared state first, so nothing fires.
//
// The robust list is per THREAD: if the thread that locked ends while its
// process lives on, the kernel releases the mutex then, and the launcher
// would report a death that is not one. Only a thread that lives as long as
// the process may hold the lifeline.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "common/unique_fd.h"
#include "nonstop/status.h"

namespace nonstop {

struct LifelineShared;  // the memfd's contents (lifeline.cc)

// The launcher's side: owns the shared mapping and a thread that waits on the
// mutex. `on_dying` runs on that thread, at most once, when the holder died
// holding it; never after a clean release, nor for a worker that never locked.
class LifelineWatcher {
 public:
  using DyingFn = std::function<void()>;
  // A fresh lifeline and its watcher thread (which waits for the holder to take it).
  static Result<std::unique_ptr<LifelineWatcher>> Create(DyingFn on_dying);
  ~LifelineWatcher();  // stops and joins the thread (at once, or within a 50 ms wait slice)
  LifelineWatcher(const LifelineWatcher&) = delete;
  LifelineWatcher& operator=(const LifelineWatcher&) = delete;

  // The memfd to pass to the child: close-on-exec (the launcher clears the flag
  // in the child it starts). The mapping stays after CloseFd().
  int fd() const { return fd_.get(); }
  void CloseFd() { fd_.Reset(); }
  // Asks the thread to stop (the destructor waits for it); for stopping many at once.
  void RequestStop();
  bool fired() const { return fired_.load(); }

 private:
  LifelineWatcher(UniqueFd fd, LifelineShared* shared, DyingFn on_dying);
  void Watch();
  bool SleepUnlessStopped(int ms);

  UniqueFd fd_;
  LifelineShared* const shared_;  // mapped; unmapped after the thread is joined
  DyingFn on_dying_;
  std::atomic<bool> fired_{false};
  std::mutex stop_mu_;
  std::condition_variable stop_cv_;
  bool stop_ = false;  // under stop_mu_
  std::thread thread_;
};

// The worker's side: the lifeline taken and held by the thread that took it.
class LifelineHold {
 public:
  // Takes the lifeline this process was started with (NONSTOP_LIFELINE_FD),
  // once per process: maps it, closes the descriptor, removes the variable and
  // locks the mutex ON THE CALLING THREAD, which must live as long as the
  // process. nullptr without the variable (a worker started by hand, a test);
  // an error when it does not name a lifeline.
  static Result<std::unique_ptr<LifelineHold>> TakeInherited();
  // Maps and locks the lifeline `fd` names (the descriptor stays open).
  static Result<std::unique_ptr<LifelineHold>> Take(int fd);
  ~LifelineHold();  // Release()
  LifelineHold(const LifelineHold&) = delete;
  LifelineHold& operator=(const LifelineHold&) = delete;

  // A clean end: nothing fires. On the holding thread it also unlocks and
  // unmaps; from any other thread it only marks the lifeline released
  // (atomic; the mutex cannot be unlocked by another thread, and the mapping
  // stays: the holder's robust list still points into it).
  void Release();
  // Marks it released from any thread (the process is told to end): its exit is expected.
  void MarkReleased();

 private:
  LifelineHold(LifelineShared* shared, pid_t holder);
  LifelineShared* const shared_;
  const pid_t holder_;     // the thread that locked
  std::mutex mu_;          // Release (unmaps) against MarkReleased from another thread
  bool unmapped_ = false;  // under mu_
};

}  // namespace nonstop
