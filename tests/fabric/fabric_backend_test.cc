// Tests of the libfabric backend over real providers on loopback: two NICs of one process (the
// same device opened twice) write, read, send and receive to each other, with data verified.
#include <gtest/gtest.h>
#include <poll.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "core/config.h"
#include "core/fabric/fabric_endpoint.h"
#include "core/nic.h"

// LeakSanitizer's switch, present only in -DPONTE_SANITIZE=address builds.
extern "C" void __lsan_disable() __attribute__((weak));
extern "C" void __lsan_enable() __attribute__((weak));

namespace ponte {
namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kDeadline = std::chrono::seconds(20);

bool required_provider(const std::string& p) { return p == "tcp;ofi_rxm" || p == "shm"; }

// A pseudo-random pattern, 8 bytes at a time (fast enough under the sanitizers).
void fill(std::vector<uint8_t>& bytes, size_t offset, size_t len, uint64_t seed) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (size_t i = 0; i < len; i += 8) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    memcpy(&bytes[offset + i], &x, std::min<size_t>(8, len - i));
  }
}

// dst[i] = ~src[i] for len bytes: every byte differs from what a write of src will put there.
void fill_inverse(uint8_t* dst, const uint8_t* src, size_t len) {
  size_t i = 0;
  for (; i + 8 <= len; i += 8) {
    uint64_t w;
    memcpy(&w, src + i, 8);
    w = ~w;
    memcpy(dst + i, &w, 8);
  }
  for (; i < len; ++i) dst[i] = static_cast<uint8_t>(~src[i]);
}

// Registered host memory on one NIC.
struct Region {
  Nic* nic = nullptr;
  std::vector<uint8_t> bytes;
  NicMr mr;
  Region(Nic* n, size_t len) : nic(n), bytes(len, 0) {
    auto r =
        nic->register_memory(MemoryDesc{bytes.data(), bytes.size(), MemKind::kHost, -1, -1, 0});
    EXPECT_TRUE(r.ok()) << r.status().message();
    if (r.ok()) mr = *r;
  }
  ~Region() {
    if (mr.handle != nullptr) nic->deregister(mr);
  }
  uint64_t remote(size_t offset) const { return mr.remote_base + offset; }
  uint8_t* at(size_t offset) { return bytes.data() + offset; }
};

// A write of all of src into dst (from its start) with an immediate.
WriteWr whole_write_with_imm(NicPeer peer, Region& src, const Region& dst, uint32_t imm, uint64_t ctx) {
  WriteWr wr;
  wr.peer = peer;
  wr.local = src.at(0);
  wr.len = src.bytes.size();
  wr.desc = src.mr.desc;
  wr.remote_addr = dst.remote(0);
  wr.rkey = dst.mr.rkey;
  wr.has_imm = true;
  wr.imm = imm;
  wr.ctx = ctx;
  return wr;
}

class FabricPair : public testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    // libfabric 1.17's "net" provider leaks small objects inside fi_endpoint and its connection
    // setup (seen under ASan; tcp;ofi_rxm, shm and udp;ofi_rxd are leak-free with the same ponte
    // code). Leak checking is paused on this thread for net's tests only.
    if (std::string(GetParam()) == "net" && __lsan_disable != nullptr) {
      __lsan_disable();
      lsan_paused_ = true;
    }
    Config cfg;
    cfg.fabric_provider = GetParam();
    auto backend = open_fabric_backend(cfg);
    if (!backend.ok()) {
      if (required_provider(GetParam())) {
        FAIL() << GetParam() << " must work here: " << backend.status().message();
      }
      GTEST_SKIP() << "provider " << GetParam()
                   << " unavailable on this host: " << backend.status().message();
    }
    backend_ = std::move(*backend);
    ASSERT_FALSE(backend_->devices().empty());
    auto a = backend_->open_nic(0);
    ASSERT_TRUE(a.ok()) << a.status().message();
    auto b = backend_->open_nic(0);
    ASSERT_TRUE(b.ok()) << b.status().message();
    a_ = std::move(*a);
    b_ = std::move(*b);
    auto ab = a_->add_peer(b_->address());
    ASSERT_TRUE(ab.ok()) << ab.status().message();
    auto ba = b_->add_peer(a_->address());
    ASSERT_TRUE(ba.ok()) << ba.status().message();
    a_to_b_ = *ab;
    b_to_a_ = *ba;
  }

  void TearDown() override {
    if (lsan_paused_) __lsan_enable();
  }

  // Opens the pair again, on a backend configured with PONTE_IDLE_WAKE (and, with unchecked,
  // Config::idle_wake_unchecked: a wait object even where fi_trywait is not known to reset it).
  void reopen_with_idle_wake(bool unchecked) {
    Config cfg;
    cfg.fabric_provider = GetParam();
    cfg.idle_wake_on_data = true;
    cfg.idle_wake_unchecked = unchecked;
    a_.reset();
    b_.reset();
    backend_.reset();
    auto backend = open_fabric_backend(cfg);
    ASSERT_TRUE(backend.ok()) << backend.status().message();
    backend_ = std::move(*backend);
    auto a = backend_->open_nic(0);
    auto b = backend_->open_nic(0);
    ASSERT_TRUE(a.ok() && b.ok());
    a_ = std::move(*a);
    b_ = std::move(*b);
    auto ab = a_->add_peer(b_->address());
    ASSERT_TRUE(ab.ok() && b_->add_peer(a_->address()).ok());
    a_to_b_ = *ab;
  }

  // Polls both NICs once, keeping every completion.
  void poll_both() {
    Completion c[64];
    int n = a_->poll(c, 64);
    ASSERT_GE(n, 0);
    a_done_.insert(a_done_.end(), c, c + n);
    if (b_ == nullptr) return;  // closed by the test
    n = b_->poll(c, 64);
    ASSERT_GE(n, 0);
    b_done_.insert(b_done_.end(), c, c + n);
  }

  // Polls until pred() holds; false at the deadline.
  bool wait(const std::function<bool()>& pred) {
    auto end = Clock::now() + kDeadline;
    while (!pred()) {
      if (Clock::now() > end) return false;
      poll_both();
      if (testing::Test::HasFatalFailure()) return false;
    }
    return true;
  }

  // Takes a completion with this ctx and kind out of list, if there is one.
  static bool take(std::vector<Completion>& list, CompletionKind kind, uint64_t ctx,
                   Completion* out) {
    for (size_t i = 0; i < list.size(); ++i) {
      if (list[i].kind == kind && list[i].ctx == ctx) {
        *out = list[i];
        list.erase(list.begin() + static_cast<ptrdiff_t>(i));
        return true;
      }
    }
    return false;
  }
  static bool take_imm(std::vector<Completion>& list, uint32_t imm, Completion* out) {
    for (size_t i = 0; i < list.size(); ++i) {
      if (list[i].kind == CompletionKind::kRemoteWrite && list[i].imm == imm) {
        *out = list[i];
        list.erase(list.begin() + static_cast<ptrdiff_t>(i));
        return true;
      }
    }
    return false;
  }

  // Posts with retries on kAgain (polling in between), bounded by the deadline.
  Status post_retrying(const std::function<Status()>& post, int* agains = nullptr) {
    auto end = Clock::now() + kDeadline;
    for (;;) {
      Status st = post();
      if (st.code() != Code::kAgain) return st;
      if (agains) ++*agains;
      if (Clock::now() > end) return Status(Code::kTimeout, "still kAgain at the deadline");
      poll_both();
    }
  }

  Completion wait_local(uint64_t ctx) {
    Completion c;
    bool ok = wait([&] { return take(a_done_, CompletionKind::kLocal, ctx, &c); });
    EXPECT_TRUE(ok) << "no local completion for ctx " << ctx;
    return c;
  }

  std::unique_ptr<Backend> backend_;
  std::unique_ptr<Nic> a_, b_;
  NicPeer a_to_b_ = 0, b_to_a_ = 0;
  std::vector<Completion> a_done_, b_done_;
  bool lsan_paused_ = false;
};

TEST_P(FabricPair, DescribesItsDevices) {
  const NicInfo& info = a_->info();
  EXPECT_FALSE(info.name.empty());
  EXPECT_EQ(info.provider, GetParam());
  EXPECT_GE(info.max_msg_size, size_t{16} << 20);
  EXPECT_EQ(info.name, backend_->devices()[0].name);
  EXPECT_EQ(backend_->kind(), BackendKind::kFabric);
  // One device opened twice: two endpoints, two addresses.
  EXPECT_FALSE(a_->address().empty());
  EXPECT_FALSE(std::equal(a_->address().begin(), a_->address().end(), b_->address().begin(),
                          b_->address().end()));
  auto blob = a_->connect_blob(a_to_b_);
  ASSERT_TRUE(blob.ok());
  EXPECT_TRUE(blob->empty());
  EXPECT_TRUE(a_->complete_connect(a_to_b_, {}).ok());
  auto bad = backend_->open_nic(backend_->devices().size());
  EXPECT_EQ(bad.status().code(), Code::kInvalidArgument);
}

TEST_P(FabricPair, WriteWithAndWithoutImmediateIsByteExact) {
  constexpr size_t kSrcOff = 32, kDstOff = 64;
  const size_t sizes[] = {0, 1, 4096, size_t{1} << 20, size_t{16} << 20};
  Region src(a_.get(), (size_t{16} << 20) + 4096);
  Region dst(b_.get(), (size_t{16} << 20) + 4096);
  uint64_t ctx = 100;
  for (bool imm : {false, true}) {
    for (size_t size : sizes) {
      SCOPED_TRACE(testing::Message() << "size " << size << (imm ? " with imm" : " without imm"));
      fill(src.bytes, kSrcOff, size, ctx);
      // Every destination byte differs from what will land, and a guard byte follows.
      fill_inverse(dst.at(kDstOff), src.at(kSrcOff), size + 1);
      const uint8_t guard = dst.bytes[kDstOff + size];
      WriteWr wr;
      wr.peer = a_to_b_;
      wr.local = src.at(kSrcOff);
      wr.len = size;
      wr.desc = src.mr.desc;
      wr.remote_addr = dst.remote(kDstOff);
      wr.rkey = dst.mr.rkey;
      wr.has_imm = imm;
      wr.imm = static_cast<uint32_t>(0xA5000000u + ctx);
      wr.ctx = ++ctx;
      ASSERT_TRUE(post_retrying([&] { return a_->post_write(wr); }).ok());
      Completion local = wait_local(wr.ctx);
      EXPECT_EQ(local.error, Code::kOk);
      if (imm) {
        Completion remote;
        ASSERT_TRUE(wait([&] { return take_imm(b_done_, wr.imm, &remote); }))
            << "the immediate never arrived";
        EXPECT_EQ(remote.error, Code::kOk);
        EXPECT_EQ(memcmp(dst.at(kDstOff), src.at(kSrcOff), size), 0);
      } else if (size > 0) {
        // No notification at the target: poll it until the bytes are there.
        EXPECT_TRUE(wait([&] {
          return dst.bytes[kDstOff + size - 1] == src.bytes[kSrcOff + size - 1] &&
                 memcmp(dst.at(kDstOff), src.at(kSrcOff), size) == 0;
        }));
      }
      EXPECT_EQ(dst.bytes[kDstOff + size], guard) << "wrote past the end";
      EXPECT_EQ(dst.bytes[kDstOff - 1], 0) << "wrote before the start";
    }
  }
  EXPECT_TRUE(b_done_.empty()) << "unexpected completions at the target: " << b_done_.size();
}

TEST_P(FabricPair, ImmediateAloneArrives) {
  // A 0-byte write with immediate and no buffer at all: ponte's imm-only message.
  Region dst(b_.get(), 4096);
  for (uint32_t i = 0; i < 8; ++i) {
    WriteWr wr;
    wr.peer = a_to_b_;
    wr.remote_addr = dst.remote(0);
    wr.rkey = dst.mr.rkey;
    wr.has_imm = true;
    wr.imm = 0xFFFFFFF0u + i;  // high bits survive
    wr.ctx = 7000 + i;
    ASSERT_TRUE(post_retrying([&] { return a_->post_write(wr); }).ok());
    EXPECT_EQ(wait_local(wr.ctx).error, Code::kOk);
    Completion remote;
    ASSERT_TRUE(wait([&] { return take_imm(b_done_, wr.imm, &remote); }));
    EXPECT_EQ(remote.len, 0u);
  }
}

// PONTE_IDLE_WAKE (Config::idle_wake_on_data): a NIC's completion queue has a wait object only when
// asked, and only where fi_trywait resets it (NicInfo::cq_wait_resets: tcp;ofi_rxm here). There,
// once arm_wait() said the CQ may wait, a write from the peer makes the descriptor readable while
// nobody polls the target: what the idle worker sleeps on (NicGroup::sleep_idle).
TEST_P(FabricPair, AWaitObjectOnlyWhereAskedAndDataArrivingWakesIt) {
  EXPECT_EQ(a_->wait_fd(), -1) << "a wait object without PONTE_IDLE_WAKE";
  EXPECT_FALSE(a_->arm_wait());
  ASSERT_NO_FATAL_FAILURE(reopen_with_idle_wake(false));
  // Debian 12's libfabric 1.17: tcp;ofi_rxm's fi_trywait resets the object, net's does not.
  const bool checked_here = std::string(GetParam()) == "tcp;ofi_rxm";
  EXPECT_EQ(b_->info().cq_wait_resets, checked_here);
  ASSERT_EQ(b_->wait_fd() >= 0, checked_here) << "wait object: " << b_->wait_fd();
  if (!checked_here) {
    EXPECT_FALSE(b_->arm_wait());
    return;
  }
  Region src(a_.get(), 1 << 20), dst(b_.get(), 1 << 20);
  fill(src.bytes, 0, src.bytes.size(), 5);
  {  // connected first (tcp;ofi_rxm connects on the first post, with both sides polled)
    WriteWr hello;
    hello.peer = a_to_b_;
    hello.remote_addr = dst.remote(0);
    hello.rkey = dst.mr.rkey;
    hello.has_imm = true;
    hello.imm = 0x50FFu;
    hello.ctx = 8999;
    ASSERT_TRUE(post_retrying([&] { return a_->post_write(hello); }).ok());
    Completion remote;
    ASSERT_TRUE(wait([&] { return take_imm(b_done_, hello.imm, &remote); }));
    EXPECT_EQ(wait_local(hello.ctx).error, Code::kOk);
  }
  for (uint32_t round = 0; round < 3; ++round) {
    SCOPED_TRACE(testing::Message() << "round " << round);
    Completion c[64];
    // Everything before this round polled away, and the object armed (reset).
    const auto arm_deadline = Clock::now() + kDeadline;
    bool armed = false;
    while (!(armed = b_->arm_wait()) && Clock::now() < arm_deadline) poll_both();
    ASSERT_TRUE(armed) << "arm_wait() never said the CQ may wait";
    pollfd pfd{b_->wait_fd(), POLLIN, 0};
    ASSERT_EQ(poll(&pfd, 1, 0), 0) << "readable right after arming, with nothing sent";
    const WriteWr wr = whole_write_with_imm(a_to_b_, src, dst, 0x5100u + round, 9000 + round);
    Status st;
    const auto post_deadline = Clock::now() + kDeadline;
    while ((st = a_->post_write(wr)).code() == Code::kAgain && Clock::now() < post_deadline) {
      ASSERT_GE(a_->poll(c, 64), 0);
    }
    ASSERT_TRUE(st.ok()) << st.message();
    // Only the writer is polled: the target's descriptor must turn readable on its own.
    const auto deadline = Clock::now() + kDeadline;
    int ready = 0;
    while (ready == 0 && Clock::now() < deadline) {
      int n = a_->poll(c, 64);
      ASSERT_GE(n, 0);
      a_done_.insert(a_done_.end(), c, c + n);
      ready = poll(&pfd, 1, 1);
    }
    ASSERT_EQ(ready, 1) << "the target's wait object never turned readable";
    Completion remote;
    ASSERT_TRUE(wait([&] { return take_imm(b_done_, wr.imm, &remote); })) << "the immediate never arrived";
    EXPECT_EQ(memcmp(dst.at(0), src.at(0), src.bytes.size()), 0);
    EXPECT_EQ(wait_local(wr.ctx).error, Code::kOk);
  }
}

// NicInfo::cq_wait_resets against what this host's libfabric does. With a wait object forced on
// (Config::idle_wake_unchecked), after each of three writes with data reaped at the target and a
// successful arming, is the object readable with nothing more sent? net 1.17's fi_trywait returns
// 0 and resets nothing, so the signal of the last completion stays (an idle worker sleeping on it
// woke 3,719 times in 500 ms); tcp;ofi_rxm's resets it. The rule must say which.
TEST_P(FabricPair, AWaitObjectIsUsedOnlyWhereArmingResetsIt) {
  ASSERT_NO_FATAL_FAILURE(reopen_with_idle_wake(/*unchecked=*/true));
  const std::string provider = GetParam();
  if (provider == "net" || provider == "tcp;ofi_rxm") {
    ASSERT_GE(b_->wait_fd(), 0) << provider << " gives an FI_WAIT_FD object";
  }
  if (b_->wait_fd() < 0) {  // none given (shm and udp;ofi_rxd here): nothing to arm, none used
    EXPECT_FALSE(b_->arm_wait());
    EXPECT_FALSE(b_->info().cq_wait_resets);
    return;
  }
  Region src(a_.get(), 4096), dst(b_.get(), 4096);
  fill(src.bytes, 0, src.bytes.size(), 9);
  int readable_after_arming = 0;
  for (uint32_t round = 0; round < 3; ++round) {
    SCOPED_TRACE(testing::Message() << "round " << round);
    const WriteWr wr = whole_write_with_imm(a_to_b_, src, dst, 0x5200u + round, 9100 + round);
    ASSERT_TRUE(post_retrying([&] { return a_->post_write(wr); }).ok());
    Completion remote;
    ASSERT_TRUE(wait([&] { return take_imm(b_done_, wr.imm, &remote); }));
    EXPECT_EQ(wait_local(wr.ctx).error, Code::kOk);
    const auto arm_deadline = Clock::now() + kDeadline;
    bool armed = false;
    while (!(armed = b_->arm_wait()) && Clock::now() < arm_deadline) ASSERT_NO_FATAL_FAILURE(poll_both());
    ASSERT_TRUE(armed) << "arm_wait() never said the CQ may wait";
    pollfd pfd{b_->wait_fd(), POLLIN, 0};
    readable_after_arming += poll(&pfd, 1, 0);
  }
  EXPECT_EQ(b_->info().cq_wait_resets, readable_after_arming == 0)
      << provider << ": readable right after a good arming in " << readable_after_arming << " of 3 rounds";
  if (provider == "net") {
    EXPECT_EQ(readable_after_arming, 3) << "net 1.17's fi_trywait resets nothing";
  }
  if (provider == "tcp;ofi_rxm") {
    EXPECT_EQ(readable_after_arming, 0);
  }
}

TEST_P(FabricPair, SendRecvDeliversDataAndImmediate) {
  Region out(a_.get(), 65536);
  Region in(b_.get(), 2 * 65536);
  ASSERT_TRUE(b_->post_recv(in.at(0), 65536, in.mr.desc, 0x1111).ok());
  ASSERT_TRUE(b_->post_recv(in.at(65536), 65536, in.mr.desc, 0x2222).ok());
  fill(out.bytes, 0, 4096, 42);
  ASSERT_TRUE(post_retrying([&] {
                return a_->post_send(a_to_b_, out.at(0), 4096, out.mr.desc, 0xC0FFEE, 1, true);
              }).ok());
  ASSERT_TRUE(
      post_retrying([&] { return a_->post_send(a_to_b_, nullptr, 0, nullptr, 0xBEEF, 2, true); }).ok());
  EXPECT_EQ(wait_local(1).error, Code::kOk);
  EXPECT_EQ(wait_local(2).error, Code::kOk);
  std::vector<Completion> recvs;
  ASSERT_TRUE(wait([&] {
    Completion c;
    while (take(b_done_, CompletionKind::kRecv, 0x1111, &c) ||
           take(b_done_, CompletionKind::kRecv, 0x2222, &c)) {
      recvs.push_back(c);
    }
    return recvs.size() == 2;
  }));
  // Which receive takes which message is the provider's business: match them by imm.
  for (const Completion& c : recvs) {
    EXPECT_EQ(c.error, Code::kOk);
    const uint8_t* buf = in.at(c.ctx == 0x1111 ? 0 : 65536);
    if (c.imm == 0xC0FFEE) {
      EXPECT_EQ(c.len, 4096u);
      EXPECT_EQ(memcmp(buf, out.at(0), 4096), 0);
    } else {
      EXPECT_EQ(c.imm, 0xBEEFu);
      EXPECT_EQ(c.len, 0u);
    }
  }
  EXPECT_NE(recvs[0].imm, recvs[1].imm);
}

TEST_P(FabricPair, ReadFetchesRemoteBytes) {
  constexpr size_t kLen = size_t{1} << 20;
  Region local(a_.get(), kLen + 4096);
  Region remote(b_.get(), kLen + 4096);
  fill(remote.bytes, 128, kLen, 9);
  ASSERT_TRUE(post_retrying([&] {
                return a_->post_read(a_to_b_, local.at(16), kLen, local.mr.desc, remote.remote(128),
                                     remote.mr.rkey, 55);
              }).ok());
  EXPECT_EQ(wait_local(55).error, Code::kOk);
  EXPECT_EQ(memcmp(local.at(16), remote.at(128), kLen), 0);
  EXPECT_EQ(local.bytes[15], 0);
  EXPECT_EQ(local.bytes[16 + kLen], 0);
}

TEST_P(FabricPair, ThousandsOfWritesInFlightWithBackPressure) {
  constexpr size_t kCount = 4096, kSize = 4096;
  Region src(a_.get(), kCount * kSize);
  Region dst(b_.get(), kCount * kSize);
  fill(src.bytes, 0, src.bytes.size(), 77);
  int agains = 0;
  for (size_t i = 0; i < kCount; ++i) {
    WriteWr wr;
    wr.peer = a_to_b_;
    wr.local = src.at(i * kSize);
    wr.len = kSize;
    wr.desc = src.mr.desc;
    wr.remote_addr = dst.remote(i * kSize);
    wr.rkey = dst.mr.rkey;
    wr.has_imm = true;
    wr.imm = static_cast<uint32_t>(i);
    wr.ctx = 1000000 + i;
    // Posting runs ahead of polling: the provider's queue fills and answers kAgain.
    Status st = post_retrying([&] { return a_->post_write(wr); }, &agains);
    ASSERT_TRUE(st.ok()) << st.message();
  }
  std::vector<bool> local(kCount), remote(kCount);
  size_t locals = 0, remotes = 0;
  ASSERT_TRUE(wait([&] {
    for (const Completion& c : a_done_) {
      EXPECT_EQ(c.error, Code::kOk);
      size_t i = c.ctx - 1000000;
      if (c.kind == CompletionKind::kLocal && i < kCount && !local[i]) local[i] = true, ++locals;
    }
    a_done_.clear();
    for (const Completion& c : b_done_) {
      EXPECT_EQ(c.error, Code::kOk);
      if (c.kind == CompletionKind::kRemoteWrite && c.imm < kCount && !remote[c.imm])
        remote[c.imm] = true, ++remotes;
    }
    b_done_.clear();
    return locals == kCount && remotes == kCount;
  })) << locals
      << " local and " << remotes << " remote completions of " << kCount;
  EXPECT_GT(agains, 0) << "4096 posts without polling never met back-pressure";
  EXPECT_EQ(memcmp(dst.at(0), src.at(0), kCount * kSize), 0);
}

TEST_P(FabricPair, RegistrationKeysAreUnique) {
  constexpr size_t kCount = 1000;
  std::vector<uint8_t> memory(kCount * 64);
  std::vector<NicMr> mrs;
  std::set<uint64_t> keys;
  for (size_t i = 0; i < kCount; ++i) {
    auto mr =
        a_->register_memory(MemoryDesc{memory.data() + i * 64, 64, MemKind::kHost, -1, -1, 0});
    ASSERT_TRUE(mr.ok()) << "registration " << i << ": " << mr.status().message();
    keys.insert(mr->rkey);
    mrs.push_back(*mr);
  }
  // The same bytes registered twice get two keys too.
  auto twice = a_->register_memory(MemoryDesc{memory.data(), 64, MemKind::kHost, -1, -1, 0});
  ASSERT_TRUE(twice.ok());
  keys.insert(twice->rkey);
  mrs.push_back(*twice);
  EXPECT_EQ(keys.size(), kCount + 1);
  EXPECT_EQ(mrs[1].remote_base,
            a_->info().virt_addr ? reinterpret_cast<uint64_t>(memory.data() + 64) : 0u);
  for (const NicMr& mr : mrs) a_->deregister(mr);
}

TEST_P(FabricPair, BadRegistrationsAreRefused) {
  auto empty = a_->register_memory(MemoryDesc{nullptr, 0, MemKind::kHost, -1, -1, 0});
  EXPECT_EQ(empty.status().code(), Code::kInvalidArgument);
  if (!a_->info().device_memory) {
    uint8_t byte = 0;
    auto cuda = a_->register_memory(MemoryDesc{&byte, 1, MemKind::kCuda, 0, -1, 0});
    EXPECT_EQ(cuda.status().code(), Code::kUnavailable);
  }
}

TEST_P(FabricPair, BadPeerAddressesAreInvalidArguments) {
  std::vector<uint8_t> own(a_->address().begin(), a_->address().end());
  EXPECT_EQ(a_->add_peer({}).status().code(), Code::kInvalidArgument);
  const uint8_t three[3] = {1, 2, 3};
  EXPECT_EQ(a_->add_peer(three).status().code(), Code::kInvalidArgument);
  std::vector<uint8_t> longer = own;
  longer.push_back(0);
  EXPECT_EQ(a_->add_peer(longer).status().code(), Code::kInvalidArgument);
  std::vector<uint8_t> foreign = own;
  foreign[0] = 0x01;  // socket family AF_UNIX / another URI scheme
  foreign[1] = 0x00;
  EXPECT_EQ(a_->add_peer(foreign).status().code(), Code::kInvalidArgument);
  std::vector<uint8_t> huge(64 * 1024, 0x7f);
  EXPECT_EQ(a_->add_peer(huge).status().code(), Code::kInvalidArgument);

  WriteWr wr;
  wr.peer = 999;
  wr.has_imm = true;
  EXPECT_EQ(a_->post_write(wr).code(), Code::kInvalidArgument);
  EXPECT_EQ(a_->post_send(999, nullptr, 0, nullptr, 0, 0, true).code(), Code::kInvalidArgument);
  EXPECT_EQ(a_->post_read(999, nullptr, 0, nullptr, 0, 0, 0).code(), Code::kInvalidArgument);
}

TEST_P(FabricPair, RemovedPeerCannotBePostedTo) {
  auto extra = a_->add_peer(b_->address());
  ASSERT_TRUE(extra.ok()) << extra.status().message();
  EXPECT_NE(*extra, a_to_b_);
  a_->remove_peer(*extra);
  a_->remove_peer(*extra);  // twice: harmless
  WriteWr wr;
  wr.peer = *extra;
  wr.has_imm = true;
  EXPECT_EQ(a_->post_write(wr).code(), Code::kInvalidArgument);
  // The other peer entry still works.
  Region dst(b_.get(), 64);
  wr.peer = a_to_b_;
  wr.remote_addr = dst.remote(0);
  wr.rkey = dst.mr.rkey;
  wr.imm = 31337;
  wr.ctx = 9;
  ASSERT_TRUE(post_retrying([&] { return a_->post_write(wr); }).ok());
  EXPECT_EQ(wait_local(9).error, Code::kOk);
}

TEST_P(FabricPair, RemovingADeadPeerEndsItsOperationsAndSparesTheOthers) {
  if (std::string(GetParam()) == "shm") {
    GTEST_SKIP() << "shm: posting to an endpoint closed in the same process crashes inside "
                    "libfabric 1.17 (the peer's shared memory goes away under the mapping); with "
                    "a peer process that exited, posts answer kAgain instead (checked by hand)";
  }
  auto c = backend_->open_nic(0);
  ASSERT_TRUE(c.ok()) << c.status().message();
  std::unique_ptr<Nic> live = std::move(*c);
  auto a_to_c = a_->add_peer(live->address());
  ASSERT_TRUE(a_to_c.ok());
  Region src(a_.get(), 4096);
  Region at_live(live.get(), 4096);
  uint64_t dead_addr = 0, dead_key = 0;
  {
    Region at_dead(b_.get(), 4096);
    dead_addr = at_dead.remote(0);
    dead_key = at_dead.mr.rkey;
  }
  b_.reset();  // the peer's process "dies"

  // Providers do not fail writes toward a dead peer: rxd accepts and never completes them, rxm
  // and net answer kAgain forever. Both must end once the peer is removed.
  WriteWr wr;
  wr.peer = a_to_b_;
  wr.local = src.at(0);
  wr.len = 64;
  wr.desc = src.mr.desc;
  wr.remote_addr = dead_addr;
  wr.rkey = dead_key;
  wr.has_imm = true;
  wr.imm = 1;
  wr.ctx = 4242;
  Status st = a_->post_write(wr);
  EXPECT_TRUE(st.ok() || st.code() == Code::kAgain) << st.message();
  const bool accepted = st.ok();

  // Another peer keeps working meanwhile.
  WriteWr to_live = wr;
  to_live.peer = *a_to_c;
  to_live.remote_addr = at_live.remote(0);
  to_live.rkey = at_live.mr.rkey;
  to_live.imm = 2;
  to_live.ctx = 4343;
  bool live_local = false, live_remote = false;
  auto poll_live = [&] {
    Completion got[8];
    int n = live->poll(got, 8);
    for (int i = 0; i < n; ++i) {
      live_remote = live_remote || (got[i].kind == CompletionKind::kRemoteWrite && got[i].imm == 2);
    }
  };
  auto end = Clock::now() + kDeadline;
  while ((st = a_->post_write(to_live)).code() == Code::kAgain && Clock::now() < end) {
    poll_both();  // the live peer must make progress too (rxm connects through it)
    poll_live();
  }
  ASSERT_TRUE(st.ok()) << st.message();
  ASSERT_TRUE(wait([&] {
    poll_live();
    Completion c;
    live_local = live_local || take(a_done_, CompletionKind::kLocal, 4343, &c);
    return live_local && live_remote;
  }));

  a_->remove_peer(a_to_b_);
  EXPECT_EQ(a_->post_write(wr).code(), Code::kInvalidArgument);
  if (accepted) {
    Completion cancelled;
    ASSERT_TRUE(wait([&] { return take(a_done_, CompletionKind::kLocal, 4242, &cancelled); }));
    EXPECT_EQ(cancelled.error, Code::kCancelled);
  }
  live->deregister(at_live.mr);
  at_live.mr.handle = nullptr;
}

// The engine rebuilds a connection on an error completion unless the provider refused that one
// operation; a lost connection must never count as one operation's error (its neighbours would
// wait on a dead connection), and a refused key must not cost the neighbours a rebuild.
TEST(FabricErrors, OnlyRefusalsOfOneOperationKeepTheConnection) {
  for (int e : std::initializer_list<int>{FI_EACCES, FI_EINVAL, FI_EFAULT, FI_EMSGSIZE, FI_ETRUNC, FI_EKEYREJECTED, FI_ENOKEY})
    EXPECT_TRUE(fabric::refuses_one_operation(e)) << "errno " << e;
  for (int e : std::initializer_list<int>{FI_ENOTCONN, FI_ECONNRESET, FI_ECONNABORTED, FI_ECONNREFUSED, FI_EHOSTUNREACH,
                FI_ENETUNREACH, FI_ENETDOWN, FI_ECANCELED, FI_ETIMEDOUT, FI_EIO, FI_EOTHER, 0})
    EXPECT_FALSE(fabric::refuses_one_operation(e)) << "errno " << e;
}

INSTANTIATE_TEST_SUITE_P(Providers, FabricPair,
                         testing::Values("tcp;ofi_rxm", "shm", "net", "udp;ofi_rxd"),
                         [](const testing::TestParamInfo<const char*>& info) {
                           std::string name = info.param;
                           for (char& ch : name) {
                             if (!isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           }
                           return name;
                         });

}  // namespace
}  // namespace ponte
