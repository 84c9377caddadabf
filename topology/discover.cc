// Discovery with hwloc (live host or XML export): GPUs, RDMA NICs and their PCIe ancestry, NUMA
// nodes, packages and physical cores, gathered into an Inventory and handed to the placement policy.
#include <hwloc.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>

#include "topology/placement.h"
#include "topology/topology.h"

namespace ponte::topo {
namespace {

constexpr uint16_t kNvidiaVendor = 0x10de;
constexpr uint16_t kClassVga = 0x0300;
constexpr uint16_t kClass3d = 0x0302;

struct TopologyDeleter {
  void operator()(hwloc_topology* t) const { hwloc_topology_destroy(t); }
};
using TopologyPtr = std::unique_ptr<hwloc_topology, TopologyDeleter>;

int os_index_of(hwloc_obj_t obj) {
  if (obj == nullptr) return -1;
  if (obj->os_index != HWLOC_UNKNOWN_INDEX) return static_cast<int>(obj->os_index);
  return static_cast<int>(obj->logical_index);
}

// A NUMA node with a subtype (HBM, MCDRAM, NVM, SPM, CXL-DRAM...) is not the node a device or core
// calls home when an ordinary one is local too.
bool is_plain_numa(hwloc_obj_t node) {
  return node->subtype == nullptr || std::strcmp(node->subtype, "DRAM") == 0;
}

// The single NUMA node among `nodes` (plain ones preferred), or -1.
int pick_numa(const std::vector<hwloc_obj_t>& nodes) {
  std::vector<hwloc_obj_t> plain;
  for (hwloc_obj_t n : nodes) {
    if (is_plain_numa(n)) plain.push_back(n);
  }
  if (plain.size() == 1) return os_index_of(plain.front());
  if (plain.empty() && nodes.size() == 1) return os_index_of(nodes.front());
  return -1;
}

class Walker {
 public:
  explicit Walker(hwloc_topology_t topo) : topo_(topo) {
    for (hwloc_obj_t n = nullptr; (n = hwloc_get_next_obj_by_type(topo_, HWLOC_OBJ_NUMANODE, n));) {
      numa_.push_back(n);
    }
    for (hwloc_obj_t p = nullptr; (p = hwloc_get_next_obj_by_type(topo_, HWLOC_OBJ_PACKAGE, p));) {
      packages_.push_back(p);
    }
  }

  Inventory collect() {
    Inventory inv;
    collect_numa(inv);
    collect_cores(inv);
    collect_pci(inv);
    return inv;
  }

 private:
  // The package holding a normal object: its ancestor, else the only package it overlaps.
  int package_of(hwloc_obj_t obj) const {
    for (hwloc_obj_t a = obj; a != nullptr; a = a->parent) {
      if (a->type == HWLOC_OBJ_PACKAGE) return os_index_of(a);
    }
    if (obj == nullptr || obj->cpuset == nullptr) return -1;
    hwloc_obj_t only = nullptr;
    for (hwloc_obj_t p : packages_) {
      if (p->cpuset == nullptr || !hwloc_bitmap_intersects(p->cpuset, obj->cpuset)) continue;
      if (only != nullptr) return -1;
      only = p;
    }
    return os_index_of(only);
  }

  // The NUMA node local to a normal object (the ancestor of a PCI device, or a core).
  int numa_of(hwloc_obj_t obj) const {
    if (obj == nullptr || obj->nodeset == nullptr) return -1;
    std::vector<hwloc_obj_t> local;
    for (hwloc_obj_t n : numa_) {
      if (n->os_index != HWLOC_UNKNOWN_INDEX &&
          hwloc_bitmap_isset(obj->nodeset, static_cast<unsigned>(n->os_index))) {
        local.push_back(n);
      }
    }
    return pick_numa(local);
  }

  void collect_numa(Inventory& inv) const {
    for (hwloc_obj_t n : numa_) {
      NumaNode node;
      node.os_index = os_index_of(n);
      node.package = package_of(n->parent);
      inv.numa_nodes.push_back(node);
    }
    std::sort(inv.numa_nodes.begin(), inv.numa_nodes.end(),
              [](const NumaNode& a, const NumaNode& b) { return a.os_index < b.os_index; });
  }

  void collect_cores(Inventory& inv) const {
    hwloc_obj_type_t type = HWLOC_OBJ_CORE;
    if (hwloc_get_nbobjs_by_type(topo_, HWLOC_OBJ_CORE) <= 0) {
      type = HWLOC_OBJ_PU;
      inv.warnings.push_back("hwloc reports no physical cores: each hardware thread counts as one");
    }
    for (hwloc_obj_t c = nullptr; (c = hwloc_get_next_obj_by_type(topo_, type, c));) {
      if (c->cpuset == nullptr || hwloc_bitmap_iszero(c->cpuset)) continue;  // not allowed to us
      CpuCore core;
      core.cpu = hwloc_bitmap_first(c->cpuset);
      std::vector<hwloc_obj_t> local;
      for (hwloc_obj_t n : numa_) {
        if (n->cpuset != nullptr && hwloc_bitmap_isset(n->cpuset, static_cast<unsigned>(core.cpu))) {
          local.push_back(n);
        }
      }
      // A core is in several nodes only beside memory-only ones: the first plain node wins.
      std::stable_partition(local.begin(), local.end(), is_plain_numa);
      core.numa = local.empty() ? -1 : os_index_of(local.front());
      core.package = package_of(c);
      inv.cores.push_back(core);
    }
  }

  // The bridges above an I/O object, nearest first, walking parent pointers (hwloc 2.9's
  // hwloc_get_common_ancestor_obj() cannot take I/O objects).
  static PciPath path_of(hwloc_obj_t obj) {
    PciPath path;
    for (hwloc_obj_t p = obj->parent; p != nullptr && hwloc_obj_type_is_io(p->type); p = p->parent) {
      if (p->type != HWLOC_OBJ_BRIDGE) continue;
      path.push_back({p->gp_index, p->attr->bridge.upstream_type == HWLOC_OBJ_BRIDGE_HOST});
    }
    return path;
  }

  void collect_pci(Inventory& inv) const {
    std::vector<std::pair<Gpu, PciPath>> gpus;
    std::vector<std::pair<Nic, PciPath>> nics;
    int pci_devices = 0;
    for (hwloc_obj_t d = nullptr; (d = hwloc_get_next_pcidev(topo_, d));) {
      ++pci_devices;
      const auto& pci = d->attr->pcidev;
      const std::string bus_id = format_pci_bus_id(pci.domain, pci.bus, pci.dev, pci.func);
      hwloc_obj_t anchor = hwloc_get_non_io_ancestor_obj(topo_, d);
      const int numa = numa_of(anchor);
      const int package = package_of(anchor);
      if (pci.vendor_id == kNvidiaVendor && (pci.class_id == kClass3d || pci.class_id == kClassVga)) {
        Gpu gpu;
        gpu.pci = bus_id;
        gpu.device_id = pci.device_id;
        gpu.numa = numa;
        gpu.package = package;
        gpus.push_back({gpu, path_of(d)});
        continue;
      }
      Nic nic;
      for (hwloc_obj_t os = d->io_first_child; os != nullptr; os = os->next_sibling) {
        if (os->type != HWLOC_OBJ_OS_DEVICE || os->name == nullptr) continue;
        if (os->attr->osdev.type == HWLOC_OBJ_OSDEV_OPENFABRICS && nic.name.empty()) {
          nic.name = os->name;
        } else {
          nic.other_names.push_back(os->name);
        }
      }
      if (nic.name.empty()) continue;
      nic.pci = bus_id;
      nic.vendor_id = pci.vendor_id;
      nic.device_id = pci.device_id;
      nic.numa = numa;
      nic.package = package;
      nic.pci_link_gbytes = pci.linkspeed > 0 ? static_cast<double>(pci.linkspeed) : 0.0;
      nics.push_back({nic, path_of(d)});
    }
    if (pci_devices == 0) {
      inv.warnings.push_back(
          "hwloc reports no PCI device at all: GPU and NIC affinity are unknown (I/O discovery "
          "unavailable, or an export made without I/O)");
    }
    std::sort(gpus.begin(), gpus.end(), [](const auto& a, const auto& b) { return a.first.pci < b.first.pci; });
    std::sort(nics.begin(), nics.end(), [](const auto& a, const auto& b) { return a.first.pci < b.first.pci; });
    for (auto& [gpu, path] : gpus) {
      inv.gpus.push_back(std::move(gpu));
      inv.gpu_paths.push_back(std::move(path));
    }
    for (auto& [nic, path] : nics) {
      if (nic.numa < 0) inv.warnings.push_back("NIC " + nic.name + " (" + nic.pci + "): NUMA node unknown");
      inv.nics.push_back(std::move(nic));
      inv.nic_paths.push_back(std::move(path));
    }
    // RDMA devices hwloc could not tie to a PCI function (SoftRoCE rxe0, siw0...).
    for (hwloc_obj_t os = nullptr; (os = hwloc_get_next_osdev(topo_, os));) {
      if (os->attr->osdev.type != HWLOC_OBJ_OSDEV_OPENFABRICS || os->name == nullptr) continue;
      if (os->parent != nullptr && os->parent->type == HWLOC_OBJ_PCI_DEVICE) continue;
      inv.warnings.push_back(std::string("RDMA device ") + os->name +
                             " is not a PCI function: it has no place in this table");
    }
  }

  hwloc_topology_t topo_;
  std::vector<hwloc_obj_t> numa_;
  std::vector<hwloc_obj_t> packages_;
};

// Reads the start of the file: a clear error when it cannot be read, is empty, or is an XML v3.
std::string check_xml_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return "cannot read topology file " + path + ": " + std::strerror(errno);
  char head[4096] = {};
  in.read(head, sizeof(head) - 1);
  if (in.bad()) return "cannot read topology file " + path + ": " + std::strerror(errno);
  const std::string start(head, static_cast<size_t>(in.gcount()));
  if (start.empty()) return "topology file " + path + " is empty";
  if (start.find("<topology version=\"3.") != std::string::npos) {
    return "topology file " + path +
           " is an hwloc XML v3 export, which hwloc 2.9 cannot read: export it with hwloc 2.x "
           "(lstopo --of xml)";
  }
  if (start.find("<topology") == std::string::npos) {
    return "topology file " + path + " is not an hwloc XML export (no <topology> element)";
  }
  return {};
}

}  // namespace

Result discover(const Options& options) {
  Result result;
  const bool from_file = !options.xml_file.empty();
  result.source = from_file ? options.xml_file : "live host";
  if (from_file) {
    result.error = check_xml_file(options.xml_file);
    if (!result.error.empty()) return result;
  }

  hwloc_topology_t raw = nullptr;
  if (hwloc_topology_init(&raw) != 0) {
    result.error = std::string("hwloc_topology_init failed: ") + std::strerror(errno);
    return result;
  }
  TopologyPtr topo(raw);
  // Keep every PCI bridge and device: distances need the whole tree, not hwloc's "important" part.
  if (hwloc_topology_set_io_types_filter(topo.get(), HWLOC_TYPE_FILTER_KEEP_ALL) != 0) {
    result.error = std::string("hwloc cannot keep I/O objects: ") + std::strerror(errno);
    return result;
  }
  const std::string invalid_file =
      "hwloc cannot load " + options.xml_file + ": not a valid hwloc XML v1.x/v2.x export (";
  if (!from_file) {
    // Linux's own sysfs walk finds every PCI device; the libpciaccess plugin ("pci") only adds
    // vendor names and leaks them, and the GPU plugins start drivers. None of them is needed.
    for (const char* plugin : {"pci", "opencl", "gl", "cuda", "nvml", "rsmi", "levelzero"}) {
      hwloc_topology_set_components(topo.get(), HWLOC_TOPOLOGY_COMPONENTS_FLAG_BLACKLIST, plugin);
    }
  }
  if (from_file && hwloc_topology_set_xml(topo.get(), options.xml_file.c_str()) != 0) {
    result.error = invalid_file + std::strerror(errno) + ")";
    return result;
  }
  if (hwloc_topology_load(topo.get()) != 0) {
    const int err = errno;
    result.error = from_file ? invalid_file + std::strerror(err) + ")"
                             : std::string("hwloc cannot discover this host: ") + std::strerror(err);
    return result;
  }

  Walker walker(topo.get());
  result.table = place(walker.collect());
  result.ok = true;
  return result;
}

}  // namespace ponte::topo
