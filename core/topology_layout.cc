// Per-GPU groups from topology/'s table (built only with hwloc; a stub answers otherwise).
#include "core/topology_layout.h"

#include <sched.h>

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
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  const bool have_mask = sched_getaffinity(0, sizeof(allowed), &allowed) == 0;
  std::vector<GroupLayout> out;
  for (const auto& g : r.table.gpus) {
    GroupLayout l;
    l.gpu_pci = g.pci;
    l.rule = topo::rule_name(g.rule);
    for (const auto& link : g.nics)
      for (size_t d : by_nic[static_cast<size_t>(link.nic)])
        if (l.devices.size() < static_cast<size_t>(kMaxNicsPerGroup)) l.devices.push_back(d);
    // The first of its cores that the calling thread may run on: a binding the application chose
    // (taskset, numactl, a launcher's --cpu-bind) is kept, as NCCL keeps it for its own threads.
    // None of them (the GPU's cores lie outside the binding): the worker keeps the caller's mask.
    for (int c : g.cpus)
      if (!have_mask || (c >= 0 && c < CPU_SETSIZE && CPU_ISSET(c, &allowed))) {
        l.cores = {c};
        break;
      }
    if (l.cores.empty() && !g.cpus.empty())
      PONTE_LOG_INFO("GPU %s: its %zu cores (first %d) are outside this thread's CPU affinity: its worker is "
                     "not pinned", g.pci.c_str(), g.cpus.size(), g.cpus.front());
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
