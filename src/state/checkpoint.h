// Durable checkpoints (DESIGN.md §6): the last rung of recovery, the state of
// the checkpoint-restart baseline, and a way to resume or evaluate later.
//
// A checkpoint is a directory `step-000030/` holding
//   state.safetensors  every registered region as a tensor (readable by any
//                      safetensors reader: torch, numpy, …)
//   manifest.json      step, generation, recipe, data position, parameter
//                      checksum, and a CRC-32C per tensor; written last
// It is written under a temporary name, every file fsynced, then renamed and
// the parent fsynced, so a directory named step-N is complete. Loading checks
// the manifest, the safetensors header, the layout against the live registry
// and every tensor's CRC before it changes a byte; a truncated or corrupt
// checkpoint is skipped with a message and the next newest is used.
//
// CheckpointWriter saves asynchronously: Save() copies the state (the only
// part the training loop waits for) and a background thread writes it.
//
// Format details: docs/formats.md.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "nonstop/state.h"
#include "nonstop/status.h"

namespace nonstop::state {

struct CheckpointMeta {
  int64_t step = -1;  // the last completed step the state holds
  uint32_t generation = 0;
  int world_size = 0;
  std::string recipe;
  std::string parameter_checksum;
  nlohmann::json extra = nlohmann::json::object();
};

struct CheckpointWriteStats {
  int64_t step = -1;
  std::string path;
  double snapshot_seconds = 0;  // what the training loop waited for
  double write_seconds = 0;     // in the background: files, fsyncs, rename
  uint64_t bytes = 0;
};

class CheckpointWriter {
 public:
  CheckpointWriter(std::string dir, int keep);
  ~CheckpointWriter();  // finishes the write in flight
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;

  // Copies `registry` now and writes it in the background. If the previous
  // write is still running, waits for it first (one checkpoint in flight).
  Status Save(const StateRegistry& registry, const CheckpointMeta& meta);
  // Waits for the write in flight; returns its result.
  Status Wait();
  std::optional<CheckpointWriteStats> last_written() const;

 private:
  void Run(std::stop_token stop);

  const std::string dir_;
  const int keep_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  struct Job {
    std::string header;  // safetensors header (with its length prefix)
    std::string data;    // the regions' bytes
    nlohmann::json manifest;
    int64_t step;
    double snapshot_seconds;
  };
  std::optional<Job> pending_;                   // guarded by mu_
  bool busy_ = false;                            // guarded by mu_
  Status last_status_;                           // guarded by mu_
  std::optional<CheckpointWriteStats> last_;     // guarded by mu_
  std::jthread thread_;
};

// Writes one checkpoint synchronously (tests, tools).
Result<CheckpointWriteStats> WriteCheckpoint(const std::string& dir, const StateRegistry& registry,
                                             const CheckpointMeta& meta, int keep);

struct LoadedCheckpoint {
  std::string path;
  int64_t step = -1;
  nlohmann::json manifest;
  std::vector<std::string> skipped;  // "path: why" for every newer checkpoint that was refused
};

// Loads the newest valid checkpoint in `dir` into `registry` in place.
// NOT_FOUND when there is none (the reasons for skipping each are in the message).
Result<LoadedCheckpoint> LoadNewestCheckpoint(const std::string& dir, StateRegistry& registry);

// Validates one checkpoint directory against `registry` (no loading).
Status VerifyCheckpoint(const std::string& path, const StateRegistry& registry);

}  // namespace nonstop::state
