// Setups: the providers multi-process tests run over: tcp;ofi_rxm, shm and udp;ofi_rxd (RDM over
// datagrams with its own reliability, as EFA's SRD) on this host, verbs alone inside the SoftRoCE
// guest (PONTE_TEST_BACKEND=verbs). Shared by tests/engine and tests/collectives.
#pragma once

#include <cstdlib>
#include <ostream>
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

inline std::vector<Setup> setups() {
  const char* b = getenv("PONTE_TEST_BACKEND");
  if (b && std::string(b) == "verbs") return {{"verbs", BackendChoice::kVerbs, ""}};
  return {{"tcp_rxm", BackendChoice::kFabric, "tcp;ofi_rxm"}, {"shm", BackendChoice::kFabric, "shm"},
          {"udp_rxd", BackendChoice::kFabric, "udp;ofi_rxd"}};
}

inline Setup setup_by_name(const std::string& n) {
  for (auto& s : setups())
    if (s.name == n) return s;
  return setups()[0];
}

}  // namespace ponte::test
