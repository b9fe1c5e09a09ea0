// WorkerSettingFlags (commands.h): the workers' settings as flags of `nonstop run` and
// `nonstop controller`.
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "apps/nonstop/commands.h"
#include "nonstop/settings_cli.h"

namespace nonstop::cli {

template <typename T>
void WorkerSettingFlags::Add(CLI::App* sub, const settings::Setting<T>& s) {
  using V = std::conditional_t<std::is_same_v<T, std::string_view>, std::string, T>;
  auto value = std::make_shared<V>();
  CLI::Option* opt = AddSetting(sub, s, *value);
  const std::string flag(s.flag.substr(0, s.flag.find(',')));
  given_.push_back([opt, value, env = std::string(s.env), flag]() -> std::optional<Value> {
    if (opt->count() == 0) return std::nullopt;
    if constexpr (std::is_same_v<V, bool>) {
      return Value{env, flag, *value ? "1" : "0"};
    } else if constexpr (std::is_same_v<V, std::string>) {
      return Value{env, flag, *value};
    } else {
      return Value{env, flag, fmt::format("{}", *value)};
    }
  });
}

void WorkerSettingFlags::Register(CLI::App* sub) {
  namespace s = settings;
  Add(sub, s::kConnectTimeoutMs);
  Add(sub, s::kWorkerControllerTimeoutMs);
  Add(sub, s::kLeaderlessTimeoutMs);
  Add(sub, s::kSpareCheckMs);
  Add(sub, s::kReplicaCheckEvery);
  Add(sub, s::kCheckedCollectives);
  Add(sub, s::kSealedStateCopy);
  Add(sub, s::kMasterPort);
  Add(sub, s::kPythonWorldInvariant);
  Add(sub, s::kTrainSteps);
  Add(sub, s::kShardGroup);
  Add(sub, s::kTorchThreads);
  Add(sub, s::kTrainNoOverlap);
  Add(sub, s::kTrainNoSalvage);
  Add(sub, s::kTrainNoLoans);
}

std::vector<WorkerSettingFlags::Value> WorkerSettingFlags::Values() const {
  std::vector<Value> out;
  for (const auto& given : given_) {
    if (auto v = given()) out.push_back(std::move(*v));
  }
  return out;
}

std::vector<std::pair<std::string, std::string>> WorkerSettingFlags::Given() const {
  std::vector<std::pair<std::string, std::string>> out;
  for (Value& v : Values()) out.emplace_back(std::move(v.env), std::move(v.text));
  return out;
}

std::vector<std::string> WorkerSettingFlags::Arguments() const {
  std::vector<std::string> out;
  for (const Value& v : Values()) out.push_back(v.flag + "=" + v.text);
  return out;
}

}  // namespace nonstop::cli
