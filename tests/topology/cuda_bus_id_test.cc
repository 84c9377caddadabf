// CUDA device -> PCI bus id through the dlopen'ed driver: a clean "not available" without it, the
// driver's own error from a stub library, and (on a GPU host) bus ids that are in the table.
#include <gtest/gtest.h>

#include <filesystem>

#include "tests/topology/topo_test_util.h"
#include "topology/cuda_bus_id.h"
#include "topology/topology.h"

namespace ponte::topo {
namespace {

TEST(CudaBusId, MissingDriverIsNotAvailable) {
  const CudaBusIds all = cuda_pci_bus_ids("libponte-no-such-cuda.so.1");
  EXPECT_FALSE(all.ok);
  EXPECT_EQ(all.error.rfind("CUDA driver not available", 0), 0u) << all.error;
  EXPECT_TRUE(all.pci.empty());
  const CudaBusId one = cuda_pci_bus_id(0, "libponte-no-such-cuda.so.1");
  EXPECT_FALSE(one.ok);
  EXPECT_EQ(one.error.rfind("CUDA driver not available", 0), 0u) << one.error;
  EXPECT_FALSE(cuda_pci_bus_ids("").ok);
  EXPECT_FALSE(cuda_pci_bus_ids(nullptr).ok);
}

TEST(CudaBusId, LibraryWithoutTheDriverApi) {
  // libdl-like library that is loadable but has no cuInit.
  const CudaBusIds all = cuda_pci_bus_ids("libm.so.6");
  EXPECT_FALSE(all.ok);
  EXPECT_NE(all.error.find("lacks cuInit"), std::string::npos) << all.error;
}

TEST(CudaBusId, StubDriverReportsItsError) {
  const std::string stub = PONTE_CUDA_STUB;
  if (stub.empty() || !std::filesystem::exists(stub)) {
    GTEST_SKIP() << "no CUDA toolkit stub libcuda.so found at configure time: the stub-driver path "
                    "did NOT run";
  }
  const CudaBusIds all = cuda_pci_bus_ids(stub.c_str());
  EXPECT_FALSE(all.ok) << "the toolkit's stub driver cannot initialise";
  EXPECT_NE(all.error.find("cuInit failed"), std::string::npos) << all.error;
}

TEST(CudaBusId, SystemDriverWhenPresent) {
  const CudaBusIds all = cuda_pci_bus_ids();
  if (!all.ok) {
    EXPECT_FALSE(all.error.empty());
    EXPECT_TRUE(all.pci.empty());
    std::printf("CUDA driver on this host: %s\n", all.error.c_str());
    return;
  }
  // A GPU host: every CUDA device is an NVIDIA GPU of the live table, by bus id.
  const Result live = discover(Options{});
  ASSERT_TRUE(live.ok) << live.error;
  for (size_t i = 0; i < all.pci.size(); ++i) {
    EXPECT_EQ(normalize_pci_bus_id(all.pci[i]), all.pci[i]);
    EXPECT_GE(find_gpu(live.table, all.pci[i]), 0) << "cuda " << i << " " << all.pci[i] << " not in the table";
    const CudaBusId one = cuda_pci_bus_id(static_cast<int>(i));
    EXPECT_TRUE(one.ok) << one.error;
    EXPECT_EQ(one.pci, all.pci[i]);
  }
  const CudaBusId past_end = cuda_pci_bus_id(static_cast<int>(all.pci.size()));
  EXPECT_FALSE(past_end.ok);
  EXPECT_NE(past_end.error.find("no CUDA device"), std::string::npos) << past_end.error;
}

}  // namespace
}  // namespace ponte::topo
