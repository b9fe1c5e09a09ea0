// nonstop::Store: the job's key-value store as a worker sees it (docs/store.md); Session::store()
// gives it. One store for the whole job, kept by the controller: what one worker sets, every
// other gets, through recoveries and through a controller takeover. It is what torch.distributed's
// default group is given as its store (torch code meets through one: a library's rendezvous, a
// counter, a flag), and the C++ form of the same calls.
//
// Keys are UTF-8 text of at most 4 KiB; values are bytes, at most 1 MiB each, 16 MiB in all
// (a call past that fails with FAILED_PRECONDITION saying so: delete the keys no longer needed).
//
// `timeout` bounds each call: get and wait wait that long for their keys; every call fails with
// DEADLINE_EXCEEDED when it is not answered within it (no controller: lost, or one taking over).
// Zero waits for ever, as torch's stores. A call whose connection is lost meanwhile is sent again
// once a controller accepts the worker; a write is applied once however often it is sent.
//
// Thread-safety: any thread may call; writes from one process are applied one at a time.
#pragma once

#include <chrono>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "nonstop/status.h"

namespace nonstop {

class Store {
 public:
  virtual ~Store() = default;

  virtual Status Set(std::string_view key, std::string_view value,
                     std::chrono::milliseconds timeout) = 0;
  // The key's value, once it is set.
  virtual Result<std::string> Get(std::string_view key, std::chrono::milliseconds timeout) = 0;
  // Adds `amount` to the counter at `key` (decimal text; 0 when missing) and returns its value.
  virtual Result<int64_t> Add(std::string_view key, int64_t amount,
                              std::chrono::milliseconds timeout) = 0;
  // Sets `key` to `desired` if it holds `expected` (or is missing and `expected` is empty);
  // returns the value it holds afterwards (`expected` when it stays missing), as torch's stores.
  virtual Result<std::string> CompareSet(std::string_view key, std::string_view expected,
                                         std::string_view desired,
                                         std::chrono::milliseconds timeout) = 0;
  virtual Status Append(std::string_view key, std::string_view value,
                        std::chrono::milliseconds timeout) = 0;
  // Returns once every key is set.
  virtual Status Wait(std::span<const std::string> keys, std::chrono::milliseconds timeout) = 0;
  // Whether every key is set now.
  virtual Result<bool> Check(std::span<const std::string> keys,
                             std::chrono::milliseconds timeout) = 0;
  // Whether the key was there.
  virtual Result<bool> DeleteKey(std::string_view key, std::chrono::milliseconds timeout) = 0;
  virtual Result<int64_t> NumKeys(std::chrono::milliseconds timeout) = 0;
};

}  // namespace nonstop
