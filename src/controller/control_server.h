// ControlServer: the controller's end of the control plane, on an EventLoop.
//
// It accepts worker and agent connections (an agent's hello has kind
// kAgent, and its first message registers its host), runs each one's
// handshake (the peer and this server prove the job key to each other,
// net/handshake.h) without ever blocking the loop, opens every frame that
// follows with the connection's MAC (a frame that fails it closes the
// connection, counted in refused_frames()), decodes the JSON messages and
// hands them to the caller as controller Events. A connection that fails its
// handshake, sends a malformed frame or message, or claims a second identity
// is closed with a logged reason; the controller itself never crashes on
// input.
//
// The loop never blocks on a peer (docs/thread-model.md):
//  - Send() queues the frame on the connection and writes what the socket
//    takes now; the rest goes out when the socket is writable. A reader that
//    lets more than `max_queued_bytes` pile up, or takes nothing for
//    `send_stall_timeout`, is disconnected, and its worker reported lost
//    (ConnectionLost): a stuck worker is a failed worker.
//  - A connection must present its hello and join within
//    `handshake_timeout`, and at most `max_unjoined` connections may be at
//    that stage at once, so a flood of idle or garbage connections costs
//    bounded memory. To make room, the oldest stranger (no valid hello yet)
//    from the address with the most strangers is closed: a flood from one
//    address evicts only its own connections, never a worker on another
//    host that has just connected. Connections that proved the job
//    key are never evicted for strangers.
//  - Refusals are logged with the peer's address, at most a few per second
//    (the rest are counted and summarised).
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>

#include "common/time.h"
#include "common/unique_fd.h"
#include "controller/controller.h"
#include "net/event_loop.h"
#include "net/frame.h"
#include "net/handshake.h"
#include "net/socket.h"
#include "nonstop/status.h"

namespace nonstop::controller {

struct ControlServerOptions {
  Millis handshake_timeout{5'000};     // from accept to a valid join message
  int max_unjoined = 64;               // connections between accept and join
  size_t max_queued_bytes = 8u << 20;  // per connection, not yet taken by the peer
  Millis send_stall_timeout{3'000};    // queued output with no byte taken for this long
  // This controller's epoch (docs/controller-failover.md): every ping says
  // it, and a ping is the first message on each worker's and agent's
  // connection, so it precedes every order; a worker or agent that has seen
  // a newer epoch leaves such a connection (a deposed leader's) unheard.
  int64_t epoch = 0;
};

// A worker's frames once it proved the job key: up to a store request of a 1 MiB value
// (control::kMaxStoreValueBytes, base64). Before that, and from agents, 64 KiB.
inline constexpr uint32_t kMaxWorkerFrameBytes = 2u << 20;

class ControlServer {
 public:
  using EventSink = std::function<void(Event)>;

  static Result<std::unique_ptr<ControlServer>> Create(net::EventLoop* loop,
                                                       const net::HostPort& where,
                                                       std::string job_token, EventSink sink,
                                                       ControlServerOptions options = {});
  ~ControlServer();
  ControlServer(const ControlServer&) = delete;
  ControlServer& operator=(const ControlServer&) = delete;

  const net::HostPort& address() const { return address_; }
  // The payload of a ping from this controller: {"epoch":N}.
  const std::string& ping_payload() const { return ping_payload_; }

  // Queues one message to a worker and never blocks. False if the worker has
  // no open connection, or if this send overflowed its queue (the connection
  // is then closed and the worker reported lost).
  bool Send(int worker_id, uint16_t type, const std::string& payload);
  // Which connection a worker is on now: an id no other connection of this
  // server has had (frames sent on one arrive in order); 0: none.
  uint64_t connection_of(int worker_id) const;
  // The same, to the agent of a host.
  bool SendToAgent(const std::string& host_id, uint16_t type, const std::string& payload);
  // Sends the agent a Shutdown (why it must go; with send_shutdown false,
  // nothing: the agent sees its connection close, fences itself and
  // registers again) and closes its connection; no HostLost follows (the
  // controller decided it).
  void CloseAgent(const std::string& host_id, const std::string& reason, int exit_code,
                  bool send_shutdown = true);
  // Closes a worker's connection (it was killed, or fenced with its host); no
  // ConnectionLost follows.
  void CloseWorker(int worker_id, const std::string& reason);
  // The hosts whose agents are connected.
  std::vector<std::string> agents() const;
  // Closes connections that overran their handshake deadline or stopped
  // taking their output. Call it from the loop's timer (every ~50 ms).
  void CheckTimers(Clock::time_point now);

  // Fencing (docs/controller-failover.md): once `may_send` says no (this
  // controller's lease ran out while its output waited in a queue, e.g. it
  // was paused), nothing more leaves: a connection with output queued is
  // closed with it (dropped, not flushed: a frame cut short is never
  // completed, and the peer looks for the new leader at once), and later
  // sends are refused. Counted in dropped_bytes(). The gate closes for good
  // (a lapsed lease is never valid again).
  void SetSendGate(std::function<bool()> may_send) { may_send_ = std::move(may_send); }
  // Whether the gate has closed: a send that failed for that is no fault of the peer's.
  bool fenced() const { return may_send_ && !may_send_(); }
  // Bytes of queued or new messages the gate kept from going out.
  uint64_t dropped_bytes() const { return dropped_bytes_; }

  int refused_connections() const { return refused_; }
  // Frames that failed their MAC (altered or injected), each of which cost its connection.
  int64_t refused_frames() const { return refused_frames_; }
  size_t open_connections() const { return conns_.size(); }

 private:
  struct Conn {
    UniqueFd fd;
    net::FrameDecoder decoder{64 << 10};  // kMaxWorkerFrameBytes once a worker proved the key
    // The handshake until it is over; then the connection's session keys, which seal and open
    // every frame.
    std::unique_ptr<net::AcceptorHandshake> handshake;
    net::Channel channel;
    bool greeted = false;      // the peer proved the job key, and its hello was accepted
    int hello_worker_id = -1;  // who the hello said it is; the join must agree
    int worker_id = -1;        // known after the join message
    bool agent = false;        // the hello said kAgent
    std::string host_id;       // an agent's, known after its register message
    std::string peer;          // "worker 3 (127.0.0.1:41234)" once known
    std::string ip;            // the peer's address, without the port
    uint64_t seq = 0;          // accept order
    Clock::time_point accepted_at{};
    std::string out;  // queued output; out_sent bytes of it are already written
    size_t out_sent = 0;
    Clock::time_point out_progress_at{};  // the last time the peer took a byte
  };

  ControlServer(net::EventLoop* loop, net::Listener listener, std::string token, EventSink sink,
                ControlServerOptions options);
  bool identified(const Conn& c) const { return c.worker_id >= 0 || !c.host_id.empty(); }
  // Bookkeeping of the handshake stages: a connection stops being a
  // stranger when its hello is accepted, and unjoined when it is identified.
  void Greeted(Conn& c);
  void Identified(Conn& c);
  // Closes the oldest stranger of the address with the most of them (none:
  // every unjoined connection has proved the job key).
  void EvictAStranger();
  bool SendOn(int fd, uint16_t type, const std::string& payload);
  void HandleAgentFrame(Conn& c, const net::Frame& f);
  void OnAccept();
  void OnEvent(int fd, short revents);
  // report_loss: a connection found closed is reported (ConnectionLost, HostLost).
  void OnReadable(int fd, bool report_loss = true);
  // Reads what a worker's connection already holds (its last frames: the
  // fault it announced, a failure it reported) before its exit is reported or
  // its connection closed: an agent's report of the exit comes on another
  // connection and can overtake them, and a closed connection loses them.
  // report_loss: as OnReadable's (false when the controller closes it anyway).
  void ReadWhatIsLeft(int worker_id, bool report_loss);
  // Writes what the socket takes now; false if the connection was closed.
  bool Flush(int fd);
  // A frame as read: the handshake's, or a sealed one, opened and handed to HandleOpenedFrame.
  void HandleFrame(Conn& c, const net::Frame& f);
  void HandleHandshakeFrame(Conn& c, const net::Frame& f);
  void HandleOpenedFrame(Conn& c, const net::Frame& f);
  // Decodes a worker's message and hands it on as an event; the decoder's
  // error (naming the bad field) otherwise.
  template <typename EventT, typename Decode>
  Status Deliver(int worker_id, const std::string& payload, Decode decode) {
    auto msg = decode(payload);
    if (!msg.ok()) return msg.status();
    sink_(EventT{worker_id, std::move(*msg)});
    return OkStatus();
  }
  void CloseConn(int fd, const std::string& reason, bool report_loss);
  // Logs a refusal, at most a few per second; the rest are counted.
  void LogRefusal(const std::string& line);

  net::EventLoop* const loop_;  // owned by the caller; outlives this
  const ControlServerOptions options_;
  UniqueFd listen_fd_;
  net::HostPort address_;
  const crypto::Key job_key_;  // of the job token: each peer proves its role's key (role_keys.h)
  EventSink sink_;
  std::map<int, std::unique_ptr<Conn>> conns_;  // by fd
  std::map<int, int> fd_of_worker_;
  std::map<std::string, int> fd_of_host_;
  uint64_t next_seq_ = 0;
  std::map<uint64_t, int> unjoined_;  // accept order → fd, for connections not yet identified
  std::map<std::string, std::map<uint64_t, int>> strangers_;  // by peer address: no valid hello yet
  std::set<int> backlogged_;  // fds with queued output the peer has not taken yet
  std::function<bool()> may_send_;
  uint64_t dropped_bytes_ = 0;
  int refused_ = 0;
  int64_t refused_frames_ = 0;
  std::string ping_payload_;
  // out of descriptors: not accepting until then
  std::optional<Clock::time_point> accept_paused_until_;
  Clock::time_point log_window_start_{};
  int logged_in_window_ = 0;
  int suppressed_logs_ = 0;
};

}  // namespace nonstop::controller
