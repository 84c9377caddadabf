// Discovery from ponte's own small hwloc XML fixtures (tests/topology/fixtures/): the even split,
// each fallback rule, a host without NIC, one without GPU, and clear errors for bad files.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "tests/topology/topo_test_util.h"
#include "topology/topology.h"

namespace ponte::topo {
namespace {

using testing::expect_well_formed;
using testing::fixture;
using testing::has_warning;

Table load(const std::string& name) {
  const Result r = discover(Options{fixture(name)});
  EXPECT_TRUE(r.ok) << name << ": " << r.error;
  EXPECT_EQ(r.source, fixture(name));
  return r.table;
}

TEST(Fixtures, TwoGpusDualPortCardExactTable) {
  const Table t = load("two_gpus_dual_port.xml");
  Table want;
  Nic port0;
  port0.pci = "0000:05:00.0";
  port0.name = "mlx5_0";
  port0.other_names = {"ib0"};
  port0.vendor_id = 0x15b3;
  port0.device_id = 0x101b;
  port0.numa = 0;
  port0.package = 0;
  port0.pci_link_gbytes = t.nics.empty() ? 0 : t.nics[0].pci_link_gbytes;
  Nic port1 = port0;
  port1.pci = "0000:05:00.1";
  port1.name = "mlx5_1";
  port1.other_names = {"ib1"};
  want.nics = {port0, port1};
  Gpu gpu0;
  gpu0.pci = "0000:03:00.0";
  gpu0.device_id = 0x2330;
  gpu0.numa = 0;
  gpu0.package = 0;
  gpu0.nics = {{0, Distance::kPIX}};
  gpu0.cpus = {0, 1};
  gpu0.rule = Rule::kSwitch;
  Gpu gpu1 = gpu0;
  gpu1.pci = "0000:04:00.0";
  gpu1.nics = {{1, Distance::kPIX}};
  gpu1.cpus = {2, 3};
  want.gpus = {gpu0, gpu1};
  HostGroup host;
  host.numa = 0;
  host.package = 0;
  host.nics = {{0, Distance::kPHB}, {1, Distance::kPHB}};
  host.cpus = {3, 2, 1, 0};
  want.host_groups = {host};
  EXPECT_EQ(t, want) << to_json(t);
  EXPECT_NEAR(t.nics.at(0).pci_link_gbytes, 31.5, 0.1);
  expect_well_formed(t);
}

TEST(Fixtures, EachFallbackRule) {
  const Table t = load("fallbacks.xml");
  expect_well_formed(t);
  ASSERT_EQ(t.gpus.size(), 4u);
  ASSERT_EQ(t.nics.size(), 2u);
  const int mlx5_0 = find_nic(t, "0000:12:00.0");
  const int mlx5_1 = find_nic(t, "0000:30:00.0");
  ASSERT_GE(mlx5_0, 0);
  ASSERT_GE(mlx5_1, 0);
  struct Want {
    const char* gpu;
    Rule rule;
    int nic;
    Distance distance;
    int numa;
    std::vector<int> cpus;
  };
  const Want wants[] = {
      {"0000:11:00.0", Rule::kSwitch, mlx5_0, Distance::kPIX, 0, {0}},
      {"0000:20:00.0", Rule::kNuma, mlx5_1, Distance::kNODE, 0, {1}},
      {"0000:40:00.0", Rule::kPackage, mlx5_0, Distance::kSYS, 1, {2, 3}},
      {"0000:80:00.0", Rule::kAny, mlx5_1, Distance::kSYS, 2, {4, 5}},
  };
  for (const Want& w : wants) {
    const Gpu* g = testing::gpu_by_pci(t, w.gpu);
    ASSERT_NE(g, nullptr) << w.gpu;
    EXPECT_EQ(g->rule, w.rule) << w.gpu << " rule " << rule_name(g->rule);
    EXPECT_EQ(g->nics, (std::vector<NicLink>{{w.nic, w.distance}})) << w.gpu;
    EXPECT_EQ(g->numa, w.numa) << w.gpu;
    EXPECT_EQ(g->cpus, w.cpus) << w.gpu;
  }
  ASSERT_EQ(t.host_groups.size(), 4u);
  EXPECT_EQ(t.host_groups[0].nics[0].distance, Distance::kPHB);
  EXPECT_EQ(t.host_groups[1].nics[0].distance, Distance::kSYS);
  EXPECT_EQ(t.host_groups[3].numa, 3);
  EXPECT_EQ(t.host_groups[3].package, 1);
  EXPECT_EQ(t.host_groups[3].cpus, (std::vector<int>{7, 6}));
  EXPECT_TRUE(has_warning(t, "GPU 0000:20:00.0 shares no PCIe switch with any NIC; placed by its NUMA node 0"));
  EXPECT_TRUE(has_warning(t, "GPU 0000:40:00.0"));
  EXPECT_TRUE(has_warning(t, "GPU 0000:80:00.0"));
  EXPECT_FALSE(has_warning(t, "GPU 0000:11:00.0"));
}

TEST(Fixtures, GpusWithoutNic) {
  const Table t = load("gpus_no_nic.xml");
  expect_well_formed(t);
  ASSERT_EQ(t.gpus.size(), 2u) << "class 0300 (VGA) and 0302 (3D) NVIDIA functions are both GPUs";
  EXPECT_TRUE(t.nics.empty()) << "an Ethernet port without OpenFabrics device is no RDMA NIC";
  for (const Gpu& g : t.gpus) {
    EXPECT_EQ(g.rule, Rule::kNone);
    EXPECT_TRUE(g.nics.empty());
  }
  EXPECT_EQ(t.gpus[0].cpus, std::vector<int>{0});
  EXPECT_EQ(t.gpus[1].cpus, std::vector<int>{1});
  EXPECT_TRUE(has_warning(t, "no RDMA NIC"));
}

TEST(Fixtures, EfaHostWithoutGpu) {
  const Table t = load("efa_no_gpu.xml");
  expect_well_formed(t);
  EXPECT_TRUE(t.gpus.empty()) << "an NVSwitch (class 0680) is no GPU";
  ASSERT_EQ(t.nics.size(), 1u) << "the ENA port has no OpenFabrics device; rxe0 has no PCI function";
  EXPECT_EQ(t.nics[0].name, "rdmap16s27");
  EXPECT_EQ(t.nics[0].pci, "0000:10:1b.0");
  EXPECT_EQ(t.nics[0].vendor_id, 0x1d0f);
  EXPECT_TRUE(t.nics[0].other_names.empty());
  ASSERT_EQ(t.host_groups.size(), 2u);
  EXPECT_EQ(t.host_groups[0].nics, (std::vector<NicLink>{{0, Distance::kPHB}}));
  EXPECT_EQ(t.host_groups[1].nics, (std::vector<NicLink>{{0, Distance::kSYS}}));
  EXPECT_EQ(t.host_groups[1].cpus, (std::vector<int>{3, 2}));
  EXPECT_TRUE(has_warning(t, "no NVIDIA GPU"));
  EXPECT_TRUE(has_warning(t, "RDMA device rxe0 is not a PCI function"));
  EXPECT_EQ(find_nic(t, "10:1b.0"), 0);
  EXPECT_EQ(find_nic(t, "0000:10:1B.0"), 0);
  EXPECT_EQ(find_nic(t, "0000:10:1c.0"), -1);
}

TEST(Fixtures, SameFileSameTable) {
  EXPECT_EQ(load("fallbacks.xml"), load("fallbacks.xml"));
}

void expect_error(const std::string& path, const std::string& part) {
  const Result r = discover(Options{path});
  EXPECT_FALSE(r.ok) << path;
  EXPECT_NE(r.error.find(part), std::string::npos) << "error was: " << r.error;
  EXPECT_TRUE(r.table.gpus.empty());
}

TEST(FixtureErrors, MissingFile) {
  expect_error(fixture("no-such-file.xml"), "cannot read topology file");
  expect_error(fixture("no-such-file.xml"), "No such file");
}

TEST(FixtureErrors, Directory) { expect_error(PONTE_TOPO_FIXTURES_DIR, "cannot read topology file"); }

TEST(FixtureErrors, EmptyFile) {
  const std::string path = testing::scratch("empty.xml");
  { std::ofstream(path).flush(); }
  expect_error(path, "is empty");
  std::remove(path.c_str());
}

TEST(FixtureErrors, Truncated) { expect_error(fixture("broken.xml"), "not a valid hwloc XML"); }

TEST(FixtureErrors, XmlVersion3) { expect_error(fixture("version3.xml"), "XML v3"); }

TEST(FixtureErrors, NotATopology) {
  const std::string path = testing::scratch("not-topology.xml");
  {
    std::ofstream out(path);
    out << "<?xml version=\"1.0\"?>\n<system version=\"1\"><cpu numaid=\"0\"/></system>\n";
  }
  expect_error(path, "not an hwloc XML export");
  std::remove(path.c_str());
}

TEST(FixtureErrors, UnreadableFile) {
  // A directory cannot be read as a file, by root too (CI runs as root, so permissions would not do).
  const std::string path = testing::scratch("a-directory.xml");
  std::filesystem::create_directories(path);
  Options o;
  o.xml_file = path;
  Result r = discover(o);
  EXPECT_FALSE(r.ok);
  EXPECT_FALSE(r.error.empty());
  std::filesystem::remove(path);
}

}  // namespace
}  // namespace ponte::topo
