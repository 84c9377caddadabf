// Unit tests of the verbs backend that need no RDMA device: the PONTE_IB_HCA parser, the address and
// connect-blob wire formats, sysfs/port helpers, the loader, and open_verbs_backend on this host.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <dirent.h>
#include <string>
#include <vector>

#include "core/config.h"
#include "core/nic.h"
#include "core/verbs/verbs_backend.h"
#include "core/verbs/verbs_device.h"
#include "core/verbs/verbs_hca_filter.h"
#include "core/verbs/verbs_loader.h"
#include "core/verbs/verbs_wire.h"

namespace ponte::verbs {
namespace {

// ------------------------------------------------------------------------------ HCA filter

TEST(HcaFilter, EmptyAcceptsEverything) {
  for (const char* text : {"", "   "}) {
    auto f = HcaFilter::parse(text);
    ASSERT_TRUE(f.ok()) << f.status().message();
    EXPECT_TRUE(f->accepts("mlx5_0", 1));
    EXPECT_TRUE(f->accepts("rxe3", 2));
  }
}

TEST(HcaFilter, PrefixMatchWithPorts) {
  auto f = HcaFilter::parse("mlx5_0:1, mlx5_1");
  ASSERT_TRUE(f.ok()) << f.status().message();
  EXPECT_FALSE(f->exclude());
  EXPECT_FALSE(f->exact());
  ASSERT_EQ(f->entries().size(), 2u);
  EXPECT_EQ(f->entries()[0].name, "mlx5_0");
  EXPECT_EQ(f->entries()[0].port, 1);
  EXPECT_EQ(f->entries()[1].port, -1);
  EXPECT_TRUE(f->accepts("mlx5_0", 1));
  EXPECT_FALSE(f->accepts("mlx5_0", 2));
  EXPECT_TRUE(f->accepts("mlx5_1", 2));
  EXPECT_TRUE(f->accepts("mlx5_10", 1));  // prefix: mlx5_1 matches mlx5_10, as in NCCL
  EXPECT_FALSE(f->accepts("mlx5_2", 1));
  EXPECT_FALSE(f->accepts("rxe0", 1));
}

TEST(HcaFilter, ExactNames) {
  auto f = HcaFilter::parse("=mlx5_1,rxe0:1");
  ASSERT_TRUE(f.ok()) << f.status().message();
  EXPECT_TRUE(f->exact());
  EXPECT_TRUE(f->accepts("mlx5_1", 1));
  EXPECT_FALSE(f->accepts("mlx5_10", 1));
  EXPECT_TRUE(f->accepts("rxe0", 1));
  EXPECT_FALSE(f->accepts("rxe0", 2));
  EXPECT_FALSE(f->accepts("rxe", 1));
}

TEST(HcaFilter, Exclude) {
  auto f = HcaFilter::parse("^mlx5_2,mlx5_3:2");
  ASSERT_TRUE(f.ok()) << f.status().message();
  EXPECT_TRUE(f->exclude());
  EXPECT_FALSE(f->accepts("mlx5_2", 1));
  EXPECT_FALSE(f->accepts("mlx5_20", 1));
  EXPECT_TRUE(f->accepts("mlx5_3", 1));
  EXPECT_FALSE(f->accepts("mlx5_3", 2));
  EXPECT_TRUE(f->accepts("mlx5_0", 1));
}

TEST(HcaFilter, ExcludeExact) {
  auto f = HcaFilter::parse("^=rxe1");
  ASSERT_TRUE(f.ok()) << f.status().message();
  EXPECT_TRUE(f->exclude());
  EXPECT_TRUE(f->exact());
  EXPECT_FALSE(f->accepts("rxe1", 1));
  EXPECT_TRUE(f->accepts("rxe10", 1));
  EXPECT_TRUE(f->accepts("rxe0", 1));
}

TEST(HcaFilter, TrailingCommaTolerated) {
  auto f = HcaFilter::parse("rxe0,");
  ASSERT_TRUE(f.ok()) << f.status().message();
  EXPECT_EQ(f->entries().size(), 1u);
}

TEST(HcaFilter, BadInputIsInvalidArgument) {
  for (const char* text : {"^", "=", "^=", ",", ",rxe0", "rxe0,,rxe1", "rxe0:", "rxe0:x", "rxe0:0",
                           "rxe0:256", "rxe0:1x", ":1",
                           "a_device_name_far_longer_than_any_kernel_device_name_could_ever_be_x"}) {
    auto f = HcaFilter::parse(text);
    ASSERT_FALSE(f.ok()) << "accepted \"" << text << "\"";
    EXPECT_EQ(f.status().code(), Code::kInvalidArgument) << text;
    EXPECT_NE(strstr(f.status().message(), "PONTE_IB_HCA"), nullptr) << f.status().message();
  }
}

// ------------------------------------------------------------------------------ wire formats

VerbsAddress sample_address() {
  VerbsAddress a;
  a.link_layer = LinkLayer::kEthernet;
  a.port = 2;
  a.lid = 0x1234;
  a.mtu = 5;
  a.gid_index = 3;
  for (int i = 0; i < 16; ++i) a.gid[i] = static_cast<uint8_t>(0xa0 + i);
  return a;
}

ConnectBlob sample_blob(uint8_t qps = 1) {
  ConnectBlob b;
  b.qp_count = qps;
  for (uint8_t i = 0; i < qps; ++i) b.qpn[i] = 0xabcdef - i;
  b.psn = 0x123456;
  b.lid = 7;
  b.mtu = 3;
  b.link_layer = LinkLayer::kInfiniBand;
  for (int i = 0; i < 16; ++i) b.gid[i] = static_cast<uint8_t>(i);
  return b;
}

TEST(VerbsWire, AddressRoundTrip) {
  VerbsAddress a = sample_address();
  auto bytes = a.encode();
  ASSERT_EQ(bytes.size(), VerbsAddress::kSize);
  EXPECT_EQ(bytes[0], VerbsAddress::kTag);
  EXPECT_EQ(bytes[1], VerbsAddress::kVersion);
  auto d = VerbsAddress::decode(bytes);
  ASSERT_TRUE(d.ok()) << d.status().message();
  EXPECT_EQ(d->link_layer, a.link_layer);
  EXPECT_EQ(d->port, a.port);
  EXPECT_EQ(d->lid, a.lid);
  EXPECT_EQ(d->mtu, a.mtu);
  EXPECT_EQ(d->gid_index, a.gid_index);
  EXPECT_EQ(d->gid, a.gid);
}

TEST(VerbsWire, BlobRoundTrip) {
  for (uint8_t qps : {uint8_t{1}, uint8_t{2}, uint8_t{4}, static_cast<uint8_t>(ConnectBlob::kMaxQps)}) {
    for (bool tc : {false, true}) {
      ConnectBlob b = sample_blob(qps);
      b.has_traffic_class = tc;
      b.traffic_class = tc ? 106 : 0;
      auto bytes = b.encode();
      ASSERT_EQ(bytes.size(), ConnectBlob::kHeaderSize + 4u * qps);
      EXPECT_EQ(bytes[1], 2) << "the multi-QP blob is version 2";
      auto d = ConnectBlob::decode(bytes);
      ASSERT_TRUE(d.ok()) << d.status().message();
      EXPECT_EQ(d->qp_count, qps);
      for (uint8_t i = 0; i < qps; ++i) EXPECT_EQ(d->qpn[i], b.qpn[i]);
      EXPECT_EQ(d->psn, b.psn);
      EXPECT_EQ(d->lid, b.lid);
      EXPECT_EQ(d->mtu, b.mtu);
      EXPECT_EQ(d->link_layer, b.link_layer);
      EXPECT_EQ(d->gid, b.gid);
      EXPECT_EQ(d->has_traffic_class, tc);
      EXPECT_EQ(d->traffic_class, tc ? 106 : 0);
      EXPECT_EQ(*d, b);
    }
  }
}

template <typename T>
void expect_rejected(std::vector<uint8_t> bytes, const char* why) {
  auto d = T::decode(bytes);
  ASSERT_FALSE(d.ok()) << why;
  EXPECT_EQ(d.status().code(), Code::kInvalidArgument) << why;
}

TEST(VerbsWire, AddressRejectsBadBytes) {
  auto good = sample_address().encode();
  std::vector<uint8_t> v(good.begin(), good.end());
  for (size_t n = 0; n < v.size(); ++n) {  // every truncation
    expect_rejected<VerbsAddress>(std::vector<uint8_t>(v.begin(), v.begin() + n),
                                                      "truncated");
  }
  auto with = [&](size_t off, uint8_t value) {
    auto c = v;
    c[off] = value;
    return c;
  };
  auto longer = v;
  longer.push_back(0);
  expect_rejected<VerbsAddress>(longer, "trailing byte");
  expect_rejected<VerbsAddress>(with(0, ConnectBlob::kTag), "a blob is not an address");
  expect_rejected<VerbsAddress>(with(0, 0x46), "foreign tag");
  expect_rejected<VerbsAddress>(with(1, 2), "future version");
  expect_rejected<VerbsAddress>(with(2, VerbsAddress::kSize + 1), "length field");
  expect_rejected<VerbsAddress>(with(4, 0), "link layer 0");
  expect_rejected<VerbsAddress>(with(4, 9), "link layer 9");
  expect_rejected<VerbsAddress>(with(5, 0), "port 0");
  expect_rejected<VerbsAddress>(with(8, 0), "mtu 0");
  expect_rejected<VerbsAddress>(with(8, 6), "mtu 6");
  // Bytes of a libfabric address or random text are refused too.
  std::vector<uint8_t> text(28, 'x');
  expect_rejected<VerbsAddress>(text, "text");
}

TEST(VerbsWire, BlobRejectsBadBytes) {
  auto good = sample_blob(3).encode();
  std::vector<uint8_t> v(good.begin(), good.end());
  for (size_t n = 0; n < v.size(); ++n) {
    expect_rejected<ConnectBlob>(std::vector<uint8_t>(v.begin(), v.begin() + n), "truncated");
  }
  auto with32 = [&](size_t off, uint32_t value) {
    auto c = v;
    memcpy(&c[off], &value, 4);  // the host is little-endian like the format
    return c;
  };
  auto with = [&](size_t off, uint8_t value) {
    auto c = v;
    c[off] = value;
    return c;
  };
  expect_rejected<ConnectBlob>(with(0, VerbsAddress::kTag), "an address is not a blob");
  expect_rejected<ConnectBlob>(with(1, 0), "version 0");
  expect_rejected<ConnectBlob>(with(1, 1), "version 1 (one QP, no count)");
  expect_rejected<ConnectBlob>(with(2, 0), "length field");
  expect_rejected<ConnectBlob>(with(2, static_cast<uint8_t>(v.size() + 4)), "length field beyond the bytes");
  expect_rejected<ConnectBlob>(with32(4, 0x1000000), "psn > 24 bits");
  expect_rejected<ConnectBlob>(with(10, 0), "mtu 0");
  expect_rejected<ConnectBlob>(with(11, 3), "link layer 3");
  expect_rejected<ConnectBlob>(with(12, 0), "0 QPs");
  expect_rejected<ConnectBlob>(with(12, 2), "QP count and length disagree");
  expect_rejected<ConnectBlob>(with(12, 4), "QP count beyond the bytes");
  expect_rejected<ConnectBlob>(with(13, 2), "unknown flag");
  expect_rejected<ConnectBlob>(with(14, 5), "a traffic class without its flag");
  expect_rejected<ConnectBlob>(with(15, 1), "padding");
  expect_rejected<ConnectBlob>(with32(32, 0), "qpn 0");
  expect_rejected<ConnectBlob>(with32(40, 0x1000000), "the last QPN > 24 bits");
  auto longer = v;
  longer.push_back(1);
  expect_rejected<ConnectBlob>(longer, "trailing byte");
  // More QPs than the format allows: a valid-looking blob of kMaxQps + 1 QPNs.
  ConnectBlob most = sample_blob(static_cast<uint8_t>(ConnectBlob::kMaxQps));
  auto bytes = most.encode();
  bytes[12] = ConnectBlob::kMaxQps + 1;
  bytes.insert(bytes.end(), {1, 0, 0, 0});
  bytes[2] = static_cast<uint8_t>(bytes.size());
  expect_rejected<ConnectBlob>(bytes, "too many QPs");
}

// ------------------------------------------------------------------------------ port helpers

TEST(VerbsPortFacts, SpeedFromCodes) {
  EXPECT_EQ(port_speed_mbps(1, 1), 2500u);      // SDR 1x
  EXPECT_EQ(port_speed_mbps(4, 2), 40000u);     // QDR 4x
  EXPECT_EQ(port_speed_mbps(8, 1), 10000u);     // FDR10 1x (what rxe on a 10G veth reports)
  EXPECT_EQ(port_speed_mbps(32, 2), 100000u);   // EDR 4x
  EXPECT_EQ(port_speed_mbps(64, 2), 200000u);   // HDR 4x
  EXPECT_EQ(port_speed_mbps(128, 2), 400000u);  // NDR 4x
  EXPECT_EQ(port_speed_mbps(64, 16), 100000u);  // HDR 2x
  EXPECT_EQ(port_speed_mbps(0, 2), 0u);
  EXPECT_EQ(port_speed_mbps(32, 3), 0u);
}

TEST(VerbsPortFacts, MtuAndGidHelpers) {
  EXPECT_EQ(mtu_bytes(IBV_MTU_256), 256u);
  EXPECT_EQ(mtu_bytes(IBV_MTU_4096), 4096u);
  EXPECT_EQ(mtu_bytes(0), 0u);
  EXPECT_EQ(mtu_bytes(6), 0u);
  ibv_gid g{};
  g.raw[10] = 0xff;
  g.raw[11] = 0xff;
  g.raw[12] = 192;
  EXPECT_TRUE(gid_is_ipv4_mapped(g));
  g.raw[0] = 0xfe;
  g.raw[1] = 0x80;
  EXPECT_FALSE(gid_is_ipv4_mapped(g));
}

class FakeSysfs : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/ponte-verbs-sysfs-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    root_ = tmpl;
  }
  void TearDown() override {
    std::string cmd = "rm -rf '" + root_ + "'";
    ASSERT_EQ(system(cmd.c_str()), 0);
  }
  void mkdirs(const std::string& rel) {
    std::string cmd = "mkdir -p '" + root_ + "/" + rel + "'";
    ASSERT_EQ(system(cmd.c_str()), 0);
  }
  void write(const std::string& rel, const std::string& text) {
    FILE* f = fopen((root_ + "/" + rel).c_str(), "w");
    ASSERT_NE(f, nullptr);
    fputs(text.c_str(), f);
    fclose(f);
  }
  std::string root_;
};

TEST_F(FakeSysfs, PciBusIdFromDeviceLink) {
  mkdirs("pci0000:40/0000:40:01.1/0000:43:00.0");
  mkdirs("ib/mlx5_0");
  ASSERT_EQ(symlink((root_ + "/pci0000:40/0000:40:01.1/0000:43:00.0").c_str(),
                    (root_ + "/ib/mlx5_0/device").c_str()), 0);
  mkdirs("ib/rxe0");  // a software device has no device link
  mkdirs("virt/net/veth0");
  mkdirs("ib/siw0");
  ASSERT_EQ(symlink((root_ + "/virt/net/veth0").c_str(), (root_ + "/ib/siw0/device").c_str()), 0);
  std::string ib = root_ + "/ib";
  EXPECT_EQ(sysfs_pci_bus_id("mlx5_0", ib.c_str()), "0000:43:00.0");
  EXPECT_EQ(sysfs_pci_bus_id("rxe0", ib.c_str()), "");
  EXPECT_EQ(sysfs_pci_bus_id("siw0", ib.c_str()), "");
  EXPECT_EQ(sysfs_pci_bus_id("missing", ib.c_str()), "");
}

TEST_F(FakeSysfs, GidType) {
  mkdirs("ib/rxe0/ports/1/gid_attrs/types");
  write("ib/rxe0/ports/1/gid_attrs/types/0", "IB/RoCE v1\n");
  write("ib/rxe0/ports/1/gid_attrs/types/1", "RoCE v2\n");
  std::string ib = root_ + "/ib";
  EXPECT_EQ(sysfs_gid_type("rxe0", 1, 0, ib.c_str()), "IB/RoCE v1");
  EXPECT_EQ(sysfs_gid_type("rxe0", 1, 1, ib.c_str()), "RoCE v2");
  EXPECT_EQ(sysfs_gid_type("rxe0", 1, 2, ib.c_str()), "");
}

// ------------------------------------------------------------------------------ loader, backend

bool host_has_rdma_devices() {
  DIR* d = opendir("/sys/class/infiniband");
  if (d == nullptr) return false;
  bool any = false;
  while (dirent* e = readdir(d)) {
    if (e->d_name[0] != '.') any = true;
  }
  closedir(d);
  return any;
}

TEST(VerbsLoader, MissingLibraryIsUnavailable) {
  auto api = load_verbs_api("/nonexistent/libibverbs.so.1");
  ASSERT_FALSE(api.ok());
  EXPECT_EQ(api.status().code(), Code::kUnavailable);
  EXPECT_NE(strstr(api.status().message(), "/nonexistent/libibverbs.so.1"), nullptr)
      << api.status().message();

  Config cfg;
  cfg.verbs_lib = "/nonexistent/libibverbs.so.1";
  auto b = open_verbs_backend(cfg);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), Code::kUnavailable);
}

TEST(VerbsLoader, WrongLibraryIsUnavailable) {
  // A real shared library that is not libibverbs: every symbol is missing.
  auto api = load_verbs_api("libm.so.6");
  ASSERT_FALSE(api.ok());
  EXPECT_EQ(api.status().code(), Code::kUnavailable);
  EXPECT_NE(strstr(api.status().message(), "ibv_get_device_list"), nullptr) << api.status().message();
}

TEST(VerbsLoader, SystemLibraryResolvesEverything) {
  auto api = load_verbs_api("");
  if (!api.ok()) GTEST_SKIP() << "libibverbs.so.1 is not installed here: " << api.status().message();
  const VerbsApi* a = api.value();
  EXPECT_EQ(a->path, "libibverbs.so.1");
  EXPECT_NE(a->get_device_list, nullptr);
  EXPECT_NE(a->query_port_export, nullptr);
  EXPECT_NE(a->reg_mr, nullptr);
  EXPECT_NE(a->create_qp, nullptr);
  EXPECT_NE(a->query_qp, nullptr);
  EXPECT_STREQ(a->status_str(IBV_WC_REM_ACCESS_ERR), "remote access error");
  auto again = load_verbs_api("libibverbs.so.1");
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again.value(), a);  // loaded once
}

TEST(VerbsBackend, ThisHostGivesACleanAnswer) {
  Config cfg;
  auto b = open_verbs_backend(cfg);
  if (!host_has_rdma_devices()) {
    ASSERT_FALSE(b.ok()) << "a backend opened on a host without /sys/class/infiniband devices";
    EXPECT_EQ(b.status().code(), Code::kUnavailable) << b.status().message();
    EXPECT_TRUE(strstr(b.status().message(), "no RDMA devices") != nullptr ||
                strstr(b.status().message(), "ibv_get_device_list") != nullptr ||
                strstr(b.status().message(), "cannot load") != nullptr)
        << b.status().message();
  } else if (b.ok()) {
    ASSERT_FALSE(b.value()->devices().empty());
    EXPECT_EQ(b.value()->kind(), BackendKind::kVerbs);
    for (const NicInfo& n : b.value()->devices()) EXPECT_EQ(n.provider, "verbs");
  } else {
    EXPECT_EQ(b.status().code(), Code::kUnavailable) << b.status().message();
  }
}

TEST(VerbsBackend, BadHcaFilterIsInvalidArgument) {
  if (!load_verbs_api("").ok()) GTEST_SKIP() << "libibverbs.so.1 is not installed here";
  Config cfg;
  cfg.ib_hca = "mlx5_0:x";
  auto b = open_verbs_backend(cfg);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), Code::kInvalidArgument) << b.status().message();
}

// ------------------------------------------------------------------------------ knobs (issue 10)

// NCCL's IB defaults, and the knobs of the receive queue and of the QPs per connection.
TEST(VerbsConfig, DefaultsAndQpsPerConnection) {
  for (const char* v : {"PONTE_IB_TIMEOUT", "PONTE_IB_QPS_PER_CONNECTION", "PONTE_RECV_COUNT"}) unsetenv(v);
  auto c = Config::from_env();
  ASSERT_TRUE(c.ok()) << c.status().message();
  EXPECT_EQ(c->ib_timeout, 20) << "NCCL_IB_TIMEOUT's default";
  EXPECT_EQ(c->ib_retry_count, 7);
  EXPECT_EQ(c->ib_qps_per_connection, 1) << "NCCL_IB_QPS_PER_CONNECTION's default";
  EXPECT_GE(c->recv_buf_count, 512u) << "the receive queue's depth: an incast's write-with-immediates";
  setenv("PONTE_IB_QPS_PER_CONNECTION", "4", 1);
  c = Config::from_env();
  ASSERT_TRUE(c.ok()) << c.status().message();
  EXPECT_EQ(c->ib_qps_per_connection, 4);
  for (const char* bad : {"0", "17", "-1", "two"}) {
    setenv("PONTE_IB_QPS_PER_CONNECTION", bad, 1);
    auto b = Config::from_env();
    ASSERT_FALSE(b.ok()) << bad;
    EXPECT_NE(strstr(b.status().message(), "PONTE_IB_QPS_PER_CONNECTION"), nullptr) << b.status().message();
  }
  unsetenv("PONTE_IB_QPS_PER_CONNECTION");
  static_assert(ConnectBlob::kMaxQps == 16, "PONTE_IB_QPS_PER_CONNECTION's range is 1..16");
}


// ------------------------------------------------------------------------------ fork()

// decide_fork's four outcomes. A kernel without copy-on-fork (before 5.12) is not at hand here, so
// libibverbs' two entry points are stand-ins that say what such a kernel would; the test below uses
// the real library.
int g_fork_init_calls = 0;
int g_fork_init_result = 0;
int counted_fork_init() {
  g_fork_init_calls++;
  return g_fork_init_result;
}
ibv_fork_status copy_on_fork() { return IBV_FORK_UNNEEDED; }
ibv_fork_status no_copy_on_fork() { return IBV_FORK_DISABLED; }

TEST(ForkSupport, OnlyAKernelWithoutCopyOnForkGetsIbvForkInit) {
  VerbsApi api;
  api.fork_init = counted_fork_init;
  api.is_fork_initialized = copy_on_fork;
  g_fork_init_calls = 0;
  EXPECT_EQ(decide_fork(api), ForkSupport::kUnneeded);
  EXPECT_EQ(g_fork_init_calls, 0) << "no madvise per registration where the kernel copies pinned pages";
  api.is_fork_initialized = no_copy_on_fork;
  g_fork_init_result = 0;
  EXPECT_EQ(decide_fork(api), ForkSupport::kEnabled);
  EXPECT_EQ(g_fork_init_calls, 1);
  g_fork_init_result = EINVAL;  // libibverbs: a registration came first
  EXPECT_EQ(decide_fork(api), ForkSupport::kTooLate);
  g_fork_init_result = ENOSYS;  // no MADV_DONTFORK
  EXPECT_EQ(decide_fork(api), ForkSupport::kUnavailable);
  api.is_fork_initialized = nullptr;  // rdma-core before 35: no way to ask, so fork_init
  g_fork_init_result = 0;
  EXPECT_EQ(decide_fork(api), ForkSupport::kEnabled);
  EXPECT_EQ(g_fork_init_calls, 4);
}

// The real libibverbs. This host's kernel has no RDMA support, so libibverbs cannot ask it about
// copy-on-fork and reports fork support disabled until ibv_fork_init; in the SoftRoCE guest (6.1)
// the kernel copies (IBV_FORK_UNNEEDED). Either way the process is fork-safe once the backend
// prepared it, which it does before ibv_get_device_list, whatever that then finds.
TEST(ForkSupport, TheBackendLeavesTheProcessForkSafe) {
  auto api = load_verbs_api("");
  ASSERT_TRUE(api.ok()) << api.status().message();
  ASSERT_NE(api.value()->is_fork_initialized, nullptr) << "rdma-core 44 exports ibv_is_fork_initialized";
  const ibv_fork_status before = api.value()->is_fork_initialized();
  Config cfg;
  auto backend = VerbsBackend::open(cfg);  // fails here (no RDMA devices), after preparing fork()
  const ibv_fork_status after = api.value()->is_fork_initialized();
  EXPECT_NE(after, IBV_FORK_DISABLED) << "before: " << before;
  EXPECT_EQ(prepare_fork(*api.value()), after == IBV_FORK_UNNEEDED ? ForkSupport::kUnneeded : ForkSupport::kEnabled);
}

}  // namespace
}  // namespace ponte::verbs
