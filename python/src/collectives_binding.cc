// The collectives half of the `ponte` module (see collectives_binding.h). It adds no transport:
// every call converts arguments, releases the GIL and calls collectives/ (Communicator, EpBuffer).
// Those classes are driven by one thread at a time: a second Python thread entering the same
// Communicator (or one of its EpBuffers) while a call runs gets a RuntimeError, not a race.
#include "python/src/collectives_binding.h"

#include <pybind11/numpy.h>

#include <cstring>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "collectives/communicator.h"
#include "collectives/ep_buffer.h"
#include "python/src/engine_binding.h"
#include "python/src/py_common.h"

namespace ponte::py {

namespace {

namespace py = pybind11;

struct EpState;

struct CommState {
  std::unique_ptr<Communicator> comm;
  std::mutex busy;  // held (try_lock, with the GIL) for the length of a call
  int rank = 0, world = 1;
  std::vector<std::weak_ptr<EpState>> eps;

  ~CommState() {
    try {
      close();
    } catch (...) {
    }
  }
  Communicator& live(const char* what) {
    if (!comm) raise_error(Status(Code::kCancelled, "the communicator is closed"), what);
    return *comm;
  }
  void close();
};

// One call at a time per communicator.
class Busy {
 public:
  Busy(CommState& c, const char* what) : lock_(c.busy, std::try_to_lock) {
    if (!lock_.owns_lock())
      throw std::runtime_error(std::string(what) + ": the communicator is in use by another thread (one thread drives a "
                               "Communicator and its EpBuffers)");
  }

 private:
  std::unique_lock<std::mutex> lock_;
};

struct EpState {
  std::shared_ptr<CommState> comm;
  std::unique_ptr<EpBuffer> ep;
  EpConfig cfg;
  int L = 0, W = 1;
  size_t rows_per_expert = 0;  // W * max_tokens

  ~EpState() { release(); }
  void release() {
    if (!ep) return;
    py::gil_scoped_release nogil;
    ep.reset();
  }
  EpBuffer& live(const char* what) {
    if (!ep) raise_error(Status(Code::kCancelled, "the EpBuffer (or its communicator) is closed"), what);
    return *ep;
  }
  const char* dtype_str() const { return cfg.dtype == DType::kFloat32 ? "float32" : "bfloat16"; }
};

void CommState::close() {
  if (!comm) return;
  std::unique_lock lock(busy, std::try_to_lock);
  if (!lock.owns_lock()) throw std::runtime_error("Communicator.close: a call is still running in another thread");
  for (auto& w : eps)
    if (auto e = w.lock()) e->release();  // EpBuffers go before their communicator
  eps.clear();
  py::gil_scoped_release nogil;
  comm.reset();
}

struct HandleState {
  std::shared_ptr<EpState> ep;
  EpHandle h;
  bool torch = false;  // the dispatch's x was a torch tensor: outputs are tensors
  int tokens = 0;
  bool received = false;
  py::object src_info, layout_range;  // copies, made on first access
};

// CommunicatorOptions::interrupted for Python: runs the interpreter's pending signal handlers
// (the GIL taken for it; the waiting call released it). Ctrl-C's handler raises KeyboardInterrupt:
// the exception stays pending, the call ends with kCancelled, and raise_error raises it.
bool python_interrupted(void*) {
  PyGILState_STATE gil = PyGILState_Ensure();
  const bool raised = PyErr_CheckSignals() != 0;
  PyGILState_Release(gil);
  return raised;
}

// Status of a collective call: bad input is a ValueError naming the call, the rest ponte.Error.
void check(const Status& st, const char* what) {
  if (!st.ok()) raise_refusal(st, what);
}

// torch's or numpy's module, imported once (a strong reference kept for the process's life).
py::handle module_once(bool torch) {
  static PyObject* mods[2] = {nullptr, nullptr};
  PyObject*& m = mods[torch ? 1 : 0];
  if (!m) m = py::module_::import(torch ? "torch" : "numpy").release().ptr();
  return m;
}

py::object new_array(bool torch, std::initializer_list<size_t> shape, const char* dtype) {
  py::tuple t(shape.size());
  size_t i = 0;
  for (size_t d : shape) t[i++] = d;
  py::handle m = module_once(torch);
  if (torch) return m.attr("empty")(t, py::arg("dtype") = m.attr(dtype));
  return m.attr("empty")(t, std::strcmp(dtype, "bfloat16") == 0 ? "uint16" : dtype);
}

// numpy -> torch when the caller works in torch.
py::object as_family(py::object np_array, bool torch) {
  if (!torch) return np_array;
  return module_once(true).attr("from_numpy")(np_array);
}

// Rows of x, y, recv_x or out: a C-contiguous array of the buffer's dtype whose last dimension is
// hidden (2-D [rows, hidden], or more dimensions taken as rows of hidden elements).
EpRows rows_of(HostMemory& m, py::handle obj, const char* name, const EpState& s, bool writable) {
  m.acquire_for_call(obj, name, writable, /*c_order=*/true);
  const bool bf16 = s.cfg.dtype == DType::kBFloat16;
  const std::string& dt = m.dtype();
  bool ok = bf16 ? (dt == "bfloat16" || (dt == "uint16" && !m.is_torch())) : dt == "float32";
  if (!ok)
    raise_type("%s: dtype %s, but the EpBuffer is %s (%s)", name, dt.c_str(), s.dtype_str(),
               bf16 ? "torch.bfloat16, or numpy uint16 holding bf16 bits" : "float32");
  const auto& sh = m.shape();
  if (sh.size() < 2 || sh.back() != static_cast<size_t>(s.cfg.hidden))
    raise_value("%s: shape must be [rows, hidden=%d]", name, s.cfg.hidden);
  size_t rows = m.size() / (static_cast<size_t>(s.cfg.hidden) * m.itemsize());
  return EpRows{m.data(), rows, static_cast<size_t>(s.cfg.hidden), s.cfg.dtype};
}

// A per-token table the caller passes (topk_idx, topk_weights) as the element type the call takes:
// the caller's own memory when it already is that type (held by `mem` for the call, no copy), else
// a converted copy.
template <typename T>
struct Table {
  HostMemory mem;
  std::vector<T> converted;
  std::span<const T> view;
};

// name [T, K] of the call's element type T (numpy dtype `own`), or of Other (dtype `other`),
// converted; `expected` names what the call takes in the TypeError.
template <typename T, typename Other>
void table_of(Table<T>& t, py::handle obj, const char* name, size_t tokens, int topk, const char* own,
              const char* other, const char* expected) {
  HostMemory& m = t.mem;
  m.acquire_for_call(obj, name, false, true);
  const auto sh = m.shape();
  if (sh.size() != 2 || sh[0] != tokens || sh[1] != static_cast<size_t>(topk))
    raise_value("%s: shape must be [tokens=%zu, topk=%d]", name, tokens, topk);
  const size_t n = tokens * static_cast<size_t>(topk);
  const bool is_own = m.dtype() == own;
  if (!is_own && m.dtype() != other) raise_type("%s: dtype %s; %s expected", name, m.dtype().c_str(), expected);
  if (is_own && reinterpret_cast<uintptr_t>(m.data()) % alignof(T) == 0) {
    t.view = std::span<const T>(static_cast<const T*>(m.data()), n);
    return;
  }
  // Another type, or the call's own at an odd offset of a byte buffer: element by element.
  const char* p = static_cast<const char*>(m.data());
  t.converted.resize(n);
  for (size_t i = 0; i < n; i++) {
    if (is_own) {
      memcpy(&t.converted[i], p + i * sizeof(T), sizeof(T));
    } else {
      Other v;
      memcpy(&v, p + i * sizeof v, sizeof v);
      t.converted[i] = static_cast<T>(v);
    }
  }
  t.view = t.converted;
}

void topk_idx_of(Table<int64_t>& t, py::handle obj, size_t tokens, int topk) {
  table_of<int64_t, int32_t>(t, obj, "topk_idx", tokens, topk, "int64", "int32", "int64 (or int32) expert indexes");
}
void topk_weights_of(Table<float>& t, py::handle obj, size_t tokens, int topk) {
  table_of<float, double>(t, obj, "topk_weights", tokens, topk, "float32", "float64", "float32 weights");
}

// ponte.EpHandle's pybind11 type, looked up once (bind_collectives): a handle is checked on every
// call that takes one, without a lookup by type name each time.
const py::detail::type_info* g_handle_tinfo = nullptr;

HandleState& handle_of(py::handle obj, const EpState& s) {
  auto vh = constructed_instance(obj.ptr(), g_handle_tinfo);
  if (!vh.inst) raise_type("handle must be a ponte.EpHandle, not %s", Py_TYPE(obj.ptr())->tp_name);
  HandleState& h = *vh.value_ptr<HandleState>();
  if (h.ep.get() != &s) raise_value("handle: it belongs to another EpBuffer");
  return h;
}

// recv_x [L, W * max_tokens, H] and recv_count [L] for a dispatch.
struct RecvOut {
  py::object x, count;
  HostMemory xm, cm;
};
// A new torch tensor of shape `shape` taken as the call's memory (HostMemory::adopt_new_tensor);
// numpy arrays are read through acquire_for_call as usual (its numpy path is as cheap).
py::object new_tensor_for_call(HostMemory& m, std::initializer_list<size_t> shape, const char* dtype, size_t itemsize) {
  py::object t = new_array(true, shape, dtype);
  m.adopt_new_tensor(t, std::span<const size_t>(shape.begin(), shape.size()), dtype, itemsize);
  return t;
}
size_t elem_bytes(const EpState& s) { return s.cfg.dtype == DType::kFloat32 ? 4 : 2; }

// The caller's recv_x / recv_count (reused across steps), or new ones.
void alloc_recv(RecvOut& r, const EpState& s, bool torch, py::handle recv_x, py::handle recv_count) {
  const size_t rows_all = static_cast<size_t>(s.L) * s.rows_per_expert;
  if (recv_x.is_none() && torch) {
    r.x = new_tensor_for_call(r.xm, {static_cast<size_t>(s.L), s.rows_per_expert, static_cast<size_t>(s.cfg.hidden)},
                              s.dtype_str(), elem_bytes(s));
  } else {
    r.x = recv_x.is_none() ? new_array(torch, {static_cast<size_t>(s.L), s.rows_per_expert, static_cast<size_t>(s.cfg.hidden)},
                                       s.dtype_str())
                           : py::reinterpret_borrow<py::object>(recv_x);
    EpRows rows = rows_of(r.xm, r.x, "recv_x", s, true);
    if (rows.rows != rows_all)
      raise_value("recv_x: %zu rows; it must be [L=%d, W * max_tokens=%zu, hidden]", rows.rows, s.L, s.rows_per_expert);
  }
  if (recv_count.is_none() && torch) {
    r.count = new_tensor_for_call(r.cm, {static_cast<size_t>(s.L)}, "int32", 4);
    return;
  }
  r.count = recv_count.is_none() ? new_array(torch, {static_cast<size_t>(s.L)}, "int32")
                                 : py::reinterpret_borrow<py::object>(recv_count);
  r.cm.acquire_for_call(r.count, "recv_count", true, true);
  if (r.cm.dtype() != "int32" || r.cm.size() != static_cast<size_t>(s.L) * 4)
    raise_value("recv_count: must be int32 [L=%d]", s.L);
}
EpRows recv_rows(RecvOut& r, const EpState& s) {
  return EpRows{r.xm.data(), static_cast<size_t>(s.L) * s.rows_per_expert, static_cast<size_t>(s.cfg.hidden), s.cfg.dtype};
}

// out [T, H]: the caller's (checked) or a new one.
py::object out_for(py::handle out, HostMemory& m, EpRows* rows, const EpState& s, const HandleState& h, bool accumulate) {
  py::object o;
  if (out.is_none()) {
    if (accumulate) raise_value("out: accumulate=True adds to out, so out must be given");
    if (h.torch) {
      o = new_tensor_for_call(m, {static_cast<size_t>(h.tokens), static_cast<size_t>(s.cfg.hidden)}, s.dtype_str(),
                              elem_bytes(s));
      *rows = EpRows{m.data(), static_cast<size_t>(h.tokens), static_cast<size_t>(s.cfg.hidden), s.cfg.dtype};
      return o;
    }
    o = new_array(h.torch, {static_cast<size_t>(h.tokens), static_cast<size_t>(s.cfg.hidden)}, s.dtype_str());
  } else {
    o = py::reinterpret_borrow<py::object>(out);
  }
  *rows = rows_of(m, o, "out", s, true);
  if (rows->rows != static_cast<size_t>(h.tokens)) raise_value("out: %zu rows, the dispatch had %d tokens", rows->rows, h.tokens);
  return o;
}

AllGather python_allgather(py::object fn, int world, std::optional<py::error_already_set>* raised) {
  return [fn, world, raised](std::span<const uint8_t> mine, std::vector<std::vector<uint8_t>>* all) -> Status {
    py::gil_scoped_acquire gil;
    try {
      py::object r = fn(py::bytes(reinterpret_cast<const char*>(mine.data()), mine.size()));
      if (!PySequence_Check(r.ptr())) return Status(Code::kInvalidArgument, "allgather must return a list of bytes");
      py::sequence seq = py::reinterpret_borrow<py::sequence>(r);
      if (static_cast<int>(seq.size()) != world)
        return Status(Code::kInvalidArgument, "allgather returned %zu entries for world %d", seq.size(), world);
      all->clear();
      for (py::handle item : seq) {
        Py_buffer hold{};
        ByteView b = arg_bytes(item, "allgather()[i]", &hold);
        all->emplace_back(b.data, b.data + b.len);
        if (hold.obj) PyBuffer_Release(&hold);
      }
      return Status::Ok();
    } catch (py::error_already_set& e) {
      Status st(Code::kInvalidArgument, "allgather raised %s", e.what());
      raised->emplace(std::move(e));
      return st;
    } catch (std::exception& e) {
      return Status(Code::kInvalidArgument, "allgather: %s", e.what());
    }
  };
}

}  // namespace

void bind_collectives(py::module_& m) {
  using CommPtr = std::shared_ptr<CommState>;
  using EpPtr = std::shared_ptr<EpState>;

  py::class_<CommState, CommPtr>(
      m, "Communicator",
      "W ranks over one engine of their own (the same keyword overrides as Engine), bootstrapped through "
      "``allgather(data: bytes) -> list[bytes]`` (every rank's bytes, in rank order). Collective calls are "
      "made by all ranks in the same order, from one thread. ``Communicator.from_torch(group)`` builds one "
      "over torch.distributed. Ctrl-C while a call waits for other ranks raises KeyboardInterrupt at once; "
      "the communicator (and its EpBuffers) then raise ponte.Error(CANCELLED).")
      .def(py::init([](py::handle rank, py::handle world, py::object allgather, py::kwargs kw) {
             int w = arg_int(world, "world", 1, 1 << 20);
             int r = arg_int(rank, "rank", 0, w - 1);
             if (!PyCallable_Check(allgather.ptr())) raise_type("allgather must be callable: bytes -> list[bytes]");
             CommunicatorOptions opts;
             opts.engine.config = engine_config(kw);
             opts.interrupted = &python_interrupted;
             std::optional<py::error_already_set> raised;
             AllGather ag = python_allgather(allgather, w, &raised);
             Result<std::unique_ptr<Communicator>> c = Status(Code::kInternal, "not created");
             {
               py::gil_scoped_release nogil;
               c = Communicator::create(r, w, ag, opts);
             }
             if (raised) {
               raised->restore();
               throw py::error_already_set();
             }
             if (!c.ok()) raise_refusal(c.status(), "Communicator");
             auto s = std::make_shared<CommState>();
             s->comm = std::move(*c);
             s->rank = r;
             s->world = w;
             return s;
           }),
           py::arg("rank"), py::arg("world"), py::arg("allgather"))
      .def_property_readonly("rank", [](const CommState& s) { return s.rank; }, "This rank.")
      .def_property_readonly("world", [](const CommState& s) { return s.world; }, "Number of ranks.")
      .def_property_readonly("closed", [](const CommState& s) { return !s.comm; }, "Whether close() ran.")
      .def("barrier", [](CommState& s) {
        Communicator& c = s.live("barrier");
        Busy busy(s, "barrier");
        Status st;
        {
          py::gil_scoped_release nogil;
          st = c.barrier();
        }
        check(st, "barrier");
      }, "Returns once every rank has entered it (ponte.Error when a rank died or did not come in time).")
      .def("all_to_all_v", [](CommState& s, py::handle send, py::handle send_counts, py::handle recv, py::handle recv_counts) {
        Communicator& c = s.live("all_to_all_v");
        HostMemory sm, rm;
        sm.acquire(send, "send", false);
        rm.acquire(recv, "recv", true);
        auto counts = [&](py::handle obj, const char* name, const HostMemory& mem) {
          std::vector<size_t> out;
          size_t i = 0, total = 0;
          for (py::handle v : py::reinterpret_borrow<py::iterable>(obj)) {
            std::string n = std::string(name) + "[" + std::to_string(i++) + "]";
            out.push_back(arg_size(v, n.c_str()) * mem.itemsize());
            total += out.back();
          }
          if (static_cast<int>(out.size()) != s.world) raise_value("%s: %zu entries for world %d", name, out.size(), s.world);
          if (total > mem.size())
            raise_value("%s: %zu bytes in all, more than the %zu-byte buffer", name, total, mem.size());
          return out;
        };
        if (!PyIter_Check(send_counts.ptr()) && !PySequence_Check(send_counts.ptr())) raise_type("send_counts must be a sequence of ints");
        if (!PyIter_Check(recv_counts.ptr()) && !PySequence_Check(recv_counts.ptr())) raise_type("recv_counts must be a sequence of ints");
        std::vector<size_t> sc = counts(send_counts, "send_counts", sm), rc = counts(recv_counts, "recv_counts", rm);
        Busy busy(s, "all_to_all_v");
        Status st;
        {
          py::gil_scoped_release nogil;
          st = c.all_to_all_v(sm.data(), sc, rm.data(), rc);
        }
        check(st, "all_to_all_v");
      }, py::arg("send"), py::arg("send_counts"), py::arg("recv"), py::arg("recv_counts"),
           "Rank r gets ``send_counts[r]`` elements of ``send`` (blocks back to back, in rank order) and "
           "``recv_counts[r]`` elements from rank r land in ``recv`` the same way. Counts are in elements of "
           "each buffer's own dtype; send_counts[r] here must match recv_counts[this rank] on rank r.")
      .def("close", &CommState::close, "Closes its EpBuffers, then its engine. Later calls raise ponte.Error(CANCELLED).")
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__", [](CommState& s, py::args) { s.close(); })
      .def("__repr__", [](const CommState& s) {
        return "<ponte.Communicator rank " + std::to_string(s.rank) + " of " + std::to_string(s.world) +
               (s.comm ? ">" : " closed>");
      });

  py::class_<HandleState>(m, "EpHandle",
                          "One dispatch/combine in flight: from dispatch(_send) until combine(_recv) returns. At most "
                          "two are live per EpBuffer.")
      .def_property_readonly("num_tokens", [](const HandleState& h) { return h.tokens; }, "T of the dispatch.")
      .def_property_readonly("src_info", [](HandleState& h) {
        if (h.src_info) return h.src_info;
        if (!h.received || !h.h.valid()) raise_value("handle.src_info: valid after dispatch_recv, until combine_recv");
        auto sp = h.h.src_info();
        py::array_t<int32_t> a({static_cast<size_t>(h.ep->L), h.ep->rows_per_expert, size_t{2}});
        memcpy(a.mutable_data(), sp.data(), sp.size_bytes());
        h.src_info = as_family(a, h.torch);
        return h.src_info;
      }, "int32 [L, W * max_tokens, 2]: for each received row of recv_x, (source rank, token index at the "
         "source); rows past recv_count[l] are -1.")
      .def_property_readonly("layout_range", [](HandleState& h) {
        if (h.layout_range) return h.layout_range;
        if (!h.received || !h.h.valid()) raise_value("handle.layout_range: valid after dispatch_recv, until combine_recv");
        auto sp = h.h.layout_range();
        py::array_t<int32_t> a({static_cast<size_t>(h.ep->L), static_cast<size_t>(h.ep->W), size_t{2}});
        memcpy(a.mutable_data(), sp.data(), sp.size_bytes());
        h.layout_range = as_family(a, h.torch);
        return h.layout_range;
      }, "int32 [L, W, 2]: per local expert and source rank, (begin, count) of that source's rows in the "
         "expert's block of recv_x.")
      .def("valid", [](const HandleState& h) { return h.ep->ep && h.h.valid(); },
           "Whether the handle is live (dispatched, not yet combined).");
  g_handle_tinfo = py::detail::get_type_info(typeid(HandleState));

  py::class_<EpState, EpPtr>(
      m, "EpBuffer",
      "MoE expert-parallel dispatch and combine over a Communicator (collective: every rank creates it and "
      "calls dispatch/combine in the same order). E experts, L = E / W per rank (expert e on rank e // L). "
      "x, y, out: numpy arrays or CPU torch tensors, float32 or bfloat16 (torch.bfloat16, or numpy uint16 "
      "holding bf16 bits); torch in, torch out. A tensor the call writes (out, recv_x) must not require grad "
      "while autograd records (torch.no_grad()): the write is outside autograd. Its version counter goes up, "
      "as with torch's in-place ops: a backward through a value the write replaced raises.")
      .def(py::init([](const CommPtr& comm, py::handle num_experts, py::handle hidden, py::handle max_tokens,
                       py::handle topk, const std::string& dtype) {
             auto s = std::make_shared<EpState>();
             s->comm = comm;
             Communicator& c = comm->live("EpBuffer");
             s->cfg.num_experts = arg_int(num_experts, "num_experts", 1, 1 << 20);
             s->cfg.hidden = arg_int(hidden, "hidden", 1, 1 << 24);
             s->cfg.max_tokens = arg_int(max_tokens, "max_tokens", 1, 1 << 24);
             s->cfg.topk = arg_int(topk, "topk", 1, 1024);
             if (dtype == "float32" || dtype == "f32") s->cfg.dtype = DType::kFloat32;
             else if (dtype == "bfloat16" || dtype == "bf16") s->cfg.dtype = DType::kBFloat16;
             else raise_value("dtype must be 'float32' or 'bfloat16', not '%s'", dtype.c_str());
             if (s->cfg.num_experts % comm->world != 0)
               raise_value("num_experts: %d is not a multiple of the world size %d", s->cfg.num_experts, comm->world);
             Busy busy(*comm, "EpBuffer");
             Result<std::unique_ptr<EpBuffer>> r = Status(Code::kInternal, "not created");
             {
               py::gil_scoped_release nogil;
               r = EpBuffer::create(c, s->cfg);
             }
             if (!r.ok()) raise_refusal(r.status(), "EpBuffer");
             s->ep = std::move(*r);
             s->L = s->ep->local_experts();
             s->W = comm->world;
             s->rows_per_expert = s->ep->recv_rows_per_expert();
             comm->eps.push_back(s);
             return s;
           }),
           py::arg("comm"), py::arg("num_experts"), py::arg("hidden"), py::arg("max_tokens"), py::arg("topk"),
           py::arg("dtype") = "float32")
      .def_property_readonly("num_experts", [](const EpState& s) { return s.cfg.num_experts; }, "E.")
      .def_property_readonly("local_experts", [](const EpState& s) { return s.L; }, "L = E / W, the experts of this rank.")
      .def_property_readonly("hidden", [](const EpState& s) { return s.cfg.hidden; }, "H, elements per row.")
      .def_property_readonly("max_tokens", [](const EpState& s) { return s.cfg.max_tokens; }, "Most tokens per dispatch.")
      .def_property_readonly("topk", [](const EpState& s) { return s.cfg.topk; }, "K, experts per token.")
      .def_property_readonly("dtype", [](const EpState& s) { return std::string(s.dtype_str()); }, "'float32' or 'bfloat16'.")
      .def_property_readonly("recv_rows_per_expert", [](const EpState& s) { return s.rows_per_expert; },
                             "W * max_tokens: the rows of each expert's block in recv_x.")
      .def("dispatch_send", [](const EpPtr& s, py::handle x, py::handle topk_idx) {
        EpBuffer& ep = s->live("dispatch_send");
        HostMemory xm;
        EpRows rows = rows_of(xm, x, "x", *s, false);
        Table<int64_t> idx;
        topk_idx_of(idx, topk_idx, rows.rows, s->cfg.topk);
        Busy busy(*s->comm, "dispatch_send");
        std::optional<Result<EpHandle>> sent;  // no placeholder Status formatted per call
        {
          py::gil_scoped_release nogil;
          sent.emplace(ep.dispatch_send(rows, idx.view));
        }
        Result<EpHandle>& h = *sent;
        if (!h.ok()) raise_refusal(h.status(), "dispatch_send");
        auto hs = std::make_unique<HandleState>();
        hs->ep = s;
        hs->h = *h;
        hs->torch = xm.is_torch();
        hs->tokens = static_cast<int>(rows.rows);
        return hs;
      }, py::arg("x"), py::arg("topk_idx"),
           "Packs x [T, H] by destination and posts the writes; returns an EpHandle at once (overlap compute, "
           "then dispatch_recv). topk_idx [T, K] int64, -1 = no expert.")
      .def("dispatch_recv", [](const EpPtr& s, py::handle handle, py::handle recv_x, py::handle recv_count) {
        EpBuffer& ep = s->live("dispatch_recv");
        HandleState& h = handle_of(handle, *s);
        RecvOut out;
        alloc_recv(out, *s, h.torch, recv_x, recv_count);
        EpRows rows = recv_rows(out, *s);
        std::span<int32_t> cnt(static_cast<int32_t*>(out.cm.data()), static_cast<size_t>(s->L));
        Busy busy(*s->comm, "dispatch_recv");
        Status st;
        {
          py::gil_scoped_release nogil;
          st = ep.dispatch_recv(h.h, rows, cnt);
        }
        check(st, "dispatch_recv");
        h.received = true;
        return py::make_tuple(out.x, out.count);
      }, py::arg("handle"), py::arg("recv_x") = py::none(), py::arg("recv_count") = py::none(),
           "Waits for every rank's rows; returns (recv_x [L, W * max_tokens, H], recv_count [L] int32), into the "
           "given arrays when passed (reuse them across steps), else new ones.")
      .def("dispatch", [](const EpPtr& s, py::handle x, py::handle topk_idx, py::handle recv_x, py::handle recv_count) {
        EpBuffer& ep = s->live("dispatch");
        HostMemory xm;
        EpRows rows = rows_of(xm, x, "x", *s, false);
        Table<int64_t> idx;
        topk_idx_of(idx, topk_idx, rows.rows, s->cfg.topk);
        RecvOut out;
        alloc_recv(out, *s, xm.is_torch(), recv_x, recv_count);
        EpRows rrows = recv_rows(out, *s);
        std::span<int32_t> cnt(static_cast<int32_t*>(out.cm.data()), static_cast<size_t>(s->L));
        Busy busy(*s->comm, "dispatch");
        std::optional<Result<EpHandle>> sent;  // no placeholder Status formatted per call
        {
          py::gil_scoped_release nogil;
          sent.emplace(ep.dispatch(rows, idx.view, rrows, cnt));
        }
        Result<EpHandle>& h = *sent;
        if (!h.ok()) raise_refusal(h.status(), "dispatch");
        auto hs = std::make_unique<HandleState>();
        hs->ep = s;
        hs->h = *h;
        hs->torch = xm.is_torch();
        hs->tokens = static_cast<int>(rows.rows);
        hs->received = true;
        return py::make_tuple(out.x, out.count, py::cast(std::move(hs)));
      }, py::arg("x"), py::arg("topk_idx"), py::arg("recv_x") = py::none(), py::arg("recv_count") = py::none(),
           "dispatch_send + dispatch_recv: returns (recv_x, recv_count, handle) (into recv_x/recv_count when given).")
      .def("combine_send", [](const EpPtr& s, py::handle y, py::handle handle) {
        EpBuffer& ep = s->live("combine_send");
        HandleState& h = handle_of(handle, *s);
        HostMemory ym;
        EpRows rows = rows_of(ym, y, "y", *s, false);
        Busy busy(*s->comm, "combine_send");
        Status st;
        {
          py::gil_scoped_release nogil;
          st = ep.combine_send(h.h, rows);
        }
        check(st, "combine_send");
      }, py::arg("y"), py::arg("handle"),
           "Sends the experts' outputs y (recv_x's layout) back to their sources; returns at once.")
      .def("combine_recv", [](const EpPtr& s, py::handle handle, py::handle topk_weights, py::handle out, bool accumulate) {
        EpBuffer& ep = s->live("combine_recv");
        HandleState& h = handle_of(handle, *s);
        Table<float> w;
        topk_weights_of(w, topk_weights, static_cast<size_t>(h.tokens), s->cfg.topk);
        HostMemory om;
        EpRows orows;
        py::object o = out_for(out, om, &orows, *s, h, accumulate);
        Busy busy(*s->comm, "combine_recv");
        Status st;
        {
          py::gil_scoped_release nogil;
          st = ep.combine_recv(h.h, w.view, orows, accumulate);
        }
        check(st, "combine_recv");
        return o;
      }, py::arg("handle"), py::arg("topk_weights"), py::arg("out") = py::none(), py::arg("accumulate") = false,
           "Waits for the rows and reduces: out[t] = sum_k topk_weights[t, k] * y_row(t, k) (float32 sums), in "
           "token order; with accumulate the sum is added to out. Releases the handle; returns out.")
      .def("combine", [](const EpPtr& s, py::handle y, py::handle topk_weights, py::handle handle, py::handle out,
                         bool accumulate) {
        EpBuffer& ep = s->live("combine");
        HandleState& h = handle_of(handle, *s);
        HostMemory ym, om;
        EpRows yrows = rows_of(ym, y, "y", *s, false);
        Table<float> w;
        topk_weights_of(w, topk_weights, static_cast<size_t>(h.tokens), s->cfg.topk);
        EpRows orows;
        py::object o = out_for(out, om, &orows, *s, h, accumulate);
        Busy busy(*s->comm, "combine");
        Status st;
        {
          py::gil_scoped_release nogil;
          st = ep.combine(h.h, yrows, w.view, orows, accumulate);
        }
        check(st, "combine");
        return o;
      }, py::arg("y"), py::arg("topk_weights"), py::arg("handle"), py::arg("out") = py::none(),
           py::arg("accumulate") = false, "combine_send + combine_recv; returns out [T, H].")
      .def("live_handles", [](EpState& s) { return s.live("live_handles").live_handles(); },
           "Handles dispatched and not yet combined (at most 2).")
      .def("close", [](EpState& s) {
        if (!s.ep) return;
        Busy busy(*s.comm, "EpBuffer.close");
        s.release();
      }, "Frees the buffer's arena (collective in effect: peers may still be writing to it until they finish).")
      .def("__repr__", [](const EpState& s) {
        return "<ponte.EpBuffer E=" + std::to_string(s.cfg.num_experts) + " H=" + std::to_string(s.cfg.hidden) +
               " K=" + std::to_string(s.cfg.topk) + " " + s.dtype_str() + (s.ep ? ">" : " closed>");
      });
}

}  // namespace ponte::py
