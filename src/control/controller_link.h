// ControllerLink: the one client of the controller (docs/architecture.md "The control plane"),
// used by a host's agent (src/agent) and by every worker's Session (src/worker)
// alike. It finds the controller (a list of addresses dialed in turn, or the
// leader etcd names, through src/coord, or the leader file the host's agent
// keeps: docs/leader-discovery.md), dials it with a deadline, says the
// caller's hello and checks the ack, fences by epoch, carries framed
// messages both ways (src/net framing) and, after a loss, dials again with
// one back-off policy. What the connection is for (a register or a join
// first, then the orders) stays with the caller: it opens the connection
// with its first frames, and reads every frame but the pings.
//
// Retries by class (client-go's wait.Backoff, etcd clientv3's retry
// interceptor): each error is sorted once, where it enters.
//  - Final (a kFailed event; the link dials no more): the controller refused
//    the hello (kFailedPrecondition whose message is the controller's reason:
//    a wrong job token, protocol version or kind); etcd says the job ended
//    (kAborted, job_exit_code()); no controller accepted the hello before the
//    give-up time (the last try's error, as it was).
//  - Dialed again at once: a connection that was accepted and then lost
//    (closed or reset by the controller, silent for `silence_timeout`, a
//    send that failed or overflowed `max_queued_bytes`).
//  - Dialed again after the back-off: a try that failed (connection refused,
//    reset or timed out, a host that does not resolve, etcd unreachable or
//    naming no host:port, a hello that is not answered in time); garbage from
//    the server (a corrupt frame, an ack that is no ack, a malformed ping,
//    and what the owner Drop()s with kInvalidArgument or kDataLoss: a
//    malformed order); a controller of an older epoch than one seen.
//  - Asked again after `leader_poll` (jittered like the back-off): etcd (or
//    the leader file) says that nobody leads yet, or the leader it names does
//    not answer (it is starting, or died and its lease has not run out). With
//    a leader file, LeaderChanged() cuts that wait short.
//
// Back-off: one policy, exponential with jitter and bounded (BackoffDelay):
// after the n-th failure in a row the wait is min(initial·2^(n−1), max) plus
// up to `jitter` of it at random. A list counts a round as one failure: the
// next address of a round is dialed at once. An acceptance starts the count
// again. Garbage after an acceptance counts apart (protocol errors in a row,
// cleared by a frame the owner takes without dropping the connection), so a
// controller that keeps sending a bad order is not redialed in a tight loop.
//
// Epochs (docs/controller-failover.md): every ping (control::kMsgPing)
// carries its controller's epoch, and is the first frame a controller sends
// on a connection. The link keeps the highest epoch seen, across
// connections. A ping of an older epoch is a deposed leader's: the link
// leaves that connection at once, and nothing that came after that ping is
// handed to the owner. Pings never reach the owner.
//
// Thread model. One thread at a time drives the link: its owner (the
// agent's loop; the Session's training thread in Join, then its I/O
// thread). The owner calls everything but Send() and open(). The owner's
// calls block only at the start of a try, in the name lookup (getaddrinfo)
// and the etcd lookup (at most etcd_timeout; a leader file is a local read),
// and in WaitAccepted(). Send()
// and open() are thread-safe (mu_): any thread may queue frames; what the
// socket does not take at once is written by the owner when fd() is
// writable. A Send that leaves bytes waiting, or fails, wakes the owner
// through wake_fd(). Two ways to drive it:
//  - an owner with a net::EventLoop calls Attach(): the link watches its own
//    descriptors on that loop, calls Advance() when they are ready and then
//    the owner's pump (which takes the events with Next()); the owner also
//    calls Advance(0, now) by wake_at() for the timers;
//  - an owner with its own poll(2) polls fd() for events(), wake_fd() for
//    POLLIN, until wake_at(); then Advance(revents, now) and Next() until it
//    returns nothing. WaitAccepted() is that loop, blocking.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/crypto.h"
#include "common/mutex.h"
#include "common/time.h"
#include "common/unique_fd.h"
#include "coord/etcd_security.h"
#include "net/event_loop.h"
#include "net/frame.h"
#include "net/handshake.h"
#include "net/socket.h"
#include "nonstop/status.h"

namespace nonstop::etcd {
class Client;
}
namespace nonstop::net {
class AbortSignal;
}
namespace nonstop::coord {
class LeaderFileReader;
}

namespace nonstop::control {

// "host:port[,host:port…]": the controllers, in the order they are tried (a
// leader and its standbys). Every item must parse, with a port other than 0.
Result<std::vector<net::HostPort>> ParseControllerList(std::string_view list);

// Exponential back-off with jitter, bounded.
struct BackoffPolicy {
  Millis initial{100};
  Millis max{1'000};
  double jitter = 0.5;  // up to this fraction of the wait is added at random
};

// The wait after `failures` failures in a row (≥ 1): d = min(initial·2^(failures−1), max),
// plus d·jitter·u; `u` is uniform in [0, 1). Pure: the tests give `u`.
Millis BackoffDelay(const BackoffPolicy& policy, int failures, double u);

struct ControllerLinkOptions {
  // Where the controller is: "host:port[,host:port…]" dialed in turn, and/or
  // etcd's endpoints, where the leader of `etcd_job` is looked up before each
  // try. One of the two is required; with both, etcd wins unless list_first.
  std::string controllers;
  std::string etcd;
  std::string etcd_job = "default";
  // Or the leader file the host's agent keeps (docs/leader-discovery.md,
  // coord::LeaderWatch): read before each try instead of asking etcd (a
  // local read of under 200 bytes), so that the host's agent is the one etcd
  // client of the host. It wins over etcd; it must be etcd_job's.
  std::string leader_file;
  // etcd's TLS and user (docs/etcd-security.md), for the etcd client. The leader key's value is
  // verified with controller_public, from etcd and from the leader file alike.
  etcd::Security etcd_security;
  Millis etcd_timeout{300};  // one etcd request (the owner's thread waits for it)
  // With etcd: until the first acceptance the list is dialed (a worker whose
  // launcher just named the leader); etcd is asked after a loss.
  bool list_first = false;

  // What the caller says of itself (kind, worker id), and the key of that role (role_keys.h: a
  // worker's control key, or the job key for an agent): the link proves it, and follows only a
  // controller that proves it too (net/handshake.h). No key is ever sent. A
  // controller that cannot prove the key is garbage, dialed again after the
  // back-off; before any controller accepted this link, three such tries in a
  // row are final (kFailedPrecondition: most likely this process holds the
  // wrong token). An authenticated refusal (its reason: a kind or worker id
  // the controller does not take) is final.
  net::Hello hello;
  crypto::Key key{};
  // The controllers' Ed25519 public key (ControllerPublicKey): the leader key's value is followed
  // only when it verifies with it. Required.
  std::string controller_public;

  Millis try_timeout{3'000};        // one try: the connect, then the hello and its ack, each
  Millis silence_timeout{5'000};    // accepted, and no byte from the controller this long: lost
  Millis reconnect_within{60'000};  // after a loss, give up if none accepts again within this
  BackoffPolicy backoff;
  // etcd says nobody leads, or the leader it names does not answer: ask again after this
  // (jittered too).
  Millis leader_poll{100};

  // A longer frame from the controller is garbage; more queued bytes than
  // max_queued_bytes, not yet taken by the controller, are a loss.
  uint32_t max_frame_bytes = net::kMaxControlFrameBytes;
  size_t max_queued_bytes = 8u << 20;
  // Test seam: uniform in [0, 1). Empty: a std::mt19937 seeded from std::random_device.
  std::function<double()> random;
};

// What the owner learns from the link, in order (Next()).
struct LinkEvent {
  enum class Kind {
    kAccepted,  // the controller accepted the hello: Open() the connection with the first frames
    kFrame,     // a frame from the controller (never a ping)
    kLost,      // the connection was lost (status: why); the link dials again on its own
    kFailed,    // final (status: why); the link dials no more
  };
  Kind kind = Kind::kFrame;
  net::Frame frame;  // kFrame
  Status status;     // kLost, kFailed
};

class ControllerLink {
 public:
  // The connection's lifecycle. Stop() goes to kIdle from anywhere; kFailed
  // is left only by Stop().
  //   /*from=*/kIdle        /*to=*/kWaiting     /*cond=*/Start()
  //   /*from=*/kWaiting     /*to=*/kConnecting  /*cond=*/the next try is due: connect in flight
  //   /*from=*/kWaiting     /*to=*/kWaiting     /*cond=*/nobody leads yet; a try failed at once
  //   /*from=*/kConnecting  /*to=*/kHello       /*cond=*/connected: the hello is queued
  //   /*from=*/kHello       /*to=*/kAccepted    /*cond=*/the controller proved the key and
  //                                                      accepted ours
  //   /*from=*/kAccepted    /*to=*/kOpen        /*cond=*/Open()
  //   /*from=*/kConnecting, kHello /*to=*/kWaiting /*cond=*/the try failed (retried)
  //   /*from=*/kAccepted, kOpen    /*to=*/kWaiting /*cond=*/lost, or Drop()
  //   /*from=*/kWaiting, kConnecting, kHello /*to=*/kFailed /*cond=*/refused, job over, gave up
  enum class State { kIdle, kWaiting, kConnecting, kHello, kAccepted, kOpen, kFailed };
  static const char* StateName(State s);

  // Checks the options (a controller list or etcd, timeouts), and makes the
  // etcd client if etcd is set. The link starts in kIdle.
  static Result<std::unique_ptr<ControllerLink>> Create(ControllerLinkOptions options);
  ~ControllerLink();
  ControllerLink(const ControllerLink&) = delete;
  ControllerLink& operator=(const ControllerLink&) = delete;

  // ---- the owner's thread ----

  // Watches fd() and wake_fd() on `loop` from now on (it outlives the link,
  // or the link is destroyed first): when one is ready the link runs
  // Advance() and then `pump`, which takes the events with Next(). Once.
  void Attach(net::EventLoop* loop, std::function<void()> pump);

  // Looks for a controller, the first try at `now`, giving up at `give_up_at`. From kIdle.
  void Start(Deadline give_up_at, Deadline now);
  // Closes the connection and dials no more (kIdle); pending events are dropped.
  void Stop();
  // The leader file changed (the owner learned it): a try that waits for the leader is made now.
  void LeaderChanged(Deadline now);
  // Moves the give-up time of the search in progress (or of the next, after a loss).
  void set_give_up_at(Deadline give_up_at) { give_up_at_ = give_up_at; }

  // Does what `revents` allows on fd() and what is due at `now`: a try, an
  // attempt's deadline, the controller's silence, a failed Send.
  void Advance(short revents, Deadline now);
  // The next event, or nothing. A loss found behind frames is handed out (and
  // the connection closed) after them.
  std::optional<LinkEvent> Next();
  // kAccepted → kOpen: queues `first` (the register, or the join and what
  // must follow it) before anything another thread may Send from now on.
  Status Open(const std::vector<std::pair<uint16_t, std::string>>& first);
  // The owner leaves the connection (a malformed order: kInvalidArgument or
  // kDataLoss count as garbage, see the back-off). No kLost follows: the
  // owner knows. The link dials again. A no-op unless kAccepted or kOpen.
  void Drop(const Status& why, Deadline now);
  // Drives the link with poll(2) until it is accepted (OK: Open() it),
  // fails for good (its status), or `abort` fires (kAborted).
  Status WaitAccepted(const net::AbortSignal* abort);

  State state() const { return state_; }
  int fd() const { return fd_; }  // the connection's descriptor, -1 without one
  short events() const;           // what to poll fd() for
  int wake_fd() const { return wake_fd_.get(); }
  Deadline wake_at() const;  // when Advance() must run at the latest
  // The controller of the current or last try ("host:port"; before any try,
  // the list's first or "").
  const std::string& controller() const { return controller_; }
  // Why the last try failed, or why the connection was lost.
  const std::string& last_error() const { return last_error_; }
  int64_t epoch() const { return epoch_; }              // the highest epoch seen
  int job_exit_code() const { return job_exit_code_; }  // kFailed with kAborted: the job's code
  // This end's IP address (IPv4 or IPv6, no brackets; kAccepted, kOpen); "" if unknown.
  std::string local_address() const;
  // Frames from a controller that failed their MAC (altered or injected), each of which cost
  // that connection.
  int64_t refused_frames() const { return refused_frames_; }

  // ---- any thread ----

  // Queues one frame to the controller and writes what the socket takes now;
  // never blocks. kUnavailable when not open, or when the connection failed
  // or overflowed (then lost: the owner learns it at its next Advance()).
  Status Send(uint16_t type, std::string_view payload) NONSTOP_LOCKS_EXCLUDED(mu_);
  bool open() const NONSTOP_LOCKS_EXCLUDED(mu_);

 private:
  // What to do after a failure (sorted once, where it enters).
  enum class Retry { kNow, kBackoff };
  struct Pending {
    LinkEvent event;
    Deadline at{};           // kLost: when it was found
    Deadline next_try_at{};  // kLost: when to dial again
  };

  explicit ControllerLink(ControllerLinkOptions options);
  void ChangeState(State next);
  bool FromEtcd() const;
  double Random();
  void BeginTry(Deadline now);
  void Connect(const net::HostPort& where, Deadline now);
  void OnConnected(Deadline now);
  void Exchange(short revents, Deadline now);
  void Read(Deadline now);
  // A frame of this connection; false when the connection ended over it.
  bool Take(net::Frame frame, Deadline now);
  // A frame of the handshake (kHello): answered, or the try ends; false when it ended.
  bool TakeHandshake(const net::Frame& frame, Deadline now);
  void TryFailed(const Status& why, Deadline now);
  void WaitForLeader(const Status& why, Deadline now);
  // With a leader file: `why` and where to look when it lasts (the agent's watch's log line).
  Status WithFileHint(const Status& why) const;
  void Fail(const Status& why);
  void Lose(const Status& why, Deadline now, Retry retry);
  void FinishLoss(const Pending& p);
  void InstallConnection(UniqueFd fd) NONSTOP_LOCKS_EXCLUDED(mu_);
  void CloseConnection() NONSTOP_LOCKS_EXCLUDED(mu_);
  Status FlushLocked() NONSTOP_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  Status TakeSendError() NONSTOP_LOCKS_EXCLUDED(mu_);
  void WakeOwner() const;
  void DrainWake() const;
  void Rewatch();

  const ControllerLinkOptions options_;
  UniqueFd wake_fd_;  // eventfd: Send() wakes the owner

  // Shared with Send() on other threads.
  mutable Mutex mu_;
  UniqueFd conn_ NONSTOP_GUARDED_BY(mu_);
  bool open_ NONSTOP_GUARDED_BY(mu_) = false;  // kOpen, and no loss found yet
  std::string out_ NONSTOP_GUARDED_BY(mu_);    // queued frames; out_sent_ bytes of it are written
  size_t out_sent_ NONSTOP_GUARDED_BY(mu_) = 0;
  Status send_error_ NONSTOP_GUARDED_BY(mu_);  // a Send failed: the owner loses the connection
  std::unique_ptr<net::FrameMac> send_mac_ NONSTOP_GUARDED_BY(mu_);  // seals what is queued

  // The owner's alone (no lock: only the owner's thread touches them).
  int fd_ = -1;  // conn_'s descriptor: only the owner opens and closes conn_
  std::vector<net::HostPort> list_;
  std::unique_ptr<etcd::Client> etcd_;
  std::unique_ptr<coord::LeaderFileReader> leader_file_;
  bool waiting_for_leader_ = false;  // kWaiting after WaitForLeader: LeaderChanged() cuts it short
  std::function<double()> random_;
  net::EventLoop* loop_ = nullptr;  // Attach(): the owner's, outlives this link
  std::function<void()> pump_;
  State state_ = State::kIdle;
  net::FrameDecoder decoder_;
  std::unique_ptr<net::DialerHandshake> handshake_;  // kHello
  std::unique_ptr<net::FrameMac> recv_mac_;          // kAccepted, kOpen: opens what is read
  int64_t refused_frames_ = 0;
  // Tries in a row whose peer did not prove the job key, before any acceptance: kUnprovenTries of
  // them are final.
  static constexpr int kUnprovenTries = 3;
  int unproven_in_a_row_ = 0;
  bool warned_unproven_ = false;  // logged once between two acceptances
  std::deque<Pending> events_;
  bool losing_ = false;      // a loss waits in events_: no more I/O on this connection
  bool took_frame_ = false;  // the owner took a frame and has not dropped the connection over it
  bool ever_accepted_ = false;
  bool try_from_etcd_ = false;
  bool named_by_etcd_ = false;  // this try dials the leader etcd named
  size_t next_ = 0;             // the list's address to dial next
  size_t tried_in_round_ = 0;
  int failed_tries_ = 0;     // failed tries (rounds of the list) in a row
  int protocol_errors_ = 0;  // connections lost to garbage in a row
  Deadline next_try_at_{};
  Deadline try_deadline_{};
  Deadline give_up_at_ = kNoDeadline;
  Deadline last_heard_{};
  Status last_status_;  // the last try's error, or the loss
  std::string last_error_;
  std::string controller_;
  int64_t epoch_ = 0;
  int job_exit_code_ = 1;
};

}  // namespace nonstop::control
