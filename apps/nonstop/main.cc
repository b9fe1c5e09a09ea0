// nonstop: the command-line front end. One file per subcommand.
#include <CLI/CLI.hpp>

#include <string>
#include <string_view>
#include <vector>

#include "apps/nonstop/commands.h"

int main(int argc, char** argv) {
  // Everything after the first `--` is the worker program and its arguments;
  // it is split off here so that no option parser ever looks at it.
  std::vector<std::string> program;
  int our_argc = argc;
  for (int i = 1; i < argc; ++i) {
    if (std::string_view(argv[i]) == "--") {
      program.assign(argv + i + 1, argv + argc);
      our_argc = i;
      break;
    }
  }
  CLI::App app{"nonstop: fault-tolerant, elastic data-parallel training"};
  app.require_subcommand(1);
  app.set_help_all_flag("--help-all", "Show help for every subcommand");
  nonstop::cli::RunCommand run;
  run.Register(app);
  run.SetProgram(program);
  nonstop::cli::DataCommand data;
  data.Register(app);
  nonstop::cli::JobCommands job;
  job.Register(app);
  job.SetProgram(program);
  try {
    app.parse(our_argc, argv);
  } catch (const CLI::ParseError& e) {
    int code = app.exit(e);
    return code == 0 ? 0 : 2;  // usage errors exit 2
  }
  if (run.selected()) return run.Execute();
  if (data.selected()) return data.Execute();
  if (job.selected()) return job.Execute();
  return 2;
}
