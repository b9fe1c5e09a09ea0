// Runs a fuzz target's LLVMFuzzerTestOneInput over files, or every file in
// directories, without libFuzzer: how builds without clang's libFuzzer (the
// default build, the ASan and TSan builds) replay the corpora of fuzz/corpus/
// as regression tests (ctest -R fuzz_). Each input gets a heap buffer of its
// exact size, so a sanitizer sees any read past its end.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(
        stderr,
        "usage: %s FILE_OR_DIR...\n  replays inputs through the fuzz target, without fuzzing\n",
        argv[0]);
    return 2;
  }
  std::vector<std::filesystem::path> inputs;
  for (int i = 1; i < argc; ++i) {
    std::error_code ec;
    std::filesystem::path p(argv[i]);
    if (std::filesystem::is_directory(p, ec)) {
      for (const auto& e : std::filesystem::directory_iterator(p, ec)) {
        if (e.is_regular_file()) inputs.push_back(e.path());
      }
    } else if (std::filesystem::is_regular_file(p, ec)) {
      inputs.push_back(p);
    } else {
      std::fprintf(stderr, "%s: no such file or directory\n", argv[i]);
      return 2;
    }
  }
  if (inputs.empty()) {
    std::fprintf(stderr, "no inputs found in the arguments: an empty corpus replays nothing\n");
    return 2;
  }
  std::sort(inputs.begin(), inputs.end());
  for (const auto& path : inputs) {
    std::ifstream in(path, std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (!in.good() && !in.eof()) {
      std::fprintf(stderr, "%s: cannot be read\n", path.c_str());
      return 2;
    }
    std::fprintf(stderr, "replay %s (%zu bytes)\n", path.c_str(), bytes.size());
    auto buffer = std::make_unique<uint8_t[]>(bytes.size());
    std::copy(bytes.begin(), bytes.end(), buffer.get());
    LLVMFuzzerTestOneInput(buffer.get(), bytes.size());
  }
  std::fprintf(stderr, "replayed %zu inputs: no crash\n", inputs.size());
  return 0;
}
