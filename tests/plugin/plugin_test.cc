// The NCCL plugin driven through its C ABI as NCCL's proxy thread drives it: dlopen'ed, v11 (and
// once v8) tables, host memory, over the configured provider (tcp;ofi_rxm on loopback here).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <csignal>
#include <map>
#include <sstream>

#include "ponte_version.h"
#include "tests/common/child_exit.h"
#include "tests/plugin/harness.h"

using namespace ponte::plugin_test;
using namespace std::chrono_literals;

namespace {

constexpr size_t kMiB = 1 << 20;

#define ASSERT_OK(expr)                       \
  do {                                        \
    ASSERT_EQ((expr), kSuccess) << #expr;     \
  } while (0)
#define EXPECT_OK(expr)                       \
  do {                                        \
    EXPECT_EQ((expr), kSuccess) << #expr;     \
  } while (0)

// One message of `size` bytes from send to recv (receive buffer of recv_size bytes), verified.
void transfer_on(const Net& n, const Pair& p, size_t size, size_t recv_size, uint32_t seed, int tag = 7) {
  Buffer src(n, p.send, size), dst(n, p.recv, recv_size);
  ASSERT_OK(src.result);
  ASSERT_OK(dst.result);
  fill(src.data(), size, seed);
  void* rreq = nullptr;
  void* sreq = nullptr;
  void* data[1] = {dst.data()};
  size_t sizes[1] = {recv_size};
  int tags[1] = {tag};
  void* mhs[1] = {dst.mh()};
  ASSERT_OK(post_recv(n, p.recv, 1, data, sizes, tags, mhs, &rreq));
  ASSERT_OK(post_send(n, p.send, src.data(), size, tag, src.mh(), &sreq));
  int ssize = -1, rsize[8] = {-1};
  ASSERT_OK(wait_request(n, sreq, &ssize));
  ASSERT_OK(wait_request(n, rreq, rsize));
  EXPECT_EQ(ssize, static_cast<int>(size));
  EXPECT_EQ(rsize[0], static_cast<int>(size)) << "test() must report the size sent";
  EXPECT_EQ(mismatch(dst.data(), size, seed), SIZE_MAX) << size << " bytes";
  if (recv_size > size) {
    EXPECT_EQ(dst.data()[size], 0) << "wrote past the message";
  }
}

class PluginTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_NE(lib().handle, nullptr) << "dlopen(" << plugin_path() << "): " << lib().error;
    ASSERT_NE(lib().v11, nullptr);
    net_ = std::make_unique<Net>();
    ASSERT_OK(net_->init_result);
    ASSERT_GT(net_->devices(), 0) << "no usable NIC through " << getenv("PONTE_BACKEND") << "/"
                                  << getenv("PONTE_FABRIC_PROVIDER");
  }
  void TearDown() override { net_.reset(); }
  const Net& net() const { return *net_; }

  void transfer(const Pair& p, size_t size, size_t recv_size, uint32_t seed, int tag = 7) {
    transfer_on(net(), p, size, recv_size, seed, tag);
  }

  std::unique_ptr<Net> net_;
};

// ---- the library itself -----------------------------------------------------------------------

TEST(PluginLibrary, ExportsEveryVersionAndNothingElse) {
  Library& l = lib();
  ASSERT_NE(l.handle, nullptr) << l.error;
  ASSERT_NE(l.v11, nullptr);
  ASSERT_NE(l.v10, nullptr);
  ASSERT_NE(l.v9, nullptr);
  ASSERT_NE(l.v8, nullptr);
  EXPECT_STREQ(l.v11->name, "ponte");
  EXPECT_STREQ(l.v8->name, "ponte");
  EXPECT_NE(l.v11->finalize, nullptr);
  EXPECT_NE(l.v11->make_vdevice, nullptr);
  EXPECT_NE(l.v11->set_net_attr, nullptr);
  // ponte_core is linked in statically with hidden visibility: none of it leaks out.
  EXPECT_EQ(dlsym(l.handle, "_ZN5ponte13global_configEv"), nullptr);
  EXPECT_EQ(dlsym(l.handle, "_ZN5ponte6Engine6createENS_13EngineOptionsE"), nullptr);
}

TEST_F(PluginTest, PropertiesAndLogging) {
  PropertiesV11 p;
  std::memset(&p, 0xab, sizeof(p));
  ASSERT_OK(net()->get_properties(0, &p));
  ASSERT_NE(p.name, nullptr);
  EXPECT_GT(std::strlen(p.name), 0u);
  EXPECT_EQ(p.ptr_support, kPtrHost) << "no GPUDirect on this host";
  EXPECT_EQ(p.max_recvs, 8);
  EXPECT_GT(p.max_comms, 0);
  EXPECT_GT(p.speed, 0);
  EXPECT_EQ(p.reg_is_global, 1);
  EXPECT_EQ(p.net_device_type, kDeviceHost);
  EXPECT_EQ(p.vprops.ndevs, 1);
  EXPECT_EQ(p.vprops.devs[0], 0);
  EXPECT_GE(p.max_p2p_bytes, size_t{1} << 31);
  EXPECT_EQ(p.max_multi_request_size, 1);
  if (p.pci_path) {
    EXPECT_EQ(std::strncmp(p.pci_path, "/sys/", 5), 0) << p.pci_path;
  } else if (const char* b = std::getenv("PONTE_BACKEND"); !b || std::string(b) != "verbs") {
    // libfabric's loopback domain has neither a PCI device nor a link speed: the default. (rxe in
    // the SoftRoCE guest has no PCI device but reports its netdev's speed.)
    EXPECT_EQ(p.speed, 100000) << "a NIC without a PCI device (loopback) reports the default";
  }
  // NCCL_DEBUG=INFO shows ponte's lines: they went through NCCL's logger.
  EXPECT_TRUE(log_record().contains("NET/ponte")) << "nothing logged through NCCL's logger";
  EXPECT_TRUE(log_record().contains("backend"));
  EXPECT_TRUE(log_record().contains("GPUDirect"));
  // The first line says which ponte is loaded: its version, and its commit when built from a checkout.
  EXPECT_EQ(log_record().first().rfind("NET/ponte : ponte " PONTE_VERSION_STRING ",", 0), 0u)
      << "first line: " << log_record().first();
  // Bad device indexes are errors, not crashes.
  EXPECT_EQ(net()->get_properties(-1, &p), kInvalidArgument);
  EXPECT_EQ(net()->get_properties(net().devices(), &p), kInvalidArgument);
  EXPECT_NE(net()->get_properties(0, nullptr), kSuccess);
}

TEST_F(PluginTest, ConnectAndAcceptNeverBlockAndReachSelf) {
  Handle h;
  void* listen = nullptr;
  ASSERT_OK(net()->listen(net().ctx(), 0, h.bytes, &listen));
  ASSERT_NE(listen, nullptr);
  void* send = nullptr;
  void* recv = nullptr;
  DeviceHandle* dh = nullptr;
  // Before anyone connected, accept returns at once with nothing.
  const auto t0 = Clock::now();
  ASSERT_OK(net()->accept(listen, &recv, &dh));
  EXPECT_EQ(recv, nullptr);
  int calls = 0;
  const auto deadline = Clock::now() + kDeadline;
  while ((!send || !recv) && Clock::now() < deadline) {
    const auto c0 = Clock::now();
    if (!send) ASSERT_OK(net()->connect(net().ctx(), 0, h.bytes, &send, &dh));
    if (!recv) ASSERT_OK(net()->accept(listen, &recv, &dh));
    EXPECT_LT(Clock::now() - c0, 2s) << "connect/accept blocked";
    ++calls;
  }
  ASSERT_NE(send, nullptr);
  ASSERT_NE(recv, nullptr);
  EXPECT_GT(calls, 0);
  (void)t0;
  Pair p{send, recv, nullptr};
  transfer(p, 4096, 4096, 1);
  ASSERT_OK(net()->close_listen(listen));
  close_pair(net(), &p);
}

TEST_F(PluginTest, SizesFromZeroTo64MiBByteForByte) {
  Pair p;
  ASSERT_OK(connect_pair(net(), 0, 0, &p));
  const size_t sizes[] = {0, 1, 7, 64, 4095, 4096, 65537, kMiB, 4 * kMiB + 3, 64 * kMiB};
  uint32_t seed = 100;
  for (size_t s : sizes) {
    SCOPED_TRACE(s);
    transfer(p, s, s, seed++);
  }
  // A receive larger than the send: test() reports what was sent.
  transfer(p, 1000, 8192, seed++);
  transfer(p, 0, 4096, seed++);
  // Zero bytes with no buffer and no memory handle at all, on both sides.
  void* data[1] = {nullptr};
  size_t zero[1] = {0};
  int tags[1] = {7};
  void* mhs[1] = {nullptr};
  void* rreq = nullptr;
  void* sreq = nullptr;
  ASSERT_OK(post_recv(net(), p.recv, 1, data, zero, tags, mhs, &rreq));
  ASSERT_OK(post_send(net(), p.send, nullptr, 0, 7, nullptr, &sreq));
  int s = -1, r[8] = {-1};
  ASSERT_OK(wait_request(net(), sreq, &s));
  ASSERT_OK(wait_request(net(), rreq, r));
  EXPECT_EQ(s, 0);
  EXPECT_EQ(r[0], 0);
  close_pair(net(), &p);
}

TEST_F(PluginTest, EightInFlightAndThirtyTwoPostedReceives) {
  Pair p;
  ASSERT_OK(connect_pair(net(), 0, 0, &p));
  for (int window : {8, 32}) {
    SCOPED_TRACE(window);
    const size_t size = 256 * 1024 + 13;
    std::vector<std::unique_ptr<Buffer>> src, dst;
    std::vector<void*> rreq(window), sreq(window);
    for (int i = 0; i < window; ++i) {
      src.push_back(std::make_unique<Buffer>(net(), p.send, size));
      dst.push_back(std::make_unique<Buffer>(net(), p.recv, size));
      fill(src.back()->data(), size, 1000 + i);
    }
    for (int i = 0; i < window; ++i) {  // all receives first: 32 requests in flight on the comm
      void* data[1] = {dst[i]->data()};
      size_t sizes[1] = {size};
      int tags[1] = {3};
      void* mhs[1] = {dst[i]->mh()};
      ASSERT_OK(net()->irecv(p.recv, 1, data, sizes, tags, mhs, nullptr, &rreq[i]));
      ASSERT_NE(rreq[i], nullptr) << "receive " << i << " of " << window << " refused";
    }
    for (int i = 0; i < window; ++i)
      ASSERT_OK(post_send(net(), p.send, src[i]->data(), size, 3, src[i]->mh(), &sreq[i]));
    // Test in reverse order: completion does not depend on the order NCCL tests in.
    for (int i = window - 1; i >= 0; --i) {
      int s = 0, r[8] = {0};
      ASSERT_OK(wait_request(net(), sreq[i], &s));
      ASSERT_OK(wait_request(net(), rreq[i], r));
      EXPECT_EQ(r[0], static_cast<int>(size));
    }
    for (int i = 0; i < window; ++i)
      EXPECT_EQ(mismatch(dst[i]->data(), size, 1000 + i), SIZE_MAX) << "message " << i;
  }
  close_pair(net(), &p);
}

// Messages of at most PONTE_NET_INLINE (4096) bytes from host memory into a one-buffer host receive
// come inside the size record (one write) and are copied out of the request's inline slot, whatever
// the receive buffer's size (NCCL posts 64 KiB step buffers and sends 8 bytes into them); larger
// ones go into the buffer with their record in that slot. Three rounds of 32 receives in flight
// reuse every slot; sizes straddle the limit, receives larger than their sends share the rounds.
TEST_F(PluginTest, SmallMessagesCycleEveryInlineSlot) {
  Pair p;
  ASSERT_OK(connect_pair(net(), 0, 0, &p));
  const size_t sends[] = {1, 4096, 4095, 100, 4097, 64, 3000, 8, 8, 65536, 4096};
  const size_t caps[] = {1, 4096, 4096, 4096, 4097, 5000, 3000, 4096, 65536, 65536, 1 << 20};
  constexpr int kWindow = 32;
  uint32_t seed = 5000;
  for (int round = 0; round < 3; ++round) {
    SCOPED_TRACE(round);
    std::vector<std::unique_ptr<Buffer>> src, dst;
    std::vector<void*> rreq(kWindow), sreq(kWindow);
    for (int i = 0; i < kWindow; ++i) {
      const size_t k = static_cast<size_t>(i + round) % std::size(sends);
      src.push_back(std::make_unique<Buffer>(net(), p.send, sends[k]));
      dst.push_back(std::make_unique<Buffer>(net(), p.recv, caps[k] + 1));
      fill(src.back()->data(), sends[k], seed + i);
      void* data[1] = {dst.back()->data()};
      size_t sizes[1] = {caps[k]};
      int tags[1] = {9};
      void* mhs[1] = {dst.back()->mh()};
      ASSERT_OK(net()->irecv(p.recv, 1, data, sizes, tags, mhs, nullptr, &rreq[i]));
      ASSERT_NE(rreq[i], nullptr) << "receive " << i << " refused";
    }
    for (int i = 0; i < kWindow; ++i) {
      const size_t k = static_cast<size_t>(i + round) % std::size(sends);
      ASSERT_OK(post_send(net(), p.send, src[i]->data(), sends[k], 9, src[i]->mh(), &sreq[i]));
    }
    for (int i = kWindow - 1; i >= 0; --i) {
      const size_t k = static_cast<size_t>(i + round) % std::size(sends);
      int sent = -1, got[8] = {-1};
      ASSERT_OK(wait_request(net(), sreq[i], &sent));
      ASSERT_OK(wait_request(net(), rreq[i], got));
      EXPECT_EQ(got[0], static_cast<int>(sends[k])) << "message " << i;
      EXPECT_EQ(mismatch(dst[i]->data(), sends[k], seed + i), SIZE_MAX) << "message " << i;
      EXPECT_EQ(dst[i]->data()[sends[k]], 0) << "message " << i << " wrote past its bytes";
    }
    seed += kWindow;
  }
  close_pair(net(), &p);
}

// A small message copied into its CTS slot's outbox area waits for that area's previous user
// (request n - 32) to end. Request indices are reused once tested (last in, first out): request 0's
// index, freed, carries request 1, a 64 MiB send still on the wire when request 32, small, comes to
// the same slot. It must go at once, not wait for the unrelated large send.
TEST_F(PluginTest, ASmallSendDoesNotWaitForALargeOneThatReusedItsSlotsLastRequest) {
  Pair p;
  ASSERT_OK(connect_pair(net(), 0, 0, &p));
  constexpr int kWindow = 32;
  constexpr size_t kSmall = 8, kLarge = 64u << 20;
  std::vector<std::unique_ptr<Buffer>> src, dst;
  for (int i = 0; i <= kWindow; ++i) {
    const size_t size = i == 1 ? kLarge : kSmall;
    src.push_back(std::make_unique<Buffer>(net(), p.send, size));
    dst.push_back(std::make_unique<Buffer>(net(), p.recv, size));
    fill(src.back()->data(), size, 300 + i);
  }
  auto post_recv_of = [&](int i, void** req) {
    void* data[1] = {dst[i]->data()};
    size_t sizes[1] = {dst[i]->size()};
    int tags[1] = {4};
    void* mhs[1] = {dst[i]->mh()};
    return post_recv(net(), p.recv, 1, data, sizes, tags, mhs, req);
  };
  std::vector<void*> rreq(kWindow + 1), sreq(kWindow + 1);
  // Request 0: inline, tested to its end on both sides (its index goes back on the free list).
  ASSERT_OK(post_recv_of(0, &rreq[0]));
  ASSERT_OK(post_send(net(), p.send, src[0]->data(), kSmall, 4, src[0]->mh(), &sreq[0]));
  int got[8] = {-1};
  ASSERT_OK(wait_request(net(), sreq[0], got));
  ASSERT_OK(wait_request(net(), rreq[0], got));
  // Requests 1..32 posted in a run (no receive tested between: every CTS goes at irecv).
  for (int i = 1; i <= kWindow; ++i) ASSERT_OK(post_recv_of(i, &rreq[i]));
  for (int i = 1; i < kWindow; ++i) {
    SCOPED_TRACE(i);
    ASSERT_OK(post_send(net(), p.send, src[i]->data(), src[i]->size(), 4, src[i]->mh(), &sreq[i]));
  }
  // Request 32 (request 0's slot): isend gives a request while request 1 is still moving.
  int large_done = 0;
  const auto deadline = Clock::now() + kDeadline;
  while (!sreq[kWindow] && !large_done && Clock::now() < deadline) {
    ASSERT_OK(net()->isend(p.send, src[kWindow]->data(), kSmall, 4, src[kWindow]->mh(), nullptr, &sreq[kWindow]));
    if (!sreq[kWindow]) {
      int size = 0;
      ASSERT_OK(net()->test(sreq[1], &large_done, &size));
    }
  }
  ASSERT_NE(sreq[kWindow], nullptr)
      << (large_done ? "the small send into request 0's slot waited until the 64 MiB send that reused request 0's "
                       "index ended"
                     : "the small send into request 0's slot got no request in time");
  for (int i = 1; i <= kWindow; ++i) {
    SCOPED_TRACE(i);
    int sent = -1;
    if (i != 1 || !large_done) ASSERT_OK(wait_request(net(), sreq[i], &sent));
    ASSERT_OK(wait_request(net(), rreq[i], got));
    EXPECT_EQ(got[0], static_cast<int>(src[i]->size()));
    EXPECT_EQ(mismatch(dst[i]->data(), src[i]->size(), 300 + i), SIZE_MAX);
  }
  close_pair(net(), &p);
}


TEST_F(PluginTest, GroupedReceiveTagsPickTheSlot) {
  Pair p;
  ASSERT_OK(connect_pair(net(), 0, 0, &p));
  constexpr int n = 8;
  std::vector<std::unique_ptr<Buffer>> src, dst;
  void* data[n];
  size_t sizes[n];
  int tags[n];
  void* mhs[n];
  for (int i = 0; i < n; ++i) {
    sizes[i] = 1000 * (i + 1) + (i == 5 ? 2 * kMiB : 0);
    tags[i] = 50 + i;
    dst.push_back(std::make_unique<Buffer>(net(), p.recv, sizes[i]));
    src.push_back(std::make_unique<Buffer>(net(), p.send, sizes[i]));
    fill(src.back()->data(), sizes[i], 500 + tags[i]);
    data[i] = dst[i]->data();
    mhs[i] = dst[i]->mh();
  }
  void* rreq = nullptr;
  ASSERT_OK(post_recv(net(), p.recv, n, data, sizes, tags, mhs, &rreq));
  // Sends in reverse tag order, some shorter than the buffer: each lands in its tag's buffer.
  std::vector<void*> sreq(n);
  for (int i = n - 1; i >= 0; --i) {
    const size_t len = i % 3 == 0 ? sizes[i] / 2 : sizes[i];
    ASSERT_OK(post_send(net(), p.send, src[i]->data(), len, tags[i], src[i]->mh(), &sreq[i]));
  }
  for (int i = 0; i < n; ++i) {
    int s = 0;
    ASSERT_OK(wait_request(net(), sreq[i], &s));
  }
  int got[n];
  ASSERT_OK(wait_request(net(), rreq, got));
  for (int i = 0; i < n; ++i) {
    const size_t len = i % 3 == 0 ? sizes[i] / 2 : sizes[i];
    EXPECT_EQ(got[i], static_cast<int>(len)) << "buffer " << i;
    EXPECT_EQ(mismatch(dst[i]->data(), len, 500 + tags[i]), SIZE_MAX) << "buffer " << i;
  }
  // A send whose tag the grouped receive does not hold waits (NULL request), it is not matched.
  void* req = nullptr;
  ASSERT_OK(net()->isend(p.send, src[0]->data(), 10, 999, src[0]->mh(), nullptr, &req));
  EXPECT_EQ(req, nullptr);
  close_pair(net(), &p);
}

// Eager (plugin/README.md): once a CTS showed a one-buffer host receive, a message of at most
// PONTE_NET_INLINE bytes for the same tag goes before its own receive is posted, into the request's
// eager slot, and its send completes without the receiver. The receiver, posting later, finds it
// there. 40 messages: every eager slot, some twice. A larger message still waits for its receive.
// With PONTE_NET_EAGER=0 (ctest plugin_eager_off) every send waits for its receive; with
// PONTE_NET_EAGER_NIC_COPY=1 (plugin_eager_nic_copy) the receiver moves the data from the slot
// through a NIC, the path GPU buffers take.
bool eager_on() {
  const char* v = getenv("PONTE_NET_EAGER");
  return !v || std::string(v) != "0";
}

// Calls isend for up to `limit`; the request, or nullptr when none came.
void* try_isend(const Net& n, void* comm, void* data, size_t size, int tag, void* mh,
                std::chrono::milliseconds limit) {
  const auto deadline = Clock::now() + limit;
  void* req = nullptr;
  do {
    if (n->isend(comm, data, size, tag, mh, nullptr, &req) != kSuccess) return nullptr;
    if (!req) std::this_thread::yield();
  } while (!req && Clock::now() < deadline);
  return req;
}

TEST_F(PluginTest, EagerMessagesGoBeforeTheirReceiveIsPosted) {
  const bool eager = eager_on();
  Pair p;
  ASSERT_OK(connect_pair(net(), 0, 0, &p));
  Buffer src(net(), p.send, 8192), dst(net(), p.recv, 65536 + 1);
  ASSERT_OK(src.result);
  ASSERT_OK(dst.result);
  transfer(p, 64, 65536, 1, 3);  // nothing predicts the first receive: it waits for its CTS
  void* data[1] = {dst.data()};
  size_t sizes[1] = {65536};
  int tags[1] = {3};
  void* mhs[1] = {dst.mh()};
  for (int k = 0; k <= 40; ++k) {
    SCOPED_TRACE(k);
    const size_t len = k == 40 ? 5000 : k % 3 == 0 ? 4096 : 1 + 97 * static_cast<size_t>(k);
    fill(src.data(), len, 100 + k);
    std::memset(dst.data(), 0, 65536 + 1);
    const bool expect = eager && len <= 4096;  // a wait for one that never comes can be short
    void* sreq = try_isend(net(), p.send, src.data(), len, 3, src.mh(), std::chrono::milliseconds(expect ? 300 : 20));
    if (expect) {
      ASSERT_NE(sreq, nullptr) << len << " bytes waited for their receive";
      int sent = -1;
      ASSERT_OK(wait_request(net(), sreq, &sent));  // done with no receive posted
      EXPECT_EQ(sent, static_cast<int>(len));
    } else {
      ASSERT_EQ(sreq, nullptr) << len << " bytes went before their receive (eager " << eager << ")";
    }
    void* rreq = nullptr;
    ASSERT_OK(post_recv(net(), p.recv, 1, data, sizes, tags, mhs, &rreq));
    if (!sreq) {
      ASSERT_OK(post_send(net(), p.send, src.data(), len, 3, src.mh(), &sreq));
      int sent = -1;
      ASSERT_OK(wait_request(net(), sreq, &sent));
    }
    int got[8] = {-1};
    ASSERT_OK(wait_request(net(), rreq, got));
    EXPECT_EQ(got[0], static_cast<int>(len));
    EXPECT_EQ(mismatch(dst.data(), len, 100 + k), SIZE_MAX);
    EXPECT_EQ(dst.data()[len], 0) << "wrote past the message";
  }
  close_pair(net(), &p);
}

// An eager message whose receive turns out to be grouped: its record names its tag, and the data
// lands in that buffer; the sender, reading the CTS, sends the other buffers' messages as usual.
TEST_F(PluginTest, EagerMessageIntoAGroupedReceive) {
  const bool eager = eager_on();
  Pair p;
  ASSERT_OK(connect_pair(net(), 0, 0, &p));
  transfer(p, 64, 65536, 1, 5);  // the prediction: one host buffer, tag 5
  const size_t lens[3] = {1000, 300, 70000};
  const size_t caps[3] = {1000, 4096, 70000};
  int tags[3] = {4, 5, 6};
  std::vector<std::unique_ptr<Buffer>> src, dst;
  void* data[3];
  size_t sizes[3];
  void* mhs[3];
  for (int i = 0; i < 3; ++i) {
    src.push_back(std::make_unique<Buffer>(net(), p.send, lens[i]));
    dst.push_back(std::make_unique<Buffer>(net(), p.recv, caps[i]));
    fill(src[i]->data(), lens[i], 900 + i);
    data[i] = dst[i]->data();
    sizes[i] = caps[i];
    mhs[i] = dst[i]->mh();
  }
  void* sreq[3] = {};
  sreq[1] = try_isend(net(), p.send, src[1]->data(), lens[1], 5, src[1]->mh(), std::chrono::milliseconds(eager ? 300 : 20));
  ASSERT_EQ(sreq[1] != nullptr, eager) << "the tag-5 message before its receive";
  void* rreq = nullptr;
  ASSERT_OK(post_recv(net(), p.recv, 3, data, sizes, tags, mhs, &rreq));
  for (int i : {2, 0, 1}) {
    if (!sreq[i]) ASSERT_OK(post_send(net(), p.send, src[i]->data(), lens[i], tags[i], src[i]->mh(), &sreq[i]));
  }
  for (void* r : sreq) ASSERT_OK(wait_request(net(), r, nullptr));
  int got[8] = {-1, -1, -1};
  ASSERT_OK(wait_request(net(), rreq, got));
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(got[i], static_cast<int>(lens[i])) << "buffer " << i;
    EXPECT_EQ(mismatch(dst[i]->data(), lens[i], 900 + i), SIZE_MAX) << "buffer " << i;
  }
  // The pair goes on: the grouped receive predicts none, the next message waits for its CTS.
  transfer(p, 2000, 4096, 7, 5);
  transfer(p, 100, 4096, 8, 5);
  close_pair(net(), &p);
}

// An eager message for request n writes request n % 32's slot, and counts on its immediate value:
// it waits until the CTS it read last says request n - 32 ended at the receiver. 32 receives
// posted and filled, none tested: the 33rd message has no free slot and waits (for its own CTS,
// which comes once the first receive ended).
TEST_F(PluginTest, AnEagerMessageWaitsUntilItsSlotIsFree) {
  if (!eager_on()) GTEST_SKIP() << "PONTE_NET_EAGER=0: no message goes eagerly";
  Pair p;
  ASSERT_OK(connect_pair(net(), 0, 0, &p));
  constexpr int kN = 33;  // NCCL_NET_MAX_REQUESTS (32) + 1
  std::vector<std::unique_ptr<Buffer>> src, dst;
  std::vector<void*> rreq(kN), sreq(kN);
  void* data[1];
  size_t sizes[1] = {4096};
  int tags[1] = {2};
  void* mhs[1];
  for (int i = 0; i < kN; ++i) {
    src.push_back(std::make_unique<Buffer>(net(), p.send, 100));
    dst.push_back(std::make_unique<Buffer>(net(), p.recv, 4096));
    fill(src[i]->data(), 100, 40 + i);
  }
  for (int i = 0; i < kN - 1; ++i) {
    data[0] = dst[i]->data();
    mhs[0] = dst[i]->mh();
    ASSERT_OK(post_recv(net(), p.recv, 1, data, sizes, tags, mhs, &rreq[i]));
  }
  for (int i = 0; i < kN - 1; ++i) {
    ASSERT_OK(post_send(net(), p.send, src[i]->data(), 100, 2, src[i]->mh(), &sreq[i]));
    ASSERT_OK(wait_request(net(), sreq[i], nullptr));
  }
  void* early = try_isend(net(), p.send, src[kN - 1]->data(), 100, 2, src[kN - 1]->mh(), std::chrono::milliseconds(200));
  EXPECT_EQ(early, nullptr) << "message 32 went while request 0 still held its slot";
  int got[8] = {-1};
  ASSERT_OK(wait_request(net(), rreq[0], got));
  EXPECT_EQ(got[0], 100);
  EXPECT_EQ(mismatch(dst[0]->data(), 100, 40), SIZE_MAX);
  data[0] = dst[kN - 1]->data();
  mhs[0] = dst[kN - 1]->mh();
  ASSERT_OK(post_recv(net(), p.recv, 1, data, sizes, tags, mhs, &rreq[kN - 1]));
  sreq[kN - 1] = early;
  if (!early) ASSERT_OK(post_send(net(), p.send, src[kN - 1]->data(), 100, 2, src[kN - 1]->mh(), &sreq[kN - 1]));
  ASSERT_OK(wait_request(net(), sreq[kN - 1], nullptr));
  for (int i = 1; i < kN; ++i) {
    got[0] = -1;
    SCOPED_TRACE(i);
    ASSERT_OK(wait_request(net(), rreq[i], got));
    EXPECT_EQ(got[0], 100) << "receive " << i;
    EXPECT_EQ(mismatch(dst[i]->data(), 100, 40 + i), SIZE_MAX) << "receive " << i;
  }
  close_pair(net(), &p);
}

// An eager message's receive can end before the sender reads that request's CTS; the receiver may
// then post 32 more receives, the last into the same CTS slot. The sender's next messages must
// still go: they waited for good for the overwritten CTS (plugin_shm hung in
// SmallMessagesCycleEveryInlineSlot, rarely: there the new CTS had to land first).
TEST_F(PluginTest, EagerRequestWhoseCtsSlotWasReusedGoesOn) {
  if (!eager_on()) GTEST_SKIP() << "PONTE_NET_EAGER=0: no message goes eagerly";
  Pair p;
  ASSERT_OK(connect_pair(net(), 0, 0, &p));
  transfer(p, 64, 65536, 1, 5);  // the prediction: one host buffer, tag 5
  constexpr int kN = 33;         // the eager one, then 32 more
  std::vector<std::unique_ptr<Buffer>> src, dst;
  std::vector<void*> rreq(kN), sreq(kN);
  for (int i = 0; i < kN; ++i) {
    src.push_back(std::make_unique<Buffer>(net(), p.send, 100));
    dst.push_back(std::make_unique<Buffer>(net(), p.recv, 4096));
    fill(src[i]->data(), 100, 70 + i);
  }
  size_t sizes[1] = {4096};
  int tags[1] = {5};
  auto post = [&](int i) {
    void* data[1] = {dst[i]->data()};
    void* mhs[1] = {dst[i]->mh()};
    return post_recv(net(), p.recv, 1, data, sizes, tags, mhs, &rreq[i]);
  };
  sreq[0] = try_isend(net(), p.send, src[0]->data(), 100, 5, src[0]->mh(), std::chrono::milliseconds(300));
  ASSERT_NE(sreq[0], nullptr) << "the first message did not go eagerly";
  ASSERT_OK(wait_request(net(), sreq[0], nullptr));
  ASSERT_OK(post(0));
  int got[8] = {-1};
  ASSERT_OK(wait_request(net(), rreq[0], got));
  EXPECT_EQ(got[0], 100);
  for (int i = 1; i < kN; ++i) ASSERT_OK(post(i));
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // their CTS land, the last over the first's
  for (int i = 1; i < kN; ++i) {
    sreq[i] = try_isend(net(), p.send, src[i]->data(), 100, 5, src[i]->mh(), std::chrono::seconds(5));
    ASSERT_NE(sreq[i], nullptr) << "message " << i << " waited for a CTS that was overwritten";
  }
  for (int i = 0; i < kN; ++i) {
    SCOPED_TRACE(i);
    if (i > 0) {
      ASSERT_OK(wait_request(net(), sreq[i], nullptr));
      got[0] = -1;
      ASSERT_OK(wait_request(net(), rreq[i], got));
      EXPECT_EQ(got[0], 100);
    }
    EXPECT_EQ(mismatch(dst[i]->data(), 100, 70 + i), SIZE_MAX);
  }
  close_pair(net(), &p);
}

// Two pairs on device 0: on `p`, receives whose CTS are held (hold_phase), and on `other` a
// receive nothing fills until the end, for a caller to wait on instead.
class HeldCtsRig {
 public:
  static constexpr size_t kSize = 8192;
  explicit HeldCtsRig(const Net& net) : net_(net) {
    const char* v = getenv("PONTE_NET_CTS_AHEAD");
    ahead = v ? atoi(v) : 4;
    per_phase = ahead + 2;
  }
  bool usable() const { return ahead >= 1 && ahead <= 14; }
  void open(int phases) {
    ASSERT_OK(connect_pair(net_, 0, 0, &p));
    ASSERT_OK(connect_pair(net_, 0, 0, &other));
    rreq.resize(phases * per_phase);
    sreq.resize(phases * per_phase);
    for (int i = 0; i < phases * per_phase; ++i) {
      src.push_back(std::make_unique<Buffer>(net_, p.send, kSize));
      dst.push_back(std::make_unique<Buffer>(net_, p.recv, kSize));
      fill(src[i]->data(), kSize, 500 + i);
    }
    osrc = std::make_unique<Buffer>(net_, other.send, 64);
    fill(osrc->data(), 64, 77);
    ASSERT_NO_FATAL_FAILURE(post_other(1));
  }
  // Posts n receives on `other`, testing the first of them after each: beyond `ahead` of them
  // (nothing fills them), their CTS are held, and the calling thread drives `other`.
  void post_other(int n) {
    const size_t first = oreqs.size();
    int done = 0;
    for (int k = 0; k < n; ++k) {
      odst.push_back(std::make_unique<Buffer>(net_, other.recv, 64));
      void* data[1] = {odst.back()->data()};
      size_t sizes[1] = {64};
      int tags[1] = {9};
      void* mhs[1] = {odst.back()->mh()};
      oreqs.push_back(nullptr);
      ASSERT_OK(post_recv(net_, other.recv, 1, data, sizes, tags, mhs, &oreqs.back()));
      ASSERT_EQ(net_->test(oreqs[first], &done, nullptr), kSuccess);
      ASSERT_EQ(done, 0);
    }
  }
  // Posts the phase's receives, testing receive `first` after each: the CTS after `ahead` are held.
  void post_held(int first) {
    int done = 0;
    for (int i = first; i < first + per_phase; ++i) {
      void* data[1] = {dst[i]->data()};
      size_t sizes[1] = {kSize};
      int tags[1] = {4};
      void* mhs[1] = {dst[i]->mh()};
      ASSERT_OK(post_recv(net_, p.recv, 1, data, sizes, tags, mhs, &rreq[i]));
      ASSERT_EQ(net_->test(rreq[first], &done, nullptr), kSuccess);
      ASSERT_EQ(done, 0);
    }
  }
  // Sends the `ahead` messages that have their CTS and checks that the next one's is held.
  void send_ahead(int first) {
    for (int i = first; i < first + ahead; ++i)
      ASSERT_TRUE(send(i, std::chrono::seconds(5))) << "message " << i << " found no CTS";
    // 50 ms: a thread that waits elsewhere writes CTS held for 100-200 ms (HeldCtsGoWhenTheCaller...).
    ASSERT_FALSE(send(first + ahead, std::chrono::milliseconds(50))) << "the CTS of receive " << first + ahead << " was not held";
  }
  void hold_phase(int first) {
    ASSERT_NO_FATAL_FAILURE(post_held(first));
    ASSERT_NO_FATAL_FAILURE(send_ahead(first));
  }
  bool send(int i, std::chrono::milliseconds limit) {
    sreq[i] = try_isend(net_, p.send, src[i]->data(), kSize, 4, src[i]->mh(), limit);
    return sreq[i] != nullptr;
  }
  // Sends [first, last) from another thread: it does not drive p.recv, so its waiting calls never
  // write p's held CTS, and only what this thread did can have sent them.
  bool send_elsewhere(int first, int last) {
    bool ok = true;
    std::thread t([&] {
      for (int i = first; i < last && ok; ++i) ok = send(i, std::chrono::seconds(5));
    });
    t.join();
    return ok;
  }
  bool one_isend(int i) {
    EXPECT_EQ(net_->isend(p.send, src[i]->data(), kSize, 4, src[i]->mh(), nullptr, &sreq[i]), kSuccess);
    return sreq[i] != nullptr;
  }
  // Tests the other comm's receive (not done) for `span`.
  void wait_elsewhere(std::chrono::milliseconds span) {
    int done = 0;
    for (const auto end = Clock::now() + span; Clock::now() < end;) {
      ASSERT_EQ(net_->test(oreqs[0], &done, nullptr), kSuccess);
      ASSERT_EQ(done, 0);
      std::this_thread::yield();
    }
  }
  // Sends the phase's messages after the held one, then checks every message of the phase.
  void end_phase(int first) {
    for (int i = first + ahead + 1; i < first + per_phase; ++i)
      ASSERT_TRUE(send(i, std::chrono::seconds(5))) << "message " << i;
    for (int i = first; i < first + per_phase; ++i) {
      SCOPED_TRACE(i);
      ASSERT_OK(wait_request(net_, sreq[i], nullptr));
      if (rreq[i]) {  // null: ended already
        int got[8] = {-1};
        ASSERT_OK(wait_request(net_, rreq[i], got));
        EXPECT_EQ(got[0], static_cast<int>(kSize));
      }
      EXPECT_EQ(mismatch(dst[i]->data(), kSize, 500 + i), SIZE_MAX);
    }
  }
  // Fills the receives on `other` (a test of the newest, held or not, writes every held CTS
  // first), checks them and closes both pairs.
  void close() {
    int done = 0;
    ASSERT_EQ(net_->test(oreqs.back(), &done, nullptr), kSuccess);
    ASSERT_EQ(done, 0);
    for (size_t k = 0; k < oreqs.size(); ++k) {
      void* os = try_isend(net_, other.send, osrc->data(), 64, 9, osrc->mh(), std::chrono::seconds(5));
      ASSERT_NE(os, nullptr) << "message " << k << " on the other comm";
      ASSERT_OK(wait_request(net_, os, nullptr));
    }
    for (size_t k = 0; k < oreqs.size(); ++k) {
      ASSERT_OK(wait_request(net_, oreqs[k], nullptr));
      EXPECT_EQ(mismatch(odst[k]->data(), 64, 77), SIZE_MAX);
    }
    src.clear();
    dst.clear();
    osrc.reset();
    odst.clear();
    close_pair(net_, &other);
    close_pair(net_, &p);
  }

  int ahead = 4, per_phase = 6;
  Pair p, other;
  std::vector<std::unique_ptr<Buffer>> src, dst;
  std::vector<std::unique_ptr<Buffer>> odst;
  std::unique_ptr<Buffer> osrc;
  std::vector<void*> rreq, sreq, oreqs;

 private:
  const Net& net_;
};

// Held CTS (plugin/README.md, step 7): a caller that tests its receives between its irecvs (NCCL's
// proxy) gets a receive's CTS held while PONTE_NET_CTS_AHEAD (4) receives with their CTS out are
// unfilled. The held ones go once fewer are unfilled (a test() sees the messages landed), or at
// once when the caller tests a held receive (it waits for it, and nothing else may make it wait).
// 8 KiB messages: none goes eagerly.
TEST_F(PluginTest, HeldCtsGoOnceFewReceivesAreUnfilledOrAHeldOneIsTested) {
  HeldCtsRig rig(net());
  if (!rig.usable()) GTEST_SKIP() << "PONTE_NET_CTS_AHEAD: this test holds 1..14";
  ASSERT_NO_FATAL_FAILURE(rig.open(2));
  const int ahead = rig.ahead, per_phase = rig.per_phase;
  // Phase 1: `ahead` CTS go, the next two are held until a test() finds the messages landed.
  ASSERT_NO_FATAL_FAILURE(rig.hold_phase(0));
  ASSERT_OK(wait_request(net(), rig.rreq[0], nullptr));  // its test() sees every sent message landed
  rig.rreq[0] = nullptr;
  ASSERT_TRUE(rig.send_elsewhere(ahead, ahead + 1)) << "held CTS " << ahead << " did not go once the receives filled";
  ASSERT_NO_FATAL_FAILURE(rig.end_phase(0));
  // Phase 2: the caller tests a held receive while `ahead` are unfilled: every CTS goes, and the
  // sender sends them all with no further call at the receiver.
  ASSERT_NO_FATAL_FAILURE(rig.post_held(per_phase));
  int done = 0;
  ASSERT_EQ(net()->test(rig.rreq[2 * per_phase - 1], &done, nullptr), kSuccess);
  ASSERT_TRUE(rig.send_elsewhere(per_phase, per_phase + ahead + 1)) << "testing a held receive did not send the held CTS";
  ASSERT_NO_FATAL_FAILURE(rig.end_phase(per_phase));
  rig.close();
}

// A caller that tests a receive, posts more (their CTS held) and then waits only for other
// requests, never calling that receive comm again: the held CTS go anyway, within about two of
// the plugin's 100 ms looks, once by test() calls on another comm's request alone, once by
// isend calls (finding no CTS) alone. NCCL never waits like this; without those looks this caller
// would wait for ever.
TEST_F(PluginTest, HeldCtsGoWhenTheCallerWaitsOnlyForOtherRequests) {
  HeldCtsRig rig(net());
  if (!rig.usable()) GTEST_SKIP() << "PONTE_NET_CTS_AHEAD: this test holds 1..14";
  ASSERT_NO_FATAL_FAILURE(rig.open(2));
  const int ahead = rig.ahead, per_phase = rig.per_phase;
  // Phase 1: the caller only tests the other comm's receive; one isend a second sees whether the
  // held CTS arrived (at most 5: too few calls to look for held CTS themselves, once per 64 calls).
  ASSERT_NO_FATAL_FAILURE(rig.hold_phase(0));
  bool went = false;
  for (int tries = 0; !went && tries < 5; ++tries) {
    ASSERT_NO_FATAL_FAILURE(rig.wait_elsewhere(std::chrono::seconds(1)));
    went = rig.one_isend(ahead);
  }
  ASSERT_TRUE(went) << "testing another comm's request for 5 s did not write the held CTS";
  ASSERT_NO_FATAL_FAILURE(rig.end_phase(0));
  // Phase 2: the caller only calls isend, which finds no CTS, until the held one arrives.
  ASSERT_NO_FATAL_FAILURE(rig.hold_phase(per_phase));
  ASSERT_TRUE(rig.send(per_phase + ahead, std::chrono::seconds(5))) << "isend calls alone for 5 s did not write the held CTS";
  ASSERT_NO_FATAL_FAILURE(rig.end_phase(per_phase));
  rig.close();
}

// Held CTS are written only by the thread that drives their receive comm (its last irecv, test or
// closeRecv): another thread's waiting calls leave them alone, and once that thread drives the
// comm, its waiting calls write them. Under TSan this also checks that a change of driver and two
// threads' looks for held CTS do not race.
TEST_F(PluginTest, HeldCtsAreWrittenOnlyByTheThreadThatDrivesTheirComm) {
  HeldCtsRig rig(net());
  if (!rig.usable()) GTEST_SKIP() << "PONTE_NET_CTS_AHEAD: this test holds 1..14";
  ASSERT_NO_FATAL_FAILURE(rig.open(2));
  const int ahead = rig.ahead, per_phase = rig.per_phase;
  // Phase 1: this thread drives the comm; another holds CTS on the other comm (which it then
  // drives) and waits there for 400 ms: it looks for held CTS, and writes its own.
  ASSERT_NO_FATAL_FAILURE(rig.hold_phase(0));
  std::thread stranger([&] {
    ASSERT_NO_FATAL_FAILURE(rig.post_other(rig.per_phase));
    rig.wait_elsewhere(std::chrono::milliseconds(400));
  });
  stranger.join();
  EXPECT_FALSE(rig.one_isend(ahead)) << "a thread that does not drive the receive comm wrote its held CTS";
  int done = 0;
  ASSERT_EQ(net()->test(rig.rreq[0], &done, nullptr), kSuccess);  // the sent ones landed: the CTS go
  if (!rig.sreq[ahead]) {
    ASSERT_TRUE(rig.send(ahead, std::chrono::seconds(5)));
  }
  if (done) rig.rreq[0] = nullptr;  // ended by that test
  ASSERT_NO_FATAL_FAILURE(rig.end_phase(0));
  // Phase 2: another thread takes the comm over (tests the phase's first receive, not yet filled:
  // nothing is written) and then waits on the other comm. This thread sends, then tries the held
  // one once a second (too few calls to look for held CTS itself, and it no longer drives them).
  ASSERT_NO_FATAL_FAILURE(rig.post_held(per_phase));
  std::atomic<bool> taken{false}, stop{false};
  std::thread driver([&] {
    int d = 0;
    ASSERT_EQ(net()->test(rig.rreq[per_phase], &d, nullptr), kSuccess);
    ASSERT_EQ(d, 0);
    taken.store(true);
    while (!stop.load()) rig.wait_elsewhere(std::chrono::milliseconds(20));
  });
  while (!taken.load()) std::this_thread::yield();
  for (int i = per_phase; i < per_phase + ahead; ++i) ASSERT_TRUE(rig.send(i, std::chrono::seconds(5))) << i;
  bool went = false;
  for (int tries = 0; !went && tries < 5; ++tries) {
    std::this_thread::sleep_for(std::chrono::seconds(1));
    went = rig.one_isend(per_phase + ahead);
  }
  stop.store(true);
  driver.join();
  ASSERT_TRUE(went) << "the thread that drives the receive comm did not write its held CTS within 5 s";
  ASSERT_NO_FATAL_FAILURE(rig.end_phase(per_phase));  // this thread drives the comm again
  rig.close();
}

// An eager message that its receive has no buffer for (a tag the receive does not hold: NCCL never
// does this, a broken peer might) fails that receive with an error, not a hang or a wrong buffer.
TEST_F(PluginTest, EagerMessageWithoutABufferOfItsTagFailsTheReceive) {
  if (!eager_on()) GTEST_SKIP() << "PONTE_NET_EAGER=0: no message goes eagerly";
  Pair p;
  ASSERT_OK(connect_pair(net(), 0, 0, &p));
  transfer(p, 64, 65536, 1, 5);
  Buffer src(net(), p.send, 100), dst(net(), p.recv, 4096);
  fill(src.data(), 100, 3);
  void* sreq = try_isend(net(), p.send, src.data(), 100, 5, src.mh(), std::chrono::milliseconds(300));
  ASSERT_NE(sreq, nullptr);
  ASSERT_OK(wait_request(net(), sreq, nullptr));
  void* data[1] = {dst.data()};
  size_t sizes[1] = {4096};
  int tags[1] = {6};
  void* mhs[1] = {dst.mh()};
  void* rreq = nullptr;
  ASSERT_OK(post_recv(net(), p.recv, 1, data, sizes, tags, mhs, &rreq));
  const NcclResult r = wait_request(net(), rreq, nullptr, std::chrono::seconds(20));
  EXPECT_NE(r, kSuccess);
  EXPECT_NE(r, kInternalError) << "the receive hung (the harness's deadline)";
  EXPECT_EQ(mismatch(dst.data(), 1, 3), 0u) << "the message landed in a buffer of another tag";
  close_pair(net(), &p);
}

// Sends 100 bytes (filled from seed) on p before their receive is posted (the receive before
// predicts it: one host buffer, tag 5), closes the send comm and gives its CLOSED time to arrive.
void send_eagerly_and_close(const Net& net, Pair* p, uint32_t seed) {
  auto src = std::make_unique<Buffer>(net, p->send, 100);
  fill(src->data(), 100, seed);
  void* sreq = try_isend(net, p->send, src->data(), 100, 5, src->mh(), std::chrono::milliseconds(300));
  ASSERT_NE(sreq, nullptr) << "the message did not go eagerly";
  ASSERT_OK(wait_request(net, sreq, nullptr));
  src.reset();  // deregistered before the close, as NCCL does
  ASSERT_EQ(net->close_send(p->send), kSuccess);
  p->send = nullptr;
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the CLOSED arrives first
}

// A send comm closed right after an eager send (the send ended: the message is the receiver's)
// counts that request as started: its receive, posted after the other end's CLOSED came, gets the
// message, and the next receive fails. On SoftRoCE (CI) the sending process had exited by then
// and such a receive failed with kPeerDead.
TEST_F(PluginTest, EagerMessageIsReceivedAfterItsSenderClosed) {
  if (!eager_on()) GTEST_SKIP() << "PONTE_NET_EAGER=0: no message goes eagerly";
  Pair p;
  ASSERT_OK(connect_pair(net(), 0, 0, &p));
  transfer(p, 64, 65536, 1, 5);
  ASSERT_NO_FATAL_FAILURE(send_eagerly_and_close(net(), &p, 9));
  Buffer dst(net(), p.recv, 4096);
  void* data[1] = {dst.data()};
  size_t sizes[1] = {4096};
  int tags[1] = {5};
  void* mhs[1] = {dst.mh()};
  void* rreq = nullptr;
  ASSERT_OK(post_recv(net(), p.recv, 1, data, sizes, tags, mhs, &rreq));
  int got[8] = {-1};
  ASSERT_OK(wait_request(net(), rreq, got, std::chrono::seconds(20)));
  EXPECT_EQ(got[0], 100);
  EXPECT_EQ(mismatch(dst.data(), 100, 9), SIZE_MAX);
  rreq = nullptr;
  NcclResult r = post_recv(net(), p.recv, 1, data, sizes, tags, mhs, &rreq);
  if (r == kSuccess) r = wait_request(net(), rreq, nullptr, std::chrono::seconds(20));
  EXPECT_NE(r, kSuccess) << "a receive the closed sender never started ended well";
  EXPECT_NE(r, kInternalError) << "the receive hung (the harness's deadline)";
  close_pair(net(), &p);
}

// A sender that closed after an eager send sent that request nothing else: a grouped receive for
// it gets the eager message's buffer and never the others. It fails within PONTE_TIMEOUT_MS of
// the CLOSED (5 s unless the ctest entry sets more), not a hang.
TEST_F(PluginTest, GroupedReceiveTheClosedSenderCouldNotFillFailsInTime) {
  if (!eager_on()) GTEST_SKIP() << "PONTE_NET_EAGER=0: no message goes eagerly";
  Pair p;
  ASSERT_OK(connect_pair(net(), 0, 0, &p));
  transfer(p, 64, 65536, 1, 5);
  ASSERT_NO_FATAL_FAILURE(send_eagerly_and_close(net(), &p, 9));
  Buffer dst0(net(), p.recv, 4096), dst1(net(), p.recv, 4096);
  void* data[2] = {dst0.data(), dst1.data()};
  size_t sizes[2] = {4096, 4096};
  int tags[2] = {5, 6};
  void* mhs[2] = {dst0.mh(), dst1.mh()};
  void* rreq = nullptr;
  const char* timeout = getenv("PONTE_TIMEOUT_MS");
  ASSERT_NE(timeout, nullptr) << "the harness sets PONTE_TIMEOUT_MS";
  NcclResult r = post_recv(net(), p.recv, 2, data, sizes, tags, mhs, &rreq);
  if (r == kSuccess)
    r = wait_request(net(), rreq, nullptr, std::chrono::milliseconds(std::stoul(timeout)) + std::chrono::seconds(15));
  EXPECT_NE(r, kSuccess) << "a receive ended well without its second buffer's message";
  EXPECT_NE(r, kInternalError) << "the receive hung (the harness's deadline)";
  close_pair(net(), &p);
}

TEST_F(PluginTest, BadInputGivesErrorsNotCrashes) {
  Handle zeros;
  void* comm = nullptr;
  DeviceHandle* dh = nullptr;
  EXPECT_NE(net()->connect(net().ctx(), 0, zeros.bytes, &comm, &dh), kSuccess);
  EXPECT_EQ(comm, nullptr);
  Handle junk;
  for (size_t i = 0; i < sizeof(junk.bytes); ++i) junk.bytes[i] = static_cast<uint8_t>(i * 37 + 1);
  EXPECT_NE(net()->connect(net().ctx(), 0, junk.bytes, &comm, &dh), kSuccess);
  void* listen = nullptr;
  Handle h;
  EXPECT_NE(net()->listen(net().ctx(), net().devices() + 3, h.bytes, &listen), kSuccess);
  EXPECT_NE(net()->listen(net().ctx(), -1, h.bytes, &listen), kSuccess);
  EXPECT_NE(net()->connect(net().ctx(), 99, h.bytes, &comm, &dh), kSuccess);
  EXPECT_NE(net()->accept(nullptr, &comm, &dh), kSuccess);
  EXPECT_NE(net()->close_send(nullptr), kSuccess);
  EXPECT_NE(net()->close_recv(&zeros), kSuccess);
  int done = 0;
  EXPECT_NE(net()->test(nullptr, &done, nullptr), kSuccess);
  EXPECT_NE(net()->test(&zeros, &done, nullptr), kSuccess);

  // A handle from a listener that was closed: connect fails (the listener refuses), in time.
  ASSERT_OK(net()->listen(net().ctx(), 0, h.bytes, &listen));
  ASSERT_OK(net()->close_listen(listen));
  NcclResult r = kSuccess;
  const auto deadline = Clock::now() + 20s;
  while (r == kSuccess && !comm && Clock::now() < deadline) {
    r = net()->connect(net().ctx(), 0, h.bytes, &comm, &dh);
    std::this_thread::yield();
  }
  EXPECT_NE(r, kSuccess) << "connect to a closed listener must fail, not hang";
  EXPECT_EQ(comm, nullptr);

  // Memory: unregistered, outside the registration, too many grouped receives, GPU memory
  // without GPUDirect.
  Pair p;
  ASSERT_OK(connect_pair(net(), 0, 0, &p));
  Buffer b(net(), p.recv, 4096);
  ASSERT_OK(b.result);
  void* mh = nullptr;
  EXPECT_NE(net()->reg_mr(p.recv, b.data(), 4096, kPtrCuda, &mh), kSuccess);
  EXPECT_NE(net()->reg_mr(p.recv, b.data(), 4096, 77, &mh), kSuccess);
  EXPECT_NE(net()->reg_mr(nullptr, b.data(), 4096, kPtrHost, &mh), kSuccess);
  // regMrDmaBuf hands the engine NCCL's dmabuf: only for GPU memory (host memory with an fd is
  // refused, not registered with the fd ignored); the host path (fd -1) works as regMr does.
  EXPECT_EQ(net()->reg_mr_dmabuf(p.recv, b.data(), 4096, kPtrHost, 0, 3, &mh), kInvalidArgument);
  EXPECT_EQ(mh, nullptr);
  ASSERT_OK(net()->reg_mr_dmabuf(p.recv, b.data(), 4096, kPtrHost, 0, -1, &mh));
  EXPECT_OK(net()->dereg_mr(p.recv, mh));
  void* req = nullptr;
  void* data[9];
  size_t sizes[9];
  int tags[9];
  void* mhs[9];
  for (int i = 0; i < 9; ++i) {
    data[i] = b.data();
    sizes[i] = 16;
    tags[i] = i;
    mhs[i] = b.mh();
  }
  EXPECT_EQ(net()->irecv(p.recv, 9, data, sizes, tags, mhs, nullptr, &req), kInvalidArgument);
  EXPECT_EQ(net()->irecv(p.recv, 0, data, sizes, tags, mhs, nullptr, &req), kInvalidArgument);
  void* no_mh[1] = {nullptr};
  EXPECT_EQ(net()->irecv(p.recv, 1, data, sizes, tags, no_mh, nullptr, &req), kInvalidArgument);
  size_t too_big[1] = {8192 + 4096};  // past the end of the (page-rounded) registration
  EXPECT_EQ(net()->irecv(p.recv, 1, data, too_big, tags, mhs, nullptr, &req), kInvalidArgument);
  EXPECT_EQ(req, nullptr);
  // Sending from unregistered memory: posted receive first, then isend without a handle.
  Buffer dst(net(), p.recv, 4096);
  void* d1[1] = {dst.data()};
  size_t s1[1] = {4096};
  int t1[1] = {1};
  void* m1[1] = {dst.mh()};
  void* rreq = nullptr;
  ASSERT_OK(post_recv(net(), p.recv, 1, d1, s1, t1, m1, &rreq));
  std::vector<uint8_t> unregistered(4096, 1);
  const auto d2 = Clock::now() + 20s;
  r = kSuccess;
  while (r == kSuccess && Clock::now() < d2) {
    r = net()->isend(p.send, unregistered.data(), 4096, 1, nullptr, nullptr, &req);
    if (req) break;
  }
  EXPECT_EQ(r, kInvalidArgument);
  EXPECT_EQ(req, nullptr);
  // The comm still works afterwards: the same receive completes from a proper send.
  Buffer src(net(), p.send, 4096);
  fill(src.data(), 4096, 77);
  void* sreq = nullptr;
  ASSERT_OK(post_send(net(), p.send, src.data(), 4096, 1, src.mh(), &sreq));
  int s = 0, rs[8] = {0};
  ASSERT_OK(wait_request(net(), sreq, &s));
  ASSERT_OK(wait_request(net(), rreq, rs));
  EXPECT_EQ(mismatch(dst.data(), 4096, 77), SIZE_MAX);
  close_pair(net(), &p);

  // And new connections still work.
  Pair q;
  ASSERT_OK(connect_pair(net(), 0, 0, &q));
  transfer(q, 12345, 12345, 9);
  close_pair(net(), &q);
}

TEST_F(PluginTest, SeveralCommsFromSeveralThreads) {
  constexpr int kThreads = 4;
  constexpr int kMessages = 40;
  std::atomic<int> failures{0};
  std::vector<std::string> errors(kThreads);
  auto worker = [&](int t) {
    Pair p;
    if (connect_pair(net(), 0, 0, &p) != kSuccess) {
      errors[t] = "connect";
      ++failures;
      return;
    }
    {
      const size_t size = 64 * 1024 * (t + 1) + t;
      Buffer src(net(), p.send, size), dst(net(), p.recv, size);
      for (int m = 0; m < kMessages && errors[t].empty(); ++m) {
        const uint32_t seed = static_cast<uint32_t>(t * 1000 + m);
        fill(src.data(), size, seed);
        void* rreq = nullptr;
        void* sreq = nullptr;
        void* data[1] = {dst.data()};
        size_t sizes[1] = {size};
        int tags[1] = {t};
        void* mhs[1] = {dst.mh()};
        int s = 0, r[8] = {0};
        if (post_recv(net(), p.recv, 1, data, sizes, tags, mhs, &rreq) != kSuccess ||
            post_send(net(), p.send, src.data(), size, t, src.mh(), &sreq) != kSuccess ||
            wait_request(net(), sreq, &s) != kSuccess || wait_request(net(), rreq, r) != kSuccess)
          errors[t] = "transfer " + std::to_string(m);
        else if (mismatch(dst.data(), size, seed) != SIZE_MAX)
          errors[t] = "data of message " + std::to_string(m);
      }
      if (!errors[t].empty()) ++failures;
    }
    close_pair(net(), &p);
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) threads.emplace_back(worker, t);
  for (auto& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) EXPECT_TRUE(errors[t].empty()) << "thread " << t << ": " << errors[t];
  EXPECT_EQ(failures.load(), 0);
}

TEST_F(PluginTest, CloseWithWorkOutstanding) {
  for (int round = 0; round < 3; ++round) {
    Pair p;
    ASSERT_OK(connect_pair(net(), 0, 0, &p, /*keep_listen=*/true));
    auto dst = std::make_unique<Buffer>(net(), p.recv, kMiB);
    auto src = std::make_unique<Buffer>(net(), p.send, kMiB);
    // Receives posted, never matched; one send in flight; a listener with a queued connection.
    for (int i = 0; i < 4; ++i) {
      void* req = nullptr;
      void* data[1] = {dst->data()};
      size_t sizes[1] = {kMiB};
      int tags[1] = {i};
      void* mhs[1] = {dst->mh()};
      ASSERT_OK(post_recv(net(), p.recv, 1, data, sizes, tags, mhs, &req));
    }
    void* sreq = nullptr;
    ASSERT_OK(post_send(net(), p.send, src->data(), kMiB, 0, src->mh(), &sreq));
    Handle h;
    void* listen2 = nullptr;
    ASSERT_OK(net()->listen(net().ctx(), 0, h.bytes, &listen2));
    void* pending_send = nullptr;
    DeviceHandle* dh = nullptr;
    ASSERT_OK(net()->connect(net().ctx(), 0, h.bytes, &pending_send, &dh));
    // Close everything with the work outstanding.
    EXPECT_OK(net()->close_send(p.send));
    EXPECT_OK(net()->close_recv(p.recv));
    EXPECT_OK(net()->close_listen(p.listen));
    EXPECT_OK(net()->close_listen(listen2));
    src.reset();
    dst.reset();
    // The abandoned connect fails (its listener is gone) or completes; it never hangs.
    NcclResult r = kSuccess;
    const auto deadline = Clock::now() + 20s;
    while (r == kSuccess && !pending_send && Clock::now() < deadline)
      r = net()->connect(net().ctx(), 0, h.bytes, &pending_send, &dh);
    EXPECT_TRUE(r != kSuccess || pending_send != nullptr) << "abandoned connect hung";
    if (pending_send) net()->close_send(pending_send);
  }
  // The plugin still makes working connections.
  Pair q;
  ASSERT_OK(connect_pair(net(), 0, 0, &q));
  transfer(q, 3 * kMiB + 1, 3 * kMiB + 1, 31);
  close_pair(net(), &q);
}

// NCCL's abort: 32 receives and 32 sends of 1 MiB in flight, every buffer deregistered and freed,
// the comms closed, then a new connection; 10 rounds. The requests may fail (they are never tested
// again, as NCCL abandons them), and so may posting them: a comm being aborted is abandoned either
// way. The plugin must not touch the freed registrations or memory (ASan), and the next connection
// must come up (issue 10, item 1). With several threads, one thread's abort can break the
// connection its neighbours share on tcp;ofi_rxm (a write into a deregistered buffer closes rxm's
// connection): the neighbour's posts may fail too, which is issue 10 item 3 (comm isolation), not
// what this test is about; each thread still has to connect again and finish its rounds.
void abort_rounds(const Net& net, int rounds, std::string* error) {
  constexpr int kBuffers = 32;
  for (int round = 0; round < rounds && error->empty(); ++round) {
    Pair p;
    if (connect_pair(net, 0, 0, &p, /*keep_listen=*/true) != kSuccess) {
      *error = "round " + std::to_string(round) + ": connect";
      close_pair(net, &p);
      return;
    }
    std::vector<uint8_t*> sbuf(kBuffers), rbuf(kBuffers);
    std::vector<void*> smh(kBuffers), rmh(kBuffers);
    for (int i = 0; i < kBuffers; ++i) {
      sbuf[i] = static_cast<uint8_t*>(std::aligned_alloc(4096, kMiB));
      rbuf[i] = static_cast<uint8_t*>(std::aligned_alloc(4096, kMiB));
      std::memset(sbuf[i], i, kMiB);
      if (net->reg_mr(p.send, sbuf[i], kMiB, kPtrHost, &smh[i]) != kSuccess ||
          net->reg_mr(p.recv, rbuf[i], kMiB, kPtrHost, &rmh[i]) != kSuccess)
        *error = "regMr";
    }
    for (int i = 0; i < kBuffers && error->empty(); ++i) {
      void* req = nullptr;
      void* data[1] = {rbuf[i]};
      size_t sizes[1] = {kMiB};
      int tags[1] = {i};
      void* mhs[1] = {rmh[i]};
      if (post_recv(net, p.recv, 1, data, sizes, tags, mhs, &req) != kSuccess) break;  // abandoned
    }
    for (int i = 0; i < kBuffers && error->empty(); ++i) {
      void* req = nullptr;
      if (post_send(net, p.send, sbuf[i], kMiB, i, smh[i], &req) != kSuccess) break;  // abandoned
    }
    // The sender hears BROKEN from the first receive deregistered; its last write to end answers
    // ACK from the engine's callback (NCCL never tests these requests again), so no deregMr may
    // wait out PONTE_TIMEOUT_MS (each used to, over shm: 32 x 5 s a round). The first one waits
    // for the ACK behind the data queued ahead of it on the connection: over udp;ofi_rxd on a
    // loaded host that took up to 4.7 s of a 10 s timeout (rxd moves data only when polled), so
    // the bound is three quarters of the timeout, not half; a wait for a lost ACK takes it all.
    const auto limit = std::chrono::milliseconds(std::atoi(std::getenv("PONTE_TIMEOUT_MS"))) * 3 / 4;
    for (int i = 0; i < kBuffers; ++i) {
      if (smh[i]) net->dereg_mr(p.send, smh[i]);
      const auto t0 = Clock::now();
      if (rmh[i]) net->dereg_mr(p.recv, rmh[i]);
      const auto waited = Clock::now() - t0;
      if (waited > std::chrono::seconds(1))  // reported: how close a loaded host comes to the bound
        std::printf("[ DEREG    ] round %d: deregMr of receive buffer %d took %lld ms\n", round, i,
                    static_cast<long long>(std::chrono::duration_cast<std::chrono::milliseconds>(waited).count()));
      if (waited > limit && error->empty())
        *error = "round " + std::to_string(round) + ": deregMr of receive buffer " + std::to_string(i) +
                 " waited more than 3/4 of PONTE_TIMEOUT_MS for the sender's ACK";
      std::free(sbuf[i]);
      std::free(rbuf[i]);
    }
    close_pair(net, &p);
  }
}

TEST_F(PluginTest, DeregisterAndCloseWithThirtyTwoSendsQueuedTenRounds) {
  std::string error;
  abort_rounds(net(), 10, &error);
  EXPECT_TRUE(error.empty()) << error;
  Pair q;
  ASSERT_OK(connect_pair(net(), 0, 0, &q));
  transfer(q, 3 * kMiB + 1, 3 * kMiB + 1, 41);
  close_pair(net(), &q);
}

TEST_F(PluginTest, DeregisterAndCloseWithSendsQueuedFromFourThreads) {
  std::vector<std::string> errors(4);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) threads.emplace_back([&, t] { abort_rounds(net(), 10, &errors[t]); });
  for (auto& th : threads) th.join();
  for (int t = 0; t < 4; ++t) EXPECT_TRUE(errors[t].empty()) << "thread " << t << ": " << errors[t];
  Pair q;
  ASSERT_OK(connect_pair(net(), 0, 0, &q));
  transfer(q, kMiB + 3, kMiB + 3, 42);
  close_pair(net(), &q);
}

// aws-ofi-nccl's functional test inflight_close, in one process: the receiving end aborts (its
// posted receives' buffers deregistered, its comm closed) while the sending end still posts. Each
// isend then hands out a request that test() fails at once: an error from isend would stop a caller
// mid-loop for the other end's abort, a NULL request forever would hang it, and a request that
// moved data would write into deregistered memory. Likewise an irecv once the sending end closed.
TEST_F(PluginTest, PostsAfterTheOtherEndAbortedFailAtTest) {
  constexpr int kBuffers = 4;
  Pair p;
  ASSERT_OK(connect_pair(net(), 0, 0, &p, /*keep_listen=*/true));
  std::vector<uint8_t*> rbuf(kBuffers);
  std::vector<void*> rmh(kBuffers);
  for (int i = 0; i < kBuffers; ++i) {
    rbuf[i] = static_cast<uint8_t*>(std::aligned_alloc(4096, kMiB));
    ASSERT_OK(net()->reg_mr(p.recv, rbuf[i], kMiB, kPtrHost, &rmh[i]));
    void* data[1] = {rbuf[i]};
    size_t cap[1] = {kMiB};
    int tags[1] = {i};
    void* mhs[1] = {rmh[i]};
    void* req = nullptr;
    ASSERT_OK(post_recv(net(), p.recv, 1, data, cap, tags, mhs, &req));
  }
  // deregMr returns once the sending end answered that it writes nothing more there.
  for (int i = 0; i < kBuffers; ++i) {
    EXPECT_OK(net()->dereg_mr(p.recv, rmh[i]));
    std::free(rbuf[i]);
  }
  EXPECT_OK(net()->close_recv(p.recv));
  p.recv = nullptr;
  {
    Buffer src(net(), p.send, kMiB);
    for (int i = 0; i < 2 * kBuffers; ++i) {
      void* req = nullptr;
      ASSERT_EQ(net()->isend(p.send, src.data(), kMiB, i % kBuffers, src.mh(), nullptr, &req), kSuccess) << "isend " << i;
      ASSERT_NE(req, nullptr) << "isend " << i << ": no request";
      int done = 0;
      EXPECT_NE(net()->test(req, &done, nullptr), kSuccess) << "isend " << i << ": its request did not fail at once";
    }
  }
  // The receiving side of another pair: a receive posted, the sending end closed; the receive fails
  // once the close is heard, and the receives posted after it fail at their first test().
  Pair q;
  ASSERT_OK(connect_pair(net(), 0, 0, &q));
  {
    Buffer dst(net(), q.recv, kMiB);
    void* data[1] = {dst.data()};
    size_t cap[1] = {kMiB};
    int tags[1] = {0};
    void* mhs[1] = {dst.mh()};
    void* first = nullptr;
    ASSERT_OK(post_recv(net(), q.recv, 1, data, cap, tags, mhs, &first));
    EXPECT_OK(net()->close_send(q.send));
    q.send = nullptr;
    int sizes[1] = {0};
    const NcclResult r = wait_request(net(), first, sizes, 20s);
    EXPECT_NE(r, kSuccess);
    EXPECT_NE(r, kInternalError) << "the receive did not end within 20 s of the sender's close";
    for (int i = 0; i < kBuffers; ++i) {
      void* req = nullptr;
      ASSERT_EQ(net()->irecv(q.recv, 1, data, cap, tags, mhs, nullptr, &req), kSuccess) << "irecv " << i;
      ASSERT_NE(req, nullptr) << "irecv " << i << ": no request";
      int done = 0;
      EXPECT_NE(net()->test(req, &done, nullptr), kSuccess) << "irecv " << i << ": its request did not fail at once";
    }
  }
  close_pair(net(), &q);
  close_pair(net(), &p);
  // The device still makes working connections.
  Pair w;
  ASSERT_OK(connect_pair(net(), 0, 0, &w));
  transfer(w, kMiB + 5, kMiB + 5, 43);
  close_pair(net(), &w);
}

// NCCL's alltoall and PXN open thousands of connections on large jobs: 4096 comms (2048 pairs)
// open at once on one device, data through some of them. The immediate table used to cap a device
// at 800 comm ids (issue 10, item 8).
TEST_F(PluginTest, FourThousandNinetySixCommsOnOneDevice) {
  PropertiesV11 props;
  ASSERT_OK(net()->get_properties(0, &props));
  EXPECT_GE(props.max_comms, 4096);
  std::vector<Pair> pairs(2048);
  for (size_t i = 0; i < pairs.size(); ++i)
    ASSERT_EQ(connect_pair(net(), 0, 0, &pairs[i]), kSuccess) << "pair " << i;
  for (size_t i = 0; i < pairs.size(); i += 255) transfer(pairs[i], 70000, 70000, static_cast<uint32_t>(i));
  transfer(pairs.back(), 5000, 5000, 99);
  for (auto& p : pairs) close_pair(net(), &p);
}

TEST_F(PluginTest, VirtualDeviceStripesOverTwoNics) {
  // Device 0 fused with itself: the engine opens the NIC twice, and writes above the stripe
  // threshold are split over both.
  VDeviceProps vp{};
  vp.ndevs = 2;
  vp.devs[0] = 0;
  vp.devs[1] = 0;
  int vdev = -1;
  const int before = net().devices();
  ASSERT_OK(net()->make_vdevice(&vdev, &vp));
  EXPECT_EQ(vdev, before);
  EXPECT_EQ(net().devices(), before + 1);
  PropertiesV11 p0, pv;
  ASSERT_OK(net()->get_properties(0, &p0));
  ASSERT_OK(net()->get_properties(vdev, &pv));
  EXPECT_EQ(pv.vprops.ndevs, 2);
  EXPECT_EQ(pv.speed, 2 * p0.speed);
  EXPECT_NE(std::string(pv.name), std::string(p0.name));
  VDeviceProps bad{};
  bad.ndevs = 5;
  EXPECT_NE(net()->make_vdevice(&vdev, &bad), kSuccess);
  bad.ndevs = 1;
  bad.devs[0] = 1000;
  EXPECT_NE(net()->make_vdevice(&vdev, &bad), kSuccess);

  Pair p;
  ASSERT_OK(connect_pair(net(), before, before, &p));
  for (size_t s : {size_t{0}, size_t{100}, kMiB + 7, 16 * kMiB}) transfer(p, s, s, 900 + static_cast<uint32_t>(s));
  close_pair(net(), &p);
}

// A flush must read through every NIC that wrote: PCIe orders a NIC's writes only before that
// NIC's own later reads, and striped data reaches a virtual device's receive buffer through all of
// its NICs. iflush used to read through one NIC (issue 10, item 6). PONTE_FLUSH_HOST=1 (set by
// main) makes the plugin flush host memory as it would GPU memory; the engine's per-NIC read
// counters, logged when the device closes, show which NICs the flushes read through.
TEST_F(PluginTest, FlushReadsThroughEveryNicOfAVirtualDevice) {
  ASSERT_STREQ(getenv("PONTE_FLUSH_HOST"), "1");
  VDeviceProps vp{};
  vp.ndevs = 2;
  int vdev = -1;
  ASSERT_OK(net()->make_vdevice(&vdev, &vp));
  constexpr int kFlushes = 3;
  {
    Pair p;
    ASSERT_OK(connect_pair(net(), vdev, vdev, &p));
    for (int i = 0; i < kFlushes; ++i) {
      const size_t size = 2 * kMiB + 128 * static_cast<size_t>(i);  // striped over both NICs
      Buffer src(net(), p.send, size), dst(net(), p.recv, size);
      ASSERT_OK(src.result);
      ASSERT_OK(dst.result);
      fill(src.data(), size, 300 + i);
      void* data[1] = {dst.data()};
      size_t sizes[1] = {size};
      int tags[1] = {1};
      void* mhs[1] = {dst.mh()};
      void* rreq = nullptr;
      void* sreq = nullptr;
      ASSERT_OK(post_recv(net(), p.recv, 1, data, sizes, tags, mhs, &rreq));
      ASSERT_OK(post_send(net(), p.send, src.data(), size, 1, src.mh(), &sreq));
      int got[8] = {-1};
      ASSERT_OK(wait_request(net(), sreq, got));
      ASSERT_OK(wait_request(net(), rreq, got));
      int flush_sizes[1] = {static_cast<int>(size)};
      void* freq = nullptr;
      ASSERT_OK(net()->iflush(p.recv, 1, data, flush_sizes, mhs, &freq));
      ASSERT_NE(freq, nullptr) << "PONTE_FLUSH_HOST=1: a host-memory flush must issue reads";
      ASSERT_OK(wait_request(net(), freq, got));
      EXPECT_EQ(mismatch(dst.data(), size, 300 + i), SIZE_MAX);
    }
    close_pair(net(), &p);
  }
  net_.reset();  // the device closes and logs its engine's per-NIC read counts
  const std::string tag = "device " + std::to_string(vdev) + " (";
  std::string counts;
  {
    std::lock_guard<std::mutex> lock(log_record().mu);
    for (const auto& l : log_record().lines) {
      const auto at = l.find("flush reads posted per NIC: ");
      if (l.find(tag) != std::string::npos && at != std::string::npos) counts = l.substr(at + 28);
    }
  }
  ASSERT_FALSE(counts.empty()) << "no per-NIC read counts logged for device " << vdev;
  EXPECT_EQ(counts, std::to_string(kFlushes) + "," + std::to_string(kFlushes))
      << "every flush must read once through each of the two NICs";
}

// NCCL_PROTO as this process started, before the plugin could set it (main records it).
std::string& user_nccl_proto() {
  static std::string v = "(unset)";
  return v;
}

// LL128 needs each 128-byte line of a write to land whole and in order. Verbs RC promises it; of
// the libfabric providers only EFA with FI_OPT_EFA_WRITE_IN_ORDER_ALIGNED_128_BYTES does. Where
// there is no promise (tcp;ofi_rxm, shm here) the plugin tells NCCL to use its Simple protocol
// (NCCL_PROTO=simple, as aws-ofi-nccl does), keeps a user's own NCCL_PROTO, and logs it once
// (issue 10, item 5).
TEST_F(PluginTest, NoByteOrderingPromiseTellsNcclToAvoidLl128) {
  const char* backend = getenv("PONTE_BACKEND");
  const char* proto = getenv("NCCL_PROTO");
  const std::string now = proto ? proto : "(unset)";
  if (backend && std::string(backend) == "verbs") {
    EXPECT_EQ(now, user_nccl_proto()) << "verbs RC orders writes: NCCL_PROTO must stay as it was";
    EXPECT_FALSE(log_record().contains("promises no 128-byte write ordering"));
    return;
  }
  const char* provider = getenv("PONTE_FABRIC_PROVIDER");
  ASSERT_TRUE(provider && std::string(provider).rfind("efa", 0) != 0)
      << "this test expects a provider without 128-byte ordering (tcp;ofi_rxm or shm)";
  if (user_nccl_proto() == "(unset)") {
    EXPECT_EQ(now, "simple");
    EXPECT_TRUE(log_record().contains("promises no 128-byte write ordering: NCCL_PROTO=simple set"));
  } else {
    EXPECT_EQ(now, user_nccl_proto()) << "a user's NCCL_PROTO is kept";
    EXPECT_TRUE(log_record().contains("was set by the user and is kept"));
  }
  // Once per process, however many inits and probes.
  Net again;
  ASSERT_OK(again.init_result);
  int lines = 0;
  {
    std::lock_guard<std::mutex> lock(log_record().mu);
    for (const auto& l : log_record().lines) lines += l.find("promises no 128-byte write ordering") != std::string::npos;
  }
  EXPECT_EQ(lines, 1);
}

TEST_F(PluginTest, FourNicDeviceConnectsThroughABootstrapGroup) {
  // Four NICs' engine address is longer than NCCL's handle holds (tcp: 106 > 104 bytes): the
  // handle names a one-NIC bootstrap group and the listener answers from the fused group.
  VDeviceProps vp{};
  vp.ndevs = 4;
  int vdev = -1;
  ASSERT_OK(net()->make_vdevice(&vdev, &vp));
  Handle h;
  void* listen = nullptr;
  ASSERT_OK(net()->listen(net().ctx(), vdev, h.bytes, &listen));
  EXPECT_EQ(h.bytes[1], 'B') << "expected a bootstrap handle for a four-NIC device";
  ASSERT_OK(net()->close_listen(listen));
  Pair p;
  ASSERT_OK(connect_pair(net(), vdev, vdev, &p));
  for (size_t s : {size_t{0}, size_t{4096}, 16 * kMiB + 3}) transfer(p, s, s, 70 + static_cast<uint32_t>(s));
  close_pair(net(), &p);
}

// NCCL v11 hands each communicator a traffic class at init (v10: at connect). Comms of two classes
// get engine peers of their own (on verbs, QPs sending in that class: the SoftRoCE run reads the
// TOS byte, tests/verbs); both move data, and a class outside 0..255 is refused at connect.
TEST(PluginTrafficClass, EachCommunicatorsClassReachesItsConnections) {
  ASSERT_NE(lib().v11, nullptr) << lib().error;
  Net plain;
  Net marked(lib().v11, 106);  // DSCP 26 (AF31), ECN 2
  ASSERT_OK(plain.init_result);
  ASSERT_OK(marked.init_result);
  for (Net* n : {&plain, &marked}) {
    Pair p;
    ASSERT_OK(connect_pair(*n, 0, 0, &p));
    transfer_on(*n, p, 5000, 5000, 9, 0);
    close_pair(*n, &p);
  }
  Net bad(lib().v11, 300);
  ASSERT_OK(bad.init_result);
  Handle h;
  void* listen = nullptr;
  ASSERT_OK(bad->listen(bad.ctx(), 0, h.bytes, &listen));
  void* send = nullptr;
  DeviceHandle* dh = nullptr;
  EXPECT_EQ(bad->connect(bad.ctx(), 0, h.bytes, &send, &dh), kInvalidArgument);
  EXPECT_EQ(send, nullptr);
  EXPECT_OK(bad->close_listen(listen));
}

// Through a bootstrap handle (a four-NIC device) the listener connects back to the sender's
// device, and that connection carries the data: it must be in the communicator's class too. The
// CONNECT carries the class (wire version 3); the listener says which class it connects back in.
TEST(PluginTrafficClass, ABootstrapConnectionIsMadeInTheCommunicatorsClass) {
  ASSERT_NE(lib().v11, nullptr) << lib().error;
  Net marked(lib().v11, 106);
  ASSERT_OK(marked.init_result);
  VDeviceProps vp{};
  vp.ndevs = 4;
  int vdev = -1;
  ASSERT_OK(marked->make_vdevice(&vdev, &vp));
  Pair p;
  ASSERT_OK(connect_pair(marked, vdev, vdev, &p));
  EXPECT_TRUE(log_record().contains("connecting back to the sender's device in traffic class 106"))
      << "the listener connected back without the sender's class";
  transfer_on(marked, p, 70000, 70000, 21, 0);
  close_pair(marked, &p);
}

TEST(PluginLifecycle, InitFinalizeReinitAndFinalizeAcceptsAFailedInit) {
  ASSERT_NE(lib().v11, nullptr) << lib().error;
  NetV11* t = lib().v11;
  EXPECT_OK(t->finalize(nullptr));  // a context from an init that failed early
  for (int round = 0; round < 2; ++round) {
    Net a(t), b(t);  // two communicators: two references
    ASSERT_OK(a.init_result);
    ASSERT_OK(b.init_result);
    ASSERT_GT(a.devices(), 0);
    Pair p;
    ASSERT_OK(connect_pair(a, 0, 0, &p));
    transfer_on(a, p, 1000, 1000, 5, 0);
    close_pair(a, &p);
  }  // both finalized: the engine closes; the next round probes again
}

// NCCL loads the plugin into the application's process (PyTorch, Python): the plugin and the
// libfabric it loads leave that process's signal handlers as they were. Debian's libfabric links
// PSM's libinfinipath, whose constructor takes these six with handlers that call exit(1): Ctrl-C
// ended a PyTorch job with status 1 and no KeyboardInterrupt (core/signal_guard.h).
std::atomic<int> g_signals_caught{0};
void count_signal(int) { g_signals_caught.fetch_add(1); }

TEST(PluginSignals, InitLeavesTheApplicationsSignalHandlers) {
  const int six[] = {SIGINT, SIGTERM, SIGSEGV, SIGBUS, SIGILL, SIGABRT};
  struct sigaction saved[6], mine = {};
  mine.sa_handler = count_signal;
  sigemptyset(&mine.sa_mask);
  for (int i = 0; i < 6; i++) ASSERT_EQ(sigaction(six[i], &mine, &saved[i]), 0);
  {
    ASSERT_NE(lib().v11, nullptr) << lib().error;
    Net net;  // init: the engine's backend loads libfabric (or libibverbs) now
    ASSERT_OK(net.init_result);
    ASSERT_GT(net.devices(), 0);
    for (int s : six) {
      struct sigaction now;
      ASSERT_EQ(sigaction(s, nullptr, &now), 0);
      EXPECT_EQ(reinterpret_cast<void*>(now.sa_handler), reinterpret_cast<void*>(count_signal)) << sigabbrev_np(s);
    }
  }
  raise(SIGINT);  // would have ended the process with status 1
  for (int i = 0; i < 1000 && g_signals_caught.load() == 0; i++) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_EQ(g_signals_caught.load(), 1);
  for (int i = 0; i < 6; i++) sigaction(six[i], &saved[i], nullptr);
}

// A process that forks after NCCL set the plugin up (a pre-forking launcher, a data-loader worker
// that ends with exit() rather than _exit()): the child's exit runs the plugin's exit teardown on
// engines whose threads stayed in the parent; it returns at once, and the parent's comms still move
// data (the child closed none of the shared endpoints).
TEST_F(PluginTest, AForkChildExitsAtOnceAndTheParentsCommsStillWork) {
  Pair p;
  ASSERT_OK(connect_pair(net(), 0, 0, &p));
  transfer(p, 4096, 4096, 21);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) std::exit(0);  // atexit handlers run: the plugin's teardown among them
  const int code = ponte::test::wait_child_exit(child, std::chrono::seconds(10));
  ASSERT_NE(code, ponte::test::kChildHung) << "the child's exit did not end within 10 s (the plugin's exit teardown)";
  EXPECT_EQ(code, 0) << "-1: killed by a signal";
  transfer(p, 1 << 20, 1 << 20, 22);
  close_pair(net(), &p);
}

// ---- other processes --------------------------------------------------------------------------

std::string join_sizes(const std::vector<size_t>& v) {
  // Appends in place: `"," + std::to_string(x)` prepends into a temporary (operator+(const char*,
  // string&&)), where GCC 12 at -O3 reports a false -Wrestrict inside std::string's memcpy.
  std::string s;
  for (size_t x : v) {
    if (!s.empty()) s += ',';
    s += std::to_string(x);
  }
  return s;
}
std::vector<size_t> split_sizes(const std::string& s) {
  std::vector<size_t> v;
  std::stringstream ss(s);
  std::string x;
  while (std::getline(ss, x, ',')) v.push_back(std::stoull(x));
  return v;
}

// Sends each size (pattern seeds 1, 2, ...) over send to a peer in role "recv", checks the size
// each send reports, then the peer's verdict on every byte and its clean exit.
// One receive of s bytes (tag 0) checked against fill(seed); "" or what went wrong.
std::string receive_verified(const Net& net, void* recv, size_t s, uint32_t seed) {
  Buffer dst(net, recv, s);
  void* data[1] = {dst.data()};
  size_t cap[1] = {s};
  int tags[1] = {0};
  void* mhs[1] = {dst.mh()};
  void* req = nullptr;
  int got[8] = {-1};
  if (post_recv(net, recv, 1, data, cap, tags, mhs, &req) != kSuccess ||
      wait_request(net, req, got) != kSuccess)
    return "receive of " + std::to_string(s);
  if (got[0] != static_cast<int>(s) || mismatch(dst.data(), s, seed) != SIZE_MAX)
    return "data of " + std::to_string(s);
  return "";
}

void send_sizes_to_receiver(const Net& net, void* send, const std::vector<size_t>& sizes, Peer& peer) {
  uint32_t seed = 1;
  for (size_t s : sizes) {
    Buffer src(net, send, s);
    fill(src.data(), s, seed++);
    void* req = nullptr;
    ASSERT_OK(post_send(net, send, src.data(), s, 0, src.mh(), &req));
    int got = -1;
    ASSERT_OK(wait_request(net, req, &got));
    EXPECT_EQ(got, static_cast<int>(s));
  }
  std::string verdict;
  ASSERT_TRUE(peer.channel().recv_str(&verdict, 120000));
  EXPECT_EQ(verdict, "ok");
  EXPECT_EQ(peer.wait_exit(30000), 0);
}

// The peer (role "recv") listens and hands us its handle; we connect from dev and send sizes.
void send_to_receiving_peer(const Net& net, int dev, const std::vector<size_t>& sizes, Peer& peer) {
  ASSERT_TRUE(peer.started());
  std::vector<uint8_t> handle;
  ASSERT_TRUE(peer.channel().recv(&handle)) << "no handle from the peer";
  ASSERT_EQ(handle.size(), kHandleMaxSize);
  void* send = nullptr;
  ASSERT_OK(connect_comm(net, dev, handle.data(), &send));
  ASSERT_NO_FATAL_FAILURE(send_sizes_to_receiver(net, send, sizes, peer));
  net->close_send(send);
}

// We listen on dev, the peer (role "send") connects and sends sizes; each is received into a
// buffer of slack bytes more and verified.
void receive_from_sending_peer(const Net& net, int dev, const std::vector<size_t>& sizes, Peer& peer,
                               size_t slack) {
  ASSERT_TRUE(peer.started());
  Handle h;
  void* listen = nullptr;
  ASSERT_OK(net->listen(net.ctx(), dev, h.bytes, &listen));
  ASSERT_TRUE(peer.channel().send(h.bytes, sizeof(h.bytes)));
  void* recv = nullptr;
  ASSERT_OK(accept_comm(net, listen, &recv));
  uint32_t seed = 1;
  for (size_t s : sizes) {
    Buffer dst(net, recv, s + slack);
    void* data[1] = {dst.data()};
    size_t cap[1] = {s + slack};
    int tags[1] = {0};
    void* mhs[1] = {dst.mh()};
    void* req = nullptr;
    ASSERT_EQ(post_recv(net, recv, 1, data, cap, tags, mhs, &req), kSuccess) << s << " bytes";
    int got[8] = {-1};
    ASSERT_EQ(wait_request(net, req, got), kSuccess) << "receive of " << s << " bytes";
    EXPECT_EQ(got[0], static_cast<int>(s));
    EXPECT_EQ(mismatch(dst.data(), s, seed++), SIZE_MAX) << s << " bytes";
  }
  std::string verdict;
  ASSERT_TRUE(peer.channel().recv_str(&verdict, 120000));
  EXPECT_EQ(verdict, "ok");
  EXPECT_EQ(peer.wait_exit(30000), 0);
  net->close_recv(recv);
  net->close_listen(listen);
}

TEST(PluginProcesses, NoDevicesUnlessTheProviderIsNamed) {
  // With the default provider (efa) and no EFA device, ponte offers no device, so NCCL falls back
  // to its own transports: init succeeds, devices() == 0.
  Peer peer({"devices"}, {"PONTE_FABRIC_PROVIDER=efa", "PONTE_BACKEND=fabric"});
  ASSERT_TRUE(peer.started());
  std::string out;
  ASSERT_TRUE(peer.channel().recv_str(&out, 60000)) << "peer did not answer";
  EXPECT_EQ(out, "init=0 devices=0");
  EXPECT_EQ(peer.wait_exit(30000), 0);
}

TEST(PluginProcesses, TwoProcessesBothDirectionsByteForByte) {
  set_test_environment();
  Net net;
  ASSERT_OK(net.init_result);
  const std::vector<size_t> sizes = {0, 1, 4096, 100000, 2 * kMiB + 5, 64 * kMiB};
  {  // The peer receives: it listens, we connect and send.
    Peer peer({"recv", join_sizes(sizes)});
    ASSERT_NO_FATAL_FAILURE(send_to_receiving_peer(net, 0, sizes, peer));
  }
  {  // The peer sends: we listen, it connects.
    Peer peer({"send", join_sizes(sizes)});
    ASSERT_NO_FATAL_FAILURE(receive_from_sending_peer(net, 0, sizes, peer, 100));
  }
}

// An initialised plugin's virtual device over its first n devices (NICs), for a process test.
void virtual_device(const Net& net, int n, int* dev) {
  ASSERT_OK(net.init_result);
  VDeviceProps vp{};
  vp.ndevs = n;
  ASSERT_OK(net->make_vdevice(dev, &vp));
}

TEST(PluginProcesses, TwoProcessesFourNicDevicesThroughBootstrap) {
  set_test_environment();
  Net net;
  int dev = -1;
  ASSERT_NO_FATAL_FAILURE(virtual_device(net, 4, &dev));
  const std::vector<size_t> sizes = {0, 5000, 3 * kMiB + 1, 16 * kMiB};
  Peer peer({"recv", join_sizes(sizes), "4"});
  ASSERT_TRUE(peer.started());
  std::vector<uint8_t> handle;
  ASSERT_TRUE(peer.channel().recv(&handle)) << "no handle from the peer";
  EXPECT_EQ(handle[1], 'B');
  void* send = nullptr;
  ASSERT_OK(connect_comm(net, dev, handle.data(), &send));
  ASSERT_NO_FATAL_FAILURE(send_sizes_to_receiver(net, send, sizes, peer));
  net->close_send(send);
}

// Sends until the peer (the receiver) is killed: the sender's isend/test fail, nothing hangs.
TEST(PluginProcesses, ReceiverKilledMidStreamFailsTheSender) {
  set_test_environment();
  Net net;
  ASSERT_OK(net.init_result);
  Peer peer({"recv_forever"});
  ASSERT_TRUE(peer.started());
  std::vector<uint8_t> handle;
  ASSERT_TRUE(peer.channel().recv(&handle));
  void* send = nullptr;
  ASSERT_OK(connect_comm(net, 0, handle.data(), &send));
  const size_t log_from = log_record().size();
  Buffer src(net, send, 4 * kMiB);
  fill(src.data(), 4 * kMiB, 3);
  int sent = 0;
  NcclResult failure = kSuccess;
  const auto end = Clock::now() + 60s;
  std::vector<void*> inflight;
  while (failure == kSuccess && Clock::now() < end) {
    if (sent == 20) peer.kill();  // mid-stream
    void* req = nullptr;
    NcclResult r = net->isend(send, src.data(), 4 * kMiB, 0, src.mh(), nullptr, &req);
    if (r != kSuccess) {
      failure = r;
      break;
    }
    if (req) {
      inflight.push_back(req);
      ++sent;
    }
    for (size_t i = 0; i < inflight.size();) {
      int done = 0, size = 0;
      r = net->test(inflight[i], &done, &size);
      if (r != kSuccess) {
        failure = r;
        break;
      }
      if (done) {
        inflight[i] = inflight.back();
        inflight.pop_back();
      } else {
        ++i;
      }
    }
  }
  EXPECT_GE(sent, 20);
  EXPECT_TRUE(failure == kRemoteError || failure == kSystemError)
      << "sender did not see the receiver die (result " << failure << ", " << sent << " sent)";
  net->close_send(send);
  // On shm a receiver killed inside its region's lock leaves the lock held (libfabric 1.17), and
  // the sender's next post there never returns: the watchdog wedges the device within
  // PONTE_TIMEOUT_MS (the error above came from that), and a wedged device takes no more work
  // (ShmWedge in tests/liveness/stopped_peer_test.cc). Then a new connection must fail at once. On
  // tcp;ofi_rxm nothing wedges, and the plugin still connects afterwards.
  const char* provider = getenv("PONTE_FABRIC_PROVIDER");
  const bool on_shm = provider && std::string(provider) == "shm";
  Pair q;
  if (log_record().contains("is wedged", log_from)) {
    ASSERT_TRUE(on_shm) << "the device wedged off shm: a provider call never returned";
    printf("[ NOTE ] shm: the killed receiver left its region lock held (libfabric 1.17); the device "
           "wedged as designed, so instead of a reconnect this checks that connecting fails at once\n");
    const auto t = Clock::now();
    EXPECT_NE(connect_pair(net, 0, 0, &q), kSuccess);
    EXPECT_LT(Clock::now() - t, 2s) << "connecting on a wedged device did not fail at once";
    return;
  }
  ASSERT_OK(connect_pair(net, 0, 0, &q));
  close_pair(net, &q);
}

// Listens on device 0, hands the peer (a sender) the handle and accepts its connection.
void accept_from_peer(const Net& net, Peer& peer, void** listen, void** recv) {
  Handle h;
  ASSERT_OK(net->listen(net.ctx(), 0, h.bytes, listen));
  ASSERT_TRUE(peer.channel().send(h.bytes, sizeof(h.bytes)));
  ASSERT_OK(accept_comm(net, *listen, recv));
}

// Receives while the peer (the sender) is killed: the pending receive fails, nothing hangs.
TEST(PluginProcesses, SenderKilledMidStreamFailsTheReceiver) {
  set_test_environment();
  Net net;
  ASSERT_OK(net.init_result);
  Peer peer({"send_forever"});
  ASSERT_TRUE(peer.started());
  void* listen = nullptr;
  void* recv = nullptr;
  ASSERT_NO_FATAL_FAILURE(accept_from_peer(net, peer, &listen, &recv));
  Buffer dst(net, recv, kMiB);
  int received = 0;
  NcclResult failure = kSuccess;
  const auto end = Clock::now() + 60s;
  while (failure == kSuccess && Clock::now() < end) {
    if (received == 10) peer.kill();
    void* data[1] = {dst.data()};
    size_t cap[1] = {kMiB};
    int tags[1] = {0};
    void* mhs[1] = {dst.mh()};
    void* req = nullptr;
    failure = post_recv(net, recv, 1, data, cap, tags, mhs, &req);
    if (failure != kSuccess) break;
    int got[8];
    failure = wait_request(net, req, got, 30s);
    if (failure == kSuccess) ++received;
  }
  EXPECT_GE(received, 10);
  EXPECT_TRUE(failure == kRemoteError || failure == kSystemError)
      << "receiver did not see the sender die (result " << failure << ")";
  net->close_recv(recv);
  net->close_listen(listen);
}

// Item 1's abort across two processes: each round the peer posts 32 receives of 1 MiB, we post 32
// sends, deregister and free every buffer and close; the peer does the same with its receives
// outstanding; then both connect again. 10 rounds; the last connection moves verified data.
TEST(PluginProcesses, TwoProcessesDeregisterAndCloseMidTransferTenRounds) {
  set_test_environment();
  Net net;
  ASSERT_OK(net.init_result);
  constexpr int kRounds = 10, kBuffers = 32;
  Peer peer({"abort_recv", std::to_string(kRounds)});
  ASSERT_TRUE(peer.started());
  for (int round = 0; round < kRounds; ++round) {
    std::vector<uint8_t> handle;
    ASSERT_TRUE(peer.channel().recv(&handle)) << "round " << round << ": no handle";
    void* send = nullptr;
    ASSERT_EQ(connect_comm(net, 0, handle.data(), &send), kSuccess) << "round " << round;
    std::vector<uint8_t*> buf(kBuffers);
    std::vector<void*> mh(kBuffers);
    for (int i = 0; i < kBuffers; ++i) {
      buf[i] = static_cast<uint8_t*>(std::aligned_alloc(4096, kMiB));
      std::memset(buf[i], i, kMiB);
      ASSERT_OK(net->reg_mr(send, buf[i], kMiB, kPtrHost, &mh[i]));
    }
    for (int i = 0; i < kBuffers; ++i) {
      void* req = nullptr;
      ASSERT_EQ(post_send(net, send, buf[i], kMiB, i, mh[i], &req), kSuccess) << "round " << round;
    }
    for (int i = 0; i < kBuffers; ++i) {
      EXPECT_OK(net->dereg_mr(send, mh[i]));
      std::free(buf[i]);
    }
    EXPECT_OK(net->close_send(send));
    ASSERT_TRUE(peer.channel().send_str("abort"));
  }
  std::vector<uint8_t> handle;
  ASSERT_TRUE(peer.channel().recv(&handle)) << "no handle for the final transfer";
  void* send = nullptr;
  ASSERT_OK(connect_comm(net, 0, handle.data(), &send));
  ASSERT_NO_FATAL_FAILURE(send_sizes_to_receiver(net, send, {kMiB + 5}, peer));
  net->close_send(send);
}

// The CTS entries (written by the receiver) and size records (by the sender) are counted by the
// other end: with PONTE_STRIPE_MIN=0 at one end only, a striped protocol write produced two
// immediates where the reader counted one, and 40 messages (more than the 32 slots) ended in a
// corrupt CTS or a hang. Protocol writes are never striped now (issue 10, item 7).
TEST(PluginProcesses, ProtocolWritesCountAloneWhenStripeSettingsDiffer) {
  set_test_environment();
  Net net;
  int dev = -1;
  ASSERT_NO_FATAL_FAILURE(virtual_device(net, 2, &dev));
  const std::vector<size_t> sizes(40, 3000);
  {  // the peer receives (writes CTS entries striped)
    Peer peer({"recv", join_sizes(sizes), "2"}, {"PONTE_STRIPE_MIN=0"});
    ASSERT_NO_FATAL_FAILURE(send_to_receiving_peer(net, dev, sizes, peer));
  }
  {  // the peer sends (writes size records striped)
    Peer peer({"send", join_sizes(sizes), "2"}, {"PONTE_STRIPE_MIN=0"});
    ASSERT_NO_FATAL_FAILURE(receive_from_sending_peer(net, dev, sizes, peer, 0));
  }
}

// A message that fills its one receive buffer in one write comes without a size record (the
// record immediate rides on the data); one the sender stripes (two immediates) or one that does
// not fill the buffer comes with a record. The sender alone decides, from its own striping: with
// PONTE_STRIPE_MIN=0 at one end only, both directions still move every byte, and each receive
// reports the size sent, whether it filled the buffer or not.
TEST(PluginProcesses, WholeBufferMessagesWithOrWithoutARecordWhateverTheStriping) {
  set_test_environment();
  Net net;
  int dev = -1;
  ASSERT_NO_FATAL_FAILURE(virtual_device(net, 2, &dev));
  const std::vector<size_t> sizes = {65536, 4097, kMiB, 5000, 4 * kMiB + 3, 65536, 1, 8 * kMiB};
  {  // we send (default striping: whole, unstriped messages go without a record) to a striping receiver
    Peer peer({"recv", join_sizes(sizes), "2"}, {"PONTE_STRIPE_MIN=0"});
    ASSERT_NO_FATAL_FAILURE(send_to_receiving_peer(net, dev, sizes, peer));
  }
  {  // the peer sends striped (every data write has two immediates: records always)
    Peer peer({"send", join_sizes(sizes), "2"}, {"PONTE_STRIPE_MIN=0"});
    ASSERT_NO_FATAL_FAILURE(receive_from_sending_peer(net, dev, sizes, peer, 0));
  }
  {  // buffers larger than the messages: never whole, records always
    Peer peer({"send", join_sizes(sizes), "2"});
    ASSERT_NO_FATAL_FAILURE(receive_from_sending_peer(net, dev, sizes, peer, 100));
  }
  {  // buffers of exactly the messages' sizes, default striping at both ends
    Peer peer({"send", join_sizes(sizes), "2"});
    ASSERT_NO_FATAL_FAILURE(receive_from_sending_peer(net, dev, sizes, peer, 0));
  }
}

// A receiver offers its inline slot (its CTS says so) and a sender takes it or not: ends that
// differ in PONTE_NET_INLINE still move every byte, both ways. A receiver that makes no offer gets
// records in record slots; one whose offer the sender declines gets the record in the inline slot
// and the data in its buffer.
TEST(PluginProcesses, InlineSettingsMayDifferBetweenTheEnds) {
  set_test_environment();
  Net net;
  ASSERT_OK(net.init_result);
  std::vector<size_t> sizes;
  for (int round = 0; round < 12; ++round)  // more than 32 messages: every inline slot twice
    for (size_t s : {size_t{1}, size_t{4096}, size_t{4097}, size_t{700}}) sizes.push_back(s);
  {  // the peer receives without inline data; we send
    Peer peer({"recv", join_sizes(sizes)}, {"PONTE_NET_INLINE=0"});
    ASSERT_NO_FATAL_FAILURE(send_to_receiving_peer(net, 0, sizes, peer));
  }
  {  // we offer the inline slot; the peer, inline off, declines it for every size
    Peer peer({"send", join_sizes(sizes)}, {"PONTE_NET_INLINE=0"});
    ASSERT_NO_FATAL_FAILURE(receive_from_sending_peer(net, 0, sizes, peer, 0));
  }
}

// Issue 10 item 2: a CONNECT or ACCEPT lost on the wire (a connection rebuild fails every message
// in flight; tcp loses what it had buffered) used to leave connect() answering "not yet" forever.
// PONTE_FAULT_DROP_RECVS=1 makes the peer's engine lose the first message that reaches it.
TEST(PluginProcesses, LostConnectIsSentAgain) {
  set_test_environment();
  Net net;
  ASSERT_OK(net.init_result);
  const std::vector<size_t> sizes = {3000, kMiB + 7};
  Peer peer({"recv", join_sizes(sizes)}, {"PONTE_FAULT_DROP_RECVS=1"});  // it loses our CONNECT
  ASSERT_NO_FATAL_FAILURE(send_to_receiving_peer(net, 0, sizes, peer));
}

TEST(PluginProcesses, LostAcceptIsSentAgain) {
  set_test_environment();
  Net net;
  ASSERT_OK(net.init_result);
  const std::vector<size_t> sizes = {3000, kMiB + 7};
  Peer peer({"send", join_sizes(sizes)}, {"PONTE_FAULT_DROP_RECVS=1"});  // it loses our ACCEPT
  ASSERT_NO_FATAL_FAILURE(receive_from_sending_peer(net, 0, sizes, peer, 0));
}

// Issue 10 item 3: NCCL's abort on the receiving side (mode "dereg": deregMr of buffers whose
// receives are posted; mode "close": closeRecv with receives posted) while this side holds their
// CTS. A write into them would hit deregistered memory and break the connection that every comm
// of the two devices shares (rxm drops it; an RC QP goes to error). Now the receiver's end tells
// this end first and waits for its answer: our sends on that comm are refused, never written, and
// the neighbour comm B carries verified data in both directions afterwards. (Refused: isend fails, or
// hands out a request whose first test() fails: refused_at_once.)
void abort_beside_a_neighbour(const char* mode) {
  set_test_environment();
  Net net;
  ASSERT_OK(net.init_result);
  const std::vector<size_t> sizes = {0, 5000, 3 * kMiB + 1};
  Peer peer({"isolation_recv", mode, join_sizes(sizes)});
  ASSERT_TRUE(peer.started());
  void* comm[2] = {nullptr, nullptr};  // A (aborted by the peer), B (its neighbour)
  for (void*& c : comm) {
    std::vector<uint8_t> handle;
    ASSERT_TRUE(peer.channel().recv(&handle)) << "no handle from the peer";
    ASSERT_OK(connect_comm(net, 0, handle.data(), &c));
  }
  std::string msg;
  ASSERT_TRUE(peer.channel().recv_str(&msg, 60000) && msg == "posted") << msg;
  // The peer aborts A while we hold its CTS; it reports once it is done (deregMr / closeRecv
  // returned: its buffers may be gone).
  auto src = std::make_unique<Buffer>(net, comm[0], kMiB);
  ASSERT_TRUE(peer.channel().send_str("abort"));
  ASSERT_TRUE(peer.channel().recv_str(&msg, 60000) && msg == "aborted") << msg;
  NcclResult r = kSuccess;
  void* req = nullptr;
  const auto deadline = Clock::now() + 10s;
  while (r == kSuccess && !req && Clock::now() < deadline)
    r = net->isend(comm[0], src->data(), kMiB, 0, src->mh(), nullptr, &req);
  const bool refused = refused_at_once(net, r, req);
  EXPECT_TRUE(refused) << "a send on the aborted comm " << (req ? "was written into the peer's "
                          "deregistered receive buffer" : "neither failed nor started: it waits forever");
  if (req && !refused) {  // written anyway (the failure above): let it end before the buffer goes
    int got = 0;
    wait_request(net, req, &got, 20s);
  }
  ASSERT_NO_FATAL_FAILURE(send_sizes_to_receiver(net, comm[1], sizes, peer));
  src.reset();
  EXPECT_OK(net->close_send(comm[0]));
  EXPECT_OK(net->close_send(comm[1]));
}

TEST(PluginProcesses, ReceiverDeregisteringPostedBuffersBreaksNoNeighbour) {
  abort_beside_a_neighbour("dereg");
}
TEST(PluginProcesses, ReceiverClosingWithReceivesPostedBreaksNoNeighbour) {
  abort_beside_a_neighbour("close");
}

// An ACK that finds no control buffer free (64 in flight: a deregMr from several threads at once
// retells BROKEN to many comms) is owed, and the receiver's next BROKEN gets it. The peer sends;
// its first three ACKs are refused (PONTE_FAULT_BUSY_ACKS=3). We post 8 receives whose CTS it
// holds, then deregister them: deregMr tells the sender BROKEN, again every 50 ms, and returns
// once the fourth try is answered. An ACK left marked sent when it was not made the sender ignore
// every retell, and deregMr waited out PONTE_TIMEOUT_MS.
TEST(PluginProcesses, AckThatFoundNoControlBufferIsSentAgain) {
  set_test_environment();
  Net net;
  ASSERT_OK(net.init_result);
  Peer peer({"hold_cts"}, {"PONTE_FAULT_BUSY_ACKS=3"});
  ASSERT_TRUE(peer.started());
  void* listen = nullptr;
  void* recv = nullptr;
  ASSERT_NO_FATAL_FAILURE(accept_from_peer(net, peer, &listen, &recv));
  std::string msg;
  ASSERT_TRUE(peer.channel().recv_str(&msg, 60000) && msg == "connected") << msg;
  constexpr int kBuffers = 8;
  std::vector<uint8_t*> buf(kBuffers);
  std::vector<void*> mh(kBuffers);
  for (int i = 0; i < kBuffers; ++i) {
    buf[i] = static_cast<uint8_t*>(std::aligned_alloc(4096, kMiB));
    ASSERT_OK(net->reg_mr(recv, buf[i], kMiB, kPtrHost, &mh[i]));
    void* data[1] = {buf[i]};
    size_t cap[1] = {kMiB};
    int tags[1] = {i};
    void* mhs[1] = {mh[i]};
    void* req = nullptr;
    ASSERT_OK(post_recv(net, recv, 1, data, cap, tags, mhs, &req));
  }
  const auto t0 = Clock::now();
  for (int i = 0; i < kBuffers; ++i) EXPECT_OK(net->dereg_mr(recv, mh[i]));
  const auto took = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0);
  const auto limit = std::chrono::milliseconds(std::atoi(std::getenv("PONTE_TIMEOUT_MS"))) / 2;
  EXPECT_LT(took, limit) << "deregMr waited for the sender's ACK as if it were never sent again";
  ASSERT_TRUE(peer.channel().send_str("aborted"));
  ASSERT_TRUE(peer.channel().recv_str(&msg, 60000));
  EXPECT_EQ(msg, "ok");
  EXPECT_OK(net->close_recv(recv));
  EXPECT_OK(net->close_listen(listen));
  for (uint8_t* b : buf) std::free(b);
}

TEST(PluginProcesses, V8TableMovesData) {
  // v8 (NCCL 2.19-2.21) takes a reference that is never finalized: run it in its own process.
  Peer peer({"v8"});
  ASSERT_TRUE(peer.started());
  std::string out;
  ASSERT_TRUE(peer.channel().recv_str(&out, 120000));
  EXPECT_EQ(out, "ok");
  EXPECT_EQ(peer.wait_exit(30000), 0);
}

// ---- peer roles (this binary started with --ponte-peer) ---------------------------------------


int peer_main(int argc, char** argv) {
  set_test_environment();
  Channel ch(3);
  const std::string role = argc > 2 ? argv[2] : "";
  auto fail = [&](const std::string& why) {
    ch.send_str(why);
    return 1;
  };
  if (role == "devices") {
    Net net;
    ch.send_str("init=" + std::to_string(net.init_result) + " devices=" + std::to_string(net.devices()));
    return 0;
  }
  if (role == "v8") {
    NetV8* t = lib().v8;
    if (!t || t->init(&test_logger) != kSuccess) return fail("v8 init");
    int n = 0;
    if (t->devices(&n) != kSuccess || n < 1) return fail("v8 devices");
    PropertiesV8 props;
    if (t->get_properties(0, &props) != kSuccess || props.max_recvs != 8) return fail("v8 props");
    Handle h;
    void* listen = nullptr;
    void* send = nullptr;
    void* recv = nullptr;
    DeviceHandle* dh = nullptr;
    if (t->listen(0, h.bytes, &listen) != kSuccess) return fail("v8 listen");
    const auto deadline = Clock::now() + kDeadline;
    while ((!send || !recv) && Clock::now() < deadline) {
      if (!send && t->connect(0, h.bytes, &send, &dh) != kSuccess) return fail("v8 connect");
      if (!recv && t->accept(listen, &recv, &dh) != kSuccess) return fail("v8 accept");
    }
    if (!send || !recv) return fail("v8 connect timeout");
    std::vector<uint8_t> a(100000), b(100000 + 10);
    fill(a.data(), a.size(), 42);
    void* ma = nullptr;
    void* mb = nullptr;
    if (t->reg_mr(send, a.data(), a.size(), kPtrHost, &ma) != kSuccess ||
        t->reg_mr(recv, b.data(), b.size(), kPtrHost, &mb) != kSuccess)
      return fail("v8 regMr");
    void* data[1] = {b.data()};
    int sizes[1] = {static_cast<int>(b.size())};
    int tags[1] = {1};
    void* mhs[1] = {mb};
    void* rreq = nullptr;
    void* sreq = nullptr;
    while (!rreq && Clock::now() < deadline)
      if (t->irecv(recv, 1, data, sizes, tags, mhs, &rreq) != kSuccess) return fail("v8 irecv");
    while (!sreq && Clock::now() < deadline)
      if (t->isend(send, a.data(), static_cast<int>(a.size()), 1, ma, &sreq) != kSuccess)
        return fail("v8 isend");
    int done = 0, got = 0;
    while (!done && Clock::now() < deadline)
      if (t->test(sreq, &done, &got) != kSuccess) return fail("v8 test send");
    done = 0;
    int rgot[8] = {0};
    while (!done && Clock::now() < deadline)
      if (t->test(rreq, &done, rgot) != kSuccess) return fail("v8 test recv");
    if (!done || rgot[0] != static_cast<int>(a.size())) return fail("v8 size");
    if (mismatch(b.data(), a.size(), 42) != SIZE_MAX) return fail("v8 data");
    if (t->isend(send, a.data(), -1, 1, ma, &sreq) == kSuccess) return fail("v8 negative size");
    t->dereg_mr(send, ma);
    t->dereg_mr(recv, mb);
    t->close_send(send);
    t->close_recv(recv);
    t->close_listen(listen);
    ch.send_str("ok");
    return 0;
  }
  Net net;
  if (net.init_result != kSuccess || net.devices() < 1) return fail("init");
  if (role == "recv" || role == "recv_forever") {
    // Optional argv[4]: listen on a device fused from that many NICs.
    int dev = 0;
    if (argc > 4 && std::atoi(argv[4]) > 1) {
      VDeviceProps vp{};
      vp.ndevs = std::atoi(argv[4]);
      if (net->make_vdevice(&dev, &vp) != kSuccess) return fail("makeVDevice");
    }
    Handle h;
    void* listen = nullptr;
    if (net->listen(net.ctx(), dev, h.bytes, &listen) != kSuccess) return fail("listen");
    ch.send(h.bytes, sizeof(h.bytes));
    void* recv = nullptr;
    if (accept_comm(net, listen, &recv) != kSuccess) return fail("accept");
    if (role == "recv_forever") {  // receive until killed
      Buffer dst(net, recv, 4 * kMiB);
      for (;;) {
        void* data[1] = {dst.data()};
        size_t cap[1] = {4 * kMiB};
        int tags[1] = {0};
        void* mhs[1] = {dst.mh()};
        void* req = nullptr;
        if (post_recv(net, recv, 1, data, cap, tags, mhs, &req) != kSuccess) return 1;
        int got[8];
        if (wait_request(net, req, got, 120s) != kSuccess) return 1;
      }
    }
    uint32_t seed = 1;
    for (size_t s : split_sizes(argv[3])) {
      const std::string error = receive_verified(net, recv, s, seed++);
      if (!error.empty()) return fail(error);
    }
    net->close_recv(recv);
    net->close_listen(listen);
    ch.send_str("ok");
    return 0;
  }
  if (role == "isolation_recv") {  // see abort_beside_a_neighbour
    const std::string mode = argv[3];
    Handle h;
    void* listen = nullptr;
    if (net->listen(net.ctx(), 0, h.bytes, &listen) != kSuccess) return fail("listen");
    void* recv[2] = {nullptr, nullptr};
    for (void*& r : recv) {
      ch.send(h.bytes, sizeof(h.bytes));
      if (accept_comm(net, listen, &r) != kSuccess) return fail("accept");
    }
    constexpr int kBuffers = 8;
    std::vector<uint8_t*> buf(kBuffers);
    std::vector<void*> mh(kBuffers);
    for (int i = 0; i < kBuffers; ++i) {
      buf[i] = static_cast<uint8_t*>(std::aligned_alloc(4096, kMiB));
      if (net->reg_mr(recv[0], buf[i], kMiB, kPtrHost, &mh[i]) != kSuccess) return fail("regMr");
      void* data[1] = {buf[i]};
      size_t cap[1] = {kMiB};
      int tags[1] = {0};
      void* mhs[1] = {mh[i]};
      void* req = nullptr;
      if (post_recv(net, recv[0], 1, data, cap, tags, mhs, &req) != kSuccess) return fail("irecv");
    }
    ch.send_str("posted");
    std::string go;
    if (!ch.recv_str(&go, 120000) || go != "abort") return fail("no abort");
    if (mode == "close") net->close_recv(recv[0]);
    for (int i = 0; i < kBuffers; ++i) {
      net->dereg_mr(recv[0], mh[i]);
      std::memset(buf[i], 0xee, kMiB);  // reused at once, as freed memory would be
    }
    if (mode != "close") net->close_recv(recv[0]);
    ch.send_str("aborted");
    uint32_t seed = 1;
    for (size_t s : split_sizes(argv[4])) {
      const std::string error = receive_verified(net, recv[1], s, seed++);
      if (!error.empty()) return fail("neighbour: " + error);
    }
    for (int i = 0; i < kBuffers; ++i)
      for (size_t j = 0; j < kMiB; ++j)
        if (buf[i][j] != 0xee) return fail("a write landed in a deregistered receive buffer");
    for (uint8_t* b : buf) std::free(b);
    net->close_recv(recv[1]);
    net->close_listen(listen);
    ch.send_str("ok");
    return 0;
  }
  if (role == "abort_recv") {  // see TwoProcessesDeregisterAndCloseMidTransferTenRounds
    constexpr int kBuffers = 32;
    const int rounds = std::atoi(argv[3]);
    for (int round = 0; round <= rounds; ++round) {
      Handle h;
      void* listen = nullptr;
      if (net->listen(net.ctx(), 0, h.bytes, &listen) != kSuccess) return fail("listen");
      ch.send(h.bytes, sizeof(h.bytes));
      void* recv = nullptr;
      if (accept_comm(net, listen, &recv) != kSuccess) return fail("accept " + std::to_string(round));
      if (round == rounds) {  // the final, verified transfer
        const std::string error = receive_verified(net, recv, kMiB + 5, 1);
        if (!error.empty()) return fail("final " + error);
        net->close_recv(recv);
        net->close_listen(listen);
        break;
      }
      std::vector<uint8_t*> buf(kBuffers);
      std::vector<void*> mh(kBuffers);
      for (int i = 0; i < kBuffers; ++i) {
        buf[i] = static_cast<uint8_t*>(std::aligned_alloc(4096, kMiB));
        if (net->reg_mr(recv, buf[i], kMiB, kPtrHost, &mh[i]) != kSuccess) return fail("regMr");
        void* data[1] = {buf[i]};
        size_t cap[1] = {kMiB};
        int tags[1] = {i};
        void* mhs[1] = {mh[i]};
        void* req = nullptr;
        if (post_recv(net, recv, 1, data, cap, tags, mhs, &req) != kSuccess) return fail("irecv");
      }
      std::string go;
      if (!ch.recv_str(&go, 120000) || go != "abort") return fail("no abort");
      for (int i = 0; i < kBuffers; ++i) {
        net->dereg_mr(recv, mh[i]);
        std::free(buf[i]);
      }
      net->close_recv(recv);
      net->close_listen(listen);
    }
    ch.send_str("ok");
    return 0;
  }
  if (role == "hold_cts") {  // see AckThatFoundNoControlBufferIsSentAgain
    std::vector<uint8_t> handle;
    if (!ch.recv(&handle) || handle.size() != kHandleMaxSize) return fail("handle");
    void* send = nullptr;
    if (connect_comm(net, 0, handle.data(), &send) != kSuccess) return fail("connect");
    ch.send_str("connected");
    std::string go;
    if (!ch.recv_str(&go, 120000) || go != "aborted") return fail("no abort");
    {
      Buffer src(net, send, kMiB);
      NcclResult r = kSuccess;
      void* req = nullptr;
      const auto deadline = Clock::now() + 10s;
      while (r == kSuccess && !req && Clock::now() < deadline)
        r = net->isend(send, src.data(), kMiB, 0, src.mh(), nullptr, &req);
      if (!refused_at_once(net, r, req))
        return fail(req ? "a send on the aborted comm was written" : "a send on the aborted comm never failed");
    }
    if (!log_record().contains("could not answer a close or failure notice yet"))
      return fail("no ACK was held back: PONTE_FAULT_BUSY_ACKS had no effect");
    net->close_send(send);
    ch.send_str("ok");
    return 0;
  }
  if (role == "send" || role == "send_forever") {
    std::vector<uint8_t> handle;
    if (!ch.recv(&handle) || handle.size() != kHandleMaxSize) return fail("handle");
    int dev = 0;  // optional argv[4]: connect from a device fused from that many NICs
    if (argc > 4 && std::atoi(argv[4]) > 1) {
      VDeviceProps vp{};
      vp.ndevs = std::atoi(argv[4]);
      if (net->make_vdevice(&dev, &vp) != kSuccess) return fail("makeVDevice");
    }
    void* send = nullptr;
    if (connect_comm(net, dev, handle.data(), &send) != kSuccess) return fail("connect");
    if (role == "send_forever") {
      Buffer src(net, send, kMiB);
      for (;;) {
        void* req = nullptr;
        int got = 0;
        if (post_send(net, send, src.data(), kMiB, 0, src.mh(), &req) != kSuccess ||
            wait_request(net, req, &got, 120s) != kSuccess)
          return 1;
      }
    }
    uint32_t seed = 1;
    for (size_t s : split_sizes(argv[3])) {
      Buffer src(net, send, s);
      fill(src.data(), s, seed++);
      void* req = nullptr;
      int got = -1;
      if (post_send(net, send, src.data(), s, 0, src.mh(), &req) != kSuccess ||
          wait_request(net, req, &got) != kSuccess || got != static_cast<int>(s))
        return fail("send of " + std::to_string(s));
    }
    net->close_send(send);
    ch.send_str("ok");
    return 0;
  }
  return fail("unknown role " + role);
}

}  // namespace

int main(int argc, char** argv) {
  if (const char* proto = getenv("NCCL_PROTO")) user_nccl_proto() = proto;
  set_test_environment();
  setenv("PONTE_FLUSH_HOST", "1", 1);  // FlushReadsThroughEveryNicOfAVirtualDevice; no other test flushes
  if (argc > 1 && std::string(argv[1]) == "--ponte-peer") return peer_main(argc, argv);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
