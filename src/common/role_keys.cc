#include "common/role_keys.h"

#include <algorithm>
#include <optional>
#include <sstream>

#include <fmt/format.h>

namespace nonstop {

namespace {

constexpr std::string_view kCredentialMagic = "nonstop-worker-credential";

std::string KeyBytes(const crypto::Key& key) {
  return {reinterpret_cast<const char*>(key.data()), key.size()};
}

bool ToKey(const std::optional<std::string>& bytes, crypto::Key* key) {
  if (!bytes || bytes->size() != key->size()) return false;
  std::copy(bytes->begin(), bytes->end(), key->begin());
  return true;
}

}  // namespace

crypto::Key WorkerControlKey(const crypto::Key& job_key, int worker_id) {
  return crypto::DeriveKey(job_key, "worker control", std::to_string(worker_id));
}

crypto::Key WorkerDataKey(const crypto::Key& job_key) {
  return crypto::DeriveKey(job_key, "worker data");
}

crypto::Key ControllerSigningSeed(const crypto::Key& job_key) {
  return crypto::DeriveKey(job_key, "controller signing");
}

std::string ControllerPublicKey(const crypto::Key& job_key) {
  return crypto::Ed25519PublicKey(ControllerSigningSeed(job_key));
}

WorkerKeys WorkerKeysOf(const crypto::Key& job_key, int worker_id) {
  return {worker_id, WorkerControlKey(job_key, worker_id), WorkerDataKey(job_key),
          ControllerPublicKey(job_key)};
}

std::string EncodeWorkerCredential(const WorkerKeys& keys) {
  return fmt::format("{} 1 {} {} {} {}\n", kCredentialMagic, keys.worker_id,
                     crypto::Base64Encode(KeyBytes(keys.control)),
                     crypto::Base64Encode(KeyBytes(keys.data)),
                     crypto::Base64Encode(keys.controller_public));
}

bool IsWorkerCredential(std::string_view secret) {
  return secret.substr(0, kCredentialMagic.size()) == kCredentialMagic;
}

Result<WorkerKeys> WorkerKeysFrom(std::string_view secret, int worker_id) {
  if (secret.empty()) {
    return InvalidArgumentError(
        "no worker credential and no job token: start it under its launcher");
  }
  if (!IsWorkerCredential(secret)) return WorkerKeysOf(crypto::JobKey(secret), worker_id);
  std::istringstream in{std::string(secret)};
  std::string magic, version, id, control, data, pub;
  WorkerKeys keys;
  in >> magic >> version >> id >> control >> data >> pub;
  std::optional<std::string> public_key = crypto::Base64Decode(pub);
  if (version != "1" || !ToKey(crypto::Base64Decode(control), &keys.control) ||
      !ToKey(crypto::Base64Decode(data), &keys.data) || !public_key ||
      public_key->size() != crypto::kEd25519PublicBytes) {
    return InvalidArgumentError(
        "the worker credential this process was started with does not parse (version " + version +
        "): start it with the same nonstop as its launcher");
  }
  if (id != std::to_string(worker_id)) {
    return FailedPreconditionError(fmt::format(
        "the worker credential this process was started with is worker {}'s, but it is "
        "worker {}: a credential serves the worker it was made for only (start it under its "
        "launcher, which sets both)",
        id, worker_id));
  }
  keys.worker_id = worker_id;
  keys.controller_public = std::move(*public_key);
  return keys;
}

}  // namespace nonstop
