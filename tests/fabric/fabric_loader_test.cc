// Tests of run-time loading of libfabric: the search order, the fallback after a bad explicit
// path, and a clean kUnavailable when no candidate is a libfabric.
#include "core/fabric/fabric_loader.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/config.h"
#include "core/nic.h"

namespace ponte::fabric {
namespace {

TEST(FabricLoader, CandidatesInDocumentedOrder) {
  std::vector<std::string> c = fabric_library_candidates("/x/libfabric.so");
  ASSERT_EQ(c.size(), 4u);
  EXPECT_EQ(c[0], "/x/libfabric.so");
  EXPECT_EQ(c[1], "/opt/amazon/efa/lib/libfabric.so.1");
  EXPECT_EQ(c[2], "/opt/amazon/efa/lib64/libfabric.so.1");
  EXPECT_EQ(c[3], "libfabric.so.1");
  EXPECT_EQ(fabric_library_candidates("").size(), 3u);
}

TEST(FabricLoader, BadExplicitPathFallsBackToTheSystemLibrary) {
  auto lib = load_fabric_library(fabric_library_candidates("/nonexistent/libfabric.so.1"), true);
  ASSERT_TRUE(lib.ok()) << lib.status().message();
  EXPECT_NE((*lib)->path, "/nonexistent/libfabric.so.1");
  EXPECT_EQ(FI_MAJOR((*lib)->version), 1u);
  EXPECT_LE((*lib)->api_version, (*lib)->version);
  EXPECT_NE((*lib)->getinfo, nullptr);
  // Loaded once per process: a second load hands back the same table.
  auto again = load_fabric_library(fabric_library_candidates(""), false);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*lib, *again);
}

TEST(FabricLoader, NoLibfabricAnywhereIsUnavailable) {
  auto lib = load_fabric_library({"/nonexistent/a/libfabric.so.1", "/nonexistent/b/libfabric.so.1"},
                                 false);
  ASSERT_FALSE(lib.ok());
  EXPECT_EQ(lib.status().code(), Code::kUnavailable);
  EXPECT_NE(std::string(lib.status().message()).find("libfabric"), std::string::npos);
}

TEST(FabricLoader, ALibraryThatIsNotLibfabricIsRejected) {
  // libc opens fine but has no fi_getinfo.
  auto lib = load_fabric_library({"libc.so.6"}, false);
  ASSERT_FALSE(lib.ok());
  EXPECT_EQ(lib.status().code(), Code::kUnavailable);
  EXPECT_NE(std::string(lib.status().message()).find("fi_getinfo"), std::string::npos)
      << lib.status().message();
}

TEST(FabricLoader, BackendOpensWithABadExplicitPath) {
  Config cfg;
  cfg.fabric_lib = "/nonexistent/libfabric.so.1";
  cfg.fabric_provider = "tcp;ofi_rxm";
  auto backend = open_fabric_backend(cfg);
  ASSERT_TRUE(backend.ok()) << backend.status().message();
  EXPECT_FALSE((*backend)->devices().empty());
}

TEST(FabricLoader, DefaultProviderIsEfaAndAbsentEfaIsUnavailable) {
  Config cfg;
  EXPECT_EQ(cfg.fabric_provider, "efa");
  auto backend = open_fabric_backend(cfg);
  if (backend.ok()) {
    EXPECT_FALSE((*backend)->devices().empty());
    EXPECT_EQ((*backend)->devices()[0].provider, "efa");
  } else {
    EXPECT_EQ(backend.status().code(), Code::kUnavailable) << backend.status().message();
  }
}

TEST(FabricLoader, BogusProviderIsACleanError) {
  Config cfg;
  cfg.fabric_provider = "no_such_provider";
  auto backend = open_fabric_backend(cfg);
  ASSERT_FALSE(backend.ok());
  EXPECT_EQ(backend.status().code(), Code::kUnavailable);
  EXPECT_NE(std::string(backend.status().message()).find("no_such_provider"), std::string::npos)
      << backend.status().message();
}

}  // namespace
}  // namespace ponte::fabric
