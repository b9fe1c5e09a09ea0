// nonstop: the command-line front end. One file per subcommand.
#include <CLI/CLI.hpp>

#include "apps/nonstop/commands.h"

int main(int argc, char** argv) {
  CLI::App app{"nonstop: fault-tolerant, elastic data-parallel training"};
  app.require_subcommand(1);
  app.set_help_all_flag("--help-all", "Show help for every subcommand");
  nonstop::cli::RunCommand run;
  run.Register(app);
  nonstop::cli::DataCommand data;
  data.Register(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    int code = app.exit(e);
    return code == 0 ? 0 : 2;  // usage errors exit 2
  }
  if (run.selected()) return run.Execute();
  if (data.selected()) return data.Execute();
  return 2;
}
