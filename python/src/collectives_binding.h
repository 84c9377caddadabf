// The collectives half of the `ponte` module: ponte.Communicator (barrier, all_to_all_v) and
// ponte.EpBuffer / ponte.EpHandle (MoE dispatch and combine), bound from collectives/.
#pragma once

#include <pybind11/pybind11.h>

namespace ponte::py {

void bind_collectives(pybind11::module_& m);

}  // namespace ponte::py
