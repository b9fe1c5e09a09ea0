// Test helper: a real, single-member etcd (Debian's etcd-server) on loopback,
// in a temporary data directory, for the tests of the controller's standbys.
// Ports come from the OS (bound to port 0, then handed to etcd); if etcd
// loses the race for one it is started again on new ones.
#pragma once

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <memory>
#include <string>
#include <thread>

#include <fmt/format.h>
#include <httplib.h>

#include "common/temp_dir.h"
#include "tests/integration/process.h"

namespace nonstop::testing {

inline int FreeLoopbackPort() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof(a);
  int port = -1;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0) {
    port = ntohs(a.sin_port);
  }
  ::close(fd);
  return port;
}

class EtcdServer {
 public:
  static constexpr const char* kBinary = "/usr/bin/etcd";
  // The command line of a one-member etcd on loopback, fast to elect (50 ms heartbeats).
  static std::vector<std::string> Argv(const std::string& data_dir, const std::string& client_url,
                                       const std::string& peer_url) {
    return {kBinary,
            "--name",
            "test",
            "--data-dir",
            data_dir,
            "--listen-client-urls",
            client_url,
            "--advertise-client-urls",
            client_url,
            "--listen-peer-urls",
            peer_url,
            "--initial-advertise-peer-urls",
            peer_url,
            "--initial-cluster",
            "test=" + peer_url,
            "--heartbeat-interval",
            "50",
            "--election-timeout",
            "500",
            "--logger",
            "zap",
            "--log-level",
            "warn"};
  }

  // Starts etcd; empty endpoint() if it could not (Output() says why).
  // Heartbeat 50 ms and election timeout 500 ms: etcd's shortest lease is then 1 s.
  explicit EtcdServer(const std::string& dir) : dir_(dir) {
    for (int attempt = 0; attempt < 5 && endpoint_.empty(); ++attempt) {
      int client = FreeLoopbackPort();
      int peer = FreeLoopbackPort();
      std::string client_url = fmt::format("http://127.0.0.1:{}", client);
      std::string peer_url = fmt::format("http://127.0.0.1:{}", peer);
      std::string data = fmt::format("{}/etcd-data-{}", dir_, attempt);
      process_ = std::make_unique<ChildProcess>(Argv(data, client_url, peer_url),
                                                fmt::format("{}/etcd-{}.out", dir_, attempt));
      httplib::Client http("127.0.0.1", client);
      http.set_connection_timeout(0, 200'000);
      for (int i = 0; i < 200; ++i) {
        auto res = http.Get("/health");
        if (res && res->status == 200 && res->body.find("true") != std::string::npos) {
          endpoint_ = fmt::format("127.0.0.1:{}", client);
          break;
        }
        if (process_->Wait(std::chrono::milliseconds(50)) != -1) break;  // exited: a port was taken
      }
      if (endpoint_.empty()) output_ += process_->Output();
    }
  }

  const std::string& endpoint() const { return endpoint_; }
  std::string Output() const { return output_ + (process_ ? process_->Output() : ""); }
  pid_t pid() const { return process_ ? process_->pid() : -1; }

 private:
  std::string dir_;
  std::string endpoint_;
  std::string output_;
  std::unique_ptr<ChildProcess> process_;
};

}  // namespace nonstop::testing
