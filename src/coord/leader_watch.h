// Leader discovery by watch, one etcd client per host (docs/leader-discovery.md).
// The host's agent watches the job's leader key and end key (etcd::Watch)
// and writes what they hold to a local file, the leader file, atomically
// (a temporary file, then rename). Its workers, and the agent's own link
// (control::ControllerLink's leader_file), read that file instead of asking
// etcd: during a failover etcd hears from one watch per host, not from a
// poll of every agent and worker.
//
// The file: one JSON object, {"job": "j", "revision": n, "leader": "<the
// leader key's value>" or null, "leader_epoch": <its create revision>,
// "end": "<the end key's value>" or null}: the keys' values as etcd holds
// them, read by LeaderFileReader exactly as coord::LookUpLeader reads the
// keys themselves.
//
// The leader key's value is signed by the controllers (docs/leader-discovery.md,
// "A forged leader key"): {"controller", "http", "pid", "epoch", "sig"}, an
// Ed25519 signature over the job's name and every other field with the key
// only holders of the job key can make (common/role_keys.h), the epoch the
// key's create revision. Whoever can write etcd (or the leader file) but does
// not hold the job token, a worker included, cannot make a value a reader
// follows; an old genuine value written again names an epoch that is not the
// key's create revision, and is refused too.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "common/crypto.h"
#include "common/mutex.h"
#include "coord/etcd_watch.h"
#include "nonstop/status.h"

namespace nonstop::coord {

// What the two keys hold (nullopt: absent).
struct LeaderKeys {
  std::string job;
  int64_t revision = 0;
  std::optional<std::string> leader;
  int64_t leader_epoch = 0;  // the leader key's create revision (0: absent)
  std::optional<std::string> end;
};

// The leader key's value `value` (with its "epoch"), its "sig" added (the controllers' key, from
// job_key): what Leadership::Publish writes.
std::string SignLeaderValue(const crypto::Key& job_key, const std::string& job,
                            nlohmann::json value);
// Whether `value` is one a leader of `job` wrote for the key created at `create_revision`: its
// signature verifies with `controller_public` (ControllerPublicKey) and its epoch is that
// revision. FailedPrecondition says which failed.
Status VerifyLeaderValue(const std::string& controller_public, const std::string& job,
                         const std::string& value, int64_t create_revision);
// The end key's value (the job_end record) signed as the leader key's is ("sig", under another
// label); and its check. A reader given the controllers' public key believes an end key only if it
// verifies: one written without the job token ends nobody's search (it is "nobody leads").
std::string SignEndValue(const crypto::Key& job_key, const std::string& job,
                         const std::string& record);
Status VerifyEndValue(const std::string& controller_public, const std::string& job,
                      const std::string& value);

// Who leads, as the two keys say (LookUpLeader reads them from etcd and asks this): the control
// address; NotFound (nobody leads, the leader has not published its address yet, or, with a
// controller_public, the value does not verify: not followed, and said once per value in the
// log); Aborted when the job ended (*exit_code its code). controller_public null: the value is
// taken unverified (tests and tools that hold no job token; every runtime reader passes it).
Result<std::string> InterpretLeaderKeys(const LeaderKeys& keys, int* exit_code = nullptr,
                                        const std::string* controller_public = nullptr);

std::string EncodeLeaderFile(const LeaderKeys& keys);
Result<LeaderKeys> DecodeLeaderFile(const std::string& text);

// Reads the leader file at `path` and interprets it; a file that is not there yet is NotFound
// (the agent has not read etcd yet); a file of another job than `job` is FailedPrecondition.
// Reads the file whole each time: it is local and under 200 bytes, and a cache keyed on its
// inode and mtime could miss an update (rename-over reuses inode numbers; mtime can be coarse).
class LeaderFileReader {
 public:
  // controller_public: the value is verified with it (nullopt: taken unverified, as
  // InterpretLeaderKeys).
  LeaderFileReader(std::string path, std::string job,
                   std::optional<std::string> controller_public = std::nullopt)
      : path_(std::move(path)), job_(std::move(job)), controller_public_(controller_public) {}
  Result<std::string> Read(int* exit_code = nullptr);
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::string job_;
  std::optional<std::string> controller_public_;
};

// The agent's watch of a job's leader and end keys, kept in the leader file.
class LeaderWatch {
 public:
  // on_change: called (on a watch's thread) after each write of the file. security: as
  // etcd::Client takes it. controller_public: a leader key that does not verify with it is said in
  // the log (the file keeps it as etcd holds it: its readers refuse it too). Errors: the options.
  static Result<std::unique_ptr<LeaderWatch>> Start(
      const std::string& endpoints, const std::string& job, std::string path,
      std::function<void()> on_change = {}, const etcd::Security& security = {},
      std::optional<std::string> controller_public = std::nullopt);
  ~LeaderWatch();  // stops the watches; the file stays (the owner removes it)
  LeaderWatch(const LeaderWatch&) = delete;
  LeaderWatch& operator=(const LeaderWatch&) = delete;

  const std::string& path() const { return path_; }
  LeaderKeys keys() const NONSTOP_LOCKS_EXCLUDED(mu_);
  // Requests etcd got from these watches (for tests): streams opened and ranges read.
  int64_t requests() const;

 private:
  LeaderWatch(std::string job, std::string path, std::function<void()> on_change,
              std::optional<std::string> controller_public)
      : path_(std::move(path)),
        on_change_(std::move(on_change)),
        controller_public_(controller_public) {
    keys_.job = std::move(job);
  }
  void Update(bool leader, const etcd::Snapshot& s, int64_t revision)
      NONSTOP_LOCKS_EXCLUDED(mu_, file_mu_);

  const std::string path_;
  const std::function<void()> on_change_;
  const std::optional<std::string> controller_public_;
  // Held while the file is written (the two watches' threads write it in turn, each the keys as
  // they are when it writes: the last write is of the latest keys). mu_ is not held meanwhile.
  Mutex file_mu_ NONSTOP_ACQUIRED_BEFORE(mu_);
  mutable Mutex mu_;
  LeaderKeys keys_ NONSTOP_GUARDED_BY(mu_);
  bool seen_leader_ NONSTOP_GUARDED_BY(mu_) = false;  // both keys were read once
  bool seen_end_ NONSTOP_GUARDED_BY(mu_) = false;
  std::string written_
      NONSTOP_GUARDED_BY(file_mu_);  // the file's contents (not rewritten if equal)
  std::unique_ptr<etcd::Watch> leader_watch_, end_watch_;
};

}  // namespace nonstop::coord
