// The Engine half of the `ponte` module (see engine_binding.h).
//
// Threads: Python threads submit with the GIL held (a submission enqueues, and is posted at once
// when the thread polls the group, without the GIL for an operation over 256 KiB: submit below);
// the engine's worker
// fires completions into an OpState's DoneCell without the GIL; waits release the GIL. Lifetimes:
// an Operation owns its OpState; when the Python object goes away before the operation ended, the
// OpState is parked on its engine (EngineState::orphans) and freed, with the GIL, once it ended. An
// OpState holds its Region (and so the caller's buffer and the registration) until it is freed.
#include "python/src/engine_binding.h"

#include <sched.h>

#include <algorithm>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <shared_mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/engine.h"
#include "python/src/py_common.h"

#if PY_VERSION_HEX < 0x030A0000
#error "the ponte module needs Python 3.10 or newer (Py_TPFLAGS_DISALLOW_INSTANTIATION)"
#endif

namespace ponte::py {

namespace {

using Clock = std::chrono::steady_clock;
constexpr int kGroup = 0;  // the engine's host-memory group, the only one Python sees

struct OpState;

// One engine (its host-memory group 0) as Python sees it.
struct EngineState {
  std::unique_ptr<Engine> engine;  // null once closed
  std::atomic<bool> closing{false};
  uint32_t timeout_ms = 30000;
  // Shared by a thread that calls into the engine with the GIL released; exclusive for close().
  std::shared_mutex users;
  std::vector<OpState*> orphans;  // touched with the GIL held only
  size_t sweep_at = 64;
  // Ended OpStates kept for the next submission (GIL held): a stream of writes allocates nothing
  // for them. At most kSpareOps; their vectors keep their capacity.
  static constexpr size_t kSpareOps = 64;
  std::vector<OpState*> spare;
  // The descriptor bytes object last decoded and what it said (GIL held). A Python stream passes
  // the same `remote` bytes object to every call; bytes are immutable and the reference held here
  // keeps the object (and so its address) alive, so the same object means the same descriptor.
  pyb::object remote_obj;
  RemoteRegion remote_val;

  ~EngineState();
  Engine& live(const char* what) {
    if (!engine || closing.load(std::memory_order_relaxed)) raise_error(Status(Code::kCancelled, "the engine is closed"), what);
    return *engine;
  }
  void close();
  void orphan(OpState* op);
  // Lets go of op, whose Python handle is gone (or never made): recycled when it has ended, else
  // parked until it does.
  void release(OpState* op);
  void sweep();
  std::unique_ptr<OpState> new_op();
  void recycle(OpState* op);  // op has ended; nothing else holds it
  RemoteRegion remote(pyb::handle obj, const char* name);
  // The engine's own bound on everything plus slack: how long any wait for it may take.
  std::chrono::milliseconds bound() const { return std::chrono::milliseconds(timeout_ms) + std::chrono::seconds(5); }
};

std::mutex g_engines_mu;
std::vector<std::weak_ptr<EngineState>> g_engines;  // for close_all at interpreter exit

// Registered caller memory.
struct RegionState {
  std::shared_ptr<EngineState> eng;
  MemoryRegion mr;
  HostMemory mem;
  pyb::bytes descriptor;
  std::atomic<int> inflight{0};  // operations using this region that have not ended
  bool closed = false;

  ~RegionState() {
    try {
      close();
    } catch (pyb::error_already_set& e) {
      e.discard_as_unraisable("ponte.Region.__del__");
    } catch (...) {
    }
  }
  const MemoryRegion& live(const char* what) const {
    if (closed) raise_value("%s: the region is closed", what);
    return mr;
  }
  void close();
};

// One submitted operation.
struct OpState {
  DoneCell cell;
  Status status;
  std::shared_ptr<RegionState> region;
  std::atomic<int>* inflight = nullptr;  // region->inflight, released when the op ends
  std::vector<uint32_t> src_pages, dst_pages;
  std::vector<ScatterTarget> targets;
  std::vector<RemoteRegion> remotes;
  std::vector<PeerId> peers;

  static void fire(void* arg, const Status& st) {  // on the engine's worker; no GIL
    auto* op = static_cast<OpState*>(arg);
    op->status = st;
    if (op->inflight) op->inflight->fetch_sub(1, std::memory_order_release);
    op->cell.fire();
  }
  Notify notify() { return Notify{&OpState::fire, this}; }
};

std::unique_ptr<OpState> EngineState::new_op() {
  if (spare.empty()) return std::make_unique<OpState>();
  std::unique_ptr<OpState> op(spare.back());
  spare.pop_back();
  return op;
}

void EngineState::release(OpState* op) {
  if (op->cell.done()) {
    recycle(op);
  } else {
    orphan(op);
  }
}

void EngineState::recycle(OpState* op) {
  if (spare.size() >= kSpareOps) {
    delete op;
    return;
  }
  // The worker's last touch of an ended op was DoneCell::fire's exchange (a wake that follows
  // only uses the address; a waiter on the reused cell rechecks its word): reuse is as safe as
  // the delete it replaces.
  op->cell.reset();
  op->status = Status::Ok();
  op->region.reset();
  op->inflight = nullptr;
  op->src_pages.clear();
  op->dst_pages.clear();
  op->targets.clear();
  op->remotes.clear();
  op->peers.clear();
  spare.push_back(op);
}

EngineState::~EngineState() {
  close();
  for (OpState* op : spare) delete op;
}

void EngineState::close() {
  if (!engine) return;
  closing.store(true);
  {
    pyb::gil_scoped_release nogil;
    std::unique_lock lock(users);
    engine.reset();  // orderly shutdown: every callback has run when this returns
  }
  sweep();
}

void EngineState::orphan(OpState* op) {
  orphans.push_back(op);
  if (orphans.size() >= sweep_at) sweep();
}

void EngineState::sweep() {
  auto keep = std::remove_if(orphans.begin(), orphans.end(), [this](OpState* op) {
    if (!op->cell.done()) return false;
    recycle(op);
    return true;
  });
  orphans.erase(keep, orphans.end());
  sweep_at = std::max<size_t>(64, 2 * orphans.size());
}

void RegionState::close() {
  if (closed) return;
  closed = true;
  // Operations still using it end within the engine's timeout; wait for them without the GIL.
  if (inflight.load(std::memory_order_acquire) != 0) {
    auto deadline = Clock::now() + eng->bound();
    pyb::gil_scoped_release nogil;
    auto nap = std::chrono::microseconds(20);
    while (inflight.load(std::memory_order_acquire) != 0 && Clock::now() < deadline) {
      std::this_thread::sleep_for(nap);
      nap = std::min(nap * 2, std::chrono::microseconds(5000));
    }
  }
  if (inflight.load(std::memory_order_acquire) != 0) {
    // Never free memory a NIC may still write: keep it (leaked) and say so.
    mem.object().inc_ref();
    raise_error(Status(Code::kTimeout, "operations on the region did not end; its memory is kept registered"),
                "Region.close");
  }
  Status st = Status::Ok();
  {
    pyb::gil_scoped_release nogil;
    std::shared_lock lock(eng->users);
    if (eng->engine && mr.id != 0) st = eng->engine->deregister(mr);
  }
  mem.release();
  if (!st.ok()) raise_error(st, "Region.close");
}

// Before a wait sleeps: the waiting thread runs the group's data path itself (Engine::progress),
// as NCCL's proxy does in test(), so that the engine's worker backs off instead of spinning beside
// it for the CPU and no completion needs a cross-thread wake-up. It yields only after a pass that
// moved nothing, and stops polling after kPollWindow without progress (or when the engine closes),
// hands the data path back to the worker (Engine::stop_polling: it would otherwise notice only
// when it next wakes, up to 5 ms later) and sleeps on the cell: a long wait does not burn a core.
// Where a poller only reaps and the worker posts (shm: Engine::polling_posts), it does not poll
// at all: each submission would wake the worker onto the waiter's core, and the worker does the
// reaping in the same pass as the posting anyway (on shm, 16 writes of 64 KiB submitted and then
// waited for went from 9.6 to 6.7-7.5 us per write, an 8-byte write and its wait from 46 to 9 us).
// The GIL is released by the caller.
constexpr auto kPollWindow = std::chrono::milliseconds(1);
void note_pass(const Engine* eng, Clock::time_point at);  // see poll_once

void poll_until_done(EngineState& es, const DoneCell& cell, Clock::time_point end) {
  std::shared_lock lock(es.users, std::try_to_lock);  // close() holds it exclusively: just sleep
  if (!lock.owns_lock()) return;
  Engine* eng = es.engine.get();
  if (!eng || !eng->polling_posts(kGroup)) return;
  auto idle_since = Clock::now();
  uint32_t passes = 0;
  while (!cell.done() && !es.closing.load(std::memory_order_relaxed)) {
    if (eng->progress(kGroup)) {
      note_pass(eng, Clock::now());
      passes = 0;
      continue;
    }
    std::this_thread::yield();
    if ((++passes & 15u) != 0) continue;  // the clock every 16 idle passes
    auto now = Clock::now();
    if (passes == 16) idle_since = now;
    if (now - idle_since >= kPollWindow || now >= end) {
      eng->stop_polling(kGroup);
      return;
    }
  }
}

// A wait whose operation is done already: a thread that is the group's poller (it polled moments
// ago, in a wait: Engine::polled_here) runs one more pass of the data path, so that it stays the
// poller while it goes on waiting for a stream of operations. Otherwise the worker takes the data
// path back and reaps while this thread posts at submit (start_submitted): two threads taking
// turns at one endpoint and at two cores. A 64 KiB write stream at window 16 on tcp;ofi_rxm
// (bench/py_overhead.py, best of 3-6) went from 0.68-0.72 of ponte-bench's rate to 0.62-1.72
// (seven of eleven runs 1.0 or more): 94% of its waits found their operation done, did not poll,
// and the worker, seeing no poller for 200 us (the hold then), took the data path back. A thread
// that did not poll just now (it computed) does not start polling here: the worker moves the data.
// Not on shm, where waits do not poll.
//
// At most one such pass per kPassGap per thread and engine: each pass that finds one completion
// costs tcp;ofi_rxm a signal write(2) and read(2) (its CQ's wait object is signalled after every
// completion and reset by the next poll; bench/README), so a stream whose waits each found their
// write done paid both per write. Passes kPassGap apart reap several at a time and keep the
// thread the poller (polled_here: a pass within PONTE_POLLER_HOLD_US). Waits for an operation not
// yet done (poll_until_done) pass as often as they need.
constexpr auto kPassGap = std::chrono::microseconds(50);
thread_local const Engine* tl_pass_engine = nullptr;  // the engine of this thread's last pass
thread_local Clock::time_point tl_pass_at;             // ... and when it ran

void note_pass(const Engine* eng, Clock::time_point at) {
  tl_pass_engine = eng;
  tl_pass_at = at;
}

void poll_once(EngineState& es) {
  const auto now = Clock::now();
  if (tl_pass_engine == es.engine.get() && now - tl_pass_at < kPassGap) return;
  std::shared_lock lock(es.users, std::try_to_lock);  // close() holds it exclusively: nothing to do
  if (!lock.owns_lock()) return;
  Engine* eng = es.engine.get();
  if (!eng || es.closing.load(std::memory_order_relaxed) || !eng->polled_here(kGroup)) return;
  pyb::gil_scoped_release nogil;
  eng->progress(kGroup);
  note_pass(eng, now);
}

// The Python handle of an OpState.
struct Operation {
  OpState* op = nullptr;
  std::shared_ptr<EngineState> eng;
  const char* what = "operation";

  Operation(OpState* o, std::shared_ptr<EngineState> e, const char* w) : op(o), eng(std::move(e)), what(w) {}
  Operation(const Operation&) = delete;
  Operation& operator=(const Operation&) = delete;
  ~Operation() {
    if (op) eng->release(op);
  }
  bool done() const { return op->cell.done(); }
  void wait(pyb::handle timeout_s) {
    std::optional<std::chrono::nanoseconds> timeout;
    if (timeout_s.ptr() && !timeout_s.is_none()) timeout = arg_timeout(timeout_s, "timeout_s");
    if (op->cell.done()) {
      poll_once(*eng);
    } else {
      pyb::gil_scoped_release nogil;
      poll_until_done(*eng, op->cell, timeout ? Clock::now() + *timeout : Clock::time_point::max());
    }
    if (!wait_cell(op->cell, timeout)) {
      raise_timeout("%s: not done after %.3f s (still in flight)", what,
                    std::chrono::duration<double>(*timeout).count());
    }
    if (!op->status.ok()) raise_error(op->status, what);
  }
};

// ponte.Operation as a plain CPython type, not a pybind11 class: a stream of small operations
// creates, waits for and drops one per write, and pybind11's per-call dispatch (its type lookups)
// and per-instance bookkeeping (the registered-instance map) cost more than the rest of the
// binding's work for such a call. The object embeds the Operation; done() and wait() are
// vectorcall methods.
struct PyOperation {
  PyObject_HEAD
  alignas(Operation) unsigned char storage[sizeof(Operation)];
  bool live;  // storage holds an Operation (tp_alloc zeroes the object)
  Operation* get() { return live ? std::launder(reinterpret_cast<Operation*>(storage)) : nullptr; }
};

PyTypeObject* g_operation_type = nullptr;

// Runs f (which returns a new reference or nullptr with an error set), turning the binding's C++
// exceptions into Python ones: nothing may propagate through CPython's C frames.
template <typename F>
PyObject* guarded(F&& f) noexcept {
  try {
    return f();
  } catch (pyb::error_already_set& e) {
    e.restore();
  } catch (const pyb::builtin_exception& e) {
    e.set_error();
  } catch (const std::bad_alloc&) {
    PyErr_NoMemory();
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  } catch (...) {
    PyErr_SetString(PyExc_RuntimeError, "ponte: unknown C++ exception");
  }
  return nullptr;
}

Operation* operation_of(PyObject* self) {
  Operation* o = reinterpret_cast<PyOperation*>(self)->get();
  if (!o) PyErr_SetString(PyExc_ValueError, "ponte.Operation: not made by an engine call");
  return o;
}

void operation_dealloc(PyObject* self) {
  PyTypeObject* type = Py_TYPE(self);
  if (Operation* o = reinterpret_cast<PyOperation*>(self)->get()) {
    // ~Operation parks or recycles the OpState (GIL held, as here); an error it raises (none is
    // expected) must not escape a deallocator.
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    try {
      o->~Operation();
    } catch (...) {
    }
    PyErr_Restore(et, ev, tb);
  }
  type->tp_free(self);
  Py_DECREF(type);  // a heap type's instances hold a reference to it
}

PyObject* operation_done(PyObject* self, PyObject*) {
  Operation* o = operation_of(self);
  if (!o) return nullptr;
  return PyBool_FromLong(o->done());
}

// Fills out[i] for the named parameters from a vectorcall's arguments (nullptr: not given);
// TypeError for too many, unknown or repeated arguments and for a missing required one.
bool parse_args(const char* fn, const char* const* names, int n, int required, PyObject* const* args,
                Py_ssize_t nargs, PyObject* kwnames, PyObject** out) {
  for (int i = 0; i < n; i++) out[i] = nullptr;
  if (nargs > n) {
    PyErr_Format(PyExc_TypeError, "%s() takes at most %d arguments (%zd given)", fn, n, nargs);
    return false;
  }
  for (Py_ssize_t i = 0; i < nargs; i++) out[i] = args[i];
  const Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
  for (Py_ssize_t k = 0; k < nkw; k++) {
    PyObject* key = PyTuple_GET_ITEM(kwnames, k);
    int i = 0;
    while (i < n && PyUnicode_CompareWithASCIIString(key, names[i]) != 0) i++;
    if (i == n) {
      PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument '%U'", fn, key);
      return false;
    }
    if (out[i]) {
      PyErr_Format(PyExc_TypeError, "%s() got multiple values for argument '%s'", fn, names[i]);
      return false;
    }
    out[i] = args[nargs + k];
  }
  for (int i = 0; i < required; i++)
    if (!out[i]) {
      PyErr_Format(PyExc_TypeError, "%s() missing required argument '%s'", fn, names[i]);
      return false;
    }
  return true;
}

PyObject* operation_wait(PyObject* self, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  static const char* const names[] = {"timeout_s"};
  PyObject* timeout;
  if (!parse_args("wait", names, 1, 0, args, nargs, kwnames, &timeout)) return nullptr;
  Operation* o = operation_of(self);
  if (!o) return nullptr;
  return guarded([&]() -> PyObject* {
    o->wait(pyb::handle(timeout));
    Py_RETURN_NONE;
  });
}

PyObject* operation_repr(PyObject* self) {
  Operation* o = reinterpret_cast<PyOperation*>(self)->get();
  if (!o) return PyUnicode_FromString("<ponte.Operation (empty)>");
  return PyUnicode_FromFormat("<ponte.Operation %s %s>", o->what, o->done() ? "done" : "in flight");
}

PyMethodDef g_operation_methods[] = {
    {"done", operation_done, METH_NOARGS, "Whether the operation has ended (successfully or not); never blocks."},
    {"wait", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(operation_wait)),
     METH_FASTCALL | METH_KEYWORDS,
     "wait(timeout_s=None)\n--\n\nWaits (with the GIL released) until the operation ends. Raises "
     "``ponte.Error`` if it failed, ``TimeoutError`` if ``timeout_s`` passed first (the operation is then "
     "still in flight). ``None`` waits until the engine ends it."},
    {nullptr, nullptr, 0, nullptr}};

// Makes ponte.Operation (once, by bind_engine) and adds it to the module.
void add_operation_type(pyb::module_& m) {
  static PyType_Slot slots[] = {
      {Py_tp_dealloc, reinterpret_cast<void*>(operation_dealloc)},
      {Py_tp_repr, reinterpret_cast<void*>(operation_repr)},
      {Py_tp_methods, g_operation_methods},
      {Py_tp_doc, const_cast<char*>("One asynchronous engine operation. It ends exactly once, with success or "
                                    "an error; the engine ends every operation within ``PONTE_TIMEOUT_MS``.")},
      {0, nullptr}};
  static PyType_Spec spec = {"ponte._ponte.Operation", static_cast<int>(sizeof(PyOperation)), 0,
                             Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION, slots};
  PyObject* type = PyType_FromSpec(&spec);
  if (!type) throw pyb::error_already_set();
  g_operation_type = reinterpret_cast<PyTypeObject*>(type);
  m.add_object("Operation", pyb::reinterpret_steal<pyb::object>(type));
  Py_INCREF(type);  // g_operation_type's own reference, kept for the process's life
}

// A new ponte.Operation owning op.
pyb::object make_operation(OpState* op, std::shared_ptr<EngineState> es, const char* what) {
  PyObject* obj = g_operation_type->tp_alloc(g_operation_type, 0);
  if (!obj) {
    es->release(op);  // not wrapped: the engine still fires op's cell
    throw pyb::error_already_set();
  }
  auto* po = reinterpret_cast<PyOperation*>(obj);
  new (po->storage) Operation(op, std::move(es), what);
  po->live = true;
  return pyb::reinterpret_steal<pyb::object>(obj);
}

// An operation that moves more than this has its posting (start_submitted) run with the GIL
// released: posting 64 MiB on tcp;ofi_rxm took 0.4-4.4 ms of the call, and other Python threads
// stood still meanwhile. Smaller ones post with the GIL held: a 64 KiB write posts in microseconds,
// and a write stream pays for a release and re-take per call.
constexpr size_t kPostWithoutGilBytes = 256 << 10;

// Submits with f(notify) and wraps the op; retries back-pressure (kAgain) with the GIL released.
// nbytes: what the operation moves (0 for an immediate or a counter), for kPostWithoutGilBytes.
template <typename F>
pyb::object submit(const std::shared_ptr<EngineState>& es, std::unique_ptr<OpState> op,
                                  const char* what, F&& f, size_t nbytes = 0) {
  Engine& eng = es->live(what);
  if (op->region) {
    op->inflight = &op->region->inflight;
    op->inflight->fetch_add(1, std::memory_order_relaxed);
  }
  Status st = f(eng, op->notify());
  if (st.code() == Code::kAgain) {
    auto deadline = Clock::now() + std::chrono::milliseconds(es->timeout_ms);
    pyb::gil_scoped_release nogil;
    std::shared_lock lock(es->users);
    auto nap = std::chrono::microseconds(1);
    while (st.code() == Code::kAgain && es->engine && !es->closing.load() && Clock::now() < deadline) {
      std::this_thread::sleep_for(nap);
      nap = std::min(nap * 2, std::chrono::microseconds(1000));
      st = f(*es->engine, op->notify());
    }
    if (st.code() == Code::kAgain && (!es->engine || es->closing.load())) st = Status(Code::kCancelled, "the engine is closed");
  }
  if (!st.ok()) {
    if (op->inflight) op->inflight->fetch_sub(1, std::memory_order_relaxed);
    raise_refusal(st, what);
  }
  // A thread that waited moments ago is still the group's poller: its submission starts at its
  // next progress() call, not with a wake-up of the worker. Post it now (never blocks, reaps
  // nothing; a failure's completion goes to a DoneCell, no GIL needed), so that it is on the wire
  // while Python computes.
  if (nbytes > kPostWithoutGilBytes) {
    pyb::gil_scoped_release nogil;
    std::shared_lock lock(es->users, std::try_to_lock);  // close() holds it: it ends the op instead
    if (lock.owns_lock() && es->engine && !es->closing.load()) es->engine->start_submitted(kGroup);
  } else if (es->engine) {
    es->engine->start_submitted(kGroup);
  }
  if (!es->orphans.empty() && es->orphans.size() >= es->sweep_at) es->sweep();
  return make_operation(op.release(), es, what);
}

RemoteRegion decode_remote(pyb::handle obj, const char* name) {
  Py_buffer hold{};
  ByteView b = arg_bytes(obj, name, &hold);
  auto r = RemoteRegion::decode(std::span<const uint8_t>(b.data, b.len));
  if (hold.obj) PyBuffer_Release(&hold);
  if (!r.ok()) raise_value("%s: not a region descriptor (%s)", name, r.status().message());
  return *r;
}

RemoteRegion EngineState::remote(pyb::handle obj, const char* name) {
  if (remote_obj && obj.ptr() == remote_obj.ptr()) return remote_val;
  RemoteRegion r = decode_remote(obj, name);
  if (PyBytes_CheckExact(obj.ptr())) {
    remote_obj = pyb::reinterpret_borrow<pyb::object>(obj);
    remote_val = r;
  }
  return r;
}

const std::shared_ptr<RegionState>* region_holder(PyObject* obj);

std::shared_ptr<RegionState> arg_region(pyb::handle obj, const char* name) {
  if (const std::shared_ptr<RegionState>* h = region_holder(obj.ptr())) return *h;
  if (!pyb::isinstance<RegionState>(obj))
    raise_type("%s must be a ponte.Region (register the memory first with Engine.register), not %s", name,
               Py_TYPE(obj.ptr())->tp_name);
  return obj.cast<std::shared_ptr<RegionState>>();
}

void check_range(size_t off, size_t len, size_t total, const char* off_name, const char* what) {
  if (off > total || len > total - off)
    raise_value("%s: [%zu, +%zu) is outside the %zu-byte %s", off_name, off, len, total, what);
}

// A list of page indexes: a sequence of ints, or a contiguous integer array (numpy).
std::vector<uint32_t> arg_pages(pyb::handle obj, const char* name) {
  std::vector<uint32_t> out;
  if (PyObject_CheckBuffer(obj.ptr()) && !PyBytes_Check(obj.ptr()) && !PyByteArray_Check(obj.ptr())) {
    Py_buffer v{};
    if (PyObject_GetBuffer(obj.ptr(), &v, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) == 0) {
      std::string f = v.format ? v.format : "B";
      if (!f.empty() && (f[0] == '<' || f[0] == '=' || f[0] == '@')) f = f.substr(1);
      bool is_signed = f == "i" || f == "l" || f == "q" || f == "h" || f == "b";
      bool is_int = is_signed || f == "I" || f == "L" || f == "Q" || f == "H" || f == "B";
      if (!is_int || v.ndim > 1) {
        PyBuffer_Release(&v);
        raise_type("%s must be a 1-D array of integers (got format '%s')", name, f.c_str());
      }
      size_t n = static_cast<size_t>(v.len / v.itemsize);
      out.resize(n);
      auto* p = static_cast<const uint8_t*>(v.buf);
      for (size_t i = 0; i < n; i++) {
        int64_t x = 0;
        uint64_t u = 0;
        switch (v.itemsize) {
          case 1: x = is_signed ? int64_t(reinterpret_cast<const int8_t*>(p)[i]) : int64_t(p[i]); break;
          case 2: x = is_signed ? int64_t(reinterpret_cast<const int16_t*>(p)[i]) : int64_t(reinterpret_cast<const uint16_t*>(p)[i]); break;
          case 4: x = is_signed ? int64_t(reinterpret_cast<const int32_t*>(p)[i]) : int64_t(reinterpret_cast<const uint32_t*>(p)[i]); break;
          case 8:
            u = reinterpret_cast<const uint64_t*>(p)[i];
            x = is_signed ? static_cast<int64_t>(u) : (u > 0xffffffffull ? -1 : static_cast<int64_t>(u));
            break;
          default: x = -1;
        }
        if (x < 0 || x > 0xffffffffll) {
          PyBuffer_Release(&v);
          raise_value("%s[%zu] is not a page index in [0, 2^32)", name, i);
        }
        out[i] = static_cast<uint32_t>(x);
      }
      PyBuffer_Release(&v);
      return out;
    }
    PyErr_Clear();
  }
  pyb::object seq = pyb::reinterpret_steal<pyb::object>(PySequence_Fast(obj.ptr(), ""));
  if (!seq) {
    PyErr_Clear();
    raise_type("%s must be a sequence of page indexes, not %s", name, Py_TYPE(obj.ptr())->tp_name);
  }
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq.ptr());
  out.resize(static_cast<size_t>(n));
  std::string item_name;
  for (Py_ssize_t i = 0; i < n; i++) {
    pyb::handle it = PySequence_Fast_GET_ITEM(seq.ptr(), i);
    if (PyLong_CheckExact(it.ptr())) {
      int overflow = 0;
      long long x = PyLong_AsLongLongAndOverflow(it.ptr(), &overflow);
      if (overflow == 0 && x >= 0 && x <= 0xffffffffll) {
        out[static_cast<size_t>(i)] = static_cast<uint32_t>(x);
        continue;
      }
    }
    item_name = std::string(name) + "[" + std::to_string(i) + "]";
    out[static_cast<size_t>(i)] = arg_u32(it, item_name.c_str());
  }
  return out;
}

std::shared_ptr<EngineState> make_engine(const pyb::kwargs& kw) {
  EngineOptions opts;
  opts.config = engine_config(kw);
  auto es = std::make_shared<EngineState>();
  es->timeout_ms = opts.config.timeout_ms;
  Result<std::unique_ptr<Engine>> r = Status(Code::kInternal, "not created");
  {
    pyb::gil_scoped_release nogil;
    r = Engine::create(opts);
  }
  if (!r.ok()) raise_error(r.status(), "Engine");
  es->engine = std::move(*r);
  std::lock_guard lock(g_engines_mu);
  std::erase_if(g_engines, [](const std::weak_ptr<EngineState>& w) { return w.expired(); });
  g_engines.push_back(es);
  return es;
}

void close_all() {
  std::vector<std::shared_ptr<EngineState>> live;
  {
    std::lock_guard lock(g_engines_mu);
    for (auto& w : g_engines)
      if (auto s = w.lock()) live.push_back(s);
    g_engines.clear();
  }
  for (auto& s : live) s->close();
}



// ---- Engine.write as a vectorcall method (see PyOperation for why): the write stream is the
// call Python makes most often. Engine and Region stay pybind11 classes; their holders are read
// through pybind11's instance layout with type_info looked up once.
const pyb::detail::type_info* g_engine_tinfo = nullptr;
const pyb::detail::type_info* g_region_tinfo = nullptr;

template <typename T>
const std::shared_ptr<T>* holder_of(PyObject* obj, const pyb::detail::type_info* ti) {
  auto vh = constructed_instance(obj, ti);
  return vh.inst ? &vh.holder<std::shared_ptr<T>>() : nullptr;
}

pyb::object engine_write(const std::shared_ptr<EngineState>& s, pyb::handle peer, pyb::handle region,
                         pyb::handle offset, pyb::handle nbytes, pyb::handle remote, pyb::handle remote_offset,
                         pyb::handle imm) {
  auto op = s->new_op();
  op->region = arg_region(region, "region");
  uint32_t p = arg_u32(peer, "peer");
  size_t off = arg_size(offset, "offset"), len = arg_size(nbytes, "nbytes");
  size_t roff = arg_size(remote_offset, "remote_offset");
  auto imm_v = imm.ptr() ? arg_opt_u32(imm, "imm") : std::nullopt;
  const MemoryRegion& mr = op->region->live("region");
  check_range(off, len, mr.len, "offset", "local region");
  RemoteRegion dst = s->remote(remote, "remote");
  check_range(roff, len, dst.len, "remote_offset", "remote region");
  uint32_t iv = imm_v.value_or(0);
  const uint32_t* ip = imm_v ? &iv : nullptr;
  return submit(s, std::move(op), "write", [&](Engine& e, Notify n) {
    return e.write(kGroup, p, LocalSlice{&mr, off, len}, dst, roff, ip, n);
  }, len);
}

const std::shared_ptr<RegionState>* region_holder(PyObject* obj) { return holder_of<RegionState>(obj, g_region_tinfo); }

PyObject* engine_write_fast(PyObject* self, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  static const char* const names[] = {"peer", "region", "offset", "nbytes", "remote", "remote_offset", "imm"};
  PyObject* a[7];
  if (!parse_args("write", names, 7, 6, args, nargs, kwnames, a)) return nullptr;
  const std::shared_ptr<EngineState>* s = holder_of<EngineState>(self, g_engine_tinfo);
  if (!s || !*s) {
    PyErr_SetString(PyExc_TypeError, "write() needs a constructed ponte.Engine");
    return nullptr;
  }
  return guarded([&]() -> PyObject* {
    return engine_write(*s, a[0], a[1], a[2], a[3], a[4], a[5], a[6]).release().ptr();
  });
}

PyMethodDef g_engine_write_def = {
    "write", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(engine_write_fast)),
    METH_FASTCALL | METH_KEYWORDS,
    "write(peer, region, offset, nbytes, remote, remote_offset, imm=None)\n--\n\n"
    "One-sided write of ``nbytes`` at ``offset`` of ``region`` to ``remote`` (a peer's descriptor bytes) at "
    "``remote_offset``. With ``imm`` (a u32) the target's counters see it "
    "``imms_per_write(peer, nbytes)`` times when all the data has landed. Returns an Operation."};

}  // namespace

Config engine_config(const pyb::kwargs& kw) {
  Config c = global_config();
  for (auto item : kw) {
    std::string k = pyb::str(item.first);
    pyb::handle v = item.second;
    if (k == "backend") {
      std::string b = pyb::str(v);
      if (b == "auto") c.backend = BackendChoice::kAuto;
      else if (b == "fabric") c.backend = BackendChoice::kFabric;
      else if (b == "verbs") c.backend = BackendChoice::kVerbs;
      else raise_value("backend must be 'auto', 'fabric' or 'verbs', not '%s'", b.c_str());
    } else if (k == "provider") {
      if (!PyUnicode_Check(v.ptr())) raise_type("provider must be a str such as 'tcp;ofi_rxm' or 'shm'");
      c.fabric_provider = pyb::str(v);
      if (c.backend == BackendChoice::kAuto) c.backend = BackendChoice::kFabric;
    } else if (k == "nics") {
      c.nics_per_group = arg_int(v, "nics", 0, kMaxNicsPerGroup);
    } else if (k == "timeout_ms") {
      c.timeout_ms = arg_u32(v, "timeout_ms");
      if (c.timeout_ms == 0) raise_value("timeout_ms must be > 0");
    } else if (k == "stripe_min") {
      c.stripe_min_bytes = arg_size(v, "stripe_min");
    } else if (k == "spin_us") {
      c.spin_us = arg_u32(v, "spin_us");
    } else if (k == "ctrl_addr") {
      c.ctrl_addr = pyb::str(v);
    } else if (k == "idle_wake") {
      if (!PyBool_Check(v.ptr())) raise_type("idle_wake must be a bool");
      c.idle_wake_on_data = v.ptr() == Py_True;
    } else if (k == "progress_cores") {
      // As PONTE_PROGRESS_CORES (group i's worker on entry i mod n): this engine's one group takes the
      // first; an empty sequence leaves the worker unpinned.
      if (PyUnicode_Check(v.ptr()) || PyBytes_Check(v.ptr()) || !PySequence_Check(v.ptr()))
        raise_type("progress_cores must be a sequence of core numbers, e.g. [2] or (2, 3)");
      c.progress_cores.clear();
      for (pyb::handle core : pyb::reinterpret_borrow<pyb::sequence>(v))
        c.progress_cores.push_back(arg_int(core, "progress_cores[i]", 0, CPU_SETSIZE - 1));
      // Engine.create would refuse it too, as a ponte.Error: a bad argument is a ValueError.
      if (Status st = check_cores_usable(c.progress_cores, "progress_cores"); !st.ok()) raise_value("%s", st.message());
    } else {
      raise_type("Engine() got an unexpected keyword argument '%s' (known: backend, provider, nics, timeout_ms, "
                 "stripe_min, spin_us, ctrl_addr, idle_wake, progress_cores)", k.c_str());
    }
  }
  return c;
}


void bind_engine(pyb::module_& m) {
  namespace py = pybind11;
  using EnginePtr = std::shared_ptr<EngineState>;

  add_operation_type(m);

  m.def(
      "wait_all",
      [](py::iterable ops, py::handle timeout_s) {
        auto timeout = arg_timeout(timeout_s, "timeout_s");
        auto end = timeout ? Clock::now() + *timeout : Clock::time_point::max();
        std::vector<Operation*> list;
        std::vector<py::object> keep;
        for (py::handle h : ops) {
          Operation* o = PyObject_TypeCheck(h.ptr(), g_operation_type) ? reinterpret_cast<PyOperation*>(h.ptr())->get() : nullptr;
          if (!o) raise_type("ops must hold ponte.Operation objects, not %s", Py_TYPE(h.ptr())->tp_name);
          keep.push_back(py::reinterpret_borrow<py::object>(h));
          list.push_back(o);
        }
        const Operation* failed = nullptr;
        for (Operation* o : list) {
          if (!o->op->cell.done()) {
            py::gil_scoped_release nogil;
            poll_until_done(*o->eng, o->op->cell, end);
          }
          std::optional<std::chrono::nanoseconds> left;
          if (timeout) left = std::max(std::chrono::nanoseconds(0), std::chrono::nanoseconds(end - Clock::now()));
          if (!wait_cell(o->op->cell, left)) {
            raise_timeout("wait_all: %s not done after %.3f s (still in flight)", o->what,
                          std::chrono::duration<double>(*timeout).count());
          }
          if (!failed && !o->op->status.ok()) failed = o;
        }
        if (failed) raise_error(failed->op->status, failed->what);
      },
      py::arg("ops"), py::arg("timeout_s") = py::none(),
      "Waits for every operation in ``ops`` (GIL released); raises the first failure as ``ponte.Error`` "
      "once all have ended, or ``TimeoutError``.");

  py::class_<RegionState, std::shared_ptr<RegionState>>(
      m, "Region",
      "Caller memory registered with an engine (``Engine.register``). Holds the registered object alive "
      "until closed; closing waits for operations still using it, then deregisters it.")
      .def("descriptor", [](const RegionState& r) { return r.descriptor; },
           "The bytes a peer passes as ``remote`` to write into or read from this memory (versioned).")
      .def_property_readonly("nbytes", [](const RegionState& r) { return r.mr.len; }, "Size of the region in bytes.")
      .def_property_readonly("obj", [](const RegionState& r) { return r.mem.object() ? r.mem.object() : py::none(); },
                             "The registered object (None once closed).")
      .def_property_readonly("closed", [](const RegionState& r) { return r.closed; }, "Whether close() ran.")
      .def("close", &RegionState::close,
           "Waits for operations using the region to end, deregisters it and releases the object.")
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__", [](RegionState& r, py::args) { r.close(); })
      .def("__len__", [](const RegionState& r) { return r.mr.len; })
      .def("__repr__", [](const RegionState& r) {
        return "<ponte.Region " + std::to_string(r.mr.len) + " bytes" + (r.closed ? " closed>" : ">");
      });

  py::class_<EngineState, EnginePtr>(
      m, "Engine",
      "ponte's RDMA engine (one host-memory NIC group). Configured by the PONTE_* environment variables; "
      "keyword overrides: backend ('auto'|'fabric'|'verbs'), provider (libfabric provider, e.g. 'tcp;ofi_rxm', "
      "'shm'), nics, timeout_ms, stripe_min, spin_us, ctrl_addr, idle_wake (PONTE_IDLE_WAKE: an idle engine "
      "wakes for data arriving; for an engine written to while it waits for nothing), progress_cores "
      "(PONTE_PROGRESS_CORES: the worker runs on the first, e.g. [2]; [] unpinned; on shm keep the threads "
      "that submit and wait off that core: README, Python). An engine belongs to the "
      "process that created it: in a fork() child its calls raise ponte.Error (UNAVAILABLE); create one there.")
      .def(py::init([](py::kwargs kw) { return make_engine(kw); }))
      .def_property_readonly("backend", [](EngineState& s) { return std::string(backend_name(s.live("backend").backend())); },
                             "'fabric' or 'verbs'.")
      .def_property_readonly("nics", [](EngineState& s) { return s.live("nics").nics_in_group(kGroup); },
                             "NICs in the engine's group.")
      .def_property_readonly("timeout_ms", [](const EngineState& s) { return s.timeout_ms; },
                             "The engine's operation timeout (PONTE_TIMEOUT_MS or the keyword).")
      .def_property_readonly("closed", [](const EngineState& s) { return !s.engine || s.closing.load(); },
                             "Whether close() ran.")
      .def("address", [](EngineState& s) {
        auto a = s.live("address").address(kGroup);
        return py::bytes(reinterpret_cast<const char*>(a.data()), a.size());
      }, "This engine's address: versioned bytes a peer passes to connect().")
      .def("connect", [](EngineState& s, py::handle addr) {
        Py_buffer hold{};
        ByteView b = arg_bytes(addr, "addr", &hold);
        auto r = s.live("connect").connect(kGroup, std::span<const uint8_t>(b.data, b.len));
        if (hold.obj) PyBuffer_Release(&hold);
        if (!r.ok()) raise_refusal(r.status(), "addr");
        return *r;
      }, py::arg("addr"),
           "Starts connecting to the engine at ``addr`` and returns its peer id at once; operations to it wait "
           "for the handshake.")
      .def("peers", [](EngineState& s) {
        py::list out;
        for (PeerId p : s.live("peers").peers(kGroup)) out.append(p);
        return out;
      },
           "Peer ids of engines that connected to this one (in arrival order).")
      .def("peer_ready", [](EngineState& s, py::handle p) { return s.live("peer_ready").peer_ready(kGroup, arg_u32(p, "peer")); },
           py::arg("peer"), "Whether the handshake with ``peer`` has completed.")
      .def("peer_dead", [](EngineState& s, py::handle p) { return s.live("peer_dead").peer_dead(kGroup, arg_u32(p, "peer")); },
           py::arg("peer"), "Whether nothing more will come from ``peer`` (it died or closed).")
      .def("register", [](const EnginePtr& s, py::handle buf) {
        s->live("register");
        auto r = std::make_shared<RegionState>();
        r->eng = s;
        r->mem.acquire_registered(buf, "buf");
        if (r->mem.size() == 0) raise_value("buf: empty (0 bytes); nothing to register");
        Result<MemoryRegion> mr = Status(Code::kInternal, "not registered");
        {
          py::gil_scoped_release nogil;
          std::shared_lock lock(s->users);
          if (s->engine && !s->closing.load()) mr = s->engine->register_memory(kGroup, r->mem.data(), r->mem.size());
          else mr = Status(Code::kCancelled, "the engine is closed");
        }
        if (!mr.ok()) raise_refusal(mr.status(), "register");
        r->mr = std::move(*mr);
        auto d = r->mr.remote().encode();
        r->descriptor = py::bytes(reinterpret_cast<const char*>(d.data()), d.size());
        return r;
      }, py::arg("buf"),
           "Registers ``buf`` (a writable contiguous object with the buffer protocol, such as a numpy array or "
           "bytearray, or a contiguous CPU torch tensor that is not a lazily negated or conjugated view) on "
           "every NIC of the group. The Region keeps ``buf`` alive; do not resize it while registered.")
      .def("read", [](const EnginePtr& s, py::handle peer, py::handle region, py::handle offset, py::handle nbytes,
                      py::handle remote, py::handle remote_offset) {
        auto op = s->new_op();
        op->region = arg_region(region, "region");
        uint32_t p = arg_u32(peer, "peer");
        size_t off = arg_size(offset, "offset"), len = arg_size(nbytes, "nbytes");
        size_t roff = arg_size(remote_offset, "remote_offset");
        const MemoryRegion& mr = op->region->live("region");
        check_range(off, len, mr.len, "offset", "local region");
        RemoteRegion src = s->remote(remote, "remote");
        check_range(roff, len, src.len, "remote_offset", "remote region");
        return submit(s, std::move(op), "read", [&](Engine& e, Notify n) {
          return e.read(kGroup, p, LocalSlice{&mr, off, len}, src, roff, n);
        }, len);
      }, py::arg("peer"), py::arg("region"), py::arg("offset"), py::arg("nbytes"), py::arg("remote"),
           py::arg("remote_offset"),
           "RDMA read: ``nbytes`` of ``remote`` at ``remote_offset`` into ``region`` at ``offset``. Returns an "
           "Operation.")
      .def("paged_write", [](const EnginePtr& s, py::handle peer, py::handle region, py::handle src_pages,
                             py::handle remote, py::handle dst_pages, py::handle page_size, py::handle imm) {
        auto op = s->new_op();
        op->region = arg_region(region, "region");
        uint32_t p = arg_u32(peer, "peer");
        size_t ps = arg_size(page_size, "page_size");
        if (ps == 0) raise_value("page_size must be > 0");
        auto imm_v = arg_opt_u32(imm, "imm");
        op->src_pages = arg_pages(src_pages, "src_pages");
        op->dst_pages = arg_pages(dst_pages, "dst_pages");
        if (op->src_pages.size() != op->dst_pages.size())
          raise_value("dst_pages: %zu entries but src_pages has %zu", op->dst_pages.size(), op->src_pages.size());
        const MemoryRegion& mr = op->region->live("region");
        RemoteRegion dst = s->remote(remote, "remote");
        for (size_t i = 0; i < op->src_pages.size(); i++) {
          if (static_cast<size_t>(op->src_pages[i]) + 1 > mr.len / ps)
            raise_value("src_pages[%zu] = %u: page outside the %zu-byte region", i, op->src_pages[i], mr.len);
          if (static_cast<size_t>(op->dst_pages[i]) + 1 > dst.len / ps)
            raise_value("dst_pages[%zu] = %u: page outside the %llu-byte remote region", i, op->dst_pages[i],
                        static_cast<unsigned long long>(dst.len));
        }
        uint32_t iv = imm_v.value_or(0);
        const uint32_t* ip = imm_v ? &iv : nullptr;
        OpState* raw = op.get();
        return submit(s, std::move(op), "paged_write", [&](Engine& e, Notify n) {
          return e.paged_write(kGroup, p, mr, raw->src_pages, dst, raw->dst_pages, ps, ip, n);
        }, raw->src_pages.size() * ps);
      }, py::arg("peer"), py::arg("region"), py::arg("src_pages"), py::arg("remote"), py::arg("dst_pages"),
           py::arg("page_size"), py::arg("imm") = py::none(),
           "Writes page ``src_pages[i]`` of ``region`` (byte ``src_pages[i] * page_size``) to page ``dst_pages[i]`` "
           "of ``remote``, one write per page; with ``imm`` each page carries it (the target counts "
           "``len(src_pages)``). Page lists: sequences of ints or 1-D integer numpy arrays. Returns an Operation.")
      .def("scatter", [](const EnginePtr& s, py::handle region, py::iterable targets, py::handle imm) {
        auto op = s->new_op();
        op->region = arg_region(region, "region");
        auto imm_v = arg_opt_u32(imm, "imm");
        const MemoryRegion& mr = op->region->live("region");
        std::vector<std::tuple<uint32_t, size_t, size_t, size_t>> spec;
        size_t i = 0;
        for (py::handle t : targets) {
          std::string nm = "targets[" + std::to_string(i) + "]";
          if (!PyTuple_Check(t.ptr()) && !PyList_Check(t.ptr()))
            raise_type("%s must be a tuple (peer, src_offset, nbytes, remote, remote_offset)", nm.c_str());
          py::sequence tup = py::reinterpret_borrow<py::sequence>(t);
          if (tup.size() != 5) raise_value("%s must have 5 items (peer, src_offset, nbytes, remote, remote_offset)", nm.c_str());
          uint32_t p = arg_u32(tup[0], (nm + ".peer").c_str());
          size_t so = arg_size(tup[1], (nm + ".src_offset").c_str());
          size_t len = arg_size(tup[2], (nm + ".nbytes").c_str());
          op->remotes.push_back(decode_remote(tup[3], (nm + ".remote").c_str()));
          size_t ro = arg_size(tup[4], (nm + ".remote_offset").c_str());
          check_range(so, len, mr.len, (nm + ".src_offset").c_str(), "local region");
          check_range(ro, len, op->remotes.back().len, (nm + ".remote_offset").c_str(), "remote region");
          spec.emplace_back(p, so, len, ro);
          i++;
        }
        op->targets.resize(spec.size());
        for (size_t k = 0; k < spec.size(); k++) {
          auto [p, so, len, ro] = spec[k];
          op->targets[k] = ScatterTarget{p, so, len, &op->remotes[k], ro};
        }
        uint32_t iv = imm_v.value_or(0);
        const uint32_t* ip = imm_v ? &iv : nullptr;
        OpState* raw = op.get();
        size_t total = 0;
        for (const auto& t : spec) total += std::get<2>(t);
        return submit(s, std::move(op), "scatter", [&](Engine& e, Notify n) {
          return e.scatter(kGroup, mr, raw->targets, ip, n);
        }, total);
      }, py::arg("region"), py::arg("targets"), py::arg("imm") = py::none(),
           "One source region to many peers: ``targets`` is a sequence of ``(peer, src_offset, nbytes, remote, "
           "remote_offset)``, one write each, each carrying ``imm`` when given (the target counts "
           "``imms_per_write(peer, nbytes)`` per write). Returns one Operation for all.")
      .def("imm", [](const EnginePtr& s, py::handle peer, py::handle value) {
        uint32_t p = arg_u32(peer, "peer");
        uint32_t v = arg_u32(value, "value");
        return submit(s, s->new_op(), "imm", [&](Engine& e, Notify n) { return e.imm(kGroup, p, v, n); });
      }, py::arg("peer"), py::arg("value"), "An immediate alone (a zero-byte write carrying ``value``). Returns an Operation.")
      .def("barrier", [](const EnginePtr& s, py::iterable peers, py::handle value) {
        auto op = s->new_op();
        size_t i = 0;
        for (py::handle p : peers) op->peers.push_back(arg_u32(p, ("peers[" + std::to_string(i++) + "]").c_str()));
        uint32_t v = arg_u32(value, "value");
        OpState* raw = op.get();
        return submit(s, std::move(op), "barrier", [&](Engine& e, Notify n) { return e.barrier(kGroup, raw->peers, v, n); });
      }, py::arg("peers"), py::arg("value"),
           "The immediate ``value`` to every peer listed; the Operation ends when all were delivered.")
      .def("expect_imm", [](const EnginePtr& s, py::handle value, py::handle count, py::handle peer, py::handle timeout_s) {
        uint32_t v = arg_u32(value, "value");
        uint32_t c = arg_u32(count, "count");
        if (c == 0) raise_value("count must be > 0");
        PeerId from = peer.is_none() ? kAnyPeer : arg_u32(peer, "peer");
        auto t = arg_timeout(timeout_s, "timeout_s");
        uint32_t tms = 0;
        if (t) tms = static_cast<uint32_t>(std::clamp<int64_t>((t->count() + 999999) / 1000000, 1, 0xffffffffll));
        return submit(s, s->new_op(), "expect_imm", [&](Engine& e, Notify n) {
          return e.expect_imm(kGroup, v, c, from, n, tms);
        });
      }, py::arg("value"), py::arg("count"), py::arg("peer") = py::none(), py::arg("timeout_s") = py::none(),
           "An Operation that ends when ``count`` immediates carrying ``value`` have arrived (those that arrived "
           "before the call count). With ``peer`` it fails when that peer dies; it fails with TIMEOUT after "
           "``timeout_s`` (default: the engine's timeout). Do not mix with imm_arrived/consume_imm for a value.")
      .def("imms_per_write", [](EngineState& s, py::handle peer, py::handle nbytes) {
        return s.live("imms_per_write").imms_per_write(kGroup, arg_u32(peer, "peer"), arg_size(nbytes, "nbytes"));
      }, py::arg("peer"), py::arg("nbytes"),
           "How many immediates one write of ``nbytes`` to ``peer`` produces at the target (striping). Known once "
           "the peer's address is (after connect, or when it connected to us).")
      .def("imm_arrived", [](EngineState& s, py::handle value) {
        return s.live("imm_arrived").imm_arrived(kGroup, arg_u32(value, "value"));
      }, py::arg("value"), "Poller view: immediates carrying ``value`` that arrived and are not consumed.")
      .def("consume_imm", [](EngineState& s, py::handle value, py::handle n) {
        s.live("consume_imm").consume_imm(kGroup, arg_u32(value, "value"), arg_u32(n, "n"));
      }, py::arg("value"), py::arg("n"), "Poller view: consumes ``n`` immediates carrying ``value``.")
      .def("close", &EngineState::close,
           "Orderly shutdown: posted operations finish (or end CANCELLED), peers are told, registrations are "
           "closed. Later calls raise ponte.Error(CANCELLED).")
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__", [](EngineState& s, py::args) { s.close(); })
      .def("__repr__", [](const EngineState& s) {
        if (!s.engine || s.closing.load()) return std::string("<ponte.Engine closed>");
        return std::string("<ponte.Engine ") + backend_name(s.engine->backend()) + ", " +
               std::to_string(s.engine->nics_in_group(kGroup)) + " NIC(s)>";
      });

  // Engine.write: the vectorcall method above in place of a pybind11 one.
  g_engine_tinfo = py::detail::get_type_info(typeid(EngineState));
  g_region_tinfo = py::detail::get_type_info(typeid(RegionState));
  py::object engine_cls = m.attr("Engine");
  PyObject* descr = PyDescr_NewMethod(reinterpret_cast<PyTypeObject*>(engine_cls.ptr()), &g_engine_write_def);
  if (!descr || PyObject_SetAttrString(engine_cls.ptr(), "write", descr) != 0) {
    Py_XDECREF(descr);
    throw py::error_already_set();
  }
  Py_DECREF(descr);

  m.def("_close_all", &close_all, "Closes every open engine (run at interpreter exit).");
}

}  // namespace ponte::py
