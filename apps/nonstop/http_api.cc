#include "apps/nonstop/http_api.h"

#include <httplib.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <sstream>

#include <fmt/format.h>

namespace nonstop::cli {

Result<std::unique_ptr<HttpApi>> HttpApi::Start(const std::string& host, int port, std::string journal_path) {
  auto api = std::unique_ptr<HttpApi>(new HttpApi());
  api->journal_path_ = std::move(journal_path);
  api->host_ = host;
  api->wake_.Reset(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  api->server_ = std::make_unique<httplib::Server>();
  HttpApi* self = api.get();
  auto& srv = *api->server_;
  srv.Get("/status", [self](const httplib::Request&, httplib::Response& res) {
    std::lock_guard<std::mutex> lock(self->mu_);
    res.set_content(self->status_, "application/json");
  });
  srv.Get("/metrics", [self](const httplib::Request&, httplib::Response& res) {
    std::lock_guard<std::mutex> lock(self->mu_);
    res.set_content(self->metrics_, "text/plain; version=0.0.4");
  });
  srv.Get("/events", [self](const httplib::Request&, httplib::Response& res) {
    std::ifstream in(self->journal_path_);
    std::stringstream ss;
    ss << in.rdbuf();
    res.set_content(ss.str(), "application/x-ndjson");
  });
  srv.Post("/scale", [self](const httplib::Request& req, httplib::Response& res) {
    auto body = nlohmann::json::parse(req.body, nullptr, false);
    if (body.is_discarded() || !body.is_object()) {
      res.status = 400;
      res.set_content(R"({"accepted": false, "error": "the body is not a JSON object: expected {\"world_size\": N}"})",
                      "application/json");
      return;
    }
    auto call = std::make_unique<ScaleCall>();
    call->body = body;
    call->source = "POST /scale from " + req.remote_addr;
    auto answer = call->reply.get_future();
    {
      std::lock_guard<std::mutex> lock(self->mu_);
      call->id = self->next_id_++;
      self->calls_.push_back(std::move(call));
    }
    uint64_t one = 1;
    ssize_t w = ::write(self->wake_.get(), &one, sizeof(one));
    (void)w;
    if (answer.wait_for(std::chrono::seconds(10)) != std::future_status::ready) {
      res.status = 503;
      res.set_content(R"({"accepted": false, "error": "the controller did not answer in 10 s"})", "application/json");
      return;
    }
    auto [status, reply] = answer.get();
    res.status = status;
    res.set_content(reply.dump(), "application/json");
  });
  int bound = port == 0 ? srv.bind_to_any_port(host) : (srv.bind_to_port(host, port) ? port : -1);
  if (bound <= 0) return UnavailableError(fmt::format("cannot listen for HTTP on {}:{}", host, port));
  api->port_ = bound;
  api->thread_ = std::thread([self] { self->server_->listen_after_bind(); });
  return api;
}

HttpApi::~HttpApi() {
  if (server_) server_->stop();
  if (thread_.joinable()) thread_.join();
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& c : calls_) c->reply.set_value({503, {{"accepted", false}, {"error", "the job has ended"}}});
}

std::string HttpApi::address() const { return fmt::format("{}:{}", host_, port_); }

std::vector<std::unique_ptr<ScaleCall>> HttpApi::TakeCalls() {
  uint64_t v;
  while (::read(wake_.get(), &v, sizeof(v)) > 0) {
  }
  std::lock_guard<std::mutex> lock(mu_);
  return std::move(calls_);
}

void HttpApi::Publish(nlohmann::json status, std::string metrics) {
  std::lock_guard<std::mutex> lock(mu_);
  status_ = status.dump(2);
  metrics_ = std::move(metrics);
}

}  // namespace nonstop::cli
