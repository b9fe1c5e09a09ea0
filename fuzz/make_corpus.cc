// Writes the seed corpora of fuzz/corpus/ (fuzz/README.md); run from the
// repository root: build-asan/bin/fuzz_make_corpus fuzz/corpus. Valid inputs
// come from the real encoders, so they stay valid when a format changes and
// this is rerun; edge cases (truncated, corrupt, over the limits, wrong
// types) are derived from them. Inputs that once crashed a target are added
// to fuzz/corpus/ by hand, named regress_<what>, and are not written here.
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "common/check.h"
#include "common/coding.h"
#include "common/crypto.h"
#include "common/temp_dir.h"
#include "control/fault_spec.h"
#include "control/messages.h"
#include "data/token_shard.h"
#include "net/frame.h"
#include "net/handshake.h"
#include "state/checkpoint.h"

namespace {

namespace fs = std::filesystem;
using namespace nonstop;  // NOLINT: a tool

fs::path root;

void Put(const std::string& target, const std::string& name, const std::string& bytes) {
  fs::create_directories(root / target);
  std::ofstream out(root / target / name, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  NONSTOP_CHECK(out.good()) << "cannot write " << (root / target / name);
}

std::string ReadAll(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  NONSTOP_CHECK(in.good()) << "cannot read " << path;
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

std::string Byte(int b) { return std::string(1, static_cast<char>(b)); }

void Frames() {
  control::HeartbeatMsg hb{41, -1};
  Put("frame", "one_frame", Byte(0) + net::EncodeFrame(7, "hello"));
  Put("frame", "three_frames_in_pieces",
      Byte(6) + net::EncodeFrame(control::kMsgHeartbeat, control::Encode(hb)) +
          net::EncodeFrame(control::kMsgShutdown, "") +
          net::EncodeFrame(3, std::string(300, 'x'), /*flags=*/0xffff));
  Put("frame", "over_small_limit", Byte(1) + net::EncodeFrame(7, std::string(65, 'y')));
  std::string bad = net::EncodeFrame(7, "payload");
  bad.back() ^= 1;
  Put("frame", "bad_checksum_after_good_frame", Byte(0) + net::EncodeFrame(1, "ok") + bad);
  std::string cut = net::EncodeFrame(9, "truncated payload");
  Put("frame", "truncated", Byte(2) + cut.substr(0, cut.size() - 3));
  Put("frame", "http_request", Byte(0) + "GET / HTTP/1.1\r\nHost: x\r\n\r\n");
  std::string huge;
  PutFixed32(&huge, 0xffffffffu);
  PutFixed16(&huge, 1);
  PutFixed16(&huge, 0);
  PutFixed32(&huge, 0);
  Put("frame", "length_over_limit", Byte(0) + huge);
}

void Hellos() {
  net::Hello h;
  h.kind = net::ConnectionKind::kControl;
  h.generation = 3;
  h.worker_id = 2;
  h.nonce = std::string(crypto::kNonceBytes, '\x5a');
  const std::string good = net::EncodeHello(h);
  Put("hello", "control", good);
  std::string v2_0 = good.substr(0, good.size() - 2);  // 2.0 had no lane
  v2_0[4] = 2;                                         // major, little-endian
  Put("hello", "protocol_2_0", v2_0);
  Put("hello", "truncated_lane", good.substr(0, good.size() - 1));
  h.kind = net::ConnectionKind::kData;
  h.lane = net::kDataLanes - 1;
  Put("hello", "data_last_lane", net::EncodeHello(h));
  h.lane = 0;
  h.worker_id = -1;
  h.nonce = "";
  Put("hello", "data_no_nonce", net::EncodeHello(h));
  Put("hello", "truncated_nonce", good.substr(0, good.size() - 5));
  Put("hello", "truncated_header", good.substr(0, 9));
  std::string bad_magic = good;
  bad_magic[0] ^= 0x20;
  Put("hello", "bad_magic", bad_magic);
  Put("hello", "trailing_bytes", good + "extra");
  std::string old_version = good;
  old_version[4] = 1;  // protocol 1.0, which sent the token here
  Put("hello", "old_version", old_version);
}

void Control() {
  using namespace control;  // NOLINT
  auto put = [](MessageType type, const char* name, const std::string& payload) {
    Put("control", name, Byte(type - kMsgJoin) + payload);
  };
  put(kMsgJoin, "join", Encode(JoinMsg{3, 4242, "127.0.0.1:40001", true, 29}));
  PlanMsg plan;
  plan.generation = 2;
  plan.members = {{0, "127.0.0.1:1"}, {4, "127.0.0.1:2"}};
  plan.resume_step = 30;
  plan.transfers = {{4, {0, 1}}};
  plan.faults =
      *ParseFaults("kill:rank=1,step=40;hang:rank=0,time=2.5;kill:rank=1,during=transfer", 1);
  plan.reason = "recovery";
  put(kMsgPlan, "plan", Encode(plan));
  // Sharded state: the shard moves, one of them with no source left.
  PlanMsg sharded = plan;
  sharded.members = {
      {0, "127.0.0.1:1"}, {1, "127.0.0.1:2"}, {2, "127.0.0.1:3"}, {4, "127.0.0.1:4"}};
  sharded.shard_group = 2;
  sharded.shard_moves = {{4, 1, {1}}, {2, 0, {0}}, {1, 1, {}}};
  put(kMsgPlan, "plan_shard_moves", Encode(sharded));
  put(kMsgHeartbeat, "heartbeat", Encode(HeartbeatMsg{12, 350}));
  put(kMsgProgress, "progress", Encode(ProgressMsg{12, 2.75, 0.31, 5123.5, 4}));
  put(kMsgFinished, "finished", Encode(FinishedMsg{200, "deadbeef"}));
  put(kMsgFailure, "failure", Encode(FailureMsg{2, 17, "peer reset", 10}));
  put(kMsgShutdown, "shutdown", Encode(ShutdownMsg{"done", 0}));
  put(kMsgAbort, "abort", Encode(AbortMsg{5, "rank 2 died"}));
  put(kMsgDrain, "drain", Encode(DrainMsg{5, 40, "scale to 3"}));
  put(kMsgReady, "ready", Encode(ReadyMsg{5, 39, "controller abort"}));
  put(kMsgRecovered, "recovered", Encode(RecoveredMsg{6, 0.01, 0.2, 1 << 20, 3, 1, 2, 4}));
  put(kMsgInjected, "injected", Encode(InjectedMsg{1, "kill:rank=1,step=40"}));
  Put("control", "agent_dying", Byte(13) + Encode(AgentDyingMsg{3, 4242}));
  // Edge cases: wrong types, numbers out of range, nesting, not JSON.
  put(kMsgJoin, "join_missing_field",
      R"({"worker_id": 1, "pid": 2, "spare": false, "state_step": -1})");
  put(kMsgHeartbeat, "heartbeat_float_step", R"({"step": 1e300, "waiting_ms": -1})");
  put(kMsgHeartbeat, "heartbeat_string_step", R"({"step": "seven", "waiting_ms": -1})");
  put(kMsgAbort, "abort_negative_generation", R"({"generation": -1, "reason": "x"})");
  put(kMsgPlan, "plan_members_not_array",
      R"({"generation": 1, "resume_step": 0, "members": 7, "transfers": [],
                                             "faults": [], "reason": "start"})");
  put(kMsgPlan, "plan_bad_fault",
      R"({"generation": 1, "resume_step": 0, "members": [], "transfers": [],
                                     "faults": [{"id": 1, "spec": "kill:rank=-1"}], "reason": "start"})");
  put(kMsgPlan, "plan_shard_out_of_range",
      R"({"generation": 1, "resume_step": 0, "members": [{"worker_id": 0,
                                              "address": "a:1"}, {"worker_id": 1, "address": "a:2"}], "transfers": [],
                                              "faults": [], "reason": "x", "shard_group": 2, "shard_moves":
                                              [{"receiver": 1, "shard": 2, "sources": [0]}]})");
  put(kMsgPlan, "plan_shard_moves_over_members",
      R"({"generation": 1, "resume_step": 0, "members": [{"worker_id": 0,
                                                    "address": "a:1"}], "transfers": [], "faults": [], "reason": "x",
                                                    "shard_group": 1, "shard_moves": [{"receiver": 0, "shard": 0,
                                                    "sources": [1, 2]}, {"receiver": 0, "shard": 0, "sources": []}]})");
  put(kMsgShutdown, "not_an_object", "[1, 2, 3]");
  put(kMsgShutdown, "deep_nesting", std::string(200, '[') + std::string(200, ']'));
  put(kMsgFinished, "not_json", "\x01\x02 not json");
  Put("control", "faults",
      Byte(12) +
          "kill:rank=2,step=30;drop:rank=3,step=7;corrupt:rank=1,step=30;exception:rank=0,step=12");
  Put("control", "faults_bad", Byte(12) + "kill:rank=2;hang:rank=x,step=1;;nothing");
}

void Shards() {
  std::vector<uint16_t> tokens = {1, 2, 3, 250, 65535, 0, 7};
  const std::string shard = data::EncodeShard(tokens, 65536 - 1);
  Put("token_shard", "nonstop", shard);
  Put("token_shard", "nonstop_empty", data::EncodeShard({}, 256));
  Put("token_shard", "nonstop_truncated", shard.substr(0, shard.size() - 1));
  Put("token_shard", "nonstop_header_only", shard.substr(0, 40));
  std::string corrupt = shard;
  corrupt.back() ^= 1;
  Put("token_shard", "nonstop_corrupt_tokens", corrupt);
  std::string llmc(data::kLlmcHeaderBytes, '\0');
  auto put32 = [&](size_t at, uint32_t v) {
    std::string b;
    PutFixed32(&b, v);
    llmc.replace(at, 4, b);
  };
  put32(0, static_cast<uint32_t>(data::kLlmcMagic));
  put32(4, 1);
  put32(8, static_cast<uint32_t>(tokens.size()));
  for (uint16_t t : tokens) PutFixed16(&llmc, t);
  Put("token_shard", "llmc", llmc);
  std::string negative = llmc;
  negative[11] = '\x80';
  Put("token_shard", "llmc_negative_count", negative);
  Put("token_shard", "llmc_truncated_header", llmc.substr(0, 100));
  Put("token_shard", "foreign", "#!/bin/sh\necho not a shard\n");
}

void Checkpoints() {
  TempDir dir;
  float params[4] = {1.5f, -2, 0, 3};
  int64_t step = 30;
  state::StateRegistry registry;
  NONSTOP_CHECK(registry.RegisterFloats("params", params, {4}).ok());
  NONSTOP_CHECK(registry.RegisterValue("step", &step).ok());
  state::CheckpointMeta meta;
  meta.step = 30;
  meta.generation = 2;
  meta.world_size = 4;
  meta.recipe = "llama-tiny";
  meta.parameter_checksum = registry.Digest();
  auto written = state::WriteCheckpoint(dir.path(), registry, meta, /*keep=*/1);
  NONSTOP_CHECK(written.ok()) << written.status().ToString();
  const std::string manifest = ReadAll(fs::path(written->path) / "manifest.json");
  const std::string tensors = ReadAll(fs::path(written->path) / "state.safetensors");
  Put("checkpoint", "valid", manifest + Byte(0) + tensors);
  Put("checkpoint", "no_state_file", manifest);
  Put("checkpoint", "truncated_state", manifest + Byte(0) + tensors.substr(0, tensors.size() - 4));
  Put("checkpoint", "not_json", "step: 30" + Byte(0) + tensors);
  Put("checkpoint", "state_only", Byte(0) + tensors);
}

void Recipes(const fs::path& recipes) {
  for (const char* name : {"llama-tiny.yaml", "gpt-oss-tiny.yaml"})
    Put("recipe", name, ReadAll(recipes / name));
  Put("recipe", "empty_mapping", "{}\n");
  Put("recipe", "flow_style",
      "model: {arch: gpt-oss, n_experts: 4, top_k: 2}\ntrain: {steps: 5}\n");
  Put("recipe", "unknown_key", "model:\n  dim: 64\n  colour: blue\n");
  Put("recipe", "wrong_type", "train:\n  steps: many\n");
  Put("recipe", "out_of_range", "train:\n  steps: 99999999999999999999999\n");
  Put("recipe", "anchors", "model: &m\n  dim: 64\noptimizer: *m\n");
  Put("recipe", "not_yaml", "model: [unclosed\n");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s OUT_DIR (run from the repository root: it reads recipes/)\n",
                 argv[0]);
    return 2;
  }
  root = argv[1];
  Frames();
  Hellos();
  Control();
  Shards();
  Checkpoints();
  Recipes("recipes");
  std::printf("seed corpora written under %s\n", root.c_str());
  return 0;
}
