// Registering a command-line flag from its entry in the settings registry
// (include/nonstop/settings.h): its names, help, NONSTOP_* environment fallback,
// default (shown in --help), range or choices, and whether it is required
// all come from the entry. Header-only, on CLI11: `nonstop`, nonstop-train and
// a user's own program register their flags with it.
//
//   cli::AddSetting(sub, settings::kNproc, nproc_);
//
// is what used to be written as
//
//   sub->add_option("--nproc", nproc_, "Worker processes that train (the world
//   size)")->capture_default_str()
//       ->envname(<the variable, as a literal>)->check(CLI::Range(1, 1024));
//
// Precedence is CLI11's: the flag, then the variable, then the default.
#pragma once

#include <CLI/CLI.hpp>

#include <string>
#include <type_traits>
#include <vector>

#include "nonstop/settings.h"

namespace nonstop::cli {

namespace settings_cli_internal {

template <typename T>
inline constexpr bool kIsList =
    std::is_same_v<T, settings::IntList> || std::is_same_v<T, settings::StringList>;

template <typename T, typename V>
void SetToDefault(const T& value, V& variable) {
  if constexpr (kIsList<T>) {
    variable.clear();
    for (const auto& item : value) variable.emplace_back(item);
  } else if constexpr (std::is_same_v<T, std::string_view>) {
    variable = std::string(value);
  } else {
    variable = static_cast<V>(value);
  }
}

}  // namespace settings_cli_internal

// Adds the flag of `s` to `app`, bound to `variable`, which is set to the
// entry's default first. `s` must have a flag. Returns the option, for what
// only one command adds (a group, ->excludes()).
template <typename T, typename V>
CLI::Option* AddSetting(CLI::App* app, const settings::Setting<T>& s, V& variable) {
  namespace internal = settings_cli_internal;
  internal::SetToDefault(s.default_value, variable);
  CLI::Option* opt = nullptr;
  if constexpr (std::is_same_v<T, bool>) {
    opt = app->add_flag(std::string(s.flag), variable, std::string(s.help));
  } else {
    opt = app->add_option(std::string(s.flag), variable, std::string(s.help));
    if (s.show_default) opt->capture_default_str();
  }
  if (s.required) opt->required();
  opt->envname(std::string(s.env));
  if constexpr (internal::kIsList<T>) {
    if (s.delimiter != 0) {
      opt->delimiter(s.delimiter);
    } else {
      opt->expected(1)->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
    }
  } else if constexpr (std::is_arithmetic_v<T> && !std::is_same_v<T, bool>) {
    if (s.range) opt->check(CLI::Range(s.range->lo, s.range->hi));
  }
  if (!s.choices.empty())
    opt->check(CLI::IsMember(std::vector<std::string>(s.choices.begin(), s.choices.end())));
  return opt;
}

}  // namespace nonstop::cli
