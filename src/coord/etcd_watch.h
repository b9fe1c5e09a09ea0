// A watch of one key (or a range) of etcd through its JSON gateway
// (docs/leader-discovery.md): POST /v3/watch streams newline-delimited JSON,
// one message per batch of changes, over one connection that stays open. So
// a process learns of a change as it lands, with no request at all while
// nothing changes, instead of asking again and again (10 agents and workers
// a host, each asking every 100 ms during a failover, made a poll storm).
//
// What the owner sees is the range's contents, not the events: a Snapshot
// after the first read and after each batch of changes. That hides the
// watch's own troubles:
//  - etcd unreachable, restarted, or a stream that ends: opened again after
//    a back-off with full jitter (etcd::Backoff: many hosts that lost etcd
//    together do not come back together), at the next endpoint, from the
//    revision after the last one seen, so that no change is missed and none
//    is seen twice. One log line per outage (etcd::OutageLog).
//  - the revision to resume from was compacted away (etcd answers the watch
//    with compact_revision and cancels it): the range is read again (one
//    Range), and the snapshot that follows is whole again.
//  - a stream that answers at a revision below the last one seen, or from
//    another cluster (etcd restored from a snapshot, or replaced by a fresh
//    one): the range is read again, as after a compaction (else the watch
//    would wait, silent, for the old revision to come round again).
//  - a stream silent for idle_timeout (×[1, 1.5] at random, so that streams
//    that opened together do not reopen together) is opened again (from
//    where it was): a member that hangs without closing the connection
//    (paused) is left within that. The stream asks etcd for progress
//    notifications (every --experimental-watch-progress-notify-interval,
//    10 min by default): with an interval under idle_timeout a healthy idle
//    stream is never reopened. TCP keepalive on the stream's socket finds a
//    member whose host died or was partitioned away within about 30 s.
// Stop() ends the thread promptly: it shuts the stream's socket down (a Range
// or a connect in progress first ends, within request_timeout).
//
// Thread-safety: Start makes one thread, which calls on_change (never two
// calls at once). RequestStop(), Stop() and the counters may be called from
// any thread, on_change included (Stop() there only asks: the thread ends
// once on_change returns).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>

#include "common/mutex.h"
#include "common/time.h"
#include "coord/etcd.h"
#include "coord/retry.h"
#include "nonstop/status.h"

namespace httplib {
class Client;
}

namespace nonstop::etcd {

struct WatchOptions {
  std::string endpoints;  // host:port[,host:port…], as etcd::Client takes them
  Security security;      // TLS, the etcd user: as etcd::Client takes them
  std::string key;
  std::string range_end;          // empty: the key alone; PrefixEnd(key): every key under it
  Millis request_timeout{2'000};  // the Range; the stream's connect and its first answer
  // A stream that sends nothing this long (times 1 + idle_jitter·u, u uniform in [0, 1), drawn
  // per stream) is opened again: one request per watch per 120–180 s while nothing changes
  // (docs/leader-discovery.md weighs it).
  Millis idle_timeout{120'000};
  double idle_jitter = 0.5;
  // Back-off after a failure (full jitter: uniform in [0, min(max, initial·2^(n−1))]).
  Millis backoff_initial{100};
  Millis backoff_max{2'000};
  // The activity as the outage lines name it ("the watch of job 'j''s leader key").
  std::string what = "an etcd watch";
};

// What the watched range holds: key → its latest version.
using Snapshot = std::map<std::string, KeyValue>;

class Watch {
 public:
  // on_change(snapshot, revision): what the range holds as of the store's `revision`; called on
  // the watch's thread after the first read (even an empty range), after each batch of changes,
  // and after a read again (compaction). Errors: the options (endpoints that do not parse, no
  // key).
  using OnChange = std::function<void(const Snapshot&, int64_t revision)>;
  static Result<std::unique_ptr<Watch>> Start(WatchOptions options, OnChange on_change);
  ~Watch();  // Stop()
  Watch(const Watch&) = delete;
  Watch& operator=(const Watch&) = delete;

  // Asks the thread to end and shuts a stream in progress down; does not wait. Idempotent.
  void RequestStop() NONSTOP_LOCKS_EXCLUDED(mu_);
  // RequestStop(), then waits for the thread to end (promptly). Idempotent; concurrent calls
  // all return once it ended. Called from on_change (the watch's own thread) it only asks.
  void Stop() NONSTOP_LOCKS_EXCLUDED(mu_, join_mu_);

  // For tests and the log: streams opened (each a /v3/watch request), reads made (each a Range).
  int64_t streams() const { return streams_.load(); }
  int64_t reads() const { return reads_.load(); }

 private:
  // kAnotherStore: etcd answered below the revision seen, or is another cluster.
  enum class StreamEnd { kStopped, kCompacted, kAnotherStore, kIdle, kFailed };
  Watch(WatchOptions options, OnChange on_change)
      : options_(std::move(options)),
        on_change_(std::move(on_change)),
        backoff_(options_.backoff_initial, options_.backoff_max),
        outage_(options_.what, "keeping the last value seen; retrying with back-off") {}
  void Run();
  // Reads the range whole (the snapshot, the revision to watch from); false: stopped.
  bool Read();
  // One stream from revision_ + 1 until it ends; *why: a failure's reason.
  StreamEnd Stream(Status* why);
  // Applies one message of the stream; false ends the stream (*end says how).
  bool Take(const std::string& line, StreamEnd* end, Status* why);
  bool stopping() const { return stopping_.load(); }
  // Sleeps `d` unless stopped first (false then).
  bool Pause(Millis d);

  const WatchOptions options_;
  const OnChange on_change_;
  size_t current_ = 0;              // the endpoint of the next stream (of client_'s)
  std::unique_ptr<Client> client_;  // the thread's, for the Range
  Snapshot snapshot_;               // the thread's
  int64_t revision_ = 0;            // the thread's: every change up to it is in snapshot_
  bool created_ = false;            // the thread's: this stream was answered
  uint64_t cluster_id_ = 0;         // the thread's: the cluster streams answered from (0: none)
  Millis idle_{0};                  // the thread's: this stream's idle timeout (jittered)
  Deadline last_message_{};         // the thread's: when this stream last sent bytes
  std::string pending_;             // the thread's: a line of the stream not whole yet
  Backoff backoff_;                 // the thread's
  std::mt19937 rng_{std::random_device{}()};  // the thread's: the idle timeouts' jitter
  OutageLog outage_;                          // the thread's
  std::atomic<bool> stopping_{false};
  std::atomic<int64_t> streams_{0};
  std::atomic<int64_t> reads_{0};
  Mutex mu_;
  httplib::Client* http_ NONSTOP_GUARDED_BY(mu_) = nullptr;  // the stream in progress, if any
  bool done_ NONSTOP_GUARDED_BY(mu_) = false;                // Run() returned
  // Held while Stop() waits for and joins the thread: two Stop()s do not both join it.
  Mutex join_mu_;
  std::thread thread_;  // joined under join_mu_
};

}  // namespace nonstop::etcd
