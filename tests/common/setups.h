// Setups: the providers multi-process tests run over: tcp;ofi_rxm, shm and udp;ofi_rxd (RDM over
// datagrams with its own reliability, as EFA's SRD) on this host, verbs alone inside the SoftRoCE
// guest (PONTE_TEST_BACKEND=verbs). PONTE_TEST_SETUPS=NAME[,NAME] picks others by name, among them
// net (libfabric's own RDM over TCP sockets), which the release stage runs as entries of their own.
// Shared by tests/engine, tests/collectives and tests/liveness.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <ostream>
#include <sstream>
#include <string>
#include <vector>

#include "core/config.h"

namespace ponte::test {

struct Setup {
  std::string name;
  BackendChoice backend;
  std::string provider;
};

inline void PrintTo(const Setup& s, std::ostream* os) { *os << s.name; }

// Every setup a test can name (setup_by_name), whatever setups() picks.
inline std::vector<Setup> known_setups() {
  return {{"tcp_rxm", BackendChoice::kFabric, "tcp;ofi_rxm"},
          {"shm", BackendChoice::kFabric, "shm"},
          {"udp_rxd", BackendChoice::kFabric, "udp;ofi_rxd"},
          {"net", BackendChoice::kFabric, "net"},
          {"verbs", BackendChoice::kVerbs, ""}};
}

// The setups parameterised suites run over: verbs alone under PONTE_TEST_BACKEND=verbs, else the
// fabric setups PONTE_TEST_SETUPS names (default tcp_rxm,shm,udp_rxd).
inline std::vector<Setup> setups() {
  const std::vector<Setup> known = known_setups();
  const char* b = getenv("PONTE_TEST_BACKEND");
  const bool verbs = b && std::string(b) == "verbs";
  const char* pick = getenv("PONTE_TEST_SETUPS");
  if (verbs || !pick || !*pick) pick = verbs ? "verbs" : "tcp_rxm,shm,udp_rxd";
  const BackendChoice backend = verbs ? BackendChoice::kVerbs : BackendChoice::kFabric;
  std::vector<Setup> out;
  std::stringstream names(pick);
  for (std::string n; std::getline(names, n, ',');) {
    bool found = false;
    for (const auto& s : known) {
      if (s.name != n || s.backend != backend) continue;
      out.push_back(s);
      found = true;
    }
    if (!found) {  // at static initialisation (INSTANTIATE_TEST_SUITE_P): say so and stop
      std::string names_known;
      for (const auto& s : known)
        if (s.backend == BackendChoice::kFabric) names_known += (names_known.empty() ? "" : ", ") + s.name;
      fprintf(stderr, "PONTE_TEST_SETUPS: unknown setup '%s' (known: %s)\n", n.c_str(), names_known.c_str());
      exit(2);
    }
  }
  return out;
}

// A setup by name (a child process gets its parent's in argv); an unknown name is the first of setups().
inline Setup setup_by_name(const std::string& n) {
  for (auto& s : known_setups())
    if (s.name == n) return s;
  return setups()[0];
}

}  // namespace ponte::test
