// The Engine half of the `ponte` module: ponte.Engine, ponte.Region (registered caller memory) and
// ponte.Operation (one asynchronous engine operation, waited for with the GIL released).
#pragma once

#include <pybind11/pybind11.h>

namespace ponte::py {

void bind_engine(pybind11::module_& m);

}  // namespace ponte::py
