// TopologyLayout: per-GPU groups from an hwloc XML file, NICs matched to backend devices by PCI
// bus id whatever the device order or names.
#include <gtest/gtest.h>

#include <algorithm>

#include "core/topology_layout.h"
#include "topology/topology.h"

using namespace ponte;

static const std::string kFixtures = PONTE_TOPOLOGY_FIXTURES;

TEST(TopologyLayout, GroupsFollowTheTableByBusId) {
  Config cfg;
  cfg.topo_file = kFixtures + "/two_gpus_dual_port.xml";
  topo::Options o;
  o.xml_file = cfg.topo_file;
  auto r = topo::discover(o);
  ASSERT_TRUE(r.ok) << r.error;
  ASSERT_GE(r.table.gpus.size(), 2u);
  ASSERT_GE(r.table.nics.size(), 2u);
  // Backend devices in reverse order, with names unlike the table's, plus one without PCI (loopback).
  std::vector<NicInfo> devs;
  NicInfo lo;
  lo.name = "lo";
  devs.push_back(lo);
  for (size_t j = r.table.nics.size(); j-- > 0;) {
    NicInfo d;
    d.name = "dev" + std::to_string(j);
    d.pci_bus_id = r.table.nics[j].pci;
    devs.push_back(d);
  }
  auto layout = gpu_layout(devs, cfg);
  ASSERT_TRUE(layout.ok()) << layout.status().message();
  ASSERT_EQ(layout->size(), r.table.gpus.size());
  for (size_t g = 0; g < layout->size(); g++) {
    const auto& l = (*layout)[g];
    EXPECT_EQ(l.gpu_pci, r.table.gpus[g].pci);
    ASSERT_EQ(l.devices.size(), r.table.gpus[g].nics.size());
    for (size_t k = 0; k < l.devices.size(); k++)
      EXPECT_EQ(devs[l.devices[k]].pci_bus_id, r.table.nics[r.table.gpus[g].nics[k].nic].pci);
    if (!r.table.gpus[g].cpus.empty()) {
      ASSERT_EQ(l.cores.size(), 1u);
      EXPECT_EQ(l.cores[0], r.table.gpus[g].cpus[0]);
    }
  }
  // Two GPUs sharing a dual-port card get one port each.
  EXPECT_NE((*layout)[0].devices, (*layout)[1].devices);
}

TEST(TopologyLayout, NoMatchingDeviceOrNoGpuIsAnError) {
  Config cfg;
  cfg.topo_file = kFixtures + "/two_gpus_dual_port.xml";
  NicInfo lo;
  lo.name = "lo";
  auto none = gpu_layout({lo}, cfg);
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), Code::kNotFound);
  cfg.topo_file = kFixtures + "/efa_no_gpu.xml";
  auto nogpu = gpu_layout({lo}, cfg);
  ASSERT_FALSE(nogpu.ok());
  EXPECT_EQ(nogpu.status().code(), Code::kNotFound);
  cfg.topo_file = kFixtures + "/broken.xml";
  auto broken = gpu_layout({lo}, cfg);
  ASSERT_FALSE(broken.ok());
  EXPECT_EQ(broken.status().code(), Code::kUnavailable);
}
