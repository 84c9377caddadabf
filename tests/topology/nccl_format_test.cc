// Real GPU servers described in NCCL's topology format (../shared/data/topologies/nccl-format:
// Azure ND A100 v4 / ND H100 v5, AWS p4d.24xlarge, IBM Cloud 8x H100): each is rewritten here as an
// hwloc XML (its sockets, PCIe switches, GPUs and NICs, with their real bus ids) and discovered;
// every GPU must get the NICs of its own switch, split evenly, shared only when they are fewer.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "tests/topology/topo_test_util.h"
#include "topology/topology.h"

namespace ponte::topo {
namespace {

using testing::expect_well_formed;
using testing::gpu_nic_map;
using testing::read_file;
using testing::real_machine;

struct Element {
  std::string name;
  std::map<std::string, std::string> attrs;
  std::vector<Element> children;
};

// A minimal XML reader for NCCL's topology files: elements and attributes, comments skipped.
bool parse_xml(const std::string& text, Element& root, std::string& error) {
  std::vector<Element*> stack{&root};
  size_t at = 0;
  while ((at = text.find('<', at)) != std::string::npos) {
    if (text.compare(at, 4, "<!--") == 0) {
      at = text.find("-->", at);
      if (at == std::string::npos) return error = "unterminated comment", false;
      continue;
    }
    const size_t end = text.find('>', at);
    if (end == std::string::npos) return error = "unterminated tag", false;
    std::string tag = text.substr(at + 1, end - at - 1);
    at = end + 1;
    if (tag.empty() || tag[0] == '?' || tag[0] == '!') continue;
    if (tag[0] == '/') {
      if (stack.size() < 2 || stack.back()->name != tag.substr(1)) return error = "mismatched </" + tag, false;
      stack.pop_back();
      continue;
    }
    const bool self_closing = tag.back() == '/';
    if (self_closing) tag.pop_back();
    Element e;
    std::istringstream in(tag);
    in >> e.name;
    size_t pos = e.name.size();
    while ((pos = tag.find('=', pos)) != std::string::npos) {
      size_t key_start = tag.rfind(' ', pos);
      const std::string key = tag.substr(key_start + 1, pos - key_start - 1);
      const size_t q1 = tag.find('"', pos), q2 = tag.find('"', q1 + 1);
      if (q1 == std::string::npos || q2 == std::string::npos) return error = "bad attribute", false;
      e.attrs[key] = tag.substr(q1 + 1, q2 - q1 - 1);
      pos = q2 + 1;
    }
    stack.back()->children.push_back(std::move(e));
    if (!self_closing) stack.push_back(&stack.back()->children.back());
  }
  if (stack.size() != 1) return error = "unclosed element", false;
  return true;
}

bool is_bridge(const Element& pci) { return pci.attrs.at("class").rfind("0x0604", 0) == 0; }
bool is_gpu(const Element& pci) {
  const std::string& c = pci.attrs.at("class");
  return c.rfind("0x0302", 0) == 0 || c.rfind("0x0300", 0) == 0;
}
bool is_nic(const Element& pci) {
  const std::string& c = pci.attrs.at("class");
  if (c.rfind("0x0207", 0) == 0) return true;  // InfiniBand
  if (c.rfind("0x02", 0) != 0) return false;
  auto vendor = pci.attrs.find("vendor");
  if (vendor != pci.attrs.end() && vendor->second == "0x1d0f") return true;  // EFA
  for (const Element& child : pci.children) {
    if (child.name == "nic") return true;
  }
  return false;
}
std::string nic_name(const Element& pci, int index) {
  for (const Element& nic : pci.children) {
    for (const Element& net : nic.children) {
      if (nic.name == "nic" && net.name == "net" && net.attrs.count("name")) return net.attrs.at("name");
    }
  }
  return "nic" + std::to_string(index);
}
std::string hex4(const Element& pci, const char* key) {
  auto it = pci.attrs.find(key);
  if (it == pci.attrs.end() || it->second.size() < 6) return "0000";
  return it->second.substr(2, 4);
}
// Azure's files give no vendor: NCCL's GPUs are NVIDIA's, their InfiniBand NICs Mellanox's.
std::string vendor_of(const Element& pci) {
  const std::string v = hex4(pci, "vendor");
  if (v != "0000") return v;
  if (is_gpu(pci)) return "10de";
  if (is_nic(pci)) return "15b3";
  return v;
}

// Writes the NCCL topology as an hwloc v2 XML: one package + NUMA node + two cores per <cpu>, a host
// bridge above each top-level <pci>, bridges for switches, PCI devices, OpenFabrics devices on NICs.
class HwlocWriter {
 public:
  std::string write(const Element& system) {
    std::vector<const Element*> cpus;
    for (const Element& c : system.children) {
      if (c.name == "cpu") cpus.push_back(&c);
    }
    const unsigned all_pus = (1u << (2 * cpus.size())) - 1;
    unsigned all_nodes = 0;
    for (const Element* c : cpus) all_nodes |= 1u << std::stoi(c->attrs.at("numaid"));
    out_ << "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<!DOCTYPE topology SYSTEM \"hwloc2.dtd\">\n"
         << "<topology version=\"2.0\">\n<object type=\"Machine\" os_index=\"0\" " << sets(all_pus, all_nodes, true)
         << " gp_index=\"" << next() << "\">\n";
    for (size_t k = 0; k < cpus.size(); ++k) {
      const int numa = std::stoi(cpus[k]->attrs.at("numaid"));
      const unsigned pus = 3u << (2 * k), nodes = 1u << numa;
      out_ << "<object type=\"Package\" os_index=\"" << numa << "\" " << sets(pus, nodes) << " gp_index=\"" << next()
           << "\">\n<object type=\"NUMANode\" os_index=\"" << numa << "\" " << sets(pus, nodes) << " gp_index=\""
           << next() << "\" local_memory=\"1073741824\"/>\n";
      for (unsigned pu = 2 * k; pu < 2 * k + 2; ++pu) {
        out_ << "<object type=\"Core\" os_index=\"" << pu << "\" " << sets(1u << pu, nodes) << " gp_index=\"" << next()
             << "\">\n<object type=\"PU\" os_index=\"" << pu << "\" " << sets(1u << pu, nodes) << " gp_index=\""
             << next() << "\"/>\n</object>\n";
      }
      for (const Element& pci : cpus[k]->children) {
        if (pci.name != "pci") continue;
        out_ << "<object type=\"Bridge\" gp_index=\"" << next() << "\" bridge_type=\"0-1\" depth=\"0\" "
             << "bridge_pci=\"0000:[00-ff]\">\n";
        device(pci, 1);
        out_ << "</object>\n";
      }
      out_ << "</object>\n";
    }
    out_ << "</object>\n</topology>\n";
    return out_.str();
  }

 private:
  static std::string bitmap(unsigned bits) {
    char buf[16];
    std::snprintf(buf, sizeof(buf), "0x%08x", bits);
    return buf;
  }
  static std::string sets(unsigned pus, unsigned nodes, bool allowed = false) {
    std::string s = "cpuset=\"" + bitmap(pus) + "\" complete_cpuset=\"" + bitmap(pus) + "\" ";
    if (allowed) s += "allowed_cpuset=\"" + bitmap(pus) + "\" ";
    s += "nodeset=\"" + bitmap(nodes) + "\" complete_nodeset=\"" + bitmap(nodes) + "\"";
    if (allowed) s += " allowed_nodeset=\"" + bitmap(nodes) + "\"";
    return s;
  }
  void device(const Element& pci, int depth) {
    const std::string busid = pci.attrs.at("busid");
    const std::string type = pci.attrs.at("class").substr(2, 4) + " [" + vendor_of(pci) + ":" +
                             hex4(pci, "device") + "] [0000:0000] 00";
    if (is_bridge(pci)) {
      out_ << "<object type=\"Bridge\" gp_index=\"" << next() << "\" bridge_type=\"1-1\" depth=\"" << depth
           << "\" bridge_pci=\"0000:[00-ff]\" pci_busid=\"" << busid << "\" pci_type=\"" << type
           << "\" pci_link_speed=\"0.000000\">\n";
      for (const Element& child : pci.children) {
        if (child.name == "pci") device(child, depth + 1);
      }
      out_ << "</object>\n";
      return;
    }
    out_ << "<object type=\"PCIDev\" gp_index=\"" << next() << "\" pci_busid=\"" << busid << "\" pci_type=\"" << type
         << "\" pci_link_speed=\"0.000000\">\n";
    if (is_nic(pci)) {
      out_ << "<object type=\"OSDev\" gp_index=\"" << next() << "\" name=\"" << nic_name(pci, nics_++)
           << "\" osdev_type=\"3\"/>\n";
    }
    out_ << "</object>\n";
  }

  int next() { return gp_++; }

  std::ostringstream out_;
  int gp_ = 1;
  int nics_ = 0;
};

// The GPUs and NICs directly under each switch of the NCCL file.
struct Switch {
  std::vector<std::string> gpus, nics;
};
void collect_switches(const Element& e, std::vector<Switch>& out) {
  Switch s;
  for (const Element& child : e.children) {
    if (child.name != "pci") continue;
    if (is_bridge(child)) {
      collect_switches(child, out);
    } else if (is_gpu(child)) {
      s.gpus.push_back(normalize_pci_bus_id(child.attrs.at("busid")));
    } else if (is_nic(child)) {
      s.nics.push_back(normalize_pci_bus_id(child.attrs.at("busid")));
    }
  }
  if (!s.gpus.empty() || !s.nics.empty()) out.push_back(s);
}

class NcclFormat : public ::testing::TestWithParam<const char*> {};

TEST_P(NcclFormat, EachGpuTakesTheNicsOfItsSwitch) {
  const std::string source = real_machine(std::string("nccl-format/") + GetParam());
  ASSERT_TRUE(std::filesystem::exists(source)) << "missing real-machine file " << source;
  Element root;
  std::string error;
  ASSERT_TRUE(parse_xml(read_file(source), root, error)) << source << ": " << error;
  ASSERT_FALSE(root.children.empty());
  const Element& system = root.children.front();
  ASSERT_EQ(system.name, "system");

  const std::string path = testing::scratch(std::string("nccl-") + GetParam());
  {
    std::ofstream out(path);
    out << HwlocWriter().write(system);
  }
  const Result r = discover(Options{path});
  std::remove(path.c_str());
  ASSERT_TRUE(r.ok) << r.error;
  const Table& t = r.table;
  expect_well_formed(t);

  std::vector<Switch> switches;
  for (const Element& cpu : system.children) collect_switches(cpu, switches);
  size_t gpus = 0;
  auto mapping = gpu_nic_map(t);
  for (const Switch& s : switches) {
    ASSERT_FALSE(s.nics.empty()) << "every switch in these files has a NIC";
    std::map<std::string, int> users;
    for (const std::string& gpu : s.gpus) {
      ++gpus;
      const Gpu* g = testing::gpu_by_pci(t, gpu);
      ASSERT_NE(g, nullptr) << gpu;
      EXPECT_EQ(g->rule, Rule::kSwitch) << gpu;
      const std::vector<std::string>& nics = mapping[gpu];
      if (s.nics.size() >= s.gpus.size()) {
        EXPECT_EQ(nics.size(), s.nics.size() / s.gpus.size()) << gpu << ": an even share of its switch's NICs";
      } else {
        EXPECT_EQ(nics.size(), 1u) << gpu << ": fewer NICs than GPUs: one each";
      }
      for (const std::string& nic : nics) {
        EXPECT_NE(std::find(s.nics.begin(), s.nics.end(), nic), s.nics.end()) << gpu << " got " << nic
                                                                               << " from another switch";
        ++users[nic];
      }
      for (const NicLink& l : g->nics) EXPECT_EQ(l.distance, Distance::kPIX) << gpu;
    }
    // Shared only when fewer: at most ceil(gpus / nics) users per NIC, and all NICs in use.
    const size_t most = (s.gpus.size() + s.nics.size() - 1) / s.nics.size();
    for (const auto& [nic, count] : users) EXPECT_LE(static_cast<size_t>(count), most) << nic;
    if (s.gpus.size() >= s.nics.size()) {
      EXPECT_EQ(users.size(), s.nics.size());
    }
  }
  EXPECT_EQ(gpus, t.gpus.size());
  EXPECT_EQ(gpus, 8u) << "each of these machines has eight GPUs";
}

INSTANTIATE_TEST_SUITE_P(RealMachines, NcclFormat,
                         ::testing::Values("ndv4-topo.xml", "ndv5-topo.xml", "p4d-24xl-topo.xml",
                                           "gx3d-160x1792x8h100-topo.xml"),
                         [](const ::testing::TestParamInfo<const char*>& info) {
                           std::string name = info.param;
                           name = name.substr(0, name.find('-'));
                           return name;
                         });

}  // namespace
}  // namespace ponte::topo
