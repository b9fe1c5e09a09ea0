// The controller's HTTP endpoint (DESIGN.md §9), served by cpp-httplib on its
// own thread:
//   GET  /status   the job: phase, generation, members, spares, policy (JSON)
//   GET  /metrics  Prometheus text
//   GET  /events   the event journal (JSON lines)
//   POST /scale    {"world_size": N} | {"release": N} | {"grow": N}
// The controller itself stays single-threaded: a scale request is queued and
// the event loop is woken through an eventfd; the HTTP thread waits for the
// loop's answer. Status and metrics are snapshots the loop publishes.
#pragma once

#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/status.h"
#include "common/unique_fd.h"

namespace httplib {
class Server;
}

namespace nonstop::cli {

struct ScaleCall {
  int id;
  nlohmann::json body;
  std::string source;
  std::promise<std::pair<int, nlohmann::json>> reply;
};

class HttpApi {
 public:
  static Result<std::unique_ptr<HttpApi>> Start(const std::string& host, int port, std::string journal_path);
  ~HttpApi();
  HttpApi(const HttpApi&) = delete;
  HttpApi& operator=(const HttpApi&) = delete;

  std::string address() const;
  // Readable when scale calls are queued; the loop then calls TakeCalls().
  int wake_fd() const { return wake_.get(); }
  std::vector<std::unique_ptr<ScaleCall>> TakeCalls();
  void Publish(nlohmann::json status, std::string metrics);

 private:
  HttpApi() = default;
  std::unique_ptr<httplib::Server> server_;
  std::thread thread_;
  std::string host_;
  int port_ = 0;
  std::string journal_path_;
  UniqueFd wake_;
  std::mutex mu_;
  std::vector<std::unique_ptr<ScaleCall>> calls_;  // guarded by mu_
  std::string status_ = "{}";                      // guarded by mu_
  std::string metrics_;                            // guarded by mu_
  int next_id_ = 1;                                // guarded by mu_
};

}  // namespace nonstop::cli
