// Shared pieces of the `ponte` Python module (see py_common.h).
#include "python/src/py_common.h"

#include <pybind11/numpy.h>

#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <string>

namespace ponte::py {

namespace {

PyObject* g_error = nullptr;  // ponte.Error

std::string vformat(const char* fmt, va_list ap) {
  char buf[512];
  vsnprintf(buf, sizeof(buf), fmt, ap);
  return buf;
}

const char* type_name(pyb::handle obj) { return Py_TYPE(obj.ptr())->tp_name; }

}  // namespace

void init_errors(pyb::module_& m) {
  g_error = PyErr_NewExceptionWithDoc(
      "ponte.Error",
      "An engine failure. ``code`` is a :class:`ponte.Code` (PEER_DEAD, TIMEOUT, TRANSPORT, ...), "
      "``message`` the engine's text.",
      PyExc_RuntimeError, nullptr);
  if (!g_error) throw pyb::error_already_set();
  m.add_object("Error", pyb::handle(g_error));
}

void raise_error(const Status& st, const char* what) {
  // A Python exception raised while the call waited (Ctrl-C's KeyboardInterrupt, from the
  // communicator's interrupted hook) is the one the caller gets.
  if (PyErr_Occurred()) throw pyb::error_already_set();
  std::string text = std::string(what) + ": " + st.message();
  pyb::object exc = pyb::reinterpret_steal<pyb::object>(PyObject_CallFunction(g_error, "s", text.c_str()));
  if (!exc) throw pyb::error_already_set();
  exc.attr("code") = pyb::cast(st.code());
  exc.attr("message") = pyb::str(st.message());
  PyErr_SetObject(g_error, exc.ptr());
  throw pyb::error_already_set();
}

void raise_refusal(const Status& st, const char* arg) {
  if (st.code() == Code::kInvalidArgument) raise_value("%s: %s", arg, st.message());
  raise_error(st, arg);
}

void raise_value(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  std::string s = vformat(fmt, ap);
  va_end(ap);
  throw pyb::value_error(s);
}

void raise_type(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  std::string s = vformat(fmt, ap);
  va_end(ap);
  throw pyb::type_error(s);
}

void raise_timeout(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  std::string s = vformat(fmt, ap);
  va_end(ap);
  PyErr_SetString(PyExc_TimeoutError, s.c_str());
  throw pyb::error_already_set();
}

// ---- arguments

// obj as a Python int (TypeError unless it is an integer, bools excluded): its value when it fits a
// long long (*overflow 0), else *overflow is +1 or -1.
static pyb::object int_of(pyb::handle obj, const char* name, long long* value, int* overflow) {
  if (PyBool_Check(obj.ptr()) || !PyIndex_Check(obj.ptr()))
    raise_type("%s must be an integer, not %s", name, type_name(obj));
  pyb::object idx = pyb::reinterpret_steal<pyb::object>(PyNumber_Index(obj.ptr()));
  if (!idx) throw pyb::error_already_set();
  *overflow = 0;
  *value = PyLong_AsLongLongAndOverflow(idx.ptr(), overflow);
  if (*value == -1 && PyErr_Occurred()) throw pyb::error_already_set();
  return idx;
}

static unsigned long long arg_ull(pyb::handle obj, const char* name, unsigned long long max) {
  long long v;
  int overflow;
  pyb::object idx = int_of(obj, name, &v, &overflow);
  if (overflow < 0 || (overflow == 0 && v < 0)) raise_value("%s must be >= 0", name);
  unsigned long long u = overflow > 0 ? PyLong_AsUnsignedLongLong(idx.ptr()) : static_cast<unsigned long long>(v);
  if (u == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
    PyErr_Clear();
    raise_value("%s is too large", name);
  }
  if (u > max) raise_value("%s = %llu is too large (at most %llu)", name, u, max);
  return u;
}

size_t arg_size(pyb::handle obj, const char* name) { return arg_ull(obj, name, SIZE_MAX); }

uint32_t arg_u32(pyb::handle obj, const char* name) { return static_cast<uint32_t>(arg_ull(obj, name, 0xffffffffull)); }

int arg_int(pyb::handle obj, const char* name, int lo, int hi) {
  long long v;
  int overflow;
  int_of(obj, name, &v, &overflow);
  if (overflow != 0 || v < lo || v > hi) raise_value("%s must be in [%d, %d]", name, lo, hi);
  return static_cast<int>(v);
}

std::optional<uint32_t> arg_opt_u32(pyb::handle obj, const char* name) {
  if (obj.is_none()) return std::nullopt;
  return arg_u32(obj, name);
}

std::optional<std::chrono::nanoseconds> arg_timeout(pyb::handle obj, const char* name) {
  if (obj.is_none()) return std::nullopt;
  if (PyBool_Check(obj.ptr()) || !(PyFloat_Check(obj.ptr()) || PyIndex_Check(obj.ptr())))
    raise_type("%s must be a number of seconds or None, not %s", name, type_name(obj));
  double s = PyFloat_AsDouble(obj.ptr());
  if (s == -1.0 && PyErr_Occurred()) throw pyb::error_already_set();
  if (!std::isfinite(s) || s < 0) raise_value("%s must be a finite number of seconds >= 0", name);
  if (s > 1e9) s = 1e9;
  return std::chrono::nanoseconds(static_cast<int64_t>(s * 1e9));
}

ByteView arg_bytes(pyb::handle obj, const char* name, Py_buffer* hold) {
  if (PyBytes_Check(obj.ptr())) {
    return ByteView{reinterpret_cast<const uint8_t*>(PyBytes_AS_STRING(obj.ptr())),
                    static_cast<size_t>(PyBytes_GET_SIZE(obj.ptr()))};
  }
  if (!PyObject_CheckBuffer(obj.ptr()) || PyUnicode_Check(obj.ptr()))
    raise_type("%s must be bytes (a peer's address or descriptor), not %s", name, type_name(obj));
  if (PyObject_GetBuffer(obj.ptr(), hold, PyBUF_C_CONTIGUOUS) != 0) {
    PyErr_Clear();
    raise_value("%s must be contiguous bytes", name);
  }
  return ByteView{static_cast<const uint8_t*>(hold->buf), static_cast<size_t>(hold->len)};
}

// ---- caller memory

namespace {

// torch.Tensor's type once seen (a strong reference kept for the process's life: torch is never
// unloaded), and the names a tensor is read through, interned once.
PyTypeObject* g_tensor_type = nullptr;

PyObject* interned(const char* s) {
  PyObject* o = PyUnicode_InternFromString(s);  // kept for the process's life
  if (!o) throw pyb::error_already_set();
  return o;
}

// torch dtypes seen so far (torch's dtype objects are singletons, held here by a strong reference):
// a tensor's dtype is then one attribute read and a pointer compare, not a str() and a call.
struct TorchDType {
  PyObject* dtype = nullptr;
  char name[24] = {};
  size_t itemsize = 0;
  bool negatable = false;     // may_be_negated(name), decided once
  bool conjugatable = false;  // may_be_conjugated(name)
};
// Whether a tensor of this dtype can be a lazily negated view (torch's neg bit: a float or complex
// tensor, e.g. the imaginary part of a conjugate) or a lazily conjugated one (complex): its memory
// then does not hold its values.
bool may_be_conjugated(const char* dtype) { return std::strncmp(dtype, "complex", 7) == 0; }
bool may_be_negated(const char* dtype) {
  return std::strncmp(dtype, "float", 5) == 0 || std::strncmp(dtype, "bfloat", 6) == 0 || may_be_conjugated(dtype);
}
std::array<TorchDType, 32> g_torch_dtypes;  // more dtypes than torch has; beyond it, read each time
size_t g_torch_dtype_count = 0;

// torch.is_grad_enabled() (torch is loaded: a tensor was seen); its function looked up once.
bool torch_grad_enabled() {
  static PyObject* fn = nullptr;  // kept for the process's life
  if (!fn) {
    static PyObject* const n_torch = interned("torch");
    PyObject* torch = PyImport_GetModule(n_torch);
    if (!torch) {
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_ImportError, "torch is not loaded");
      throw pyb::error_already_set();
    }
    fn = PyObject_GetAttrString(torch, "is_grad_enabled");
    Py_DECREF(torch);
    if (!fn) throw pyb::error_already_set();
  }
  PyObject* r = PyObject_CallNoArgs(fn);
  if (!r) throw pyb::error_already_set();
  const bool on = r == Py_True;
  Py_DECREF(r);
  return on;
}

// A tensor this call writes: its version counter goes up, as with torch's own in-place ops, so
// that autograd notices when it had saved the tensor for a backward pass (backward then raises
// instead of using the overwritten values). tensor.set_(tensor) does that and changes nothing else:
// same storage, offset, sizes and strides (a view keeps its base; the counter is shared with it).
// Taken before the write: the counter only has to differ from what autograd saved. A tensor with
// no counter to bump (an inference tensor outside torch.inference_mode(), where torch refuses
// in-place updates) is written without one.
void bump_version(PyObject* tensor) {
  static PyObject* const n_set = interned("set_");
  PyObject* r = PyObject_CallMethodOneArg(tensor, n_set, tensor);
  if (r) {
    Py_DECREF(r);
  } else {
    PyErr_Clear();
  }
}

}  // namespace

bool is_torch_tensor(pyb::handle obj) {
  // A torch.Tensor does not export the buffer protocol: numpy arrays and bytearrays, the common
  // case of a hot loop, are answered here without looking torch up.
  if (PyObject_CheckBuffer(obj.ptr())) return false;
  if (!g_tensor_type) {
    static PyObject* const name = PyUnicode_InternFromString("torch");  // kept for the process's life
    if (!name) {
      PyErr_Clear();
      return false;
    }
    PyObject* torch = PyImport_GetModule(name);  // new ref or NULL; never imports
    if (!torch) {
      PyErr_Clear();
      return false;
    }
    PyObject* tensor = PyObject_GetAttrString(torch, "Tensor");
    Py_DECREF(torch);
    if (!tensor || !PyType_Check(tensor)) {
      Py_XDECREF(tensor);
      PyErr_Clear();
      return false;
    }
    g_tensor_type = reinterpret_cast<PyTypeObject*>(tensor);  // the reference is kept
  }
  return PyObject_TypeCheck(obj.ptr(), g_tensor_type);
}

static std::string format_dtype(const char* fmt, size_t itemsize) {
  std::string f = fmt ? fmt : "B";
  if (!f.empty() && (f[0] == '<' || f[0] == '=' || f[0] == '@' || f[0] == '|')) f = f.substr(1);
  if (f.size() != 1) return "bytes" + std::to_string(itemsize);
  switch (f[0]) {
    case 'f': return "float32";
    case 'd': return "float64";
    case 'e': return "float16";
    case 'b': return "int8";
    case 'B': return "uint8";
    case 'h': return "int16";
    case 'H': return "uint16";
    case 'i': return itemsize == 4 ? "int32" : "int" + std::to_string(8 * itemsize);
    case 'I': return itemsize == 4 ? "uint32" : "uint" + std::to_string(8 * itemsize);
    case 'l': case 'q': return "int" + std::to_string(8 * itemsize);
    case 'L': case 'Q': return "uint" + std::to_string(8 * itemsize);
    case '?': return "bool";
    default: return "bytes" + std::to_string(itemsize);
  }
}

void HostMemory::acquire_checked(pyb::handle obj, const char* name, bool writable, bool c_order, bool refuse_grad) {
  release();
  if (obj.is_none()) raise_type("%s must be a numpy array, bytearray or CPU torch tensor, not None", name);
  if (is_torch_tensor(obj)) return acquire_torch(obj, name, refuse_grad);
  if (!PyObject_CheckBuffer(obj.ptr()) || PyUnicode_Check(obj.ptr()))
    raise_type("%s must be a numpy array, bytearray or CPU torch tensor (an object with the buffer protocol), not %s",
               name, type_name(obj));
  int flags = (c_order ? PyBUF_C_CONTIGUOUS : PyBUF_ANY_CONTIGUOUS) | PyBUF_FORMAT;
  if (writable) flags |= PyBUF_WRITABLE;
  if (PyObject_GetBuffer(obj.ptr(), &view_, flags) != 0) {
    pyb::error_already_set e;  // fetches the BufferError
    if (writable && PyObject_GetBuffer(obj.ptr(), &view_, flags & ~PyBUF_WRITABLE) == 0) {
      PyBuffer_Release(&view_);
      raise_type("%s is read-only (%s); pass writable memory such as a bytearray or numpy array", name, type_name(obj));
    }
    PyErr_Clear();
    raise_value("%s: %s is not %scontiguous memory (%s)", name, type_name(obj), c_order ? "C-" : "", e.what());
  }
  has_view_ = true;
  data_ = view_.buf;
  size_ = static_cast<size_t>(view_.len);
  itemsize_ = static_cast<size_t>(view_.itemsize > 0 ? view_.itemsize : 1);
  dtype_ = format_dtype(view_.format, itemsize_);
  ndim_ = 0;
  more_.clear();
  if (view_.ndim == 0) {
    push_dim(size_ / itemsize_);
  } else {
    for (int i = 0; i < view_.ndim; i++) push_dim(static_cast<size_t>(view_.shape ? view_.shape[i] : size_ / itemsize_));
  }
  torch_ = false;
  obj_ = pyb::reinterpret_borrow<pyb::object>(obj);
}

// A CPU tensor, read through five attribute reads and calls (is_cpu, is_contiguous, dtype, shape,
// data_ptr; and is_neg / is_conj for a float or complex dtype; requires_grad, and set_ for the
// version counter (bump_version), for one written in the call), with names interned and dtypes
// remembered with what they allow: torch's str(dtype), element_size() and device are taken only
// for a dtype not seen before or on the way to an error, and numel() never (the product of the
// shape).
void HostMemory::acquire_torch(pyb::handle obj, const char* name, bool refuse_grad) {
  static PyObject* const n_is_cpu = interned("is_cpu");
  static PyObject* const n_dtype = interned("dtype");
  static PyObject* const n_shape = interned("shape");
  static PyObject* const n_is_contiguous = interned("is_contiguous");
  static PyObject* const n_data_ptr = interned("data_ptr");
  PyObject* o = obj.ptr();
  // A torch error on the way (a sparse or otherwise unreadable tensor) becomes a ValueError naming
  // the argument.
  auto attr = [&](PyObject* n, bool call) {
    PyObject* r = call ? PyObject_CallMethodNoArgs(o, n) : PyObject_GetAttr(o, n);
    if (!r) {
      pyb::error_already_set e;
      raise_value("%s: the tensor cannot be read as CPU memory (%s)", name, e.what());
    }
    return pyb::reinterpret_steal<pyb::object>(r);
  };
  if (attr(n_is_cpu, false).ptr() != Py_True) {
    std::string dev = pyb::str(obj.attr("device").attr("type"));
    raise_value("%s: a %s tensor; only CPU tensors are supported", name, dev.c_str());
  }
  if (attr(n_is_contiguous, true).ptr() != Py_True)
    raise_value("%s: the tensor is not contiguous (call .contiguous())", name);
  pyb::object dt = attr(n_dtype, false);
  const TorchDType* known = nullptr;
  for (size_t i = 0; i < g_torch_dtype_count; i++)
    if (g_torch_dtypes[i].dtype == dt.ptr()) known = &g_torch_dtypes[i];
  bool negatable, conjugatable;
  if (known) {
    dtype_ = known->name;
    itemsize_ = known->itemsize;
    negatable = known->negatable;
    conjugatable = known->conjugatable;
  } else {
    dtype_ = pyb::str(dt);
    if (dtype_.rfind("torch.", 0) == 0) dtype_ = dtype_.substr(6);
    static PyObject* const n_element_size = interned("element_size");
    itemsize_ = attr(n_element_size, true).cast<size_t>();
    negatable = may_be_negated(dtype_.c_str());
    conjugatable = may_be_conjugated(dtype_.c_str());
    if (g_torch_dtype_count < g_torch_dtypes.size() && dtype_.size() < sizeof(TorchDType::name)) {
      // Filled, then counted (the GIL is held throughout: no Python code runs in between).
      TorchDType& t = g_torch_dtypes[g_torch_dtype_count];
      std::memcpy(t.name, dtype_.c_str(), dtype_.size() + 1);
      t.itemsize = itemsize_;
      t.negatable = negatable;
      t.conjugatable = conjugatable;
      t.dtype = dt.release().ptr();  // the reference is kept
      g_torch_dtype_count++;
    }
  }
  static PyObject* const n_is_neg = interned("is_neg");
  static PyObject* const n_is_conj = interned("is_conj");
  if (negatable && attr(n_is_neg, true).ptr() == Py_True)
    raise_value("%s: the tensor is a negated view: its memory does not hold its values (call .resolve_neg())", name);
  if (refuse_grad) {
    // Only a float or complex tensor can require grad; torch.is_grad_enabled() is asked only for one
    // that does.
    static PyObject* const n_requires_grad = interned("requires_grad");
    if (negatable && attr(n_requires_grad, false).ptr() == Py_True && torch_grad_enabled())
      raise_value("%s: the tensor requires grad and autograd is recording; ponte writes its memory outside autograd, "
                  "which would not see the change (pass a tensor that does not require grad, or call under "
                  "torch.no_grad())", name);
  }
  if (conjugatable && attr(n_is_conj, true).ptr() == Py_True)
    raise_value("%s: the tensor is a conjugated view: its memory does not hold its values (call .resolve_conj())",
                name);
  pyb::object shape = attr(n_shape, false);
  ndim_ = 0;
  more_.clear();
  size_t n = 1;
  if (PyTuple_Check(shape.ptr())) {  // torch.Size is a tuple
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(shape.ptr()); i++) {
      size_t d = PyLong_AsSize_t(PyTuple_GET_ITEM(shape.ptr(), i));
      if (d == static_cast<size_t>(-1) && PyErr_Occurred()) throw pyb::error_already_set();
      push_dim(d);
      n *= d;
    }
  } else {
    for (auto d : shape) {
      size_t v = d.cast<size_t>();
      push_dim(v);
      n *= v;
    }
  }
  if (ndim_ == 0) push_dim(1);  // a 0-d tensor holds one element
  void* p = PyLong_AsVoidPtr(attr(n_data_ptr, true).ptr());
  if (!p && PyErr_Occurred()) throw pyb::error_already_set();
  if (refuse_grad) bump_version(o);
  data_ = p;
  size_ = n * itemsize_;
  torch_ = true;
  obj_ = pyb::reinterpret_borrow<pyb::object>(obj);
}

// numpy's type numbers (stable across numpy versions) of the dtypes the binding names, with their
// names as format_dtype gives them and their sizes; nullptr: not one of them.
static const char* numpy_dtype(int type_num, size_t* itemsize) {
  static_assert(sizeof(long) == 8, "NPY_LONG is taken as 64-bit");
  switch (type_num) {
    case 0: *itemsize = 1; return "bool";
    case 1: *itemsize = 1; return "int8";
    case 2: *itemsize = 1; return "uint8";
    case 3: *itemsize = 2; return "int16";
    case 4: *itemsize = 2; return "uint16";
    case 5: *itemsize = 4; return "int32";
    case 6: *itemsize = 4; return "uint32";
    case 7: case 9: *itemsize = 8; return "int64";    // NPY_LONG, NPY_LONGLONG
    case 8: case 10: *itemsize = 8; return "uint64";  // NPY_ULONG, NPY_ULONGLONG
    case 11: *itemsize = 4; return "float32";
    case 12: *itemsize = 8; return "float64";
    case 23: *itemsize = 2; return "float16";         // NPY_HALF
    default: return nullptr;
  }
}

void HostMemory::acquire_for_call(pyb::handle obj, const char* name, bool writable, bool c_order) {
  namespace d = pyb::detail;
  // Only an object of numpy.ndarray's own type (numpy is loaded then: the object exists).
  PyTypeObject* t = Py_TYPE(obj.ptr());
  if (!PyObject_CheckBuffer(obj.ptr()) || std::strcmp(t->tp_name, "numpy.ndarray") != 0 ||
      t != d::npy_api::get().PyArray_Type_)
    return acquire(obj, name, writable, c_order);
  const d::PyArray_Proxy* a = d::array_proxy(obj.ptr());
  const d::PyArrayDescr_Proxy* descr = d::array_descriptor_proxy(a->descr);
  const int contiguous = c_order ? d::npy_api::NPY_ARRAY_C_CONTIGUOUS_
                                 : d::npy_api::NPY_ARRAY_C_CONTIGUOUS_ | d::npy_api::NPY_ARRAY_F_CONTIGUOUS_;
  size_t itemsize = 0;
  const char* dtype = numpy_dtype(descr->type_num, &itemsize);
  const bool native = descr->byteorder == '=' || descr->byteorder == '|' ||
                      (descr->byteorder == '<' && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__);
  if (!dtype || !native || !(a->flags & contiguous) || (writable && !(a->flags & d::npy_api::NPY_ARRAY_WRITEABLE_)))
    return acquire(obj, name, writable, c_order);  // its errors name what is wrong
  release();
  ndim_ = 0;
  more_.clear();
  size_t n = 1;
  for (int i = 0; i < a->nd; i++) {
    push_dim(static_cast<size_t>(a->dimensions[i]));
    n *= static_cast<size_t>(a->dimensions[i]);
  }
  if (a->nd == 0) push_dim(1);
  data_ = a->data;
  itemsize_ = itemsize;
  size_ = n * itemsize;
  dtype_ = dtype;
  torch_ = false;
  obj_ = pyb::reinterpret_borrow<pyb::object>(obj);
}

void HostMemory::adopt_new_tensor(pyb::object tensor, std::span<const size_t> shape, const char* dtype,
                                  size_t itemsize) {
  static PyObject* const n_data_ptr = interned("data_ptr");
  PyObject* r = PyObject_CallMethodNoArgs(tensor.ptr(), n_data_ptr);
  if (!r) throw pyb::error_already_set();
  void* p = PyLong_AsVoidPtr(r);
  Py_DECREF(r);
  if (!p && PyErr_Occurred()) throw pyb::error_already_set();
  release();
  ndim_ = 0;
  more_.clear();
  size_t n = 1;
  for (size_t d : shape) {
    push_dim(d);
    n *= d;
  }
  dtype_ = dtype;
  itemsize_ = itemsize;
  data_ = p;
  size_ = n * itemsize;
  torch_ = true;
  obj_ = std::move(tensor);
}

void HostMemory::push_dim(size_t d) {
  if (ndim_ < dims_.size()) {
    dims_[ndim_++] = d;
    return;
  }
  if (ndim_ == dims_.size()) more_.assign(dims_.begin(), dims_.end());
  more_.push_back(d);
  ndim_++;
}

void HostMemory::release() {
  if (has_view_) {
    PyBuffer_Release(&view_);
    has_view_ = false;
  }
  obj_ = pyb::object();
  data_ = nullptr;
  size_ = 0;
}

// ---- waiting

static long futex(std::atomic<uint32_t>* addr, int op, uint32_t val, const timespec* ts) {
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), op, val, ts, nullptr, 0);
}

void DoneCell::fire() {
  // The waiter may free the cell as soon as it sees kDone; the wake only uses the address (a stale
  // wake is harmless: futex waiters recheck their word).
  if (state_.exchange(kDone, std::memory_order_acq_rel) == kSleeper) futex(&state_, FUTEX_WAKE_PRIVATE, INT_MAX, nullptr);
}

bool DoneCell::wait_until(std::chrono::steady_clock::time_point deadline) {
  // A short spin first: a completion often arrives within microseconds under load.
  for (int i = 0; i < 200; i++) {
    if (done()) return true;
    __builtin_ia32_pause();
  }
  // Then up to kYieldSpinUs giving the core away between looks (sched_yield returns at once where
  // no other thread wants it): the engine's worker, which fires the cell, often shares the
  // waiter's core, and a futex sleep costs the worker a wake-up syscall and the waiter a context
  // switch per operation. On shm (the worker posts there, a Python wait does not poll), a 64 KiB
  // write stream at window 16 went from 0.34-0.42 to 0.48-0.67 of ponte-bench's
  // (bench/py_overhead.py, two cores).
  constexpr auto kYieldSpinUs = std::chrono::microseconds(50);
  const auto spin_end = std::min(deadline, std::chrono::steady_clock::now() + kYieldSpinUs);
  while (std::chrono::steady_clock::now() < spin_end) {
    if (done()) return true;
    sched_yield();
  }
  for (;;) {
    uint32_t s = state_.load(std::memory_order_acquire);
    if (s == kDone) return true;
    if (s == kPending && !state_.compare_exchange_weak(s, kSleeper, std::memory_order_acq_rel)) continue;
    auto left = deadline - std::chrono::steady_clock::now();
    if (left <= std::chrono::nanoseconds(0)) return done();
    auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(left).count();
    timespec ts{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
    futex(&state_, FUTEX_WAIT_PRIVATE, kSleeper, &ts);
  }
}

bool wait_cell(DoneCell& cell, std::optional<std::chrono::nanoseconds> timeout) {
  if (cell.done()) return true;
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  const auto end = timeout ? start + *timeout : clock::time_point::max();
  constexpr auto kSlice = std::chrono::milliseconds(100);  // how often Ctrl-C is noticed
  for (;;) {
    auto now = clock::now();
    auto slice_end = (end - now > kSlice) ? now + kSlice : end;
    bool done;
    {
      pyb::gil_scoped_release nogil;
      done = cell.wait_until(slice_end);
    }
    if (done) return true;
    if (clock::now() >= end) return false;
    if (PyErr_CheckSignals() != 0) throw pyb::error_already_set();
  }
}

}  // namespace ponte::py
