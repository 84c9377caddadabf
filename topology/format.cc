// The table as JSON and as text, lookups by PCI bus id, and PCI bus id parsing and formatting.
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "topology/topology.h"

namespace ponte::topo {
namespace {

void append_json_string(std::string& out, std::string_view text) {
  out += '"';
  for (const char c : text) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      case '\r': out += "\\r"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", static_cast<unsigned>(static_cast<unsigned char>(c)));
          out += buf;
        } else {
          out += c;
        }
    }
  }
  out += '"';
}

std::string hex4(uint16_t v) {
  char buf[8];
  std::snprintf(buf, sizeof(buf), "%04x", static_cast<unsigned>(v));
  return buf;
}

void append_ints(std::string& out, const std::vector<int>& values) {
  out += '[';
  for (size_t i = 0; i < values.size(); ++i) {
    if (i) out += ',';
    out += std::to_string(values[i]);
  }
  out += ']';
}

void append_links(std::string& out, const Table& table, const std::vector<NicLink>& links) {
  out += '[';
  for (size_t i = 0; i < links.size(); ++i) {
    const NicLink& link = links[i];
    const bool known = link.nic >= 0 && static_cast<size_t>(link.nic) < table.nics.size();
    if (i) out += ',';
    out += "{\"nic\":" + std::to_string(link.nic) + ",\"pci\":";
    append_json_string(out, known ? table.nics[link.nic].pci : "");
    out += ",\"name\":";
    append_json_string(out, known ? table.nics[link.nic].name : "");
    out += ",\"distance\":\"";
    out += distance_name(link.distance);
    out += "\"}";
  }
  out += ']';
}

// "0-5,48,50-51" from a list of CPU numbers (kept in its order; runs of +1 collapse).
std::string cpu_ranges(const std::vector<int>& cpus) {
  std::string out;
  for (size_t i = 0; i < cpus.size();) {
    size_t j = i;
    while (j + 1 < cpus.size() && cpus[j + 1] == cpus[j] + 1) ++j;
    if (!out.empty()) out += ',';
    out += std::to_string(cpus[i]);
    if (j > i) out += '-' + std::to_string(cpus[j]);
    i = j + 1;
  }
  return out.empty() ? "-" : out;
}

std::string links_text(const Table& table, const std::vector<NicLink>& links) {
  std::string out;
  for (const NicLink& link : links) {
    if (!out.empty()) out += ", ";
    if (link.nic < 0 || static_cast<size_t>(link.nic) >= table.nics.size()) {
      out += "?";
      continue;
    }
    const Nic& nic = table.nics[link.nic];
    out += nic.name + " " + nic.pci + " " + distance_name(link.distance);
  }
  return out.empty() ? "-" : out;
}

std::string sorted_ranges(std::vector<int> cpus) {
  std::sort(cpus.begin(), cpus.end());
  return cpu_ranges(cpus);
}

std::string pad(std::string text, size_t width) {
  if (text.size() < width) text.append(width - text.size(), ' ');
  return text + ' ';
}

std::string number_or_dash(int v) { return v < 0 ? "-" : std::to_string(v); }

int hex_digit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// Parses 1..max_digits hex digits ending at one of `ends` (or the end of text for '\0').
bool parse_hex(std::string_view& text, size_t max_digits, char end, uint32_t& value) {
  value = 0;
  size_t digits = 0;
  while (!text.empty() && hex_digit(text.front()) >= 0) {
    if (++digits > max_digits) return false;
    value = value * 16 + static_cast<uint32_t>(hex_digit(text.front()));
    text.remove_prefix(1);
  }
  if (digits == 0) return false;
  if (end == '\0') return text.empty();
  if (text.empty() || text.front() != end) return false;
  text.remove_prefix(1);
  return true;
}

template <typename List>
int find_by_pci(const List& list, std::string_view pci_bus_id) {
  const std::string wanted = normalize_pci_bus_id(pci_bus_id);
  if (wanted.empty()) return -1;
  for (size_t i = 0; i < list.size(); ++i) {
    if (list[i].pci == wanted) return static_cast<int>(i);
  }
  return -1;
}

}  // namespace

const char* distance_name(Distance d) {
  switch (d) {
    case Distance::kPIX: return "PIX";
    case Distance::kPXB: return "PXB";
    case Distance::kPHB: return "PHB";
    case Distance::kNODE: return "NODE";
    case Distance::kSYS: return "SYS";
  }
  return "SYS";
}

const char* rule_name(Rule r) {
  switch (r) {
    case Rule::kSwitch: return "switch";
    case Rule::kNuma: return "numa";
    case Rule::kPackage: return "package";
    case Rule::kAny: return "any";
    case Rule::kNone: return "none";
  }
  return "none";
}

std::string to_json(const Table& table) {
  std::string out = "{\"gpus\":[";
  for (size_t i = 0; i < table.gpus.size(); ++i) {
    const Gpu& gpu = table.gpus[i];
    if (i) out += ',';
    out += "{\"pci\":";
    append_json_string(out, gpu.pci);
    out += ",\"device_id\":\"" + hex4(gpu.device_id) + "\"";
    out += ",\"numa\":" + std::to_string(gpu.numa) + ",\"package\":" + std::to_string(gpu.package);
    out += ",\"nics\":";
    append_links(out, table, gpu.nics);
    out += ",\"cpus\":";
    append_ints(out, gpu.cpus);
    out += ",\"rule\":\"";
    out += rule_name(gpu.rule);
    out += "\"}";
  }
  out += "],\"nics\":[";
  for (size_t i = 0; i < table.nics.size(); ++i) {
    const Nic& nic = table.nics[i];
    if (i) out += ',';
    out += "{\"pci\":";
    append_json_string(out, nic.pci);
    out += ",\"name\":";
    append_json_string(out, nic.name);
    out += ",\"other_names\":[";
    for (size_t k = 0; k < nic.other_names.size(); ++k) {
      if (k) out += ',';
      append_json_string(out, nic.other_names[k]);
    }
    out += "],\"vendor_id\":\"" + hex4(nic.vendor_id) + "\",\"device_id\":\"" + hex4(nic.device_id) + "\"";
    out += ",\"numa\":" + std::to_string(nic.numa) + ",\"package\":" + std::to_string(nic.package);
    char speed[32];
    std::snprintf(speed, sizeof(speed), "%.2f", nic.pci_link_gbytes);
    out += ",\"pci_link_gbytes\":";
    out += speed;
    out += '}';
  }
  out += "],\"host_groups\":[";
  for (size_t i = 0; i < table.host_groups.size(); ++i) {
    const HostGroup& group = table.host_groups[i];
    if (i) out += ',';
    out += "{\"numa\":" + std::to_string(group.numa) + ",\"package\":" + std::to_string(group.package);
    out += ",\"nics\":";
    append_links(out, table, group.nics);
    out += ",\"cpus\":";
    append_ints(out, group.cpus);
    out += '}';
  }
  out += "],\"warnings\":[";
  for (size_t i = 0; i < table.warnings.size(); ++i) {
    if (i) out += ',';
    append_json_string(out, table.warnings[i]);
  }
  out += "]}\n";
  return out;
}

std::string to_text(const Table& table) {
  std::string out;
  out += std::to_string(table.gpus.size()) + " GPU(s), " + std::to_string(table.nics.size()) +
         " RDMA NIC(s), " + std::to_string(table.host_groups.size()) + " NUMA node(s)\n\n";
  if (!table.gpus.empty()) {
    out += pad("GPU", 13) + pad("NUMA", 4) + pad("PKG", 3) + pad("RULE", 7) + pad("CORES", 15) +
           "NICS (name, bus id, distance; nearest first)\n";
    for (const Gpu& gpu : table.gpus) {
      out += pad(gpu.pci, 13) + pad(number_or_dash(gpu.numa), 4) + pad(number_or_dash(gpu.package), 3) +
             pad(rule_name(gpu.rule), 7) + pad(sorted_ranges(gpu.cpus), 15) + links_text(table, gpu.nics) +
             "\n";
    }
    out += '\n';
  }
  out += pad("HOST MEMORY", 13) + pad("NUMA", 4) + pad("PKG", 3) + pad("", 7) + pad("CORES", 15) +
         "NICS (nearest first)\n";
  for (const HostGroup& group : table.host_groups) {
    out += pad("numa " + number_or_dash(group.numa), 13) + pad(number_or_dash(group.numa), 4) +
           pad(number_or_dash(group.package), 3) + pad("", 7) + pad(sorted_ranges(group.cpus), 15) +
           links_text(table, group.nics) + "\n";
  }
  if (!table.nics.empty()) {
    out += '\n' + pad("NIC", 13) + pad("NUMA", 4) + pad("PKG", 3) + pad("NAME", 14) + pad("PCI ID", 9) +
           pad("GB/s", 6) + "OTHER NAMES\n";
    for (const Nic& nic : table.nics) {
      char speed[32];
      std::snprintf(speed, sizeof(speed), "%.1f", nic.pci_link_gbytes);
      std::string others;
      for (const std::string& name : nic.other_names) others += (others.empty() ? "" : " ") + name;
      out += pad(nic.pci, 13) + pad(number_or_dash(nic.numa), 4) + pad(number_or_dash(nic.package), 3) +
             pad(nic.name, 14) + pad(hex4(nic.vendor_id) + ":" + hex4(nic.device_id), 9) +
             pad(nic.pci_link_gbytes > 0 ? speed : "?", 6) + (others.empty() ? "-" : others) + "\n";
    }
  }
  if (!table.warnings.empty()) {
    out += "\nwarnings:\n";
    for (const std::string& w : table.warnings) out += "  - " + w + "\n";
  }
  return out;
}

int find_nic(const Table& table, std::string_view pci_bus_id) { return find_by_pci(table.nics, pci_bus_id); }
int find_gpu(const Table& table, std::string_view pci_bus_id) { return find_by_pci(table.gpus, pci_bus_id); }

std::string format_pci_bus_id(uint32_t domain, uint32_t bus, uint32_t device, uint32_t function) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%04x:%02x:%02x.%x", domain, bus & 0xff, device & 0x1f, function & 0x7);
  return buf;
}

std::string normalize_pci_bus_id(std::string_view text) {
  while (!text.empty() && (text.front() == ' ' || text.front() == '\t' || text.front() == '\n')) {
    text.remove_prefix(1);
  }
  while (!text.empty() && (text.back() == ' ' || text.back() == '\t' || text.back() == '\n' ||
                           text.back() == '\0')) {
    text.remove_suffix(1);
  }
  // Two colons: domain given; one: bus:dev.fn in domain 0.
  size_t colons = 0;
  for (const char c : text) colons += c == ':';
  uint32_t domain = 0, bus = 0, device = 0, function = 0;
  if (colons == 2 && !parse_hex(text, 8, ':', domain)) return {};
  if (colons != 1 && colons != 2) return {};
  if (!parse_hex(text, 2, ':', bus) || !parse_hex(text, 2, '.', device) ||
      !parse_hex(text, 1, '\0', function)) {
    return {};
  }
  if (device > 0x1f || function > 7) return {};
  return format_pci_bus_id(domain, bus, device, function);
}

}  // namespace ponte::topo
