// Discovery on real machines' hwloc exports in ../shared/data/topologies/ (read at run time, never
// copied): the GPU -> NIC mapping each should give, by PCI bus id. A missing folder fails the test.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <set>

#include "tests/topology/topo_test_util.h"
#include "topology/topology.h"

namespace ponte::topo {
namespace {

using testing::expect_well_formed;
using testing::gpu_by_pci;
using testing::gpu_nic_map;
using testing::has_warning;
using testing::real_machine;
using testing::real_machines_dir;

class RealMachine : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(std::filesystem::is_directory(real_machines_dir()))
        << "the real-machine topologies are missing: " << real_machines_dir()
        << " (../shared/data/topologies next to the project) must exist";
  }

  static Table load(const std::string& name) {
    const Result r = discover(Options{real_machine(name)});
    EXPECT_TRUE(r.ok) << name << ": " << r.error;
    expect_well_formed(r.table);
    return r.table;
  }

  // Expects the GPU to take exactly these NICs, by this rule, at this distance.
  static void expect_gpu(const Table& t, const std::string& gpu, Rule rule,
                         const std::vector<std::string>& nics, Distance distance) {
    const Gpu* g = gpu_by_pci(t, gpu);
    ASSERT_NE(g, nullptr) << "no GPU " << gpu;
    EXPECT_EQ(g->rule, rule) << gpu << ": rule " << rule_name(g->rule);
    EXPECT_EQ(gpu_nic_map(t)[gpu], nics) << gpu;
    for (const NicLink& l : g->nics) {
      EXPECT_EQ(l.distance, distance) << gpu << ": " << distance_name(l.distance);
    }
  }

  static std::string name_of(const Table& t, const std::string& pci) {
    const int i = find_nic(t, pci);
    return i < 0 ? "" : t.nics[static_cast<size_t>(i)].name;
  }
};

// JUWELS Booster: four A100, four ConnectX-6, each GPU with one NIC behind its PCIe switch.
void expect_juwels_booster_layout(const Table& t, size_t cores_per_node) {
  ASSERT_EQ(t.gpus.size(), 4u);
  ASSERT_EQ(t.nics.size(), 4u);
  const std::map<std::string, std::string> pairs = {
      {"0000:03:00.0", "0000:04:00.0"},
      {"0000:44:00.0", "0000:43:00.0"},
      {"0000:84:00.0", "0000:83:00.0"},
      {"0000:c4:00.0", "0000:c3:00.0"},
  };
  const std::map<std::string, int> numa = {
      {"0000:03:00.0", 3}, {"0000:44:00.0", 1}, {"0000:84:00.0", 7}, {"0000:c4:00.0", 5}};
  for (const auto& [gpu, nic] : pairs) {
    const Gpu* g = gpu_by_pci(t, gpu);
    ASSERT_NE(g, nullptr) << gpu;
    EXPECT_EQ(g->rule, Rule::kSwitch) << gpu;
    EXPECT_EQ(gpu_nic_map(t)[gpu], std::vector<std::string>{nic}) << gpu;
    ASSERT_EQ(g->nics.size(), 1u);
    EXPECT_EQ(g->nics[0].distance, Distance::kPIX) << gpu;
    EXPECT_EQ(g->numa, numa.at(gpu)) << gpu;
    EXPECT_EQ(t.nics[static_cast<size_t>(g->nics[0].nic)].numa, numa.at(gpu));
    EXPECT_EQ(g->cpus.size(), cores_per_node) << gpu << ": all cores of its NUMA node";
  }
  EXPECT_EQ(gpu_by_pci(t, "0000:62:00.0"), nullptr) << "the ASPEED VGA (1a03) is no GPU";
  EXPECT_EQ(t.host_groups.size(), 8u);
}

TEST_F(RealMachine, JuwelsBoosterHwloc111Export) {
  const Table t = load("topo.jwb0001.xml");  // hwloc 1.11 export
  expect_juwels_booster_layout(t, 6);
  EXPECT_EQ(name_of(t, "0000:43:00.0"), "mlx5_0");
  EXPECT_EQ(name_of(t, "0000:04:00.0"), "mlx5_1");
  EXPECT_EQ(t.nics[static_cast<size_t>(find_nic(t, "0000:43:00.0"))].other_names,
            std::vector<std::string>{"ib0"});
  EXPECT_TRUE(t.warnings.empty()) << t.warnings.front();
}

TEST_F(RealMachine, JuwelsBoosterSameMappingByBusIdThoughNamesDiffer) {
  const Table a = load("topo.jwb0001.xml");
  const Table b = load("topo.jwb0004.xml");
  expect_juwels_booster_layout(b, 6);
  EXPECT_EQ(gpu_nic_map(a), gpu_nic_map(b));
  // The names are swapped between the two nodes: mapping by name would pair the wrong NICs.
  EXPECT_EQ(name_of(a, "0000:43:00.0"), "mlx5_0");
  EXPECT_EQ(name_of(b, "0000:43:00.0"), "mlx5_1");
  EXPECT_EQ(name_of(a, "0000:04:00.0"), "mlx5_1");
  EXPECT_EQ(name_of(b, "0000:04:00.0"), "mlx5_0");
  int differing = 0;
  for (const Nic& n : a.nics) differing += name_of(b, n.pci) != n.name;
  EXPECT_EQ(differing, 4);
  for (size_t i = 0; i < a.gpus.size(); ++i) {
    EXPECT_EQ(a.gpus[i].cpus, b.gpus[i].cpus) << a.gpus[i].pci;
    EXPECT_EQ(a.gpus[i].rule, b.gpus[i].rule);
  }
}

TEST_F(RealMachine, JurecaDcOneNicPerGpu) {
  const Table t = load("topo.jrc0386.xml");
  expect_juwels_booster_layout(t, 16);
  std::set<int> used;
  for (const Gpu& g : t.gpus) used.insert(g.nics.at(0).nic);
  EXPECT_EQ(used.size(), 4u) << "no NIC shared";
}

TEST_F(RealMachine, JuwelsClusterTwoGpusShareEachNic) {
  const Table t = load("topo.jwc09n003.xml");
  ASSERT_EQ(t.gpus.size(), 4u);
  ASSERT_EQ(t.nics.size(), 2u);
  expect_gpu(t, "0000:5d:00.0", Rule::kSwitch, {"0000:5f:00.0"}, Distance::kPIX);
  expect_gpu(t, "0000:5e:00.0", Rule::kSwitch, {"0000:5f:00.0"}, Distance::kPIX);
  expect_gpu(t, "0000:88:00.0", Rule::kSwitch, {"0000:8a:00.0"}, Distance::kPIX);
  expect_gpu(t, "0000:89:00.0", Rule::kSwitch, {"0000:8a:00.0"}, Distance::kPIX);
  // The two GPUs of a socket divide its cores.
  const Gpu* a = gpu_by_pci(t, "0000:5d:00.0");
  const Gpu* b = gpu_by_pci(t, "0000:5e:00.0");
  ASSERT_TRUE(a && b);
  EXPECT_EQ(a->cpus.size(), b->cpus.size());
  for (int c : a->cpus) EXPECT_EQ(std::count(b->cpus.begin(), b->cpus.end(), c), 0) << "core shared";
}

TEST_F(RealMachine, MeluxinaFallsBackToThePackage) {
  const Table t = load("topo.mel2001.xml");
  ASSERT_EQ(t.gpus.size(), 4u);
  ASSERT_EQ(t.nics.size(), 2u);
  expect_gpu(t, "0000:44:00.0", Rule::kSwitch, {"0000:43:00.0"}, Distance::kPIX);
  expect_gpu(t, "0000:84:00.0", Rule::kSwitch, {"0000:83:00.0"}, Distance::kPIX);
  // GPU 03 (NUMA 3) and c3 (NUMA 5) share no switch with a NIC, and their nodes have none.
  expect_gpu(t, "0000:03:00.0", Rule::kPackage, {"0000:43:00.0"}, Distance::kSYS);
  expect_gpu(t, "0000:c3:00.0", Rule::kPackage, {"0000:83:00.0"}, Distance::kSYS);
  EXPECT_TRUE(has_warning(t, "GPU 0000:03:00.0 shares no PCIe switch"));
  EXPECT_TRUE(has_warning(t, "GPU 0000:c3:00.0 shares no PCIe switch"));
  EXPECT_EQ(gpu_by_pci(t, "0000:03:00.0")->numa, 3);
}

TEST_F(RealMachine, AwsG4dnMetalEfa) {
  const Table t = load("g4dnmetal.xml");
  ASSERT_EQ(t.gpus.size(), 8u);
  ASSERT_EQ(t.nics.size(), 1u);
  EXPECT_EQ(t.nics[0].name, "rdmap197s0");
  EXPECT_EQ(t.nics[0].pci, "0000:c5:00.0");
  EXPECT_EQ(t.nics[0].vendor_id, 0x1d0f);
  EXPECT_EQ(t.nics[0].numa, 1);
  for (const char* gpu : {"0000:e7:00.0", "0000:e8:00.0", "0000:f4:00.0", "0000:f5:00.0"}) {
    expect_gpu(t, gpu, Rule::kNuma, {"0000:c5:00.0"}, Distance::kNODE);
  }
  for (const char* gpu : {"0000:18:00.0", "0000:19:00.0", "0000:35:00.0", "0000:36:00.0"}) {
    expect_gpu(t, gpu, Rule::kAny, {"0000:c5:00.0"}, Distance::kSYS);
  }
  // 24 cores per socket, four GPUs each: six cores apiece.
  for (const Gpu& g : t.gpus) EXPECT_EQ(g.cpus.size(), 6u) << g.pci;
  EXPECT_EQ(t.host_groups.at(1).nics.at(0).distance, Distance::kPHB);
  EXPECT_EQ(t.host_groups.at(0).nics.at(0).distance, Distance::kSYS);
}

TEST_F(RealMachine, LassenDualPortCardsSplitOnePortPerGpu) {
  const Table t = load("coral-lassen.xml");
  ASSERT_EQ(t.gpus.size(), 4u);
  ASSERT_EQ(t.nics.size(), 4u);
  expect_gpu(t, "0004:04:00.0", Rule::kNuma, {"0003:01:00.0"}, Distance::kNODE);
  expect_gpu(t, "0004:05:00.0", Rule::kNuma, {"0003:01:00.1"}, Distance::kNODE);
  expect_gpu(t, "0035:03:00.0", Rule::kNuma, {"0033:01:00.0"}, Distance::kNODE);
  expect_gpu(t, "0035:04:00.0", Rule::kNuma, {"0033:01:00.1"}, Distance::kNODE);
  EXPECT_EQ(gpu_by_pci(t, "0035:03:00.0")->numa, 8) << "POWER9 socket 1 is NUMA node 8";
  ASSERT_EQ(t.host_groups.size(), 2u);
  EXPECT_EQ(t.host_groups[1].numa, 8);
  // SMT4: one logical CPU per physical core.
  for (int cpu : gpu_by_pci(t, "0004:04:00.0")->cpus) EXPECT_EQ(cpu % 4, 0) << cpu;
}

TEST_F(RealMachine, PascalBothGpusUnderTheNicsSwitch) {
  const Table t = load("cts1-pascal.xml");
  ASSERT_EQ(t.gpus.size(), 2u);
  expect_gpu(t, "0000:04:00.0", Rule::kSwitch, {"0000:08:00.0"}, Distance::kPIX);
  expect_gpu(t, "0000:07:00.0", Rule::kSwitch, {"0000:08:00.0"}, Distance::kPIX);
  EXPECT_EQ(t.gpus[0].cpus, (std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7, 8}));
  EXPECT_EQ(t.gpus[1].cpus, (std::vector<int>{9, 10, 11, 12, 13, 14, 15, 16, 17}));
}

TEST_F(RealMachine, Dgx2WithoutNicsDegrades) {
  const Table t = load("nvidiaDGX2.v2x.xml");
  EXPECT_EQ(t.gpus.size(), 16u) << "the NVSwitches (class 0680) are no GPUs";
  EXPECT_TRUE(t.nics.empty());
  for (const Gpu& g : t.gpus) EXPECT_EQ(g.rule, Rule::kNone);
  EXPECT_TRUE(has_warning(t, "no RDMA NIC"));
}

TEST_F(RealMachine, BuildVmHostGroupsOnly) {
  const Table t = load("local_vm.xml");
  EXPECT_TRUE(t.gpus.empty());
  EXPECT_TRUE(t.nics.empty());
  ASSERT_EQ(t.host_groups.size(), 1u);
  EXPECT_EQ(t.host_groups[0].cpus, (std::vector<int>{1, 0}));
  EXPECT_TRUE(has_warning(t, "no NVIDIA GPU"));
  EXPECT_TRUE(has_warning(t, "no RDMA NIC"));
}

TEST_F(RealMachine, EveryExportLoads) {
  int loaded = 0;
  for (const auto& entry : std::filesystem::directory_iterator(real_machines_dir())) {
    if (entry.path().extension() != ".xml") continue;
    SCOPED_TRACE(entry.path().string());
    load(entry.path().filename().string());
    ++loaded;
  }
  EXPECT_GE(loaded, 10);
}

TEST_F(RealMachine, NcclFormatFileIsRejectedClearly) {
  const std::string path = real_machine("nccl-format/ndv5-topo.xml");
  ASSERT_TRUE(std::filesystem::exists(path)) << path;
  const Result r = discover(Options{path});
  EXPECT_FALSE(r.ok);
  EXPECT_NE(r.error.find("not an hwloc XML export"), std::string::npos) << r.error;
}

}  // namespace
}  // namespace ponte::topo
