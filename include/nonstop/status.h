// Status and Result<T>: how expected failures cross module boundaries.
//
// A Status is a code plus a message that says who, what, where and which
// generation. Each code has one meaning (docs/errors.md):
//   kUnavailable        a peer is unreachable or its connection closed; reconfigure, then retry
//   kDeadlineExceeded   a deadline passed
//   kAborted            the operation was aborted (membership changed); redo the step
//   kDataLoss           a checksum or format check failed
//   kInvalidArgument    the caller passed something wrong (bad config, bad flag)
//   kFailedPrecondition the system is not in a state where the call can work
//   kNotFound           a named thing does not exist
//   kInternal           a protocol violation or an invariant broken by a peer
// Bugs in our own code are not Statuses: they are NONSTOP_CHECK failures.
//
// Thread-safety: values; copy freely.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

#include "nonstop/check.h"

namespace nonstop {

enum class StatusCode {
  kOk = 0,
  kCancelled,
  kInvalidArgument,
  kDeadlineExceeded,
  kNotFound,
  kFailedPrecondition,
  kAborted,
  kUnavailable,
  kDataLoss,
  kInternal,
};

std::string_view StatusCodeName(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  std::string ToString() const;

  // Returns a copy whose message is "context: message".
  Status WithContext(std::string_view context) const;

  void IgnoreError() const {}

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

inline Status OkStatus() { return Status(); }
inline Status CancelledError(std::string m) { return {StatusCode::kCancelled, std::move(m)}; }
inline Status InvalidArgumentError(std::string m) {
  return {StatusCode::kInvalidArgument, std::move(m)};
}
inline Status DeadlineExceededError(std::string m) {
  return {StatusCode::kDeadlineExceeded, std::move(m)};
}
inline Status NotFoundError(std::string m) { return {StatusCode::kNotFound, std::move(m)}; }
inline Status FailedPreconditionError(std::string m) {
  return {StatusCode::kFailedPrecondition, std::move(m)};
}
inline Status AbortedError(std::string m) { return {StatusCode::kAborted, std::move(m)}; }
inline Status UnavailableError(std::string m) { return {StatusCode::kUnavailable, std::move(m)}; }
inline Status DataLossError(std::string m) { return {StatusCode::kDataLoss, std::move(m)}; }
inline Status InternalError(std::string m) { return {StatusCode::kInternal, std::move(m)}; }

// Status from errno, with the operation and object named: "connect 127.0.0.1:4000: Connection
// refused".
Status ErrnoStatus(StatusCode code, std::string_view what, int err);

// Result<T> holds a T or a non-OK Status.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : value_(std::move(value)) {}         // NOLINT: implicit by design
  Result(Status status) : status_(std::move(status)) {  // NOLINT: implicit by design
    NONSTOP_CHECK(!status_.ok()) << "Result constructed from an OK status without a value";
  }

  bool ok() const { return status_.ok(); }
  const Status& status() const { return status_; }

  T& value() & {
    NONSTOP_CHECK(ok()) << status_.ToString();
    return *value_;
  }
  const T& value() const& {
    NONSTOP_CHECK(ok()) << status_.ToString();
    return *value_;
  }
  T&& value() && {
    NONSTOP_CHECK(ok()) << status_.ToString();
    return std::move(*value_);
  }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }

 private:
  Status status_;
  std::optional<T> value_;
};

#define NONSTOP_STATUS_CONCAT_INNER(a, b) a##b
#define NONSTOP_STATUS_CONCAT(a, b) NONSTOP_STATUS_CONCAT_INNER(a, b)

#define NONSTOP_RETURN_IF_ERROR(expr)                  \
  do {                                                 \
    ::nonstop::Status _nonstop_status = (expr);        \
    if (!_nonstop_status.ok()) return _nonstop_status; \
  } while (0)

#define NONSTOP_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                                  \
  if (!tmp.ok()) return tmp.status();                 \
  lhs = std::move(tmp).value()

#define NONSTOP_ASSIGN_OR_RETURN(lhs, expr) \
  NONSTOP_ASSIGN_OR_RETURN_IMPL(NONSTOP_STATUS_CONCAT(_nonstop_result_, __LINE__), lhs, expr)

}  // namespace nonstop
