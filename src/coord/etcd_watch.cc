#include "coord/etcd_watch.h"

#include <httplib.h>

#include <algorithm>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "common/logging.h"
#include "coord/retry.h"

namespace nonstop::etcd {

namespace {

// The gateway writes 64-bit integers as strings ("revision":"12") and leaves zeros out.
int64_t Int(const nlohmann::json& j, const char* field) {
  auto it = j.find(field);
  if (it == j.end()) return 0;
  if (it->is_number_integer()) return it->get<int64_t>();
  if (it->is_string()) return std::stoll(it->get<std::string>());
  throw std::invalid_argument(fmt::format("'{}' is not an integer", field));
}

// "host:port" or "http://host:port", comma separated; etcd::Client::Create checked them first.
std::vector<std::pair<std::string, int>> SplitEndpoints(const std::string& endpoints) {
  std::vector<std::pair<std::string, int>> out;
  size_t begin = 0;
  while (begin <= endpoints.size()) {
    size_t end = std::min(endpoints.find(',', begin), endpoints.size());
    std::string one = endpoints.substr(begin, end - begin);
    begin = end + 1;
    if (one.rfind("http://", 0) == 0) one = one.substr(7);
    while (!one.empty() && one.back() == '/') one.pop_back();
    auto colon = one.rfind(':');
    out.emplace_back(one.substr(0, colon), std::stoi(one.substr(colon + 1)));
  }
  return out;
}

void SetTimeouts(httplib::Client& http, Millis connect, Millis read) {
  http.set_connection_timeout(connect.count() / 1000, (connect.count() % 1000) * 1000);
  http.set_read_timeout(read.count() / 1000, (read.count() % 1000) * 1000);
  http.set_write_timeout(connect.count() / 1000, (connect.count() % 1000) * 1000);
}

}  // namespace

Result<std::unique_ptr<Watch>> Watch::Start(WatchOptions options, OnChange on_change) {
  if (options.key.empty()) return InvalidArgumentError("an etcd watch of no key");
  if (options.request_timeout <= Millis(0) || options.idle_timeout <= Millis(0) ||
      options.backoff_initial <= Millis(0) || options.backoff_max < options.backoff_initial) {
    return InvalidArgumentError(
        "etcd watch: timeouts must be positive, the back-off's max at least its initial");
  }
  auto client = Client::Create(options.endpoints, {options.request_timeout});
  if (!client.ok()) return InvalidArgumentError(client.status().message());
  auto w = std::unique_ptr<Watch>(new Watch(std::move(options), std::move(on_change)));
  for (auto& [host, port] : SplitEndpoints(w->options_.endpoints))
    w->endpoints_.push_back({host, port});
  w->client_ = std::move(*client);
  w->thread_ = std::thread([p = w.get()] { p->Run(); });
  return w;
}

Watch::~Watch() { Stop(); }

void Watch::Stop() {
  stopping_.store(true);
  if (!thread_.joinable()) return;
  // A stream blocks in recv until etcd sends something: shut its socket down. httplib holds its
  // socket's lock while it connects, so a stop() then takes effect only once connected (bounded
  // by request_timeout); it is repeated until the thread is gone.
  while (true) {
    {
      MutexLock lock(&mu_);
      if (http_ != nullptr) http_->stop();
      if (http_ == nullptr && done_) break;
    }
    std::this_thread::sleep_for(Millis(10));
  }
  thread_.join();
}

bool Watch::Pause(Millis d) {
  return SleepUnless(d, [this] { return stopping(); });
}

void Watch::Run() {
  bool need_read = true;
  while (!stopping()) {
    if (need_read) {
      if (!Read()) break;
      need_read = false;
    }
    Status why;
    StreamEnd end = Stream(&why);
    if (end == StreamEnd::kStopped) break;
    if (end == StreamEnd::kIdle) continue;  // nothing changed for idle_timeout: open it again
    if (end == StreamEnd::kCompacted) {
      // the revision to resume from is gone: read the range whole again, then watch from there
      NONSTOP_LOG_INFO("{}: revision {} was compacted; reading the key again", options_.what,
                       revision_ + 1);
      need_read = true;
      continue;
    }
    // etcd restarted, or this member is down, paused, partitioned: the next member, after the
    // back-off, from the revision after the last one seen
    outage_.Failed(why);
    current_ = (current_ + 1) % endpoints_.size();
    if (!Pause(backoff_.Next())) break;
  }
  MutexLock lock(&mu_);
  done_ = true;
}

bool Watch::Read() {
  while (!stopping()) {
    int64_t revision = 0;
    reads_.fetch_add(1);
    auto kvs = client_->Range(options_.key, options_.range_end, &revision);
    if (kvs.ok()) {
      outage_.Succeeded();
      backoff_.Reset();
      snapshot_.clear();
      for (auto& kv : *kvs) snapshot_[kv.key] = std::move(kv);
      revision_ = revision;
      on_change_(snapshot_, revision_);
      return true;
    }
    // A final error too (permission denied): logged once; an operator may fix the role.
    outage_.Failed(kvs.status());
    if (!Pause(backoff_.Next())) return false;
  }
  return false;
}

Watch::StreamEnd Watch::Stream(Status* why) {
  const Endpoint& e = endpoints_[current_];
  httplib::Client http(e.host, e.port);
  SetTimeouts(http, options_.request_timeout, options_.idle_timeout);
  {
    MutexLock lock(&mu_);
    if (stopping()) return StreamEnd::kStopped;
    http_ = &http;
  }
  struct Unregister {
    Watch* w;
    ~Unregister() {
      MutexLock lock(&w->mu_);
      w->http_ = nullptr;
    }
  } unregister{this};

  nlohmann::json create = {{"key", Base64Encode(options_.key)},
                           {"start_revision", std::to_string(revision_ + 1)},
                           {"progress_notify", true}};
  if (!options_.range_end.empty()) create["range_end"] = Base64Encode(options_.range_end);
  httplib::Request req;
  req.method = "POST";
  req.path = "/v3/watch";
  req.set_header("Content-Type", "application/json");
  req.body = nlohmann::json({{"create_request", create}}).dump();
  int status = 0;
  std::string error_body;
  StreamEnd end = StreamEnd::kFailed;
  created_ = false;
  pending_.clear();
  last_message_ = Clock::now();
  req.response_handler = [&status](const httplib::Response& r) {
    status = r.status;
    return true;
  };
  req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
    if (stopping()) {
      end = StreamEnd::kStopped;
      return false;
    }
    if (status != 200) {
      error_body.append(data, n);
      return error_body.size() < (64u << 10);
    }
    last_message_ = Clock::now();
    pending_.append(data, n);
    size_t nl;
    while ((nl = pending_.find('\n')) != std::string::npos) {
      std::string line = pending_.substr(0, nl);
      pending_.erase(0, nl + 1);
      if (!Take(line, &end, why)) return false;
    }
    return pending_.size() < (16u << 20);  // a message of 16 MiB: not etcd's
  };
  streams_.fetch_add(1);
  auto res = http.send(req);
  if (stopping()) return StreamEnd::kStopped;
  // An answered stream that timed out reading: etcd had nothing to say for idle_timeout (a reset
  // or a close comes sooner). Opened again at once, without a log line.
  if (!res && res.error() == httplib::Error::Read && created_ && end == StreamEnd::kFailed &&
      why->ok() && Clock::now() - last_message_ >= options_.idle_timeout - Millis(100)) {
    return StreamEnd::kIdle;
  }
  if (end != StreamEnd::kFailed || !why->ok()) return end;
  std::string where = fmt::format("{}:{}", e.host, e.port);
  if (status != 0 && status != 200) {
    *why = AnswerStatus(where, "watch", status, error_body);
  } else if (!res) {
    *why = UnavailableError(fmt::format(
        "etcd {}: the watch ended ({}{})", where, httplib::to_string(res.error()),
        res.error() == httplib::Error::Read
            ? fmt::format(": closed, reset, or silent for {} ms", options_.idle_timeout.count())
            : ""));
  } else {
    *why = UnavailableError(fmt::format("etcd {}: the watch ended", where));
  }
  return StreamEnd::kFailed;
}

bool Watch::Take(const std::string& line, StreamEnd* end, Status* why) {
  if (line.find_first_not_of(" \r\t") == std::string::npos) return true;
  auto j = nlohmann::json::parse(line, nullptr, false);
  if (!j.is_object()) {
    *why = DataLossError("etcd's watch sent a line that is not a JSON object");
    return false;
  }
  try {
    if (auto e = j.find("error"); e != j.end()) {
      // A stream's error: {"grpc_code", "http_code", "message", "http_status"}.
      std::string message = e->is_object() ? e->value("message", e->dump()) : e->dump();
      int http = e->is_object() ? static_cast<int>(Int(*e, "http_code")) : 500;
      int grpc = e->is_object() ? static_cast<int>(Int(*e, "grpc_code")) : -1;
      *why = AnswerStatus(
          "watch", "watch", http == 0 ? 500 : http,
          nlohmann::json({{"message", message}, {"code", grpc == 0 ? 14 : grpc}}).dump());
      return false;
    }
    const nlohmann::json& r = j.contains("result") ? j["result"] : j;
    if (r.value("canceled", false)) {
      if (Int(r, "compact_revision") > 0) {
        *end = StreamEnd::kCompacted;
        return false;
      }
      *why = UnavailableError(fmt::format("etcd canceled the watch: {}",
                                          r.value("cancel_reason", std::string("no reason"))));
      return false;
    }
    if (r.value("created", false)) {
      created_ = true;
      outage_.Succeeded();
      backoff_.Reset();
    }
    auto events = r.find("events");
    if (events == r.end() || events->empty()) {
      // A progress notification: every change up to the header's revision was sent. (The
      // creation's header is not one: an old start revision's changes may still follow.)
      if (!r.value("created", false)) {
        revision_ =
            std::max(revision_, Int(r.value("header", nlohmann::json::object()), "revision"));
      }
      return true;
    }
    for (const auto& ev : *events) {
      const nlohmann::json& kvj = ev.value("kv", nlohmann::json::object());
      KeyValue kv;
      auto key = Base64Decode(kvj.value("key", ""));
      auto value = Base64Decode(kvj.value("value", ""));
      if (!key.ok() || !value.ok()) {
        *why = DataLossError("etcd's watch sent a key or value that is not base64");
        return false;
      }
      kv.key = std::move(*key);
      kv.value = std::move(*value);
      kv.create_revision = Int(kvj, "create_revision");
      kv.mod_revision = Int(kvj, "mod_revision");
      kv.version = Int(kvj, "version");
      kv.lease = Int(kvj, "lease");
      // PUT is the enum's zero, which the gateway leaves out.
      bool deleted = ev.contains("type") && ev["type"] == "DELETE";
      revision_ = std::max(revision_, kv.mod_revision);
      if (deleted) {
        snapshot_.erase(kv.key);
      } else {
        snapshot_[kv.key] = std::move(kv);
      }
    }
    on_change_(snapshot_, revision_);
    return true;
  } catch (const std::exception& e) {
    *why = DataLossError(fmt::format("etcd's watch sent a malformed message: {}", e.what()));
    return false;
  }
}

}  // namespace nonstop::etcd
