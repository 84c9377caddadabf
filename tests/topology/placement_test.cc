// Placement policy on hand-built inventories (no hwloc): distances, the closest-ancestor rule, the
// even split and sharing of NICs, fallbacks, and the division of cores.
#include <gtest/gtest.h>

#include <set>

#include "tests/topology/topo_test_util.h"
#include "topology/placement.h"

namespace ponte::topo {
namespace {

using testing::gpu_nic_map;
using testing::has_warning;

// Builds inventories: bridges are named by small ids; `host` marks host bridges.
class Builder {
 public:
  Builder& gpu(const std::string& pci, int numa, int package, PciPath path) {
    Gpu g;
    g.pci = pci;
    g.numa = numa;
    g.package = package;
    inv_.gpus.push_back(g);
    inv_.gpu_paths.push_back(std::move(path));
    return *this;
  }
  Builder& nic(const std::string& pci, const std::string& name, int numa, int package, PciPath path) {
    Nic n;
    n.pci = pci;
    n.name = name;
    n.numa = numa;
    n.package = package;
    inv_.nics.push_back(n);
    inv_.nic_paths.push_back(std::move(path));
    return *this;
  }
  Builder& node(int os_index, int package, const std::vector<int>& cpus) {
    inv_.numa_nodes.push_back({os_index, package});
    for (int c : cpus) inv_.cores.push_back({c, os_index, package});
    return *this;
  }
  Table place() const { return ponte::topo::place(inv_); }
  Inventory& inventory() { return inv_; }

 private:
  Inventory inv_;
};

PciBridge br(uint64_t id) { return {id, false}; }
PciBridge hb(uint64_t id) { return {id, true}; }

TEST(PciDistance, Classes) {
  // One switch: downstream port (2 / 3) below the upstream port (1), root port 9, host bridge 100.
  const PciPath under_port_a{br(2), br(1), br(9), hb(100)};
  const PciPath under_port_b{br(3), br(1), br(9), hb(100)};
  EXPECT_EQ(pci_distance(under_port_a, 0, under_port_b, 0), Distance::kPIX);
  // Two functions under the same bridge.
  EXPECT_EQ(pci_distance(under_port_a, 0, under_port_a, 0), Distance::kPIX);
  // Nested switch below port 3: more than one switch between them.
  const PciPath nested{br(5), br(4), br(3), br(1), br(9), hb(100)};
  EXPECT_EQ(pci_distance(under_port_a, 0, nested, 0), Distance::kPXB);
  // Different root ports of one host bridge.
  const PciPath other_root{br(20), hb(100)};
  EXPECT_EQ(pci_distance(under_port_a, 0, other_root, 0), Distance::kPHB);
  // Different host bridges: NUMA decides.
  const PciPath other_host{br(30), hb(200)};
  EXPECT_EQ(pci_distance(under_port_a, 0, other_host, 0), Distance::kNODE);
  EXPECT_EQ(pci_distance(under_port_a, 0, other_host, 1), Distance::kSYS);
  EXPECT_EQ(pci_distance(under_port_a, -1, other_host, -1), Distance::kSYS);
  // Symmetric.
  EXPECT_EQ(pci_distance(nested, 0, under_port_a, 0), Distance::kPXB);
}

TEST(Placement, TwoGpusOneDualPortCardSplitOnePortEach) {
  Builder b;
  b.node(0, 0, {0, 1, 2, 3})
      .gpu("0000:03:00.0", 0, 0, {br(2), br(1), hb(100)})
      .gpu("0000:04:00.0", 0, 0, {br(3), br(1), hb(100)})
      .nic("0000:05:00.0", "mlx5_0", 0, 0, {br(4), br(1), hb(100)})
      .nic("0000:05:00.1", "mlx5_1", 0, 0, {br(4), br(1), hb(100)});
  const Table t = b.place();
  ASSERT_EQ(t.gpus.size(), 2u);
  EXPECT_EQ(t.gpus[0].rule, Rule::kSwitch);
  ASSERT_EQ(t.gpus[0].nics.size(), 1u);
  ASSERT_EQ(t.gpus[1].nics.size(), 1u);
  EXPECT_EQ(t.gpus[0].nics[0], (NicLink{0, Distance::kPIX}));
  EXPECT_EQ(t.gpus[1].nics[0], (NicLink{1, Distance::kPIX}));
  EXPECT_EQ(t.gpus[0].cpus, (std::vector<int>{0, 1}));
  EXPECT_EQ(t.gpus[1].cpus, (std::vector<int>{2, 3}));
  EXPECT_TRUE(t.warnings.empty()) << t.warnings.front();
}

TEST(Placement, OneGpuTakesBothPortsOfItsCard) {
  Builder b;
  b.node(0, 0, {0, 1})
      .gpu("0000:03:00.0", 0, 0, {br(2), br(1), hb(100)})
      .nic("0000:05:00.0", "mlx5_0", 0, 0, {br(4), br(1), hb(100)})
      .nic("0000:05:00.1", "mlx5_1", 0, 0, {br(4), br(1), hb(100)});
  const Table t = b.place();
  EXPECT_EQ(gpu_nic_map(t)["0000:03:00.0"], (std::vector<std::string>{"0000:05:00.0", "0000:05:00.1"}));
}

TEST(Placement, TwoGpusFourNicsTwoEachNoneShared) {
  Builder b;
  b.node(0, 0, {0, 1});
  b.gpu("0000:10:00.0", 0, 0, {br(2), br(1)}).gpu("0000:11:00.0", 0, 0, {br(3), br(1)});
  for (int i = 0; i < 4; ++i) {
    b.nic("0000:2" + std::to_string(i) + ":00.0", "mlx5_" + std::to_string(i), 0, 0, {br(10 + i), br(1)});
  }
  const Table t = b.place();
  std::set<int> seen;
  for (const Gpu& g : t.gpus) {
    ASSERT_EQ(g.nics.size(), 2u) << g.pci;
    for (const NicLink& l : g.nics) EXPECT_TRUE(seen.insert(l.nic).second) << "NIC given twice";
  }
  EXPECT_EQ(seen.size(), 4u);
}

TEST(Placement, FewerNicsThanGpusSharesEvenly) {
  Builder b;
  b.node(0, 0, {0, 1, 2});
  for (int i = 0; i < 3; ++i) b.gpu("0000:1" + std::to_string(i) + ":00.0", 0, 0, {br(10 + i), br(1)});
  b.nic("0000:20:00.0", "mlx5_0", 0, 0, {br(20), br(1)}).nic("0000:21:00.0", "mlx5_1", 0, 0, {br(21), br(1)});
  const Table t = b.place();
  std::map<int, int> users;
  for (const Gpu& g : t.gpus) {
    ASSERT_EQ(g.nics.size(), 1u) << "with fewer NICs than GPUs each GPU gets one";
    ++users[g.nics[0].nic];
  }
  EXPECT_EQ(users[0], 2);
  EXPECT_EQ(users[1], 1);
  EXPECT_EQ(t.gpus[0].nics[0].nic, 0);
  EXPECT_EQ(t.gpus[1].nics[0].nic, 1);
  EXPECT_EQ(t.gpus[2].nics[0].nic, 0);
  // One core each.
  EXPECT_EQ(t.gpus[0].cpus, std::vector<int>{0});
  EXPECT_EQ(t.gpus[2].cpus, std::vector<int>{2});
}

TEST(Placement, ClosestCommonAncestorWins) {
  // GPU and NIC A behind sub-switch 5; NIC B one level up, behind switch 1 only.
  Builder b;
  b.node(0, 0, {0})
      .gpu("0000:10:00.0", 0, 0, {br(6), br(5), br(1), hb(100)})
      .nic("0000:11:00.0", "mlx5_0", 0, 0, {br(7), br(5), br(1), hb(100)})
      .nic("0000:20:00.0", "mlx5_1", 0, 0, {br(8), br(1), hb(100)});
  const Table t = b.place();
  EXPECT_EQ(gpu_nic_map(t)["0000:10:00.0"], std::vector<std::string>{"0000:11:00.0"});
}

TEST(Placement, ConstrainedGpuChoosesFirst) {
  // GPU C and NIC C share sub-switch 5 under switch 1; GPUs A and B sit on switch 1 with NICs A, B.
  // A and B see {A, B, C} under switch 1; C sees only {C}: C keeps its NIC, A and B split A and B.
  Builder b;
  b.node(0, 0, {0, 1, 2})
      .gpu("0000:10:00.0", 0, 0, {br(2), br(1)})
      .gpu("0000:11:00.0", 0, 0, {br(3), br(1)})
      .gpu("0000:12:00.0", 0, 0, {br(6), br(5), br(1)})
      .nic("0000:20:00.0", "nicA", 0, 0, {br(8), br(1)})
      .nic("0000:21:00.0", "nicB", 0, 0, {br(9), br(1)})
      .nic("0000:22:00.0", "nicC", 0, 0, {br(7), br(5), br(1)});
  auto m = gpu_nic_map(b.place());
  EXPECT_EQ(m["0000:12:00.0"], std::vector<std::string>{"0000:22:00.0"});
  EXPECT_EQ(m["0000:10:00.0"], std::vector<std::string>{"0000:20:00.0"});
  EXPECT_EQ(m["0000:11:00.0"], std::vector<std::string>{"0000:21:00.0"});
}

TEST(Placement, FallbackRulesInOrder) {
  Builder b;
  b.node(0, 0, {0}).node(1, 0, {1}).node(2, 1, {2});
  b.gpu("0000:11:00.0", 0, 0, {br(1), hb(100)})     // switch with nic0
      .gpu("0000:20:00.0", 0, 0, {hb(200)})           // numa 0: nic1 is free there
      .gpu("0000:40:00.0", 1, 0, {hb(300)})           // package 0
      .gpu("0000:80:00.0", 2, 1, {hb(400)})           // any
      .nic("0000:12:00.0", "mlx5_0", 0, 0, {br(1), hb(100)})
      .nic("0000:30:00.0", "mlx5_1", 0, 0, {hb(500)});
  const Table t = b.place();
  EXPECT_EQ(t.gpus[0].rule, Rule::kSwitch);
  EXPECT_EQ(t.gpus[1].rule, Rule::kNuma);
  EXPECT_EQ(t.gpus[2].rule, Rule::kPackage);
  EXPECT_EQ(t.gpus[3].rule, Rule::kAny);
  EXPECT_EQ(t.gpus[0].nics, (std::vector<NicLink>{{0, Distance::kPIX}}));
  EXPECT_EQ(t.gpus[1].nics, (std::vector<NicLink>{{1, Distance::kNODE}}));
  EXPECT_EQ(t.gpus[2].nics, (std::vector<NicLink>{{0, Distance::kSYS}}));
  EXPECT_EQ(t.gpus[3].nics, (std::vector<NicLink>{{1, Distance::kSYS}}));
  EXPECT_TRUE(has_warning(t, "GPU 0000:20:00.0 shares no PCIe switch"));
  EXPECT_TRUE(has_warning(t, "placed by its package 0"));
  EXPECT_TRUE(has_warning(t, "placed on any NIC"));
  EXPECT_FALSE(has_warning(t, "GPU 0000:11:00.0"));
}

TEST(Placement, NoNicMeansRuleNoneAndAWarning) {
  Builder b;
  b.node(0, 0, {0, 1}).gpu("0000:01:00.0", 0, 0, {hb(1)});
  const Table t = b.place();
  EXPECT_EQ(t.gpus[0].rule, Rule::kNone);
  EXPECT_TRUE(t.gpus[0].nics.empty());
  EXPECT_EQ(t.gpus[0].cpus, (std::vector<int>{0, 1}));
  EXPECT_TRUE(has_warning(t, "no RDMA NIC"));
  ASSERT_EQ(t.host_groups.size(), 1u);
  EXPECT_TRUE(t.host_groups[0].nics.empty());
}

TEST(Placement, NoGpuGivesHostGroupsOnly) {
  Builder b;
  b.node(0, 0, {0, 1}).node(1, 1, {2, 3}).nic("0000:10:00.0", "efa0", 1, 1, {hb(1)});
  b.nic("0000:90:00.0", "efa1", 0, 0, {hb(2)});
  const Table t = b.place();
  EXPECT_TRUE(t.gpus.empty());
  EXPECT_TRUE(has_warning(t, "no NVIDIA GPU"));
  ASSERT_EQ(t.host_groups.size(), 2u);
  // Node 0: its own NIC (index 1) first.
  EXPECT_EQ(t.host_groups[0].nics, (std::vector<NicLink>{{1, Distance::kPHB}, {0, Distance::kSYS}}));
  EXPECT_EQ(t.host_groups[1].nics, (std::vector<NicLink>{{0, Distance::kPHB}, {1, Distance::kSYS}}));
  EXPECT_EQ(t.host_groups[0].cpus, (std::vector<int>{1, 0}));
  EXPECT_EQ(t.host_groups[1].cpus, (std::vector<int>{3, 2}));
}

TEST(Placement, CoresDividedAmongTheNodesGpus) {
  Builder b;
  b.node(0, 0, {0, 1, 2, 3, 4});
  b.gpu("0000:01:00.0", 0, 0, {hb(1)}).gpu("0000:02:00.0", 0, 0, {hb(2)});
  const Table t = b.place();
  EXPECT_EQ(t.gpus[0].cpus, (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(t.gpus[1].cpus, (std::vector<int>{3, 4}));
  EXPECT_EQ(t.host_groups[0].cpus, (std::vector<int>{4, 3, 2, 1, 0}));
}

TEST(Placement, UnknownNumaAndCorelessNodesFallBackToThePackage) {
  Builder b;
  b.node(0, 0, {0, 1}).node(1, 1, {2, 3});
  b.inventory().numa_nodes.push_back({2, 1});  // memory only (HBM, CXL)
  b.gpu("0000:01:00.0", -1, 1, {hb(1)});
  const Table t = b.place();
  EXPECT_EQ(t.gpus[0].cpus, (std::vector<int>{2, 3}));
  EXPECT_TRUE(has_warning(t, "GPU 0000:01:00.0: NUMA node unknown"));
  ASSERT_EQ(t.host_groups.size(), 3u);
  EXPECT_EQ(t.host_groups[2].numa, 2);
  EXPECT_EQ(t.host_groups[2].cpus, (std::vector<int>{3, 2}));
  EXPECT_TRUE(has_warning(t, "NUMA node 2 has no cores of its own"));
}

TEST(Placement, EmptyInventoryDegradesWithoutCrashing) {
  const Table t = place(Inventory{});
  EXPECT_TRUE(t.gpus.empty());
  EXPECT_TRUE(t.nics.empty());
  ASSERT_EQ(t.host_groups.size(), 1u);
  EXPECT_EQ(t.host_groups[0].numa, -1);
  EXPECT_TRUE(has_warning(t, "no CPU cores"));
  EXPECT_TRUE(has_warning(t, "no NUMA node"));
}

TEST(Placement, SameInputSameTable) {
  Builder b;
  b.node(0, 0, {0, 1}).gpu("0000:01:00.0", 0, 0, {br(1)}).nic("0000:02:00.0", "mlx5_0", 0, 0, {br(1)});
  EXPECT_EQ(b.place(), b.place());
}

}  // namespace
}  // namespace ponte::topo
