// CUDA device ordinal -> PCI bus id, through the CUDA driver loaded at run time (dlopen of
// libcuda.so.1): no link-time CUDA dependency; a host without the driver gets a clear "not available".
#pragma once

#include <string>
#include <vector>

namespace ponte::topo {

struct CudaBusIds {
  bool ok = false;
  std::string error;              // set when !ok: "CUDA driver not available: ..." or a CUDA error
  std::vector<std::string> pci;   // pci[ordinal], normalized "0000:44:00.0" (see topology.h)
};

// PCI bus ids of every CUDA device, by CUDA ordinal (as the process sees them, so after
// CUDA_VISIBLE_DEVICES). driver_library: the file to dlopen (tests pass a missing one).
CudaBusIds cuda_pci_bus_ids(const char* driver_library = "libcuda.so.1");

struct CudaBusId {
  bool ok = false;
  std::string error;
  std::string pci;
};

// The PCI bus id of one CUDA device ordinal.
CudaBusId cuda_pci_bus_id(int ordinal, const char* driver_library = "libcuda.so.1");

}  // namespace ponte::topo
