// The Engine half of the `ponte` module: ponte.Engine, ponte.Region (registered caller memory) and
// ponte.Operation (one asynchronous engine operation, waited for with the GIL released).
#pragma once

#include <pybind11/pybind11.h>

#include "core/config.h"

namespace ponte::py {

void bind_engine(pybind11::module_& m);

// The process configuration with Engine()'s keyword overrides applied (TypeError/ValueError naming
// a bad keyword); the Communicator takes the same keywords.
Config engine_config(const pybind11::kwargs& kw);

}  // namespace ponte::py
