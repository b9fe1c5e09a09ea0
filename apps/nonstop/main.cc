// nonstop: the command-line front end. One file per subcommand.
#include <CLI/CLI.hpp>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "apps/nonstop/agent_command.h"
#include "apps/nonstop/commands.h"
#include "common/args.h"
#include "common/job_token.h"

namespace {

// Python workers import the nonstop package built beside this binary
// (build/python/nonstop): its folder goes first on the PYTHONPATH that every
// worker inherits, through `nonstop run` and `nonstop agent` alike.
void PutPythonPackageOnPath() {
  std::filesystem::path dir =
      std::filesystem::path(nonstop::cli::SelfDirectory()).parent_path() / "python";
  std::error_code ec;
  if (!std::filesystem::exists(dir / "nonstop" / "__init__.py", ec)) return;
  const char* old = std::getenv("PYTHONPATH");
  std::string value = dir.string();
  if (old != nullptr && *old != '\0') value += ":" + std::string(old);
  ::setenv("PYTHONPATH", value.c_str(), 1);
}

}  // namespace

int main(int argc, char** argv) {
  // Before any token is read: no worker (the same user) can read this process's memory or
  // descriptors through /proc.
  if (nonstop::Status s = nonstop::ShutOutSameUserProcesses(); !s.ok())
    std::fprintf(stderr, "nonstop: warning: %s\n", std::string(s.message()).c_str());
  PutPythonPackageOnPath();
  // Everything after the first `--` is the worker program and its arguments.
  auto [our_argc, program] = nonstop::SplitAtDoubleDash(argc, argv);
  CLI::App app{"nonstop: fault-tolerant, elastic data-parallel training"};
  app.require_subcommand(1);
  app.set_help_all_flag("--help-all", "Show help for every subcommand");
  nonstop::cli::RunCommand run;
  run.Register(app);
  run.SetProgram(program);
  nonstop::cli::DataCommand data;
  data.Register(app);
  nonstop::cli::ReportCommand report;
  report.Register(app);
  nonstop::cli::JobCommands job;
  job.Register(app);
  job.SetProgram(program);
  nonstop::cli::ControllerCommand controller;
  controller.Register(app);
  nonstop::cli::AgentCommand agent;
  agent.Register(app);
  agent.SetProgram(program);
  nonstop::cli::SettingsCommand settings;
  settings.Register(app);
  try {
    app.parse(our_argc, argv);
  } catch (const CLI::ParseError& e) {
    int code = app.exit(e);
    return code == 0 ? 0 : 2;  // usage errors exit 2
  }
  if (run.selected()) return run.Execute();
  if (data.selected()) return data.Execute();
  if (report.selected()) return report.Execute();
  if (job.selected()) return job.Execute();
  if (controller.selected()) return controller.Execute();
  if (agent.selected()) return agent.Execute();
  if (settings.selected()) return settings.Execute();
  return 2;
}
