// keep_test_traffic_on_loopback: points libfabric's IP providers at lo before a test process (or a
// peer it spawns, which inherits the environment) opens one. Without it they offer eth0 first.
#pragma once

#include <cstdlib>

namespace ponte::test {

// tcp (and tcp;ofi_rxm), udp (udp;ofi_rxd), net and sockets; a value the environment set wins.
inline void keep_test_traffic_on_loopback() {
  for (const char* name : {"FI_TCP_IFACE", "FI_UDP_IFACE", "FI_NET_IFACE", "FI_SOCKETS_IFACE"})
    setenv(name, "lo", 0);
}

}  // namespace ponte::test
