// The strict JSON field reading of the control messages (messages.cc, store_messages.cc): every
// field is read through a Reader, which throws FieldError at the first field that is missing or
// ill-typed; Decode turns it into an INVALID_ARGUMENT naming the message and the field. The
// exception never leaves the decoders. Reading is strict: an integer field takes a JSON integer
// within its type's range (no float, no bool: converting 1e300 to an integer is undefined
// behaviour), a number field any JSON number or "nan", "inf", "-inf" (how Encode writes what JSON
// cannot), a string field a string. Internal to src/control.
#pragma once

#include <cmath>
#include <limits>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "nonstop/status.h"

namespace nonstop::control::fields {

using nlohmann::json;

struct FieldError {
  std::string field;    // "members[2].worker_id"
  std::string problem;  // "must be an integer from 0 to 4294967295, got -1"
};

// A short rendering of an untrusted value for messages; structured values
// are not dumped (dump() recurses, and `v` may be nested a million deep).
inline std::string Shown(const json& v) {
  if (v.is_object()) return "an object";
  if (v.is_array()) return "an array";
  std::string text = v.dump(-1, ' ', /*ensure_ascii=*/true, json::error_handler_t::replace);
  return text.size() > 40 ? text.substr(0, 37) + "..." : text;
}

template <typename V>
V Convert(const json& v, const std::string& path) {
  if constexpr (std::is_same_v<V, bool>) {
    if (v.is_boolean()) return v.get<bool>();
    throw FieldError{path, fmt::format("must be true or false, got {}", Shown(v))};
  } else if constexpr (std::is_integral_v<V>) {
    if (v.is_number_unsigned() && std::in_range<V>(v.get<uint64_t>()))
      return static_cast<V>(v.get<uint64_t>());
    if (v.is_number_integer() && !v.is_number_unsigned() && std::in_range<V>(v.get<int64_t>())) {
      return static_cast<V>(v.get<int64_t>());
    }
    throw FieldError{
        path, fmt::format("must be an integer from {} to {}, got {}", std::numeric_limits<V>::min(),
                          std::numeric_limits<V>::max(), Shown(v))};
  } else if constexpr (std::is_floating_point_v<V>) {
    if (v.is_number()) return v.get<V>();
    if (v.is_string()) {
      const auto& s = v.get_ref<const std::string&>();
      if (s == "nan") return std::numeric_limits<V>::quiet_NaN();
      if (s == "inf") return std::numeric_limits<V>::infinity();
      if (s == "-inf") return -std::numeric_limits<V>::infinity();
    }
    throw FieldError{
        path, fmt::format("must be a number (or \"nan\", \"inf\", \"-inf\"), got {}", Shown(v))};
  } else if constexpr (std::is_same_v<V, std::string>) {
    if (v.is_string()) return v.get<std::string>();
    throw FieldError{path, fmt::format("must be a string, got {}", Shown(v))};
  } else {
    static_assert(
        std::is_same_v<V, std::vector<int>> || std::is_same_v<V, std::vector<std::string>>,
        "add a conversion for this field type");
    if (!v.is_array()) throw FieldError{path, fmt::format("must be an array, got {}", Shown(v))};
    V out;
    for (size_t i = 0; i < v.size(); ++i)
      out.push_back(Convert<typename V::value_type>(v[i], fmt::format("{}[{}]", path, i)));
    return out;
  }
}

// The fields of one JSON object, named by their path from the message.
class Reader {
 public:
  Reader(const json& j, std::string path) : j_(j), path_(std::move(path)) {
    if (!j_.is_object())
      throw FieldError{path_, fmt::format("must be an object, got {}", Shown(j_))};
  }

  template <typename V>
  void operator()(const char* name, V* out) const {
    *out = Convert<V>(At(name), Path(name));
  }

  // The array field `name`.
  const json& Array(const char* name) const {
    const json& a = At(name);
    if (!a.is_array())
      throw FieldError{Path(name), fmt::format("must be an array, got {}", Shown(a))};
    return a;
  }

  // The elements of the array field `name`, each an object.
  std::vector<Reader> Objects(const char* name) const {
    const json& a = At(name);
    if (!a.is_array())
      throw FieldError{Path(name), fmt::format("must be an array, got {}", Shown(a))};
    std::vector<Reader> out;
    for (size_t i = 0; i < a.size(); ++i)
      out.emplace_back(a[i], fmt::format("{}[{}]", Path(name), i));
    return out;
  }

  // An optional field: left as it is when absent, checked like any other when present.
  template <typename V>
  void Optional(const char* name, V* out) const {
    if (j_.contains(name)) (*this)(name, out);
  }
  bool Has(const char* name) const { return j_.contains(name); }
  std::string Path(const char* name) const { return path_.empty() ? name : path_ + "." + name; }

 private:
  const json& At(const char* name) const {
    auto it = j_.find(name);
    if (it == j_.end()) throw FieldError{Path(name), "is missing"};
    return *it;
  }

  const json& j_;  // the message's parsed JSON outlives every Reader of it (Decode)
  std::string path_;
};

// Parses `payload` as a JSON object and runs `fill` on it.
template <typename T, typename F>
Result<T> Decode(std::string_view what, std::string_view payload, F fill) {
  json j = json::parse(payload, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return InvalidArgumentError(fmt::format("{} message is not a JSON object", what));
  }
  T out;
  try {
    fill(Reader(j, ""), out);
  } catch (const FieldError& e) {
    return InvalidArgumentError(fmt::format("{} message: field '{}' {}", what, e.field, e.problem));
  }
  return out;
}

// JSON has no NaN or infinity (dump() writes null): a worker may well report
// a NaN loss, so they travel as strings, read back by Convert<double>.
inline json Number(double d) {
  if (std::isfinite(d)) return d;
  if (std::isnan(d)) return "nan";
  return d > 0 ? "inf" : "-inf";
}

// Invalid UTF-8 in a string (an exception's message, say) is replaced, never
// thrown about: encoding cannot fail.
inline std::string Dump(const json& j) {
  return j.dump(-1, ' ', /*ensure_ascii=*/false, json::error_handler_t::replace);
}

}  // namespace nonstop::control::fields
