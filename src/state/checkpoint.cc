#include "state/checkpoint.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <thread>
#include <tuple>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "common/coding.h"
#include "common/file_util.h"
#include "common/mutex.h"
#include "common/time.h"
#include "nonstop/crc32c.h"
#include "nonstop/log.h"

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
std::string EncodeSafetensorsHeader(const StateRegistry& reg, const CheckpointMeta& meta) {
  nlohmann::json h = nlohmann::json::object();
  uint64_t offset = 0;
  for (const auto& r : reg.regions()) {
    h[r.name] = {{"dtype", r.dtype},
                 {"shape", ShapeOf(r)},
                 {"data_offsets", {offset, offset + r.bytes.size()}}};
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
  if (ec)
    return UnavailableError(
        fmt::format("cannot create checkpoint directory {}: {}", dir, ec.message()));
  std::string final_dir = dir + "/" + DirName(step);
  std::string tmp_dir = final_dir + ".tmp-" + std::to_string(::getpid());
  fs::remove_all(tmp_dir, ec);
  fs::create_directories(tmp_dir, ec);
  if (ec) return UnavailableError(fmt::format("cannot create {}: {}", tmp_dir, ec.message()));
  NONSTOP_RETURN_IF_ERROR(WriteFileSynced(tmp_dir + "/" + kStateFile, header + data));
  // last
  NONSTOP_RETURN_IF_ERROR(WriteFileSynced(tmp_dir + "/" + kManifestFile, manifest.dump(2) + "\n"));
  NONSTOP_RETURN_IF_ERROR(SyncDirectory(tmp_dir));
  fs::remove_all(final_dir, ec);
  fs::rename(tmp_dir, final_dir, ec);
  if (ec)
    return UnavailableError(
        fmt::format("cannot rename {} to {}: {}", tmp_dir, final_dir, ec.message()));
  NONSTOP_RETURN_IF_ERROR(SyncDirectory(dir));
  // Retention: keep the newest `keep` complete checkpoints.
  std::vector<std::string> complete;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    std::string name = e.path().filename().string();
    if (e.is_directory() && name.rfind("step-", 0) == 0 &&
        name.find(".tmp-") == std::string::npos) {
      complete.push_back(e.path().string());
    }
  }
  std::sort(complete.begin(), complete.end());
  for (size_t i = 0; keep > 0 && i + static_cast<size_t>(keep) < complete.size(); ++i)
    fs::remove_all(complete[i], ec);
  return OkStatus();
}

struct Snapshot {
  std::string header, data;
  nlohmann::json manifest;
};

Snapshot TakeSnapshot(const StateRegistry& reg, const CheckpointMeta& meta) {
  Snapshot s;
  s.header = EncodeSafetensorsHeader(reg, meta);
  s.data.resize(reg.total_bytes());
  nlohmann::json tensors = nlohmann::json::object();
  size_t offset = 0;
  for (size_t i = 0; i < reg.regions().size(); ++i) {
    const Region& r = reg.regions()[i];
    std::span<std::byte> to(reinterpret_cast<std::byte*>(s.data.data()) + offset, r.bytes.size());
    reg.ReadRegion(i, 0, to);  // device memory too
    tensors[r.name] = {{"bytes", r.bytes.size()},
                       {"crc32c", fmt::format("{:08x}", Crc32c(to.data(), to.size()))}};
    offset += r.bytes.size();
  }
  s.manifest = {
      {"format", "nonstop-checkpoint"},
      {"version", 1},
      {"step", meta.step},
      {"generation", meta.generation},
      {"world_size", meta.world_size},
      {"recipe", meta.recipe},
      {"writer", meta.writer},
      {"data_position",
       {{"next_step", meta.step + 1}, {"note", "batches are a function of (data, seed, step)"}}},
      {"rng", "none: the models have no dropout and the data order is a function of the step"},
      {"parameter_checksum", meta.parameter_checksum},
      {"state_file", kStateFile},
      {"state_bytes", s.header.size() + s.data.size()},
      {"state_file_crc32c",
       fmt::format("{:08x}", Crc32cExtend(Crc32c(s.header), s.data.data(), s.data.size()))},
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
  std::string out = skipped
                        ? fmt::format("skipped step {}: the write of step {} is still in flight",
                                      step, in_flight_step)
                        : fmt::format("queued step {}", step);
  if (!earlier.ok()) out += fmt::format(" (an earlier write failed: {})", earlier.ToString());
  return out;
}

// The writer behind CheckpointWriter: one queued job at most, and the thread
// that writes it.
class CheckpointWriter::Impl {
 public:
  Impl(std::string dir, int keep) : dir_(std::move(dir)), keep_(keep) {
    thread_ = std::jthread([this] { Run(); });
  }
  ~Impl();
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;

  CheckpointSaveResult TrySave(const StateRegistry& registry, const CheckpointMeta& meta);
  Status Wait();
  std::optional<CheckpointWriteStats> last_written() const;
  uint64_t skipped_count() const;
  bool in_flight() const;
  void SetWriteHookForTesting(std::function<void(int64_t step)> hook);

 private:
  void Run();

  const std::string dir_;
  const int keep_;
  mutable Mutex mu_;
  CondVar cv_;
  struct Job {
    std::string header;  // safetensors header (with its length prefix)
    std::string data;    // the regions' bytes
    nlohmann::json manifest;
    int64_t step;
    double snapshot_seconds;
  };
  std::optional<Job> pending_ NONSTOP_GUARDED_BY(mu_);
  bool in_flight_ NONSTOP_GUARDED_BY(mu_) = false;  // true from queueing to the end of the write
  int64_t in_flight_step_ NONSTOP_GUARDED_BY(mu_) = -1;  // the step of that write
  bool stopping_ NONSTOP_GUARDED_BY(mu_) = false;        // set (under mu_) by the destructor
  uint64_t skipped_ NONSTOP_GUARDED_BY(mu_) = 0;
  Status last_status_ NONSTOP_GUARDED_BY(mu_);
  std::optional<CheckpointWriteStats> last_ NONSTOP_GUARDED_BY(mu_);
  std::function<void(int64_t)> write_hook_ NONSTOP_GUARDED_BY(mu_);  // copied out, run unlocked
  std::jthread thread_;  // last: started once the members above exist
};

CheckpointWriter::CheckpointWriter(std::string dir, int keep)
    : impl_(std::make_unique<Impl>(std::move(dir), keep)) {}
CheckpointWriter::~CheckpointWriter() = default;
CheckpointSaveResult CheckpointWriter::TrySave(const StateRegistry& registry,
                                               const CheckpointMeta& meta) {
  return impl_->TrySave(registry, meta);
}
Status CheckpointWriter::Save(const StateRegistry& registry, const CheckpointMeta& meta) {
  return TrySave(registry, meta).earlier;
}
Status CheckpointWriter::Wait() { return impl_->Wait(); }
std::optional<CheckpointWriteStats> CheckpointWriter::last_written() const {
  return impl_->last_written();
}
uint64_t CheckpointWriter::skipped_count() const { return impl_->skipped_count(); }
bool CheckpointWriter::in_flight() const { return impl_->in_flight(); }
void CheckpointWriter::SetWriteHookForTesting(std::function<void(int64_t step)> hook) {
  impl_->SetWriteHookForTesting(std::move(hook));
}

CheckpointWriter::Impl::~Impl() {
  {
    // The flag changes under the mutex: the writer thread either sees it when
    // it checks, or is already waiting and gets the notification. (Setting it
    // without the mutex could land between its check and its wait: a lost
    // wake-up, and a destructor that never returns.)
    MutexLock lock(&mu_);
    stopping_ = true;
  }
  cv_.NotifyAll();
  thread_.join();  // the writer finishes what is queued before it sees stopping_
}

CheckpointSaveResult CheckpointWriter::Impl::TrySave(const StateRegistry& registry,
                                                     const CheckpointMeta& meta) {
  CheckpointSaveResult result;
  result.step = meta.step;
  {
    MutexLock lock(&mu_);
    result.earlier = last_status_;
    if (in_flight_) {  // one checkpoint in flight: the writer fell behind
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
    MutexLock lock(&mu_);
    pending_ = Job{std::move(snap.header), std::move(snap.data), std::move(snap.manifest),
                   meta.step, secs};
    in_flight_ = true;
    in_flight_step_ = meta.step;
  }
  cv_.NotifyAll();
  return result;
}

Status CheckpointWriter::Impl::Wait() {
  MutexLock lock(&mu_);
  cv_.Wait(&mu_, [&]() NONSTOP_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !in_flight_; });
  return last_status_;
}

std::optional<CheckpointWriteStats> CheckpointWriter::Impl::last_written() const {
  MutexLock lock(&mu_);
  return last_;
}

bool CheckpointWriter::Impl::in_flight() const {
  MutexLock lock(&mu_);
  return in_flight_;
}

uint64_t CheckpointWriter::Impl::skipped_count() const {
  MutexLock lock(&mu_);
  return skipped_;
}

void CheckpointWriter::Impl::SetWriteHookForTesting(std::function<void(int64_t step)> hook) {
  MutexLock lock(&mu_);
  write_hook_ = std::move(hook);
}

void CheckpointWriter::Impl::Run() {
  while (true) {
    Job job;
    std::function<void(int64_t)> hook;
    {
      MutexLock lock(&mu_);
      cv_.Wait(&mu_, [&]() NONSTOP_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return pending_.has_value() || stopping_;
      });
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
      MutexLock lock(&mu_);
      in_flight_ = false;
      last_status_ = s;
      if (s.ok()) last_ = st;
    }
    cv_.NotifyAll();
  }
}

namespace {

using nlohmann::json;

// Appends a rendering of `v` to `out`, at most `depth` levels deep and about
// 40 characters long: `v` is untrusted, and may be nested a million deep.
void Render(const json& v, int depth, std::string* out) {
  if (v.is_structured()) {
    bool array = v.is_array();
    *out += array ? '[' : '{';
    if (depth == 0 && !v.empty()) *out += "...";
    bool first = true;
    for (auto it = v.begin(); depth > 0 && it != v.end(); ++it) {
      if (out->size() > 40) {
        *out += ",...";
        break;
      }
      if (!first) *out += ',';
      first = false;
      if (!array)
        *out +=
            json(it.key()).dump(-1, ' ', /*ensure_ascii=*/true, json::error_handler_t::replace) +
            ':';
      Render(*it, depth - 1, out);
    }
    *out += array ? ']' : '}';
    return;
  }
  std::string text = v.dump(-1, ' ', /*ensure_ascii=*/true, json::error_handler_t::replace);
  *out += text.size() > 40 ? text.substr(0, 37) + "..." : text;
}

std::string Shown(const json& v) {
  std::string out;
  Render(v, /*depth=*/3, &out);
  return out;
}

// The field `key` of object `obj`, described as `where` in messages.
Result<const json*> Field(const json& obj, std::string_view where, const char* key) {
  auto it = obj.find(key);
  if (it == obj.end()) return DataLossError(fmt::format("{} has no field \"{}\"", where, key));
  return &*it;
}

Result<uint64_t> UnsignedField(const json& obj, std::string_view where, const char* key,
                               uint64_t max = UINT64_MAX) {
  NONSTOP_ASSIGN_OR_RETURN(const json* v, Field(obj, where, key));
  if (!v->is_number_unsigned() || v->get<uint64_t>() > max) {
    return DataLossError(fmt::format("{} field \"{}\" must be an integer from 0 to {}, it is {}",
                                     where, key, max, Shown(*v)));
  }
  return v->get<uint64_t>();
}

Result<std::string> StringField(const json& obj, std::string_view where, const char* key) {
  NONSTOP_ASSIGN_OR_RETURN(const json* v, Field(obj, where, key));
  if (!v->is_string())
    return DataLossError(
        fmt::format("{} field \"{}\" must be a string, it is {}", where, key, Shown(*v)));
  return v->get<std::string>();
}

Result<uint32_t> Crc32cField(const json& obj, std::string_view where, const char* key) {
  NONSTOP_ASSIGN_OR_RETURN(std::string text, StringField(obj, where, key));
  bool hex = text.size() == 8 && text.find_first_not_of("0123456789abcdef") == std::string::npos;
  if (!hex)
    return DataLossError(fmt::format("{} field \"{}\" must be 8 lowercase hex digits, it is \"{}\"",
                                     where, key, text.substr(0, 40)));
  return static_cast<uint32_t>(std::stoul(text, nullptr, 16));
}

// Bytes per element of a safetensors dtype; 0 for a dtype we do not know.
uint64_t KnownDtypeBytes(std::string_view dtype) {
  if (dtype == "F64" || dtype == "I64" || dtype == "U64") return 8;
  if (dtype == "F32" || dtype == "I32" || dtype == "U32") return 4;
  if (dtype == "F16" || dtype == "BF16" || dtype == "I16" || dtype == "U16") return 2;
  if (dtype == "U8" || dtype == "I8" || dtype == "BOOL" || dtype == "F8_E4M3" || dtype == "F8_E5M2")
    return 1;
  return 0;
}

// A safetensors file's header may not exceed this (the reference reader's limit).
constexpr uint64_t kMaxSafetensorsHeaderBytes = 100 << 20;

Result<SafetensorsTensor> ParseTensorEntry(const std::string& name, const json& t,
                                           uint64_t data_bytes) {
  std::string where = fmt::format("tensor '{}'", name);
  if (!t.is_object())
    return DataLossError(fmt::format("{} must be an object, it is {}", where, Shown(t)));
  SafetensorsTensor out;
  out.name = name;
  NONSTOP_ASSIGN_OR_RETURN(out.dtype, StringField(t, where, "dtype"));
  uint64_t elem = KnownDtypeBytes(out.dtype);
  if (elem == 0)
    return DataLossError(
        fmt::format("{} has unknown dtype \"{}\"", where, out.dtype.substr(0, 40)));
  NONSTOP_ASSIGN_OR_RETURN(const json* shape, Field(t, where, "shape"));
  if (!shape->is_array())
    return DataLossError(
        fmt::format("{} field \"shape\" must be an array, it is {}", where, Shown(*shape)));
  uint64_t elements = 1;
  bool overflow = false;
  for (const json& d : *shape) {
    if (!d.is_number_unsigned() || d.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) {
      return DataLossError(fmt::format(
          "{} field \"shape\" holds {}, not a dimension (an integer >= 0)", where, Shown(d)));
    }
    uint64_t dim = d.get<uint64_t>();
    out.shape.push_back(static_cast<int64_t>(dim));
    if (dim != 0 && elements > UINT64_MAX / dim) overflow = true;
    elements = overflow ? 0 : elements * dim;
  }
  NONSTOP_ASSIGN_OR_RETURN(const json* offs, Field(t, where, "data_offsets"));
  if (!offs->is_array() || offs->size() != 2 || !(*offs)[0].is_number_unsigned() ||
      !(*offs)[1].is_number_unsigned()) {
    return DataLossError(
        fmt::format("{} field \"data_offsets\" must be [begin, end] (two integers >= 0), it is {}",
                    where, Shown(*offs)));
  }
  out.begin = (*offs)[0].get<uint64_t>();
  out.end = (*offs)[1].get<uint64_t>();
  if (out.begin > out.end) {
    return DataLossError(
        fmt::format("{} field \"data_offsets\" is [{}, {}]: it ends before it begins", where,
                    out.begin, out.end));
  }
  if (out.end > data_bytes) {
    return DataLossError(fmt::format(
        "{} field \"data_offsets\" is [{}, {}], past the end of the {}-byte data section", where,
        out.begin, out.end, data_bytes));
  }
  if (overflow || elements > UINT64_MAX / elem || elements * elem != out.end - out.begin) {
    return DataLossError(fmt::format(
        "{} field \"shape\" {} of {} ({} bytes each) disagrees with its data_offsets' {} "
        "bytes",
        where, Shown(*shape), out.dtype, elem, out.end - out.begin));
  }
  return out;
}

}  // namespace

Result<SafetensorsHeader> ParseSafetensorsHeader(std::span<const std::byte> file_bytes) {
  const char* p = reinterpret_cast<const char*>(file_bytes.data());
  if (file_bytes.size() < 8) {
    return DataLossError(
        fmt::format("{} bytes: too short for the 8-byte header length", file_bytes.size()));
  }
  uint64_t header_len = DecodeFixed64(p);
  if (header_len > file_bytes.size() - 8 || header_len > kMaxSafetensorsHeaderBytes) {
    return DataLossError(
        fmt::format("header length {} exceeds the {} bytes that follow it (or the {}-byte limit)",
                    header_len, file_bytes.size() - 8, kMaxSafetensorsHeaderBytes));
  }
  json header = json::parse(p + 8, p + 8 + header_len, nullptr, /*allow_exceptions=*/false);
  if (header.is_discarded() || !header.is_object())
    return DataLossError("header is not a JSON object");
  SafetensorsHeader out;
  out.data_offset = 8 + header_len;
  uint64_t data_bytes = file_bytes.size() - out.data_offset;
  for (const auto& [name, t] : header.items()) {
    if (name == "__metadata__") {
      if (!t.is_object())
        return DataLossError(fmt::format("\"__metadata__\" must be an object, it is {}", Shown(t)));
      continue;
    }
    NONSTOP_ASSIGN_OR_RETURN(SafetensorsTensor tensor, ParseTensorEntry(name, t, data_bytes));
    out.tensors.push_back(std::move(tensor));
  }
  std::sort(out.tensors.begin(), out.tensors.end(),
            [](const SafetensorsTensor& a, const SafetensorsTensor& b) {
              return std::tie(a.begin, a.end) < std::tie(b.begin, b.end);
            });
  uint64_t at = 0;
  for (const auto& t : out.tensors) {
    if (t.begin != at) {
      return DataLossError(fmt::format(
          "tensor '{}' starts at byte {} of the data section, where the tensors before it "
          "end at {} ({})",
          t.name, t.begin, at, t.begin < at ? "overlap" : "a gap"));
    }
    at = t.end;
  }
  if (at != data_bytes) {
    return DataLossError(
        fmt::format("the tensors cover {} bytes of the {}-byte data section", at, data_bytes));
  }
  return out;
}

Result<CheckpointManifest> ParseCheckpointManifest(std::string_view json_text) {
  json m = json::parse(json_text.begin(), json_text.end(), nullptr, /*allow_exceptions=*/false);
  if (m.is_discarded() || !m.is_object())
    return DataLossError("manifest.json is not a JSON object");
  constexpr std::string_view kWhere = "manifest";
  auto format = StringField(m, kWhere, "format");
  if (!format.ok() || *format != "nonstop-checkpoint") {
    return DataLossError(
        fmt::format("manifest.json is not a nonstop checkpoint manifest (field \"format\" must be "
                    "\"nonstop-checkpoint\", it is {})",
                    m.contains("format") ? Shown(m["format"]) : "missing"));
  }
  NONSTOP_ASSIGN_OR_RETURN(const json* version, Field(m, kWhere, "version"));
  if (!version->is_number_unsigned() || version->get<uint64_t>() != 1) {
    return InvalidArgumentError(
        fmt::format("checkpoint format version {} is not supported (manifest field \"version\"; "
                    "this build reads 1)",
                    Shown(*version)));
  }
  CheckpointManifest out;
  NONSTOP_ASSIGN_OR_RETURN(uint64_t step,
                           UnsignedField(m, kWhere, "step", static_cast<uint64_t>(INT64_MAX)));
  out.step = static_cast<int64_t>(step);
  NONSTOP_ASSIGN_OR_RETURN(uint64_t generation, UnsignedField(m, kWhere, "generation", UINT32_MAX));
  out.generation = static_cast<uint32_t>(generation);
  NONSTOP_ASSIGN_OR_RETURN(uint64_t world_size, UnsignedField(m, kWhere, "world_size", INT32_MAX));
  out.world_size = static_cast<int64_t>(world_size);
  NONSTOP_ASSIGN_OR_RETURN(out.recipe, StringField(m, kWhere, "recipe"));
  NONSTOP_ASSIGN_OR_RETURN(out.parameter_checksum, StringField(m, kWhere, "parameter_checksum"));
  NONSTOP_ASSIGN_OR_RETURN(std::string state_file, StringField(m, kWhere, "state_file"));
  if (state_file != kStateFile) {
    return DataLossError(fmt::format("manifest field \"state_file\" must be \"{}\", it is \"{}\"",
                                     kStateFile, state_file.substr(0, 40)));
  }
  NONSTOP_ASSIGN_OR_RETURN(out.state_bytes, UnsignedField(m, kWhere, "state_bytes"));
  NONSTOP_ASSIGN_OR_RETURN(out.state_file_crc32c, Crc32cField(m, kWhere, "state_file_crc32c"));
  NONSTOP_ASSIGN_OR_RETURN(const json* tensors, Field(m, kWhere, "tensors"));
  if (!tensors->is_object()) {
    return DataLossError(fmt::format(
        "manifest field \"tensors\" must be an object of name: {{bytes, crc32c}}, it is {}",
        Shown(*tensors)));
  }
  for (const auto& [name, t] : tensors->items()) {
    std::string where = fmt::format("manifest tensor '{}'", name);
    if (!t.is_object())
      return DataLossError(
          fmt::format("{} must be an object {{bytes, crc32c}}, it is {}", where, Shown(t)));
    CheckpointTensorSum sum;
    NONSTOP_ASSIGN_OR_RETURN(sum.bytes, UnsignedField(t, where, "bytes"));
    NONSTOP_ASSIGN_OR_RETURN(sum.crc32c, Crc32cField(t, where, "crc32c"));
    out.tensors.emplace(name, sum);
  }
  out.json = std::move(m);
  return out;
}

namespace {

struct CheckedCheckpoint {
  CheckpointManifest manifest;
  std::string file;          // all of state.safetensors
  uint64_t data_offset = 0;  // where the tensors' bytes start in `file`
  SafetensorsHeader header;
  // What goes where: each region loaded and its tensor in the file (pointers
  // into `header`, which a move keeps in place and a copy would not: no copies).
  CheckedCheckpoint() = default;
  CheckedCheckpoint(CheckedCheckpoint&&) = default;
  CheckedCheckpoint(const CheckedCheckpoint&) = delete;
  CheckedCheckpoint& operator=(const CheckedCheckpoint&) = delete;
  std::vector<std::pair<const Region*, const SafetensorsTensor*>> copies;
  bool by_name = false;
  std::vector<std::string> kept, ignored;  // LoadedCheckpoint's
};

// The other writer wrote it (LoadOptions::loader).
bool WrittenByTheOther(const CheckpointManifest& m, std::string_view loader) {
  if (loader.empty()) return false;
  std::string writer = m.json.value("recipe", std::string()) == kPythonWriter
                           ? std::string(kPythonWriter)
                           : std::string(kTrainWriter);
  if (auto it = m.json.find("writer"); it != m.json.end() && it->is_string()) writer = *it;
  return writer != loader;
}

Status SameTensor(const Region& r, const SafetensorsTensor& t, bool shape_too) {
  if (t.end - t.begin != r.bytes.size()) {
    return InvalidArgumentError(
        fmt::format("tensor '{}' has {} bytes in the checkpoint, this worker has {}", r.name,
                    t.end - t.begin, r.bytes.size()));
  }
  if (t.dtype != r.dtype) {
    return InvalidArgumentError(
        fmt::format("tensor '{}' has dtype {} in the checkpoint, this worker has {}", r.name,
                    t.dtype, r.dtype));
  }
  if (shape_too && t.shape != ShapeOf(r)) {
    return InvalidArgumentError(
        fmt::format("tensor '{}' has shape [{}] in the checkpoint, this worker has [{}]", r.name,
                    fmt::join(t.shape, ", "), fmt::join(ShapeOf(r), ", ")));
  }
  return OkStatus();
}

// The same trainer's checkpoint: exactly the registry's regions, in order.
Status MatchInOrder(const StateRegistry& reg, const SafetensorsHeader& header,
                    const std::map<std::string_view, const SafetensorsTensor*>& by_name,
                    std::span<const std::string> optional, CheckedCheckpoint* out) {
  uint64_t offset = 0;
  for (const auto& r : reg.regions()) {
    auto it = by_name.find(r.name);
    if (it == by_name.end() &&
        std::find(optional.begin(), optional.end(), r.name) != optional.end()) {
      out->kept.push_back(r.name);  // registered since the checkpoint was written
      continue;
    }
    if (it == by_name.end()) {
      return InvalidArgumentError(
          fmt::format("the checkpoint has no tensor '{}': it was written by another model or "
                      "optimizer",
                      r.name));
    }
    const SafetensorsTensor& t = *it->second;
    NONSTOP_RETURN_IF_ERROR(SameTensor(r, t, /*shape_too=*/true));
    if (t.begin != offset) {
      return InvalidArgumentError(
          fmt::format("tensor '{}' is at byte {} of the checkpoint's data, this worker expects {} "
                      "(the tensors are in another order)",
                      r.name, t.begin, offset));
    }
    offset += r.bytes.size();
    out->copies.emplace_back(&r, &t);
  }
  for (const auto& t : header.tensors) {
    bool registered = std::any_of(reg.regions().begin(), reg.regions().end(),
                                  [&](const Region& r) { return r.name == t.name; });
    if (!registered) {
      return InvalidArgumentError(
          fmt::format("the checkpoint holds tensor '{}', which this worker does not have: it "
                      "was written by another model or optimizer",
                      t.name));
    }
  }
  return OkStatus();
}

// The other writer's checkpoint: by name. Every required region (parameters,
// optimizer moments) must be there, with its dtype and shape;
// the rest (counters, positions) is loaded where the names, dtypes and sizes
// agree and kept otherwise.
Status MatchByName(const StateRegistry& reg, const SafetensorsHeader& header,
                   const std::map<std::string_view, const SafetensorsTensor*>& by_name,
                   std::span<const std::string> required_names, CheckedCheckpoint* out) {
  out->by_name = true;
  for (const auto& r : reg.regions()) {
    const bool required = required_names.empty()
                              ? r.dtype == "F32"
                              : std::find(required_names.begin(), required_names.end(), r.name) !=
                                    required_names.end();
    auto it = by_name.find(r.name);
    if (it == by_name.end() && required) {
      return InvalidArgumentError(fmt::format(
          "the checkpoint (written by another trainer) has no tensor '{}': a model or optimizer "
          "whose parameters and moments have other names or shapes",
          r.name));
    }
    Status same = it == by_name.end() ? NotFoundError("") : SameTensor(r, *it->second, required);
    if (!same.ok() && required) return same;
    if (same.ok()) {
      out->copies.emplace_back(&r, it->second);
    } else {
      out->kept.push_back(r.name);
    }
  }
  for (const auto& t : header.tensors) {
    bool loaded = std::any_of(out->copies.begin(), out->copies.end(),
                              [&](const auto& c) { return c.second == &t; });
    if (!loaded) out->ignored.push_back(t.name);
  }
  return OkStatus();
}

// Reads and checks one checkpoint against the live layout; changes nothing.
Result<CheckedCheckpoint> Check(const std::string& path, const StateRegistry& reg,
                                const LoadOptions& options) {
  auto manifest_text = ReadFile(path + "/" + kManifestFile);
  if (!manifest_text.ok()) return DataLossError("no manifest.json: the checkpoint is incomplete");
  CheckedCheckpoint out;
  NONSTOP_ASSIGN_OR_RETURN(out.manifest, ParseCheckpointManifest(*manifest_text));
  const CheckpointManifest& m = out.manifest;
  auto data = ReadFile(path + "/" + kStateFile);
  if (!data.ok()) return DataLossError("state.safetensors is missing");
  out.file = std::move(*data);
  const std::string& file = out.file;
  if (file.size() != m.state_bytes) {
    return DataLossError(fmt::format(
        "state.safetensors is {} bytes, the manifest's \"state_bytes\" says {} ({})", file.size(),
        m.state_bytes, file.size() < m.state_bytes ? "truncated" : "trailing bytes"));
  }
  uint32_t file_crc = Crc32c(file);
  if (file_crc != m.state_file_crc32c) {
    return DataLossError(fmt::format(
        "state.safetensors fails its checksum (crc32c {:08x}, the manifest says {:08x}): the "
        "file is corrupt",
        file_crc, m.state_file_crc32c));
  }
  auto header = ParseSafetensorsHeader(std::as_bytes(std::span(file.data(), file.size())));
  if (!header.ok()) return header.status().WithContext("state.safetensors");
  out.header = std::move(*header);
  out.data_offset = out.header.data_offset;
  std::map<std::string_view, const SafetensorsTensor*> by_name;  // into out.header, which stays
  for (const auto& t : out.header.tensors) by_name.emplace(t.name, &t);
  NONSTOP_RETURN_IF_ERROR(WrittenByTheOther(m, options.loader)
                              ? MatchByName(reg, out.header, by_name, options.required, &out)
                              : MatchInOrder(reg, out.header, by_name, options.optional, &out));
  // Every tensor's own CRC, from the manifest.
  for (const auto& [r, t] : out.copies) {
    auto it = m.tensors.find(t->name);
    if (it == m.tensors.end()) {
      return DataLossError(
          fmt::format("the manifest's \"tensors\" has no entry for tensor '{}'", t->name));
    }
    if (it->second.bytes != t->end - t->begin) {
      return DataLossError(
          fmt::format("the manifest says tensor '{}' has {} bytes, the state file has {}", t->name,
                      it->second.bytes, t->end - t->begin));
    }
    uint32_t crc = Crc32c(file.data() + out.data_offset + t->begin, t->end - t->begin);
    if (crc != it->second.crc32c) {
      return DataLossError(fmt::format(
          "tensor '{}' fails its checksum (crc32c {:08x}, the manifest says {:08x}): the "
          "state file is corrupt",
          t->name, crc, it->second.crc32c));
    }
  }
  if (m.tensors.size() != out.header.tensors.size()) {
    return DataLossError(fmt::format("the manifest lists {} tensors, the state file holds {}",
                                     m.tensors.size(), out.header.tensors.size()));
  }
  return out;
}

}  // namespace

Status VerifyCheckpoint(const std::string& path, const StateRegistry& registry) {
  return Check(path, registry, LoadOptions{}).status();
}

Result<LoadedCheckpoint> LoadNewestCheckpoint(const std::string& dir, StateRegistry& registry,
                                              const LoadOptions& options) {
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
    auto checked = Check(path, registry, options);
    if (!checked.ok()) {
      out.skipped.push_back(path + ": " + checked.status().message());
      continue;
    }
    for (const auto& [r, t] : checked->copies) {
      const auto* from = reinterpret_cast<const std::byte*>(checked->file.data() +
                                                            checked->data_offset + t->begin);
      registry.WriteRegion(static_cast<size_t>(r - registry.regions().data()), 0,
                           std::span(from, r->bytes.size()));  // device memory too
    }
    out.by_name = checked->by_name;
    out.kept = std::move(checked->kept);
    out.ignored = std::move(checked->ignored);
    out.path = path;
    out.step = checked->manifest.step;
    out.manifest = checked->manifest.json;
    out.parsed = std::move(checked->manifest);
    return out;
  }
  std::string why;
  for (const auto& s : out.skipped) why += "\n  skipped " + s;
  return NotFoundError(fmt::format("no valid checkpoint in {}{}", dir, why));
}

}  // namespace nonstop::state
