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
//  - a stream silent for idle_timeout is opened again (from where it was):
//    a member that hangs without closing the connection (paused,
//    partitioned) is left within that.
// Stop() ends the thread promptly: it shuts the stream's socket down (a Range
// or a connect in progress first ends, within request_timeout).
//
// Thread-safety: Start makes one thread, which calls on_change (never two
// calls at once). Stop() and the counters may be called from any thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>

#include "common/mutex.h"
#include "common/status.h"
#include "common/time.h"
#include "coord/etcd.h"
#include "coord/retry.h"

namespace httplib {
class Client;
}

namespace nonstop::etcd {

struct WatchOptions {
  std::string endpoints;  // host:port[,host:port…], as etcd::Client takes them
  std::string key;
  std::string range_end;          // empty: the key alone; PrefixEnd(key): every key under it
  Millis request_timeout{2'000};  // the Range; the stream's connect and its first answer
  // A stream that sends nothing this long is opened again (at most one request per this).
  Millis idle_timeout{10'000};
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

  // Ends the thread (promptly: a stream in progress is shut down). Idempotent.
  void Stop() NONSTOP_LOCKS_EXCLUDED(mu_);

  // For tests and the log: streams opened (each a /v3/watch request), reads made (each a Range).
  int64_t streams() const { return streams_.load(); }
  int64_t reads() const { return reads_.load(); }

 private:
  enum class StreamEnd { kStopped, kCompacted, kIdle, kFailed };
  struct Endpoint {
    std::string host;
    int port = 0;
  };
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
  std::vector<Endpoint> endpoints_;
  size_t current_ = 0;              // the endpoint of the next stream
  std::unique_ptr<Client> client_;  // the thread's, for the Range
  Snapshot snapshot_;               // the thread's
  int64_t revision_ = 0;            // the thread's: every change up to it is in snapshot_
  bool created_ = false;            // the thread's: this stream was answered
  Deadline last_message_{};         // the thread's: when this stream last sent bytes
  std::string pending_;             // the thread's: a line of the stream not whole yet
  Backoff backoff_;                 // the thread's
  OutageLog outage_;                // the thread's
  std::atomic<bool> stopping_{false};
  std::atomic<int64_t> streams_{0};
  std::atomic<int64_t> reads_{0};
  Mutex mu_;
  httplib::Client* http_ NONSTOP_GUARDED_BY(mu_) = nullptr;  // the stream in progress, if any
  bool done_ NONSTOP_GUARDED_BY(mu_) = false;                // Run() returned
  std::thread thread_;
};

}  // namespace nonstop::etcd
