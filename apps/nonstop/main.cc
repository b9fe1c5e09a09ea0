// nonstop: the command-line front end. One file per subcommand.
#include <CLI/CLI.hpp>

#include <string>
#include <string_view>
#include <vector>

#include "apps/nonstop/agent_command.h"
#include "apps/nonstop/commands.h"
#include "common/args.h"

int main(int argc, char** argv) {
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
  return 2;
}
