// Retrying etcd's transient failures (docs/controller-failover.md, "etcd
// trouble"): one back-off policy, one log line per outage.
//
//   etcd::Backoff backoff(Millis(100), Millis(1'000));
//   etcd::OutageLog outage("reading the journal from etcd at 10.0.0.1:2379");
//   auto kvs = etcd::RetryTransient([&] { return client.Prefix(p); }, backoff, outage, [&] { return
//   lost(); });
//
// Which failures are transient is the client's classification
// (etcd::IsTransient, src/coord/etcd.h): the rest end the retries at once.
//
// Thread-safety: a Backoff and an OutageLog belong to one thread (each
// activity that calls etcd keeps its own).
#pragma once

#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <utility>

#include "common/time.h"
#include "coord/etcd.h"
#include "nonstop/status.h"

namespace nonstop::etcd {

// Exponential back-off with full jitter (the AWS Architecture Blog's
// "Exponential Backoff And Jitter"; etcd's clientv3 and client-go back off
// alike): the n-th wait in a row is uniform in [0, min(max, initial·2^(n−1))].
// Full jitter spreads the retries of many clients that failed together (a
// standby and every controller's threads when etcd comes back).
class Backoff {
 public:
  // random: uniform in [0, 1) (a test seam); empty: a generator seeded from std::random_device.
  Backoff(Millis initial, Millis max, std::function<double()> random = {});
  Backoff(const Backoff&) = delete;  // its default generator is its own
  Backoff& operator=(const Backoff&) = delete;

  Millis Next();                   // the wait after one more failure
  void Reset() { failures_ = 0; }  // after a success
  int failures() const { return failures_; }
  // The cap of the next wait: min(max, initial·2^failures).
  Millis Ceiling() const;

 private:
  Millis initial_;
  Millis max_;
  int failures_ = 0;
  std::function<double()> random_;
  std::mt19937_64 generator_;
};

// One line when an activity's calls to etcd start failing ("etcd … does not
// answer …: <what goes on meanwhile>"), one when they succeed again, with
// the outage's length: never one per retry.
class OutageLog {
 public:
  // what: the activity, as the lines name it ("the campaign for job 'j'").
  // meanwhile: what happens until etcd answers ("standing by; retrying with back-off").
  OutageLog(std::string what, std::string meanwhile);
  void Failed(const Status& s);
  void Succeeded();
  bool in_outage() const { return since_ >= 0; }
  int64_t failures() const { return failures_; }

 private:
  std::string what_;
  std::string meanwhile_;
  double since_ = -1;  // MonotonicSeconds() of the outage's first failure; < 0: none
  int64_t failures_ = 0;
};

// Sleeps `d`, in slices of at most 50 ms, unless `stop()` turns true first (returns false then).
bool SleepUnless(Millis d, const std::function<bool()>& stop);

inline const Status& StatusOf(const Status& s) { return s; }
template <typename T>
const Status& StatusOf(const Result<T>& r) {
  return r.status();
}

// Calls `call` until it succeeds, fails for good (!IsTransient), or
// `give_up()` is true after a transient failure (then that failure is
// returned). Waits backoff.Next() between tries; the outage is logged once.
template <typename Call>
auto RetryTransient(Call&& call, Backoff& backoff, OutageLog& outage,
                    const std::function<bool()>& give_up) -> decltype(call()) {
  while (true) {
    auto r = call();
    if (r.ok()) {
      outage.Succeeded();
      backoff.Reset();
      return r;
    }
    if (!IsTransient(StatusOf(r))) return r;
    outage.Failed(StatusOf(r));
    if (give_up() || !SleepUnless(backoff.Next(), give_up)) return r;
  }
}

}  // namespace nonstop::etcd
