// ponte-netem-wire: a network emulator in user space, for kernels without sch_netem (this host's
// kernel has no netem and no modules to load). It bridges two interfaces (the middle ends of two
// veth pairs, in a namespace of their own) frame by frame, in both directions, and impairs each
// direction as `tc qdisc ... netem loss P% delay D J reorder R%` would: a frame is lost with
// probability P, otherwise held D +- J (uniform) before it goes out, or, with probability R, sent
// at once past the held ones (netem's reorder). Jitter reorders as well, as in netem. Frames over
// the queue limit are dropped (netem's limit). The impairment is read from a file, again on
// SIGHUP, so a test can change it while connections stay up.
//
// usage: ponte-netem-wire IF_A IF_B CONFIG_FILE
//   CONFIG_FILE: "loss=PCT delay_us=N jitter_us=N reorder=PCT limit=N seed=N" (missing keys: 0;
//   limit 20000 frames per direction). SIGHUP re-reads it; SIGUSR1 writes the frame counts of both
//   directions, summed, to CONFIG_FILE.stats ("in=N out=N lost=N over_limit=N reordered=N
//   oversize=N send_errors=N"); SIGTERM/SIGINT end the wire and print them to stderr. The senders' offloads must be off (ethtool -K tx off tso off gso
//   off): a frame bigger than the MTU cannot be sent back out and is counted as "oversize".
#include <arpa/inet.h>
#include <linux/if_packet.h>
#include <net/ethernet.h>
#include <net/if.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <queue>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#ifndef PACKET_IGNORE_OUTGOING
#define PACKET_IGNORE_OUTGOING 23
#endif

namespace {

struct Params {
  double loss = 0;     // probability 0..1
  double reorder = 0;  // probability 0..1 (only with a delay: sent at once, past the held frames)
  uint64_t delay_ns = 0, jitter_ns = 0;
  size_t limit = 20000;
  uint64_t seed = 1;
};

bool parse_params(const std::string& path, Params* out, std::string* err) {
  std::ifstream f(path);
  if (!f) return (*err = "cannot read " + path, false);
  std::stringstream ss;
  ss << f.rdbuf();
  Params p;
  std::string kv;
  while (ss >> kv) {
    auto eq = kv.find('=');
    if (eq == std::string::npos) return (*err = "not key=value: " + kv, false);
    std::string k = kv.substr(0, eq);
    char* end = nullptr;
    double v = strtod(kv.c_str() + eq + 1, &end);
    if (end == kv.c_str() + eq + 1 || *end != 0 || v < 0) return (*err = "bad value: " + kv, false);
    if (k == "loss") p.loss = v / 100;
    else if (k == "reorder") p.reorder = v / 100;
    else if (k == "delay_us") p.delay_ns = static_cast<uint64_t>(v * 1000);
    else if (k == "jitter_us") p.jitter_ns = static_cast<uint64_t>(v * 1000);
    else if (k == "limit") p.limit = static_cast<size_t>(v);
    else if (k == "seed") p.seed = static_cast<uint64_t>(v);
    else return (*err = "unknown key: " + k, false);
  }
  if (p.loss > 1 || p.reorder > 1) return (*err = "a percentage over 100", false);
  if (p.jitter_ns > p.delay_ns) p.jitter_ns = p.delay_ns;
  *out = p;
  return true;
}

uint64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}

struct Rng {  // splitmix64
  uint64_t s;
  uint64_t next() {
    uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  double unit() { return static_cast<double>(next() >> 11) * (1.0 / 9007199254740992.0); }
};

int open_port(const char* ifname, int* mtu) {
  int fd = socket(AF_PACKET, SOCK_RAW | SOCK_CLOEXEC, htons(ETH_P_ALL));
  if (fd < 0) return -1;
  unsigned idx = if_nametoindex(ifname);
  if (idx == 0) return close(fd), -1;
  int one = 1;
  setsockopt(fd, SOL_PACKET, PACKET_IGNORE_OUTGOING, &one, sizeof(one));  // not our own sends
  int buf = 16 << 20;  // room while this thread is off the CPU (2 cores, busy-polling engines)
  setsockopt(fd, SOL_SOCKET, SO_RCVBUFFORCE, &buf, sizeof(buf));
  setsockopt(fd, SOL_SOCKET, SO_SNDBUFFORCE, &buf, sizeof(buf));
  sockaddr_ll sll{};
  sll.sll_family = AF_PACKET;
  sll.sll_protocol = htons(ETH_P_ALL);
  sll.sll_ifindex = static_cast<int>(idx);
  if (bind(fd, reinterpret_cast<sockaddr*>(&sll), sizeof(sll)) != 0) return close(fd), -1;
  ifreq ifr{};
  snprintf(ifr.ifr_name, sizeof(ifr.ifr_name), "%s", ifname);
  *mtu = ioctl(fd, SIOCGIFMTU, &ifr) == 0 ? ifr.ifr_mtu : 1500;
  // Frames that arrived before the bind may come from any interface: drain them.
  char junk[64];
  while (recv(fd, junk, sizeof(junk), MSG_DONTWAIT) >= 0) {
  }
  return fd;
}

std::atomic<const Params*> g_params{nullptr};
std::atomic<bool> g_stop{false};

struct Counts {
  std::atomic<uint64_t> in{0}, out{0}, lost{0}, over_limit{0}, reordered{0}, oversize{0}, send_err{0};
};

// One direction: frames read from rx go out on tx, impaired.
class Direction {
 public:
  Direction(int rx, int tx, size_t frame_max, const char* name) : rx_(rx), tx_(tx), frame_max_(frame_max), name_(name) {}
  void run() {
    const Params* p = g_params.load();
    Rng rng{p->seed * 2 + (name_[0] == 'a')};
    pool_.resize(p->limit);
    for (auto& b : pool_) b.reset(new uint8_t[frame_max_]);
    for (size_t i = 0; i < pool_.size(); i++) free_.push_back(i);
    constexpr int kBatch = 64;
    std::vector<uint8_t> scratch(static_cast<size_t>(kBatch) * frame_max_);
    mmsghdr msgs[kBatch];
    iovec iov[kBatch];
    while (!g_stop.load(std::memory_order_relaxed)) {
      const Params* cur = g_params.load(std::memory_order_acquire);
      if (cur != p) {
        p = cur;
        if (p->limit > pool_.size()) grow(p->limit);
      }
      uint64_t t = now_ns();
      release(t);
      flush();
      uint64_t wait_ns = 100000000;  // 100 ms: a look at the parameters and the stop flag
      if (!held_.empty()) wait_ns = std::min(wait_ns, held_.top().due - std::min(t, held_.top().due));
      timespec ts{static_cast<time_t>(wait_ns / 1000000000), static_cast<long>(wait_ns % 1000000000)};
      pollfd pfd{rx_, POLLIN, 0};
      if (ppoll(&pfd, 1, &ts, nullptr) <= 0) continue;
      for (int i = 0; i < kBatch; i++) {
        iov[i] = {scratch.data() + static_cast<size_t>(i) * frame_max_, frame_max_};
        msgs[i] = {};
        msgs[i].msg_hdr.msg_iov = &iov[i];
        msgs[i].msg_hdr.msg_iovlen = 1;
      }
      int n = recvmmsg(rx_, msgs, kBatch, MSG_DONTWAIT, nullptr);
      if (n <= 0) {
        flush();
        continue;
      }
      t = now_ns();
      for (int i = 0; i < n; i++) {
        const uint8_t* f = static_cast<const uint8_t*>(iov[i].iov_base);
        size_t len = msgs[i].msg_len;
        counts.in++;
        if (msgs[i].msg_hdr.msg_flags & MSG_TRUNC) {
          counts.oversize++;
          continue;
        }
        if (p->loss > 0 && rng.unit() < p->loss) {
          counts.lost++;
          continue;
        }
        if (p->delay_ns == 0 || (p->reorder > 0 && rng.unit() < p->reorder)) {
          if (p->delay_ns) counts.reordered++;
          emit(f, len);
          continue;
        }
        if (free_.empty()) {
          counts.over_limit++;
          continue;
        }
        uint64_t d = p->delay_ns;
        if (p->jitter_ns) d = d - p->jitter_ns + static_cast<uint64_t>(rng.unit() * 2.0 * static_cast<double>(p->jitter_ns));
        size_t slot = free_.back();
        free_.pop_back();
        memcpy(pool_[slot].get(), f, len);
        held_.push(Held{t + d, seq_++, slot, len});
      }
      flush();  // before the next receive reuses the batch's buffers
    }
  }
  Counts counts;

 private:
  struct Held {
    uint64_t due, seq;
    size_t slot, len;
    bool operator>(const Held& o) const { return due != o.due ? due > o.due : seq > o.seq; }
  };
  void grow(size_t n) {
    for (size_t i = pool_.size(); i < n; i++) {
      pool_.emplace_back(new uint8_t[frame_max_]);
      free_.push_back(i);
    }
  }
  void release(uint64_t t) {
    while (!held_.empty() && held_.top().due <= t) {
      Held h = held_.top();
      held_.pop();
      emit(pool_[h.slot].get(), h.len, h.slot);
    }
  }
  // Queued for one sendmmsg: frames point into the receive batch or the pool (slot, freed once sent).
  void emit(const uint8_t* f, size_t len, size_t slot = SIZE_MAX) {
    if (out_n_ == kOutBatch) flush();
    out_iov_[out_n_] = {const_cast<uint8_t*>(f), len};
    out_slot_[out_n_] = slot;
    out_n_++;
  }
  void flush() {
    mmsghdr m[kOutBatch];
    for (int i = 0; i < out_n_; i++) {
      m[i] = {};
      m[i].msg_hdr.msg_iov = &out_iov_[i];
      m[i].msg_hdr.msg_iovlen = 1;
    }
    int done = 0;
    while (done < out_n_) {
      int w = sendmmsg(tx_, m + done, static_cast<unsigned>(out_n_ - done), 0);
      if (w > 0) {
        counts.out += static_cast<uint64_t>(w);
        done += w;
        continue;
      }
      if (errno == EMSGSIZE) {
        if (counts.oversize++ == 0)
          fprintf(stderr, "ponte-netem-wire: a %zu-byte frame is over the MTU: turn the senders' offloads off\n",
                  out_iov_[done].iov_len);
      } else {
        counts.send_err++;  // the far end is down (ENETDOWN, ENXIO): the frame is lost, as on a wire
      }
      done++;
    }
    for (int i = 0; i < out_n_; i++)
      if (out_slot_[i] != SIZE_MAX) free_.push_back(out_slot_[i]);
    out_n_ = 0;
  }
  static constexpr int kOutBatch = 64;
  iovec out_iov_[kOutBatch];
  size_t out_slot_[kOutBatch];
  int out_n_ = 0;
  int rx_, tx_;
  size_t frame_max_;
  const char* name_;
  std::vector<std::unique_ptr<uint8_t[]>> pool_;
  std::vector<size_t> free_;
  std::priority_queue<Held, std::vector<Held>, std::greater<Held>> held_;
  uint64_t seq_ = 0;
};

void write_stats(const std::string& path, const Counts& x, const Counts& y) {
  auto sum = [](const std::atomic<uint64_t>& a, const std::atomic<uint64_t>& b) {
    return static_cast<unsigned long long>(a.load() + b.load());
  };
  std::string tmp = path + ".tmp";
  FILE* f = fopen(tmp.c_str(), "w");
  if (!f) return;
  fprintf(f, "in=%llu out=%llu lost=%llu over_limit=%llu reordered=%llu oversize=%llu send_errors=%llu\n",
          sum(x.in, y.in), sum(x.out, y.out), sum(x.lost, y.lost), sum(x.over_limit, y.over_limit),
          sum(x.reordered, y.reordered), sum(x.oversize, y.oversize), sum(x.send_err, y.send_err));
  fclose(f);
  rename(tmp.c_str(), path.c_str());
}

void print_counts(const char* tag, const Counts& c) {
  fprintf(stderr, "ponte-netem-wire: %s: in %llu out %llu lost %llu over-limit %llu reordered %llu oversize %llu send-errors %llu\n",
          tag, static_cast<unsigned long long>(c.in.load()), static_cast<unsigned long long>(c.out.load()),
          static_cast<unsigned long long>(c.lost.load()), static_cast<unsigned long long>(c.over_limit.load()),
          static_cast<unsigned long long>(c.reordered.load()), static_cast<unsigned long long>(c.oversize.load()),
          static_cast<unsigned long long>(c.send_err.load()));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    fprintf(stderr, "usage: %s IF_A IF_B CONFIG_FILE\n", argv[0]);
    return 2;
  }
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGHUP);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGUSR1);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);  // inherited by the direction threads; main waits for them
  std::vector<std::unique_ptr<Params>> history;  // every published Params stays alive: readers never lock
  std::string err;
  history.push_back(std::make_unique<Params>());
  if (!parse_params(argv[3], history.back().get(), &err)) {
    fprintf(stderr, "ponte-netem-wire: %s\n", err.c_str());
    return 2;
  }
  g_params.store(history.back().get());
  int mtu_a = 1500, mtu_b = 1500;
  int a = open_port(argv[1], &mtu_a), b = open_port(argv[2], &mtu_b);
  if (a < 0 || b < 0) {
    fprintf(stderr, "ponte-netem-wire: cannot open %s: %s\n", a < 0 ? argv[1] : argv[2], strerror(errno));
    return 1;
  }
  // A frame: Ethernet header, a VLAN tag, the MTU; anything larger is truncated and counted.
  size_t frame_max = static_cast<size_t>(std::max(mtu_a, mtu_b)) + 18;
  Direction ab(a, b, frame_max, "a->b"), ba(b, a, frame_max, "b->a");
  std::thread t1([&] { ab.run(); }), t2([&] { ba.run(); });
  fprintf(stderr, "ponte-netem-wire: bridging %s <-> %s\n", argv[1], argv[2]);
  for (;;) {
    int sig = 0;
    if (sigwait(&set, &sig) != 0) continue;
    if (sig == SIGUSR1) {
      write_stats(std::string(argv[3]) + ".stats", ab.counts, ba.counts);
      continue;
    }
    if (sig == SIGHUP) {
      auto p = std::make_unique<Params>();
      if (parse_params(argv[3], p.get(), &err)) {
        g_params.store(p.get(), std::memory_order_release);
        history.push_back(std::move(p));
      } else {
        fprintf(stderr, "ponte-netem-wire: keeping the old impairment: %s\n", err.c_str());
      }
      continue;
    }
    break;
  }
  g_stop = true;
  t1.join();
  t2.join();
  print_counts("a->b", ab.counts);
  print_counts("b->a", ba.counts);
  return 0;
}
