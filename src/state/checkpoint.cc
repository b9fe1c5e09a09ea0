#include "state/checkpoint.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>

#include <fmt/format.h>

#include "common/coding.h"
#include "common/crc32c.h"
#include "common/file_util.h"
#include "common/logging.h"
#include "common/time.h"

namespace nonstop::state {

namespace fs = std::filesystem;

namespace {

constexpr char kStateFile[] = "state.safetensors";
constexpr char kManifestFile[] = "manifest.json";

size_t DtypeBytes(const std::string& dtype) {
  if (dtype == "F32" || dtype == "I32" || dtype == "U32") return 4;
  if (dtype == "F64" || dtype == "I64" || dtype == "U64") return 8;
  if (dtype == "F16" || dtype == "BF16" || dtype == "I16" || dtype == "U16") return 2;
  return 1;
}

std::vector<int64_t> ShapeOf(const Region& r) {
  if (!r.shape.empty()) return r.shape;
  return {static_cast<int64_t>(r.bytes.size() / DtypeBytes(r.dtype))};
}

std::string DirName(int64_t step) { return fmt::format("step-{:09}", step); }

// The safetensors header: u64 length, then JSON padded with spaces to 8 bytes.
std::string SafetensorsHeader(const StateRegistry& reg, const CheckpointMeta& meta) {
  nlohmann::json h = nlohmann::json::object();
  uint64_t offset = 0;
  for (const auto& r : reg.regions()) {
    h[r.name] = {{"dtype", r.dtype}, {"shape", ShapeOf(r)}, {"data_offsets", {offset, offset + r.bytes.size()}}};
    offset += r.bytes.size();
  }
  h["__metadata__"] = {{"format", "nonstop"}, {"step", std::to_string(meta.step)}};
  std::string text = h.dump();
  while ((8 + text.size()) % 8 != 0) text += ' ';
  std::string out;
  PutFixed64(&out, text.size());
  return out + text;
}

Status WriteJob(const std::string& dir, const std::string& header, const std::string& data,
                const nlohmann::json& manifest, int64_t step, int keep) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return UnavailableError(fmt::format("cannot create checkpoint directory {}: {}", dir, ec.message()));
  std::string final_dir = dir + "/" + DirName(step);
  std::string tmp_dir = final_dir + ".tmp-" + std::to_string(::getpid());
  fs::remove_all(tmp_dir, ec);
  fs::create_directories(tmp_dir, ec);
  if (ec) return UnavailableError(fmt::format("cannot create {}: {}", tmp_dir, ec.message()));
  NONSTOP_RETURN_IF_ERROR(WriteFileSynced(tmp_dir + "/" + kStateFile, header + data));
  NONSTOP_RETURN_IF_ERROR(WriteFileSynced(tmp_dir + "/" + kManifestFile, manifest.dump(2) + "\n"));  // last
  NONSTOP_RETURN_IF_ERROR(SyncDirectory(tmp_dir));
  fs::remove_all(final_dir, ec);
  fs::rename(tmp_dir, final_dir, ec);
  if (ec) return UnavailableError(fmt::format("cannot rename {} to {}: {}", tmp_dir, final_dir, ec.message()));
  NONSTOP_RETURN_IF_ERROR(SyncDirectory(dir));
  // Retention: keep the newest `keep` complete checkpoints.
  std::vector<std::string> complete;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    std::string name = e.path().filename().string();
    if (e.is_directory() && name.rfind("step-", 0) == 0 && name.find(".tmp-") == std::string::npos) {
      complete.push_back(e.path().string());
    }
  }
  std::sort(complete.begin(), complete.end());
  for (size_t i = 0; keep > 0 && i + static_cast<size_t>(keep) < complete.size(); ++i) fs::remove_all(complete[i], ec);
  return OkStatus();
}

struct Snapshot {
  std::string header, data;
  nlohmann::json manifest;
};

Snapshot TakeSnapshot(const StateRegistry& reg, const CheckpointMeta& meta) {
  Snapshot s;
  s.header = SafetensorsHeader(reg, meta);
  s.data.resize(reg.total_bytes());
  nlohmann::json tensors = nlohmann::json::object();
  size_t offset = 0;
  for (const auto& r : reg.regions()) {
    std::memcpy(s.data.data() + offset, r.bytes.data(), r.bytes.size());
    tensors[r.name] = {{"bytes", r.bytes.size()}, {"crc32c", fmt::format("{:08x}", Crc32c(r.bytes.data(), r.bytes.size()))}};
    offset += r.bytes.size();
  }
  s.manifest = {{"format", "nonstop-checkpoint"},
                {"version", 1},
                {"step", meta.step},
                {"generation", meta.generation},
                {"world_size", meta.world_size},
                {"recipe", meta.recipe},
                {"data_position", {{"next_step", meta.step + 1}, {"note", "batches are a function of (data, seed, step)"}}},
                {"rng", "none: the models have no dropout and the data order is a function of the step"},
                {"parameter_checksum", meta.parameter_checksum},
                {"state_file", kStateFile},
                {"state_bytes", s.header.size() + s.data.size()},
                {"state_file_crc32c", fmt::format("{:08x}", Crc32cExtend(Crc32c(s.header), s.data.data(), s.data.size()))},
                {"tensors", tensors},
                {"created_unix_us", WallMicros()},
                {"extra", meta.extra}};
  return s;
}

}  // namespace

Result<CheckpointWriteStats> WriteCheckpoint(const std::string& dir, const StateRegistry& registry,
                                             const CheckpointMeta& meta, int keep) {
  auto t0 = Clock::now();
  Snapshot snap = TakeSnapshot(registry, meta);
  auto t1 = Clock::now();
  NONSTOP_RETURN_IF_ERROR(WriteJob(dir, snap.header, snap.data, snap.manifest, meta.step, keep));
  CheckpointWriteStats st;
  st.step = meta.step;
  st.path = dir + "/" + DirName(meta.step);
  st.snapshot_seconds = std::chrono::duration<double>(t1 - t0).count();
  st.write_seconds = std::chrono::duration<double>(Clock::now() - t1).count();
  st.bytes = snap.header.size() + snap.data.size();
  return st;
}

std::string CheckpointSaveResult::ToString() const {
  std::string out = skipped ? fmt::format("skipped step {}: the write of step {} is still in flight", step,
                                          in_flight_step)
                            : fmt::format("queued step {}", step);
  if (!earlier.ok()) out += fmt::format(" (an earlier write failed: {})", earlier.ToString());
  return out;
}

CheckpointWriter::CheckpointWriter(std::string dir, int keep) : dir_(std::move(dir)), keep_(keep) {
  thread_ = std::thread([this] { Run(); });
}

CheckpointWriter::~CheckpointWriter() {
  {
    // The flag changes under the mutex: the writer thread either sees it when
    // it checks, or is already waiting and gets the notification. (Setting it
    // without the mutex could land between its check and its wait: a lost
    // wake-up, and a destructor that never returns.)
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  thread_.join();  // the writer finishes what is queued before it sees stopping_
}

CheckpointSaveResult CheckpointWriter::TrySave(const StateRegistry& registry, const CheckpointMeta& meta) {
  CheckpointSaveResult result;
  result.step = meta.step;
  {
    std::lock_guard<std::mutex> lock(mu_);
    result.earlier = last_status_;
    if (in_flight_step_ >= 0) {  // one checkpoint in flight: the writer fell behind
      result.skipped = true;
      result.in_flight_step = in_flight_step_;
      ++skipped_;
    }
  }
  if (result.skipped) {
    NONSTOP_LOG_WARNING("checkpoint {} in {}", result.ToString(), dir_);
    return result;
  }
  // Only this thread queues jobs, so the slot stays free while we copy.
  auto t0 = Clock::now();
  Snapshot snap = TakeSnapshot(registry, meta);
  double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  {
    std::lock_guard<std::mutex> lock(mu_);
    pending_ = Job{std::move(snap.header), std::move(snap.data), std::move(snap.manifest), meta.step, secs};
    in_flight_step_ = meta.step;
  }
  cv_.notify_all();
  return result;
}

Status CheckpointWriter::Save(const StateRegistry& registry, const CheckpointMeta& meta) {
  return TrySave(registry, meta).earlier;
}

Status CheckpointWriter::Wait() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return in_flight_step_ < 0; });
  return last_status_;
}

std::optional<CheckpointWriteStats> CheckpointWriter::last_written() const {
  std::lock_guard<std::mutex> lock(mu_);
  return last_;
}

uint64_t CheckpointWriter::skipped_count() const {
  std::lock_guard<std::mutex> lock(mu_);
  return skipped_;
}

void CheckpointWriter::SetWriteHookForTesting(std::function<void(int64_t step)> hook) {
  std::lock_guard<std::mutex> lock(mu_);
  write_hook_ = std::move(hook);
}

void CheckpointWriter::Run() {
  while (true) {
    Job job;
    std::function<void(int64_t)> hook;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return pending_.has_value() || stopping_; });
      if (!pending_) return;  // stopping, nothing queued
      job = std::move(*pending_);
      pending_.reset();
      hook = write_hook_;
    }
    if (hook) hook(job.step);
    auto t0 = Clock::now();
    Status s = WriteJob(dir_, job.header, job.data, job.manifest, job.step, keep_);
    CheckpointWriteStats st{job.step, dir_ + "/" + DirName(job.step), job.snapshot_seconds,
                            std::chrono::duration<double>(Clock::now() - t0).count(),
                            job.header.size() + job.data.size()};
    if (!s.ok()) NONSTOP_LOG_WARNING("checkpoint of step {} failed: {}", job.step, s.ToString());
    {
      std::lock_guard<std::mutex> lock(mu_);
      in_flight_step_ = -1;
      last_status_ = s;
      if (s.ok()) last_ = st;
    }
    cv_.notify_all();
  }
}

namespace {

// Parses and checks one checkpoint; on success returns the manifest and the state bytes' offset in `file`.
Result<nlohmann::json> Check(const std::string& path, const StateRegistry& reg, std::string* file, size_t* data_offset) {
  auto manifest_text = ReadFile(path + "/" + kManifestFile);
  if (!manifest_text.ok()) return DataLossError("no manifest.json: the checkpoint is incomplete");
  auto manifest = nlohmann::json::parse(*manifest_text, nullptr, false);
  if (manifest.is_discarded() || !manifest.is_object() || manifest.value("format", "") != "nonstop-checkpoint") {
    return DataLossError("manifest.json is not a nonstop checkpoint manifest");
  }
  if (manifest.value("version", 0) != 1) {
    return InvalidArgumentError(fmt::format("checkpoint format version {} is not supported", manifest.value("version", 0)));
  }
  auto data = ReadFile(path + "/" + kStateFile);
  if (!data.ok()) return DataLossError("state.safetensors is missing");
  *file = std::move(*data);
  uint64_t want_bytes = manifest.value("state_bytes", uint64_t{0});
  if (file->size() != want_bytes) {
    return DataLossError(fmt::format("state.safetensors is {} bytes, the manifest says {} ({})", file->size(), want_bytes,
                                     file->size() < want_bytes ? "truncated" : "trailing bytes"));
  }
  if (fmt::format("{:08x}", Crc32c(*file)) != manifest.value("state_file_crc32c", "")) {
    return DataLossError("state.safetensors fails its checksum (the file is corrupt)");
  }
  if (file->size() < 8) return DataLossError("state.safetensors is too short");
  uint64_t header_len = DecodeFixed64(file->data());
  if (header_len > file->size() - 8) return DataLossError("state.safetensors has a bad header length");
  auto header = nlohmann::json::parse(file->substr(8, header_len), nullptr, false);
  if (header.is_discarded() || !header.is_object()) return DataLossError("state.safetensors header is not JSON");
  *data_offset = 8 + header_len;
  uint64_t offset = 0;
  for (const auto& r : reg.regions()) {
    if (!header.contains(r.name)) {
      return InvalidArgumentError(fmt::format("the checkpoint has no tensor '{}': it was written by another model or "
                                              "optimizer", r.name));
    }
    const auto& t = header[r.name];
    auto offs = t.value("data_offsets", std::vector<uint64_t>{});
    if (offs.size() != 2 || offs[0] != offset || offs[1] - offs[0] != r.bytes.size()) {
      return InvalidArgumentError(fmt::format("tensor '{}' has {} bytes in the checkpoint, this worker has {}", r.name,
                                              offs.size() == 2 ? offs[1] - offs[0] : 0, r.bytes.size()));
    }
    offset += r.bytes.size();
  }
  if (*data_offset + offset != file->size()) return DataLossError("state.safetensors holds more tensors than this worker");
  return manifest;
}

}  // namespace

Status VerifyCheckpoint(const std::string& path, const StateRegistry& registry) {
  std::string file;
  size_t offset = 0;
  return Check(path, registry, &file, &offset).status();
}

Result<LoadedCheckpoint> LoadNewestCheckpoint(const std::string& dir, StateRegistry& registry) {
  std::error_code ec;
  std::vector<std::string> candidates;
  LoadedCheckpoint out;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    std::string name = e.path().filename().string();
    if (!e.is_directory() || name.rfind("step-", 0) != 0) continue;
    if (name.find(".tmp-") != std::string::npos) {
      out.skipped.push_back(e.path().string() + ": half-written (never renamed into place)");
      continue;
    }
    candidates.push_back(e.path().string());
  }
  std::sort(candidates.rbegin(), candidates.rend());  // newest first (zero-padded step numbers)
  for (const auto& path : candidates) {
    std::string file;
    size_t data_offset = 0;
    auto manifest = Check(path, registry, &file, &data_offset);
    if (!manifest.ok()) {
      out.skipped.push_back(path + ": " + manifest.status().message());
      continue;
    }
    size_t offset = data_offset;
    for (const auto& r : registry.regions()) {
      std::memcpy(r.bytes.data(), file.data() + offset, r.bytes.size());
      offset += r.bytes.size();
    }
    out.path = path;
    out.step = (*manifest)["step"].get<int64_t>();
    out.manifest = std::move(*manifest);
    return out;
  }
  std::string why;
  for (const auto& s : out.skipped) why += "\n  skipped " + s;
  return NotFoundError(fmt::format("no valid checkpoint in {}{}", dir, why));
}

}  // namespace nonstop::state
