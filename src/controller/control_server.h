// ControlServer: the controller's end of the control plane, on an EventLoop.
//
// It accepts worker connections, checks each one's hello (magic, version, job
// token) without ever blocking the loop, decodes the JSON messages and hands
// them to the caller as controller Events. A connection that fails its
// handshake, sends a malformed frame or message, or claims a second identity
// is closed with a logged reason; the controller itself never crashes on
// input.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>

#include "common/status.h"
#include "common/unique_fd.h"
#include "controller/controller.h"
#include "net/event_loop.h"
#include "net/frame.h"
#include "net/socket.h"

namespace nonstop::controller {

class ControlServer {
 public:
  using EventSink = std::function<void(Event)>;

  static Result<std::unique_ptr<ControlServer>> Create(net::EventLoop* loop, const net::HostPort& where,
                                                       std::string job_token, EventSink sink);
  ~ControlServer();
  ControlServer(const ControlServer&) = delete;
  ControlServer& operator=(const ControlServer&) = delete;

  const net::HostPort& address() const { return address_; }

  // Sends one message to a worker; false if it has no open connection.
  bool Send(int worker_id, uint16_t type, const std::string& payload);
  int refused_connections() const { return refused_; }

 private:
  struct Conn {
    UniqueFd fd;
    net::FrameDecoder decoder{64 << 10};
    bool greeted = false;  // hello accepted
    int worker_id = -1;    // known after the join message
    std::string peer;
  };

  ControlServer(net::EventLoop* loop, net::Listener listener, std::string token, EventSink sink);
  void OnAccept();
  void OnReadable(int fd);
  void HandleFrame(Conn& c, const net::Frame& f);
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

  net::EventLoop* const loop_;  // owned by the caller; outlives this
  UniqueFd listen_fd_;
  net::HostPort address_;
  const std::string token_;
  EventSink sink_;
  std::map<int, std::unique_ptr<Conn>> conns_;  // by fd
  std::map<int, int> fd_of_worker_;
  int refused_ = 0;
};

}  // namespace nonstop::controller
