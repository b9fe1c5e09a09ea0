#include "coord/leader_watch.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "common/file_util.h"
#include "common/logging.h"
#include "common/role_keys.h"
#include "coord/leadership.h"

namespace nonstop::coord {

namespace {

// What a signed value is: its label and its job are signed with it (a value signed for job A does
// not verify for job B of the same token, nor a leader value as the end key's), over the value's
// JSON without its "sig" (nlohmann writes an object's fields in key order: the writer's and the
// reader's texts agree). The signature is the controllers' Ed25519 (role_keys.h): workers and
// agents verify it and cannot make one.
constexpr const char* kLeaderValue = "leader key value";
constexpr const char* kEndValue = "end key value";

std::string SignedText(const char* label, const std::string& job,
                       const nlohmann::json& unsigned_value) {
  return fmt::format("nonstop {}\n{}\n{}", label, job, unsigned_value.dump());
}

std::string SignValue(const char* label, const crypto::Key& job_key, const std::string& job,
                      nlohmann::json value) {
  value.erase("sig");
  std::string sig =
      crypto::Ed25519Sign(ControllerSigningSeed(job_key), SignedText(label, job, value));
  value["sig"] = crypto::Base64Encode(sig);
  return value.dump();
}

// Parses `value` and checks its signature; *unsigned_value is the value without it.
Status CheckValueSignature(const char* label, const std::string& controller_public,
                           const std::string& job, const std::string& value,
                           nlohmann::json* unsigned_value) {
  nlohmann::json& v = *unsigned_value;
  v = nlohmann::json::parse(value, nullptr, false);
  if (!v.is_object() || !v.contains("sig") || !v["sig"].is_string()) {
    return FailedPreconditionError("it carries no signature of the job's controllers");
  }
  const std::string sig = v["sig"].get<std::string>();
  v.erase("sig");
  std::optional<std::string> bytes = crypto::Base64Decode(sig);
  if (!bytes || !crypto::Ed25519Verify(controller_public, SignedText(label, job, v), *bytes)) {
    return FailedPreconditionError("its signature does not verify with the job's controller key");
  }
  return OkStatus();
}

// The last value refused in this process: one log line per refused value (a reader asks again
// and again while the value stays).
Mutex refused_mu;
std::string refused_last NONSTOP_GUARDED_BY(refused_mu);

void SayRefusedOnce(const std::string& job, const char* key, const std::string& value,
                    const Status& why) {
  MutexLock lock(&refused_mu);
  if (refused_last == value) return;
  refused_last = value;
  NONSTOP_LOG_WARNING(
      "job '{}': not following the {} {}: {} (someone who can write etcd but does not hold the "
      "job token wrote it{})",
      job, key, value.substr(0, 200), why.message(),
      std::string_view(key) == "leader key" ? "; the leader puts its own value back" : "");
}

}  // namespace

std::string SignLeaderValue(const crypto::Key& job_key, const std::string& job,
                            nlohmann::json value) {
  return SignValue(kLeaderValue, job_key, job, std::move(value));
}

std::string SignEndValue(const crypto::Key& job_key, const std::string& job,
                         const std::string& record) {
  auto v = nlohmann::json::parse(record, nullptr, false);
  if (!v.is_object()) v = nlohmann::json::object();
  return SignValue(kEndValue, job_key, job, std::move(v));
}

Status VerifyEndValue(const std::string& controller_public, const std::string& job,
                      const std::string& value) {
  nlohmann::json v;
  return CheckValueSignature(kEndValue, controller_public, job, value, &v);
}

Status VerifyLeaderValue(const std::string& controller_public, const std::string& job,
                         const std::string& value, int64_t create_revision) {
  nlohmann::json v;
  NONSTOP_RETURN_IF_ERROR(CheckValueSignature(kLeaderValue, controller_public, job, value, &v));
  if (!v.contains("epoch") || !v["epoch"].is_number_integer() ||
      v["epoch"].get<int64_t>() != create_revision) {
    return FailedPreconditionError(fmt::format(
        "it is a genuine value of epoch {}, written again into the key of epoch {} (a replay)",
        v.contains("epoch") ? v["epoch"].dump() : "none", create_revision));
  }
  return OkStatus();
}

// The same reading as LookUpLeader's (src/coord/leadership.cc), of the same values.
Result<std::string> InterpretLeaderKeys(const LeaderKeys& keys, int* exit_code,
                                        const std::string* controller_public) {
  if (!keys.leader) {
    if (keys.end && controller_public != nullptr) {
      if (Status s = VerifyEndValue(*controller_public, keys.job, *keys.end); !s.ok()) {
        SayRefusedOnce(keys.job, "end key", *keys.end, s);
        return NotFoundError(fmt::format(
            "the end key of job '{}' is not believed: {} (written without the job token)", keys.job,
            s.message()));
      }
    }
    if (keys.end) {
      auto r = nlohmann::json::parse(*keys.end, nullptr, false);
      int code = r.is_object() && r.contains("exit_code") && r["exit_code"].is_number_integer()
                     ? r["exit_code"].get<int>()
                     : 1;
      if (exit_code != nullptr) *exit_code = code;
      std::string reason = r.is_object() && r.contains("reason") && r["reason"].is_string()
                               ? r["reason"].get<std::string>()
                               : std::string();
      return AbortedError(fmt::format("job '{}' ended (exit code {}): {}", keys.job, code, reason));
    }
    return NotFoundError(fmt::format("no controller leads job '{}' now", keys.job));
  }
  auto v = nlohmann::json::parse(*keys.leader, nullptr, false);
  if (!v.is_object() || !v.contains("controller") || !v["controller"].is_string()) {
    return NotFoundError(
        fmt::format("the leader of job '{}' has not published its address yet", keys.job));
  }
  if (controller_public != nullptr) {
    if (Status s = VerifyLeaderValue(*controller_public, keys.job, *keys.leader, keys.leader_epoch);
        !s.ok()) {
      SayRefusedOnce(keys.job, "leader key", *keys.leader, s);
      return NotFoundError(fmt::format(
          "the leader key of job '{}' is not followed: {} (written without the job token)",
          keys.job, s.message()));
    }
  }
  return v["controller"].get<std::string>();
}

std::string EncodeLeaderFile(const LeaderKeys& keys) {
  nlohmann::json j = {{"job", keys.job}, {"revision", keys.revision}};
  j["leader"] = keys.leader ? nlohmann::json(*keys.leader) : nlohmann::json(nullptr);
  j["leader_epoch"] = keys.leader_epoch;
  j["end"] = keys.end ? nlohmann::json(*keys.end) : nlohmann::json(nullptr);
  return j.dump() + "\n";
}

Result<LeaderKeys> DecodeLeaderFile(const std::string& text) {
  auto j = nlohmann::json::parse(text, nullptr, false);
  auto optional = [&](const char* field) -> std::optional<std::string> {
    if (!j.contains(field) || !j[field].is_string()) return std::nullopt;
    return j[field].get<std::string>();
  };
  if (!j.is_object() || !j.contains("job") || !j["job"].is_string() || !j.contains("revision") ||
      !j["revision"].is_number_integer()) {
    return DataLossError("not a leader file (a JSON object with job, revision, leader, end)");
  }
  LeaderKeys keys;
  keys.job = j["job"].get<std::string>();
  keys.revision = j["revision"].get<int64_t>();
  keys.leader = optional("leader");
  if (j.contains("leader_epoch") && j["leader_epoch"].is_number_integer())
    keys.leader_epoch = j["leader_epoch"].get<int64_t>();
  keys.end = optional("end");
  return keys;
}

Result<std::string> LeaderFileReader::Read(int* exit_code) {
  auto text = ReadFile(path_);
  if (!text.ok()) {
    if (text.status().code() == StatusCode::kNotFound) {
      return NotFoundError(
          fmt::format("the agent has not written the leader file {} yet (it reads etcd)", path_));
    }
    return UnavailableError(fmt::format("leader file {}: {}", path_, text.status().message()));
  }
  auto keys = DecodeLeaderFile(*text);
  if (!keys.ok()) {
    return UnavailableError(fmt::format("leader file {}: {}", path_, keys.status().message()));
  }
  if (keys->job != job_) {
    return FailedPreconditionError(fmt::format(
        "leader file {} is job '{}''s, not job '{}''s: the agent that wrote it watches another job "
        "(NONSTOP_LEADER_FILE and NONSTOP_ETCD_JOB must come from the same agent)",
        path_, keys->job, job_));
  }
  return InterpretLeaderKeys(*keys, exit_code, controller_public_ ? &*controller_public_ : nullptr);
}

// A temporary file renamed over `path`: a reader opens the old file or the new one, whole. No
// fsync: the file is rebuilt from etcd after a crash, and it is not worth a disk flush on the
// watch's thread at each leader change.
namespace {

Status WriteLeaderFile(const std::string& path, const std::string& text) {
  std::string tmp = path + ".tmp";
  std::FILE* f = std::fopen(tmp.c_str(), "w");
  if (f == nullptr) {
    return UnavailableError(fmt::format("creating {}: {}", tmp, std::strerror(errno)));
  }
  // Readable by the workers whatever this process's umask (they may be of another user: the
  // values are signed, and nothing in the file is secret).
  (void)::fchmod(::fileno(f), 0644);
  bool written = std::fwrite(text.data(), 1, text.size(), f) == text.size();
  int err = errno;
  if (std::fclose(f) != 0 && written) {
    written = false;
    err = errno;
  }
  if (!written) {
    ::unlink(tmp.c_str());
    return UnavailableError(fmt::format("writing {}: {}", tmp, std::strerror(err)));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    Status st =
        UnavailableError(fmt::format("renaming {} to {}: {}", tmp, path, std::strerror(errno)));
    ::unlink(tmp.c_str());
    return st;
  }
  return OkStatus();
}

}  // namespace

Result<std::unique_ptr<LeaderWatch>> LeaderWatch::Start(
    const std::string& endpoints, const std::string& job, std::string path,
    std::function<void()> on_change, const etcd::Security& security,
    std::optional<std::string> controller_public) {
  NONSTOP_RETURN_IF_ERROR(CheckJobName(job));
  auto w = std::unique_ptr<LeaderWatch>(
      new LeaderWatch(job, std::move(path), std::move(on_change), controller_public));
  LeaderWatch* self = w.get();
  for (bool leader : {true, false}) {
    etcd::WatchOptions o;
    o.endpoints = endpoints;
    o.security = security;
    o.key = leader ? LeaderKey(job) : JobPrefix(job) + "end";
    o.what = fmt::format("the watch of job '{}''s {} key in etcd at {}", job,
                         leader ? "leader" : "end", endpoints);
    auto watch =
        etcd::Watch::Start(std::move(o), [self, leader](const etcd::Snapshot& s, int64_t revision) {
          self->Update(leader, s, revision);
        });
    if (!watch.ok()) return watch.status();
    (leader ? w->leader_watch_ : w->end_watch_) = std::move(*watch);
  }
  return w;
}

LeaderWatch::~LeaderWatch() {
  // Both asked first, then waited for: the two stop together (not one stop's time after the other).
  for (auto* w : {leader_watch_.get(), end_watch_.get()}) {
    if (w != nullptr) w->RequestStop();
  }
  for (auto* w : {leader_watch_.get(), end_watch_.get()}) {
    if (w != nullptr) w->Stop();
  }
}

LeaderKeys LeaderWatch::keys() const {
  MutexLock lock(&mu_);
  return keys_;
}

int64_t LeaderWatch::requests() const {
  int64_t n = 0;
  for (const auto* w : {leader_watch_.get(), end_watch_.get()}) {
    if (w != nullptr) n += w->streams() + w->reads();
  }
  return n;
}

void LeaderWatch::Update(bool leader, const etcd::Snapshot& s, int64_t revision) {
  MutexLock file(&file_mu_);
  LeaderKeys now;
  {
    MutexLock lock(&mu_);
    std::optional<std::string> value;
    if (!s.empty()) value = s.begin()->second.value;
    if (leader) keys_.leader_epoch = s.empty() ? 0 : s.begin()->second.create_revision;
    (leader ? keys_.leader : keys_.end) = std::move(value);
    (leader ? seen_leader_ : seen_end_) = true;
    keys_.revision = std::max(keys_.revision, revision);
    // Not before both keys were read: "nobody leads" may be "the job ended" not read yet.
    if (!seen_leader_ || !seen_end_) return;
    now = keys_;
  }
  // A value that does not verify is said here, the host's one reader of etcd (its readers of the
  // file refuse it too, and say it once each).
  if (controller_public_ && leader) (void)InterpretLeaderKeys(now, nullptr, &*controller_public_);
  LeaderKeys shown = now;
  shown.revision = 0;  // a change of the revision alone is no change of the file
  std::string text = EncodeLeaderFile(shown);
  if (text == written_) return;
  if (Status st = WriteLeaderFile(path_, EncodeLeaderFile(now)); !st.ok()) {
    NONSTOP_LOG_WARNING("writing the leader file: {} (its readers keep the last one)",
                        st.ToString());
    return;
  }
  written_ = std::move(text);
  NONSTOP_LOG_DEBUG("leader file {}: {}", path_, written_);
  file.Unlock();
  if (on_change_) on_change_();
}

}  // namespace nonstop::coord
