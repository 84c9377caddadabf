// The `ponte._ponte` extension: the engine (and, where built, the collectives) for Python. The
// package `ponte` (python/ponte/__init__.py) re-exports it.
#include <pybind11/pybind11.h>

#include "core/status.h"
#include "python/src/engine_binding.h"
#ifdef PONTE_PY_COLLECTIVES
#include "python/src/collectives_binding.h"
#endif
#include "python/src/py_common.h"

namespace pyb = pybind11;

PYBIND11_MODULE(_ponte, m) {
  m.doc() = "ponte: one RDMA transport stack for LLM systems (engine, KV-cache and weight transfer, MoE)";
  pyb::enum_<ponte::Code>(m, "Code", "The engine's error codes, as ``ponte.Error.code``.")
      .value("OK", ponte::Code::kOk)
      .value("INVALID_ARGUMENT", ponte::Code::kInvalidArgument)
      .value("NOT_FOUND", ponte::Code::kNotFound)
      .value("UNAVAILABLE", ponte::Code::kUnavailable)
      .value("AGAIN", ponte::Code::kAgain)
      .value("PEER_DEAD", ponte::Code::kPeerDead)
      .value("TIMEOUT", ponte::Code::kTimeout)
      .value("TRANSPORT", ponte::Code::kTransport)
      .value("RESOURCE", ponte::Code::kResource)
      .value("CANCELLED", ponte::Code::kCancelled)
      .value("INTERNAL", ponte::Code::kInternal);
  ponte::py::init_errors(m);
  ponte::py::bind_engine(m);
#ifdef PONTE_PY_COLLECTIVES
  ponte::py::bind_collectives(m);
#endif
}
