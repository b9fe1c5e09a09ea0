// AbortSignal: a level-triggered flag that every blocking wait in nonstop
// polls together with its socket. Fire() from any thread wakes every waiter
// within microseconds (it is an eventfd in every poll set); the flag stays set
// until Reset(), which only the owner calls between generations.
//
// Thread-safety: Fire(), fired() and fd() are safe from any thread.
#pragma once

#include <atomic>

#include "common/unique_fd.h"

namespace nonstop::net {

class AbortSignal {
 public:
  AbortSignal();
  AbortSignal(const AbortSignal&) = delete;
  AbortSignal& operator=(const AbortSignal&) = delete;

  void Fire();
  void Reset();
  bool fired() const { return fired_.load(std::memory_order_acquire); }
  int fd() const { return fd_.get(); }

 private:
  UniqueFd fd_;
  std::atomic<bool> fired_{false};
};

}  // namespace nonstop::net
