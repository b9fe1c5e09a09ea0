// `nonstop status`, `nonstop scale` and `nonstop worker`: talking to a running job.
//
// They find the job through its job file (written by the controller beside
// its journal), which names the job token's file (mode 0600, this user's:
// docs/security.md), or an explicit --http address (the token then from
// NONSTOP_JOB_TOKEN).
#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>

#include <fmt/format.h>
#include <httplib.h>
#include <nlohmann/json.hpp>

#include "apps/nonstop/commands.h"
#include "common/job_token.h"
#include "common/role_keys.h"
#include "launcher/local_launcher.h"
#include "net/address.h"
#include "nonstop/settings.h"
#include "nonstop/settings_cli.h"
#include "nonstop/status.h"

namespace nonstop::cli {

namespace {

Result<nlohmann::json> ReadJobFile(const std::string& path) {
  // As private as the token file it names (the controller writes it so): one planted by another
  // user could send this process's credentials, or a worker it starts, wherever it likes.
  Result<std::string> text = ReadPrivateFile(path, "job file", 1 << 20);
  if (text.status().code() == StatusCode::kNotFound) {
    return NotFoundError(
        fmt::format("no job file {}: is `nonstop run` running here? (HINT: --job PATH or --http "
                    "HOST:PORT)",
                    path));
  }
  if (!text.ok()) return text.status();
  auto j = nlohmann::json::parse(*text, nullptr, false);
  if (j.is_discarded() || !j.is_object()) {
    return DataLossError(
        fmt::format("job file {} is not a nonstop job file (not a JSON object)", path));
  }
  for (const char* key : {"http", "controller", "token_file"}) {
    if (!j.contains(key) || !j[key].is_string()) {
      return DataLossError(fmt::format(
          "job file {} is not a nonstop job file: \"{}\" is missing or not a string", path, key));
    }
  }
  if (j.contains("env")) {
    bool strings = j["env"].is_object();
    for (const auto& [k, v] : j["env"].items()) strings = strings && v.is_string();
    if (!strings) {
      return DataLossError(fmt::format(
          "job file {} is not a nonstop job file: \"env\" is not an object of strings", path));
    }
  }
  return j;
}

// Why a request got no answer, with what to do about a certificate that does not verify.
std::string Unreachable(httplib::Error error, bool https) {
  std::string why = httplib::to_string(error);
  if (error == httplib::Error::SSLServerVerification) {
    why +=
        " (HINT: --http-cacert FILE: the CA, or the endpoint's own self-signed certificate; it "
        "must name the host dialled)";
  } else if (https && error == httplib::Error::SSLConnection) {
    why += " (is the endpoint HTTPS? without --http-cert it is plain: --http http://HOST:PORT)";
  }
  return why;
}

// The job's token, from the file the job file names.
Result<std::string> JobToken(const nlohmann::json& job) {
  return ReadJobTokenFile(job["token_file"].get<std::string>());
}

}  // namespace

void JobCommands::Register(CLI::App& app) {
  status_ =
      app.add_subcommand("status", "Show a running job: phase, generation, world, spares, policy");
  scale_ = app.add_subcommand("scale", "Ask a running job to grow or shrink (POST /scale)");
  worker_ =
      app.add_subcommand("worker", "Start a worker by hand that joins a running job as a spare");
  for (CLI::App* sub : {status_, scale_, worker_}) AddSetting(sub, settings::kJobFile, job_file_);
  for (CLI::App* sub : {status_, scale_}) AddSetting(sub, settings::kHttp, http_);
  for (CLI::App* sub : {status_, scale_}) AddSetting(sub, settings::kHttpCacert, http_cacert_);
  auto* group = scale_->add_option_group("change", "exactly one of");
  world_size_opt_ = group->add_option("--world-size", world_size_, "The world size to have");
  release_opt_ = group->add_option("--release", release_, "Give back this many workers");
  group->add_option("--grow", grow_, "Take this many more workers");
  group->require_option(1);
  worker_->add_option("--worker-id", worker_id_,
                      "A worker id unique in the job (default: 100000 + pid)");
  worker_->footer("After `--`: the worker program and its arguments (default: nonstop-train).");
}

int JobCommands::Execute() {
  if (worker_->parsed()) return ExecWorker();
  std::string address = http_;
  // POST /scale (and /events) need the HTTP token, derived from the job token (from the file the
  // job file names, or the environment with --http): the job token itself is never sent.
  std::string token;
  // HTTPS: --http https://…, or a job file that names the endpoint's certificate.
  bool https = false;
  std::string cacert = http_cacert_;
  if (address.empty()) {
    auto job = ReadJobFile(job_file_);
    if (!job.ok()) {
      fmt::print(stderr, "nonstop: {}\n", job.status().message());
      return 1;
    }
    address = (*job)["http"];
    auto t = JobToken(*job);
    if (!t.ok()) {
      fmt::print(stderr, "nonstop: {}\n", t.status().message());
      return 1;
    }
    token = HttpCredential(*t);
    if (job->contains("http_cert") && (*job)["http_cert"].is_string()) {
      https = true;
      if (cacert.empty()) cacert = (*job)["http_cert"];
    }
  } else if (const char* env = std::getenv(settings::kJobToken.env.data())) {
    token = HttpCredential(env);
  }
  for (auto [prefix, tls] : {std::pair{"https://", true}, std::pair{"http://", false}}) {
    if (address.starts_with(prefix)) {
      address = address.substr(std::strlen(prefix));
      https = tls;
    }
  }
  while (address.ends_with('/')) address.pop_back();
  // host:port or [v6]:port
  auto hp = net::ParseHostPort(address);
  if (!hp.ok()) {
    fmt::print(stderr, "nonstop: --http {}\n", hp.status().message());
    return 2;
  }
  httplib::Client client(fmt::format("{}://{}", https ? "https" : "http",
                                     net::FormatHostPort(net::UnbracketHost(hp->host), hp->port)));
  // The certificate must also name the address dialled (the host of --http or of the job file).
  if (https && !cacert.empty()) client.set_ca_cert_path(cacert);
  client.set_connection_timeout(5);
  client.set_read_timeout(15);
  if (!token.empty()) client.set_bearer_token_auth(token);
  if (status_->parsed()) {
    auto res = client.Get("/status");
    if (!res) {
      fmt::print(stderr, "nonstop status: cannot reach the controller at {}: {}\n", address,
                 Unreachable(res.error(), https));
      return 1;
    }
    auto j = nlohmann::json::parse(res->body, nullptr, false);
    if (j.is_discarded()) {
      fmt::print("{}\n", res->body);
      return 1;
    }
    // off loopback /status needs the token too; an HTTPS endpoint refuses plain HTTP
    if (res->status != 200) {
      fmt::print(stderr, "nonstop status: refused ({}): {}\n", res->status,
                 j.is_object() ? j.value("error", res->body) : res->body);
      return 1;
    }
    fmt::print(
        "job at {}: {}, generation {}, world {} (target {}), {} spare(s), highest step {}, {} "
        "recoveries/resizes\n",
        address, j.value("phase", "?"), j.value("generation", 0), j.value("world_size", 0),
        j.value("target_world_size", 0), j.value("spares", 0), j.value("highest_step", -1),
        j.value("recoveries", 0));
    fmt::print("members (worker ids by rank): {}\npolicy: {}\n", j["members"].dump(),
               j["policy"].dump());
    if (j.contains("waiting_for") && j["waiting_for"].is_object())
      fmt::print("{}\n", j["waiting_for"].value("text", ""));
    return 0;
  }
  nlohmann::json body;
  if (world_size_opt_->count() > 0)
    body["world_size"] = world_size_;
  else if (release_opt_->count() > 0)
    body["release"] = release_;
  else
    body["grow"] = grow_;
  auto res = client.Post("/scale", body.dump(), "application/json");
  if (!res) {
    fmt::print(stderr, "nonstop scale: cannot reach the controller at {}: {}\n", address,
               Unreachable(res.error(), https));
    return 1;
  }
  auto j = nlohmann::json::parse(res->body, nullptr, false);
  if (res->status / 100 == 2) {
    fmt::print("accepted: world {} → {}\n", j.value("from", 0), j.value("world_size", 0));
    return 0;
  }
  fmt::print(stderr, "refused ({}): {}\n", res->status,
             j.is_discarded() ? res->body : j.value("error", res->body));
  return 1;
}

int JobCommands::ExecWorker() {
  auto job = ReadJobFile(job_file_);
  if (!job.ok()) {
    fmt::print(stderr, "nonstop worker: {}\n", job.status().message());
    return 1;
  }
  std::vector<std::string> program = program_;
  if (program.empty()) program = {SelfDirectory() + "/nonstop-train"};
  int id = worker_id_ >= 0 ? worker_id_ : 100000 + static_cast<int>(::getpid());
  auto set = [](std::string_view name, const std::string& value) {
    ::setenv(name.data(), value.c_str(), 1);
  };
  auto token = JobToken(*job);
  if (!token.ok()) {
    fmt::print(stderr, "nonstop worker: {}\n", token.status().message());
    return 1;
  }
  // The worker's credential (its keys, not the job token: docs/security.md, "Keys by role") in a
  // memfd the program inherits (its close-on-exec flag cleared), never in its environment.
  auto token_fd = JobTokenMemfd(EncodeWorkerCredential(WorkerKeysOf(crypto::JobKey(*token), id)));
  if (!token_fd.ok() || ::fcntl(token_fd->get(), F_SETFD, 0) != 0) {
    fmt::print(stderr, "nonstop worker: passing the worker's credential: {}\n",
               token_fd.ok() ? std::strerror(errno) : token_fd.status().ToString());
    return 1;
  }
  ::unsetenv(settings::kJobToken.env.data());
  set(settings::kJobTokenFd.env, std::to_string(token_fd->Release()));
  set(settings::kControllerAddress.env, (*job)["controller"].get<std::string>());
  set(settings::kWorkerId.env, std::to_string(id));
  set(settings::kSpare.env, "1");
  for (const auto& [k, v] : (*job)["env"].items())
    ::setenv(k.c_str(), v.get<std::string>().c_str(), 1);
  // torchrun's variables, as an agent's spare has them: a script that reads LOCAL_RANK or
  // WORLD_SIZE before it joins finds them (the job's, then the live ones once it has a rank).
  std::map<std::string, std::string> torchrun;
  const nlohmann::json of_job = job->value("torchrun", nlohmann::json::object());
  for (const auto& [k, v] : of_job.items())
    if (v.is_string()) torchrun[k] = v.get<std::string>();
  launcher::AddTorchrunHostVariables(&torchrun);
  for (const auto& [k, v] : torchrun) ::setenv(k.c_str(), v.c_str(), 1);
  fmt::print("nonstop worker: joining {} as worker {}\n", (*job)["controller"].get<std::string>(),
             id);
  std::fflush(stdout);
  std::vector<char*> argv;
  for (auto& a : program) argv.push_back(a.data());
  argv.push_back(nullptr);
  ::execvp(argv[0], argv.data());
  fmt::print(stderr, "nonstop worker: cannot start {}: {}\n", program[0], std::strerror(errno));
  return 1;
}

}  // namespace nonstop::cli
