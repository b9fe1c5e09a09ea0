// A LibTorch-free worker for integration tests: joins through nonstop::Session,
// runs --steps steps of an allreduce over a deterministic vector, checks the
// sum against the closed form, reports each step and finishes with a checksum.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "common/crc32c.h"
#include "nonstop/session.h"

int main(int argc, char** argv) {
  CLI::App app{"nonstop integration-test worker"};
  int64_t steps = 10;
  size_t elements = 1000;
  int sleep_ms = 0;
  app.add_option("--steps", steps);
  app.add_option("--elements", elements);
  app.add_option("--sleep-ms", sleep_ms);
  CLI11_PARSE(app, argc, argv);

  auto options = nonstop::SessionOptions::FromEnvironment();
  if (!options.ok()) {
    fmt::print(stderr, "{}\n", options.status().ToString());
    return 2;
  }
  auto session = nonstop::Session::Join(*options);
  if (!session.ok()) {
    if (session.status().code() == nonstop::StatusCode::kCancelled) return 0;  // a spare that was never needed
    fmt::print(stderr, "join failed: {}\n", session.status().ToString());
    return 10;
  }
  auto& s = **session;
  fmt::print("worker {} is rank {} of {}\n", s.worker_id(), s.rank(), s.world_size());
  std::fflush(stdout);
  std::vector<float> v(elements);
  uint32_t crc = 0;
  for (int64_t step = s.resume_step(); step < steps; ++step) {
    for (size_t i = 0; i < elements; ++i) v[i] = static_cast<float>((static_cast<int64_t>(i) + step) % 7 + s.rank());
    nonstop::Status st = s.AllReduce(v);
    if (!st.ok()) {
      fmt::print(stderr, "step {}: {}\n", step, st.ToString());
      return 10;
    }
    const int w = s.world_size();
    for (size_t i = 0; i < elements; ++i) {
      float want = static_cast<float>(w * ((static_cast<int64_t>(i) + step) % 7) + w * (w - 1) / 2);
      if (v[i] != want) {
        fmt::print(stderr, "step {}: element {} is {}, expected {}\n", step, i, v[i], want);
        return 11;
      }
    }
    crc = nonstop::Crc32cExtend(crc, v.data(), v.size() * sizeof(float));
    s.ReportStep({step, static_cast<double>(v[0]), 0, 0});
    if (s.rank() == 0) {
      fmt::print("step {} ok\n", step);
      std::fflush(stdout);
    }
    if (sleep_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(sleep_ms));
  }
  nonstop::Status fin = s.Finish(steps - 1, fmt::format("{:08x}", crc));
  if (!fin.ok()) {
    fmt::print(stderr, "finish: {}\n", fin.ToString());
    return 10;
  }
  return 0;
}
