// Durable checkpoints (docs/architecture.md "State"): the last rung of recovery, the state of
// the checkpoint-restart baseline, and a way to resume or evaluate later.
//
// A checkpoint is a directory `step-000030/` holding
//   state.safetensors  every registered region as a tensor (readable by any
//                      safetensors reader: torch, numpy, …)
//   manifest.json      step, generation, recipe, data position, parameter
//                      checksum, and a CRC-32C per tensor; written last
// It is written under a temporary name, every file fsynced, then renamed and
// the parent fsynced, so a directory named step-N is complete. Loading checks
// the manifest (every field's type), the safetensors header (against the
// file's size), the layout against the live registry (names, dtypes, shapes,
// sizes), the file's CRC and every tensor's CRC before it changes a byte; a
// truncated, corrupt or malformed checkpoint is skipped with a reason and the
// next newest is used. Everything read from disk is untrusted input.
//
// CheckpointWriter saves asynchronously: Save() copies the state (the only
// part the training loop waits for) and a background thread writes it; a
// checkpoint due while the previous write is in flight is skipped.
//
// Format details: docs/formats.md. Implemented by src/state/checkpoint.cc
// (whose internal header adds the format parsers that the loader and the
// fuzz targets share).
//
// A training program saves at a step boundary and resumes before it joins:
//
//   state::CheckpointWriter writer(dir, /*keep=*/3);          // rank 0
//   writer.TrySave(state, {step, session->generation(), session->world_size(), recipe, checksum});
//   ...
//   auto loaded = state::LoadNewestCheckpoint(dir, state);     // before Session::Join
//   auto session = Session::Join(options, &state, loaded.ok() ? loaded->step : -1);
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
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
  std::string writer = "nonstop-train";  // kTrainWriter or kPythonWriter: who loads it how
};

struct CheckpointWriteStats {
  int64_t step = -1;
  std::string path;
  double snapshot_seconds = 0;  // what the training loop waited for
  double write_seconds = 0;     // in the background: files, fsyncs, rename
  uint64_t bytes = 0;
};

// What CheckpointWriter::TrySave did with one checkpoint.
struct CheckpointSaveResult {
  int64_t step = -1;            // the step the caller asked to save
  bool skipped = false;         // true: nothing was copied or queued for `step`
  int64_t in_flight_step = -1;  // when skipped: the step whose write is still running
  // the last finished write's result (OK when it succeeded or none finished)
  Status earlier;
  // "queued step 30" or "skipped step 40: the write of step 30 is still in flight".
  std::string ToString() const;
};

// Writes checkpoints in the background, one at a time.
//
// The training thread calls Save/TrySave at a step boundary, usually on rank 0
// while the other ranks already wait in the next collective: so saving never
// waits for a write. It copies the state (the only cost the caller pays) and
// hands the copy to the writer thread; when the previous write is still in
// flight, the writer has fallen behind, and this checkpoint is SKIPPED (not
// copied, logged with its step, counted in skipped_count()). The next one due
// is written instead.
//
// Thread-safety: Save/TrySave/Wait are called by one thread (the training
// loop); last_written/skipped_count from any thread.
class CheckpointWriter {
 public:
  CheckpointWriter(std::string dir, int keep);
  ~CheckpointWriter();  // finishes the write in flight (the only wait without a bound: at exit)
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;

  // Copies `registry` now and queues the copy for the writer thread, unless a
  // write is still in flight: then skips this checkpoint and says so. Never
  // waits for a write.
  CheckpointSaveResult TrySave(const StateRegistry& registry, const CheckpointMeta& meta);
  // TrySave, returning only `earlier`: the result of the last finished write.
  // A skip is not an error: it is logged and counted in skipped_count().
  Status Save(const StateRegistry& registry, const CheckpointMeta& meta);
  // Waits for the write in flight; returns its result.
  Status Wait();
  std::optional<CheckpointWriteStats> last_written() const;
  // Checkpoints skipped because a write was still in flight.
  uint64_t skipped_count() const;
  // True from queueing a checkpoint until its write ended (well or not).
  bool in_flight() const;

  // Test seam: `hook(step)` runs on the writer thread before each write
  // starts, with no lock held; a test can block it to hold a write in flight.
  void SetWriteHookForTesting(std::function<void(int64_t step)> hook);

 private:
  class Impl;  // src/state/checkpoint.cc: the queue, its mutex and the writer thread
  std::unique_ptr<Impl> impl_;
};

// Writes one checkpoint synchronously (tests, tools).
Result<CheckpointWriteStats> WriteCheckpoint(const std::string& dir, const StateRegistry& registry,
                                             const CheckpointMeta& meta, int keep);

// The checked contents of a checkpoint's manifest.json.
struct CheckpointTensorSum {
  uint64_t bytes = 0;
  uint32_t crc32c = 0;
};
struct CheckpointManifest {
  int64_t step = -1;
  uint32_t generation = 0;
  int64_t world_size = 0;
  std::string recipe;
  std::string parameter_checksum;
  uint64_t state_bytes = 0;        // size of state.safetensors
  uint32_t state_file_crc32c = 0;  // CRC-32C of all of state.safetensors
  std::map<std::string, CheckpointTensorSum> tensors;
  nlohmann::json json;  // the whole manifest (data_position, extra, created_unix_us, …)
};

struct LoadedCheckpoint {
  std::string path;
  int64_t step = -1;
  nlohmann::json manifest;  // manifest.json as parsed (the checked fields are in `parsed`)
  CheckpointManifest parsed;
  std::vector<std::string> skipped;  // "path: why" for every newer checkpoint that was refused
  // Loaded by name, from the other trainer's checkpoint: this worker's
  // regions it had nothing for (they keep their values), and its tensors
  // that this worker has no region for.
  bool by_name = false;
  std::vector<std::string> kept, ignored;
};

// The manifest's "writer": nonstop-train's checkpoints and the Python
// package's. A manifest without one (older) is nonstop-train's unless its
// "recipe" is "python".
inline constexpr std::string_view kTrainWriter = "nonstop-train";
inline constexpr std::string_view kPythonWriter = "python";

struct LoadOptions {
  // Who loads (kTrainWriter, kPythonWriter). Empty: any checkpoint is loaded
  // as the same writer's.
  std::string_view loader;
  // By name: the regions that must be in the checkpoint (parameters and
  // optimizer moments). Empty: every float32 region.
  std::vector<std::string> required{};
  // Regions a checkpoint of the loader's own writer may lack (state registered since it was
  // written: the Python package's model buffers); they keep their values (`kept`).
  std::vector<std::string> optional{};
};

// Loads the newest valid checkpoint in `dir` into `registry` in place.
// NOT_FOUND when there is none (the reasons for skipping each are in the message).
// A checkpoint of the loader's own writer must hold exactly the registry's
// regions, in order (but for options.optional ones it lacks). One the other writer wrote is loaded
// by name: every required region must be there with its dtype and shape; the others (counters, data
// positions) are loaded where the checkpoint has them with the same dtype and size, and keep their
// values otherwise (`kept`).
Result<LoadedCheckpoint> LoadNewestCheckpoint(const std::string& dir, StateRegistry& registry,
                                              const LoadOptions& options = {});

// Validates one checkpoint directory against `registry` (no loading).
Status VerifyCheckpoint(const std::string& path, const StateRegistry& registry);

}  // namespace nonstop::state
