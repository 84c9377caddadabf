// An engine's control port under attack (raw TCP clients on loopback): garbage, truncated and
// oversized frames, wrong proofs, a replay of a real handshake recorded from another engine, and
// thousands of half-open connections; meanwhile a real peer keeps writing verified data, the
// engine logs one line, and its descriptors return to their baseline.
#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include "core/control_messages.h"
#include "core/control_socket.h"
#include "core/engine.h"
#include "core/group_address.h"
#include "core/log.h"

using namespace ponte;
using namespace std::chrono_literals;

namespace {

std::atomic<int> g_uninvited_logs{0};
void count_logs(LogLevel, const char* line) {
  if (strstr(line, "did not prove it was invited")) g_uninvited_logs++;
}

int open_fds() {
  int n = 0;
  DIR* d = opendir("/proc/self/fd");
  while (dirent* e = readdir(d))
    if (e->d_name[0] != '.') n++;
  closedir(d);
  return n - 1;  // the DIR's own
}

Config config(uint32_t timeout_ms) {
  Config c = global_config();
  c.backend = BackendChoice::kFabric;
  c.fabric_provider = "tcp;ofi_rxm";
  c.ctrl_addr = "127.0.0.1";
  c.timeout_ms = timeout_ms;
  return c;
}

std::unique_ptr<Engine> make_engine(uint32_t timeout_ms) {
  EngineOptions o;
  o.config = config(timeout_ms);
  o.groups = {{0}};
  auto e = Engine::create(o);
  EXPECT_TRUE(e.ok()) << e.status().message();
  return e.ok() ? std::move(*e) : nullptr;
}

sockaddr_in control_addr(const std::vector<uint8_t>& address) {
  auto a = GroupAddress::decode(address);
  EXPECT_TRUE(a.ok());
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  memcpy(&sa.sin_addr, a->ip, 4);
  sa.sin_port = htons(a->port);
  return sa;
}

int dial(const sockaddr_in& sa) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (connect(fd, reinterpret_cast<const sockaddr*>(&sa), sizeof(sa)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

void send_all(int fd, const std::vector<uint8_t>& b) {
  size_t off = 0;
  while (off < b.size()) {
    ssize_t n = send(fd, b.data() + off, b.size() - off, MSG_NOSIGNAL);
    if (n <= 0) return;
    off += static_cast<size_t>(n);
  }
}

// Reads until the engine closes the connection; true if it did within the time given. What it
// sent before (its challenge) is returned in *got.
bool closed_by_engine(int fd, std::chrono::milliseconds within, std::vector<uint8_t>* got = nullptr) {
  auto deadline = std::chrono::steady_clock::now() + within;
  uint8_t buf[4096];
  for (;;) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return false;
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
    ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) return true;  // EOF or reset
    if (got) got->insert(got->end(), buf, buf + n);
  }
}

std::vector<uint8_t> frame(const std::vector<uint8_t>& payload) {
  std::vector<uint8_t> out;
  append_frame(payload, &out);
  return out;
}

// A TCP relay that records what the connecting side sends: the test's window on a real handshake.
class RecordingProxy {
 public:
  explicit RecordingProxy(sockaddr_in to) : to_(to) {
    listen_fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    bind(listen_fd_, reinterpret_cast<sockaddr*>(&sa), sizeof(sa));
    listen(listen_fd_, 4);
    socklen_t len = sizeof(sa);
    getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&sa), &len);
    port_ = ntohs(sa.sin_port);
    thread_ = std::thread([this] { relay(); });
  }
  ~RecordingProxy() {
    stop_ = true;
    thread_.join();
    close(listen_fd_);
  }
  uint16_t port() const { return port_; }
  std::vector<uint8_t> recorded() {
    std::lock_guard<std::mutex> l(mu_);
    return recorded_;
  }

 private:
  void relay() {
    int in = -1, out = -1;
    while (!stop_ && in < 0) {
      pollfd p{listen_fd_, POLLIN, 0};
      if (poll(&p, 1, 50) == 1) in = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    }
    if (in >= 0) out = dial(to_);
    uint8_t buf[4096];
    while (!stop_ && in >= 0 && out >= 0) {
      pollfd p[2] = {{in, POLLIN, 0}, {out, POLLIN, 0}};
      if (poll(p, 2, 50) <= 0) continue;
      if (p[0].revents) {
        ssize_t n = recv(in, buf, sizeof(buf), 0);
        if (n <= 0) break;
        {
          std::lock_guard<std::mutex> l(mu_);
          recorded_.insert(recorded_.end(), buf, buf + n);
        }
        send_all(out, std::vector<uint8_t>(buf, buf + n));
      }
      if (p[1].revents) {
        ssize_t n = recv(out, buf, sizeof(buf), 0);
        if (n <= 0) break;
        send_all(in, std::vector<uint8_t>(buf, buf + n));
      }
    }
    if (in >= 0) close(in);
    if (out >= 0) close(out);
  }
  sockaddr_in to_;
  int listen_fd_ = -1;
  uint16_t port_ = 0;
  std::atomic<bool> stop_{false};
  std::thread thread_;
  std::mutex mu_;
  std::vector<uint8_t> recorded_;
};

// B writes 256 KiB with an immediate into A's buffer, A checks every byte; again and again.
struct Traffic {
  Engine* a = nullptr;
  Engine* b = nullptr;
  PeerId b_to_a = 0;
  std::vector<uint8_t> src = std::vector<uint8_t>(256 << 10), dst = std::vector<uint8_t>(256 << 10);
  MemoryRegion src_mr, dst_mr;
  std::atomic<bool> stop{false};
  std::atomic<int> verified{0}, failed{0};
  std::string first_error;
  std::thread thread;

  void run() {
    for (uint32_t seed = 1; !stop; seed++) {
      for (size_t i = 0; i < src.size(); i++) src[i] = static_cast<uint8_t>(seed * 31 + i * 7);
      Flag written, arrived;
      const uint32_t imm = 100 + (seed & 1023);
      Status st = a->expect_imm(0, imm, b->imms_per_write(0, b_to_a, src.size()), kAnyPeer, arrived.notify());
      if (st.ok()) st = b->write_imm(0, b_to_a, LocalSlice{&src_mr, 0, src.size()}, dst_mr.remote(), 0, imm, written.notify());
      if (st.ok()) st = written.wait(20s);
      if (st.ok()) st = arrived.wait(20s);
      bool same = st.ok() && dst == src;
      if (same) {
        verified++;
      } else {
        first_error = st.ok() ? "bytes differ" : st.message();  // this thread's only write, before failed
        failed++;
        return;
      }
    }
  }
};

TEST(UninvitedConnections, AreDroppedWhileRealPeersKeepWorking) {
  // The half-open storm below needs descriptors on both ends of each connection.
  rlimit rl{};
  getrlimit(RLIMIT_NOFILE, &rl);
  const rlim_t want = std::min<rlim_t>(rl.rlim_max, 8192);
  if (rl.rlim_cur < want) {
    rl.rlim_cur = want;
    setrlimit(RLIMIT_NOFILE, &rl);
  }
  set_log_sink(count_logs);
  auto a = make_engine(2000);  // A's window for a proof: min(PONTE_TIMEOUT_MS, 5 s) = 2 s
  auto b = make_engine(20000);
  ASSERT_TRUE(a && b);
  const auto a_addr = a->address(0);
  const sockaddr_in a_ctrl = control_addr(a_addr);

  Traffic t;
  t.a = a.get();
  t.b = b.get();
  auto sm = b->register_memory(0, t.src.data(), t.src.size());
  auto dm = a->register_memory(0, t.dst.data(), t.dst.size());
  ASSERT_TRUE(sm.ok() && dm.ok());
  t.src_mr = *sm;
  t.dst_mr = *dm;
  auto peer = b->connect(0, a_addr);
  ASSERT_TRUE(peer.ok()) << peer.status().message();
  t.b_to_a = *peer;

  // A real handshake recorded on its way from engine C to A (through a relay), for the replay.
  std::vector<uint8_t> recorded;
  {
    auto c = make_engine(20000);
    ASSERT_TRUE(c);
    auto via = GroupAddress::decode(a_addr);
    ASSERT_TRUE(via.ok());
    RecordingProxy proxy(a_ctrl);
    via->port = proxy.port();
    auto cp = c->connect(0, via->encode());
    ASSERT_TRUE(cp.ok()) << cp.status().message();
    auto deadline = std::chrono::steady_clock::now() + 20s;
    while (!c->peer_ready(0, *cp) && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(1ms);
    ASSERT_TRUE(c->peer_ready(0, *cp));
    recorded = proxy.recorded();
  }
  // It holds the proof (AUTH) and the hello, as frames.
  std::span<const uint8_t> proof_payload;
  auto took = take_frame(recorded, kMaxControlMessage, &proof_payload);
  ASSERT_TRUE(took.ok() && *took > 0);
  ASSERT_TRUE(decode_auth(proof_payload).ok());

  // Let the first write settle, then take the baseline.
  t.thread = std::thread([&t] { t.run(); });
  auto deadline = std::chrono::steady_clock::now() + 20s;
  while (t.verified < 1 && t.failed == 0 && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(1ms);
  ASSERT_GE(t.verified.load(), 1) << t.first_error;
  std::this_thread::sleep_for(300ms);  // C's departure fully handled
  const int baseline = open_fds();
  const int logs_before = g_uninvited_logs.load();
  ASSERT_EQ(logs_before, 0) << "nothing uninvited happened yet";

  // 1. Garbage: the challenge comes, then the close.
  {
    int fd = dial(a_ctrl);
    ASSERT_GE(fd, 0);
    std::vector<uint8_t> junk(1000);
    for (size_t i = 0; i < junk.size(); i++) junk[i] = static_cast<uint8_t>(i * 37 + 11);
    send_all(fd, junk);
    std::vector<uint8_t> got;
    EXPECT_TRUE(closed_by_engine(fd, 3s, &got)) << "garbage";
    std::span<const uint8_t> ch;
    auto n = take_frame(got, kMaxControlMessage, &ch);
    EXPECT_TRUE(n.ok() && *n > 0 && decode_challenge(ch).ok()) << "the engine speaks first: a challenge";
    close(fd);
  }
  // 2. Oversized: a frame announcing 1 MiB is refused at its header.
  {
    int fd = dial(a_ctrl);
    send_all(fd, {0, 0, 16, 0, 1, 2, 3});
    EXPECT_TRUE(closed_by_engine(fd, 3s)) << "oversized";
    close(fd);
  }
  // 3. Truncated: half a proof, then silence, ends at the 2 s window.
  {
    int fd = dial(a_ctrl);
    auto half = frame(encode_auth(Sha256Digest{}));
    half.resize(half.size() / 2);
    send_all(fd, half);
    auto t0 = std::chrono::steady_clock::now();
    EXPECT_TRUE(closed_by_engine(fd, 6s)) << "truncated";
    EXPECT_GE(std::chrono::steady_clock::now() - t0, 1500ms);
    close(fd);
  }
  // 4. A well-formed proof of the wrong key, and a hello without any proof.
  {
    int fd = dial(a_ctrl);
    Sha256Digest wrong;
    wrong.fill(0x5a);
    send_all(fd, frame(encode_auth(wrong)));
    EXPECT_TRUE(closed_by_engine(fd, 3s)) << "wrong proof";
    close(fd);
    fd = dial(a_ctrl);
    std::span<const uint8_t> hello_payload;
    std::span<const uint8_t> rest(recorded.data() + *took, recorded.size() - *took);
    auto th = take_frame(rest, kMaxControlMessage, &hello_payload);
    ASSERT_TRUE(th.ok() && *th > 0 && decode_hello(hello_payload).ok());
    send_all(fd, frame(std::vector<uint8_t>(hello_payload.begin(), hello_payload.end())));
    EXPECT_TRUE(closed_by_engine(fd, 3s)) << "hello without a proof";
    close(fd);
  }
  // 5. The recorded handshake of engine C, replayed byte for byte: its proof answers another
  //    challenge.
  for (int k = 0; k < 3; k++) {
    int fd = dial(a_ctrl);
    send_all(fd, recorded);
    EXPECT_TRUE(closed_by_engine(fd, 3s)) << "replay " << k;
    close(fd);
  }
  // 6. Thousands of half-open connections: connected, silent, then abandoned by their clients.
  {
    std::vector<int> fds;
    for (int k = 0; k < 3000; k++) {
      int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
      if (fd < 0) break;
      int rc = connect(fd, reinterpret_cast<const sockaddr*>(&a_ctrl), sizeof(a_ctrl));
      if (rc != 0 && errno != EINPROGRESS) {
        close(fd);
        continue;
      }
      fds.push_back(fd);
    }
    EXPECT_GE(fds.size(), 2000u);
    std::this_thread::sleep_for(2500ms);  // past the window: the engine has closed what it accepted
    for (int fd : fds) close(fd);
  }

  // The real peer never noticed.
  EXPECT_EQ(t.failed.load(), 0) << t.first_error;
  const int before = t.verified.load();
  deadline = std::chrono::steady_clock::now() + 20s;
  while (t.verified < before + 3 && t.failed == 0 && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(1ms);
  t.stop = true;
  t.thread.join();
  EXPECT_EQ(t.failed.load(), 0) << t.first_error;
  EXPECT_GE(t.verified.load(), before + 3);
  EXPECT_TRUE(b->peer_ready(0, t.b_to_a));

  // Every descriptor the attacks cost is back; one log line said so.
  deadline = std::chrono::steady_clock::now() + 10s;
  while (open_fds() > baseline && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(50ms);
  EXPECT_EQ(open_fds(), baseline);
  EXPECT_EQ(g_uninvited_logs.load() - logs_before, 1);

  // And a new, invited peer still gets in.
  auto d = make_engine(20000);
  ASSERT_TRUE(d);
  auto dp = d->connect(0, a_addr);
  ASSERT_TRUE(dp.ok());
  deadline = std::chrono::steady_clock::now() + 20s;
  while (!d->peer_ready(0, *dp) && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(1ms);
  EXPECT_TRUE(d->peer_ready(0, *dp));
  EXPECT_TRUE(a->deregister(t.dst_mr).ok());
  EXPECT_TRUE(b->deregister(t.src_mr).ok());
  set_log_sink(nullptr);
}

TEST(UninvitedConnections, JobKeyMustMatch) {
  // With PONTE_JOB_KEY the address carries no secret; a connector without the key is refused
  // before it dials, one with another key is dropped by the acceptor and says why.
  EngineOptions o;
  o.config = config(3000);
  o.config.job_key = "job-1234";
  o.groups = {{0}};
  auto a = Engine::create(o);
  ASSERT_TRUE(a.ok()) << a.status().message();
  auto addr = GroupAddress::decode((*a)->address(0));
  ASSERT_TRUE(addr.ok());
  EXPECT_EQ(addr->auth_kind, AuthKind::kJobKey);
  EXPECT_EQ(addr->auth_secret, 0u);

  auto nokey = make_engine(3000);
  ASSERT_TRUE(nokey);
  auto r = nokey->connect(0, (*a)->address(0));
  ASSERT_FALSE(r.ok());
  EXPECT_NE(std::string(r.status().message()).find("PONTE_JOB_KEY"), std::string::npos) << r.status().message();

  o.config.job_key = "job-5678";
  auto other = Engine::create(o);
  ASSERT_TRUE(other.ok());
  auto p = (*other)->connect(0, (*a)->address(0));
  ASSERT_TRUE(p.ok());
  auto deadline = std::chrono::steady_clock::now() + 10s;
  while (!(*other)->peer_dead(0, *p) && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(1ms);
  EXPECT_TRUE((*other)->peer_dead(0, *p));

  o.config.job_key = "job-1234";
  auto same = Engine::create(o);
  ASSERT_TRUE(same.ok());
  auto q = (*same)->connect(0, (*a)->address(0));
  ASSERT_TRUE(q.ok());
  deadline = std::chrono::steady_clock::now() + 10s;
  while (!(*same)->peer_ready(0, *q) && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(1ms);
  EXPECT_TRUE((*same)->peer_ready(0, *q));
}

}  // namespace
