// loopback_env: the consumers' defaults for a run on this host (libfabric tcp;ofi_rxm on lo, one NIC
// per engine); the environment wins. Call before the first engine (ponte reads it once).
#pragma once

#include <cstdlib>

inline void set_loopback_defaults() {
  setenv("PONTE_BACKEND", "fabric", 0);
  setenv("PONTE_FABRIC_PROVIDER", "tcp;ofi_rxm", 0);
  setenv("FI_TCP_IFACE", "lo", 0);
  setenv("PONTE_CTRL_ADDR", "127.0.0.1", 0);
  setenv("PONTE_NICS", "1", 0);
}
