// The verbs backend for real, between SoftRoCE devices of the tests/softroce guest: node A uses rxe0
// (and rxe2), node B rxe1 (and rxe3), each pair joined by a veth. Both nodes live in this process and
// one thread polls both. Outside the guest (no rxe devices) every test skips and says why.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/config.h"
#include "core/nic.h"
#include "core/verbs/verbs_nic.h"
#include "core/verbs/verbs_srq.h"

namespace ponte {
namespace {

using Clock = std::chrono::steady_clock;

// Inside the guest the rig sets PONTE_RXE_GUEST=1: a missing device is then a failure, not a skip.
bool in_guest() {
  const char* g = getenv("PONTE_RXE_GUEST");
  return g != nullptr && strcmp(g, "1") == 0;
}

std::string env_or(const char* name, const char* fallback) {
  const char* v = getenv(name);
  return v != nullptr && *v != 0 ? v : fallback;
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= s.size()) {
    size_t c = s.find(',', start);
    if (c == std::string::npos) c = s.size();
    if (c > start) out.push_back(s.substr(start, c - start));
    start = c + 1;
  }
  return out;
}

// A registered host buffer on one NIC.
struct Buffer {
  std::vector<uint8_t> bytes;
  NicMr mr;
  Nic* nic = nullptr;
  Buffer() = default;
  Buffer(const Buffer&) = delete;
  ~Buffer() {
    if (nic != nullptr) nic->deregister(mr);
  }
  uint8_t* data() { return bytes.data(); }
  uint64_t remote(size_t off = 0) const { return mr.remote_base + off; }
};

std::unique_ptr<Buffer> make_buffer(Nic* nic, size_t len, uint8_t fill) {
  auto b = std::make_unique<Buffer>();
  b->bytes.assign(len, fill);
  MemoryDesc d;
  d.addr = b->bytes.data();
  d.len = len;
  auto mr = nic->register_memory(d);
  EXPECT_TRUE(mr.ok()) << mr.status().message();
  if (!mr.ok()) return nullptr;
  b->mr = mr.value();
  b->nic = nic;
  return b;
}

void fill_pattern(uint8_t* p, size_t len, uint32_t seed) {
  uint32_t x = seed * 2654435761u + 1;
  for (size_t i = 0; i < len; ++i) {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    p[i] = static_cast<uint8_t>(x);
  }
}

// Collects completions from several NICs until `done` holds or the deadline passes.
struct Poller {
  std::vector<Nic*> nics;
  std::vector<std::vector<Completion>> got;  // per NIC

  explicit Poller(std::vector<Nic*> n) : nics(std::move(n)), got(nics.size()) {}
  void poll_once() {
    Completion c[64];
    for (size_t i = 0; i < nics.size(); ++i) {
      int k = nics[i]->poll(c, 64);
      for (int j = 0; j < k; ++j) got[i].push_back(c[j]);
    }
  }
  bool until(const std::function<bool()>& done, int timeout_ms = 20000) {
    auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
    while (!done()) {
      if (Clock::now() > deadline) return false;
      poll_once();
    }
    return true;
  }
  size_t count(size_t nic, CompletionKind kind) const {
    size_t n = 0;
    for (const Completion& c : got[nic]) n += c.kind == kind;
    return n;
  }
};

class RxeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    cfg_.ib_hca = "";  // the guest's four rxe devices
    auto b = open_verbs_backend(cfg_);
    if (!b.ok()) {
      if (in_guest()) FAIL() << "no verbs backend inside the SoftRoCE guest: " << b.status().message();
      GTEST_SKIP() << "needs SoftRoCE devices (run tests/softroce/run-suite BUILD_DIR): "
                   << b.status().message();
    }
    backend_ = std::move(b).value();
    devs_a_ = split(env_or("PONTE_RXE_DEVS_A", "rxe0,rxe2"));
    devs_b_ = split(env_or("PONTE_RXE_DEVS_B", "rxe1,rxe3"));
  }

  // Index of "name:1" in the backend's list, or -1.
  int index_of(const std::string& dev) const {
    const auto& d = backend_->devices();
    for (size_t i = 0; i < d.size(); ++i) {
      if (d[i].name == dev + ":1") return static_cast<int>(i);
    }
    return -1;
  }

  std::unique_ptr<Nic> open(const std::string& dev) {
    int i = index_of(dev);
    EXPECT_GE(i, 0) << dev << " not among the backend's devices";
    if (i < 0) return nullptr;
    auto n = backend_->open_nic(static_cast<size_t>(i));
    EXPECT_TRUE(n.ok()) << n.status().message();
    return n.ok() ? std::move(n).value() : nullptr;
  }

  // Opens dev through a backend of its own built from cfg (another PONTE_IB_* setting than cfg_).
  std::unique_ptr<Nic> open_with(const Config& cfg, const std::string& dev) {
    auto b = open_verbs_backend(cfg);
    EXPECT_TRUE(b.ok()) << b.status().message();
    if (!b.ok()) return nullptr;
    others_.push_back(std::move(b).value());
    const auto& d = others_.back()->devices();
    for (size_t i = 0; i < d.size(); ++i) {
      if (d[i].name != dev + ":1") continue;
      auto n = others_.back()->open_nic(i);
      EXPECT_TRUE(n.ok()) << n.status().message();
      return n.ok() ? std::move(n).value() : nullptr;
    }
    ADD_FAILURE() << dev << " not among the backend's devices";
    return nullptr;
  }

  // Opens node A's and node B's NIC of rail r and connects them through blobs (B's NIC through
  // b_cfg when given).
  bool open_rail(size_t r, const Config* b_cfg = nullptr) {
    if (r >= devs_a_.size() || r >= devs_b_.size()) {
      ADD_FAILURE() << "rail " << r << " missing: PONTE_RXE_DEVS_A/B name too few devices";
      return false;
    }
    a_.push_back(open(devs_a_[r]));
    b_.push_back(b_cfg != nullptr ? open_with(*b_cfg, devs_b_[r]) : open(devs_b_[r]));
    if (!a_.back() || !b_.back()) return false;
    auto pa = a_[r]->add_peer(b_[r]->address());
    auto pb = b_[r]->add_peer(a_[r]->address());
    EXPECT_TRUE(pa.ok()) << pa.status().message();
    EXPECT_TRUE(pb.ok()) << pb.status().message();
    if (!pa.ok() || !pb.ok()) return false;
    peer_a_.push_back(*pa);
    peer_b_.push_back(*pb);
    return handshake(r);
  }

  bool handshake(size_t r) {
    auto blob_a = a_[r]->connect_blob(peer_a_[r]);
    auto blob_b = b_[r]->connect_blob(peer_b_[r]);
    EXPECT_TRUE(blob_a.ok()) << blob_a.status().message();
    EXPECT_TRUE(blob_b.ok()) << blob_b.status().message();
    if (!blob_a.ok() || !blob_b.ok()) return false;
    Status sa = a_[r]->complete_connect(peer_a_[r], *blob_b);
    Status sb = b_[r]->complete_connect(peer_b_[r], *blob_a);
    EXPECT_TRUE(sa.ok()) << sa.message();
    EXPECT_TRUE(sb.ok()) << sb.message();
    return sa.ok() && sb.ok();
  }

  // Keeps B's SRQ stocked: a write-with-imm consumes one receive (the backend reposts it).
  void post_receives(Nic* nic, Buffer* buf, size_t slot_size, int count, uint64_t ctx_base) {
    for (int i = 0; i < count; ++i) {
      Status s = nic->post_recv(buf->data() + i * slot_size, slot_size, buf->mr.desc, ctx_base + i);
      ASSERT_TRUE(s.ok()) << s.message();
    }
  }

  // A write of len host bytes from src+off to dst+dst_off over rail r (A to B).
  WriteWr write_wr(size_t r, Buffer& src, size_t off, size_t len, Buffer& dst, size_t dst_off, uint64_t ctx) {
    WriteWr w;
    w.peer = peer_a_[r];
    w.local = src.data() + off;
    w.len = len;
    w.desc = src.mr.desc;
    w.remote_addr = dst.remote(dst_off);
    w.rkey = dst.mr.rkey;
    w.inline_ok = true;
    w.ctx = ctx;
    return w;
  }

  // Posts, polling every NIC while the backend answers kAgain; fails the test on other errors.
  void post_retrying(Poller& poller, const std::function<Status()>& post, int* again = nullptr) {
    auto deadline = Clock::now() + std::chrono::seconds(20);
    for (;;) {
      Status s = post();
      if (s.ok()) return;
      ASSERT_EQ(s.code(), Code::kAgain) << s.message();
      if (again != nullptr) ++*again;
      ASSERT_LT(Clock::now(), deadline) << "back-pressure never cleared";
      poller.poll_once();
    }
  }

  Config cfg_;
  std::unique_ptr<Backend> backend_;
  std::vector<std::unique_ptr<Backend>> others_;
  std::vector<std::string> devs_a_, devs_b_;
  std::vector<std::unique_ptr<Nic>> a_, b_;
  std::vector<NicPeer> peer_a_, peer_b_;
};

TEST_F(RxeTest, DevicesDescribeRxePorts) {
  const auto& d = backend_->devices();
  ASSERT_GE(d.size(), 2u);
  for (const std::string& dev : {devs_a_[0], devs_b_[0]}) {
    int i = index_of(dev);
    ASSERT_GE(i, 0) << dev;
    const NicInfo& n = d[static_cast<size_t>(i)];
    EXPECT_EQ(n.provider, "verbs");
    EXPECT_EQ(n.pci_bus_id, "") << "rxe is not a PCI device";
    EXPECT_GT(n.speed_mbps, 0u);
    EXPECT_GE(n.max_msg_size, 1u << 20);
    EXPECT_GT(n.max_inline, 0u);
    EXPECT_TRUE(n.virt_addr);
    EXPECT_FALSE(n.dmabuf);
  }
  auto nic = open(devs_a_[0]);
  ASSERT_TRUE(nic);
  // The rig's rxe devices carry their IPv4 RoCE v2 GID at index 1: the default choice.
  auto* vn = dynamic_cast<verbs::VerbsNic*>(nic.get());
  ASSERT_NE(vn, nullptr);
  EXPECT_EQ(vn->gid_index(), 1);
  EXPECT_GT(vn->limits().sq_depth, 0u);
  EXPECT_GT(vn->limits().cq_depth, vn->limits().srq_depth);
}

TEST_F(RxeTest, HcaFilterSelectsDevices) {
  Config cfg;
  cfg.ib_hca = "=" + devs_b_[0] + ":1";
  auto b = open_verbs_backend(cfg);
  ASSERT_TRUE(b.ok()) << b.status().message();
  ASSERT_EQ(b.value()->devices().size(), 1u);
  EXPECT_EQ(b.value()->devices()[0].name, devs_b_[0] + ":1");
  cfg.ib_hca = "^rxe";
  auto none = open_verbs_backend(cfg);
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), Code::kUnavailable);
  EXPECT_NE(strstr(none.status().message(), "PONTE_IB_HCA"), nullptr) << none.status().message();
  cfg.ib_hca = "";
  cfg.ib_gid_index = 5000;
  auto bad_gid = open_verbs_backend(cfg);
  ASSERT_FALSE(bad_gid.ok());
  EXPECT_EQ(bad_gid.status().code(), Code::kInvalidArgument) << bad_gid.status().message();
}

TEST_F(RxeTest, PostBeforeConnectIsAgain) {
  auto a = open(devs_a_[0]);
  auto b = open(devs_b_[0]);
  ASSERT_TRUE(a && b);
  auto pa = a->add_peer(b->address());
  ASSERT_TRUE(pa.ok());
  auto buf = make_buffer(a.get(), 4096, 1);
  ASSERT_TRUE(buf);
  WriteWr w;
  w.peer = *pa;
  w.local = buf->data();
  w.len = 4096;
  w.desc = buf->mr.desc;
  w.remote_addr = 0x1000;
  w.rkey = 1;
  EXPECT_EQ(a->post_write(w).code(), Code::kAgain);  // no QP yet
  auto blob = a->connect_blob(*pa);
  ASSERT_TRUE(blob.ok());
  EXPECT_EQ(a->post_write(w).code(), Code::kAgain);  // QP waiting for the peer's blob
  // connect_blob is idempotent while waiting: the engine may send its hello twice.
  auto again = a->connect_blob(*pa);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, *blob);
}

class RxeWrite : public RxeTest, public ::testing::WithParamInterface<std::tuple<size_t, bool>> {};

TEST_P(RxeWrite, VerifiedByteForByte) {
  ASSERT_TRUE(open_rail(0));
  auto [size, with_imm] = GetParam();
  Nic* a = a_[0].get();
  Nic* b = b_[0].get();
  size_t alloc = std::max<size_t>(size, 1);
  auto src = make_buffer(a, alloc, 0);
  auto dst = make_buffer(b, alloc + 64, 0xee);
  auto rbuf = make_buffer(b, 16 * 64, 0);
  ASSERT_TRUE(src && dst && rbuf);
  post_receives(b, rbuf.get(), 64, 16, 1000);
  fill_pattern(src->data(), size, static_cast<uint32_t>(size) + with_imm);

  // One write per max_msg_size chunk (rxe: 8 MiB), as the engine splits them.
  const size_t chunk = a->info().max_msg_size;
  size_t chunks = size == 0 ? 1 : (size + chunk - 1) / chunk;
  Poller poller({a, b});
  for (size_t i = 0; i < chunks; ++i) {
    size_t off = i * chunk;
    WriteWr w;
    w.peer = peer_a_[0];
    w.local = src->data() + off;
    w.len = std::min(chunk, size - off);
    w.desc = src->mr.desc;
    w.remote_addr = dst->remote(off);
    w.rkey = dst->mr.rkey;
    w.has_imm = with_imm;
    w.imm = 0xabc00000u + static_cast<uint32_t>(i);
    w.ctx = 77 + i;
    post_retrying(poller, [&] { return a->post_write(w); });
  }
  size_t want_remote = with_imm ? chunks : 0;
  ASSERT_TRUE(poller.until([&] {
    return poller.got[0].size() >= chunks && poller.count(1, CompletionKind::kRemoteWrite) >= want_remote;
  })) << "completions missing: local " << poller.got[0].size() << "/" << chunks;
  for (size_t i = 0; i < poller.got[0].size(); ++i) {
    const Completion& c = poller.got[0][i];
    EXPECT_EQ(c.kind, CompletionKind::kLocal);
    EXPECT_EQ(c.error, Code::kOk);
    EXPECT_EQ(c.ctx, 77 + i);
  }
  if (with_imm) {
    std::vector<bool> seen(chunks, false);
    for (const Completion& c : poller.got[1]) {
      ASSERT_EQ(c.kind, CompletionKind::kRemoteWrite) << "a send-side receive completed";
      EXPECT_EQ(c.error, Code::kOk);
      uint32_t i = c.imm - 0xabc00000u;
      ASSERT_LT(i, chunks) << "imm 0x" << std::hex << c.imm;
      EXPECT_FALSE(seen[i]);
      seen[i] = true;
    }
    // The backend put the consumed receives back itself.
    auto* vb = dynamic_cast<verbs::VerbsNic*>(b);
    ASSERT_NE(vb, nullptr);
    EXPECT_EQ(vb->receives_posted(), 16);
  } else {
    EXPECT_TRUE(poller.got[1].empty());
  }
  ASSERT_EQ(memcmp(dst->data(), src->data(), size), 0);
  for (size_t i = size; i < size + 64; ++i) ASSERT_EQ(dst->bytes[i], 0xee) << "wrote past the end at " << i;
}

INSTANTIATE_TEST_SUITE_P(Sizes, RxeWrite,
                         ::testing::Combine(::testing::Values(size_t{0}, size_t{1}, size_t{4096},
                                                              size_t{1} << 20, size_t{16} << 20),
                                            ::testing::Bool()),
                         [](const auto& info) {
                           return std::to_string(std::get<0>(info.param)) +
                                  (std::get<1>(info.param) ? "B_imm" : "B");
                         });

TEST_F(RxeTest, ImmAloneNeedsNoMemory) {
  ASSERT_TRUE(open_rail(0));
  Nic* a = a_[0].get();
  Nic* b = b_[0].get();
  auto rbuf = make_buffer(b, 4 * 64, 0);
  ASSERT_TRUE(rbuf);
  post_receives(b, rbuf.get(), 64, 4, 0);
  Poller poller({a, b});
  for (uint32_t v : {0u, 1u, 0xdeadbeefu, 0xffffffffu}) {
    WriteWr w;
    w.peer = peer_a_[0];
    w.has_imm = true;
    w.imm = v;
    w.ctx = v;
    post_retrying(poller, [&] { return a->post_write(w); });  // no local buffer, no remote one
  }
  ASSERT_TRUE(poller.until([&] {
    return poller.got[0].size() >= 4 && poller.count(1, CompletionKind::kRemoteWrite) >= 4;
  }));
  std::vector<uint32_t> imms;
  for (const Completion& c : poller.got[1]) imms.push_back(c.imm);
  EXPECT_EQ(imms, (std::vector<uint32_t>{0u, 1u, 0xdeadbeefu, 0xffffffffu}));  // host order
  for (const Completion& c : poller.got[0]) EXPECT_EQ(c.error, Code::kOk);
}

TEST_F(RxeTest, SendRecvCarriesImmAndLength) {
  ASSERT_TRUE(open_rail(0));
  Nic* a = a_[0].get();
  Nic* b = b_[0].get();
  const size_t slot = 8192;
  auto rbuf = make_buffer(b, 8 * slot, 0);
  auto sbuf = make_buffer(a, slot, 0);
  ASSERT_TRUE(rbuf && sbuf);
  post_receives(b, rbuf.get(), slot, 8, 500);
  const std::vector<size_t> sizes = {0, 1, 16, a->info().max_inline, 4096, slot};
  Poller poller({a, b});
  uint8_t small[64];
  for (size_t i = 0; i < sizes.size(); ++i) {
    fill_pattern(sbuf->data(), sizes[i], static_cast<uint32_t>(i));
    // A small send from host memory goes inline, from unregistered memory too; larger ones, and
    // any the caller does not allow inline (GPU memory), need the registration.
    const void* from = sbuf->data();
    void* desc = sbuf->mr.desc;
    if (sizes[i] > 0 && sizes[i] <= sizeof(small) && sizes[i] <= a->info().max_inline) {
      memcpy(small, sbuf->data(), sizes[i]);
      from = small;
      desc = nullptr;
      EXPECT_EQ(a->post_send(peer_a_[0], from, sizes[i], desc, 0, 1, false).code(), Code::kInvalidArgument)
          << "not inline: the registration is needed";
    }
    post_retrying(poller, [&] { return a->post_send(peer_a_[0], from, sizes[i], desc, 0x5000 + i, 40 + i, true); });
    ASSERT_TRUE(poller.until([&] { return poller.count(1, CompletionKind::kRecv) > i; }));
    const Completion& c = poller.got[1].back();
    EXPECT_EQ(c.kind, CompletionKind::kRecv);
    EXPECT_EQ(c.error, Code::kOk);
    EXPECT_EQ(c.imm, 0x5000 + i);
    EXPECT_EQ(c.len, sizes[i]);
    ASSERT_GE(c.ctx, 500u);
    ASSERT_LT(c.ctx, 508u);
    EXPECT_EQ(memcmp(rbuf->data() + (c.ctx - 500) * slot, sbuf->data(), sizes[i]), 0) << sizes[i] << " B";
  }
  ASSERT_TRUE(poller.until([&] { return poller.got[0].size() >= sizes.size(); }));
  for (const Completion& c : poller.got[0]) EXPECT_EQ(c.error, Code::kOk);
  auto* vb = dynamic_cast<verbs::VerbsNic*>(b);
  EXPECT_EQ(vb->receives_posted(), 8 - static_cast<int>(sizes.size()));  // handed to the engine
}

TEST_F(RxeTest, ReadVerified) {
  ASSERT_TRUE(open_rail(0));
  Nic* a = a_[0].get();
  Nic* b = b_[0].get();
  const size_t size = 3 << 20;
  auto remote = make_buffer(b, size, 0);
  auto local = make_buffer(a, size, 0x11);
  ASSERT_TRUE(remote && local);
  fill_pattern(remote->data(), size, 99);
  Poller poller({a, b});
  const size_t parts = 3;
  for (size_t i = 0; i < parts; ++i) {
    size_t off = i * (size / parts);
    post_retrying(poller, [&] {
      return a->post_read(peer_a_[0], local->data() + off, size / parts, local->mr.desc,
                          remote->remote(off), remote->mr.rkey, 9 + i);
    });
  }
  ASSERT_TRUE(poller.until([&] { return poller.got[0].size() >= parts; }));
  for (const Completion& c : poller.got[0]) EXPECT_EQ(c.error, Code::kOk);
  EXPECT_TRUE(poller.got[1].empty()) << "a read made a completion at the target";
  EXPECT_EQ(memcmp(local->data(), remote->data(), size), 0);
}

TEST_F(RxeTest, ThousandsInFlightWithBackPressure) {
  ASSERT_TRUE(open_rail(0));
  Nic* a = a_[0].get();
  Nic* b = b_[0].get();
  auto* va = dynamic_cast<verbs::VerbsNic*>(a);
  ASSERT_NE(va, nullptr);
  const size_t n = 4000, size = 1024;
  auto src = make_buffer(a, n * size, 0);
  auto dst = make_buffer(b, n * size, 0);
  auto rbuf = make_buffer(b, 64 * 16, 0);
  ASSERT_TRUE(src && dst && rbuf);
  post_receives(b, rbuf.get(), 16, 64, 0);
  fill_pattern(src->data(), n * size, 4242);
  Poller poller({a, b});
  int again = 0;
  uint32_t most_in_flight = 0;
  for (size_t i = 0; i < n; ++i) {
    WriteWr w;
    w.peer = peer_a_[0];
    w.local = src->data() + i * size;
    w.len = size;
    w.desc = src->mr.desc;
    w.remote_addr = dst->remote(i * size);
    w.rkey = dst->mr.rkey;
    w.has_imm = (i % 4) == 0;
    w.imm = static_cast<uint32_t>(i);
    w.ctx = i;
    // Post until the backend pushes back, then drain: never overflows, never fails.
    Status s = a->post_write(w);
    if (!s.ok()) {
      ASSERT_EQ(s.code(), Code::kAgain) << s.message();
      ++again;
      most_in_flight = std::max(most_in_flight, va->sends_in_flight());
      post_retrying(poller, [&] { return a->post_write(w); });
    }
    most_in_flight = std::max(most_in_flight, va->sends_in_flight());
  }
  ASSERT_TRUE(poller.until([&] {
    return poller.got[0].size() >= n && poller.count(1, CompletionKind::kRemoteWrite) >= n / 4;
  }, 60000)) << poller.got[0].size() << " of " << n;
  EXPECT_GT(again, 0) << "the send queue never filled";
  EXPECT_GE(most_in_flight, 1000u);
  EXPECT_LE(most_in_flight, va->limits().sq_depth);
  std::vector<bool> seen(n, false);
  for (const Completion& c : poller.got[0]) {
    ASSERT_EQ(c.error, Code::kOk);
    ASSERT_LT(c.ctx, n);
    EXPECT_FALSE(seen[c.ctx]);
    seen[c.ctx] = true;
  }
  EXPECT_EQ(va->sends_in_flight(), 0u);
  EXPECT_EQ(memcmp(src->data(), dst->data(), n * size), 0);
}

TEST_F(RxeTest, BadBytesAndBadCallsAreInvalidArgument) {
  auto a = open(devs_a_[0]);
  auto b = open(devs_b_[0]);
  ASSERT_TRUE(a && b);
  auto addr = b->address();
  std::vector<uint8_t> good(addr.begin(), addr.end());
  std::vector<std::vector<uint8_t>> bad = {
      {}, {0x56}, std::vector<uint8_t>(good.begin(), good.end() - 1), std::vector<uint8_t>(64, 0xab)};
  auto foreign = good;
  foreign[0] = 'F';
  bad.push_back(foreign);
  auto newer = good;
  newer[1] = 9;
  bad.push_back(newer);
  for (const auto& bytes : bad) {
    auto p = a->add_peer(bytes);
    ASSERT_FALSE(p.ok());
    EXPECT_EQ(p.status().code(), Code::kInvalidArgument) << p.status().message();
  }
  auto pa = a->add_peer(good);
  ASSERT_TRUE(pa.ok());
  // complete_connect before connect_blob, with garbage, with an address instead of a blob.
  auto pb = b->add_peer(a->address());
  ASSERT_TRUE(pb.ok());
  auto blob_b = b->connect_blob(*pb);
  ASSERT_TRUE(blob_b.ok());
  EXPECT_EQ(a->complete_connect(*pa, *blob_b).code(), Code::kInvalidArgument);
  auto blob_a = a->connect_blob(*pa);
  ASSERT_TRUE(blob_a.ok());
  EXPECT_EQ(a->complete_connect(*pa, good).code(), Code::kInvalidArgument);
  std::vector<uint8_t> cut(blob_b->begin(), blob_b->end() - 4);
  EXPECT_EQ(a->complete_connect(*pa, cut).code(), Code::kInvalidArgument);
  // Unknown peers.
  EXPECT_EQ(a->connect_blob(99).status().code(), Code::kInvalidArgument);
  EXPECT_EQ(a->complete_connect(99, *blob_b).code(), Code::kInvalidArgument);
  // Now connect for real and try bad posts.
  ASSERT_TRUE(a->complete_connect(*pa, *blob_b).ok());
  ASSERT_TRUE(b->complete_connect(*pb, *blob_a).ok());
  EXPECT_TRUE(a->complete_connect(*pa, *blob_b).ok()) << "the same blob twice is harmless";
  auto buf = make_buffer(a.get(), 1 << 20, 0);
  ASSERT_TRUE(buf);
  WriteWr w;
  w.peer = 42;
  w.local = buf->data();
  w.len = 4096;
  w.desc = buf->mr.desc;
  EXPECT_EQ(a->post_write(w).code(), Code::kInvalidArgument);  // unknown peer
  w.peer = *pa;
  w.desc = nullptr;
  EXPECT_EQ(a->post_write(w).code(), Code::kInvalidArgument);  // 4 KiB, not inline, no desc
  w.desc = buf->mr.desc;
  w.len = a->info().max_msg_size + 1;
  EXPECT_EQ(a->post_write(w).code(), Code::kInvalidArgument);  // too large for one write
  w.len = 16;
  w.rkey = uint64_t{1} << 40;
  EXPECT_EQ(a->post_write(w).code(), Code::kInvalidArgument);  // not a 32-bit rkey
  EXPECT_EQ(a->post_recv(buf->data(), 64, nullptr, 1).code(), Code::kInvalidArgument);
  MemoryDesc empty;
  EXPECT_EQ(a->register_memory(empty).status().code(), Code::kInvalidArgument);
  // remove_peer: later posts name the peer as unknown.
  a->remove_peer(*pa);
  w.rkey = 1;
  EXPECT_EQ(a->post_write(w).code(), Code::kInvalidArgument);
  EXPECT_EQ(a->connect_blob(*pa).status().code(), Code::kInvalidArgument);
}

TEST_F(RxeTest, QpErrorFlushesAndIsRebuilt) {
  ASSERT_TRUE(open_rail(0));
  Nic* a = a_[0].get();
  Nic* b = b_[0].get();
  auto src = make_buffer(a, 64 << 10, 0);
  auto dst = make_buffer(b, 64 << 10, 0);
  auto rbuf = make_buffer(b, 16 * 16, 0);
  ASSERT_TRUE(src && dst && rbuf);
  post_receives(b, rbuf.get(), 16, 16, 0);
  fill_pattern(src->data(), 64 << 10, 5);
  Poller poller({a, b});
  const int n = 12;
  for (int i = 0; i < n; ++i) {
    WriteWr w;
    w.peer = peer_a_[0];
    w.local = src->data() + i * 4096;
    w.len = 4096;
    w.desc = src->mr.desc;
    w.remote_addr = dst->remote(i * 4096);
    w.rkey = i == 0 ? dst->mr.rkey ^ 0x5a5a00 : dst->mr.rkey;  // the first one's rkey is wrong
    w.ctx = 100 + i;
    post_retrying(poller, [&] { return a->post_write(w); });
  }
  ASSERT_TRUE(poller.until([&] { return poller.got[0].size() >= n; }))
      << poller.got[0].size() << " of " << n << " completions";
  std::vector<bool> seen(n, false);
  for (const Completion& c : poller.got[0]) {
    EXPECT_EQ(c.error, Code::kTransport) << "ctx " << c.ctx;
    ASSERT_GE(c.ctx, 100u);
    ASSERT_LT(c.ctx, 100u + n);
    EXPECT_FALSE(seen[c.ctx - 100]);
    seen[c.ctx - 100] = true;
  }
  // The failed QP refuses posts with a reason until it is rebuilt.
  WriteWr w;
  w.peer = peer_a_[0];
  w.local = src->data();
  w.len = 4096;
  w.desc = src->mr.desc;
  w.remote_addr = dst->remote(0);
  w.rkey = dst->mr.rkey;
  w.has_imm = true;
  w.imm = 7;
  w.ctx = 1;
  Status s = a->post_write(w);
  EXPECT_EQ(s.code(), Code::kTransport);
  EXPECT_NE(strstr(s.message(), "connect_blob"), nullptr) << s.message();

  // Re-handshake: both sides get new QPs (B's went to ERR silently when it NAKed the bad rkey).
  auto* va = dynamic_cast<verbs::VerbsNic*>(a);
  EXPECT_EQ(va->sends_in_flight(), 0u);
  ASSERT_TRUE(handshake(0));
  poller.got[0].clear();
  poller.got[1].clear();
  post_retrying(poller, [&] { return a->post_write(w); });
  ASSERT_TRUE(poller.until([&] {
    return poller.got[0].size() >= 1 && poller.count(1, CompletionKind::kRemoteWrite) >= 1;
  }));
  EXPECT_EQ(poller.got[0][0].error, Code::kOk);
  EXPECT_EQ(poller.got[0][0].ctx, 1u);
  EXPECT_EQ(poller.got[1][0].imm, 7u);
  EXPECT_EQ(memcmp(dst->data(), src->data(), 4096), 0);
}

// The work requests of one pass go to a QP as one chain: one ibv_post_send, and only the last of
// the chain (and every kSignalEvery-th) signaled; one completion reports the requests before it.
// More than kMaxStagedSends staged are flushed on the way.
TEST_F(RxeTest, OnePassIsOneDoorbellAndItsLastCompletionReportsTheRest) {
  ASSERT_TRUE(open_rail(0));
  Nic* a = a_[0].get();
  auto* va = dynamic_cast<verbs::VerbsNic*>(a);
  ASSERT_NE(va, nullptr);
  const size_t chunk = 4096;
  static_assert(verbs::VerbsNic::kMaxStagedSends == 32 && verbs::VerbsNic::kSignalEvery == 16,
                "the counts below are for a stage of 32, every 16th signaled");
  const int runs[2] = {8, 40};
  auto src = make_buffer(a, chunk * static_cast<size_t>(runs[1]), 0);
  auto dst = make_buffer(b_[0].get(), chunk * static_cast<size_t>(runs[1]), 0);
  ASSERT_TRUE(src && dst);
  Poller poller({a});
  for (int run = 0; run < 2; ++run) {
    const int n = runs[run];
    fill_pattern(src->data(), chunk * static_cast<size_t>(n), 40 + static_cast<uint32_t>(run));
    poller.got[0].clear();
    const uint64_t bells0 = va->send_doorbells(), cqes0 = va->send_completions();
    for (int i = 0; i < n; ++i) {
      WriteWr w = write_wr(0, *src, i * chunk, chunk, *dst, i * chunk, static_cast<uint64_t>(1000 * run + i));
      w.inline_ok = false;
      ASSERT_TRUE(a->post_write(w).ok()) << "write " << i;
    }
    // Staged, not posted: nothing rang yet beyond the flushes a full stage forced.
    EXPECT_EQ(va->send_doorbells() - bells0, static_cast<uint64_t>(n / verbs::VerbsNic::kMaxStagedSends));
    ASSERT_TRUE(poller.until([&] { return poller.got[0].size() >= static_cast<size_t>(n); }))
        << poller.got[0].size() << " of " << n << " completions";
    std::vector<bool> seen(static_cast<size_t>(n), false);
    for (const Completion& c : poller.got[0]) {
      EXPECT_EQ(c.error, Code::kOk);
      const uint64_t i = c.ctx - 1000u * static_cast<uint64_t>(run);
      ASSERT_LT(i, static_cast<uint64_t>(n));
      EXPECT_FALSE(seen[i]) << "reported twice";
      seen[i] = true;
    }
    // 8 writes: one chain, its last signaled. 40: a chain of 32 (the 16th and the 32nd signaled)
    // flushed when the stage filled, then one of 8.
    const uint64_t want_bells = run == 0 ? 1 : 2, want_cqes = run == 0 ? 1 : 3;
    EXPECT_EQ(va->send_doorbells() - bells0, want_bells) << n << " writes";
    EXPECT_EQ(va->send_completions() - cqes0, want_cqes) << n << " writes";
    EXPECT_EQ(va->sends_in_flight(), 0u);
    EXPECT_EQ(memcmp(dst->data(), src->data(), chunk * static_cast<size_t>(n)), 0);
  }
}

// A failure in the middle of a chain: the requests ahead of it are reported done (the failed one's
// completion reports them: RC executes in order), it and the rest failed; none is lost or doubled.
TEST_F(RxeTest, AFailureInsideAChainReportsTheRequestsAheadAsDone) {
  ASSERT_TRUE(open_rail(0));
  Nic* a = a_[0].get();
  const int n = 12, bad = 5;
  const size_t chunk = 4096;
  auto src = make_buffer(a, chunk * n, 0);
  auto dst = make_buffer(b_[0].get(), chunk * n, 0);
  ASSERT_TRUE(src && dst);
  fill_pattern(src->data(), chunk * n, 77);
  for (int i = 0; i < n; ++i) {
    WriteWr w = write_wr(0, *src, i * chunk, chunk, *dst, i * chunk, static_cast<uint64_t>(i));
    w.inline_ok = false;
    if (i == bad) w.rkey ^= 0x5a5a00;
    ASSERT_TRUE(a->post_write(w).ok()) << "write " << i;
  }
  Poller poller({a});
  ASSERT_TRUE(poller.until([&] { return poller.got[0].size() >= static_cast<size_t>(n); }))
      << poller.got[0].size() << " of " << n << " completions";
  std::vector<bool> seen(n, false);
  for (const Completion& c : poller.got[0]) {
    ASSERT_LT(c.ctx, static_cast<uint64_t>(n));
    EXPECT_FALSE(seen[c.ctx]) << "reported twice";
    seen[c.ctx] = true;
    EXPECT_EQ(c.error, c.ctx < static_cast<uint64_t>(bad) ? Code::kOk : Code::kTransport) << "write " << c.ctx;
  }
  EXPECT_EQ(memcmp(dst->data(), src->data(), chunk * bad), 0) << "the writes ahead of the failure landed";
  EXPECT_EQ(dynamic_cast<verbs::VerbsNic*>(a)->sends_in_flight(), 0u);
}

TEST_F(RxeTest, RemovePeerReportsEveryOutstandingOp) {
  ASSERT_TRUE(open_rail(0));
  Nic* a = a_[0].get();
  Nic* b = b_[0].get();
  const size_t n = 200, size = 64 << 10;
  auto src = make_buffer(a, size, 1);
  auto dst = make_buffer(b, size, 0);
  ASSERT_TRUE(src && dst);
  Poller poller({a, b});
  for (size_t i = 0; i < n; ++i) {
    WriteWr w;
    w.peer = peer_a_[0];
    w.local = src->data();
    w.len = size;
    w.desc = src->mr.desc;
    w.remote_addr = dst->remote(0);
    w.rkey = dst->mr.rkey;
    w.ctx = i;
    post_retrying(poller, [&] { return a->post_write(w); });
  }
  a->remove_peer(peer_a_[0]);  // with writes still in flight
  ASSERT_TRUE(poller.until([&] { return poller.got[0].size() >= n; }))
      << poller.got[0].size() << " of " << n;
  std::vector<bool> seen(n, false);
  for (const Completion& c : poller.got[0]) {
    ASSERT_LT(c.ctx, n);
    EXPECT_FALSE(seen[c.ctx]) << "reported twice";
    seen[c.ctx] = true;
    EXPECT_TRUE(c.error == Code::kOk || c.error == Code::kTransport);
  }
  EXPECT_EQ(dynamic_cast<verbs::VerbsNic*>(a)->sends_in_flight(), 0u);
}

TEST_F(RxeTest, TwoNicsStripeOneWrite) {
  ASSERT_TRUE(open_rail(0));
  ASSERT_TRUE(open_rail(1));
  const size_t size = 2 << 20, half = size / 2;
  auto src0 = make_buffer(a_[0].get(), size, 0);
  ASSERT_TRUE(src0);
  fill_pattern(src0->data(), size, 2024);
  // The same source memory registered on the second NIC too (as the engine registers everywhere).
  MemoryDesc d;
  d.addr = src0->data();
  d.len = size;
  auto src1 = a_[1]->register_memory(d);
  ASSERT_TRUE(src1.ok()) << src1.status().message();
  auto dst = make_buffer(b_[0].get(), size, 0);
  ASSERT_TRUE(dst);
  d.addr = dst->data();
  auto dst1 = b_[1]->register_memory(d);
  ASSERT_TRUE(dst1.ok()) << dst1.status().message();
  std::vector<std::unique_ptr<Buffer>> rbufs;
  for (int r = 0; r < 2; ++r) {
    rbufs.push_back(make_buffer(b_[r].get(), 4 * 16, 0));
    post_receives(b_[r].get(), rbufs.back().get(), 16, 4, 0);
  }
  Poller poller({a_[0].get(), a_[1].get(), b_[0].get(), b_[1].get()});
  for (int r = 0; r < 2; ++r) {
    WriteWr w;
    w.peer = peer_a_[r];
    w.local = src0->data() + r * half;
    w.len = half;
    w.desc = r == 0 ? src0->mr.desc : src1->desc;
    w.remote_addr = (r == 0 ? dst->mr.remote_base : dst1->remote_base) + r * half;
    w.rkey = r == 0 ? dst->mr.rkey : dst1->rkey;
    w.has_imm = true;
    w.imm = 0x777;
    w.ctx = static_cast<uint64_t>(r);
    post_retrying(poller, [&] { return a_[r]->post_write(w); });
  }
  ASSERT_TRUE(poller.until([&] {
    return poller.got[0].size() == 1 && poller.got[1].size() == 1 &&
           poller.count(2, CompletionKind::kRemoteWrite) == 1 && poller.count(3, CompletionKind::kRemoteWrite) == 1;
  }));
  for (int i = 0; i < 4; ++i) EXPECT_EQ(poller.got[i][0].error, Code::kOk);
  EXPECT_EQ(poller.got[2][0].imm, 0x777u);
  EXPECT_EQ(poller.got[3][0].imm, 0x777u);
  EXPECT_EQ(memcmp(dst->data(), src0->data(), size), 0);
  a_[1]->deregister(src1.value());
  b_[1]->deregister(dst1.value());
}

// ---------------------------------------------------------------------------- issue 10, item 4
// A small write or send goes inline only from host memory: inline makes the provider memcpy the
// payload on the CPU, which faults on GPU memory. Stand-in for GPU memory: host pages registered
// as MemKind::kCuda (no CUDA here: the peer-memory path registers them as they are), then made
// inaccessible to the CPU. rxe reads registered pages through the kernel, so a DMA-style read works
// while any CPU copy faults.
TEST_F(RxeTest, NoInlineFromMemoryTheCpuCannotRead) {
  ASSERT_TRUE(open_rail(0));
  Nic* a = a_[0].get();
  Nic* b = b_[0].get();
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t len = 2 * page;
  void* mem = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(mem, MAP_FAILED);
  auto* src = static_cast<uint8_t*>(mem);
  fill_pattern(src, len, 404);
  std::vector<uint8_t> expected(src, src + len);
  MemoryDesc d;
  d.addr = src;
  d.len = len;
  d.kind = MemKind::kCuda;
  d.cuda_device = 0;
  auto mr = a->register_memory(d);
  ASSERT_TRUE(mr.ok()) << mr.status().message();
  ASSERT_EQ(mprotect(mem, len, PROT_NONE), 0);
  auto dst = make_buffer(b, len, 0);
  auto rbuf = make_buffer(b, 4 * 512, 0);
  ASSERT_TRUE(dst && rbuf);
  post_receives(b, rbuf.get(), 512, 4, 900);
  const size_t max_inline = a->info().max_inline;
  ASSERT_GT(max_inline, 0u);
  const std::vector<size_t> sizes = {1, 8, 64, max_inline};
  Poller poller({a, b});
  size_t off = 0;
  for (size_t i = 0; i < sizes.size(); ++i, off += 512) {
    WriteWr w;
    w.peer = peer_a_[0];
    w.local = src + off;
    w.len = sizes[i];
    w.desc = mr->desc;
    w.remote_addr = dst->remote(off);
    w.rkey = dst->mr.rkey;
    w.inline_ok = false;  // what the engine passes for MemKind::kCuda
    w.ctx = i;
    post_retrying(poller, [&] { return a->post_write(w); });
  }
  post_retrying(poller, [&] { return a->post_send(peer_a_[0], src + page, 48, mr->desc, 0x66, 99, false); });
  ASSERT_TRUE(poller.until([&] {
    return poller.got[0].size() >= sizes.size() + 1 && poller.count(1, CompletionKind::kRecv) >= 1;
  }));
  for (const Completion& c : poller.got[0]) EXPECT_EQ(c.error, Code::kOk) << "ctx " << c.ctx;
  off = 0;
  for (size_t i = 0; i < sizes.size(); ++i, off += 512) {
    EXPECT_EQ(memcmp(dst->data() + off, expected.data() + off, sizes[i]), 0) << sizes[i] << " B";
  }
  const Completion& r = poller.got[1].back();
  ASSERT_EQ(r.kind, CompletionKind::kRecv);
  ASSERT_EQ(r.len, 48u);
  ASSERT_GE(r.ctx, 900u);
  EXPECT_EQ(memcmp(rbuf->data() + (r.ctx - 900) * 512, expected.data() + page, 48), 0);
  ASSERT_EQ(mprotect(mem, len, PROT_READ | PROT_WRITE), 0);
  a->deregister(mr.value());
  munmap(mem, len);
}

// ---------------------------------------------------------------------------- issue 10, item 9
// The receives a write-with-immediate consumes go back in one ibv_post_srq_recv per poll pass, not
// one per receive, and the receive queue holds every receive the engine posts (no RNR while a
// burst of up to that many is in flight and the target does not poll at all).
TEST_F(RxeTest, ReceivesGoBackInOneDoorbellPerPass) {
  ASSERT_TRUE(open_rail(0));
  Nic* a = a_[0].get();
  Nic* b = b_[0].get();
  auto* vb = dynamic_cast<verbs::VerbsNic*>(b);
  ASSERT_NE(vb, nullptr);
  const int depth = vb->limits().srq_depth;
  EXPECT_EQ(depth, static_cast<int>(cfg_.recv_buf_count)) << "the SRQ holds exactly the engine's receives";
  EXPECT_GE(depth, 512) << "PONTE_RECV_COUNT's default";
  const int n = 256;
  auto rbuf = make_buffer(b, static_cast<size_t>(depth) * 16, 0);
  auto src = make_buffer(a, 4096, 0);
  auto dst = make_buffer(b, n * 16, 0);
  ASSERT_TRUE(rbuf && src && dst);
  fill_pattern(src->data(), 4096, 9);
  const uint64_t bells0 = vb->receive_doorbells();
  post_receives(b, rbuf.get(), 16, depth, 0);
  Poller poller_b({b});
  poller_b.poll_once();  // posts the last partial batch
  EXPECT_EQ(vb->receives_posted(), depth);
  EXPECT_LE(vb->receive_doorbells() - bells0, static_cast<uint64_t>(depth / verbs::VerbsSrq::kBatch + 1));
  // A burst of write-with-immediates while B does not poll: each takes one of B's receives.
  Poller poller_a({a});
  for (int i = 0; i < n; ++i) {
    WriteWr w = write_wr(0, *src, i * 16, 16, *dst, i * 16, static_cast<uint64_t>(i));
    w.has_imm = true;
    w.imm = 0x9000u + static_cast<uint32_t>(i);
    post_retrying(poller_a, [&] { return a->post_write(w); });
  }
  ASSERT_TRUE(poller_a.until([&] { return poller_a.got[0].size() >= static_cast<size_t>(n); }, 30000))
      << poller_a.got[0].size() << " of " << n << " writes acknowledged while the target did not poll: "
      << "receives missing from its queue (RNR)";
  for (const Completion& c : poller_a.got[0]) ASSERT_EQ(c.error, Code::kOk);
  const uint64_t bells1 = vb->receive_doorbells();
  int polls = 0;
  ASSERT_TRUE(poller_b.until([&] {
    ++polls;
    return poller_b.count(0, CompletionKind::kRemoteWrite) >= static_cast<size_t>(n);
  }));
  // 32 completions at most per pass, their receives reposted together: 8 doorbells, not 256.
  EXPECT_LE(vb->receive_doorbells() - bells1, static_cast<uint64_t>(n / 32 + 2))
      << "over " << polls << " poll passes";
  EXPECT_EQ(vb->receives_posted(), depth);
  EXPECT_EQ(memcmp(dst->data(), src->data(), n * 16), 0);
}

// ---------------------------------------------------------------------------- issue 10, item 11
// NCCL's IB defaults reach the QP, and a traffic class set for one peer is what its QPs send in,
// on both ends: the side that did not ask takes the other's (the class travels in the blob).
TEST_F(RxeTest, TrafficClassAndTimeoutReachTheQps) {
  EXPECT_EQ(cfg_.ib_timeout, 20) << "NCCL_IB_TIMEOUT's default";
  auto a = open(devs_a_[0]);
  auto b = open(devs_b_[0]);
  ASSERT_TRUE(a && b);
  auto* va = dynamic_cast<verbs::VerbsNic*>(a.get());
  auto* vb = dynamic_cast<verbs::VerbsNic*>(b.get());
  // Two connections between the same NICs: one with a class of its own, one without.
  auto pa = a->add_peer(b->address());
  auto pb = b->add_peer(a->address());
  auto pa2 = a->add_peer(b->address());
  auto pb2 = b->add_peer(a->address());
  ASSERT_TRUE(pa.ok() && pb.ok() && pa2.ok() && pb2.ok());
  const uint8_t tc = 0x68;  // DSCP 26
  ASSERT_TRUE(a->set_traffic_class(*pa, tc).ok());
  auto blob_a = a->connect_blob(*pa);
  auto blob_b = b->connect_blob(*pb);
  ASSERT_TRUE(blob_a.ok() && blob_b.ok());
  EXPECT_EQ(a->set_traffic_class(*pa, 1).code(), Code::kInvalidArgument) << "after connect_blob";
  ASSERT_TRUE(a->complete_connect(*pa, *blob_b).ok());
  ASSERT_TRUE(b->complete_connect(*pb, *blob_a).ok());
  auto blob_a2 = a->connect_blob(*pa2);
  auto blob_b2 = b->connect_blob(*pb2);
  ASSERT_TRUE(blob_a2.ok() && blob_b2.ok());
  ASSERT_TRUE(a->complete_connect(*pa2, *blob_b2).ok());
  ASSERT_TRUE(b->complete_connect(*pb2, *blob_a2).ok());
  const int mask = IBV_QP_AV | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_MIN_RNR_TIMER;
  struct Want {
    verbs::VerbsNic* nic;
    NicPeer peer;
    uint8_t tc;
  };
  for (const Want& w : {Want{va, *pa, tc}, Want{vb, *pb, tc}, Want{va, *pa2, 0}, Want{vb, *pb2, 0}}) {
    ibv_qp_attr attr{};
    Status st = w.nic->query_qp(w.peer, 0, mask, &attr);
    ASSERT_TRUE(st.ok()) << st.message();
    EXPECT_EQ(attr.ah_attr.grh.traffic_class, w.tc) << w.nic->info().name << " peer " << w.peer;
    EXPECT_EQ(attr.timeout, 20);
    EXPECT_EQ(attr.retry_cnt, 7);
    EXPECT_EQ(attr.rnr_retry, 7) << "RNR is back-pressure: retried forever";
    EXPECT_EQ(attr.min_rnr_timer, 7) << "0.12 ms";
  }
}

// Several RC QPs per connection (PONTE_IB_QPS_PER_CONNECTION): every QP carries a share of a write
// stream, reads too; sends stay on QP 0; all of it verified byte for byte.
class RxeQps : public RxeTest, public ::testing::WithParamInterface<int> {
 protected:
  void SetUp() override {
    cfg_.ib_qps_per_connection = GetParam();
    RxeTest::SetUp();
  }
};

TEST_P(RxeQps, WriteStreamUsesEveryQp) {
  const uint32_t qps = static_cast<uint32_t>(GetParam());
  ASSERT_TRUE(open_rail(0));
  Nic* a = a_[0].get();
  Nic* b = b_[0].get();
  auto* va = dynamic_cast<verbs::VerbsNic*>(a);
  auto* vb = dynamic_cast<verbs::VerbsNic*>(b);
  ASSERT_EQ(va->connected_qps(peer_a_[0]), qps);
  ASSERT_EQ(vb->connected_qps(peer_b_[0]), qps);
  const size_t n = 64, size = 64 << 10;
  auto src = make_buffer(a, n * size, 0);
  auto dst = make_buffer(b, n * size, 0);
  auto rbuf = make_buffer(b, 64 * 256, 0);
  ASSERT_TRUE(src && dst && rbuf);
  post_receives(b, rbuf.get(), 256, 64, 0);
  fill_pattern(src->data(), n * size, 77 + qps);
  Poller poller({a, b});
  for (size_t i = 0; i < n; ++i) {
    // A few small (inline) ones among them.
    WriteWr w = write_wr(0, *src, i * size, i % 8 == 7 ? 100 : size, *dst, i * size, i);
    w.has_imm = i % 2 == 0;
    w.imm = static_cast<uint32_t>(i);
    post_retrying(poller, [&] { return a->post_write(w); });
  }
  const std::vector<uint32_t> after_writes = va->posts_per_qp(peer_a_[0]);
  for (int i = 0; i < 4; ++i) {
    post_retrying(poller, [&] { return a->post_send(peer_a_[0], src->data(), 200, src->mr.desc, 0x700 + i, 1000 + i, true); });
  }
  auto back = make_buffer(a, size, 0);
  ASSERT_TRUE(back);
  post_retrying(poller, [&] { return a->post_read(peer_a_[0], back->data(), size, back->mr.desc, dst->remote(0), dst->mr.rkey, 2000); });
  ASSERT_TRUE(poller.until([&] {
    return poller.got[0].size() >= n + 5 && poller.count(1, CompletionKind::kRemoteWrite) >= n / 2 &&
           poller.count(1, CompletionKind::kRecv) >= 4;
  }, 60000)) << poller.got[0].size() << " of " << n + 5;
  for (const Completion& c : poller.got[0]) ASSERT_EQ(c.error, Code::kOk) << "ctx " << c.ctx;
  ASSERT_EQ(after_writes.size(), qps);
  for (uint32_t q = 0; q < qps; ++q) {
    EXPECT_EQ(after_writes[q], n / qps) << "QP " << q << " of " << qps << ": round-robin, one write each in turn";
  }
  // The sends went on QP 0, in order; the read on whichever QP was next.
  const std::vector<uint32_t> all = va->posts_per_qp(peer_a_[0]);
  uint32_t more = 0;
  for (uint32_t q = 0; q < qps; ++q) more += all[q] - after_writes[q];
  EXPECT_EQ(more, 5u);
  EXPECT_GE(all[0] - after_writes[0], 4u);
  std::vector<uint32_t> imms;
  for (const Completion& c : poller.got[1])
    if (c.kind == CompletionKind::kRecv) imms.push_back(c.imm);
  EXPECT_EQ(imms, (std::vector<uint32_t>{0x700, 0x701, 0x702, 0x703}));
  for (size_t i = 0; i < n; ++i) {
    size_t len = i % 8 == 7 ? 100 : size;
    ASSERT_EQ(memcmp(dst->data() + i * size, src->data() + i * size, len), 0) << "write " << i;
  }
  EXPECT_EQ(memcmp(back->data(), src->data(), size), 0);
}

// A write with a bad key breaks one QP of the connection (both ends' QP goes to ERR); the whole
// connection is refused until a new handshake, which rebuilds all of its QPs, and then every QP
// carries data again.
TEST_P(RxeQps, BadKeyRebuildsEveryQp) {
  const uint32_t qps = static_cast<uint32_t>(GetParam());
  ASSERT_TRUE(open_rail(0));
  Nic* a = a_[0].get();
  Nic* b = b_[0].get();
  auto* va = dynamic_cast<verbs::VerbsNic*>(a);
  auto src = make_buffer(a, 64 << 10, 0);
  auto dst = make_buffer(b, 64 << 10, 0);
  auto rbuf = make_buffer(b, 64 * 16, 0);
  ASSERT_TRUE(src && dst && rbuf);
  post_receives(b, rbuf.get(), 16, 64, 0);
  fill_pattern(src->data(), 64 << 10, 55);
  Poller poller({a, b});
  const size_t n = 4 * qps;
  for (size_t i = 0; i < n; ++i) {
    WriteWr w = write_wr(0, *src, i * 1024, 1024, *dst, i * 1024, i);
    if (i == 0) w.rkey ^= 0x5a5a00;  // the first one's key is wrong
    post_retrying(poller, [&] { return a->post_write(w); });
  }
  ASSERT_TRUE(poller.until([&] { return poller.got[0].size() >= n; })) << poller.got[0].size() << " of " << n;
  size_t failed = 0;
  for (const Completion& c : poller.got[0]) failed += c.error != Code::kOk;
  EXPECT_GE(failed, 1u) << "the bad key's write";
  WriteWr w = write_wr(0, *src, 0, 4096, *dst, 0, 500);
  w.has_imm = true;
  EXPECT_EQ(a->post_write(w).code(), Code::kTransport) << "the connection is refused as a whole";
  ASSERT_TRUE(handshake(0));
  ASSERT_EQ(va->connected_qps(peer_a_[0]), qps);
  poller.got[0].clear();
  poller.got[1].clear();
  memset(dst->data(), 0, 64 << 10);
  for (size_t i = 0; i < n; ++i) {
    w.local = src->data() + i * 4096;
    w.remote_addr = dst->remote(i * 4096);
    w.len = 4096;
    w.imm = static_cast<uint32_t>(i);
    w.ctx = 600 + i;
    post_retrying(poller, [&] { return a->post_write(w); });
  }
  ASSERT_TRUE(poller.until([&] {
    return poller.got[0].size() >= n && poller.count(1, CompletionKind::kRemoteWrite) >= n;
  }));
  for (const Completion& c : poller.got[0]) EXPECT_EQ(c.error, Code::kOk);
  for (uint32_t posts : va->posts_per_qp(peer_a_[0])) EXPECT_EQ(posts, n / qps) << "every new QP carried data";
  EXPECT_EQ(memcmp(dst->data(), src->data(), n * 4096), 0);
}

INSTANTIATE_TEST_SUITE_P(QpsPerConnection, RxeQps, ::testing::Values(1, 2, 4),
                         [](const auto& info) { return std::to_string(info.param) + "qps"; });

// Both ends of a connection use the smaller of their QP counts (PONTE_IB_QPS_PER_CONNECTION may
// differ between processes).
TEST_F(RxeTest, UnequalQpCountsUseTheSmaller) {
  cfg_.ib_qps_per_connection = 4;
  backend_ = std::move(open_verbs_backend(cfg_)).value();
  Config b_cfg = cfg_;
  b_cfg.ib_qps_per_connection = 2;
  ASSERT_TRUE(open_rail(0, &b_cfg));
  auto* va = dynamic_cast<verbs::VerbsNic*>(a_[0].get());
  auto* vb = dynamic_cast<verbs::VerbsNic*>(b_[0].get());
  EXPECT_EQ(va->qps_per_connection(), 4u);
  EXPECT_EQ(vb->qps_per_connection(), 2u);
  EXPECT_EQ(va->connected_qps(peer_a_[0]), 2u);
  EXPECT_EQ(vb->connected_qps(peer_b_[0]), 2u);
  auto src = make_buffer(a_[0].get(), 8 * 4096, 0);
  auto dst = make_buffer(b_[0].get(), 8 * 4096, 0);
  ASSERT_TRUE(src && dst);
  fill_pattern(src->data(), 8 * 4096, 3);
  Poller poller({a_[0].get(), b_[0].get()});
  for (size_t i = 0; i < 8; ++i) {
    WriteWr w = write_wr(0, *src, i * 4096, 4096, *dst, i * 4096, i);
    post_retrying(poller, [&] { return a_[0]->post_write(w); });
  }
  ASSERT_TRUE(poller.until([&] { return poller.got[0].size() >= 8; }));
  for (const Completion& c : poller.got[0]) EXPECT_EQ(c.error, Code::kOk);
  EXPECT_EQ(va->posts_per_qp(peer_a_[0]), (std::vector<uint32_t>{4, 4, 0, 0}));
  EXPECT_EQ(memcmp(dst->data(), src->data(), 8 * 4096), 0);
}

}  // namespace
}  // namespace ponte
