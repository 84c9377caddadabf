// Discovery on the live host, checked against what sysfs says on its own (GPUs, RDMA devices,
// NUMA nodes, physical cores), and against XML exports of this same host (hwloc's own export and
// lstopo's): both inputs must give the same table.
#include <gtest/gtest.h>
#include <hwloc.h>
#include <sched.h>

#include <cstdio>
#include <filesystem>
#include <set>

#include "tests/topology/topo_test_util.h"
#include "topology/topology.h"

namespace ponte::topo {
namespace {

namespace fs = std::filesystem;
using testing::expect_well_formed;
using testing::has_warning;
using testing::read_file;

Table live() {
  const Result r = discover(Options{});
  EXPECT_TRUE(r.ok) << r.error;
  EXPECT_EQ(r.source, "live host");
  return r.table;
}

unsigned long hex_file(const fs::path& p) { return std::strtoul(read_file(p).c_str(), nullptr, 16); }

// NVIDIA display / 3D controllers as sysfs lists them.
std::set<std::string> sysfs_gpus() {
  std::set<std::string> out;
  const fs::path root = "/sys/bus/pci/devices";
  if (!fs::is_directory(root)) return out;
  for (const auto& dev : fs::directory_iterator(root)) {
    const unsigned long klass = hex_file(dev.path() / "class") >> 8;
    if (hex_file(dev.path() / "vendor") == 0x10de && (klass == 0x0300 || klass == 0x0302)) {
      out.insert(normalize_pci_bus_id(dev.path().filename().string()));
    }
  }
  return out;
}

// RDMA devices backed by a PCI function: (bus id, name).
std::set<std::pair<std::string, std::string>> sysfs_rdma_nics() {
  std::set<std::pair<std::string, std::string>> out;
  const fs::path root = "/sys/class/infiniband";
  if (!fs::is_directory(root)) return out;
  for (const auto& dev : fs::directory_iterator(root)) {
    std::error_code ec;
    const fs::path target = fs::canonical(dev.path() / "device", ec);
    if (ec) continue;  // SoftRoCE / siw: no device
    const std::string pci = normalize_pci_bus_id(target.filename().string());
    if (!pci.empty() && fs::exists(target / "vendor")) out.insert({pci, dev.path().filename().string()});
  }
  return out;
}

// Physical cores (package, core id) of the CPUs this process may run on, and those CPUs.
std::set<std::pair<int, int>> allowed_cores(std::set<int>& cpus) {
  cpu_set_t set;
  CPU_ZERO(&set);
  EXPECT_EQ(sched_getaffinity(0, sizeof(set), &set), 0);
  std::set<std::pair<int, int>> cores;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (!CPU_ISSET(cpu, &set)) continue;
    cpus.insert(cpu);
    const fs::path topo = "/sys/devices/system/cpu/cpu" + std::to_string(cpu) + "/topology";
    const int package = std::atoi(read_file(topo / "physical_package_id").c_str());
    const int core = std::atoi(read_file(topo / "core_id").c_str());
    cores.insert({package, core});
  }
  return cores;
}

TEST(LiveHost, MatchesSysfs) {
  const Table t = live();
  expect_well_formed(t);

  std::set<std::string> gpus;
  for (const Gpu& g : t.gpus) gpus.insert(g.pci);
  EXPECT_EQ(gpus, sysfs_gpus());
  if (t.gpus.empty()) {
    EXPECT_TRUE(has_warning(t, "no NVIDIA GPU")) << "a GPU-less host must say so";
  }

  std::set<std::pair<std::string, std::string>> nics;
  for (const Nic& n : t.nics) nics.insert({n.pci, n.name});
  EXPECT_EQ(nics, sysfs_rdma_nics());
  if (t.nics.empty()) {
    EXPECT_TRUE(has_warning(t, "no RDMA NIC")) << "a NIC-less host must say so";
  }

  if (fs::is_directory("/sys/bus/pci/devices") && !fs::is_empty("/sys/bus/pci/devices")) {
    EXPECT_FALSE(has_warning(t, "no PCI device")) << "sysfs lists PCI devices: hwloc must see them";
  }

  int nodes = 0;
  if (fs::is_directory("/sys/devices/system/node")) {
    for (const auto& e : fs::directory_iterator("/sys/devices/system/node")) {
      const std::string name = e.path().filename().string();
      nodes += name.rfind("node", 0) == 0 && name.size() > 4 && std::isdigit(static_cast<unsigned char>(name[4]));
    }
  }
  EXPECT_EQ(t.host_groups.size(), static_cast<size_t>(std::max(nodes, 1)));

  // One logical CPU per allowed physical core across the host groups, each one we may run on.
  std::set<int> allowed;
  const std::set<std::pair<int, int>> cores = allowed_cores(allowed);
  std::set<int> placed;
  for (const HostGroup& h : t.host_groups) {
    for (int cpu : h.cpus) {
      EXPECT_TRUE(allowed.count(cpu)) << "cpu " << cpu << " is outside this process's affinity";
      placed.insert(cpu);
    }
  }
  EXPECT_EQ(placed.size(), cores.size());
}

// Exports the live host with hwloc itself (I/O filter KEEP_ALL, as discovery uses); lstopo's
// exports below use hwloc's default components.
std::string export_with_hwloc(const std::string& path) {
  hwloc_topology_t topo = nullptr;
  if (hwloc_topology_init(&topo) != 0) return "hwloc_topology_init failed";
  std::string error;
  // As discovery does: libpciaccess's plugin leaks its name tables (LeakSanitizer would fail us).
  for (const char* plugin : {"pci", "opencl", "gl", "cuda", "nvml", "rsmi", "levelzero"}) {
    hwloc_topology_set_components(topo, HWLOC_TOPOLOGY_COMPONENTS_FLAG_BLACKLIST, plugin);
  }
  if (hwloc_topology_set_io_types_filter(topo, HWLOC_TYPE_FILTER_KEEP_ALL) != 0 || hwloc_topology_load(topo) != 0) {
    error = "hwloc could not load this host";
  } else if (hwloc_topology_export_xml(topo, path.c_str(), 0) != 0) {
    error = "hwloc_topology_export_xml failed";
  }
  hwloc_topology_destroy(topo);
  return error;
}

TEST(LiveHost, HwlocExportGivesTheSameTable) {
  const std::string path = testing::scratch("live-hwloc.xml");
  ASSERT_EQ(export_with_hwloc(path), "");
  const Result from_file = discover(Options{path});
  ASSERT_TRUE(from_file.ok) << from_file.error;
  EXPECT_EQ(from_file.table, live()) << to_json(from_file.table) << "\nvs live\n" << to_json(live());
  std::remove(path.c_str());
}

class LstopoExport : public ::testing::Test {
 protected:
  void SetUp() override {
    if (std::string(PONTE_LSTOPO).empty()) {
      GTEST_SKIP() << "lstopo not found when configuring (install the hwloc package): the live "
                      "lstopo export comparison did NOT run";
    }
  }
  static Result export_and_load(const std::string& options, const std::string& name) {
    const std::string path = testing::scratch(name);
    const testing::RunResult run = testing::run(testing::shell_quote(PONTE_LSTOPO) + " " + options +
                                                " --of xml " + testing::shell_quote(path));
    EXPECT_EQ(run.rc, 0) << run.err;
    Result r = discover(Options{path});
    EXPECT_TRUE(r.ok) << r.error;
    std::remove(path.c_str());
    return r;
  }
};

TEST_F(LstopoExport, WholeIoExportGivesTheSameTable) {
  const Result r = export_and_load("--whole-io", "lstopo-whole-io.xml");
  const Table l = live();
  EXPECT_EQ(r.table, l) << to_json(r.table) << "\nvs live\n" << to_json(l);
}

TEST_F(LstopoExport, DefaultExportGivesTheSameGroups) {
  // lstopo keeps only "important" I/O by default; GPUs, NICs and the bridges above them stay.
  const Result r = export_and_load("", "lstopo-default.xml");
  const Table l = live();
  EXPECT_EQ(r.table.gpus, l.gpus);
  EXPECT_EQ(r.table.nics, l.nics);
  EXPECT_EQ(r.table.host_groups, l.host_groups);
}

TEST(LiveHost, RepeatedDiscoveryIsStable) { EXPECT_EQ(live(), live()); }

}  // namespace
}  // namespace ponte::topo
