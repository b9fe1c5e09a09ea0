// The controller's HTTP endpoint (docs/dashboard.md), served by cpp-httplib:
//   GET  /         the dashboard page (it holds no data)                       open
//   GET  /status   the job: phase, generation, members, spares, policy (JSON)   loopback: open
//   GET  /metrics  Prometheus text                                              loopback: open
//   GET  /events   the event journal (JSON lines)                               token
//   POST /scale    {"world_size": N} | {"release": N} | {"grow": N}             token
// "token": the request must carry the job token as `Authorization: Bearer
// <token>` (compared in constant time); 401 otherwise, with a reason that
// never repeats what was presented. Off loopback (any other address, the
// wildcards 0.0.0.0 and :: included) every endpoint but the page needs it:
// the job's members, hosts and metrics are nobody else's business either.
// An empty token is allowed only on a loopback address, and then nothing
// asks for one.
//
// HTTPS (HttpTls): the same endpoint over TLS with the given certificate
// and key, checked at Start. The TLS handshake is part of "the request": the
// gate below runs it, non-blocking, with the request's deadline, so a slow
// or idle TLS client holds no thread either. A plain HTTP request to an
// HTTPS endpoint gets a plain 400 that says to use https://.
//
// Every refused request gets a 4xx whose JSON body names the reason:
// {"error": "..."} (400 malformed request or JSON, 401, 404 unknown path,
// 405 wrong method, 408 request not sent in time, 413 body over 64 KiB, 415
// body that is not JSON).
//
// Connections: httplib would give every connection one of its few pool
// threads for as long as the client keeps it open, so a handful of idle
// connections could starve a real request. Here httplib's listening thread
// only accepts; a gate thread holds every connection (in one poll loop, at
// most kMaxWaitingConnections, the oldest closed first) until its whole
// request has arrived (head and a body up to the limit) or its deadline
// passes, and only then a worker thread serves it, with deadlines on every
// read and write, one request per connection. Idle or slow clients therefore
// cost a descriptor and a buffer, never a thread.
//
// The controller itself stays single-threaded: a scale request is queued and
// the event loop is woken through an eventfd; the HTTP worker waits for the
// loop's answer. Status and metrics are snapshots the loop publishes.
#pragma once

#include <atomic>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/mutex.h"
#include "common/unique_fd.h"
#include "nonstop/status.h"

namespace httplib {
class Server;
struct Request;
struct Response;
}  // namespace httplib

namespace nonstop::controller {

class GatedHttpServer;

// HTTPS: PEM files. Both empty: plain HTTP.
struct HttpTls {
  std::string cert_path;  // the certificate (chain), leaf first
  std::string key_path;   // its private key, unencrypted, readable by the owner only
};

struct ScaleCall {
  int id;
  nlohmann::json body;
  std::string source;
  std::promise<std::pair<int, nlohmann::json>> reply;
};

class HttpApi {
 public:
  // Serves on host:port (0: a port from the OS). `token` guards /events and
  // /scale, and off loopback every endpoint but the page; an empty token on
  // a non-loopback host is refused (kInvalidArgument), as anyone on the
  // network could then resize the job. With `tls` set it serves HTTPS;
  // certificate or key files that are missing, unreadable, not PEM, not a
  // pair, or (the key) readable by group or others: kInvalidArgument naming
  // the file and the fix.
  static Result<std::unique_ptr<HttpApi>> Start(const std::string& host, int port,
                                                std::string journal_path, std::string token = "",
                                                const HttpTls& tls = {});
  ~HttpApi();
  HttpApi(const HttpApi&) = delete;
  HttpApi& operator=(const HttpApi&) = delete;

  std::string address() const;
  int port() const { return port_; }
  // "https" with HttpTls, else "http": for the URLs printed.
  const char* scheme() const { return tls_ ? "https" : "http"; }
  // Readable when scale calls are queued; the loop then calls TakeCalls().
  int wake_fd() const { return wake_.get(); }
  std::vector<std::unique_ptr<ScaleCall>> TakeCalls();
  void Publish(nlohmann::json status, std::string metrics);

 private:
  HttpApi() = default;
  bool Authorized(const std::string& authorization_header) const;
  void InstallGate();
  void InstallRoutes();
  void ServeEvents(const httplib::Request& req, httplib::Response& res);
  void ServeScale(const httplib::Request& req, httplib::Response& res);

  std::unique_ptr<GatedHttpServer> server_;
  std::thread thread_;
  std::string host_;
  int port_ = 0;
  std::string journal_path_;
  std::string token_;
  bool loopback_ = true;  // off loopback every endpoint but the page needs the token
  bool tls_ = false;
  // requests refused for want of the token (nonstop_http_unauthorized_total in /metrics)
  std::atomic<uint64_t> unauthorized_{0};
  UniqueFd wake_;
  Mutex mu_;
  std::vector<std::unique_ptr<ScaleCall>> calls_ NONSTOP_GUARDED_BY(mu_);
  std::string status_ NONSTOP_GUARDED_BY(mu_) = "{}";
  std::string metrics_ NONSTOP_GUARDED_BY(mu_);
  int next_id_ NONSTOP_GUARDED_BY(mu_) = 1;
};

// True for 127.0.0.0/8, ::1 and "localhost".
bool IsLoopbackHost(const std::string& host);

}  // namespace nonstop::controller
