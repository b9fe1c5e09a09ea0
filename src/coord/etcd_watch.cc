#include "coord/etcd_watch.h"

#include <httplib.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include <algorithm>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "common/logging.h"
#include "coord/retry.h"

namespace nonstop::etcd {

namespace {

void SetTimeouts(httplib::Client& http, Millis connect, Millis read) {
  http.set_connection_timeout(connect.count() / 1000, (connect.count() % 1000) * 1000);
  http.set_read_timeout(read.count() / 1000, (read.count() % 1000) * 1000);
  http.set_write_timeout(connect.count() / 1000, (connect.count() % 1000) * 1000);
}

// TCP keepalive on a stream's socket: a member whose host died or was partitioned away (no FIN, no
// RST) is found within about 10 + 3·5 s, long before the idle timeout. (A paused member's kernel
// still answers the probes: the idle timeout finds that one.)
void KeepAlive(int fd) {
  int on = 1, idle = 10, interval = 5, count = 3;
  ::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &on, sizeof(on));
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof(idle));
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof(interval));
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &count, sizeof(count));
}

uint64_t ClusterId(const nlohmann::json& header) {
  auto it = header.find("cluster_id");
  if (it == header.end()) return 0;
  if (it->is_number_unsigned()) return it->get<uint64_t>();
  if (it->is_string()) return std::stoull(it->get<std::string>());
  return 0;
}

}  // namespace

Result<std::unique_ptr<Watch>> Watch::Start(WatchOptions options, OnChange on_change) {
  if (options.key.empty()) return InvalidArgumentError("an etcd watch of no key");
  if (options.request_timeout <= Millis(0) || options.idle_timeout <= Millis(0) ||
      options.backoff_initial <= Millis(0) || options.backoff_max < options.backoff_initial ||
      options.idle_jitter < 0 || options.idle_jitter > 1) {
    return InvalidArgumentError(
        "etcd watch: timeouts must be positive, the back-off's max at least its initial, the idle "
        "jitter in [0, 1]");
  }
  auto client = Client::Create(options.endpoints, {options.request_timeout, options.security});
  if (!client.ok()) return InvalidArgumentError(client.status().message());
  auto w = std::unique_ptr<Watch>(new Watch(std::move(options), std::move(on_change)));
  w->client_ = std::move(*client);
  w->thread_ = std::thread([p = w.get()] { p->Run(); });
  return w;
}

Watch::~Watch() { Stop(); }

void Watch::RequestStop() {
  stopping_.store(true);
  MutexLock lock(&mu_);
  if (http_ != nullptr) http_->stop();
}

void Watch::Stop() {
  RequestStop();
  // From on_change, the thread cannot wait for itself: it ends once on_change returns.
  if (std::this_thread::get_id() == thread_.get_id()) return;
  MutexLock join(&join_mu_);
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
    if (end == StreamEnd::kAnotherStore) {
      // Restored from a snapshot, or a fresh cluster: the revision to resume from may never come
      // (or mean something else). Read the range again. Or a member behind the others: the next
      // one, and a back-off, so that a member stuck behind does not make a read per stream.
      NONSTOP_LOG_WARNING("{}: {}; reading the key again", options_.what, why.message());
      current_ = (current_ + 1) % client_->endpoint_count();
      if (!Pause(backoff_.Next())) break;
      need_read = true;
      continue;
    }
    // etcd restarted, or this member is down, paused, partitioned: the next member, after the
    // back-off, from the revision after the last one seen
    outage_.Failed(why);
    // etcd no longer takes the stream's token: the next stream authenticates again
    if (why.message().find("auth token") != std::string::npos) client_->ForgetToken();
    current_ = (current_ + 1) % client_->endpoint_count();
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
      // (The back-off is reset by an answered stream: a read again after kAnotherStore keeps it.)
      outage_.Succeeded();
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
  // With an etcd user, the stream carries its token (the Range's client authenticates).
  auto token = client_->AuthToken();
  if (!token.ok()) {
    *why = token.status();
    return StreamEnd::kFailed;
  }
  std::unique_ptr<httplib::Client> connection = client_->NewConnection(current_);
  httplib::Client& http = *connection;
  idle_ = options_.idle_timeout +
          Millis(static_cast<int64_t>(static_cast<double>(options_.idle_timeout.count()) *
                                      options_.idle_jitter *
                                      std::uniform_real_distribution<double>(0, 1)(rng_)));
  SetTimeouts(http, options_.request_timeout, idle_);
  http.set_socket_options([](int fd) { KeepAlive(fd); });
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
  if (!token->empty()) req.set_header("Authorization", *token);
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
      why->ok() && Clock::now() - last_message_ >= idle_ - Millis(100)) {
    return StreamEnd::kIdle;
  }
  if (end != StreamEnd::kFailed || !why->ok()) return end;
  const std::string& where = client_->endpoint_name(current_);
  if (status != 0 && status != 200) {
    *why = AnswerStatus(where, "watch", status, error_body);
  } else if (!res && res.error() != httplib::Error::Read &&
             res.error() != httplib::Error::Canceled) {
    *why = client_->TransportFailure(current_, http, res.error());
  } else if (!res) {
    *why = UnavailableError(
        fmt::format("etcd {}: the watch ended ({}{})", where, httplib::to_string(res.error()),
                    res.error() == httplib::Error::Read
                        ? fmt::format(": closed, reset, or silent for {} ms", idle_.count())
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
      int http = e->is_object() ? static_cast<int>(JsonInt(*e, "http_code")) : 500;
      int grpc = e->is_object() ? static_cast<int>(JsonInt(*e, "grpc_code")) : -1;
      *why = AnswerStatus(
          "watch", "watch", http == 0 ? 500 : http,
          nlohmann::json({{"message", message}, {"code", grpc == 0 ? 14 : grpc}}).dump());
      return false;
    }
    const nlohmann::json& r = j.contains("result") ? j["result"] : j;
    if (r.value("canceled", false)) {
      if (JsonInt(r, "compact_revision") > 0) {
        *end = StreamEnd::kCompacted;
        return false;
      }
      *why = UnavailableError(fmt::format("etcd canceled the watch: {}",
                                          r.value("cancel_reason", std::string("no reason"))));
      return false;
    }
    if (r.value("created", false)) {
      // The store's revision now, and its cluster: below the revision seen, or another cluster,
      // this is not the store that revision_ counts in.
      const nlohmann::json& header = r.value("header", nlohmann::json::object());
      int64_t now_at = JsonInt(header, "revision");
      uint64_t cluster = ClusterId(header);
      if ((now_at > 0 && now_at < revision_) ||
          (cluster != 0 && cluster_id_ != 0 && cluster != cluster_id_)) {
        *why = UnavailableError(fmt::format(
            "etcd is at revision {} (cluster {:x}), the watch had seen revision {} (cluster "
            "{:x}): restored from a snapshot, a new cluster, or a member behind",
            now_at, cluster, revision_, cluster_id_));
        cluster_id_ = cluster;
        *end = StreamEnd::kAnotherStore;
        return false;
      }
      if (cluster != 0) cluster_id_ = cluster;
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
            std::max(revision_, JsonInt(r.value("header", nlohmann::json::object()), "revision"));
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
      kv.create_revision = JsonInt(kvj, "create_revision");
      kv.mod_revision = JsonInt(kvj, "mod_revision");
      kv.version = JsonInt(kvj, "version");
      kv.lease = JsonInt(kvj, "lease");
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
