// Exit codes a nonstop job ends with that mean the same to every program of
// it (docs/errors.md "Exit codes"): a worker that exits with one, the session
// that reports one to the controller, and `nonstop run`, which ends with it.
#pragma once

namespace nonstop {

// A usage error: a malformed flag or file, or an injected fault that cannot be carried out (so a
// test built on it cannot pass untested). Fix the command.
inline constexpr int kExitUsage = 2;

// Data corruption: a corrupt shard, a loss that is not finite, replicas that
// disagree with no majority (docs/integrity.md). Do not restart on the same
// data: fix it first.
inline constexpr int kExitDataCorruption = 11;

// A bug in the script: the same exception recurred on the replacements of a
// rank (or at the same step), or every member raised it at once. Do not
// restart the job unchanged: fix the script (its traceback is printed).
inline constexpr int kExitScriptFailure = 12;

}  // namespace nonstop
