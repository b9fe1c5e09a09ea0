// Durable file writes: a temporary file, fsync, rename, fsync of the
// directory. After a crash a reader sees either the old file or the whole
// new one, never a part.
#pragma once

#include <string>
#include <string_view>

#include "nonstop/status.h"

namespace nonstop {

// Writes `contents` to `path` atomically.
Status WriteFileAtomically(const std::string& path, std::string_view contents);
// Writes `contents` to `path` (no rename) and fsyncs it.
Status WriteFileSynced(const std::string& path, std::string_view contents);
// fsyncs a directory so that a rename or create inside it is durable.
Status SyncDirectory(const std::string& dir);
// Reads a whole file.
Result<std::string> ReadFile(const std::string& path);

}  // namespace nonstop
