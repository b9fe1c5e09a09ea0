#include "control/fault_spec.h"

#include <charconv>

#include <fmt/format.h>

namespace nonstop::control {

std::string_view FaultKindName(FaultKind k) {
  switch (k) {
    case FaultKind::kKill:
      return "kill";
    case FaultKind::kHang:
      return "hang";
    case FaultKind::kException:
      return "exception";
    case FaultKind::kDrop:
      return "drop";
    case FaultKind::kCorrupt:
      return "corrupt";
    case FaultKind::kStall:
      return "stall";
    case FaultKind::kSpin:
      return "spin";
    case FaultKind::kBitflip:
      return "bitflip";
    case FaultKind::kWireflip:
      return "wireflip";
  }
  return "?";
}

namespace {

std::vector<std::string_view> Split(std::string_view s, char sep) {
  std::vector<std::string_view> out;
  while (true) {
    size_t p = s.find(sep);
    out.push_back(s.substr(0, p));
    if (p == std::string_view::npos) break;
    s.remove_prefix(p + 1);
  }
  return out;
}

template <typename T>
bool ParseNumber(std::string_view text, T* out) {
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), *out);
  return ec == std::errc() && end == text.data() + text.size();
}

}  // namespace

Result<std::vector<FaultSpec>> ParseFaults(std::string_view text, int first_id) {
  std::vector<FaultSpec> out;
  const std::string hint = " (HINT: e.g. kill:rank=2,step=30 or hang:rank=1,time=5)";
  for (std::string_view item : Split(text, ';')) {
    if (item.empty()) continue;
    size_t colon = item.find(':');
    if (colon == std::string_view::npos) {
      return InvalidArgumentError(fmt::format("fault '{}' has no ':'{}", item, hint));
    }
    FaultSpec f;
    f.id = first_id + static_cast<int>(out.size());
    std::string_view kind = item.substr(0, colon);
    if (kind == "kill")
      f.kind = FaultKind::kKill;
    else if (kind == "hang")
      f.kind = FaultKind::kHang;
    else if (kind == "stall")
      f.kind = FaultKind::kStall;
    else if (kind == "spin")
      f.kind = FaultKind::kSpin;
    else if (kind == "exception")
      f.kind = FaultKind::kException;
    else if (kind == "drop")
      f.kind = FaultKind::kDrop;
    else if (kind == "corrupt")
      f.kind = FaultKind::kCorrupt;
    else if (kind == "bitflip")
      f.kind = FaultKind::kBitflip;
    else if (kind == "wireflip")
      f.kind = FaultKind::kWireflip;
    else
      return InvalidArgumentError(
          fmt::format("fault '{}': unknown kind '{}' (kill, hang, stall, spin, exception, drop, "
                      "corrupt, bitflip, wireflip)",
                      item, kind));
    bool has_rank = false;
    bool has_phase = false;
    for (std::string_view kv : Split(item.substr(colon + 1), ',')) {
      size_t eq = kv.find('=');
      if (eq == std::string_view::npos)
        return InvalidArgumentError(
            fmt::format("fault '{}': '{}' is not key=value{}", item, kv, hint));
      std::string_view k = kv.substr(0, eq), v = kv.substr(eq + 1);
      bool ok = true;
      if (k == "rank") {
        ok = ParseNumber(v, &f.rank) && f.rank >= 0;
        has_rank = true;
      } else if (k == "step") {
        ok = ParseNumber(v, &f.step) && f.step >= 0;
      } else if (k == "time") {
        ok = ParseNumber(v, &f.time_seconds) && f.time_seconds >= 0;
        f.point = FaultPoint::kTime;
      } else if (k == "at") {
        ok = ParseNumber(v, &f.at) && f.at >= 0 && f.at < 1;
        if (!ok) {
          return InvalidArgumentError(fmt::format(
              "fault '{}': at={} is not a fraction of the step in [0, 1) (0: as the step starts, "
              "0.5: half-way through it; leave it out for just before the step's reduction)",
              item, v));
        }
      } else if (k == "tensor") {
        ok = !v.empty();
        f.tensor = std::string(v);
      } else if (k == "phase") {
        ok = v == "gather" || v == "reduce";
        f.gather_phase = v == "gather";
        has_phase = true;
      } else if (k == "during") {
        ok = v == "transfer" || v == "step";
        if (v == "transfer") f.point = FaultPoint::kTransfer;
      } else {
        return InvalidArgumentError(fmt::format(
            "fault '{}': unknown key '{}' (rank, step, time, at, during, tensor, phase)", item, k));
      }
      if (!ok)
        return InvalidArgumentError(fmt::format("fault '{}': bad value '{}' for {}", item, v, k));
    }
    if (!has_rank)
      return InvalidArgumentError(fmt::format("fault '{}': rank= is required{}", item, hint));
    if (f.point == FaultPoint::kTime) {
      if (f.kind != FaultKind::kKill && f.kind != FaultKind::kHang) {
        return InvalidArgumentError(
            fmt::format("fault '{}': time= works for kill and hang only", item));
      }
      if (f.step >= 0)
        return InvalidArgumentError(fmt::format("fault '{}': give step= or time=, not both", item));
    } else if (f.step < 0 && f.point != FaultPoint::kTransfer) {
      return InvalidArgumentError(
          fmt::format("fault '{}': step= or time= is required{}", item, hint));
    }
    if (f.kind == FaultKind::kCorrupt) f.point = FaultPoint::kTransfer;
    if (!f.tensor.empty() && f.kind != FaultKind::kBitflip) {
      return InvalidArgumentError(
          fmt::format("fault '{}': tensor= names the region of a bitflip only", item));
    }
    if (f.kind == FaultKind::kBitflip && (f.point != FaultPoint::kStep || f.step < 0)) {
      return InvalidArgumentError(fmt::format(
          "fault '{}': a bitflip happens at a step (e.g. bitflip:rank=1,step=30,tensor=params)",
          item));
    }
    if (has_phase && f.kind != FaultKind::kWireflip) {
      return InvalidArgumentError(
          fmt::format("fault '{}': phase= names the ring phase of a wireflip only", item));
    }
    if (f.kind == FaultKind::kWireflip && (f.point != FaultPoint::kStep || f.step < 0)) {
      return InvalidArgumentError(
          fmt::format("fault '{}': a wireflip happens in a step's reduction (e.g. "
                      "wireflip:rank=1,step=30,phase=gather)",
                      item));
    }
    if (f.at >= 0 && (f.point != FaultPoint::kStep || f.step < 0 ||
                      (f.kind != FaultKind::kKill && f.kind != FaultKind::kHang))) {
      return InvalidArgumentError(
          fmt::format("fault '{}': at= works with step= for kill and hang only (e.g. "
                      "kill:rank=1,step=30,at=0.5)",
                      item));
    }
    out.push_back(f);
  }
  return out;
}

std::string FormatFault(const FaultSpec& f) {
  std::string s = fmt::format("{}:rank={}", FaultKindName(f.kind), f.rank);
  if (f.point == FaultPoint::kTime) return s + fmt::format(",time={}", f.time_seconds);
  if (f.step >= 0) s += fmt::format(",step={}", f.step);
  if (f.point == FaultPoint::kTransfer && f.kind != FaultKind::kCorrupt) s += ",during=transfer";
  if (f.at >= 0) s += fmt::format(",at={}", f.at);
  if (!f.tensor.empty()) s += ",tensor=" + f.tensor;
  if (f.kind == FaultKind::kWireflip && !f.gather_phase) s += ",phase=reduce";
  return s;
}

}  // namespace nonstop::control
