// The subcommands of the `nonstop` CLI. Each registers its flags (every flag
// has a NONSTOP_* environment fallback) and runs when selected.
#pragma once

#include <CLI/CLI.hpp>

#include <string>
#include <vector>

namespace nonstop::cli {

// `nonstop run`: controller + local launcher for one job on this machine.
class RunCommand {
 public:
  void Register(CLI::App& app);
  // The worker program and its arguments (what followed `--`).
  void SetProgram(std::vector<std::string> program) { program_ = std::move(program); }
  bool selected() const { return sub_ != nullptr && sub_->parsed(); }
  int Execute();

 private:
  CLI::App* sub_ = nullptr;
  int nproc_ = 4;
  int spares_ = 1;
  std::string host_ = "127.0.0.1";
  int port_ = 0;
  std::string journal_ = "runs/journal.jsonl";
  int heartbeat_timeout_ms_ = 1000;
  int abort_timeout_ms_ = 2000;
  std::vector<std::string> inject_;
  std::string recovery_ = "checkpointless";
  std::string checkpoint_dir_;
  int checkpoint_every_ = 0;
  double mtbf_seconds_ = 0;
  std::string log_level_ = "info";
  std::vector<std::string> program_;
};

// `nonstop data prepare`: text files → token shards.
class DataCommand {
 public:
  void Register(CLI::App& app);
  bool selected() const { return sub_ != nullptr && sub_->parsed(); }
  int Execute();

 private:
  CLI::App* sub_ = nullptr;
  CLI::App* prepare_ = nullptr;
  CLI::App* inspect_ = nullptr;
  std::vector<std::string> inputs_;
  std::string output_;
  uint64_t tokens_per_shard_ = 1 << 20;
  bool strip_fortune_ = false;
  std::string inspect_path_;
};

// Directory of the running executable (to find sibling binaries such as nonstop-train).
std::string SelfDirectory();

}  // namespace nonstop::cli
