// TopologyLayout: turns topology/'s table into the engine's NIC groups: one group per GPU, its NICs
// matched to backend devices by PCI bus id, and the cores its worker is pinned to.
#pragma once

#include <string>
#include <vector>

#include "core/config.h"
#include "core/nic.h"
#include "core/status.h"

namespace ponte {

struct GroupLayout {
  std::vector<size_t> devices;  // backend device indexes, nearest first
  std::vector<int> cores;       // the worker's cores (empty: not pinned): the first of the GPU's cores
                                // that the calling thread's CPU affinity allows (none: empty)
  std::string gpu_pci;          // the GPU this group serves ("" for host memory)
  std::string rule;             // which placement rule chose the NICs ("switch", "numa", ...)
};

// One group per GPU of the host (or of PONTE_TOPO_FILE), in PCI bus id order. kNotFound when the
// host has no GPU or no backend device matches a NIC of the table; kUnavailable when ponte was built
// without hwloc.
Result<std::vector<GroupLayout>> gpu_layout(const std::vector<NicInfo>& devices, const Config& cfg);

}  // namespace ponte
