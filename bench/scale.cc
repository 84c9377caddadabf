// ponte-scale: what each peer and each plugin comm costs, measured, and what that means at 1,024
// peers per NIC. A benchmark: it asserts only that every connection it makes moves a verified
// message (exit status 1 when one did not); the tables are for reading (bench/README.md).
//
//   ponte-scale [--provider tcp;ofi_rxm] [--peers 2,4,8,16,32,64] [--wave N] [--dial both|hub|peers|mutual]
//               [--comms 100,200,400] [--pending 0,255,256] [--nics 1] [--timeout 120]
//               [--no-engine] [--no-plugin]
//
// Engine rows: one hub engine (this process, fresh for each row) and N peer processes (this binary
// started again, each with its own engine). Half the peers are dialled by the hub and half dial it
// (--dial both; mutual: each side dials the other, as all-to-all ranks do), all told at once (or --wave N at a time); every connection then carries a 4 KiB
// write-with-immediate each way, checked at the receiver, so lazily opened transport connections
// are open when the hub is measured. Deltas of the hub from N started, unconnected peers to N
// connected and used: descriptors, threads, heap (mallinfo2), RSS, libfabric endpoints and
// address-vector entries (through libponte-ficount, which this program puts behind
// PONTE_FABRIC_LIB by default), fitted as first + per-peer x N over the complete rows. Setup:
// connect() to peer_ready of each connection (p50, max), and from "go" until all were ready. Idle
// CPU: the hub process over one second with N connected, idle peers. Then the peers exit and the
// hub waits to see them dead: what dead peers leave behind. A peer whose connection or exchange
// did not complete says what failed.
//
// Control port rows: k raw TCP connections that take the hub's challenge and stay silent, then a
// real engine dials the hub: the queue of connections waiting to authenticate (kMaxPending).
//
// Plugin rows: two processes, each loading libnccl-net-ponte.so; C listen + connect + accept per
// side at once (never blocking, as NCCL's proxy), one verified message each way per comm, then
// the deltas of this process (a pair = one send comm and one recv comm) and what closing leaves.
#include <sys/resource.h>

#include <algorithm>
#include <map>
#include <cinttypes>
#include <memory>
#include <sstream>
#include <thread>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>

#include "core/engine.h"
#include "core/group_address.h"
#include "core/nic_group_internal.h"  // kMaxPeers, kMaxPending: the projection's hard limits
#include "plugin/wire.h"              // kMaxCommId
#include "tests/plugin/harness.h"
#include "tests/soak/soak_support.h"

using namespace ponte;
using namespace ponte::soak;
using ponte::nccl_abi::NetV11;
using ponte::test::PeerProcess;

namespace {

using Clock = std::chrono::steady_clock;

struct Opts {
  std::string provider = "tcp;ofi_rxm";
  std::vector<int> peers = {2, 4, 8, 16, 32, 64};
  std::vector<int> comms = {100, 200, 400};
  std::vector<int> pending = {0, 255, 256};  // silent connections before a real peer dials
  int nics = 1;
  std::string dial = "both";
  int wave = 0;  // peers told to connect at once (0: all)
  int timeout_s = 120;
  bool engine = true, plugin = true;
};

std::vector<int> parse_list(const std::string& s) {
  std::vector<int> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');)
    if (!item.empty()) out.push_back(std::stoi(item));
  return out;
}

constexpr const char* kUsage =
    "usage: ponte-scale [--provider P] [--peers 2,4,..] [--comms 100,..] [--pending 0,255,256] [--nics N]\n"
    "                   [--dial both|hub|peers|mutual] [--wave N] [--timeout S] [--no-engine] [--no-plugin]\n";

Opts parse(int argc, char** argv, int first) {
  Opts o;
  for (int i = first; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) die("missing value after %s", a.c_str());
      return argv[++i];
    };
    if (a == "--provider") o.provider = next();
    else if (a == "--peers") o.peers = parse_list(next());
    else if (a == "--comms") o.comms = parse_list(next());
    else if (a == "--pending") o.pending = parse_list(next());
    else if (a == "--nics") o.nics = std::stoi(next());
    else if (a == "--dial") o.dial = next();
    else if (a == "--wave") o.wave = std::stoi(next());
    else if (a == "--timeout") o.timeout_s = std::stoi(next());
    else if (a == "--no-engine") o.engine = false;
    else if (a == "--no-plugin") o.plugin = false;
    else {
      std::fputs(kUsage, stderr);
      std::exit(2);
    }
  }
  if (o.dial != "both" && o.dial != "hub" && o.dial != "peers" && o.dial != "mutual")
    die("--dial takes both, hub, peers or mutual");
  if (o.nics < 1 || o.nics > 4 || o.timeout_s < 1) die("nics 1..4, timeout > 0");
  for (int n : o.peers)
    if (n < 1 || n > 1024) die("peers 1..1024");
  for (int c : o.comms)
    if (c < 1 || 2 * c > static_cast<int>(plugin::kMaxCommId)) die("comms 1..%u", plugin::kMaxCommId / 2);
  return o;
}

// 64 processes on 2 cores: handshakes wait for the CPU, hence the long timeout.
void set_environment(const Opts& o) { set_loopback_environment(o.provider, "60000"); }

double ms_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}
double process_cpu_s() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<double>(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) +
         static_cast<double>(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) * 1e-6;
}
double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

constexpr size_t kMsg = 4096;             // below PONTE_STRIPE_MIN: one immediate per write
constexpr uint32_t kToHub = 0x61000;      // + peer index: a peer's message landed in the hub's slot
constexpr uint32_t kToPeer = 0x62000;     // the hub's message landed in a peer's region
constexpr uint32_t kHello = 0x63000;      // an immediate alone from the hub, on every connection
constexpr uint64_t kStreamToHub = 21, kStreamToPeer = 22;

EngineOptions engine_options(int nics) {
  EngineOptions e;
  e.groups.push_back(std::vector<size_t>(static_cast<size_t>(nics), 0));
  return e;
}

// Page-aligned registered memory.
struct Region {
  Engine& e;
  uint8_t* ptr;
  size_t len;
  MemoryRegion mr;
  Region(Engine& eng, size_t n) : e(eng), len((n + 4095) / 4096 * 4096) {
    ptr = static_cast<uint8_t*>(std::aligned_alloc(4096, len));
    std::memset(ptr, 0, len);
    auto r = e.register_memory(0, ptr, len);
    if (!r.ok()) die("register_memory: %s", r.status().message());
    mr = std::move(r).value();
  }
  ~Region() {
    (void)e.deregister(mr);
    std::free(ptr);
  }
};

struct Counter {
  std::atomic<int> done{0}, errors{0};
  static void fire(void* arg, const Status& st) {
    auto* c = static_cast<Counter*>(arg);
    if (!st.ok()) c->errors.fetch_add(1);
    c->done.fetch_add(1);
  }
};

void must(const Status& st, const char* what) {
  if (!st.ok()) die("%s: %s", what, st.message());
}

// ---- an engine peer process -------------------------------------------------------------------

// The hub asks for reports once it has seen all it will: what has not completed 15 s after that failed.
struct Asked {
  const Channel& ch;
  bool seen = false;
  Clock::time_point deadline;
  bool operator()() {
    if (!seen) {
      pollfd p{ch.fd(), POLLIN, 0};
      if (poll(&p, 1, 0) != 1) return false;
      seen = true;
      deadline = Clock::now() + std::chrono::seconds(15);
    }
    return Clock::now() > deadline;
  }
};

// dials: this peer calls connect(); hub_dials: the hub does (both: each dials the other, as ranks
// of an all-to-all do, and the engines fold the two connections into one peer).
int engine_peer(int index, bool dials, bool hub_dials, int nics, int timeout_s, const Channel& ch) {
  auto made = Engine::create(engine_options(nics));
  if (!made.ok()) die("peer %d: Engine::create: %s", index, made.status().message());
  Engine& e = **made;
  Region rx(e, kMsg), tx(e, kMsg);
  if (!ch.send(e.address(0)) || !ch.send(rx.mr.remote().encode())) die("peer %d: channel", index);
  std::vector<uint8_t> hub_addr, hub_region_bytes;
  if (!ch.recv(&hub_addr, timeout_s * 4000) || !ch.recv(&hub_region_bytes, timeout_s * 1000))
    die("peer %d: no go from the hub", index);  // later waves wait for the earlier ones
  auto hub_region = RemoteRegion::decode(hub_region_bytes);
  if (!hub_region.ok()) die("peer %d: bad region", index);
  Counter wrote;
  double setup_ms = -1;
  Asked asked{ch, false, {}};
  // The connection and the exchange; what failed, or nullptr.
  auto attempt = [&]() -> const char* {
    const auto t0 = Clock::now();
    PeerId hub = 0;
    if (dials) {
      auto p = e.connect(0, hub_addr);
      if (!p.ok()) return "connect_refused";
      hub = p.value();
    }
    for (;;) {
      if (!dials) {
        auto ps = e.peers(0);
        if (!ps.empty()) hub = ps.front();
        if (ps.empty()) {
          if (asked()) return "the_hub_never_connected";
          std::this_thread::sleep_for(std::chrono::microseconds(200));
          continue;
        }
      }
      if (e.peer_ready(0, hub)) break;
      if (e.peer_dead(0, hub)) return "peer_dead_during_the_handshake";
      if (asked()) return "handshake_not_done";
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    setup_ms = ms_between(t0, Clock::now());
    fill_message(tx.ptr, kMsg, kStreamToHub, static_cast<uint64_t>(index));
    if (!e.write_imm(0, hub, LocalSlice{&tx.mr, 0, kMsg}, hub_region.value(), static_cast<size_t>(index) * kMsg,
                     kToHub + static_cast<uint32_t>(index), Notify{&Counter::fire, &wrote})
             .ok())
      return "write_refused";
    // The hub answers on every connection with an immediate, and writes a message to those it dialled.
    while (e.imm_arrived(0, kHello) < 1 || (hub_dials && e.imm_arrived(0, kToPeer) < 1) || wrote.done.load() < 1) {
      if (wrote.errors.load()) return "write_failed";
      if (asked()) return "exchange_not_done";
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    if (hub_dials && check_message(rx.ptr, kMsg, static_cast<uint64_t>(index), kMsg) != Verdict::kOk)
      return "hub_message_does_not_verify";
    return nullptr;
  };
  const char* failed = attempt();
  char report[96];
  std::snprintf(report, sizeof(report), "%s %.3f", failed ? failed : "ok", dials ? setup_ms : -1.0);
  ch.send_str(report);
  for (std::string m; ch.recv_str(&m, timeout_s * 4000) && m != "bye";) {  // "report" is read here
  }
  return 0;
}

// ---- the hub ------------------------------------------------------------------------------------

struct EngineRow {
  int peers = 0;
  Snapshot pre, made, before, after, dead;
  double setup_p50_ms = 0, setup_max_ms = 0, all_ready_ms = 0, idle_cpu_pct = 0;
  double setup_cpu_ms = 0;  // the hub process's CPU from "go" until all were ready
  int connected = 0, verified = 0;  // peers whose exchange completed; of those, verified at the hub
  std::map<std::string, std::vector<int>> failures;  // why -> peer indexes
};

EngineRow engine_row(const Opts& o, int n) {
  EngineRow row;
  row.peers = n;
  row.pre = snapshot();
  auto made = Engine::create(engine_options(o.nics));
  if (!made.ok()) die("hub: Engine::create: %s", made.status().message());
  std::unique_ptr<Engine> hub = std::move(made).value();
  Engine& e = *hub;
  row.made = snapshot();
  // The bench's own memory: a slot per peer for its message, one for ours to it.
  auto slots = std::make_unique<Region>(e, static_cast<size_t>(n) * kMsg);
  auto outs = std::make_unique<Region>(e, static_cast<size_t>(n) * kMsg);

  std::vector<std::unique_ptr<PeerProcess>> procs;
  std::vector<bool> dials(static_cast<size_t>(n)), hub_dials(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    dials[i] = o.dial == "peers" || o.dial == "mutual" || (o.dial == "both" && i % 2 == 1);
    hub_dials[i] = o.dial == "hub" || o.dial == "mutual" || (o.dial == "both" && i % 2 == 0);
    procs.push_back(std::make_unique<PeerProcess>(std::vector<std::string>{
        "engine-peer", std::to_string(i), dials[i] ? "1" : "0", hub_dials[i] ? "1" : "0", std::to_string(o.nics),
        std::to_string(o.timeout_s)}));
    if (!procs.back()->started()) die("could not start peer %d", i);
  }
  std::vector<std::vector<uint8_t>> addrs(static_cast<size_t>(n));
  std::vector<RemoteRegion> regions(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    std::vector<uint8_t> reg;
    if (!procs[i]->channel().recv(&addrs[i], o.timeout_s * 1000) || !procs[i]->channel().recv(&reg, o.timeout_s * 1000))
      die("peer %d did not start its engine", i);
    auto r = RemoteRegion::decode(reg);
    if (!r.ok()) die("peer %d: bad region", i);
    regions[i] = r.value();
  }
  row.before = snapshot();  // the peers run, nothing is connected: what follows is their cost
  const auto addr = e.address(0);
  const auto slots_desc = slots->mr.remote().encode();
  std::vector<PeerId> ids(static_cast<size_t>(n), kAnyPeer);
  std::vector<Clock::time_point> t_connect(static_cast<size_t>(n));
  std::vector<double> setup;
  std::vector<PeerId> inbound_answered;
  std::vector<bool> resolved(static_cast<size_t>(n), false);
  Counter ops;
  int ops_posted = 0, ready = 0, out_dead = 0, n_in = 0;
  Watchdog wd(o.timeout_s);
  const int wave = o.wave > 0 ? o.wave : n;
  const auto t_go = Clock::now();
  const double cpu_go = process_cpu_s();
  for (int first = 0; first < n && !wd.expired(); first += wave) {
    const int last = std::min(n, first + wave);
    // Go: the wave's peers dial us, or we dial them, all at once.
    for (int i = first; i < last; ++i) procs[i]->channel().send(addr), procs[i]->channel().send(slots_desc);
    for (int i = first; i < last; ++i) {
      if (!hub_dials[i]) {
        ++n_in;
        continue;
      }
      t_connect[i] = Clock::now();
      auto p = e.connect(0, addrs[i]);
      if (!p.ok()) die("hub: connect to peer %d: %s", i, p.status().message());
      ids[i] = p.value();
    }
    Watchdog stall(std::min(30, o.timeout_s));
    while (ready < last && !wd.expired()) {
      bool progress = false;
      for (int i = first; i < last; ++i) {
        if (!hub_dials[i] || resolved[i]) continue;
        if (e.peer_dead(0, ids[i])) {
          resolved[i] = true, ++out_dead, progress = true;
          continue;
        }
        if (!e.peer_ready(0, ids[i])) continue;
        setup.push_back(ms_between(t_connect[i], Clock::now()));
        uint8_t* msg = outs->ptr + static_cast<size_t>(i) * kMsg;
        fill_message(msg, kMsg, kStreamToPeer, static_cast<uint64_t>(i));
        must(e.write_imm(0, ids[i], LocalSlice{&outs->mr, static_cast<size_t>(i) * kMsg, kMsg}, regions[i], 0, kToPeer,
                         Notify{&Counter::fire, &ops}),
             "hub: write_imm");
        must(e.imm(0, ids[i], kHello, Notify{&Counter::fire, &ops}), "hub: imm");
        ops_posted += 2, resolved[i] = true, ++ready, progress = true;
      }
      if (static_cast<int>(inbound_answered.size()) < n_in) {
        for (PeerId p : e.peers(0)) {
          if (std::find(inbound_answered.begin(), inbound_answered.end(), p) != inbound_answered.end()) continue;
          if (!e.peer_ready(0, p)) continue;
          must(e.imm(0, p, kHello, Notify{&Counter::fire, &ops}), "hub: imm");
          inbound_answered.push_back(p);
          ++ops_posted, ++ready, progress = true;
        }
      }
      if (progress) stall.progressed();
      else if (stall.expired()) break;  // what has not come in 30 s will not
      else std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }
  row.all_ready_ms = ms_between(t_go, Clock::now());
  row.setup_cpu_ms = (process_cpu_s() - cpu_go) * 1e3;
  while (ops.done.load() < ops_posted) {
    if (wd.expired()) die("hub: operations did not complete");
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  // Reports: a peer whose exchange has not completed by now answers with what failed.
  for (int i = 0; i < n; ++i) procs[i]->channel().send_str("report");
  for (int i = 0; i < n; ++i) {
    std::string rep;
    if (!procs[i]->channel().recv_str(&rep, o.timeout_s * 1000)) die("peer %d sent no report", i);
    double ms = -1;
    char verdict[64] = {};
    if (std::sscanf(rep.c_str(), "%63s %lf", verdict, &ms) != 2) die("peer %d: bad report %s", i, rep.c_str());
    if (std::string(verdict) != "ok") {
      row.failures[std::string(verdict) + (dials[i] && hub_dials[i] ? " (both dialled)"
                                           : dials[i]              ? " (it dialled)"
                                                                   : " (the hub dialled)")]
          .push_back(i);
      continue;
    }
    ++row.connected;
    if (ms >= 0) setup.push_back(ms);
    // Its message to us landed before it reported (its write completed, and our answer reached it).
    const uint32_t v = kToHub + static_cast<uint32_t>(i);
    while (e.imm_arrived(0, v) < 1 && !wd.expired()) std::this_thread::sleep_for(std::chrono::microseconds(100));
    if (e.imm_arrived(0, v) >= 1 &&
        check_message(slots->ptr + static_cast<size_t>(i) * kMsg, kMsg, static_cast<uint64_t>(i), kMsg) == Verdict::kOk) {
      e.consume_imm(0, v, 1);
      ++row.verified;
    } else {
      row.failures["message_to_the_hub_does_not_verify"].push_back(i);
    }
  }
  if (ops.errors.load()) row.failures["hub_operations_failed"].push_back(ops.errors.load());
  row.setup_p50_ms = median(setup);
  row.setup_max_ms = setup.empty() ? 0 : *std::max_element(setup.begin(), setup.end());
  row.after = snapshot();
  const double cpu0 = process_cpu_s();
  const auto t_idle = Clock::now();
  std::this_thread::sleep_for(std::chrono::seconds(1));
  row.idle_cpu_pct = 100.0 * (process_cpu_s() - cpu0) / (ms_between(t_idle, Clock::now()) / 1000.0);
  // The peers go; the hub sees each dead.
  for (auto& p : procs) p->channel().send_str("bye");
  for (int i = 0; i < n; ++i)
    if (procs[i]->wait_exit(o.timeout_s * 1000) != 0) die("peer %d did not exit cleanly", i);
  std::vector<PeerId> all = inbound_answered;
  for (int i = 0; i < n; ++i)
    if (hub_dials[i]) all.push_back(ids[i]);
  Watchdog dead(o.timeout_s);
  while (!std::all_of(all.begin(), all.end(), [&](PeerId p) { return e.peer_dead(0, p); })) {
    if (dead.expired()) die("hub: peers not seen dead after %d s", o.timeout_s);
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  row.dead = snapshot();  // the channels to the exited peers are still open, as at "before"
  procs.clear();
  outs.reset();
  slots.reset();
  hub.reset();
  return row;
}

// ---- the control port's queue of connections waiting to authenticate ------------------------------

struct PendingRow {
  int silent = 0;
  bool connected = false;
  double ms = 0;
};

// k raw TCP connections to a fresh hub's control port that take its challenge and stay silent (as
// dialers whose proofs have not arrived yet), then a real engine in this process dials the hub.
PendingRow pending_probe(const Opts& o, int k) {
  PendingRow row;
  row.silent = k;
  auto hub = Engine::create(engine_options(o.nics));
  auto dialer = Engine::create(engine_options(o.nics));
  if (!hub.ok() || !dialer.ok()) die("pending probe: Engine::create failed");
  const auto addr = (*hub)->address(0);
  auto ga = GroupAddress::decode(addr);
  if (!ga.ok()) die("pending probe: %s", ga.status().message());
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  std::memcpy(&sa.sin_addr, ga->ip, 4);
  sa.sin_port = htons(ga->port);
  std::vector<int> fds;
  for (int i = 0; i < k; ++i) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0 || connect(fd, reinterpret_cast<const sockaddr*>(&sa), sizeof(sa)) != 0) die("pending probe: connect");
    fds.push_back(fd);
  }
  // Each has been accepted once its challenge arrived (the closed ones beyond the cap read EOF).
  for (int fd : fds) {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, o.timeout_s * 1000) != 1) die("pending probe: the hub never answered a connection");
  }
  const auto t0 = Clock::now();
  auto peer = (*dialer)->connect(0, addr);
  if (!peer.ok()) die("pending probe: connect: %s", peer.status().message());
  Watchdog wd(o.timeout_s);
  while (!(*dialer)->peer_ready(0, *peer) && !(*dialer)->peer_dead(0, *peer) && !wd.expired())
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  row.connected = (*dialer)->peer_ready(0, *peer);
  row.ms = ms_between(t0, Clock::now());
  for (int fd : fds) close(fd);
  return row;
}

void print_pending(const std::vector<PendingRow>& rows) {
  if (rows.empty()) return;
  std::printf("\n# control port: k connections accepted and silent (waiting to authenticate, kMaxPending %zu, each "
              "dropped after min(PONTE_TIMEOUT_MS, %u ms)), then a real peer dials\n",
              kMaxPending, kAuthWindowMs);
  std::printf("%8s %-10s %9s\n", "silent", "real peer", "ms");
  for (const PendingRow& r : rows)
    std::printf("%8d %-10s %9.1f\n", r.silent, r.connected ? "connected" : "REFUSED", r.ms);
  std::fflush(stdout);
}

// ---- the plugin --------------------------------------------------------------------------------

void plugin_logger(nccl_abi::LogLevel level, unsigned long, const char*, int, const char* fmt, ...) {
  if (level != nccl_abi::kLogWarn) return;
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof(buf), fmt, ap);
  va_end(ap);
  std::fprintf(stderr, "[nccl-log warn pid %d] %s\n", static_cast<int>(getpid()), buf);
}

struct PluginRow {
  int pairs = 0;
  Snapshot before, after, closed;
  double setup_ms = 0, per_pair_ms = 0;
};

class PluginSide {
 public:
  PluginSide(const Channel& ch, int timeout_s) : ch_(ch), timeout_s_(timeout_s) {
    auto& l = plugin_test::lib();
    if (!l.v11) die("cannot load %s: %s", plugin_test::plugin_path().c_str(), l.error.c_str());
    t_ = l.v11;
    nccl_abi::CommConfig config{nccl_abi::kTrafficClassUndef};
    check(t_->init(&ctx_, 0x5ca1e, &config, &plugin_logger, nullptr), "init");
    int ndev = 0;
    check(t_->devices(&ndev), "devices");
    if (ndev < 1) die("the plugin has no device");
  }
  ~PluginSide() { t_->finalize(ctx_); }

  // c comm pairs each way, established at once, one verified message per comm each way.
  // Returns the time from the first listen to the last comm established.
  double open(int c) {
    const auto t0 = Clock::now();
    listens_.assign(static_cast<size_t>(c), nullptr);
    std::vector<uint8_t> handles(static_cast<size_t>(c) * sizeof(plugin_test::Handle));
    for (int i = 0; i < c; ++i)
      check(t_->listen(ctx_, 0, handles.data() + static_cast<size_t>(i) * sizeof(plugin_test::Handle), &listens_[i]),
            "listen");
    theirs_ = trade(ch_, handles, timeout_s_, "listen handles");
    if (theirs_.size() != handles.size()) die("handle count differs");
    sends_.assign(static_cast<size_t>(c), nullptr);
    recvs_.assign(static_cast<size_t>(c), nullptr);
    int open = 0;
    Watchdog wd(timeout_s_);
    nccl_abi::DeviceHandle* dh = nullptr;
    while (open < 2 * c) {
      bool progress = false;
      for (int i = 0; i < c; ++i) {
        if (!sends_[i]) {
          check(t_->connect(ctx_, 0, theirs_.data() + static_cast<size_t>(i) * sizeof(plugin_test::Handle), &sends_[i], &dh),
                "connect");
          if (sends_[i]) ++open, progress = true;
        }
        if (!recvs_[i]) {
          check(t_->accept(listens_[i], &recvs_[i], &dh), "accept");
          if (recvs_[i]) ++open, progress = true;
        }
      }
      if (progress) wd.progressed();
      else if (wd.expired()) die("plugin: %d of %d comms open after %d s", open, 2 * c, timeout_s_);
      else std::this_thread::yield();
    }
    const double ms = ms_between(t0, Clock::now());
    for (void*& l : listens_) check(t_->close_listen(l), "closeListen");
    listens_.clear();
    exchange(c);
    return ms;
  }
  void close_all() {
    for (void* s : sends_) check(t_->close_send(s), "closeSend");
    for (void* r : recvs_) check(t_->close_recv(r), "closeRecv");
    sends_.clear();
    recvs_.clear();
    // Closed comms wait for the other end's acknowledgement and go at the plugin's next call.
    for (int round = 0; round < 2; ++round) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      plugin_test::Handle h;
      void* l = nullptr;
      check(t_->listen(ctx_, 0, h.bytes, &l), "listen");
      check(t_->close_listen(l), "closeListen");
    }
    sync(ch_, "closed", timeout_s_);
  }

 private:
  void check(int r, const char* what) const {
    if (r != nccl_abi::kSuccess) die("plugin %s: ncclResult %d", what, r);
  }
  // One message each way on every comm, verified; buffers registered on the comms (and released).
  void exchange(int c) {
    const size_t len = 1024;
    std::vector<uint8_t*> tx(static_cast<size_t>(c)), rx(static_cast<size_t>(c));
    std::vector<void*> smh(static_cast<size_t>(c)), rmh(static_cast<size_t>(c)), sreq(static_cast<size_t>(c)),
        rreq(static_cast<size_t>(c));
    uint8_t* pool = static_cast<uint8_t*>(std::aligned_alloc(4096, 2 * static_cast<size_t>(c) * 4096));
    for (int i = 0; i < c; ++i) {
      tx[i] = pool + static_cast<size_t>(2 * i) * 4096;
      rx[i] = tx[i] + 4096;
      fill_message(tx[i], len, 31, static_cast<uint64_t>(i));
      check(t_->reg_mr(sends_[i], tx[i], 4096, nccl_abi::kPtrHost, &smh[i]), "regMr");
      check(t_->reg_mr(recvs_[i], rx[i], 4096, nccl_abi::kPtrHost, &rmh[i]), "regMr");
    }
    int done = 0;
    std::vector<int> state(static_cast<size_t>(c), 0);  // bit 0 sent, bit 1 received
    Watchdog wd(timeout_s_);
    while (done < 2 * c) {
      bool progress = false;
      for (int i = 0; i < c; ++i) {
        if (!(state[i] & 2) && !rreq[i]) {
          void* data[1] = {rx[i]};
          size_t sizes[1] = {4096};
          int tags[1] = {0};
          void* mhs[1] = {rmh[i]};
          check(t_->irecv(recvs_[i], 1, data, sizes, tags, mhs, nullptr, &rreq[i]), "irecv");
        }
        if (!(state[i] & 1) && !sreq[i]) check(t_->isend(sends_[i], tx[i], len, 0, smh[i], nullptr, &sreq[i]), "isend");
        int d = 0, sizes[1] = {0};
        if (sreq[i]) {
          check(t_->test(sreq[i], &d, sizes), "test");
          if (d) sreq[i] = nullptr, state[i] |= 1, ++done, progress = true;
        }
        if (rreq[i]) {
          check(t_->test(rreq[i], &d, sizes), "test");
          if (d) {
            rreq[i] = nullptr, state[i] |= 2, ++done, progress = true;
            if (check_message(rx[i], static_cast<size_t>(sizes[0]), static_cast<uint64_t>(i), len) != Verdict::kOk)
              die("plugin: comm %d's message does not verify", i);
          }
        }
      }
      if (progress) wd.progressed();
      else if (wd.expired()) die("plugin: %d of %d messages after %d s", done, 2 * c, timeout_s_);
      else std::this_thread::yield();
    }
    sync(ch_, "exchanged", timeout_s_);
    for (int i = 0; i < c; ++i) {
      check(t_->dereg_mr(sends_[i], smh[i]), "deregMr");
      check(t_->dereg_mr(recvs_[i], rmh[i]), "deregMr");
    }
    std::free(pool);
  }

  const Channel& ch_;
  int timeout_s_;
  NetV11* t_ = nullptr;
  void* ctx_ = nullptr;
  std::vector<void*> listens_, sends_, recvs_;
  std::vector<uint8_t> theirs_;
};

// Both processes run the same rounds; side A (this one) measures.
std::vector<PluginRow> plugin_rounds(const std::vector<int>& comms, int timeout_s, const Channel& ch, bool measure) {
  PluginSide side(ch, timeout_s);
  side.open(1);  // warm-up: the device's engine is built on first use and kept
  side.close_all();
  std::vector<PluginRow> rows;
  for (int c : comms) {
    PluginRow r;
    r.pairs = c;
    sync(ch, "round", timeout_s);
    if (measure) r.before = snapshot();
    r.setup_ms = side.open(c);
    r.per_pair_ms = r.setup_ms / c;
    if (measure) r.after = snapshot();
    sync(ch, "measured", timeout_s);
    side.close_all();
    if (measure) r.closed = snapshot();
    rows.push_back(r);
  }
  return rows;
}

// ---- tables and the projection --------------------------------------------------------------------

int fi_index(const char* name) {
  for (int k = 0; k < kFiKinds; ++k)
    if (std::string(kFiNames[k]) == name) return k;
  return 0;
}


std::string load_average() {
  char b[64] = "?";
  if (FILE* f = std::fopen("/proc/loadavg", "r")) {
    if (!std::fgets(b, sizeof(b), f)) b[0] = 0;
    std::fclose(f);
  }
  std::string s = b;
  while (!s.empty() && s.back() == '\n') s.pop_back();
  return s;
}

// Least-squares line through (x, y): y = first + per * x. With one row, all of it is "per".
struct Fit {
  double first = 0, per = 0;
};
Fit fit(const std::vector<double>& x, const std::vector<double>& y) {
  const size_t n = x.size();
  if (n == 0) return {};
  if (n == 1) return {0, y[0] / x[0]};
  double sx = 0, sy = 0, sxx = 0, sxy = 0;
  for (size_t i = 0; i < n; ++i) sx += x[i], sy += y[i], sxx += x[i] * x[i], sxy += x[i] * y[i];
  const double per = (n * sxy - sx * sy) / (n * sxx - sx * sx);
  return {(sy - per * sx) / n, per};
}

// One resource measured over the rows: its delta per row and its fitted cost.
struct Series {
  const char* name;
  const char* unit;
  std::vector<double> x, y;
  Fit f() const { return fit(x, y); }
};

void print_fits(const char* what, const std::vector<Series>& series) {
  std::printf("# fitted over the complete rows (delta = first + %s x count):\n", what);
  for (const Series& s : series) {
    const Fit f = s.f();
    std::printf("#   %-14s %10.2f %-4s per %s, %10.1f %-4s at the first\n", s.name, f.per, s.unit, what, f.first, s.unit);
  }
}

std::vector<Series> engine_series(const std::vector<EngineRow>& rows) {
  const int av = fi_index("fi_av_entry"), ep = fi_index("fi_endpoint");
  std::vector<Series> out = {{"fds", "", {}, {}}, {"threads", "", {}, {}}, {"heap", "KiB", {}, {}},
                             {"RSS", "KiB", {}, {}}, {"AV entries", "", {}, {}}, {"endpoints", "", {}, {}}};
  for (const EngineRow& r : rows) {
    if (r.verified != r.peers) continue;  // a row where some connections failed measures less
    const double n = r.peers;
    const double d[] = {static_cast<double>(r.after.fds - r.before.fds), static_cast<double>(r.after.threads - r.before.threads),
                        static_cast<double>(r.after.heap_kib - r.before.heap_kib),
                        static_cast<double>(r.after.rss_kib - r.before.rss_kib),
                        static_cast<double>(r.after.fi[av] - r.before.fi[av]),
                        static_cast<double>(r.after.fi[ep] - r.before.fi[ep])};
    for (size_t k = 0; k < out.size(); ++k) out[k].x.push_back(n), out[k].y.push_back(d[k]);
  }
  if (!rows.empty() && !rows.front().before.fi_known) out.resize(4);
  return out;
}

std::vector<Series> plugin_series(const std::vector<PluginRow>& rows) {
  const int mr = fi_index("fi_mr");
  std::vector<Series> out = {{"fds", "", {}, {}}, {"threads", "", {}, {}}, {"heap", "KiB", {}, {}},
                             {"RSS", "KiB", {}, {}}, {"MRs", "", {}, {}}, {"setup", "ms", {}, {}}};
  for (const PluginRow& r : rows) {
    const double c = r.pairs;
    const double d[] = {static_cast<double>(r.after.fds - r.before.fds), static_cast<double>(r.after.threads - r.before.threads),
                        static_cast<double>(r.after.heap_kib - r.before.heap_kib),
                        static_cast<double>(r.after.rss_kib - r.before.rss_kib),
                        static_cast<double>(r.after.fi[mr] - r.before.fi[mr]), r.setup_ms};
    for (size_t k = 0; k < out.size(); ++k) out[k].x.push_back(c), out[k].y.push_back(d[k]);
  }
  if (!rows.empty() && !rows.front().before.fi_known) out.erase(out.begin() + 4);
  return out;
}

void print_engine(const Opts& o, const std::vector<EngineRow>& rows) {
  if (rows.empty()) return;
  const EngineRow& f = rows.front();
  const bool fi = f.before.fi_known;
  const int av = fi_index("fi_av_entry"), ep = fi_index("fi_endpoint"), mr = fi_index("fi_mr"), cq = fi_index("fi_cq");
  std::printf("\n# ponte-scale engine: provider %s, %d NIC%s, a hub engine and N peer processes on loopback "
              "(%ld cores: oversubscribed), dial %s; every connection verified both ways\n",
              o.provider.c_str(), o.nics, o.nics > 1 ? "s" : "", sysconf(_SC_NPROCESSORS_ONLN), o.dial.c_str());
  std::printf("# load average at the end: %s\n", load_average().c_str());
  std::printf("# one engine before any peer: fds %+ld, threads %+ld, heap %+.1f MiB, RSS %+.1f MiB", f.made.fds - f.pre.fds,
              f.made.threads - f.pre.threads, (f.made.heap_kib - f.pre.heap_kib) / 1024.0,
              (f.made.rss_kib - f.pre.rss_kib) / 1024.0);
  if (fi)
    std::printf(", fi endpoints %+ld, CQs %+ld, MRs %+ld", f.made.fi[ep] - f.pre.fi[ep], f.made.fi[cq] - f.pre.fi[cq],
                f.made.fi[mr] - f.pre.fi[mr]);
  std::printf("\n# hub deltas from N idle, unconnected peers to N connected and used; after: the peers exited, seen dead\n");
  std::printf("%5s %5s %6s %5s %9s %9s %5s %4s %9s %9s %9s %9s %8s | %9s %7s %9s\n", "peers", "ok", "fds", "thr",
              "heap KiB", "RSS KiB", "AV", "EPs", "setup p50", "setup max", "all ready", "hub CPU/p", "idle CPU",
              "after fds", "AV", "heap KiB");
  for (const EngineRow& r : rows) {
    std::printf("%5d %5d %+6ld %+5ld %+9ld %+9ld %5s %4s %7.1fms %7.1fms %7.1fms %7.2fms %7.1f%% | %+9ld %7s %+9ld\n",
                r.peers, r.verified,
                r.after.fds - r.before.fds, r.after.threads - r.before.threads, r.after.heap_kib - r.before.heap_kib,
                r.after.rss_kib - r.before.rss_kib, fi ? std::to_string(r.after.fi[av] - r.before.fi[av]).c_str() : "-",
                fi ? std::to_string(r.after.fi[ep] - r.before.fi[ep]).c_str() : "-", r.setup_p50_ms, r.setup_max_ms,
                r.all_ready_ms, r.setup_cpu_ms / r.peers, r.idle_cpu_pct, r.dead.fds - r.before.fds,
                fi ? std::to_string(r.dead.fi[av] - r.before.fi[av]).c_str() : "-", r.dead.heap_kib - r.before.heap_kib);
    for (const auto& [why, who] : r.failures) {
      std::string list;
      for (size_t k = 0; k < who.size() && k < 12; ++k) {
        if (k) list += ',';
        list += std::to_string(who[k]);
      }
      std::printf("      %zu of %d peers failed: %s [%s%s]\n", who.size(), r.peers, why.c_str(), list.c_str(),
                  who.size() > 12 ? ",..." : "");
    }
  }
  print_fits("peer", engine_series(rows));
  std::fflush(stdout);
}

void print_plugin(const std::vector<PluginRow>& rows) {
  if (rows.empty()) return;
  const int mr = fi_index("fi_mr");
  const bool fi = rows.front().before.fi_known;
  std::printf("\n# ponte-scale plugin: two processes, each with C send comms + C recv comms (a pair = one of each) "
              "opened at once and one verified message per comm each way; deltas of this process\n");
  std::printf("%6s %6s %5s %9s %9s %6s %9s %8s | %11s %9s %5s\n", "pairs", "fds", "thr", "heap KiB", "RSS KiB", "MRs",
              "setup ms", "ms/pair", "closed: fds", "heap KiB", "MRs");
  for (const PluginRow& r : rows) {
    std::printf("%6d %+6ld %+5ld %+9ld %+9ld %6s %9.1f %8.2f | %+11ld %+9ld %5s\n", r.pairs, r.after.fds - r.before.fds,
                r.after.threads - r.before.threads, r.after.heap_kib - r.before.heap_kib, r.after.rss_kib - r.before.rss_kib,
                fi ? std::to_string(r.after.fi[mr] - r.before.fi[mr]).c_str() : "-", r.setup_ms, r.per_pair_ms,
                r.closed.fds - r.before.fds, r.closed.heap_kib - r.before.heap_kib,
                fi ? std::to_string(r.closed.fi[mr] - r.before.fi[mr]).c_str() : "-");
  }
  print_fits("pair", plugin_series(rows));
  std::fflush(stdout);
}

// The fitted costs times 1,024 peers per NIC, against each resource's limit.
void print_projection(const std::vector<EngineRow>& er, const std::vector<PluginRow>& pr) {
  constexpr int kPeers = 1024;
  // NCCL opens a send and a recv comm per peer per p2p channel (NCCL_NCHANNELS_PER_NET_PEER, 2).
  constexpr int kPairsPerPeer = 2;
  std::printf("\n# projection to 1,024 peers per NIC (128 nodes x 8 GPUs, one NIC per GPU: each rank's device engine meets "
              "1,023 others; NCCL: %d comm pairs per peer), from the fits above\n", kPairsPerPeer);
  std::printf("%-26s %12s %14s  %s\n", "resource", "per peer", "at 1,024", "limit");
  rlimit nofile{};
  getrlimit(RLIMIT_NOFILE, &nofile);
  auto row = [](const char* name, double per_peer, double first, const char* unit, const std::string& limit) {
    char at[48];
    std::snprintf(at, sizeof(at), "%.0f%s", first + per_peer * kPeers, unit);
    std::printf("%-26s %12.2f %14s  %s\n", name, per_peer, at, limit.c_str());
  };
  if (!er.empty()) {
    auto s = engine_series(er);
    row("fds (engine)", s[0].f().per, s[0].f().first, "",
        "RLIMIT_NOFILE: " + std::to_string(nofile.rlim_cur) + " here (soft), 1024 a common default");
    row("threads (engine)", s[1].f().per, s[1].f().first, "", "one worker per group");
    row("heap (engine)", s[2].f().per, s[2].f().first, " KiB", "host memory");
    row("RSS (engine)", s[3].f().per, s[3].f().first, " KiB", "host memory");
    if (s.size() > 4) row("AV entries (engine)", s[4].f().per, s[4].f().first, "", "provider's AV (shm: 256 in 1.17); a dead peer's stays");
    row("peer ids (engine)", 1, 0, "", "kMaxPeers " + std::to_string(kMaxPeers) + " per group over its life (never reused)");
  }
  if (!pr.empty()) {
    auto s = plugin_series(pr);
    row("plugin comm ids", 2.0 * kPairsPerPeer, 0, "", "kMaxCommId " + std::to_string(plugin::kMaxCommId) + " per device");
    row("plugin heap", s[2].f().per * kPairsPerPeer, s[2].f().first, " KiB", "host memory per device");
    if (s.size() > 5) row("plugin MRs", s[4].f().per * kPairsPerPeer, s[4].f().first, "", "registrations per NIC (device max_mr)");
  }
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 2 && std::string(argv[1]) == "--ponte-peer") {
    const std::string role = argv[2];
    Channel ch(3);
    fix_malloc_thresholds();  // the environment came from the hub
    if (role == "engine-peer" && argc == 8)
      return engine_peer(std::stoi(argv[3]), std::string(argv[4]) == "1", std::string(argv[5]) == "1",
                         std::stoi(argv[6]), std::stoi(argv[7]), ch);
    if (role == "plugin-peer" && argc == 5) {
      plugin_rounds(parse_list(argv[3]), std::stoi(argv[4]), ch, false);
      return 0;
    }
    die("unknown peer role %s", role.c_str());
  }
  const Opts o = parse(argc, argv, 1);
  set_environment(o);
  fix_malloc_thresholds();
  std::vector<EngineRow> er;
  std::vector<PluginRow> pr;
  if (o.engine) {
    for (int n : o.peers) {
      er.push_back(engine_row(o, n));
      std::fprintf(stderr, "ponte-scale: %d peers done\n", n);
    }
    print_engine(o, er);
  }
  std::vector<PendingRow> pend;
  if (o.engine) {
    for (int k : o.pending) pend.push_back(pending_probe(o, k));
    print_pending(pend);
  }
  if (o.plugin && !o.comms.empty()) {
    std::string list;
    for (int c : o.comms) list += (list.empty() ? "" : ",") + std::to_string(c);
    PeerProcess peer({"plugin-peer", list, std::to_string(o.timeout_s)});
    if (!peer.started()) die("could not start the plugin peer");
    pr = plugin_rounds(o.comms, o.timeout_s, peer.channel(), true);
    if (peer.wait_exit(o.timeout_s * 1000) != 0) die("the plugin peer did not exit cleanly");
    print_plugin(pr);
  }
  print_projection(er, pr);
  int incomplete = 0;
  for (const EngineRow& r : er) incomplete += r.verified != r.peers;
  if (incomplete) std::printf("ponte-scale: %d engine row(s) INCOMPLETE: some connections did not verify (above)\n", incomplete);
  return incomplete ? 1 : 0;
}
