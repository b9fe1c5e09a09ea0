// Mutex, MutexLock and CondVar: the project's locking primitives, the
// standard ones wrapped so that clang's thread-safety analysis can see them
// (https://clang.llvm.org/docs/ThreadSafetyAnalysis.html). The idea is
// leveldb's port::Mutex and abseil's annotated Mutex.
//
// std::mutex carries no attributes, so the analysis cannot tell which data a
// mutex protects. With these types it can: a field declared
//   Status error_ NONSTOP_GUARDED_BY(mu_);
// may only be read or written where the compiler sees mu_ held, and a method
// declared NONSTOP_EXCLUSIVE_LOCKS_REQUIRED(mu_) (by convention named
// *Locked) may only be called there. Clang builds make a violation an error
// (cmake/NonstopHelpers.cmake); GCC ignores the macros, and each type costs
// what the standard one it wraps costs.
//
// The analysis is local to a function, and a lambda is a function of its own:
// a lambda that reads guarded fields while its caller holds the lock (a
// CondVar predicate) says so with NONSTOP_EXCLUSIVE_LOCKS_REQUIRED(mu_) after
// its parameter list. A field the analysis cannot follow (written under the
// lock by one thread, read by that same thread without it) stays unannotated,
// with a comment saying why.
//
// Thread-safety: Mutex and CondVar are shared between threads; a MutexLock
// belongs to the thread that made it.
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <stop_token>
#include <utility>

// The attributes, only where the compiler knows them.
#if defined(__clang__)
#define NONSTOP_THREAD_ANNOTATION_(x) __attribute__((x))
#else
#define NONSTOP_THREAD_ANNOTATION_(x)
#endif

// On a class: its objects are locks (Mutex).
#define NONSTOP_CAPABILITY(name) NONSTOP_THREAD_ANNOTATION_(capability(name))
// On a class: an object holds a lock from its construction to its destruction (MutexLock).
#define NONSTOP_SCOPED_CAPABILITY NONSTOP_THREAD_ANNOTATION_(scoped_lockable)
// On a field: only touched with the lock held.
#define NONSTOP_GUARDED_BY(x) NONSTOP_THREAD_ANNOTATION_(guarded_by(x))
// On a pointer field: what it points to is only touched with the lock held.
#define NONSTOP_PT_GUARDED_BY(x) NONSTOP_THREAD_ANNOTATION_(pt_guarded_by(x))
// On a lock: the order in which two locks are taken.
#define NONSTOP_ACQUIRED_BEFORE(...) NONSTOP_THREAD_ANNOTATION_(acquired_before(__VA_ARGS__))
#define NONSTOP_ACQUIRED_AFTER(...) NONSTOP_THREAD_ANNOTATION_(acquired_after(__VA_ARGS__))
// On a function: the caller holds the lock(s) (the *Locked methods).
#define NONSTOP_EXCLUSIVE_LOCKS_REQUIRED(...) \
  NONSTOP_THREAD_ANNOTATION_(requires_capability(__VA_ARGS__))
#define NONSTOP_REQUIRES(...) NONSTOP_EXCLUSIVE_LOCKS_REQUIRED(__VA_ARGS__)
// On a function: the caller does not hold the lock(s): the function takes them.
#define NONSTOP_LOCKS_EXCLUDED(...) NONSTOP_THREAD_ANNOTATION_(locks_excluded(__VA_ARGS__))
// On a function: it takes, or gives back, the lock(s) (this object, when none is named).
#define NONSTOP_ACQUIRE(...) NONSTOP_THREAD_ANNOTATION_(acquire_capability(__VA_ARGS__))
#define NONSTOP_RELEASE(...) NONSTOP_THREAD_ANNOTATION_(release_capability(__VA_ARGS__))
#define NONSTOP_TRY_ACQUIRE(...) NONSTOP_THREAD_ANNOTATION_(try_acquire_capability(__VA_ARGS__))
// On a function: returns only if the lock is held; from then on the analysis assumes it.
#define NONSTOP_ASSERT_CAPABILITY(x) NONSTOP_THREAD_ANNOTATION_(assert_capability(x))
// On a function: it returns a reference to the lock named.
#define NONSTOP_RETURN_CAPABILITY(x) NONSTOP_THREAD_ANNOTATION_(lock_returned(x))
// On a function: not analysed. For the primitives below, not for the code that uses them.
#define NONSTOP_NO_THREAD_SAFETY_ANALYSIS NONSTOP_THREAD_ANNOTATION_(no_thread_safety_analysis)

namespace nonstop {

// A std::mutex the analysis knows. Also BasicLockable (lock/unlock), so that
// std::condition_variable_any can release and retake it.
class NONSTOP_CAPABILITY("mutex") Mutex {
 public:
  constexpr Mutex() noexcept = default;  // constant-initialised: safe as a namespace-scope global
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void Lock() NONSTOP_ACQUIRE() { mu_.lock(); }
  void Unlock() NONSTOP_RELEASE() { mu_.unlock(); }
  bool TryLock() NONSTOP_TRY_ACQUIRE(true) { return mu_.try_lock(); }

  void lock() NONSTOP_ACQUIRE() { mu_.lock(); }
  void unlock() NONSTOP_RELEASE() { mu_.unlock(); }

 private:
  std::mutex mu_;
};

// Holds a Mutex for its scope. Unlock() and Lock() let a stretch in the
// middle run unlocked (a callback, a write to a socket); the destructor
// unlocks only if the lock is held then.
class NONSTOP_SCOPED_CAPABILITY MutexLock {
 public:
  explicit MutexLock(Mutex* mu) NONSTOP_ACQUIRE(mu) : mu_(mu) { mu_->Lock(); }
  ~MutexLock() NONSTOP_RELEASE() {
    if (held_) mu_->Unlock();
  }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

  void Unlock() NONSTOP_RELEASE() {
    held_ = false;
    mu_->Unlock();
  }
  void Lock() NONSTOP_ACQUIRE() {
    mu_->Lock();
    held_ = true;
  }

 private:
  Mutex* const mu_;
  bool held_ = true;
};

// A condition variable over Mutex. Every wait names the mutex, which the
// caller holds (checked by the analysis); it is released while waiting and
// held again on return. Waits take a predicate, so that a spurious or stolen
// wake-up goes back to sleep, and, where a peer or the network is what is
// awaited, a deadline (docs/architecture.md "Code style").
class CondVar {
 public:
  CondVar() = default;
  CondVar(const CondVar&) = delete;
  CondVar& operator=(const CondVar&) = delete;

  void NotifyOne() noexcept { cv_.notify_one(); }
  void NotifyAll() noexcept { cv_.notify_all(); }

  // Until pred() or the deadline; returns pred() (false: timed out).
  template <typename Clock, typename Duration, typename Pred>
  bool WaitUntil(Mutex* mu, const std::chrono::time_point<Clock, Duration>& deadline, Pred pred)
      NONSTOP_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    return cv_.wait_until(*mu, deadline, std::move(pred));
  }
  // Until pred() or `timeout` from now; returns pred().
  template <typename Rep, typename Period, typename Pred>
  bool WaitFor(Mutex* mu, const std::chrono::duration<Rep, Period>& timeout, Pred pred)
      NONSTOP_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    return cv_.wait_for(*mu, timeout, std::move(pred));
  }
  // One wake-up or the deadline, for a caller that loops on its own condition.
  template <typename Clock, typename Duration>
  std::cv_status WaitUntil(Mutex* mu, const std::chrono::time_point<Clock, Duration>& deadline)
      NONSTOP_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    return cv_.wait_until(*mu, deadline);
  }

  // Without a deadline: only where another thread of this process is bound to
  // end the wait (a consumer woken at shutdown; the I/O thread that gives up
  // on a lost controller and says so). A wait on the network itself has one.
  template <typename Pred>
  void Wait(Mutex* mu, Pred pred) NONSTOP_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    cv_.wait(*mu, std::move(pred));
  }
  // Until pred() or a stop request; returns pred().
  template <typename Pred>
  bool Wait(Mutex* mu, std::stop_token stop, Pred pred) NONSTOP_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    return cv_.wait(*mu, std::move(stop), std::move(pred));
  }

 private:
  std::condition_variable_any cv_;
};

}  // namespace nonstop
