// SessionOptions::FromEnvironment (include/nonstop/session.h): a worker's options from the
// variables its launcher set (docs/settings.md), each checked against its registry entry.
#include <cstdlib>
#include <string>
#include <tuple>
#include <utility>

#include <fmt/format.h>

#include "common/job_token.h"
#include "net/address.h"
#include "nonstop/session.h"
#include "nonstop/settings.h"

namespace nonstop {

namespace {

// The job token this process was started with (TakeInheritedJobToken), taken
// once. kTakenAtLoad takes it as this library loads (static initialization:
// before main, or as Python imports the package), before the program can
// start a child that would inherit the descriptor or the variable.
const Result<std::string>& InheritedJobToken() {
  static const Result<std::string> token = TakeInheritedJobToken();
  return token;
}
[[maybe_unused]] const bool kTakenAtLoad = InheritedJobToken().ok();

// An int setting's variable, `text`, within the setting's range: INVALID_ARGUMENT
// "NAME='text' is not WHAT from LO to HI" (and `note`) otherwise.
Result<int> ParseIntSetting(const settings::Setting<int>& entry, const std::string& text,
                            std::string_view what, std::string_view note = "") {
  size_t used = 0;
  int value = -1;
  try {
    value = std::stoi(text, &used);
  } catch (...) {
  }
  const auto range = *entry.range;
  if (used != text.size() || value < range.lo || value > range.hi) {
    return InvalidArgumentError(fmt::format("{}='{}' is not {} from {} to {}{}", entry.env, text,
                                            what, range.lo, range.hi, note));
  }
  return value;
}

}  // namespace

Result<SessionOptions> SessionOptions::FromEnvironment() {
  namespace s = settings;
  SessionOptions o;
  auto get = [](const auto& entry) -> std::string {
    const char* v = std::getenv(entry.env.data());  // an entry's env is a NUL-terminated literal
    return v != nullptr ? v : "";
  };
  const Result<std::string>& inherited = InheritedJobToken();
  if (!inherited.ok()) return inherited.status();
  o.controller_address = get(s::kControllerAddress);
  // A variable set after the library loaded (a worker started by hand, a test) serves too.
  o.secret = !inherited->empty() ? *inherited : get(s::kJobToken);
  std::string id = get(s::kWorkerId);
  if (o.controller_address.empty() || o.secret.empty() || id.empty()) {
    return FailedPreconditionError(fmt::format(
        "{}, the job token ({} or {}) and {} are not all set: start this program "
        "under `nonstop run` (HINT: nonstop run --nproc 4 -- <program> <args>)",
        s::kControllerAddress.env, s::kJobTokenFd.env, s::kJobToken.env, s::kWorkerId.env));
  }
  try {
    o.worker_id = std::stoi(id);
  } catch (...) {
    return InvalidArgumentError(fmt::format("{}='{}' is not an integer", s::kWorkerId.env, id));
  }
  o.spare = get(s::kSpare) == "1";
  for (auto [entry, field] : {std::pair{&s::kConnectTimeoutMs, &o.join_timeout},
                              std::pair{&s::kWorkerControllerTimeoutMs, &o.controller_timeout},
                              std::pair{&s::kLeaderlessTimeoutMs, &o.leaderless_timeout},
                              std::pair{&s::kSpareCheckMs, &o.spare_check_interval}}) {
    std::string v = get(*entry);
    if (v.empty()) continue;
    try {
      size_t used = 0;
      long long ms = std::stoll(v, &used);
      if (used != v.size() || ms < (entry->range ? entry->range->lo : 1) ||
          (entry->range && ms > entry->range->hi))
        throw std::invalid_argument(v);
      *field = std::chrono::milliseconds(ms);
    } catch (...) {
      return InvalidArgumentError(
          entry->range
              ? fmt::format("{}='{}' is not a number of milliseconds from {} to {}", entry->env, v,
                            entry->range->lo, entry->range->hi)
              : fmt::format("{}='{}' is not a positive number of milliseconds", entry->env, v));
    }
  }
  if (std::string every = get(s::kReplicaCheckEvery); !every.empty()) {
    NONSTOP_ASSIGN_OR_RETURN(o.replica_check_every,
                             ParseIntSetting(s::kReplicaCheckEvery, every, "a number of steps",
                                             " (0: never compare the replicas)"));
  }
  for (auto [entry, field, what] :
       {std::tuple{&s::kCheckedCollectives, &o.checked_collectives,
                   "whether the all-reduce's pieces are checked and fetched again when damaged"},
        std::tuple{&s::kSealedStateCopy, &o.sealed_state_copy,
                   "whether every chunk of a state copy carries a tag under the job key"}}) {
    const std::string v = get(*entry);
    if (v.empty()) continue;
    if (v != "1" && v != "0" && v != "true" && v != "false") {
      return InvalidArgumentError(
          fmt::format("{}='{}' is not 1 or 0 (true or false): {}", entry->env, v, what));
    }
    *field = v == "1" || v == "true";
  }
  if (std::string port = get(s::kMasterPort); !port.empty()) {
    NONSTOP_ASSIGN_OR_RETURN(o.master_port, ParseIntSetting(s::kMasterPort, port, "a port"));
  }
  if (std::string host = get(s::kDataHost); !host.empty()) {
    Result<std::string> h = net::ParseHost(host);  // "fd00::1" or "[fd00::1]" alike
    if (!h.ok())
      return InvalidArgumentError(fmt::format("{}: {}", s::kDataHost.env, h.status().message()));
    o.data_host = *h;
  }
  if (std::string ports = get(s::kDataPorts); !ports.empty()) {
    Result<net::PortRange> r = net::ParsePortRange(ports);
    if (!r.ok())
      return InvalidArgumentError(fmt::format("{}: {}", s::kDataPorts.env, r.status().message()));
    o.data_port_lo = r->lo;
    o.data_port_hi = r->hi;
  }
  o.advertise_address = get(s::kWorkerAdvertiseAddress);
  o.host_id = get(s::kHostId);
  o.etcd_endpoints = get(s::kEtcd);
  if (std::string job = get(s::kEtcdJob); !job.empty()) o.etcd_job = job;
  o.leader_file = get(s::kLeaderFile);
  o.etcd_cacert = get(s::kEtcdCacert);
  o.etcd_cert = get(s::kEtcdCert);
  o.etcd_key = get(s::kEtcdKey);
  o.etcd_auth_file = get(s::kEtcdAuthFile);
  o.etcd_allow_plaintext = get(s::kEtcdAllowPlaintext) == "1";
  return o;
}

}  // namespace nonstop
