// Placement policy: GPU -> NICs by PCIe ancestry with NUMA / package / any fallbacks, the even split
// of shared NICs, and the division of each NUMA node's cores among its GPUs.
#include "topology/placement.h"

#include <algorithm>
#include <map>
#include <tuple>
#include <utility>

namespace ponte::topo {
namespace {

const PciPath kNoPath;

const PciPath& path_at(const std::vector<PciPath>& paths, size_t i) {
  return i < paths.size() ? paths[i] : kNoPath;
}

// Positions in a and b of their nearest common bridge; {-1, -1} when they share none.
std::pair<int, int> common_bridge(const PciPath& a, const PciPath& b) {
  for (size_t i = 0; i < a.size(); ++i) {
    for (size_t j = 0; j < b.size(); ++j) {
      if (a[i].id == b[j].id) return {static_cast<int>(i), static_cast<int>(j)};
    }
  }
  return {-1, -1};
}

std::string nic_label(const Nic& nic) { return nic.name + " (" + nic.pci + ")"; }

struct Candidates {
  Rule rule = Rule::kNone;
  std::vector<int> nics;  // by NIC index
};

// Rules 1 and 3: the NICs a GPU may take, and the rule that chose them.
Candidates candidates_for(const Inventory& inv, size_t g) {
  Candidates out;
  const Gpu& gpu = inv.gpus[g];
  const PciPath& gpu_path = path_at(inv.gpu_paths, g);
  // Rule 1: the NICs under the closest (deepest) PCIe ancestor the GPU shares with any NIC.
  int closest = -1;
  for (size_t n = 0; n < inv.nics.size(); ++n) {
    const int hops = common_bridge(gpu_path, path_at(inv.nic_paths, n)).first;
    if (hops < 0) continue;
    if (closest < 0 || hops < closest) {
      closest = hops;
      out.nics.clear();
    }
    if (hops == closest) out.nics.push_back(static_cast<int>(n));
  }
  if (!out.nics.empty()) {
    out.rule = Rule::kSwitch;
    return out;
  }
  // Rule 3: NUMA node, then package, then anything.
  auto collect = [&](auto&& keep) {
    for (size_t n = 0; n < inv.nics.size(); ++n) {
      if (keep(inv.nics[n])) out.nics.push_back(static_cast<int>(n));
    }
  };
  if (gpu.numa >= 0) collect([&](const Nic& nic) { return nic.numa == gpu.numa; });
  if (!out.nics.empty()) {
    out.rule = Rule::kNuma;
    return out;
  }
  if (gpu.package >= 0) collect([&](const Nic& nic) { return nic.package == gpu.package; });
  if (!out.nics.empty()) {
    out.rule = Rule::kPackage;
    return out;
  }
  collect([](const Nic&) { return true; });
  out.rule = out.nics.empty() ? Rule::kNone : Rule::kAny;
  return out;
}

// Rule 2: GPUs with the same candidates form a pool; pools split their NICs.
void assign_nics(const Inventory& inv, Table& table) {
  const size_t gpu_count = inv.gpus.size();
  std::vector<Candidates> cands(gpu_count);
  std::map<std::pair<Rule, std::vector<int>>, std::vector<int>> pools;  // -> GPUs, in order
  for (size_t g = 0; g < gpu_count; ++g) {
    cands[g] = candidates_for(inv, g);
    table.gpus[g].rule = cands[g].rule;
    if (cands[g].rule == Rule::kNone) continue;
    pools[{cands[g].rule, cands[g].nics}].push_back(static_cast<int>(g));
  }
  struct Pool {
    Rule rule;
    const std::vector<int>* nics;
    const std::vector<int>* gpus;
  };
  std::vector<Pool> order;
  for (const auto& [key, gpus] : pools) order.push_back({key.first, &key.second, &gpus});
  // Closer rules first; within a rule, the most constrained pool first.
  std::sort(order.begin(), order.end(), [](const Pool& a, const Pool& b) {
    return std::make_tuple(a.rule, a.nics->size(), a.gpus->front()) <
           std::make_tuple(b.rule, b.nics->size(), b.gpus->front());
  });

  auto distance = [&](int g, int n) {
    return pci_distance(path_at(inv.gpu_paths, g), inv.gpus[g].numa, path_at(inv.nic_paths, n),
                        inv.nics[n].numa);
  };
  std::vector<int> load(inv.nics.size(), 0);  // GPUs given each NIC so far
  std::vector<std::vector<int>> given(gpu_count);
  for (const Pool& pool : order) {
    std::vector<int> free;
    for (int n : *pool.nics) {
      if (load[n] == 0) free.push_back(n);
    }
    const size_t members = pool.gpus->size();
    if (free.size() >= members) {
      // Enough NICs: every GPU gets its own, the first ones one more when they do not divide.
      const size_t each = free.size() / members, extra = free.size() % members;
      for (size_t k = 0; k < members; ++k) {
        const int g = (*pool.gpus)[k];
        std::stable_sort(free.begin(), free.end(), [&](int a, int b) {
          return std::make_pair(distance(g, a), a) < std::make_pair(distance(g, b), b);
        });
        const size_t take = each + (k < extra ? 1 : 0);
        for (size_t i = 0; i < take; ++i) {
          given[g].push_back(free[i]);
          ++load[free[i]];
        }
        free.erase(free.begin(), free.begin() + static_cast<long>(take));
      }
    } else {
      // Fewer free NICs than GPUs: each GPU takes one NIC, the least loaded (then nearest) first.
      for (int g : *pool.gpus) {
        int best = -1;
        for (int n : *pool.nics) {
          if (best < 0 || std::make_tuple(load[n], distance(g, n), n) <
                              std::make_tuple(load[best], distance(g, best), best)) {
            best = n;
          }
        }
        given[g].push_back(best);
        ++load[best];
      }
    }
  }

  for (size_t g = 0; g < gpu_count; ++g) {
    Gpu& gpu = table.gpus[g];
    const int gi = static_cast<int>(g);
    std::sort(given[g].begin(), given[g].end(), [&](int a, int b) {
      return std::make_pair(distance(gi, a), a) < std::make_pair(distance(gi, b), b);
    });
    gpu.nics.clear();
    for (int n : given[g]) gpu.nics.push_back({n, distance(gi, n)});
    if (gpu.rule == Rule::kSwitch || gpu.rule == Rule::kNone || gpu.nics.empty()) continue;
    std::string names;
    for (const NicLink& link : gpu.nics) {
      names += (names.empty() ? "" : ", ") + nic_label(table.nics[link.nic]);
    }
    std::string why = "GPU " + gpu.pci + " shares no PCIe switch with any NIC";
    if (gpu.rule == Rule::kNuma) {
      why += "; placed by its NUMA node " + std::to_string(gpu.numa);
    } else if (gpu.rule == Rule::kPackage) {
      why += " and its NUMA node " + std::to_string(gpu.numa) + " has none; placed by its package " +
             std::to_string(gpu.package);
    } else {
      why += " and none is on its NUMA node or package; placed on any NIC";
    }
    table.warnings.push_back(why + ": " + names);
  }
}

// Splits cpus into `parts` shares in order; with fewer cpus than parts, share i is {cpus[i % n]}.
std::vector<std::vector<int>> divide(const std::vector<int>& cpus, size_t parts) {
  std::vector<std::vector<int>> out(parts);
  if (cpus.empty() || parts == 0) return out;
  if (cpus.size() < parts) {
    for (size_t i = 0; i < parts; ++i) out[i] = {cpus[i % cpus.size()]};
    return out;
  }
  const size_t each = cpus.size() / parts, extra = cpus.size() % parts;
  size_t at = 0;
  for (size_t i = 0; i < parts; ++i) {
    const size_t take = each + (i < extra ? 1 : 0);
    out[i].assign(cpus.begin() + static_cast<long>(at), cpus.begin() + static_cast<long>(at + take));
    at += take;
  }
  return out;
}

// Rule 4 and the host groups.
void assign_cores(const Inventory& inv, Table& table) {
  std::map<int, std::vector<int>> node_cpus, package_cpus;
  std::vector<int> all_cpus;
  for (const CpuCore& core : inv.cores) {
    if (core.cpu < 0) continue;
    all_cpus.push_back(core.cpu);
    if (core.numa >= 0) node_cpus[core.numa].push_back(core.cpu);
    if (core.package >= 0) package_cpus[core.package].push_back(core.cpu);
  }
  if (all_cpus.empty()) table.warnings.push_back("no CPU cores found: no progress-thread placement");

  // The cores of the package, else all of them: for a GPU or node without cores of its own.
  auto wider_cpus = [&](int package) -> const std::vector<int>& {
    auto it = package_cpus.find(package);
    return it != package_cpus.end() ? it->second : all_cpus;
  };

  std::map<int, std::vector<int>> node_gpus;
  for (size_t g = 0; g < table.gpus.size(); ++g) {
    Gpu& gpu = table.gpus[g];
    if (gpu.numa >= 0 && node_cpus.count(gpu.numa)) {
      node_gpus[gpu.numa].push_back(static_cast<int>(g));
      continue;
    }
    gpu.cpus = wider_cpus(gpu.package);
    if (!all_cpus.empty()) {
      table.warnings.push_back("GPU " + gpu.pci + ": " +
                               (gpu.numa < 0 ? std::string("NUMA node unknown")
                                             : "NUMA node " + std::to_string(gpu.numa) + " has no cores") +
                               "; its progress thread may use any core of its " +
                               (package_cpus.count(gpu.package) ? "package" : "host"));
    }
  }
  for (const auto& [node, gpus] : node_gpus) {
    std::vector<std::vector<int>> shares = divide(node_cpus[node], gpus.size());
    for (size_t k = 0; k < gpus.size(); ++k) table.gpus[gpus[k]].cpus = std::move(shares[k]);
  }

  std::vector<NumaNode> nodes = inv.numa_nodes;
  if (nodes.empty()) {
    table.warnings.push_back("no NUMA node found: one host group for the whole host");
    nodes.push_back(NumaNode{});
  }
  for (const NumaNode& node : nodes) {
    HostGroup group;
    group.numa = node.os_index;
    group.package = node.package;
    std::vector<std::pair<int, int>> ranked;  // (tier, nic)
    for (size_t n = 0; n < table.nics.size(); ++n) {
      const Nic& nic = table.nics[n];
      int tier = 2;
      if (node.os_index >= 0 && nic.numa == node.os_index) {
        tier = 0;
      } else if (node.package >= 0 && nic.package == node.package) {
        tier = 1;
      }
      ranked.push_back({tier, static_cast<int>(n)});
    }
    std::sort(ranked.begin(), ranked.end());
    for (const auto& [tier, n] : ranked) {
      group.nics.push_back({n, tier == 0 ? Distance::kPHB : Distance::kSYS});
    }
    auto own = node_cpus.find(node.os_index);
    if (own != node_cpus.end()) {
      group.cpus = own->second;
    } else {
      group.cpus = wider_cpus(node.package);
      if (node.os_index >= 0 && !all_cpus.empty()) {
        table.warnings.push_back("NUMA node " + std::to_string(node.os_index) +
                                 " has no cores of its own: its host group uses those of its " +
                                 (package_cpus.count(node.package) ? "package" : "host"));
      }
    }
    std::reverse(group.cpus.begin(), group.cpus.end());
    table.host_groups.push_back(std::move(group));
  }
}

}  // namespace

Distance pci_distance(const PciPath& a, int numa_a, const PciPath& b, int numa_b) {
  const auto [i, j] = common_bridge(a, b);
  if (i >= 0) {
    if (a[static_cast<size_t>(i)].host) return Distance::kPHB;
    return std::max(i, j) <= 1 ? Distance::kPIX : Distance::kPXB;
  }
  if (numa_a >= 0 && numa_a == numa_b) return Distance::kNODE;
  return Distance::kSYS;
}

Table place(const Inventory& inventory) {
  Table table;
  table.gpus = inventory.gpus;
  table.nics = inventory.nics;
  table.warnings = inventory.warnings;
  for (Gpu& gpu : table.gpus) {
    gpu.nics.clear();
    gpu.cpus.clear();
    gpu.rule = Rule::kNone;
  }
  if (table.gpus.empty()) {
    table.warnings.push_back(
        "no NVIDIA GPU found (PCI vendor 10de, class 0300/0302): host-memory groups only");
  }
  if (table.nics.empty()) {
    table.warnings.push_back(
        "no RDMA NIC found (PCI device with an OpenFabrics OS device): no GPU or host group has "
        "a NIC");
  }
  assign_nics(inventory, table);
  assign_cores(inventory, table);
  return table;
}

}  // namespace ponte::topo
