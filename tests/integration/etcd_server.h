// Test helper: a real, single-member etcd (Debian's etcd-server) on loopback,
// in a temporary data directory, for the tests of the controller's standbys.
// Ports come from the OS (bound to port 0, then handed to etcd); if etcd
// loses the race for one it is started again on new ones.
#pragma once

#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

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

// A TLS etcd's files (tests/integration/test_certs.h makes them): it serves https with cert_file
// and key_file and wants client certificates signed by ca_file (the client's: for /health).
struct EtcdTlsFiles {
  std::string ca_file, cert_file, key_file;
  std::string client_cert, client_key;
};

// Whether the etcd of `process` serves /health on loopback `port` (over TLS with `tls`): asked for
// about 10 s, false at once if it exits.
inline bool WaitHealthy(ChildProcess& process, int port, const EtcdTlsFiles* tls = nullptr) {
  httplib::Client http = tls == nullptr ? httplib::Client("127.0.0.1", port)
                                        : httplib::Client(fmt::format("https://127.0.0.1:{}", port),
                                                          tls->client_cert, tls->client_key);
  if (tls != nullptr) {
    http.set_ca_cert_path(tls->ca_file.c_str());
    http.enable_server_certificate_verification(true);
  }
  http.set_connection_timeout(0, 200'000);
  for (int i = 0; i < 200; ++i) {
    auto res = http.Get("/health");
    if (res && res->status == 200 && res->body.find("true") != std::string::npos) return true;
    if (process.Wait(std::chrono::milliseconds(50)) != -1) return false;
  }
  return false;
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
      if (WaitHealthy(*process_, client)) {
        endpoint_ = fmt::format("127.0.0.1:{}", client);
      } else {
        output_ += process_->Output();  // exited (a port was taken) or never answered
      }
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

// An etcd on ports and a data directory of its own, chosen when this is made, so that it can be
// killed and started again on the same ones (EtcdServer takes new ports at each start). `extra`:
// more flags for etcd. `tls`: it serves https only, and wants client certificates.
class RestartableEtcd {
 public:
  explicit RestartableEtcd(std::string dir, std::vector<std::string> extra = {},
                           std::optional<EtcdTlsFiles> tls = std::nullopt)
      : dir_(std::move(dir)),
        extra_(std::move(extra)),
        tls_(std::move(tls)),
        client_port_(FreeLoopbackPort()),
        peer_port_(FreeLoopbackPort()) {
    if (tls_) {
      extra_.insert(extra_.end(), {"--cert-file", tls_->cert_file, "--key-file", tls_->key_file,
                                   "--client-cert-auth", "--trusted-ca-file", tls_->ca_file});
    }
  }
  ~RestartableEtcd() { Kill(); }

  // "127.0.0.1:port", or "https://127.0.0.1:port" for a TLS one.
  std::string endpoint() const {
    return fmt::format("{}127.0.0.1:{}", tls_ ? "https://" : "", client_port_);
  }
  pid_t pid() const { return process_ ? process_->pid() : -1; }
  // The output of its latest start (kept after a Kill).
  std::string Output() const { return process_ ? process_->Output() : ""; }

  // Starts etcd on its data directory (a new one the first time); true once /health answers.
  bool Start() {
    auto argv =
        EtcdServer::Argv(dir_ + "/etcd-data",
                         fmt::format("{}://127.0.0.1:{}", tls_ ? "https" : "http", client_port_),
                         fmt::format("http://127.0.0.1:{}", peer_port_));
    argv.insert(argv.end(), extra_.begin(), extra_.end());
    process_ = std::make_unique<ChildProcess>(argv, fmt::format("{}/etcd-{}.out", dir_, ++starts_));
    return WaitHealthy(*process_, client_port_, tls_ ? &*tls_ : nullptr);
  }
  void Kill() {
    if (!process_) return;
    ::kill(process_->pid(), SIGKILL);
    process_->Wait(std::chrono::milliseconds(10'000));
  }
  // Its data gone (call it killed): the next Start is a fresh etcd, at revision 1.
  void Wipe() { std::filesystem::remove_all(dir_ + "/etcd-data"); }

 private:
  std::string dir_;
  std::vector<std::string> extra_;
  std::optional<EtcdTlsFiles> tls_;
  int client_port_;
  int peer_port_;
  int starts_ = 0;
  std::unique_ptr<ChildProcess> process_;
};

}  // namespace nonstop::testing
