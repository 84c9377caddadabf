// Shared pieces of the `ponte` Python module: ponte.Error from a Status, argument conversion with
// messages that name the argument, caller memory (buffer protocol, CPU torch tensors) and bounded waits.
#pragma once

#include <pybind11/pybind11.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "core/status.h"

namespace ponte::py {

namespace pyb = pybind11;

// Called once by the module: creates ponte.Error (a RuntimeError with .code and .message).
void init_errors(pyb::module_& m);

// Raises ponte.Error for st ("what: message"); never returns.
[[noreturn]] void raise_error(const Status& st, const char* what);
// An engine refusal: kInvalidArgument becomes ValueError naming `arg`, anything else ponte.Error.
[[noreturn]] void raise_refusal(const Status& st, const char* arg);
[[noreturn]] void raise_value(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
[[noreturn]] void raise_type(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
// TimeoutError, formatted as printf does (PyErr_Format has no %f: it printed "%.3f" as is).
[[noreturn]] void raise_timeout(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

// Argument conversion: TypeError when obj is not an integer, ValueError when out of range.
size_t arg_size(pyb::handle obj, const char* name);
uint32_t arg_u32(pyb::handle obj, const char* name);
int arg_int(pyb::handle obj, const char* name, int lo, int hi);
// None -> nullopt, else a u32.
std::optional<uint32_t> arg_opt_u32(pyb::handle obj, const char* name);
// A timeout in seconds (None -> nullopt); ValueError when negative or not finite.
std::optional<std::chrono::nanoseconds> arg_timeout(pyb::handle obj, const char* name);
// Bytes-like (bytes, bytearray, memoryview of bytes) as a pointer and length valid while obj lives.
struct ByteView {
  const uint8_t* data = nullptr;
  size_t len = 0;
};
ByteView arg_bytes(pyb::handle obj, const char* name, Py_buffer* hold);

// Caller memory: a contiguous object exporting the buffer protocol (numpy array, bytearray,
// memoryview) or a contiguous CPU torch tensor. Holds the object (and its buffer export) until
// release(), which needs the GIL.
class HostMemory {
 public:
  HostMemory() = default;
  HostMemory(const HostMemory&) = delete;
  HostMemory& operator=(const HostMemory&) = delete;
  ~HostMemory() { release(); }
  // writable: the memory will be written during the call (refuses read-only exports, and a torch
  // tensor that requires grad while autograd records: torch refuses such an out= tensor too, since
  // a write outside autograd would go unseen by it; bumps a torch tensor's version counter, as an
  // in-place op does: bump_version in py_common.cc). c_order: rows must be C-contiguous (else any
  // contiguous layout: the memory is taken as bytes).
  void acquire(pyb::handle obj, const char* name, bool writable, bool c_order = false) {
    acquire_checked(obj, name, writable, c_order, /*refuse_grad=*/writable);
  }
  // Memory registered for peers to write later (Engine.register): writable, and a tensor that
  // requires grad is taken (a model's parameters, updated in place under torch.no_grad()).
  void acquire_registered(pyb::handle obj, const char* name) {
    acquire_checked(obj, name, /*writable=*/true, /*c_order=*/false, /*refuse_grad=*/false);
  }
  // The same for memory used only during one call (the collectives' arrays): a plain numpy array of
  // a numeric dtype is read from its fields, without a buffer export (the costly part of taking an
  // array: bench/README.md, py_overhead), and is held by a reference, which makes numpy refuse to
  // resize it meanwhile.
  // Anything else goes through acquire().
  void acquire_for_call(pyb::handle obj, const char* name, bool writable, bool c_order = false);
  // A tensor the binding has just made with torch.empty (contiguous, on the CPU, requiring no
  // grad, seen by nothing yet): only its data pointer is read. acquire's checks could not fail,
  // and no autograd record can hold its version.
  void adopt_new_tensor(pyb::object tensor, std::span<const size_t> shape, const char* dtype, size_t itemsize);
  void release();
  void* data() const { return data_; }
  size_t size() const { return size_; }
  pyb::object object() const { return obj_; }
  bool is_torch() const { return torch_; }
  // Element type as numpy's dtype string ("float32", "int64", "uint16", "bfloat16", ...).
  const std::string& dtype() const { return dtype_; }
  size_t itemsize() const { return itemsize_; }
  // Shape in elements.
  std::span<const size_t> shape() const {
    return ndim_ <= dims_.size() ? std::span<const size_t>(dims_.data(), ndim_) : std::span<const size_t>(more_);
  }

 private:
  pyb::object obj_;
  Py_buffer view_{};
  bool has_view_ = false;
  bool torch_ = false;
  void* data_ = nullptr;
  size_t size_ = 0;
  size_t itemsize_ = 1;
  std::string dtype_;
  // The shape: inline up to 8 dimensions (no allocation per call for the arrays of a hot loop),
  // in more_ beyond.
  std::array<size_t, 8> dims_{};
  std::vector<size_t> more_;
  size_t ndim_ = 0;
  void push_dim(size_t d);
  void acquire_checked(pyb::handle obj, const char* name, bool writable, bool c_order, bool refuse_grad);
  void acquire_torch(pyb::handle obj, const char* name, bool refuse_grad);
};

// The C++ side of a constructed pybind11 instance of ti's class (or a subclass), read through
// pybind11's instance layout with ti looked up once; empty (inst null) for anything else.
inline pyb::detail::value_and_holder constructed_instance(PyObject* obj, const pyb::detail::type_info* ti) {
  if (!ti || !PyObject_TypeCheck(obj, ti->type)) return {};
  auto vh = reinterpret_cast<pyb::detail::instance*>(obj)->get_value_and_holder(ti, /*throw_if_missing=*/false);
  if (!vh.inst || !vh.vh || !vh.value_ptr() || !vh.holder_constructed()) return {};  // __init__ did not run
  return vh;
}

// Whether obj is a torch.Tensor (without importing torch: only when torch is already loaded).
bool is_torch_tensor(pyb::handle obj);

// A one-shot completion cell fired from the engine's worker thread (no GIL, no lock, no allocation:
// one atomic exchange, and a futex wake only when a thread sleeps on it) and waited for by Python
// threads with the GIL released.
class DoneCell {
 public:
  bool done() const { return state_.load(std::memory_order_acquire) == kDone; }
  void fire();  // worker side
  // Pending again, for a cell whose operation ended and whose waiters are gone (reuse).
  void reset() { state_.store(kPending, std::memory_order_relaxed); }
  // Waits until done or the deadline; true when done. The GIL must be released by the caller.
  bool wait_until(std::chrono::steady_clock::time_point deadline);

 private:
  static constexpr uint32_t kPending = 0, kDone = 1, kSleeper = 2;
  std::atomic<uint32_t> state_{kPending};
};

// Waits for cell with the GIL released, in slices, checking for KeyboardInterrupt between them.
// timeout nullopt: until done. Returns false on timeout; raises on a pending Python signal.
bool wait_cell(DoneCell& cell, std::optional<std::chrono::nanoseconds> timeout);

}  // namespace ponte::py
