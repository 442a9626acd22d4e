// Errors travel as values: a Status carries a code and a message with context (file, tensor, field,
// rank); Result<T> is a value or a Status. Library code never exits; only apps/ turns a Status into an
// exit code.
#pragma once

#include <cassert>
#include <string>
#include <utility>
#include <variant>

#include <fmt/format.h>

namespace dl {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,  // bad input: flags, request fields, config values
  kNotFound,         // missing file, tensor, preset
  kDataLoss,         // corrupt or truncated file
  kUnimplemented,    // valid input we do not support yet
  kResourceExhausted,
  kUnavailable,      // no GPU, no driver
  kFailedPrecondition,
  kInternal,
  kDeadlineExceeded,
  kCancelled,
};

const char* StatusCodeName(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return {}; }
  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  std::string ToString() const;

  // Prepends context ("loading model.safetensors: ") to the message, keeping the code.
  Status WithContext(const std::string& context) const {
    if (ok()) return *this;
    return Status(code_, context + ": " + message_);
  }

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

template <typename... Args>
Status InvalidArgument(fmt::format_string<Args...> f, Args&&... args) {
  return Status(StatusCode::kInvalidArgument, fmt::format(f, std::forward<Args>(args)...));
}
template <typename... Args>
Status NotFound(fmt::format_string<Args...> f, Args&&... args) {
  return Status(StatusCode::kNotFound, fmt::format(f, std::forward<Args>(args)...));
}
template <typename... Args>
Status DataLoss(fmt::format_string<Args...> f, Args&&... args) {
  return Status(StatusCode::kDataLoss, fmt::format(f, std::forward<Args>(args)...));
}
template <typename... Args>
Status Unimplemented(fmt::format_string<Args...> f, Args&&... args) {
  return Status(StatusCode::kUnimplemented, fmt::format(f, std::forward<Args>(args)...));
}
template <typename... Args>
Status Unavailable(fmt::format_string<Args...> f, Args&&... args) {
  return Status(StatusCode::kUnavailable, fmt::format(f, std::forward<Args>(args)...));
}
template <typename... Args>
Status Internal(fmt::format_string<Args...> f, Args&&... args) {
  return Status(StatusCode::kInternal, fmt::format(f, std::forward<Args>(args)...));
}
template <typename... Args>
Status ResourceExhausted(fmt::format_string<Args...> f, Args&&... args) {
  return Status(StatusCode::kResourceExhausted, fmt::format(f, std::forward<Args>(args)...));
}
template <typename... Args>
Status FailedPrecondition(fmt::format_string<Args...> f, Args&&... args) {
  return Status(StatusCode::kFailedPrecondition, fmt::format(f, std::forward<Args>(args)...));
}

// A value or an error. (std::expected is C++23 and absent from g++ 12.)
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}  // NOLINT: implicit by design
  Result(Status status) : v_(std::move(status)) {  // NOLINT
    assert(!std::get<Status>(v_).ok() && "Result from an OK status");
  }

  bool ok() const { return std::holds_alternative<T>(v_); }
  const Status& status() const {
    static const Status kOk;
    return ok() ? kOk : std::get<Status>(v_);
  }
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace dl

#define DL_CONCAT_INNER(a, b) a##b
#define DL_CONCAT(a, b) DL_CONCAT_INNER(a, b)

// Returns the Status from the enclosing function when `expr` (a Status) is not OK.
#define DL_RETURN_IF_ERROR(expr)               \
  do {                                         \
    ::dl::Status dl_status_ = (expr);          \
    if (!dl_status_.ok()) return dl_status_;   \
  } while (0)

// `DL_ASSIGN_OR_RETURN(auto x, MakeX());` binds the value or returns the error.
#define DL_ASSIGN_OR_RETURN(lhs, expr) DL_ASSIGN_OR_RETURN_IMPL(DL_CONCAT(dl_result_, __LINE__), lhs, expr)
#define DL_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                             \
  if (!tmp.ok()) return tmp.status();            \
  lhs = std::move(tmp).value()
