// `nonstop controller --etcd`: campaign to lead the job through etcd, lead it
// until it ends or this process is deposed, then stand by again
// (docs/controller-failover.md).
#include <sys/signalfd.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <filesystem>

#include <fmt/format.h>

#include "agent/agent.h"
#include "apps/nonstop/commands.h"
#include "common/crypto.h"
#include "common/job_token.h"
#include "common/role_keys.h"
#include "common/signals.h"
#include "common/unique_fd.h"
#include "controller/runtime.h"
#include "controller/takeover.h"
#include "coord/leader_watch.h"
#include "coord/leadership.h"

namespace nonstop::cli {

// Never ends on a transient etcd failure (docs/controller-failover.md, "etcd
// trouble"): the campaign waits through outages (one line each), and a
// leader that loses its lease, or loses it while it takes over, stands by and
// campaigns again. It ends when the job ends, on SIGINT/SIGTERM, and on a
// final error (etcd refuses this client: the message names the key and the
// fix).
int ControllerCommand::LeadThroughEtcd(const std::string& name, controller::RuntimeOptions o) {
  // SIGINT/SIGTERM stop a standby too: read from a signalfd while it waits.
  sigset_t mask = BlockTerminationSignals();
  UniqueFd sigfd(::signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK));
  auto interrupted = [&]() {
    signalfd_siginfo si;
    return sigfd.valid() && ::read(sigfd.get(), &si, sizeof(si)) == sizeof(si);
  };
  coord::LeadershipOptions lo;
  lo.endpoints = etcd_;
  lo.security = etcd_security_.security();
  lo.job = job_;
  lo.ttl_seconds = lease_ttl_s_;
  // etcd keeps a snapshot of the journal and a bounded tail (docs/controller-failover.md).
  lo.compact = controller::CompactJournal;
  while (true) {
    auto leadership = coord::Leadership::Connect(lo);
    if (!leadership.ok()) {  // malformed endpoints, a bad job name: no retry can help
      fmt::print(stderr, "{}: {}\n", name, leadership.status().ToString());
      return controller::kExitUsage;
    }
    fmt::print("{}: job '{}' in etcd {}: campaigning to lead (lease {} s)\n", name, job_, etcd_,
               lease_ttl_s_);
    std::fflush(stdout);
    auto epoch = (*leadership)->Campaign(interrupted, [&](const std::string& leader) {
      // The value checked with the job key, once the first leader wrote the token file (a value
      // without a controller yet is a leader that has not published its address).
      std::string unverified;
      auto v = nlohmann::json::parse(leader, nullptr, false);
      auto token = std::filesystem::exists(token_file_) ? ReadJobTokenFile(token_file_)
                                                        : Result<std::string>(std::string());
      if (token.ok() && !token->empty() && v.is_object() && v.contains("controller")) {
        Status s = coord::VerifyLeaderValue(ControllerPublicKey(crypto::JobKey(*token)), job_,
                                            leader, (*leadership)->seen_epoch());
        if (!s.ok()) unverified = " (NOT followed: " + s.message() + ")";
      }
      fmt::print("{}: standing by; the leader is {}{}\n", name, leader, unverified);
      std::fflush(stdout);
    });
    if (!epoch.ok() && epoch.status().code() == StatusCode::kCancelled) {
      fmt::print("{}: {}\n", name, epoch.status().message());
      return controller::kExitInterrupted;
    }
    if (!epoch.ok()) {
      fmt::print(stderr, "{}: cannot campaign: {}\n", name, epoch.status().ToString());
      return 1;
    }
    fmt::print("{}: leading job '{}' (epoch {})\n", name, job_, *epoch);
    std::fflush(stdout);
    // The job's token: the first leader wrote it; every later one reads it (agents and workers hold
    // it).
    if (auto token = ReadJobTokenFile(token_file_); token.ok()) {
      o.token = *token;
    } else if (token.status().code() != StatusCode::kNotFound) {
      fmt::print(stderr, "{}: {}\n", name, token.status().message());
      return 1;
    }
    o.leadership = leadership->get();
    int code = controller::RunController(o);
    if (code != controller::kExitDeposed) return code;
    if (Status final_error = (*leadership)->final_error(); !final_error.ok()) {
      fmt::print(stderr, "{}: etcd refuses this controller: {}\n", name, final_error.ToString());
      return 1;
    }
    fmt::print("{}: deposed ({}); standing by again\n", name, (*leadership)->why_not_leading());
    std::fflush(stdout);
    // given back at the next contact, if etcd holds it still
    lo.previous_lease = (*leadership)->lease();
  }
}

}  // namespace nonstop::cli
