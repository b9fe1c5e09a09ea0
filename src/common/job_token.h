// The job token handled as a secret (docs/security.md). Files that hold it
// are written through a fresh temporary name and read only when they are
// this user's own and private. A worker receives it in a sealed memfd that
// it inherits, named by NONSTOP_JOB_TOKEN_FD: the token itself is in no
// process's environment, so neither the user's program nor its children
// (nor a crash report or a `ps e`) see it.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include "common/unique_fd.h"
#include "nonstop/status.h"

namespace nonstop {

// The longest job token a file or a descriptor may hold.
inline constexpr size_t kMaxJobTokenBytes = 1024;

// Writes `contents` to `path`, readable and writable by this user only: into
// a temporary file of a random name beside it, created with
// O_CREAT|O_EXCL|O_NOFOLLOW and mode 0600 (a file or a symlink planted at a
// predictable name is never written through), fsynced, then renamed over
// `path`. A reader sees the old file or the whole new one, never a part.
Status WritePrivateFile(const std::string& path, std::string_view contents);

// Reads a file holding a secret. Refused with the reason and the fix
// (kFailedPrecondition) when `path` is a symlink, is not a regular file, is
// owned by another user, or may be read or written by group or others: the
// checks are made on the opened descriptor (fstat), so the file cannot change
// between the check and the read. kNotFound when it does not exist;
// kInvalidArgument when it holds over `max_bytes`. `what` names it in
// messages ("job token file").
Result<std::string> ReadPrivateFile(const std::string& path, std::string_view what,
                                    size_t max_bytes);

// Reads a job token file (ReadPrivateFile): the token is the file's contents
// with surrounding whitespace removed; an empty file is refused.
Result<std::string> ReadJobTokenFile(const std::string& path);

// The HTTP endpoint's bearer token: derived from the job token (HMAC with the job key, in hex), so
// that what an HTTP client sends, over plain HTTP off loopback included, never gives away the job
// token, the root of the job key. Whoever holds it may use the endpoint, nothing more.
std::string HttpCredential(std::string_view job_token);

// A sealed memfd holding `token`, close-on-exec: a launcher clears that flag
// in the child it starts and names the descriptor in NONSTOP_JOB_TOKEN_FD.
// The descriptor is 3 or above (never a standard stream).
Result<UniqueFd> JobTokenMemfd(std::string_view token);

// Takes the job token this process was started with, once, as the worker
// library loads (before main, or as Python imports the package): from the
// memfd NONSTOP_JOB_TOKEN_FD names (checked to be a sealed memfd of this
// kind, read, then closed, so that no child inherits it), or else from
// NONSTOP_JOB_TOKEN (a worker started by hand). Both variables are then
// removed from the environment. "" when neither is set; an error when
// NONSTOP_JOB_TOKEN_FD does not name such a descriptor.
Result<std::string> TakeInheritedJobToken();

// Shuts this process to the other processes of its user (prctl PR_SET_DUMPABLE 0): opening its
// /proc/<pid>/mem, /environ or /fd, or attaching to it with ptrace, then takes CAP_SYS_PTRACE,
// so the code a worker runs (the same user) cannot read the job token out of the launcher,
// the agent or the controller that hold it. It dumps no core either. A program it starts is
// dumpable again (execve resets the flag): workers are not affected. Every `nonstop` command
// calls it first (docs/security.md, "Workers").
Status ShutOutSameUserProcesses();

namespace testing {
// WritePrivateFile through the temporary name `tmp` (a test plants things there).
Status WritePrivateFileVia(const std::string& path, const std::string& tmp,
                           std::string_view contents);
}  // namespace testing

}  // namespace nonstop
