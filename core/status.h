// Status and Result<T>: ponte's errors as values, used across every module border.
// A Status is cheap to copy; its message is a fixed buffer so that creating one never allocates.
#pragma once

#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <new>
#include <type_traits>
#include <utility>

namespace ponte {

enum class Code : uint8_t {
  kOk = 0,
  kInvalidArgument,   // bad input: truncated/foreign bytes, out-of-range offset, unknown index
  kNotFound,          // no such device/provider/peer
  kUnavailable,       // backend library or device not present on this host
  kAgain,             // back-pressure: queue full, try again later (never a failure of the op)
  kPeerDead,          // the peer's process died or its connection closed
  kTimeout,           // no completion within the configured timeout
  kTransport,         // the NIC/provider reported an error completion
  kResource,          // out of memory, registrations, queue slots
  kCancelled,         // the engine or comm was closed while the op was outstanding
  kInternal,          // a bug in ponte
};

const char* code_name(Code c);

class [[nodiscard]] Status {
 public:
  Status() { msg_[0] = 0; }
  static Status Ok() { return Status(); }
  Status(Code code, const char* fmt, ...) __attribute__((format(printf, 3, 4))) : code_(code) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg_, sizeof(msg_), fmt, ap);
    va_end(ap);
  }
  bool ok() const { return code_ == Code::kOk; }
  Code code() const { return code_; }
  const char* message() const { return msg_; }
  explicit operator bool() const = delete;  // write st.ok(), never if (st)

 private:
  Code code_ = Code::kOk;
  char msg_[120];  // only msg_[0] is set for OK: building an OK status writes one byte
};

// Result<T>: a T or a non-OK Status.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : ok_(true) { new (&value_) T(std::move(value)); }  // NOLINT implicit
  Result(Status st) : ok_(false), status_(st) {                       // NOLINT implicit
    if (status_.ok()) status_ = Status(Code::kInternal, "Result built from an OK status");
  }
  Result(const Result& o) : ok_(o.ok_), status_(o.status_) {
    if (ok_) new (&value_) T(o.value_);
  }
  Result(Result&& o) noexcept : ok_(o.ok_), status_(o.status_) {
    if (ok_) new (&value_) T(std::move(o.value_));
  }
  Result& operator=(Result o) {
    this->~Result();
    new (this) Result(std::move(o));
    return *this;
  }
  ~Result() {
    if (ok_) value_.~T();
  }
  bool ok() const { return ok_; }
  const Status& status() const { return status_; }
  T& value() & { return value_; }
  const T& value() const& { return value_; }
  T&& value() && { return std::move(value_); }
  T* operator->() { return &value_; }
  const T* operator->() const { return &value_; }
  T& operator*() { return value_; }

 private:
  bool ok_;
  Status status_;
  union {
    T value_;
  };
};

#define PONTE_RETURN_IF_ERROR(expr)      \
  do {                                   \
    ::ponte::Status _st = (expr);        \
    if (!_st.ok()) return _st;           \
  } while (0)

#define PONTE_CONCAT_INNER(a, b) a##b
#define PONTE_CONCAT(a, b) PONTE_CONCAT_INNER(a, b)
#define PONTE_ASSIGN_OR_RETURN(lhs, expr)                              \
  auto PONTE_CONCAT(_res_, __LINE__) = (expr);                         \
  if (!PONTE_CONCAT(_res_, __LINE__).ok())                             \
    return PONTE_CONCAT(_res_, __LINE__).status();                     \
  lhs = std::move(PONTE_CONCAT(_res_, __LINE__)).value()

}  // namespace ponte
