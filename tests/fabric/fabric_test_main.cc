// Test main of the libfabric backend tests: keeps every network provider on loopback, then runs
// GoogleTest. (Set before libfabric is first loaded: providers read these once.)
#include <gtest/gtest.h>

#include <cstdlib>

int main(int argc, char** argv) {
  setenv("FI_TCP_IFACE", "lo", 1);
  setenv("FI_NET_IFACE", "lo", 1);
  setenv("FI_UDP_IFACE", "lo", 1);
  setenv("FI_SOCKETS_IFACE", "lo", 1);
  unsetenv("FI_PROVIDER");  // the tests pick providers themselves
  testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
