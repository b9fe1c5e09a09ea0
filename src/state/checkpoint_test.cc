#include "state/checkpoint.h"

#include <gtest/gtest.h>

#include <fmt/format.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <numeric>

#include "common/coding.h"
#include "common/file_util.h"
#include "common/temp_dir.h"
#include "nonstop/crc32c.h"

namespace nonstop::state {
namespace {

namespace fs = std::filesystem;

struct Model {
  std::vector<float> w = std::vector<float>(600);
  std::vector<float> m = std::vector<float>(600);
  int64_t step = -1;
  StateRegistry reg{256};
  Model() {
    NONSTOP_CHECK(reg.RegisterFloats("w", w, {20, 30}).ok());
    NONSTOP_CHECK(reg.RegisterFloats("adam.m", m).ok());
    NONSTOP_CHECK(reg.RegisterValue("step", &step).ok());
  }
  void Fill(float base, int64_t s) {
    std::iota(w.begin(), w.end(), base);
    std::iota(m.begin(), m.end(), -base);
    step = s;
  }
};

CheckpointMeta Meta(int64_t step) {
  CheckpointMeta m;
  m.step = step;
  m.recipe = "test";
  m.parameter_checksum = "abcd";
  return m;
}

TEST(CheckpointTest, AsyncSaveThenLoadRestoresTheState) {
  TempDir dir;
  Model a;
  a.Fill(1.0f, 30);
  {
    CheckpointWriter writer(dir.path(), 3);
    ASSERT_TRUE(writer.Save(a.reg, Meta(30)).ok());
    a.Fill(99.0f, 31);  // training goes on: the checkpoint holds the copy taken at Save
    ASSERT_TRUE(writer.Wait().ok());
    ASSERT_TRUE(writer.last_written().has_value());
    EXPECT_EQ(writer.last_written()->step, 30);
  }
  Model b;
  auto loaded = LoadNewestCheckpoint(dir.path(), b.reg);
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  EXPECT_EQ(loaded->step, 30);
  EXPECT_EQ(b.step, 30);
  EXPECT_EQ(b.w[5], 6.0f);
  EXPECT_EQ(loaded->manifest["recipe"], "test");
}

// Holds the background write of one step until the test releases it (and
// releases it on destruction, so that a failing test cannot hang the writer).
class WriteGate {
 public:
  WriteGate(CheckpointWriter* writer, int64_t step) : released_(release_.get_future().share()) {
    writer->SetWriteHookForTesting([this, step](int64_t s) {
      if (s != step) return;
      entered_.set_value();
      released_.wait();
    });
  }
  ~WriteGate() { Release(); }
  void WaitUntilEntered() { entered_.get_future().wait(); }
  void Release() {
    if (!released_once_) release_.set_value();
    released_once_ = true;
  }

 private:
  std::promise<void> entered_, release_;
  std::shared_future<void> released_;
  bool released_once_ = false;
};

TEST(CheckpointTest, SaveWhileAWriteIsInFlightSkipsInsteadOfWaiting) {
  TempDir dir;
  Model a;
  a.Fill(1.0f, 30);
  CheckpointWriter writer(dir.path(), 3);
  WriteGate gate(&writer, 30);  // destroyed first: releases the write before the writer joins
  CheckpointSaveResult first = writer.TrySave(a.reg, Meta(30));
  EXPECT_FALSE(first.skipped) << first.ToString();
  gate.WaitUntilEntered();  // the write of step 30 is in flight, and stays there
  // The unfixed writer waited here for the write of step 30: the test hung.
  CheckpointSaveResult second = writer.TrySave(a.reg, Meta(31));
  EXPECT_TRUE(second.skipped);
  EXPECT_EQ(second.step, 31);
  EXPECT_EQ(second.in_flight_step, 30);
  EXPECT_EQ(second.ToString(), "skipped step 31: the write of step 30 is still in flight");
  EXPECT_TRUE(writer.Save(a.reg, Meta(32)).ok()) << "a skip is not an error of the old API";
  EXPECT_EQ(writer.skipped_count(), 2u);
  gate.Release();
  ASSERT_TRUE(writer.Wait().ok());
  EXPECT_EQ(writer.last_written()->step, 30);
  EXPECT_TRUE(fs::exists(dir / "step-000000030"));
  EXPECT_FALSE(fs::exists(dir / "step-000000031"));
  EXPECT_FALSE(fs::exists(dir / "step-000000032"));
  // Caught up: the next checkpoint is written.
  CheckpointSaveResult third = writer.TrySave(a.reg, Meta(33));
  EXPECT_FALSE(third.skipped) << third.ToString();
  ASSERT_TRUE(writer.Wait().ok());
  EXPECT_EQ(writer.last_written()->step, 33);
}

TEST(CheckpointTest, DestructorFinishesTheQueuedWrite) {
  TempDir dir;
  Model a;
  a.Fill(2.0f, 7);
  {
    CheckpointWriter writer(dir.path(), 3);
    ASSERT_FALSE(writer.TrySave(a.reg, Meta(7)).skipped);
  }
  EXPECT_TRUE(fs::exists(dir / "step-000000007/manifest.json"));
}

TEST(CheckpointTest, FailedWriteIsReportedByTheNextSave) {
  TempDir dir;
  std::string blocked = dir / "file";
  ASSERT_TRUE(WriteFileAtomically(blocked, "not a directory").ok());
  Model a;
  a.Fill(1.0f, 1);
  CheckpointWriter writer(blocked + "/ckpt", 3);
  ASSERT_TRUE(writer.Save(a.reg, Meta(1)).ok());
  EXPECT_FALSE(writer.Wait().ok());
  CheckpointSaveResult next = writer.TrySave(a.reg, Meta(2));
  EXPECT_FALSE(next.skipped);
  EXPECT_FALSE(next.earlier.ok());
  EXPECT_NE(next.ToString().find("an earlier write failed"), std::string::npos) << next.ToString();
  EXPECT_FALSE(writer.Wait().ok());
}

TEST(CheckpointTest, SafetensorsHeaderDescribesEveryTensor) {
  TempDir dir;
  Model a;
  a.Fill(1.0f, 3);
  auto st = WriteCheckpoint(dir.path(), a.reg, Meta(3), 3);
  ASSERT_TRUE(st.ok());
  auto file = ReadFile(st->path + "/state.safetensors");
  ASSERT_TRUE(file.ok());
  uint64_t n = DecodeFixed64(file->data());
  EXPECT_EQ((8 + n) % 8, 0u) << "header padded to 8 bytes";
  auto header = nlohmann::json::parse(file->substr(8, n));
  EXPECT_EQ(header["w"]["dtype"], "F32");
  EXPECT_EQ(header["w"]["shape"], nlohmann::json({20, 30}));
  EXPECT_EQ(header["step"]["dtype"], "I64");
  EXPECT_EQ(header["adam.m"]["data_offsets"], nlohmann::json({2400, 4800}));
  float first;
  std::memcpy(&first, file->data() + 8 + n, 4);
  EXPECT_EQ(first, 1.0f);
}

TEST(CheckpointTest, CorruptTruncatedAndHalfWrittenCheckpointsAreSkippedWithReasons) {
  TempDir dir;
  Model a;
  for (int64_t s : {10, 20, 30, 40}) {
    a.Fill(static_cast<float>(s), s);
    ASSERT_TRUE(WriteCheckpoint(dir.path(), a.reg, Meta(s), 10).ok());
  }
  // 40: truncated; 30: a flipped byte; 20: no manifest; plus a half-written 50.
  std::string p40 = dir / "step-000000040/state.safetensors";
  fs::resize_file(p40, fs::file_size(p40) - 7);
  {
    std::fstream f(dir / "step-000000030/state.safetensors",
                   std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(300);
    f.put('\x55');
  }
  fs::remove(dir / "step-000000020/manifest.json");
  fs::create_directories(dir / "step-000000050.tmp-123");
  Model b;
  auto loaded = LoadNewestCheckpoint(dir.path(), b.reg);
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  EXPECT_EQ(loaded->step, 10);
  EXPECT_EQ(b.w[0], 10.0f);
  ASSERT_EQ(loaded->skipped.size(), 4u);
  std::string all;
  for (const auto& s : loaded->skipped) all += s + "\n";
  EXPECT_NE(all.find("half-written"), std::string::npos) << all;
  EXPECT_NE(all.find("truncated"), std::string::npos) << all;
  EXPECT_NE(all.find("fails its checksum"), std::string::npos) << all;
  EXPECT_NE(all.find("no manifest.json"), std::string::npos) << all;
}

TEST(CheckpointTest, NothingValidIsNotFoundWithEveryReason) {
  TempDir dir;
  Model a;
  a.Fill(1, 5);
  ASSERT_TRUE(WriteCheckpoint(dir.path(), a.reg, Meta(5), 3).ok());
  fs::remove(dir / "step-000000005/manifest.json");
  Model b;
  auto loaded = LoadNewestCheckpoint(dir.path(), b.reg);
  ASSERT_FALSE(loaded.ok());
  EXPECT_EQ(loaded.status().code(), StatusCode::kNotFound);
  EXPECT_NE(loaded.status().message().find("no manifest.json"), std::string::npos);
  EXPECT_EQ(b.step, -1) << "nothing loaded";
}

TEST(CheckpointTest, RetentionKeepsTheNewest) {
  TempDir dir;
  Model a;
  for (int64_t s = 1; s <= 5; ++s) {
    a.Fill(1, s);
    ASSERT_TRUE(WriteCheckpoint(dir.path(), a.reg, Meta(s), 2).ok());
  }
  EXPECT_FALSE(fs::exists(dir / "step-000000003"));
  EXPECT_TRUE(fs::exists(dir / "step-000000004"));
  EXPECT_TRUE(fs::exists(dir / "step-000000005"));
}

TEST(CheckpointTest, OtherModelIsRefusedByName) {
  TempDir dir;
  Model a;
  a.Fill(1, 5);
  ASSERT_TRUE(WriteCheckpoint(dir.path(), a.reg, Meta(5), 3).ok());
  std::vector<float> other(600);
  int64_t step = 0;
  StateRegistry reg;
  ASSERT_TRUE(reg.RegisterFloats("v", other).ok());
  ASSERT_TRUE(reg.RegisterValue("step", &step).ok());
  Status s = VerifyCheckpoint(dir / "step-000000005", reg);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("'v'"), std::string::npos) << s.ToString();
}

// State registered since a checkpoint was written (the Python package's model buffers): listed as
// optional it keeps its values and the rest loads; not listed, the checkpoint is another model's.
TEST(CheckpointTest, ARegionRegisteredSinceTheCheckpointLoadsWhenOptional) {
  TempDir dir;
  Model a;
  a.Fill(1, 5);
  ASSERT_TRUE(WriteCheckpoint(dir.path(), a.reg, Meta(5), 3).ok());
  std::vector<float> w(600), m(600), running_mean(8, 0.5f);
  int64_t step = -1;
  StateRegistry reg(256);
  ASSERT_TRUE(reg.RegisterFloats("w", w, {20, 30}).ok());
  ASSERT_TRUE(reg.RegisterFloats("bn.running_mean", running_mean).ok());
  ASSERT_TRUE(reg.RegisterFloats("adam.m", m).ok());
  ASSERT_TRUE(reg.RegisterValue("step", &step).ok());
  auto refused = LoadNewestCheckpoint(dir.path(), reg);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("'bn.running_mean'"), std::string::npos)
      << refused.status().ToString();
  auto loaded = LoadNewestCheckpoint(dir.path(), reg, {.optional = {"bn.running_mean"}});
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  EXPECT_EQ(loaded->kept, std::vector<std::string>{"bn.running_mean"});
  EXPECT_EQ(w, a.w);
  EXPECT_EQ(m, a.m);
  EXPECT_EQ(step, 5);
  EXPECT_EQ(running_mean, std::vector<float>(8, 0.5f));
}

// The Python package's layout of the same model: the parameters and moments by
// the same names and shapes, in another order, with counters of its own.
struct PythonModel {
  std::vector<float> w = std::vector<float>(600), m = std::vector<float>(600);
  std::vector<float> adam_step = {0.0f};
  int64_t tokens = 7, step = -1;
  StateRegistry reg{256};
  PythonModel() {
    NONSTOP_CHECK(reg.RegisterFloats("adam.m", m, {600}).ok());
    NONSTOP_CHECK(reg.RegisterFloats("w", w, {20, 30}).ok());
    NONSTOP_CHECK(reg.RegisterFloats("adam.step.w", adam_step).ok());  // one element: a counter
    NONSTOP_CHECK(reg.RegisterValue("extra.tokens", &tokens).ok());
    NONSTOP_CHECK(reg.RegisterValue("step", &step).ok());
  }
};

TEST(CheckpointTest, TheOtherTrainersCheckpointIsLoadedByNameAndItsOwnCountersKept) {
  TempDir dir;
  Model a;  // nonstop-train's layout ("test" recipe)
  a.Fill(1.0f, 12);
  ASSERT_TRUE(WriteCheckpoint(dir.path(), a.reg, Meta(12), 3).ok());
  PythonModel p;
  // The same kind (or no loader named) wants exactly its own regions, in order.
  EXPECT_FALSE(LoadNewestCheckpoint(dir.path(), p.reg).ok());
  EXPECT_FALSE(LoadNewestCheckpoint(dir.path(), p.reg, {.loader = kTrainWriter}).ok());
  const LoadOptions python{.loader = kPythonWriter, .required = {"adam.m", "w"}};
  auto loaded = LoadNewestCheckpoint(dir.path(), p.reg, python);
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  EXPECT_TRUE(loaded->by_name);
  EXPECT_EQ(p.w, a.w);
  EXPECT_EQ(p.m, a.m);
  EXPECT_EQ(p.step, 12);
  EXPECT_EQ(p.tokens, 7) << "a counter the checkpoint does not have keeps its value";
  EXPECT_EQ(loaded->kept, (std::vector<std::string>{"adam.step.w", "extra.tokens"}));
  EXPECT_TRUE(loaded->ignored.empty());

  // Back: the Python layout's checkpoint loads into nonstop-train's, its counters ignored.
  TempDir back;
  p.w[3] = 42.0f;
  CheckpointMeta meta = Meta(13);
  meta.writer = std::string(kPythonWriter);
  ASSERT_TRUE(WriteCheckpoint(back.path(), p.reg, meta, 3).ok());
  Model b;
  const LoadOptions train{.loader = kTrainWriter};  // required: its float regions
  loaded = LoadNewestCheckpoint(back.path(), b.reg, train);
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  EXPECT_EQ(b.w[3], 42.0f);
  EXPECT_EQ(b.step, 12);
  EXPECT_EQ(loaded->ignored, (std::vector<std::string>{"adam.step.w", "extra.tokens"}));

  // A parameter of another shape is refused by name, whoever wrote it.
  std::vector<float> w2(600);
  int64_t step = 0;
  StateRegistry other;
  ASSERT_TRUE(other.RegisterFloats("w", w2, {30, 20}).ok());
  ASSERT_TRUE(other.RegisterValue("step", &step).ok());
  auto refused = LoadNewestCheckpoint(back.path(), other, train);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("tensor 'w' has shape [20, 30] in the checkpoint"),
            std::string::npos)
      << refused.status().ToString();
  // A parameter missing in it too.
  StateRegistry missing;
  ASSERT_TRUE(missing.RegisterFloats("v", w2, {600}).ok());
  refused = LoadNewestCheckpoint(back.path(), missing, train);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("has no tensor 'v'"), std::string::npos)
      << refused.status().ToString();
}

// Rewrites checkpoint `path` the way a forger would: the safetensors header
// and the data may be changed, and the manifest's whole-file size and CRC are
// then made right again, so that only the deeper checks can catch the change.
// The per-tensor CRCs are left as they were unless `manifest_edit` changes them.
void Forge(const std::string& path, const std::function<void(nlohmann::json&)>& header_edit,
           const std::function<void(std::string&)>& data_edit,
           const std::function<void(nlohmann::json&)>& manifest_edit) {
  auto file = ReadFile(path + "/state.safetensors");
  ASSERT_TRUE(file.ok());
  uint64_t n = DecodeFixed64(file->data());
  nlohmann::json header = nlohmann::json::parse(file->substr(8, n));
  std::string data = file->substr(8 + n);
  if (header_edit) header_edit(header);
  if (data_edit) data_edit(data);
  std::string text = header.dump();
  while (text.size() % 8 != 0) text += ' ';
  std::string out;
  PutFixed64(&out, text.size());
  out += text + data;
  ASSERT_TRUE(WriteFileAtomically(path + "/state.safetensors", out).ok());
  auto manifest_text = ReadFile(path + "/manifest.json");
  ASSERT_TRUE(manifest_text.ok());
  nlohmann::json manifest = nlohmann::json::parse(*manifest_text);
  manifest["state_bytes"] = out.size();
  manifest["state_file_crc32c"] = fmt::format("{:08x}", Crc32c(out));
  if (manifest_edit) manifest_edit(manifest);
  ASSERT_TRUE(WriteFileAtomically(path + "/manifest.json", manifest.dump(2)).ok());
}

// Writes checkpoints of steps 10 and 20, forges step 20, and expects the load
// to skip it with a reason holding every string in `reason` and load step 10.
void ExpectForgedNewestIsSkipped(const std::function<void(nlohmann::json&)>& header_edit,
                                 const std::function<void(std::string&)>& data_edit,
                                 const std::function<void(nlohmann::json&)>& manifest_edit,
                                 const std::vector<std::string>& reason) {
  TempDir dir;
  Model a;
  for (int64_t s : {10, 20}) {
    a.Fill(static_cast<float>(s), s);
    ASSERT_TRUE(WriteCheckpoint(dir.path(), a.reg, Meta(s), 10).ok());
  }
  Forge(dir / "step-000000020", header_edit, data_edit, manifest_edit);
  Model b;
  auto loaded = LoadNewestCheckpoint(dir.path(), b.reg);
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  EXPECT_EQ(loaded->step, 10);
  EXPECT_EQ(b.w[0], 10.0f);
  ASSERT_EQ(loaded->skipped.size(), 1u);
  for (const auto& r : reason)
    EXPECT_NE(loaded->skipped[0].find(r), std::string::npos) << loaded->skipped[0];
}

TEST(CheckpointTest, TensorThatFailsItsOwnCrcIsSkippedNamingTheTensor) {
  // One flipped byte inside adam.m, with the whole-file CRC made right again:
  // only the per-tensor CRC in the manifest can catch it.
  ExpectForgedNewestIsSkipped(nullptr, [](std::string& data) { data[2400 + 17] ^= 0x01; }, nullptr,
                              {"'adam.m'", "checksum"});
}

struct ManifestCase {
  const char* name;
  std::function<void(nlohmann::json&)> edit;
  std::vector<std::string> reason;
};

void PrintTo(const ManifestCase& c, std::ostream* os) { *os << c.name; }

class WrongManifestTest : public ::testing::TestWithParam<ManifestCase> {};

TEST_P(WrongManifestTest, IsSkippedWithAReasonNamingTheField) {
  ExpectForgedNewestIsSkipped(nullptr, nullptr, GetParam().edit, GetParam().reason);
}

INSTANTIATE_TEST_SUITE_P(
    CheckpointTest, WrongManifestTest,
    ::testing::Values(
        ManifestCase{"StepNotANumber",
                     [](nlohmann::json& m) { m["step"] = "abc"; },
                     {"\"step\"", "integer"}},
        ManifestCase{"NegativeStep", [](nlohmann::json& m) { m["step"] = -3; }, {"\"step\""}},
        ManifestCase{
            "VersionAsString", [](nlohmann::json& m) { m["version"] = "1"; }, {"\"version\""}},
        ManifestCase{
            "FormatNotAString", [](nlohmann::json& m) { m["format"] = 7; }, {"\"format\""}},
        ManifestCase{
            "NoTensorList", [](nlohmann::json& m) { m.erase("tensors"); }, {"\"tensors\""}},
        ManifestCase{"TensorListNotAnObject",
                     [](nlohmann::json& m) { m["tensors"] = nlohmann::json::array(); },
                     {"\"tensors\""}},
        ManifestCase{"NegativeStateBytes",
                     [](nlohmann::json& m) { m["state_bytes"] = -5; },
                     {"\"state_bytes\""}},
        ManifestCase{"FileCrcNotAString",
                     [](nlohmann::json& m) { m["state_file_crc32c"] = 5; },
                     {"\"state_file_crc32c\""}},
        ManifestCase{"NegativeTensorSize",
                     [](nlohmann::json& m) { m["tensors"]["w"]["bytes"] = -2400; },
                     {"'w'", "\"bytes\""}},
        ManifestCase{"TensorCrcNotHex",
                     [](nlohmann::json& m) { m["tensors"]["w"]["crc32c"] = "zzzzzzzz"; },
                     {"'w'", "\"crc32c\""}},
        ManifestCase{
            "TensorMissing", [](nlohmann::json& m) { m["tensors"].erase("adam.m"); }, {"'adam.m'"}},
        ManifestCase{"ParameterChecksumNotAString",
                     [](nlohmann::json& m) { m["parameter_checksum"] = 12; },
                     {"\"parameter_checksum\""}},
        ManifestCase{"GenerationNegative",
                     [](nlohmann::json& m) { m["generation"] = -1; },
                     {"\"generation\""}}),
    [](const ::testing::TestParamInfo<ManifestCase>& info) {
      return std::string(info.param.name);
    });

struct HeaderCase {
  const char* name;
  std::function<void(nlohmann::json&)> edit;
  std::vector<std::string> reason;
};

void PrintTo(const HeaderCase& c, std::ostream* os) { *os << c.name; }

class WrongSafetensorsHeaderTest : public ::testing::TestWithParam<HeaderCase> {};

TEST_P(WrongSafetensorsHeaderTest, IsSkippedWithAReasonNamingTheTensor) {
  ExpectForgedNewestIsSkipped(GetParam().edit, nullptr, nullptr, GetParam().reason);
}

INSTANTIATE_TEST_SUITE_P(
    CheckpointTest, WrongSafetensorsHeaderTest,
    ::testing::Values(
        HeaderCase{"EntryNotAnObject", [](nlohmann::json& h) { h["w"] = 5; }, {"'w'"}},
        HeaderCase{"OffsetsNotNumbers",
                   [](nlohmann::json& h) { h["w"]["data_offsets"] = "x"; },
                   {"'w'", "data_offsets"}},
        HeaderCase{"EndBeforeBegin",
                   [](nlohmann::json& h) {
                     h["w"]["data_offsets"] = {2400, 0};
                   },
                   {"'w'", "data_offsets", "ends before it begins"}},
        HeaderCase{"OffsetsPastTheData",
                   [](nlohmann::json& h) {
                     h["step"]["data_offsets"] = {4800, 1u << 30};
                   },
                   {"'step'", "data_offsets"}},
        HeaderCase{"ShapeOfAnotherModel",
                   [](nlohmann::json& h) {
                     h["w"]["shape"] = {30, 20};
                   },
                   {"'w'", "shape"}},
        HeaderCase{"ShapeDisagreesWithSize",
                   [](nlohmann::json& h) {
                     h["w"]["shape"] = {20, 31};
                   },
                   {"'w'", "shape"}},
        HeaderCase{
            "OtherDtype", [](nlohmann::json& h) { h["w"]["dtype"] = "I32"; }, {"'w'", "dtype"}},
        HeaderCase{"UnknownTensor",
                   [](nlohmann::json& h) {
                     h["extra"] = {{"dtype", "U8"}, {"shape", {0}}, {"data_offsets", {4808, 4808}}};
                   },
                   {"'extra'"}}),
    [](const ::testing::TestParamInfo<HeaderCase>& info) { return std::string(info.param.name); });

TEST(CheckpointTest, ParseManifestRefusesEveryTruncationWithoutThrowing) {
  TempDir dir;
  Model a;
  a.Fill(1, 3);
  auto st = WriteCheckpoint(dir.path(), a.reg, Meta(3), 3);
  ASSERT_TRUE(st.ok());
  auto text = ReadFile(st->path + "/manifest.json");
  ASSERT_TRUE(text.ok());
  auto whole = ParseCheckpointManifest(*text);
  ASSERT_TRUE(whole.ok()) << whole.status().ToString();
  EXPECT_EQ(whole->step, 3);
  EXPECT_EQ(whole->tensors.size(), 3u);
  EXPECT_EQ(whole->tensors.at("w").bytes, 2400u);
  std::string trimmed = text->substr(0, text->find_last_not_of(" \n") + 1);
  for (size_t n = 0; n < trimmed.size(); ++n) {
    auto parsed = ParseCheckpointManifest(trimmed.substr(0, n));
    EXPECT_EQ(parsed.status().code(), StatusCode::kDataLoss) << "a " << n << "-byte prefix";
  }
  for (const char* junk : {"", "null", "[]", "\"x\"", "{\"format\": \"nonstop-checkpoint\"}",
                           "{\"format\": [1]}", "{{{{", "\xff\xfe"}) {
    EXPECT_FALSE(ParseCheckpointManifest(junk).ok()) << junk;
  }
  // Deep nesting where a number belongs: the error message must not recurse into it.
  std::string deep = R"({"format": "nonstop-checkpoint", "version": 1, "step": )" +
                     std::string(1'000'000, '[') + std::string(1'000'000, ']') + "}";
  auto parsed = ParseCheckpointManifest(deep);
  ASSERT_FALSE(parsed.ok());
  EXPECT_NE(parsed.status().message().find("\"step\""), std::string::npos)
      << parsed.status().message().substr(0, 200);
}

TEST(CheckpointTest, ParseSafetensorsHeaderRefusesEveryTruncationAndAHugeLength) {
  TempDir dir;
  Model a;
  a.Fill(1, 3);
  auto st = WriteCheckpoint(dir.path(), a.reg, Meta(3), 3);
  ASSERT_TRUE(st.ok());
  auto file = ReadFile(st->path + "/state.safetensors");
  ASSERT_TRUE(file.ok());
  auto bytes = [](const std::string& s) { return std::as_bytes(std::span(s.data(), s.size())); };
  auto whole = ParseSafetensorsHeader(bytes(*file));
  ASSERT_TRUE(whole.ok()) << whole.status().ToString();
  ASSERT_EQ(whole->tensors.size(), 3u);
  EXPECT_EQ(whole->tensors[1].name, "adam.m");
  EXPECT_EQ(whole->tensors[1].begin, 2400u);
  EXPECT_EQ(whole->data_offset + 4808, file->size());
  for (size_t n = 0; n < file->size(); n += (n < 400 ? 1 : 53)) {
    // exactly n bytes: a read past them is a read past the allocation
    std::string prefix = file->substr(0, n);
    EXPECT_EQ(ParseSafetensorsHeader(bytes(prefix)).status().code(), StatusCode::kDataLoss)
        << n << " bytes";
  }
  std::string huge = *file;
  EncodeFixed64(huge.data(), UINT64_MAX - 3);
  auto parsed = ParseSafetensorsHeader(bytes(huge));
  ASSERT_FALSE(parsed.ok());
  EXPECT_NE(parsed.status().message().find("header length 18446744073709551612"), std::string::npos)
      << parsed.status().ToString();
}

}  // namespace
}  // namespace nonstop::state
