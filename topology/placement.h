// Placement policy: from an inventory of GPUs, NICs (with their PCIe ancestry), NUMA nodes and
// cores to the Table of topology.h. Pure data in, data out: discovery fills the inventory from hwloc.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "topology/topology.h"

namespace ponte::topo {

// One bridge above a PCI device: a PCI-to-PCI bridge (switch port, root port) or a host bridge.
struct PciBridge {
  uint64_t id = 0;    // unique within one inventory (hwloc's gp_index)
  bool host = false;  // a PCIe host bridge (root complex)
  bool operator==(const PciBridge&) const = default;
};
// The bridges above a device, nearest first; a host bridge, when known, comes last.
using PciPath = std::vector<PciBridge>;

struct CpuCore {
  int cpu = -1;      // logical CPU number of its first hardware thread (PU OS index)
  int numa = -1;     // NUMA node OS index, -1 when in none
  int package = -1;  // package OS index, -1 when in none
};

struct NumaNode {
  int os_index = -1;
  int package = -1;
};

// What discovery found, before the policy. gpus[i].nics / cpus / rule are filled by place().
struct Inventory {
  std::vector<Gpu> gpus;               // by PCI bus id
  std::vector<PciPath> gpu_paths;      // gpu_paths[i] belongs to gpus[i]
  std::vector<Nic> nics;               // by PCI bus id
  std::vector<PciPath> nic_paths;      // nic_paths[j] belongs to nics[j]
  std::vector<NumaNode> numa_nodes;    // by OS index
  std::vector<CpuCore> cores;          // one per physical core, in topology order
  std::vector<std::string> warnings;   // from discovery; place() appends its own
};

// PCI distance between two devices from their paths and NUMA nodes.
Distance pci_distance(const PciPath& a, int numa_a, const PciPath& b, int numa_b);

// Applies the policy (see Gpu::nics, Gpu::cpus, HostGroup in topology.h):
//  1. a GPU takes the NICs under its closest common PCIe ancestor (same switch first);
//  2. NICs a group of GPUs shares at equal standing are divided evenly among them, and a NIC goes
//     to several GPUs only when there are fewer free NICs than GPUs (then the least loaded first);
//  3. a GPU with no NIC under any shared PCIe ancestor falls back to its NUMA node, then its
//     package, then any NIC, and Gpu::rule says which rule placed it;
//  4. the physical cores of a NUMA node are divided among its GPUs, in order.
Table place(const Inventory& inventory);

}  // namespace ponte::topo
