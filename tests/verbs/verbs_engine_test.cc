// The engine over verbs between SoftRoCE devices of the tests/softroce guest, several engines in this
// process (node A on rxe0, node B on rxe1): what only shows through the engine's own use of the
// backend. GPU memory never goes inline (issue 10 item 4), the receive queue holds an incast while
// the target's worker cannot poll (item 9), a connection's traffic class and its several QPs are
// seen on the wire (item 11), read from the RoCE v2 packets themselves with a packet socket.
// Outside the guest every test skips and says why.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <linux/if_ether.h>
#include <linux/if_packet.h>
#include <netinet/in.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "core/engine.h"
#include "tests/common/completion_counter.h"

namespace ponte {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

bool in_guest() {
  const char* g = getenv("PONTE_RXE_GUEST");
  return g != nullptr && strcmp(g, "1") == 0;
}

std::string first_of(const char* list_var, const char* fallback) {
  const char* v = getenv(list_var);
  std::string s = v != nullptr && *v != 0 ? v : fallback;
  return s.substr(0, s.find(','));
}

uint8_t pattern(uint32_t seed, size_t i) { return static_cast<uint8_t>(seed * 131 + i * 7 + (i >> 9)); }
void fill(uint8_t* p, size_t len, uint32_t seed) {
  for (size_t i = 0; i < len; i++) p[i] = pattern(seed, i);
}
bool holds(const uint8_t* p, size_t len, uint32_t seed) {
  for (size_t i = 0; i < len; i++)
    if (p[i] != pattern(seed, i)) return false;
  return true;
}

// RoCE v2 packets seen on any interface while it runs (a packet socket: the guest runs as root).
// Each packet is seen twice, leaving one veth and entering the other.
class RoceSniffer {
 public:
  struct Packet {
    uint32_t src = 0, dst = 0;  // IPv4, network order
    uint8_t tos = 0;            // DSCP and ECN: the QP's traffic class
    uint16_t sport = 0;         // UDP source port: rxe derives it from the sending QP
    uint32_t dest_qp = 0;       // from the BTH
  };
  ~RoceSniffer() { stop(); }
  bool start(std::string* err) {
    fd_ = socket(AF_PACKET, SOCK_DGRAM, htons(ETH_P_IP));
    if (fd_ < 0) {
      *err = std::string("packet socket: ") + strerror(errno);
      return false;
    }
    timeval tv{0, 20000};
    setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    int big = 8 << 20;
    setsockopt(fd_, SOL_SOCKET, SO_RCVBUF, &big, sizeof(big));
    run_ = true;
    thread_ = std::thread([this] { loop(); });
    return true;
  }
  void stop() {
    run_ = false;
    if (thread_.joinable()) thread_.join();
    if (fd_ >= 0) close(fd_);
    fd_ = -1;
  }
  std::vector<Packet> take() {
    std::lock_guard<std::mutex> lock(mu_);
    return std::move(packets_);
  }

 private:
  void loop() {
    uint8_t buf[2048];
    while (run_) {
      ssize_t n = recv(fd_, buf, sizeof(buf), 0);
      if (n < 20 || (buf[0] >> 4) != 4 || buf[9] != IPPROTO_UDP) continue;
      size_t ihl = static_cast<size_t>(buf[0] & 0xf) * 4;
      if (static_cast<size_t>(n) < ihl + 8 + 12) continue;
      const uint8_t* udp = buf + ihl;
      if (((udp[2] << 8) | udp[3]) != 4791) continue;
      Packet p;
      memcpy(&p.src, buf + 12, 4);
      memcpy(&p.dst, buf + 16, 4);
      p.tos = buf[1];
      p.sport = static_cast<uint16_t>((udp[0] << 8) | udp[1]);
      const uint8_t* bth = udp + 8;
      p.dest_qp = (uint32_t{bth[5]} << 16) | (uint32_t{bth[6]} << 8) | bth[7];
      std::lock_guard<std::mutex> lock(mu_);
      if (packets_.size() < 200000) packets_.push_back(p);
    }
  }
  int fd_ = -1;
  std::atomic<bool> run_{false};
  std::thread thread_;
  std::mutex mu_;
  std::vector<Packet> packets_;
};

// Counts the ends of many operations.
using Counter = ponte::test::CompletionCounter;

class VerbsEngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    cfg_ = global_config();
    cfg_.backend = BackendChoice::kVerbs;
    cfg_.ib_hca = "";
    cfg_.ctrl_addr = "127.0.0.1";
    cfg_.timeout_ms = 30000;  // SoftRoCE under QEMU is slow
    auto b = open_verbs_backend(cfg_);
    if (!b.ok()) {
      if (in_guest()) FAIL() << "no verbs backend inside the SoftRoCE guest: " << b.status().message();
      GTEST_SKIP() << "needs SoftRoCE devices (run tests/softroce/run-suite BUILD_DIR): " << b.status().message();
    }
    dev_a_ = first_of("PONTE_RXE_DEVS_A", "rxe0");
    dev_b_ = first_of("PONTE_RXE_DEVS_B", "rxe1");
    for (size_t i = 0; i < (*b)->devices().size(); i++) {
      if ((*b)->devices()[i].name == dev_a_ + ":1") index_a_ = static_cast<int>(i);
      if ((*b)->devices()[i].name == dev_b_ + ":1") index_b_ = static_cast<int>(i);
    }
    ASSERT_GE(index_a_, 0) << dev_a_;
    ASSERT_GE(index_b_, 0) << dev_b_;
  }

  // An engine of one group: one NIC, node A's or node B's.
  std::unique_ptr<Engine> engine(char node, const Config* cfg = nullptr) {
    EngineOptions o;
    o.config = cfg != nullptr ? *cfg : cfg_;
    o.groups = {{static_cast<size_t>(node == 'A' ? index_a_ : index_b_)}};
    auto e = Engine::create(o);
    EXPECT_TRUE(e.ok()) << e.status().message();
    return e.ok() ? std::move(e).value() : nullptr;
  }

  // from connects to to; returns from's peer id and sets *back to to's id for from.
  PeerId connect(Engine& from, Engine& to, PeerId* back, const ConnectOptions& opts = {}) {
    const size_t known = to.peers(0).size();
    auto id = from.connect(0, to.address(0), opts);
    EXPECT_TRUE(id.ok()) << id.status().message();
    if (!id.ok()) return kAnyPeer;
    auto deadline = Clock::now() + 20s;
    while (Clock::now() < deadline) {
      auto in = to.peers(0);
      if (from.peer_ready(0, *id) && in.size() > known && to.peer_ready(0, in.back())) {
        *back = in.back();
        return *id;
      }
      std::this_thread::sleep_for(1ms);
    }
    ADD_FAILURE() << "handshake did not complete";
    return kAnyPeer;
  }

  static uint32_t ip_of(const std::string& dev) {
    const char* v = getenv(("PONTE_RXE_IP_" + dev).c_str());
    in_addr a{};
    if (v == nullptr || inet_pton(AF_INET, v, &a) != 1) return 0;
    return a.s_addr;
  }

  Config cfg_;
  std::string dev_a_, dev_b_;
  int index_a_ = -1, index_b_ = -1;
};

// ---------------------------------------------------------------------------- issue 10, item 4
// Writes and sends of at most max_inline bytes from memory registered as GPU memory: inline would
// make the provider memcpy it on the CPU (a SIGSEGV on cudaMalloc memory). Here host pages stand in
// for it, registered as MemKind::kCuda (without CUDA the engine registers them through the
// peer-memory path, as they are) and then made inaccessible to the CPU: rxe still reads them
// through the kernel, any CPU copy faults. Before the fix this test died of SIGSEGV.
TEST_F(VerbsEngineTest, GpuMemoryNeverGoesInline) {
  auto a = engine('A');
  auto b = engine('B');
  ASSERT_TRUE(a && b);
  PeerId b_to_a = kAnyPeer;
  PeerId to_b = connect(*a, *b, &b_to_a);
  ASSERT_NE(to_b, kAnyPeer);
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t len = 2 * page;
  void* mem = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(mem, MAP_FAILED);
  auto* gpu = static_cast<uint8_t*>(mem);
  fill(gpu, len, 44);
  auto src = a->register_memory(0, gpu, len, MemKind::kCuda, 0);
  ASSERT_TRUE(src.ok()) << src.status().message();
  ASSERT_EQ(src->kind, MemKind::kCuda);
  std::vector<uint8_t> dst_buf(len, 0);
  auto dst = b->register_memory(0, dst_buf.data(), len);
  ASSERT_TRUE(dst.ok()) << dst.status().message();
  struct Got {
    std::mutex mu;
    std::vector<uint8_t> bytes;
    std::atomic<int> n{0};
  } got;
  b->set_recv_handler(0, [](void* arg, PeerId, std::span<const uint8_t> data) {
    auto* g = static_cast<Got*>(arg);
    std::lock_guard<std::mutex> lock(g->mu);
    g->bytes.assign(data.begin(), data.end());
    g->n++;
  }, &got);
  ASSERT_EQ(mprotect(mem, len, PROT_NONE), 0);

  const size_t max_inline = a->nic_info(0, 0).max_inline;
  ASSERT_GT(max_inline, 0u) << "rxe sends inline: the test needs it to mean something";
  const std::vector<size_t> sizes = {1, 8, 64, max_inline};
  Counter c;
  RemoteRegion r = dst->remote();
  size_t off = 0;
  for (size_t i = 0; i < sizes.size(); i++, off += 512) {
    uint32_t v = 0x4400 + static_cast<uint32_t>(i);
    ASSERT_TRUE(a->write(0, to_b, LocalSlice{&*src, off, sizes[i]}, r, off, i % 2 ? &v : nullptr, c.notify()).ok());
  }
  ASSERT_TRUE(a->send(0, to_b, LocalSlice{&*src, page, 48}, c.notify()).ok());
  const int total = static_cast<int>(sizes.size()) + 1;
  EXPECT_TRUE(c.wait_total(total, 30s)) << c.ok << " of " << total;
  EXPECT_EQ(c.failed, 0);
  auto deadline = Clock::now() + 20s;
  while (got.n == 0 && Clock::now() < deadline) std::this_thread::sleep_for(1ms);
  ASSERT_EQ(mprotect(mem, len, PROT_READ | PROT_WRITE), 0);

  std::vector<uint8_t> want(len);
  fill(want.data(), len, 44);
  off = 0;
  for (size_t i = 0; i < sizes.size(); i++, off += 512)
    EXPECT_EQ(memcmp(dst_buf.data() + off, want.data() + off, sizes[i]), 0) << sizes[i] << " B";
  ASSERT_EQ(got.n, 1);
  {
    std::lock_guard<std::mutex> lock(got.mu);
    ASSERT_EQ(got.bytes.size(), 48u);
    EXPECT_EQ(memcmp(got.bytes.data(), want.data() + page, 48), 0);
  }
  b->set_recv_handler(0, nullptr, nullptr);
  EXPECT_TRUE(a->deregister(*src).ok());
  EXPECT_TRUE(b->deregister(*dst).ok());
  munmap(mem, len);
}

// ---------------------------------------------------------------------------- issue 10, item 9
// An incast of write-with-immediates toward one target: each consumes one of the target's posted
// receives until its worker polls and gives it back. The target's worker is held inside a receive
// handler, so it polls nothing: every write must still be acknowledged, because the engine keeps
// the whole receive queue posted (PONTE_RECV_COUNT, 512 by default). Before the fix it posted 128:
// the 128th write stalled on RNR until the worker came back, and the senders' completions stopped
// there. Then everything is verified: the data and each sender's count of immediates.
TEST_F(VerbsEngineTest, IncastFitsTheReceiveQueueWhileTheTargetIsBusy) {
  constexpr int kSenders = 3;
  constexpr int kEach = 150;  // 450 in flight toward one NIC: more than 128, fewer than 511
  constexpr size_t kLen = 256;
  auto target = engine('B');
  ASSERT_TRUE(target);
  std::vector<std::unique_ptr<Engine>> senders;
  std::vector<PeerId> to_target, from;
  for (int s = 0; s < kSenders; s++) {
    senders.push_back(engine('A'));
    ASSERT_TRUE(senders.back());
    PeerId back = kAnyPeer;
    to_target.push_back(connect(*senders.back(), *target, &back));
    ASSERT_NE(to_target.back(), kAnyPeer);
    from.push_back(back);
  }
  std::vector<uint8_t> dst_buf(kSenders * kEach * kLen, 0);
  auto dst = target->register_memory(0, dst_buf.data(), dst_buf.size());
  ASSERT_TRUE(dst.ok()) << dst.status().message();
  const RemoteRegion r = dst->remote();
  std::vector<std::vector<uint8_t>> src_bufs(kSenders);
  std::vector<MemoryRegion> srcs;
  for (int s = 0; s < kSenders; s++) {
    src_bufs[s].resize(kEach * kLen);
    fill(src_bufs[s].data(), src_bufs[s].size(), 100 + s);
    auto m = senders[s]->register_memory(0, src_bufs[s].data(), src_bufs[s].size());
    ASSERT_TRUE(m.ok()) << m.status().message();
    srcs.push_back(*m);
  }

  // Hold the target's worker: a receive handler that waits until released.
  struct Hold {
    std::atomic<bool> entered{false}, release{false};
  } hold;
  target->set_recv_handler(0, [](void* arg, PeerId, std::span<const uint8_t>) {
    auto* h = static_cast<Hold*>(arg);
    h->entered = true;
    auto deadline = Clock::now() + 60s;
    while (!h->release && Clock::now() < deadline) std::this_thread::sleep_for(100us);
  }, &hold);
  struct Release {
    Hold* h;
    ~Release() { h->release = true; }
  } release_on_exit{&hold};
  Flag sent;
  ASSERT_TRUE(senders[0]->send(0, to_target[0], LocalSlice{&srcs[0], 0, 8}, sent.notify()).ok());
  auto deadline = Clock::now() + 20s;
  while (!hold.entered && Clock::now() < deadline) std::this_thread::sleep_for(1ms);
  ASSERT_TRUE(hold.entered) << "the target never received the message that holds its worker";
  ASSERT_TRUE(sent.wait(20s).ok());

  Counter c;
  for (int s = 0; s < kSenders; s++) {
    for (int k = 0; k < kEach; k++) {
      const size_t at = (static_cast<size_t>(s) * kEach + k) * kLen;
      ASSERT_TRUE(senders[s]->write_imm(0, to_target[s], LocalSlice{&srcs[s], k * kLen, kLen}, r, at,
                                        0x5100 + static_cast<uint32_t>(s), c.notify()).ok());
    }
  }
  const int total = kSenders * kEach;
  const bool all_acked = c.wait_total(total, 15s);
  const int acked_while_held = c.ok + c.failed;
  hold.release = true;
  EXPECT_TRUE(all_acked) << acked_while_held << " of " << total
                         << " write-with-immediates acknowledged while the target's worker was busy: "
                            "its receive queue ran dry (RNR)";
  ASSERT_TRUE(c.wait_total(total, 60s)) << c.ok + c.failed << " of " << total;
  EXPECT_EQ(c.failed, 0);
  for (int s = 0; s < kSenders; s++) {
    Flag f;
    ASSERT_TRUE(target->expect_imm(0, 0x5100 + static_cast<uint32_t>(s), kEach, from[s], f.notify()).ok());
    EXPECT_TRUE(f.wait(30s).ok()) << "sender " << s << ": " << f.status().message();
    for (int k = 0; k < kEach; k++) {
      const uint8_t* got = dst_buf.data() + (static_cast<size_t>(s) * kEach + k) * kLen;
      ASSERT_EQ(memcmp(got, src_bufs[s].data() + k * kLen, kLen), 0) << "sender " << s << " write " << k;
    }
  }
  target->set_recv_handler(0, nullptr, nullptr);
  for (int s = 0; s < kSenders; s++) EXPECT_TRUE(senders[s]->deregister(srcs[s]).ok());
  EXPECT_TRUE(target->deregister(*dst).ok());
}

// ---------------------------------------------------------------------------- issue 10, item 11
// Moves a write stream a -> b (and one write back), verified, while the sniffer records the packets.
void stream(Engine& a, PeerId to_b, Engine& b, PeerId to_a, int writes, uint32_t seed) {
  constexpr size_t kLen = 4096;
  std::vector<uint8_t> src(writes * kLen), dst(writes * kLen, 0), back(kLen, 0);
  fill(src.data(), src.size(), seed);
  auto s = a.register_memory(0, src.data(), src.size());
  auto d = b.register_memory(0, dst.data(), dst.size());
  auto k = a.register_memory(0, back.data(), back.size());
  ASSERT_TRUE(s.ok() && d.ok() && k.ok());
  Counter c;
  const RemoteRegion r = d->remote();
  for (int i = 0; i < writes; i++)
    ASSERT_TRUE(a.write_imm(0, to_b, LocalSlice{&*s, i * kLen, kLen}, r, i * kLen, 77, c.notify()).ok());
  Flag imms;
  ASSERT_TRUE(b.expect_imm(0, 77, static_cast<uint32_t>(writes), kAnyPeer, imms.notify()).ok());
  ASSERT_TRUE(c.wait_total(writes, 60s));
  EXPECT_EQ(c.failed, 0);
  EXPECT_TRUE(imms.wait(30s).ok());
  EXPECT_TRUE(holds(dst.data(), dst.size(), seed)) << "the stream's bytes";
  Flag f;  // and b -> a: b's QPs send in the class too
  ASSERT_TRUE(b.write(0, to_a, LocalSlice{&*d, 0, kLen}, k->remote(), 0, f.notify()).ok());
  EXPECT_TRUE(f.wait(30s).ok());
  EXPECT_TRUE(holds(back.data(), kLen, seed));
  EXPECT_TRUE(a.deregister(*s).ok());
  EXPECT_TRUE(a.deregister(*k).ok());
  EXPECT_TRUE(b.deregister(*d).ok());
}

// Engine::connect's per-connection traffic class (NCCL v11's per-comm one) is what both ends'
// packets carry: the connector's QPs, and the acceptor's, which take it from the handshake. A
// connection without one sends in PONTE_IB_TC (0 here).
TEST_F(VerbsEngineTest, TrafficClassOfAConnectionIsOnTheWire) {
  const uint32_t ip_a = ip_of(dev_a_), ip_b = ip_of(dev_b_);
  ASSERT_NE(ip_a, 0u) << "PONTE_RXE_IP_" << dev_a_;
  ASSERT_NE(ip_b, 0u) << "PONTE_RXE_IP_" << dev_b_;
  RoceSniffer sniff;
  std::string err;
  ASSERT_TRUE(sniff.start(&err)) << err;
  for (int tc : {-1, 0x68}) {
    SCOPED_TRACE("traffic class " + std::to_string(tc));
    {
      auto a = engine('A');
      auto b = engine('B');
      ASSERT_TRUE(a && b);
      PeerId to_a = kAnyPeer;
      ConnectOptions opts;
      opts.traffic_class = tc;
      PeerId to_b = connect(*a, *b, &to_a, opts);
      ASSERT_NE(to_b, kAnyPeer);
      stream(*a, to_b, *b, to_a, 32, 5);
    }
    std::this_thread::sleep_for(100ms);  // the sniffer's last reads
    auto packets = sniff.take();
    std::set<int> a_to_b, b_to_a;
    for (const auto& p : packets) {
      if (p.src == ip_a && p.dst == ip_b) a_to_b.insert(p.tos);
      if (p.src == ip_b && p.dst == ip_a) b_to_a.insert(p.tos);
    }
    const int want = tc < 0 ? cfg_.ib_traffic_class : tc;
    EXPECT_EQ(a_to_b, std::set<int>{want}) << packets.size() << " RoCE packets seen";
    EXPECT_EQ(b_to_a, std::set<int>{want}) << "the accepting side's packets";
  }
  auto a = engine('A');
  ASSERT_TRUE(a);
  auto b = engine('B');
  ASSERT_TRUE(b);
  ConnectOptions bad;
  bad.traffic_class = 256;
  EXPECT_EQ(a->connect(0, b->address(0), bad).status().code(), Code::kInvalidArgument);
}

// PONTE_IB_QPS_PER_CONNECTION: the stream's packets go to that many QPs of the target, each its own
// UDP source port (the ECMP entropy the knob is for); one QP without it. Data verified each time.
TEST_F(VerbsEngineTest, QpsPerConnectionSpreadAWriteStream) {
  const uint32_t ip_a = ip_of(dev_a_), ip_b = ip_of(dev_b_);
  ASSERT_NE(ip_a, 0u);
  ASSERT_NE(ip_b, 0u);
  RoceSniffer sniff;
  std::string err;
  ASSERT_TRUE(sniff.start(&err)) << err;
  for (int qps : {1, 4}) {
    SCOPED_TRACE(std::to_string(qps) + " QPs per connection");
    {
      Config cfg = cfg_;
      cfg.ib_qps_per_connection = qps;
      auto a = engine('A', &cfg);
      auto b = engine('B', &cfg);
      ASSERT_TRUE(a && b);
      PeerId to_a = kAnyPeer;
      PeerId to_b = connect(*a, *b, &to_a);
      ASSERT_NE(to_b, kAnyPeer);
      stream(*a, to_b, *b, to_a, 64, 6 + qps);
    }
    std::this_thread::sleep_for(100ms);
    std::set<uint32_t> qpns;
    std::set<uint16_t> ports;
    for (const auto& p : sniff.take()) {
      if (p.src != ip_a || p.dst != ip_b) continue;
      qpns.insert(p.dest_qp);
      ports.insert(p.sport);
    }
    EXPECT_EQ(qpns.size(), static_cast<size_t>(qps)) << "the target QPs the stream went to";
    EXPECT_EQ(ports.size(), static_cast<size_t>(qps)) << "UDP source ports (flows) of the stream";
  }
}

}  // namespace
}  // namespace ponte
