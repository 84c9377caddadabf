// PCI bus id parsing and formatting, name tables, lookups, and the JSON / text renderings.
#include <gtest/gtest.h>

#include "tests/topology/topo_test_util.h"
#include "topology/topology.h"

namespace ponte::topo {
namespace {

using testing::Json;
using testing::JsonReader;

TEST(PciBusId, Normalizes) {
  EXPECT_EQ(normalize_pci_bus_id("0000:43:00.0"), "0000:43:00.0");
  EXPECT_EQ(normalize_pci_bus_id("43:00.0"), "0000:43:00.0");
  EXPECT_EQ(normalize_pci_bus_id("0000:C3:1F.7"), "0000:c3:1f.7");
  EXPECT_EQ(normalize_pci_bus_id("00000000:65:00.0"), "0000:65:00.0");  // nvidia-smi style
  EXPECT_EQ(normalize_pci_bus_id(" 0003:01:00.1\n"), "0003:01:00.1");
  EXPECT_EQ(normalize_pci_bus_id("10000:01:00.0"), "10000:01:00.0");  // VMD domains
  EXPECT_EQ(normalize_pci_bus_id("1:2.3"), "0000:01:02.3");
}

TEST(PciBusId, RejectsWhatIsNotOne) {
  for (const char* bad : {"", "mlx5_0", "0000:43:00", "0000:43:00.8", "0000:43:20.0", "0000:143:00.0",
                          "123456789:00:00.0", "0000:43:00.0.1", "0000::00.0", "0000:43:00.x", ":43:00.0",
                          "0000:00:00:00.0"}) {
    EXPECT_EQ(normalize_pci_bus_id(bad), "") << bad;
  }
}

TEST(PciBusId, Formats) {
  EXPECT_EQ(format_pci_bus_id(0, 0x43, 0, 0), "0000:43:00.0");
  EXPECT_EQ(format_pci_bus_id(0x35, 4, 0x1f, 7), "0035:04:1f.7");
}

TEST(Names, DistanceAndRule) {
  EXPECT_STREQ(distance_name(Distance::kPIX), "PIX");
  EXPECT_STREQ(distance_name(Distance::kPXB), "PXB");
  EXPECT_STREQ(distance_name(Distance::kPHB), "PHB");
  EXPECT_STREQ(distance_name(Distance::kNODE), "NODE");
  EXPECT_STREQ(distance_name(Distance::kSYS), "SYS");
  EXPECT_STREQ(rule_name(Rule::kSwitch), "switch");
  EXPECT_STREQ(rule_name(Rule::kNuma), "numa");
  EXPECT_STREQ(rule_name(Rule::kPackage), "package");
  EXPECT_STREQ(rule_name(Rule::kAny), "any");
  EXPECT_STREQ(rule_name(Rule::kNone), "none");
}

Table sample() {
  Table t;
  Nic n;
  n.pci = "0000:43:00.0";
  n.name = "mlx5_\"1\"\\";  // needs escaping
  n.other_names = {"ib0", "tab\there"};
  n.vendor_id = 0x15b3;
  n.device_id = 0x101b;
  n.numa = 1;
  n.package = 0;
  n.pci_link_gbytes = 31.507692;
  t.nics.push_back(n);
  Gpu g;
  g.pci = "0000:44:00.0";
  g.device_id = 0x20b0;
  g.numa = 1;
  g.package = 0;
  g.nics = {{0, Distance::kPIX}};
  g.cpus = {6, 7, 8};
  g.rule = Rule::kSwitch;
  t.gpus.push_back(g);
  t.host_groups.push_back({1, 0, {{0, Distance::kPHB}}, {8, 7, 6}});
  t.warnings = {"a \"quoted\" warning\nwith a newline and \x01 control"};
  return t;
}

TEST(Json, ShapeAndValues) {
  const Table t = sample();
  Json j;
  JsonReader reader(to_json(t));
  ASSERT_TRUE(reader.parse(j)) << reader.error() << "\n" << to_json(t);
  const Json& gpu = j["gpus"][0];
  EXPECT_EQ(gpu["pci"].text, "0000:44:00.0");
  EXPECT_EQ(gpu["numa"].number, 1);
  EXPECT_EQ(gpu["rule"].text, "switch");
  EXPECT_EQ(gpu["device_id"].text, "20b0");
  EXPECT_EQ(gpu["nics"][0]["pci"].text, "0000:43:00.0");
  EXPECT_EQ(gpu["nics"][0]["name"].text, "mlx5_\"1\"\\");
  EXPECT_EQ(gpu["nics"][0]["distance"].text, "PIX");
  EXPECT_EQ(gpu["nics"][0]["nic"].number, 0);
  ASSERT_EQ(gpu["cpus"].items.size(), 3u);
  EXPECT_EQ(gpu["cpus"][2].number, 8);
  const Json& nic = j["nics"][0];
  EXPECT_EQ(nic["name"].text, "mlx5_\"1\"\\");
  EXPECT_EQ(nic["other_names"][1].text, "tab\there");
  EXPECT_EQ(nic["vendor_id"].text, "15b3");
  EXPECT_NEAR(nic["pci_link_gbytes"].number, 31.51, 0.001);
  EXPECT_EQ(j["host_groups"][0]["nics"][0]["distance"].text, "PHB");
  EXPECT_EQ(j["host_groups"][0]["cpus"][0].number, 8);
  EXPECT_EQ(j["warnings"][0].text, t.warnings[0]);
}

TEST(Json, EmptyTable) {
  EXPECT_EQ(to_json(Table{}), "{\"gpus\":[],\"nics\":[],\"host_groups\":[],\"warnings\":[]}\n");
}

TEST(Text, NamesEverything) {
  const std::string text = to_text(sample());
  for (const char* part : {"1 GPU(s), 1 RDMA NIC(s), 1 NUMA node(s)", "0000:44:00.0", "switch", "6-8",
                           "0000:43:00.0 PIX", "PHB", "15b3:101b", "ib0", "warnings:", "quoted"}) {
    EXPECT_NE(text.find(part), std::string::npos) << part << " missing from:\n" << text;
  }
}

TEST(Lookup, ByBusIdInAnySpelling) {
  const Table t = sample();
  EXPECT_EQ(find_nic(t, "0000:43:00.0"), 0);
  EXPECT_EQ(find_nic(t, "43:00.0"), 0);
  EXPECT_EQ(find_nic(t, "00000000:43:00.0"), 0);
  EXPECT_EQ(find_nic(t, "mlx5_1"), -1) << "never by name";
  EXPECT_EQ(find_gpu(t, "0000:44:00.0"), 0);
  EXPECT_EQ(find_gpu(t, "0000:43:00.0"), -1);
}

}  // namespace
}  // namespace ponte::topo
