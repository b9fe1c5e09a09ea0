#include "control/messages.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace nonstop::control {

using nlohmann::json;

namespace {

// Parses `payload` as a JSON object and runs `fill`, turning any parse or type
// error into INVALID_ARGUMENT naming the message and the field.
template <typename T, typename F>
Result<T> Decode(std::string_view what, std::string_view payload, F fill) {
  json j = json::parse(payload, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return InvalidArgumentError(fmt::format("{} message is not a JSON object", what));
  }
  T out;
  std::string field;
  try {
    fill(j, out, field);
  } catch (const json::exception& e) {
    return InvalidArgumentError(fmt::format("{} message: field '{}' is missing or ill-typed ({})", what, field, e.what()));
  }
  return out;
}

template <typename V>
void Get(const json& j, const char* name, V* out, std::string& field) {
  field = name;
  *out = j.at(name).get<V>();
}

}  // namespace

std::string Encode(const JoinMsg& m) {
  return json{{"worker_id", m.worker_id}, {"pid", m.pid},       {"data_address", m.data_address},
              {"spare", m.spare},         {"state_step", m.state_step}}.dump();
}
std::string Encode(const PlanMsg& m) {
  json members = json::array();
  for (const auto& p : m.members) members.push_back({{"worker_id", p.worker_id}, {"address", p.address}});
  json transfers = json::array();
  for (const auto& t : m.transfers) transfers.push_back({{"receiver", t.receiver}, {"sources", t.sources}});
  json faults = json::array();
  for (const auto& f : m.faults) faults.push_back({{"id", f.id}, {"spec", FormatFault(f)}});
  return json{{"generation", m.generation}, {"members", members}, {"resume_step", m.resume_step},
              {"transfers", transfers}, {"faults", faults}, {"reason", m.reason}}.dump();
}
std::string Encode(const HeartbeatMsg& m) { return json{{"step", m.step}, {"waiting_ms", m.waiting_ms}}.dump(); }
std::string Encode(const ProgressMsg& m) {
  return json{{"step", m.step},
              {"loss", m.loss},
              {"step_seconds", m.step_seconds},
              {"tokens_per_second", m.tokens_per_second},
              {"world_size", m.world_size}}
      .dump();
}
std::string Encode(const FinishedMsg& m) { return json{{"step", m.step}, {"checksum", m.checksum}}.dump(); }
std::string Encode(const FailureMsg& m) {
  return json{{"generation", m.generation}, {"step", m.step}, {"reason", m.reason}, {"exit_code", m.exit_code}}.dump();
}
std::string Encode(const ShutdownMsg& m) { return json{{"reason", m.reason}, {"exit_code", m.exit_code}}.dump(); }
std::string Encode(const AbortMsg& m) { return json{{"generation", m.generation}, {"reason", m.reason}}.dump(); }
std::string Encode(const DrainMsg& m) {
  return json{{"generation", m.generation}, {"after_step", m.after_step}, {"reason", m.reason}}.dump();
}
std::string Encode(const ReadyMsg& m) {
  return json{{"generation", m.generation}, {"step", m.step}, {"reason", m.reason}}.dump();
}
std::string Encode(const RecoveredMsg& m) {
  return json{{"generation", m.generation}, {"connect_seconds", m.connect_seconds},
              {"transfer_seconds", m.transfer_seconds}, {"bytes_received", m.bytes_received},
              {"sources", m.sources}, {"refetched_chunks", m.refetched_chunks}}.dump();
}
std::string Encode(const InjectedMsg& m) { return json{{"fault_id", m.fault_id}, {"description", m.description}}.dump(); }

Result<JoinMsg> DecodeJoin(std::string_view p) {
  return Decode<JoinMsg>("join", p, [](const json& j, JoinMsg& m, std::string& f) {
    Get(j, "worker_id", &m.worker_id, f);
    Get(j, "pid", &m.pid, f);
    Get(j, "data_address", &m.data_address, f);
    Get(j, "spare", &m.spare, f);
    Get(j, "state_step", &m.state_step, f);
  });
}
Result<PlanMsg> DecodePlan(std::string_view p) {
  return Decode<PlanMsg>("plan", p, [](const json& j, PlanMsg& m, std::string& f) {
    Get(j, "generation", &m.generation, f);
    Get(j, "resume_step", &m.resume_step, f);
    f = "members";
    for (const auto& e : j.at("members")) {
      PlanMember pm;
      Get(e, "worker_id", &pm.worker_id, f);
      Get(e, "address", &pm.address, f);
      m.members.push_back(pm);
    }
    f = "transfers";
    for (const auto& e : j.at("transfers")) {
      PlanTransfer t;
      Get(e, "receiver", &t.receiver, f);
      Get(e, "sources", &t.sources, f);
      m.transfers.push_back(t);
    }
    f = "faults";
    for (const auto& e : j.at("faults")) {
      int id = e.at("id").get<int>();
      auto parsed = ParseFaults(e.at("spec").get<std::string>(), id);
      if (!parsed.ok() || parsed->size() != 1) throw json::other_error::create(501, "bad fault spec", nullptr);
      m.faults.push_back((*parsed)[0]);
    }
    Get(j, "reason", &m.reason, f);
  });
}
Result<HeartbeatMsg> DecodeHeartbeat(std::string_view p) {
  return Decode<HeartbeatMsg>("heartbeat", p, [](const json& j, HeartbeatMsg& m, std::string& f) {
    Get(j, "step", &m.step, f);
    Get(j, "waiting_ms", &m.waiting_ms, f);
  });
}
Result<ProgressMsg> DecodeProgress(std::string_view p) {
  return Decode<ProgressMsg>("progress", p, [](const json& j, ProgressMsg& m, std::string& f) {
    Get(j, "step", &m.step, f);
    Get(j, "loss", &m.loss, f);
    Get(j, "step_seconds", &m.step_seconds, f);
    Get(j, "tokens_per_second", &m.tokens_per_second, f);
    Get(j, "world_size", &m.world_size, f);
  });
}
Result<FinishedMsg> DecodeFinished(std::string_view p) {
  return Decode<FinishedMsg>("finished", p, [](const json& j, FinishedMsg& m, std::string& f) {
    Get(j, "step", &m.step, f);
    Get(j, "checksum", &m.checksum, f);
  });
}
Result<FailureMsg> DecodeFailure(std::string_view p) {
  return Decode<FailureMsg>("failure", p, [](const json& j, FailureMsg& m, std::string& f) {
    Get(j, "generation", &m.generation, f);
    Get(j, "step", &m.step, f);
    Get(j, "reason", &m.reason, f);
    Get(j, "exit_code", &m.exit_code, f);
  });
}
Result<AbortMsg> DecodeAbort(std::string_view p) {
  return Decode<AbortMsg>("abort", p, [](const json& j, AbortMsg& m, std::string& f) {
    Get(j, "generation", &m.generation, f);
    Get(j, "reason", &m.reason, f);
  });
}
Result<DrainMsg> DecodeDrain(std::string_view p) {
  return Decode<DrainMsg>("drain", p, [](const json& j, DrainMsg& m, std::string& f) {
    Get(j, "generation", &m.generation, f);
    Get(j, "after_step", &m.after_step, f);
    Get(j, "reason", &m.reason, f);
  });
}
Result<ReadyMsg> DecodeReady(std::string_view p) {
  return Decode<ReadyMsg>("ready", p, [](const json& j, ReadyMsg& m, std::string& f) {
    Get(j, "generation", &m.generation, f);
    Get(j, "step", &m.step, f);
    Get(j, "reason", &m.reason, f);
  });
}
Result<RecoveredMsg> DecodeRecovered(std::string_view p) {
  return Decode<RecoveredMsg>("recovered", p, [](const json& j, RecoveredMsg& m, std::string& f) {
    Get(j, "generation", &m.generation, f);
    Get(j, "connect_seconds", &m.connect_seconds, f);
    Get(j, "transfer_seconds", &m.transfer_seconds, f);
    Get(j, "bytes_received", &m.bytes_received, f);
    Get(j, "sources", &m.sources, f);
    Get(j, "refetched_chunks", &m.refetched_chunks, f);
  });
}
Result<InjectedMsg> DecodeInjected(std::string_view p) {
  return Decode<InjectedMsg>("injected", p, [](const json& j, InjectedMsg& m, std::string& f) {
    Get(j, "fault_id", &m.fault_id, f);
    Get(j, "description", &m.description, f);
  });
}
Result<ShutdownMsg> DecodeShutdown(std::string_view p) {
  return Decode<ShutdownMsg>("shutdown", p, [](const json& j, ShutdownMsg& m, std::string& f) {
    Get(j, "reason", &m.reason, f);
    Get(j, "exit_code", &m.exit_code, f);
  });
}

}  // namespace nonstop::control
