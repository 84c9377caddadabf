// Helpers for the topology tests: fixture / real-machine paths, a tiny JSON reader for ponte-topo's
// output, running a command with its exit status, stdout and stderr, and table lookups.
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "topology/topology.h"

namespace ponte::topo::testing {

inline std::string fixture(const std::string& name) { return std::string(PONTE_TOPO_FIXTURES_DIR) + "/" + name; }
inline std::string real_machines_dir() { return PONTE_TOPOLOGIES_DIR; }
inline std::string real_machine(const std::string& name) { return real_machines_dir() + "/" + name; }

// A unique scratch path for this process (ctest runs each test in its own process).
inline std::string scratch(const std::string& name) {
  return "/tmp/ponte-topo-test-" + std::to_string(::getpid()) + "-" + name;
}

inline std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

inline std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

struct RunResult {
  int rc = -1;
  std::string out;
  std::string err;
};

// Runs `command` with /bin/sh; stderr goes through a scratch file.
inline RunResult run(const std::string& command) {
  RunResult r;
  const std::string err_path = scratch("stderr");
  FILE* pipe = ::popen((command + " 2>" + shell_quote(err_path)).c_str(), "r");
  if (pipe == nullptr) return r;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), pipe)) > 0) r.out.append(buf, n);
  const int status = ::pclose(pipe);
  r.rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.err = read_file(err_path);
  std::remove(err_path.c_str());
  return r;
}

// Just enough JSON to check ponte-topo's output: objects, arrays, strings, numbers, true/false/null.
struct Json {
  enum Kind { kNull, kBool, kNumber, kString, kArray, kObject } kind = kNull;
  bool boolean = false;
  double number = 0;
  std::string text;
  std::vector<Json> items;
  // An object's members: keys[i] names values[i]. Two vectors, not one of pair<string, Json>:
  // a vector of an incomplete type is fine, a pair of one is not (clang-14 rejects it).
  std::vector<std::string> keys;
  std::vector<Json> values;

  const Json& operator[](const std::string& key) const {
    static const Json missing;
    for (size_t i = 0; i < keys.size(); ++i) {
      if (keys[i] == key) return values[i];
    }
    return missing;
  }
  const Json& operator[](size_t i) const {
    static const Json missing;
    return i < items.size() ? items[i] : missing;
  }
  bool has(const std::string& key) const {
    for (const auto& k : keys) {
      if (k == key) return true;
    }
    return false;
  }
};

class JsonReader {
 public:
  explicit JsonReader(const std::string& text) : s_(text) {}

  // Parses the whole text; false (with error()) on anything malformed or trailing.
  bool parse(Json& out) {
    if (!value(out)) return false;
    space();
    if (at_ != s_.size()) return fail("trailing characters");
    return true;
  }
  const std::string& error() const { return error_; }

 private:
  bool fail(const std::string& why) {
    if (error_.empty()) error_ = why + " at offset " + std::to_string(at_);
    return false;
  }
  void space() {
    while (at_ < s_.size() && std::isspace(static_cast<unsigned char>(s_[at_]))) ++at_;
  }
  bool literal(const char* word) {
    const std::string w(word);
    if (s_.compare(at_, w.size(), w) != 0) return fail("bad literal");
    at_ += w.size();
    return true;
  }
  bool string(std::string& out) {
    if (at_ >= s_.size() || s_[at_] != '"') return fail("expected string");
    ++at_;
    while (at_ < s_.size() && s_[at_] != '"') {
      char c = s_[at_++];
      if (static_cast<unsigned char>(c) < 0x20) return fail("control character in string");
      if (c == '\\') {
        if (at_ >= s_.size()) return fail("bad escape");
        const char e = s_[at_++];
        switch (e) {
          case '"': case '\\': case '/': out += e; break;
          case 'n': out += '\n'; break;
          case 't': out += '\t'; break;
          case 'r': out += '\r'; break;
          case 'b': out += '\b'; break;
          case 'f': out += '\f'; break;
          case 'u':
            if (at_ + 4 > s_.size()) return fail("bad \\u escape");
            out += static_cast<char>(std::stoi(s_.substr(at_, 4), nullptr, 16));
            at_ += 4;
            break;
          default: return fail("bad escape");
        }
      } else {
        out += c;
      }
    }
    if (at_ >= s_.size()) return fail("unterminated string");
    ++at_;
    return true;
  }
  bool value(Json& out) {
    space();
    if (at_ >= s_.size()) return fail("unexpected end");
    const char c = s_[at_];
    if (c == '{') {
      out.kind = Json::kObject;
      ++at_;
      space();
      if (at_ < s_.size() && s_[at_] == '}') return ++at_, true;
      while (true) {
        std::string key;
        space();
        if (!string(key)) return false;
        space();
        if (at_ >= s_.size() || s_[at_] != ':') return fail("expected ':'");
        ++at_;
        Json v;
        if (!value(v)) return false;
        out.keys.push_back(std::move(key));
        out.values.push_back(std::move(v));
        space();
        if (at_ < s_.size() && s_[at_] == ',') { ++at_; continue; }
        if (at_ < s_.size() && s_[at_] == '}') return ++at_, true;
        return fail("expected ',' or '}'");
      }
    }
    if (c == '[') {
      out.kind = Json::kArray;
      ++at_;
      space();
      if (at_ < s_.size() && s_[at_] == ']') return ++at_, true;
      while (true) {
        Json v;
        if (!value(v)) return false;
        out.items.push_back(std::move(v));
        space();
        if (at_ < s_.size() && s_[at_] == ',') { ++at_; continue; }
        if (at_ < s_.size() && s_[at_] == ']') return ++at_, true;
        return fail("expected ',' or ']'");
      }
    }
    if (c == '"') {
      out.kind = Json::kString;
      return string(out.text);
    }
    if (c == 't') { out.kind = Json::kBool; out.boolean = true; return literal("true"); }
    if (c == 'f') { out.kind = Json::kBool; return literal("false"); }
    if (c == 'n') { out.kind = Json::kNull; return literal("null"); }
    const size_t start = at_;
    if (s_[at_] == '-') ++at_;
    while (at_ < s_.size() && (std::isdigit(static_cast<unsigned char>(s_[at_])) || s_[at_] == '.' ||
                               s_[at_] == 'e' || s_[at_] == 'E' || s_[at_] == '+' || s_[at_] == '-')) {
      ++at_;
    }
    if (at_ == start || (at_ == start + 1 && s_[start] == '-')) return fail("expected a value");
    out.kind = Json::kNumber;
    out.number = std::strtod(s_.substr(start, at_ - start).c_str(), nullptr);
    return true;
  }

  const std::string s_;
  size_t at_ = 0;
  std::string error_;
};

// GPU bus id -> its NICs' bus ids (in order).
inline std::map<std::string, std::vector<std::string>> gpu_nic_map(const Table& t) {
  std::map<std::string, std::vector<std::string>> out;
  for (const Gpu& g : t.gpus) {
    auto& list = out[g.pci];
    for (const NicLink& l : g.nics) list.push_back(t.nics.at(static_cast<size_t>(l.nic)).pci);
  }
  return out;
}

inline const Gpu* gpu_by_pci(const Table& t, const std::string& pci) {
  const int i = find_gpu(t, pci);
  return i < 0 ? nullptr : &t.gpus[static_cast<size_t>(i)];
}

inline bool has_warning(const Table& t, const std::string& part) {
  for (const std::string& w : t.warnings) {
    if (w.find(part) != std::string::npos) return true;
  }
  return false;
}

// What every table must satisfy, whatever the machine.
inline void expect_well_formed(const Table& t) {
  for (size_t i = 0; i < t.nics.size(); ++i) {
    EXPECT_EQ(normalize_pci_bus_id(t.nics[i].pci), t.nics[i].pci);
    EXPECT_FALSE(t.nics[i].name.empty());
    if (i > 0) {
      EXPECT_LT(t.nics[i - 1].pci, t.nics[i].pci) << "NICs must be in bus id order";
    }
  }
  for (size_t i = 0; i < t.gpus.size(); ++i) {
    const Gpu& g = t.gpus[i];
    EXPECT_EQ(normalize_pci_bus_id(g.pci), g.pci);
    if (i > 0) {
      EXPECT_LT(t.gpus[i - 1].pci, g.pci) << "GPUs must be in bus id order";
    }
    if (t.nics.empty()) {
      EXPECT_EQ(g.rule, Rule::kNone) << g.pci;
      EXPECT_TRUE(g.nics.empty()) << g.pci;
    } else {
      EXPECT_NE(g.rule, Rule::kNone) << g.pci;
      EXPECT_FALSE(g.nics.empty()) << g.pci << " has no NIC though the host has some";
    }
    for (size_t k = 0; k < g.nics.size(); ++k) {
      ASSERT_GE(g.nics[k].nic, 0);
      ASSERT_LT(static_cast<size_t>(g.nics[k].nic), t.nics.size());
      if (k > 0) {
        EXPECT_LE(g.nics[k - 1].distance, g.nics[k].distance) << "nearest first";
      }
    }
    EXPECT_FALSE(g.cpus.empty()) << g.pci << " has no progress core";
  }
  EXPECT_FALSE(t.host_groups.empty());
  for (const HostGroup& h : t.host_groups) {
    EXPECT_EQ(h.nics.size(), t.nics.size()) << "a host group lists every NIC";
    EXPECT_FALSE(h.cpus.empty()) << "host group of NUMA node " << h.numa;
    for (size_t k = 1; k < h.nics.size(); ++k) EXPECT_LE(h.nics[k - 1].distance, h.nics[k].distance);
  }
  Json json;
  JsonReader reader(to_json(t));
  ASSERT_TRUE(reader.parse(json)) << reader.error();
  EXPECT_EQ(json["gpus"].items.size(), t.gpus.size());
  EXPECT_EQ(json["nics"].items.size(), t.nics.size());
  EXPECT_EQ(json["host_groups"].items.size(), t.host_groups.size());
  EXPECT_EQ(json["warnings"].items.size(), t.warnings.size());
}

}  // namespace ponte::topo::testing
