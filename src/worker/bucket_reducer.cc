#include "worker/bucket_reducer.h"

namespace nonstop::worker {

void BucketReducer::Start(std::span<float> data, std::function<void(const Status&)> done,
                          bool on_device) {
  MutexLock lock(&mu_);
  if (!thread_.joinable()) thread_ = std::jthread([this](std::stop_token st) { Loop(st); });
  buckets_.push_back({data, std::move(done), on_device});
  cv_.NotifyAll();
}

void BucketReducer::Loop(std::stop_token st) {
  MutexLock lock(&mu_);
  while (true) {
    auto started = [&]() NONSTOP_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !buckets_.empty(); };
    cv_.Wait(&mu_, st, started);
    if (st.stop_requested()) return;
    std::span<float> bucket = buckets_.front().data;
    const bool on_device = buckets_.front().on_device;
    std::function<void(const Status&)> done = std::move(buckets_.front().done);
    const bool skip = !status_.ok();
    const bool first = first_;
    first_ = false;
    lock.Unlock();
    Status s = skip ? OkStatus() : reduce_(bucket, on_device, first);
    lock.Lock();
    if (!s.ok() && status_.ok()) status_ = s;
    if (done) {
      // Before the bucket leaves the queue (WaitAll returns only after every `done`), and without
      // the lock: `done` may take a lock of its own (Python's GIL).
      Status so_far = status_;
      lock.Unlock();
      done(so_far);
      done = nullptr;  // what it holds is let go without the lock too
      lock.Lock();
    }
    buckets_.pop_front();
    cv_.NotifyAll();
  }
}

Status BucketReducer::WaitAll() {
  MutexLock lock(&mu_);
  cv_.Wait(&mu_, [&]() NONSTOP_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return buckets_.empty(); });
  Status s = status_;
  status_ = OkStatus();
  first_ = true;
  return s;
}

void BucketReducer::Stop() {
  if (!thread_.joinable()) return;
  thread_.request_stop();
  thread_.join();
}

}  // namespace nonstop::worker
