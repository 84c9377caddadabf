// Machine topology for ponte: the GPUs, RDMA NICs, NUMA nodes and cores of a host (hwloc, live or
// from an XML export) and the table the engine builds its NIC groups and pins its progress threads by.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

// Plain data only: nothing here includes hwloc or core/. Errors are values (Result::ok, ::error).
//
// How the engine uses it:
//   ponte::topo::Options opts;
//   opts.xml_file = config.topo_file;              // PONTE_TOPO_FILE; empty = the live host
//   ponte::topo::Result r = ponte::topo::discover(opts);
//   if (!r.ok) { ...r.error... }                   // only an unreadable / invalid XML file fails
//   for (const ponte::topo::Gpu& g : r.table.gpus) {
//     for (const ponte::topo::NicLink& l : g.nics) r.table.nics[l.nic] ...  // the GPU's NIC group
//     g.cpus ...                                                              // its progress cores
//   }
//   int j = ponte::topo::find_nic(r.table, bus_id_of_my_verbs_device);      // match by PCI bus id
//
// Every PCI bus id in the table is lowercase "dddd:bb:dd.f" (see normalize_pci_bus_id()).
namespace ponte::topo {

// PCI distance between two devices (NCCL's names), nearest first.
enum class Distance : uint8_t {
  kPIX,   // at most one PCIe switch between them (same switch, or same bridge)
  kPXB,   // several PCIe bridges, but no host bridge
  kPHB,   // through a PCIe host bridge (same root complex)
  kNODE,  // no shared PCIe ancestor, same NUMA node
  kSYS,   // across NUMA nodes (or a NUMA node is unknown)
};
const char* distance_name(Distance d);  // "PIX", "PXB", "PHB", "NODE", "SYS"

// Which rule of the placement policy chose a GPU's NICs.
enum class Rule : uint8_t {
  kSwitch,   // NICs under the GPU's closest common PCIe ancestor (switch, bridge or host bridge)
  kNuma,     // no shared PCIe ancestor with any NIC: NICs on the GPU's NUMA node
  kPackage,  // none on its NUMA node: NICs in its package (socket)
  kAny,      // none in its package: any NIC of the host
  kNone,     // the host has no RDMA NIC
};
const char* rule_name(Rule r);  // "switch", "numa", "package", "any", "none"

// One NIC of a GPU's or host group's NIC list.
struct NicLink {
  int nic = -1;                          // index into Table::nics
  Distance distance = Distance::kSYS;    // from the GPU (or from host memory of the NUMA node)
  bool operator==(const NicLink&) const = default;
};

// An RDMA NIC: a PCI function with an OpenFabrics OS device (mlx5_0, EFA's rdmap16s27, ...).
// Names differ from node to node; the PCI bus id is what identifies it.
struct Nic {
  std::string pci;                       // "0000:43:00.0"
  std::string name;                      // the OpenFabrics device name (ibv_get_device_name())
  std::vector<std::string> other_names;  // further OS devices of that function (netdev "ib0", ...)
  uint16_t vendor_id = 0;                // PCI vendor (0x15b3 Mellanox, 0x1d0f Amazon)
  uint16_t device_id = 0;
  int numa = -1;                         // NUMA node OS index, -1 when unknown
  int package = -1;                      // package OS index, -1 when unknown
  double pci_link_gbytes = 0;            // PCIe link bandwidth in GB/s as hwloc reports it, 0 unknown
  bool operator==(const Nic&) const = default;
};

// An NVIDIA GPU (PCI vendor 10de, class 0302 3D or 0300 VGA) and its placement.
struct Gpu {
  std::string pci;                       // "0000:44:00.0"
  uint16_t device_id = 0;                // PCI device id
  int numa = -1;                         // NUMA node OS index, -1 when unknown
  int package = -1;                      // package OS index, -1 when unknown
  // The GPU's NIC group, nearest first (by distance, then bus id). Policy: the NICs under its
  // closest common PCIe ancestor, divided evenly among the GPUs that share them; a NIC is given to
  // several GPUs only when there are fewer NICs than GPUs. Empty only when the host has no NIC.
  std::vector<NicLink> nics;
  // Logical CPU numbers (PU OS indexes, for sched_setaffinity / CPU_SET), one per physical core:
  // this GPU's share of the physical cores of its NUMA node. Its progress thread goes on the first
  // (or floats over all of them). Cores are shared only when a node has more GPUs than cores.
  std::vector<int> cpus;
  Rule rule = Rule::kNone;
  bool operator==(const Gpu&) const = default;
};

// Host memory on one NUMA node.
struct HostGroup {
  int numa = -1;                         // NUMA node OS index
  int package = -1;
  // Every NIC, nearest first: those on this node (PHB), then the rest of its package, then the
  // others (SYS), by bus id within each. The engine takes the first PONTE_NICS of them.
  std::vector<NicLink> nics;
  // One logical CPU per physical core of this node (the package's when the node has no cores),
  // last core first: the GPUs' progress threads start at the front of their shares, so a host
  // thread on the first of these collides with them least.
  std::vector<int> cpus;
  bool operator==(const HostGroup&) const = default;
};

struct Table {
  std::vector<Gpu> gpus;                 // by PCI bus id (CUDA_DEVICE_ORDER=PCI_BUS_ID order)
  std::vector<Nic> nics;                 // by PCI bus id
  std::vector<HostGroup> host_groups;    // one per NUMA node, by OS index
  std::vector<std::string> warnings;     // what degraded and why (no GPU, no NIC, fallbacks, ...)
  bool operator==(const Table&) const = default;
};

struct Options {
  std::string xml_file;  // an hwloc XML export (lstopo --of xml; XML v1.x or v2.x); empty = live
};

struct Result {
  bool ok = false;
  std::string error;     // set when !ok: the file is unreadable or not an hwloc topology
  std::string source;    // "live host" or the XML file's path
  Table table;
};

// Discovers the topology and applies the placement policy. Never fails on an odd machine (no GPU,
// no NIC, a GPU far from every NIC): it degrades and says so in table.warnings. It fails only when
// hwloc cannot load the live host or the XML file. The live host and an XML export of it give
// the same table.
Result discover(const Options& options);

// The table as JSON: {"gpus":[...],"nics":[...],"host_groups":[...],"warnings":[...]}.
std::string to_json(const Table& table);
// The table for people: one line per GPU / host group / NIC, then the warnings.
std::string to_text(const Table& table);

// Index of the NIC / GPU with this PCI bus id (any case, 2- or 4+-digit domain), or -1.
int find_nic(const Table& table, std::string_view pci_bus_id);
int find_gpu(const Table& table, std::string_view pci_bus_id);

// "0000:43:00.0" from its parts.
std::string format_pci_bus_id(uint32_t domain, uint32_t bus, uint32_t device, uint32_t function);
// Canonical form of "43:00.0", "0000:43:00.0", "00000000:43:00.0", "0000:43:00.0 " in any case:
// "0000:43:00.0". Empty when the text is not a PCI bus id.
std::string normalize_pci_bus_id(std::string_view text);

}  // namespace ponte::topo
