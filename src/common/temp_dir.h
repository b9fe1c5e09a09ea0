// TempDir: a fresh directory under $TMPDIR, removed with its contents when
// the object goes away. For tests and tools.
#pragma once

#include <stdlib.h>

#include <filesystem>
#include <string>

#include "common/check.h"

namespace nonstop {

class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "nonstop-XXXXXX").string();
    NONSTOP_CHECK(::mkdtemp(tmpl.data()) != nullptr) << "mkdtemp failed";
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::string& path() const { return path_; }
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

}  // namespace nonstop
