#include <cstdio>

#include <fmt/format.h>

#include "apps/nonstop/commands.h"
#include "data/token_shard.h"
#include "nonstop/data.h"
#include "nonstop/settings_cli.h"

namespace nonstop::cli {

void DataCommand::Register(CLI::App& app) {
  sub_ = app.add_subcommand("data", "Prepare and inspect token shards");
  sub_->require_subcommand(1);
  prepare_ =
      sub_->add_subcommand("prepare", "Turn text files into token shards (byte-level tokenizer)");
  prepare_->add_option("inputs", inputs_, "Text files or directories")->required();
  AddSetting(prepare_, settings::kDataOutput, output_);
  AddSetting(prepare_, settings::kTokensPerShard, tokens_per_shard_);
  prepare_->add_flag("--strip-fortune-separators", strip_fortune_,
                     "Drop the '%' lines between fortune entries");
  inspect_ = sub_->add_subcommand(
      "inspect", "Validate a shard or a directory of shards and print their sizes");
  inspect_->add_option("path", inspect_path_, "A shard file or a directory of *.bin shards")
      ->required();
}

int DataCommand::Execute() {
  if (prepare_->parsed()) {
    data::PrepareOptions o{inputs_, output_, tokens_per_shard_, strip_fortune_};
    auto report = data::PrepareShards(o, [](const std::string& line) { fmt::print("{}\n", line); });
    if (!report.ok()) {
      fmt::print(stderr, "nonstop data prepare: {}\n", report.status().ToString());
      return report.status().code() == StatusCode::kInvalidArgument ? 2 : 1;
    }
    for (const auto& s : report->skipped) fmt::print("skipped {}\n", s);
    fmt::print("prepared {} tokens from {} files into {} shards in {}\n", report->tokens,
               report->files_read, report->shards, output_);
    return 0;
  }
  auto paths = data::ListShards(inspect_path_);
  if (!paths.ok()) {
    fmt::print(stderr, "nonstop data inspect: {}\n", paths.status().ToString());
    return 1;
  }
  int bad = 0;
  for (const auto& p : *paths) {
    auto shard = data::TokenShard::Open(p);
    if (!shard.ok()) {
      fmt::print("{}: INVALID: {}\n", p, shard.status().message());
      ++bad;
      continue;
    }
    fmt::print("{}: ok, {} format, {} tokens\n", p,
               (*shard)->format() == data::ShardFormat::kNonstop ? "nonstop" : "llm.c",
               (*shard)->tokens().size());
  }
  return bad == 0 ? 0 : 11;
}

}  // namespace nonstop::cli
