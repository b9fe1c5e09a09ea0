// Keys by role (docs/security.md, "Keys by role"). The job key K (crypto::JobKey of the token)
// is held by the controllers, the agents and the launchers, never by a worker. A launcher hands
// each worker a credential instead: what that worker needs and nothing more.
//
//   control key   DeriveKey(K, "worker control", id): the worker's control connection proves
//                 it, both ways. Each worker's is its own, so a worker can neither answer another
//                 worker as the controller nor dial the controller as another worker.
//   data key      DeriveKey(K, "worker data"): every worker's, for the data connections between
//                 workers (collectives, state copies, their seal).
//   controller public key
//                 Ed25519, of the seed DeriveKey(K, "controller signing"): the leader and end
//                 values in etcd and in an agent's leader file are signed with its private key,
//                 which only the holders of K can make; a worker verifies and cannot sign.
//
// An agent proves K itself (ConnectionKind::kAgent): no worker can register as one.
#pragma once

#include <string>
#include <string_view>

#include "common/crypto.h"
#include "nonstop/status.h"

namespace nonstop {

crypto::Key WorkerControlKey(const crypto::Key& job_key, int worker_id);
crypto::Key WorkerDataKey(const crypto::Key& job_key);
crypto::Key ControllerSigningSeed(const crypto::Key& job_key);
std::string ControllerPublicKey(const crypto::Key& job_key);

// What one worker holds.
struct WorkerKeys {
  int worker_id = -1;
  crypto::Key control{};
  crypto::Key data{};
  std::string controller_public;
};

WorkerKeys WorkerKeysOf(const crypto::Key& job_key, int worker_id);

// The credential a launcher passes a worker (through the memfd that once carried the token:
// job_token.h): one line, "nonstop-worker-credential 1 <id> <control> <data> <public>", the keys
// in base64. Under kMaxJobTokenBytes.
std::string EncodeWorkerCredential(const WorkerKeys& keys);
bool IsWorkerCredential(std::string_view secret);

// The keys of worker `worker_id` from what it was started with: a credential (which must be
// that worker's: kFailedPrecondition naming both ids otherwise, kInvalidArgument for one that
// does not parse), or else a job token (a worker started by hand, which then holds K itself).
Result<WorkerKeys> WorkerKeysFrom(std::string_view secret, int worker_id);

}  // namespace nonstop
