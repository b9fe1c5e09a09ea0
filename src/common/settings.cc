#include "nonstop/settings.h"

#include <algorithm>
#include <map>
#include <type_traits>

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace nonstop::settings {

namespace {

template <typename T>
std::string TypeName() {
  if constexpr (std::is_same_v<T, bool>)
    return "bool";
  else if constexpr (std::is_same_v<T, double>)
    return "float";
  else if constexpr (std::is_integral_v<T>)
    return "int";
  else if constexpr (std::is_same_v<T, std::string_view>)
    return "string";
  else if constexpr (std::is_same_v<T, IntList>)
    return "list of int";
  else
    return "list of string";
}

template <typename T>
std::string ValueText(const T& v) {
  if constexpr (std::is_same_v<T, bool>)
    return v ? "true" : "false";
  else if constexpr (std::is_arithmetic_v<T>)
    return fmt::format("{}", v);
  else if constexpr (std::is_same_v<T, std::string_view>)
    return std::string(v);
  else
    return fmt::format("{}", fmt::join(v, ","));
}

template <typename T>
Info Describe(const Setting<T>& s) {
  Info i;
  i.env = s.env;
  i.flag = s.flag;
  i.type = TypeName<T>();
  i.default_is_value = s.default_doc.empty();
  i.default_text = i.default_is_value ? ValueText(s.default_value) : std::string(s.default_doc);
  if constexpr (std::is_arithmetic_v<T> && !std::is_same_v<T, bool>) {
    if (s.range) i.values = fmt::format("{} to {}", s.range->lo, s.range->hi);
  }
  if (!s.choices.empty()) i.values = fmt::format("{}", fmt::join(s.choices, ", "));
  i.required = s.required;
  i.read_by = s.read_by;
  i.set_by = s.set_by;
  i.help = s.help;
  i.note = s.note;
  return i;
}

std::vector<Info> Build() {
  return {
      // the job
      Describe(kJournal),
      Describe(kHeartbeatTimeoutMs),
      Describe(kAbortTimeoutMs),
      Describe(kBusyTimeoutMs),
      Describe(kHangFactor),
      Describe(kStallFloorMs),
      Describe(kStallFactor),
      Describe(kFailureRepeats),
      Describe(kFailureWindowMs),
      Describe(kRecoveryBudget),
      Describe(kRecoveryBudgetWindowS),
      Describe(kRefillNice),
      Describe(kJoinTimeoutMs),
      Describe(kInject),
      Describe(kRecovery),
      Describe(kCheckpointDir),
      Describe(kCheckpointEvery),
      Describe(kMtbfSeconds),
      Describe(kHttpHost),
      Describe(kHttpPort),
      Describe(kHttpCert),
      Describe(kHttpKey),
      Describe(kMinWorld),
      Describe(kMaxWorld),
      Describe(kAllowedSizes),
      Describe(kWorldIncrement),
      Describe(kStablePeriodMs),
      Describe(kLogLevel),
      // nonstop run
      Describe(kNproc),
      Describe(kSpares),
      Describe(kHost),
      Describe(kPort),
      Describe(kResumable),
      Describe(kVerbose),
      // nonstop controller
      Describe(kListen),
      Describe(kControllerAdvertiseAddress),
      Describe(kNnodes),
      Describe(kControllerJobTokenFile),
      Describe(kControllerEtcd),
      Describe(kEtcdJob),
      Describe(kLeaseTtlS),
      // etcd's TLS and user
      Describe(kEtcdCacert),
      Describe(kEtcdCert),
      Describe(kEtcdKey),
      Describe(kEtcdAuthFile),
      Describe(kEtcdAllowPlaintext),
      // nonstop agent
      Describe(kAgentController),
      Describe(kEtcd),
      Describe(kAgentJobTokenFile),
      Describe(kAgentHostId),
      Describe(kNprocPerHost),
      Describe(kSparesPerHost),
      Describe(kAgentAdvertiseAddress),
      Describe(kAgentJoinTimeoutMs),
      Describe(kAgentControllerTimeoutMs),
      Describe(kFenceAfterMs),
      Describe(kWorkerUser),
      Describe(kOnSigterm),
      // nonstop status, scale, worker; nonstop data prepare
      Describe(kJobFile),
      Describe(kHttp),
      Describe(kHttpCacert),
      Describe(kDataOutput),
      Describe(kTokensPerShard),
      // a worker
      Describe(kControllerAddress),
      Describe(kJobToken),
      Describe(kJobTokenFd),
      Describe(kLifelineFd),
      Describe(kWorkerId),
      Describe(kSpare),
      Describe(kDataHost),
      Describe(kDataPorts),
      Describe(kWorkerAdvertiseAddress),
      Describe(kHostId),
      Describe(kLeaderFile),
      Describe(kConnectTimeoutMs),
      Describe(kWorkerControllerTimeoutMs),
      Describe(kLeaderlessTimeoutMs),
      Describe(kSpareCheckMs),
      Describe(kReplicaCheckEvery),
      Describe(kCheckedCollectives),
      Describe(kSealedStateCopy),
      Describe(kMasterPort),
      Describe(kPythonWorldInvariant),
      // nonstop-train
      Describe(kTrainCheckpointDir),
      Describe(kTrainCheckpointEvery),
      Describe(kTrainMtbfSeconds),
      Describe(kResume),
      Describe(kTrainSteps),
      Describe(kShardGroup),
      Describe(kTorchThreads),
      Describe(kTrainNoOverlap),
      Describe(kTrainNoSalvage),
      Describe(kTrainNoLoans),
  };
}

// A table cell: no line breaks, no column separators.
std::string Cell(std::string_view text) {
  std::string out;
  for (char c : text) {
    if (c == '|')
      out += "\\|";
    else if (c == '\n')
      out += ' ';
    else
      out += c;
  }
  return out;
}

// "--resumable,!--single-process" → "`--resumable` / `--single-process`".
std::string FlagCell(std::string_view flag) {
  if (flag.empty()) return "—";
  std::string out;
  size_t start = 0;
  while (start <= flag.size()) {
    size_t end = std::min(flag.find(',', start), flag.size());
    std::string_view name = flag.substr(start, end - start);
    if (!name.empty() && name[0] == '!') name.remove_prefix(1);
    out += fmt::format("{}`{}`", out.empty() ? "" : " / ", name);
    start = end + 1;
  }
  return out;
}

// `300000`, or the words of default_doc; "no default" for an empty value.
std::string DefaultCell(const Info& i) {
  if (!i.default_is_value) return i.default_text;
  return i.default_text.empty() ? "no default" : fmt::format("`{}`", i.default_text);
}

std::string Row(const Info& i) {
  std::string type = i.values.empty() ? i.type : fmt::format("{} ({})", i.type, i.values);
  std::string meaning(i.help);
  if (i.required) meaning += ". Required";
  if (!i.note.empty()) meaning += fmt::format(". Note: {}", i.note);
  return fmt::format("| `{}` | {} | {} | {} | {} | {} | {} |\n", i.env, FlagCell(i.flag),
                     Cell(type), Cell(DefaultCell(i)), ProgramNames(i.read_by),
                     i.set_by == 0 ? "—" : ProgramNames(i.set_by), Cell(meaning));
}

}  // namespace

const std::vector<Info>& All() {
  static const std::vector<Info> all = Build();
  return all;
}

bool IsRegistered(std::string_view env) {
  const auto& all = All();
  return std::any_of(all.begin(), all.end(), [&](const Info& i) { return i.env == env; });
}

std::string ProgramNames(uint32_t programs) {
  static constexpr std::string_view kNames[kProgramCount] = {
      "run",           "controller",          "agent",        "worker",
      "nonstop-train", "status/scale/worker", "data prepare", "Python"};
  std::string out;
  for (int b = 0; b < kProgramCount; ++b) {
    if ((programs & (1u << b)) != 0) out += fmt::format("{}{}", out.empty() ? "" : ", ", kNames[b]);
  }
  return out;
}

std::string Markdown() {
  std::vector<const Info*> rows;
  for (const Info& i : All()) rows.push_back(&i);
  std::stable_sort(rows.begin(), rows.end(),
                   [](const Info* a, const Info* b) { return a->env < b->env; });
  std::string out =
      "| Variable | Flag | Type | Default | Read by | Set by | Meaning |\n"
      "|---|---|---|---|---|---|---|\n";
  for (const Info* i : rows) out += Row(*i);
  std::map<std::string_view, std::vector<const Info*>> by_env;
  for (const Info* i : rows) by_env[i->env].push_back(i);
  out += "\nVariables with more than one entry (one per program and meaning):\n\n";
  for (const auto& [env, entries] : by_env) {
    if (entries.size() < 2) continue;
    std::string uses;
    for (const Info* i : entries) {
      uses += fmt::format("{}{}: {}", uses.empty() ? "" : "; ", ProgramNames(i->read_by),
                          DefaultCell(*i));
    }
    out += fmt::format("- `{}`: {}\n", env, uses);
  }
  return out;
}

}  // namespace nonstop::settings
