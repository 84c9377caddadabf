// Per-GPU groups from topology/'s table (built only with hwloc; a stub answers otherwise).
#include "core/topology_layout.h"

#include "core/log.h"
#include "core/remote_region.h"

#ifdef PONTE_WITH_TOPOLOGY
#include "topology/topology.h"
#endif

namespace ponte {

Result<std::vector<GroupLayout>> gpu_layout(const std::vector<NicInfo>& devices, const Config& cfg) {
#ifndef PONTE_WITH_TOPOLOGY
  (void)devices;
  (void)cfg;
  return Status(Code::kUnavailable, "ponte was built without hwloc: no topology");
#else
  topo::Options o;
  o.xml_file = cfg.topo_file;
  topo::Result r = topo::discover(o);
  if (!r.ok) return Status(Code::kUnavailable, "topology (%s): %s", r.source.c_str(), r.error.c_str());
  for (const auto& w : r.table.warnings) PONTE_LOG_INFO("topology: %s", w.c_str());
  if (r.table.gpus.empty()) return Status(Code::kNotFound, "topology (%s): no GPU", r.source.c_str());
  // Table NIC index -> backend devices on that PCI function (several ports may share one).
  std::vector<std::vector<size_t>> by_nic(r.table.nics.size());
  for (size_t d = 0; d < devices.size(); d++) {
    int j = devices[d].pci_bus_id.empty() ? -1 : topo::find_nic(r.table, devices[d].pci_bus_id);
    if (j >= 0) by_nic[static_cast<size_t>(j)].push_back(d);
  }
  std::vector<GroupLayout> out;
  for (const auto& g : r.table.gpus) {
    GroupLayout l;
    l.gpu_pci = g.pci;
    l.rule = topo::rule_name(g.rule);
    for (const auto& link : g.nics)
      for (size_t d : by_nic[static_cast<size_t>(link.nic)])
        if (l.devices.size() < static_cast<size_t>(kMaxNicsPerGroup)) l.devices.push_back(d);
    if (!g.cpus.empty()) l.cores = {g.cpus.front()};
    if (l.devices.empty())
      return Status(Code::kNotFound, "topology: no %s device matches a NIC of GPU %s", devices.empty() ? "backend" : devices[0].provider.c_str(),
                    g.pci.c_str());
    PONTE_LOG_INFO("GPU %s: %zu NICs (rule %s), worker on core %d", g.pci.c_str(), l.devices.size(), l.rule.c_str(),
                   l.cores.empty() ? -1 : l.cores[0]);
    out.push_back(std::move(l));
  }
  return out;
#endif
}

}  // namespace ponte
