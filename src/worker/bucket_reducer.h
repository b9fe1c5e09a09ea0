// The overlapped reduction (Session::StartAllReduce, WaitAll): buckets started by the training
// thread are reduced in order, one at a time, by a communication thread of this class's own.
#pragma once

#include <deque>
#include <functional>
#include <span>
#include <thread>
#include <utility>

#include "common/mutex.h"
#include "nonstop/status.h"

namespace nonstop::worker {

class BucketReducer {
 public:
  // Reduces one bucket: `on_device`, the data is in the session's device memory; `first`, it is
  // its step's first (the one that announces the member's arrival). Called on the communication
  // thread only.
  using Reduce = std::function<Status(std::span<float> data, bool on_device, bool first)>;

  explicit BucketReducer(Reduce reduce) : reduce_(std::move(reduce)) {}
  ~BucketReducer() { Stop(); }
  BucketReducer(const BucketReducer&) = delete;
  BucketReducer& operator=(const BucketReducer&) = delete;

  // Queues `data` (the thread starts with the first bucket); `done`, if any, is called with the
  // step's first error so far once the bucket is reduced or skipped, without the lock.
  void Start(std::span<float> data, std::function<void(const Status&)> done, bool on_device)
      NONSTOP_LOCKS_EXCLUDED(mu_);
  // Waits until every started bucket is done; returns the first error since the last call.
  Status WaitAll() NONSTOP_LOCKS_EXCLUDED(mu_);
  // Stops the thread after the bucket in flight (abort the collective first to cut it short).
  void Stop();

 private:
  // The communication thread. After the first error the rest of the step's buckets are skipped:
  // the step is dropped whole, so there is nothing to gain from them.
  void Loop(std::stop_token st) NONSTOP_LOCKS_EXCLUDED(mu_);

  const Reduce reduce_;
  Mutex mu_;
  CondVar cv_;
  struct Bucket {
    std::span<float> data;
    std::function<void(const Status&)> done;  // may be empty
    bool on_device = false;
  };
  std::deque<Bucket> buckets_ NONSTOP_GUARDED_BY(mu_);  // started, not yet done (front: in flight)
  Status status_ NONSTOP_GUARDED_BY(mu_);               // the first error since the last WaitAll
  bool first_ NONSTOP_GUARDED_BY(mu_) = true;           // the next bucket is its step's first
  // Started by the first Start, joined by Stop; the thread that calls Start owns it.
  std::jthread thread_;
};

}  // namespace nonstop::worker
