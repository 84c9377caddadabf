// TopologyLayout: per-GPU groups from an hwloc XML file, NICs matched to backend devices by PCI
// bus id whatever the device order or names.
#include <gtest/gtest.h>

#include <sched.h>

#include <algorithm>

#include "core/topology_layout.h"
#include "topology/topology.h"

using namespace ponte;

static const std::string kFixtures = PONTE_TOPOLOGY_FIXTURES;

// The first of cpus the calling thread's affinity allows, or -1.
static int first_allowed(const std::vector<int>& cpus) {
  cpu_set_t mask;
  CPU_ZERO(&mask);
  if (sched_getaffinity(0, sizeof(mask), &mask) != 0) return cpus.empty() ? -1 : cpus[0];
  for (int c : cpus)
    if (c >= 0 && c < CPU_SETSIZE && CPU_ISSET(c, &mask)) return c;
  return -1;
}

static std::vector<NicInfo> table_devices(const topo::Table& t) {
  std::vector<NicInfo> devs;
  for (const auto& n : t.nics) {
    NicInfo d;
    d.name = n.pci;
    d.pci_bus_id = n.pci;
    devs.push_back(d);
  }
  return devs;
}

// The fixture both tests read: two GPUs sharing a dual-port card, four cores.
static topo::Result two_gpus(Config* cfg) {
  cfg->topo_file = kFixtures + "/two_gpus_dual_port.xml";
  topo::Options o;
  o.xml_file = cfg->topo_file;
  return topo::discover(o);
}

TEST(TopologyLayout, GroupsFollowTheTableByBusId) {
  Config cfg;
  auto r = two_gpus(&cfg);
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
    // The first of its cores this thread may run on (this host's 2 cores against the file's 4).
    const int want = first_allowed(r.table.gpus[g].cpus);
    if (want >= 0) {
      ASSERT_EQ(l.cores.size(), 1u);
      EXPECT_EQ(l.cores[0], want);
    } else {
      EXPECT_TRUE(l.cores.empty()) << "GPU " << g << " pinned to core " << l.cores[0] << " outside our affinity";
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

// A binding the application chose (taskset, numactl) is kept: the worker goes on the first of its
// GPU's cores inside the creating thread's affinity, and is not pinned when none is. Run with this
// thread bound to each of the file's four cores in turn that this host lets it run on (the file's
// two GPUs split them).
TEST(TopologyLayout, WorkersStayInsideTheCallersCpuAffinity) {
  Config cfg;
  auto r = two_gpus(&cfg);
  ASSERT_TRUE(r.ok) << r.error;
  ASSERT_EQ(r.table.gpus.size(), 2u);
  cpu_set_t saved;
  ASSERT_EQ(sched_getaffinity(0, sizeof(saved), &saved), 0);
  int checked = 0;
  for (int core = 0; core < 4; core++) {
    if (!CPU_ISSET(core, &saved)) continue;
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(core, &one);
    ASSERT_EQ(sched_setaffinity(0, sizeof(one), &one), 0);
    auto layout = gpu_layout(table_devices(r.table), cfg);
    ASSERT_EQ(sched_setaffinity(0, sizeof(saved), &saved), 0);
    ASSERT_TRUE(layout.ok()) << layout.status().message();
    for (size_t g = 0; g < 2; g++) {
      const auto& cpus = r.table.gpus[g].cpus;
      const bool near = std::find(cpus.begin(), cpus.end(), core) != cpus.end();
      if (near) {
        EXPECT_EQ((*layout)[g].cores, std::vector<int>{core}) << "GPU " << g << ", bound to core " << core;
      } else {
        EXPECT_TRUE((*layout)[g].cores.empty()) << "GPU " << g << " pinned to " << (*layout)[g].cores[0]
                                                << " while bound to core " << core;
      }
      checked += near ? 1 : 0;
    }
  }
  EXPECT_GE(checked, 1) << "this thread may run on none of cores 0..3, or no GPU of the file has them";
}
