// plugin-bench: any NCCL net plugin driven as NCCL's proxy thread drives it (dlopen, isend/irecv/
// test from one thread), bandwidth and ping-pong latency tables, another plugin alongside for ratios.
//
//   plugin-bench [--plugin PATH] [--compare PATH] [--caller yield,spin] [--pass nccl|all]
//                [--sizes 1k,..,64m] [--lat-sizes 8,..,64k] [--window 8] [--bytes 1g] [--iters N]
//                [--lat-iters 1000] [--lat-depth 1] [--lat-recv 0] [--repeat 3] [--nics 1] [--devs A,B] [--channels 1]
//                [--engine-size 4m] [--no-engine] [--abi 11|10|9|8] [--timeout 60] [--json]
//
// Every run is two fresh processes (this binary started again), each loading one plugin (the
// newest of ncclNetPlugin_v11 .. _v8 it exports, or the one --abi names), reading its device
// properties, listening, connecting to the other and accepting; side A sends and measures, side B
// receives. With --compare the two plugins run alternately, --repeat times each, taking turns to
// go first; the best run per row is kept and the spread over the runs printed beside it, and under
// each table every round's own ratio (the two runs side by side) with their median (the host is
// shared; the load average is printed before and after). The bandwidth loop makes one plugin call
// per pass per comm, as NCCL's proxy does (--pass nccl): post the next request if its slot is free,
// or else test the oldest one; --pass all posts every free slot and tests every request on each
// pass.
// --channels N connects N send/receive comm pairs between the two sides, as NCCL opens one per
// channel, and the pass goes over all of them (NCCL's proxy steps every channel's op in one loop):
// a row's messages are dealt round the channels, each with its own window.
// The engine's own write-with-immediate bandwidth (the ceiling of ponte's plugin) is measured in
// this process at --engine-size with the same caller loop. --devs A,B puts side A on the plugin's
// device A and side B on device B (and the engine's ends on the backend's devices A and B), as two
// NICs of one host talk (default 0,0: one device talks to itself). --lat-depth N keeps N receives
// posted on each side of the ping-pong (1: the next receive only, posted just before the answer;
// NCCL's proxy keeps one posted per free step, up to 8, ahead of the data). --lat-recv N posts each
// ping-pong receive with an N-byte buffer (at least the message): NCCL posts whole step buffers
// (64 KiB for its LL protocol) whatever it then sends into them.
// The environment picks the provider for each plugin as it would under NCCL; the defaults here are
// PONTE_BACKEND=fabric, PONTE_FABRIC_PROVIDER=tcp;ofi_rxm and FI_TCP_IFACE=lo (loopback only).
#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <cinttypes>
#include <cstdio>
#include <ctime>
#include <deque>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "core/engine.h"
#include "tests/plugin/harness.h"

using namespace ponte;
using namespace ponte::plugin_test;

namespace {

struct Options {
  std::string plugin;
  std::string compare;
  std::vector<std::string> callers = {"yield", "spin"};
  bool nccl_pass = true;  // --pass nccl (one call per pass, oldest request tested) or all
  int abi = 0;            // --abi 11|10|9|8: that ncclNet table (0: the newest exported)
  std::vector<size_t> sizes;
  std::vector<size_t> lat_sizes;
  int window = 8;
  size_t bytes = 1ull << 30;  // per bandwidth row: iterations = bytes / size within 64..20000
  int iters = 0;              // fixed iterations per bandwidth row (0: from --bytes)
  int warmup = -1;            // -1: max(2 x window, iters / 10)
  int lat_iters = 1000;
  int lat_depth = 1;  // --lat-depth N: receives kept posted on each side of the ping-pong
  size_t lat_recv = 0;  // --lat-recv N: bytes posted per ping-pong receive (0: the message size)
  int repeat = 3;
  int nics = 1;
  int dev_a = 0, dev_b = 0;  // --devs A,B
  int channels = 1;          // --channels N: comm pairs, each with `window` requests in flight
  size_t engine_size = 4u << 20;
  bool engine = true;
  int timeout_s = 60;
  bool json = false;
  std::vector<std::string> args;  // as given, for the side processes
};

[[noreturn]] void die(const char* what) {
  std::fprintf(stderr, "plugin-bench: %s\n", what);
  std::exit(1);
}

size_t parse_bytes(const std::string& s) {
  char* end = nullptr;
  double v = std::strtod(s.c_str(), &end);
  if (end == s.c_str()) die(("not a size: " + s).c_str());
  switch (end && *end ? (*end | 0x20) : 0) {
    case 'k':
      v *= 1024;
      break;
    case 'm':
      v *= 1024 * 1024;
      break;
    case 'g':
      v *= 1024.0 * 1024 * 1024;
      break;
    default:
      break;
  }
  return static_cast<size_t>(v);
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

std::vector<size_t> parse_sizes(const std::string& s) {
  std::vector<size_t> out;
  for (auto& item : split(s)) out.push_back(parse_bytes(item));
  return out;
}

constexpr const char* kUsage =
    "usage: plugin-bench [--plugin PATH] [--compare PATH] [--caller yield,spin] [--pass nccl|all]\n"
    "                    [--sizes LIST] [--lat-sizes LIST] [--window 8] [--bytes 1g] [--iters N]\n"
    "                    [--warmup N] [--lat-iters 1000] [--lat-depth 1] [--lat-recv 0] [--repeat 3]\n"
    "                    [--nics 1] [--devs A,B] [--channels 1]\n"
    "                    [--engine-size 4m] [--abi 11|10|9|8] [--no-engine] [--timeout 60] [--json]\n";

Options parse_options(int argc, char** argv, int first) {
  Options o;
  o.plugin = plugin_path();
  o.sizes = parse_sizes("1k,4k,16k,64k,256k,1m,4m,16m,64m");
  o.lat_sizes = parse_sizes("8,64,512,4k,16k,64k");
  for (int i = first; i < argc; ++i) {
    const std::string a = argv[i];
    o.args.push_back(a);
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) die(("missing value after " + a).c_str());
      o.args.push_back(argv[i + 1]);
      return argv[++i];
    };
    if (a == "--plugin") o.plugin = next();
    else if (a == "--compare") o.compare = next();
    else if (a == "--caller") o.callers = split(next());
    else if (a == "--pass") {
      const std::string v = next();
      if (v != "nccl" && v != "all") die("--pass takes nccl or all");
      o.nccl_pass = v == "nccl";
    }
    else if (a == "--sizes" || a == "--size") o.sizes = parse_sizes(next());
    else if (a == "--lat-sizes") o.lat_sizes = parse_sizes(next());
    else if (a == "--abi") o.abi = std::stoi(next());
    else if (a == "--window") o.window = std::stoi(next());
    else if (a == "--bytes") o.bytes = parse_bytes(next());
    else if (a == "--iters") o.iters = std::stoi(next());
    else if (a == "--warmup") o.warmup = std::stoi(next());
    else if (a == "--lat-iters") o.lat_iters = std::stoi(next());
    else if (a == "--lat-depth") o.lat_depth = std::stoi(next());
    else if (a == "--lat-recv") o.lat_recv = parse_bytes(next());
    else if (a == "--repeat") o.repeat = std::stoi(next());
    else if (a == "--nics") o.nics = std::stoi(next());
    else if (a == "--devs") {
      const std::string v = next();
      const size_t comma = v.find(',');
      if (comma == std::string::npos) die("--devs takes A,B (device indexes)");
      o.dev_a = std::stoi(v.substr(0, comma));
      o.dev_b = std::stoi(v.substr(comma + 1));
    }
    else if (a == "--channels") o.channels = std::stoi(next());
    else if (a == "--engine-size") o.engine_size = parse_bytes(next());
    else if (a == "--no-engine") o.engine = false;
    else if (a == "--timeout") o.timeout_s = std::stoi(next());
    else if (a == "--json") o.json = true;
    else {
      std::fputs(kUsage, stderr);
      std::exit(2);
    }
  }
  for (auto& c : o.callers)
    if (c != "yield" && c != "spin") die("--caller takes yield, spin or both");
  for (size_t s : o.sizes)
    if (s == 0) die("sizes must be > 0");
  if (o.abi != 0 && (o.abi < 8 || o.abi > 11)) die("--abi takes 8, 9, 10 or 11");
  if (o.window < 1 || o.window > kMaxRequests || o.nics < 1 || o.nics > kMaxDevsPerNic ||
      o.repeat < 1 || o.lat_iters < 1 || o.iters < 0 || o.timeout_s < 1 || o.callers.empty())
    die("window must be 1..32, nics 1..4, repeat, lat-iters and timeout > 0");
  if (o.lat_depth < 1 || o.lat_depth > 8) die("--lat-depth takes 1..8");
  if (o.dev_a < 0 || o.dev_b < 0) die("--devs: device indexes are >= 0");
  if (o.channels < 1 || o.channels > 32) die("--channels takes 1..32");
  if (o.nics > 1 && (o.dev_a != 0 || o.dev_b != 0)) die("--devs with --nics > 1: not supported");
  return o;
}

int bw_iters(const Options& o, size_t size) {
  if (o.iters > 0) return o.iters;
  return static_cast<int>(std::clamp<size_t>(o.bytes / size, 64, 20000));
}
int bw_warmup(const Options& o, int iters) {
  return o.warmup >= 0 ? o.warmup : std::max(2 * o.window * o.channels, iters / 10);
}

// ---- time and CPU -----------------------------------------------------------------------------

double thread_cpu_ns() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) * 1e9 + static_cast<double>(ts.tv_nsec);
}
double process_cpu_ns() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  auto ns = [](const timeval& t) { return static_cast<double>(t.tv_sec) * 1e9 + t.tv_usec * 1e3; };
  return ns(ru.ru_utime) + ns(ru.ru_stime);
}

// A measured interval: wall time, the calling (proxy) thread's CPU and the whole process's CPU.
struct Meter {
  Clock::time_point t0;
  double thread0 = 0, proc0 = 0;
  void start() {
    t0 = Clock::now();
    thread0 = thread_cpu_ns();
    proc0 = process_cpu_ns();
  }
  double secs() const { return std::chrono::duration<double>(Clock::now() - t0).count(); }
  double thread_ns() const { return thread_cpu_ns() - thread0; }
  double proc_ns() const { return process_cpu_ns() - proc0; }
};

// The caller loop's two styles: NCCL's proxy thread yields when a pass over its work made no
// progress ("yield"); a busy-polling caller never does ("spin").
struct Caller {
  bool yield = true;
  void pass(bool progress) const {
    if (yield && !progress) std::this_thread::yield();
  }
};

// ---- loading a plugin -------------------------------------------------------------------------

// The newest table the library exports (v11, v10, v9 or v8), seen through the v11 layout: the
// older tables' calls are forwarded by the shims below (one plugin per process).
struct Loaded {
  void* handle = nullptr;
  int version = 0;
  NetV11 table{};
};
NetV10* g_v10 = nullptr;
NetV9* g_v9 = nullptr;
NetV8* g_v8 = nullptr;

NcclResult v10_init(void** ctx, uint64_t, CommConfig*, Logger logger, ProfilerCallback prof) {
  *ctx = nullptr;
  return g_v10->init(logger, prof);
}
NcclResult v10_listen(void*, int dev, void* handle, void** comm) { return g_v10->listen(dev, handle, comm); }
NcclResult v10_connect(void*, int dev, void* handle, void** comm, DeviceHandle** dh) {
  CommConfig config{kTrafficClassUndef};
  return g_v10->connect(dev, &config, handle, comm, dh);
}
NcclResult v10_finalize(void*) { return kSuccess; }
NcclResult v10_get_properties(int dev, PropertiesV11* p) {
  *p = PropertiesV11{};
  return g_v10->get_properties(dev, reinterpret_cast<PropertiesV10*>(p));  // v11 extends v10
}
// v9 and v8 share init (once, no context), listen and connect (no comm config).
template <typename Table, Table** table>
NcclResult old_init(void** ctx, uint64_t, CommConfig*, Logger logger, ProfilerCallback) {
  *ctx = nullptr;
  return (*table)->init(logger);
}
template <typename Table, Table** table>
NcclResult old_listen(void*, int dev, void* handle, void** comm) {
  return (*table)->listen(dev, handle, comm);
}
template <typename Table, Table** table>
NcclResult old_connect(void*, int dev, void* handle, void** comm, DeviceHandle** dh) {
  return (*table)->connect(dev, handle, comm, dh);
}
NcclResult v9_get_properties(int dev, PropertiesV11* p) {
  *p = PropertiesV11{};
  return g_v9->get_properties(dev, reinterpret_cast<PropertiesV9*>(p));
}
NcclResult v9_isend(void* comm, void* data, size_t size, int tag, void* mh, void*, void** req) {
  return g_v9->isend(comm, data, size, tag, mh, req);
}
NcclResult v9_irecv(void* comm, int n, void** data, size_t* sizes, int* tags, void** mhs, void**,
                    void** req) {
  return g_v9->irecv(comm, n, data, sizes, tags, mhs, req);
}
// v8: v9's calls with int sizes, properties without virtual devices, no makeVDevice.
NcclResult v8_get_properties(int dev, PropertiesV11* p) {
  PropertiesV8 v8{};
  const NcclResult r = g_v8->get_properties(dev, &v8);
  *p = PropertiesV11{};
  p->name = v8.name, p->pci_path = v8.pci_path, p->guid = v8.guid, p->ptr_support = v8.ptr_support;
  p->reg_is_global = v8.reg_is_global, p->speed = v8.speed, p->port = v8.port, p->latency = v8.latency;
  p->max_comms = v8.max_comms, p->max_recvs = v8.max_recvs;
  return r;
}
NcclResult v8_isend(void* comm, void* data, size_t size, int tag, void* mh, void*, void** req) {
  if (size > static_cast<size_t>(INT32_MAX)) return kInvalidArgument;
  return g_v8->isend(comm, data, static_cast<int>(size), tag, mh, req);
}
NcclResult v8_irecv(void* comm, int n, void** data, size_t* sizes, int* tags, void** mhs, void**,
                    void** req) {
  constexpr int kMaxGrouped = 8;  // NCCL groups at most 8 receives in one irecv
  int isizes[kMaxGrouped];
  if (n < 1 || n > kMaxGrouped) return kInvalidArgument;
  for (int i = 0; i < n; ++i) {
    if (sizes[i] > static_cast<size_t>(INT32_MAX)) return kInvalidArgument;
    isizes[i] = static_cast<int>(sizes[i]);
  }
  return g_v8->irecv(comm, n, data, isizes, tags, mhs, req);
}

// The calls whose signature v8, v9 and v10 share with v11.
template <typename Table>
void copy_common(const Table* from, NetV11* t) {
  t->name = from->name;
  t->devices = from->devices;
  t->accept = from->accept;
  t->reg_mr = from->reg_mr;
  t->dereg_mr = from->dereg_mr;
  t->test = from->test;
  t->close_send = from->close_send;
  t->close_recv = from->close_recv;
  t->close_listen = from->close_listen;
  if constexpr (requires { from->make_vdevice; }) t->make_vdevice = from->make_vdevice;
  t->finalize = v10_finalize;
}

// A v9 or v8 table seen through the v11 layout.
template <typename Table, Table** table>
void adapt_old(NetV11* t, decltype(NetV11::get_properties) props, decltype(NetV11::isend) isend,
               decltype(NetV11::irecv) irecv) {
  copy_common(*table, t);
  t->init = old_init<Table, table>;
  t->listen = old_listen<Table, table>;
  t->connect = old_connect<Table, table>;
  t->get_properties = props;
  t->isend = isend;
  t->irecv = irecv;
}

// abi: the table to use (11, 10, 9 or 8), 0 for the newest the library exports.
Loaded load_plugin(const std::string& path, int abi) {
  Loaded l;
  l.handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);  // as NCCL opens it
  if (!l.handle) die(("dlopen: " + std::string(dlerror())).c_str());
  NetV11& t = l.table;
  auto table = [&](int v) -> void* {
    if (abi != 0 && abi != v) return nullptr;
    return dlsym(l.handle, ("ncclNetPlugin_v" + std::to_string(v)).c_str());
  };
  if (auto* v11 = static_cast<NetV11*>(table(11))) {
    l.version = 11;
    t = *v11;
  } else if ((g_v10 = static_cast<NetV10*>(table(10)))) {
    l.version = 10;
    copy_common(g_v10, &t);
    t.init = v10_init;
    t.get_properties = v10_get_properties;
    t.listen = v10_listen;
    t.connect = v10_connect;
    t.isend = g_v10->isend;
    t.irecv = g_v10->irecv;
  } else if ((g_v9 = static_cast<NetV9*>(table(9)))) {
    l.version = 9;
    adapt_old<NetV9, &g_v9>(&t, v9_get_properties, v9_isend, v9_irecv);
  } else if ((g_v8 = static_cast<NetV8*>(table(8)))) {
    l.version = 8;
    adapt_old<NetV8, &g_v8>(&t, v8_get_properties, v8_isend, v8_irecv);
  } else {
    die((abi ? "no ncclNetPlugin_v" + std::to_string(abi) + " in " + path
             : "no ncclNetPlugin_v11, _v10, _v9 or _v8 in " + path).c_str());
  }
  return l;
}

// ---- one side of a plugin run -----------------------------------------------------------------

// Buffers are filled with words derived from a seed, so the receiver can tell this size's data
// from what an earlier size left behind.
void fill_words(uint8_t* p, size_t n, uint64_t seed) {
  for (size_t i = 0; i + 8 <= n; i += 8) {
    const uint64_t w = seed * 0x9e3779b97f4a7c15ull + i;
    std::memcpy(p + i, &w, 8);
  }
}
bool check_words(const uint8_t* p, size_t n, uint64_t seed) {
  for (size_t i = 0; i + 8 <= n; i += 8) {
    const uint64_t w = seed * 0x9e3779b97f4a7c15ull + i;
    if (std::memcmp(p + i, &w, 8) != 0) return false;
  }
  return true;
}

struct Side {
  const Options& o;
  Caller caller;
  Clock::time_point deadline;
  NetV11* t = nullptr;
  void* ctx = nullptr;
  // One entry per channel (--channels): its comms, listen comm and registrations.
  std::vector<void*> sends = {}, recvs = {}, listens = {}, smhs = {}, rmhs = {};
  uint8_t* sbuf = nullptr;
  uint8_t* rbuf = nullptr;
  size_t slen = 0, rlen = 0;

  void check(NcclResult r, const char* what) const {
    if (r != kSuccess) die((std::string(what) + " failed: " + std::to_string(r)).c_str());
    if (Clock::now() > deadline) die((std::string(what) + ": timed out").c_str());
  }
  // Offset of channel c's receive slot i for messages of `size` bytes (slots share the buffer
  // when it is short).
  size_t slot(int c, int i, size_t size) const {
    const size_t off = (static_cast<size_t>(c) * static_cast<size_t>(o.window) + static_cast<size_t>(i)) * size;
    return off + size <= rlen ? off : 0;
  }
  // Channel c's share of a row's `total` messages (dealt round the channels).
  int quota(int total, int c) const { return total / o.channels + (c < total % o.channels ? 1 : 0); }

  // The window of one bandwidth row: request i of the row lives in slot i % window (--pass nccl)
  // or in any free slot (--pass all).
  struct Window {
    std::vector<void*> reqs;
    int posted = 0, completed = 0;
  };
  // One pass of the caller's loop over the window; returns whether it made progress. With
  // --pass nccl it makes one call, as NCCL's proxy does per connection: the next request is posted
  // if its slot is free (and the pass ends there), or else the oldest outstanding one is tested.
  // With --pass all every free slot is posted and every outstanding request tested.
  // post(slot) returns the new request (nullptr: the plugin is not ready); done(req, slot) tests.
  template <typename Post, typename Done>
  bool bw_pass(Window& w, int total, Post post, Done done) {
    const int n = o.window;
    if (o.nccl_pass) {
      if (w.posted < total && w.posted - w.completed < n) {
        const int i = w.posted % n;
        w.reqs[static_cast<size_t>(i)] = post(i);
        if (w.reqs[static_cast<size_t>(i)]) return ++w.posted, true;
      }
      if (w.completed < w.posted) {
        const int i = w.completed % n;
        void*& r = w.reqs[static_cast<size_t>(i)];
        if (done(r, i)) return r = nullptr, ++w.completed, true;
      }
      return false;
    }
    bool progress = false;
    for (int i = 0; i < n; ++i) {
      void*& r = w.reqs[static_cast<size_t>(i)];
      if (!r && w.posted < total) {
        r = post(i);
        if (r) ++w.posted, progress = true;
      }
      if (r && done(r, i)) r = nullptr, ++w.completed, progress = true;
    }
    return progress;
  }

  // One pass over every channel's window (bw_pass each); returns whether any made progress and
  // adds the requests completed to *completed.
  template <typename Post, typename Done>
  bool channels_pass(std::vector<Window>& ws, int total, int* completed, Post post, Done done) {
    bool progress = false;
    for (int c = 0; c < o.channels; ++c) {
      Window& w = ws[static_cast<size_t>(c)];
      const int before = w.completed;
      progress |= bw_pass(
          w, quota(total, c), [&](int i) { return post(c, i); }, [&](void* r, int i) { return done(c, r, i); });
      *completed += w.completed - before;
    }
    return progress;
  }
  std::vector<Window> windows() const {
    return std::vector<Window>(static_cast<size_t>(o.channels),
                               Window{std::vector<void*>(static_cast<size_t>(o.window), nullptr)});
  }

  // Sender side of a bandwidth row: window isends in flight per channel, each slot re-posted when
  // test() reports it done. Returns "secs msgs thread_ns proc_ns".
  std::string send_bw(size_t size) {
    const int iters = bw_iters(o, size), warm = bw_warmup(o, iters), total = iters + warm;
    fill_words(sbuf, size, size);
    std::vector<Window> ws = windows();
    auto post = [&](int c, int) {
      void* r = nullptr;
      check(t->isend(sends[static_cast<size_t>(c)], sbuf, size, 0, smhs[static_cast<size_t>(c)], nullptr, &r),
            "isend");
      return r;
    };
    auto done = [&](int, void* r, int) {
      int d = 0, got = 0;
      check(t->test(r, &d, &got), "test(send)");
      return d != 0;
    };
    Meter m;
    int completed = 0;
    while (completed < total) {
      if (completed >= warm && m.t0 == Clock::time_point{}) m.start();
      caller.pass(channels_pass(ws, total, &completed, post, done));
    }
    char out[128];
    std::snprintf(out, sizeof(out), "%.9f %d %.0f %.0f", m.secs(), total - warm, m.thread_ns(),
                  m.proc_ns());
    return out;
  }

  // Receiver side: window irecvs in flight per channel; the last message's bytes and size are
  // checked.
  std::string recv_bw(size_t size) {
    const int iters = bw_iters(o, size), warm = bw_warmup(o, iters), total = iters + warm;
    std::vector<Window> ws = windows();
    size_t last = 0;
    auto post = [&](int c, int i) {
      void* r = nullptr;
      void* data[1] = {rbuf + slot(c, i, size)};
      size_t sizes[1] = {size};
      int tags[1] = {0};
      void* mhs[1] = {rmhs[static_cast<size_t>(c)]};
      check(t->irecv(recvs[static_cast<size_t>(c)], 1, data, sizes, tags, mhs, nullptr, &r), "irecv");
      return r;
    };
    auto done = [&](int c, void* r, int i) {
      int d = 0, got[1] = {0};
      check(t->test(r, &d, got), "test(recv)");
      if (!d) return false;
      if (static_cast<size_t>(got[0]) != size) die("a receive reported the wrong size");
      last = slot(c, i, size);
      return true;
    };
    Meter m;
    int completed = 0;
    while (completed < total) {
      if (completed >= warm && m.t0 == Clock::time_point{}) m.start();
      caller.pass(channels_pass(ws, total, &completed, post, done));
    }
    if (!check_words(rbuf + last, size, size)) die("received data does not verify");
    char out[128];
    std::snprintf(out, sizeof(out), "%.0f %.0f", m.thread_ns(), m.proc_ns());
    return out;
  }

  // Polls test() on req until done (the caller style decides whether a fruitless pass yields).
  void wait(void* req, const char* what) {
    int done = 0, got = 0;
    for (;;) {
      check(t->test(req, &done, &got), what);
      if (done) return;
      caller.pass(false);
    }
  }
  void* post_recv(size_t size) {
    void* r = nullptr;
    void* data[1] = {rbuf};
    size_t sizes[1] = {std::max(size, o.lat_recv)};
    int tags[1] = {0};
    void* mhs[1] = {rmhs[0]};
    while (!r) {
      check(t->irecv(recvs[0], 1, data, sizes, tags, mhs, nullptr, &r), "irecv");
      if (!r) caller.pass(false);
    }
    return r;
  }
  void* post_send(size_t size) {
    void* r = nullptr;
    while (!r) {
      check(t->isend(sends[0], sbuf, size, 0, smhs[0], nullptr, &r), "isend");
      if (!r) caller.pass(false);
    }
    return r;
  }

  // Ping-pong (channel 0), `depth` receives kept posted on each side (--lat-depth). With one, A
  // posts the pong's receive, sends the ping and waits for both; B answers each ping with its
  // next receive posted before the pong (were it posted after, the next ping could wait for it).
  // With more, each side reposts a receive once a message is answered, as NCCL's proxy keeps a
  // receive posted per free step (NCCL_STEPS) ahead of the data. Returns A's one-way latency in
  // microseconds.
  double pingpong(bool a, size_t size) {
    const int warm = std::max(10, o.lat_iters / 10), total = o.lat_iters + warm;
    const int depth = std::min(o.lat_depth, total);
    fill_words(sbuf, size, size);
    Clock::time_point t0;
    std::deque<void*> posted;
    for (int k = 0; k < depth; ++k) posted.push_back(post_recv(size));
    for (int k = 0; k < total; ++k) {
      if (k == warm) t0 = Clock::now();
      if (a) {
        // With one receive it is posted before the ping; with more, after it (the ping goes out
        // first), in place of the one the last pong took.
        if (depth == 1 && k > 0) posted.push_back(post_recv(size));
        void* s = post_send(size);
        if (depth > 1 && k > 0 && k - 1 + depth < total) posted.push_back(post_recv(size));
        wait(s, "test(ping)");
        wait(posted.front(), "test(pong)");
        posted.pop_front();
      } else {
        const bool refill = k + depth < total;  // a ping is still to come for one more receive
        wait(posted.front(), "test(ping)");
        posted.pop_front();
        if (refill && depth == 1) posted.push_back(post_recv(size));
        void* s = post_send(size);
        wait(s, "test(pong)");
        if (refill && depth > 1) posted.push_back(post_recv(size));
      }
    }
    if (!check_words(rbuf, size, size)) die("ping-pong data does not verify");
    return std::chrono::duration<double, std::micro>(Clock::now() - t0).count() / o.lat_iters / 2;
  }
};

// A side process: loads the plugin, reads every device's properties (as NCCL does at init),
// listens, trades handles through the parent, connects and accepts (interleaved, never blocking),
// then runs every row for one caller style and reports.
int run_side(bool a, const std::string& path, const std::string& caller, const Options& o,
             const Channel& ch) {
  Loaded l = load_plugin(path, o.abi);
  Side s{o, Caller{caller == "yield"}, Clock::now() + std::chrono::seconds(o.timeout_s)};
  s.t = &l.table;
  CommConfig config{kTrafficClassUndef};
  s.check(s.t->init(&s.ctx, 0x1234, &config, &test_logger, nullptr), "init");
  int ndev = 0;
  s.check(s.t->devices(&ndev), "devices");
  if (ndev < 1) die("the plugin has no device");
  PropertiesV11 props{};
  for (int d = ndev - 1; d >= 0; --d) s.check(s.t->get_properties(d, &props), "getProperties");
  int dev = a ? o.dev_a : o.dev_b;
  if (dev >= ndev) die("--devs: the plugin has fewer devices");
  s.check(s.t->get_properties(dev, &props), "getProperties");  // this side's device (its name)
  if (o.nics > 1) {
    if (!s.t->make_vdevice) die("the plugin has no makeVDevice (--nics > 1)");
    VDeviceProps vp{};
    vp.ndevs = o.nics;
    s.check(s.t->make_vdevice(&dev, &vp), "makeVDevice");
    s.check(s.t->get_properties(dev, &props), "getProperties(vdevice)");
  }
  if (!(props.ptr_support & kPtrHost)) die("the plugin's device does not take host memory");
  std::string dev_name = props.name ? props.name : "?";
  // One listen comm per channel, as NCCL listens per connection; the handles go across at once.
  const size_t nch = static_cast<size_t>(o.channels);
  std::vector<Handle> mine(nch), theirs(nch);
  s.listens.assign(nch, nullptr);
  s.sends.assign(nch, nullptr);
  s.recvs.assign(nch, nullptr);
  std::vector<uint8_t> handles;
  for (size_t c = 0; c < nch; ++c) {
    s.check(s.t->listen(s.ctx, dev, mine[c].bytes, &s.listens[c]), "listen");
    handles.insert(handles.end(), mine[c].bytes, mine[c].bytes + sizeof(mine[c].bytes));
  }
  std::vector<uint8_t> got;
  if (!ch.send(handles.data(), handles.size()) || !ch.recv(&got, o.timeout_s * 1000) ||
      got.size() != handles.size())
    die("handle exchange");
  for (size_t c = 0; c < nch; ++c)
    std::memcpy(theirs[c].bytes, got.data() + c * sizeof(theirs[c].bytes), sizeof(theirs[c].bytes));
  DeviceHandle* dh = nullptr;
  for (bool all = false; !all;) {  // connects and accepts interleaved, never blocking
    all = true;
    for (size_t c = 0; c < nch; ++c) {
      if (!s.sends[c]) s.check(s.t->connect(s.ctx, dev, theirs[c].bytes, &s.sends[c], &dh), "connect");
      if (!s.recvs[c]) s.check(s.t->accept(s.listens[c], &s.recvs[c], &dh), "accept");
      all = all && s.sends[c] && s.recvs[c];
    }
    if (!all) std::this_thread::yield();
  }
  size_t max_bw = 0, max_lat = 0;
  for (size_t z : o.sizes) max_bw = std::max(max_bw, z);
  for (size_t z : o.lat_sizes) max_lat = std::max(max_lat, std::max(z, o.lat_recv));
  s.slen = std::max(max_bw, max_lat);
  s.rlen = std::max({max_lat, max_bw,
                     std::min<size_t>(max_bw * static_cast<size_t>(o.window) * nch, 128u << 20)});
  auto alloc = [](size_t n) {
    auto* p = static_cast<uint8_t*>(std::aligned_alloc(4096, (n + 4095) / 4096 * 4096));
    std::memset(p, 0, n);
    return p;
  };
  s.sbuf = alloc(s.slen);
  s.rbuf = alloc(s.rlen);
  s.smhs.assign(nch, nullptr);
  s.rmhs.assign(nch, nullptr);
  for (size_t c = 0; c < nch; ++c) {
    s.check(s.t->reg_mr(s.sends[c], s.sbuf, s.slen, kPtrHost, &s.smhs[c]), "regMr(send)");
    s.check(s.t->reg_mr(s.recvs[c], s.rbuf, s.rlen, kPtrHost, &s.rmhs[c]), "regMr(recv)");
  }

  std::string name = s.t->name ? s.t->name : "?";
  std::replace(name.begin(), name.end(), ' ', '_');  // one word in the report
  std::replace(dev_name.begin(), dev_name.end(), ' ', '_');
  std::string report = "name " + name + " v" + std::to_string(l.version) + " " + dev_name + "\n";
  const auto row_time = std::chrono::seconds(o.timeout_s);
  for (size_t size : o.sizes) {
    s.deadline = Clock::now() + row_time;
    if (a) report += "bw " + std::to_string(size) + " " + s.send_bw(size) + "\n";
    else report += "bwr " + std::to_string(size) + " " + s.recv_bw(size) + "\n";
  }
  for (size_t size : o.lat_sizes) {
    s.deadline = Clock::now() + row_time;
    char line[96];
    std::snprintf(line, sizeof(line), "lat %zu %.3f\n", size, s.pingpong(a, size));
    report += line;
  }
  ch.send_str(report);
  std::string bye;
  ch.recv_str(&bye, o.timeout_s * 1000);  // both sides done before either closes
  for (size_t c = 0; c < nch; ++c) {
    s.t->dereg_mr(s.sends[c], s.smhs[c]);
    s.t->dereg_mr(s.recvs[c], s.rmhs[c]);
    s.t->close_send(s.sends[c]);
    s.t->close_recv(s.recvs[c]);
    s.t->close_listen(s.listens[c]);
  }
  if (s.t->finalize) s.t->finalize(s.ctx);
  std::free(s.sbuf);
  std::free(s.rbuf);
  return 0;
}

// ---- a run of one plugin (two side processes) --------------------------------------------------

struct Row {
  double gbps = 0;         // bandwidth (best run)
  double send_cpu_ns = 0;  // sender's proxy thread CPU per message (in the best run)
  double send_proc_ns = 0; // sender's whole process CPU per message
  double recv_cpu_ns = 0;  // receiver's proxy thread CPU per message
  double worst_gbps = 0;   // the slowest run's bandwidth (the spread: best - worst)
};
// Keeps the best run's row and the slowest run's bandwidth.
void keep_best(Row* kept, const Row& run, bool first) {
  const double worst = first ? run.gbps : std::min(kept->worst_gbps, run.gbps);
  if (first || run.gbps > kept->gbps) *kept = run;
  kept->worst_gbps = worst;
}
// Spread over the runs in percent of the best: (best - worst) / best.
double spread_pct(double best, double worst) { return best > 0 ? (best - worst) / best * 100 : 0; }

struct Latency {
  double us = 0;        // best run
  double worst_us = 0;  // slowest run
};
struct PluginResult {
  std::string name;
  std::map<size_t, Row> bw;
  std::map<size_t, Latency> lat;
  std::map<size_t, std::vector<double>> bw_runs;   // every run's bandwidth, in round order
  std::map<size_t, std::vector<double>> lat_runs;  // every run's latency, in round order
};

// Round k's own ratio for each k (this plugin's run k against the other's run k, which ran beside
// it), then their median and range: best-of-each alone can pair runs from different speeds of a
// shared host and hides how far the rounds disagree.
std::string per_round(const std::vector<double>& mine, const std::vector<double>& theirs) {
  std::vector<double> r;
  std::string out = "per round";
  char b[64];
  for (size_t k = 0; k < mine.size() && k < theirs.size(); ++k) {
    if (theirs[k] <= 0) continue;
    r.push_back(mine[k] / theirs[k]);
    std::snprintf(b, sizeof(b), " %.3f", r.back());
    out += b;
  }
  if (r.empty()) return "no round ran both";
  std::sort(r.begin(), r.end());
  const size_t n = r.size();
  const double median = n % 2 ? r[n / 2] : (r[n / 2 - 1] + r[n / 2]) / 2;
  std::snprintf(b, sizeof(b), "; median %.3f, range %.3f-%.3f", median, r.front(), r.back());
  return out + b;
}

std::string load_average() {
  char buf[128] = {};
  FILE* f = std::fopen("/proc/loadavg", "r");
  if (!f) return "?";
  const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  std::string s(buf, n);
  for (int field = 0, i = 0; i < static_cast<int>(s.size()); ++i)  // the three averages
    if (s[static_cast<size_t>(i)] == ' ' && ++field == 3) return s.substr(0, static_cast<size_t>(i));
  return s;
}

void parse_report(const std::string& text, std::vector<std::vector<std::string>>* lines) {
  std::stringstream ss(text);
  for (std::string line; std::getline(ss, line);) {
    std::stringstream ls(line);
    std::vector<std::string> words;
    for (std::string w; ls >> w;) words.push_back(w);
    if (!words.empty()) lines->push_back(words);
  }
}

void run_plugin(const Options& o, const std::string& path, const std::string& caller, PluginResult* res) {
  std::vector<std::string> args_a = {"side-a", path, caller}, args_b = {"side-b", path, caller};
  args_a.insert(args_a.end(), o.args.begin(), o.args.end());
  args_b.insert(args_b.end(), o.args.begin(), o.args.end());
  Peer a(args_a), b(args_b);
  if (!a.started() || !b.started()) die("could not start the side processes");
  const int ms = o.timeout_s * 1000;
  std::vector<uint8_t> ha, hb;
  if (!a.channel().recv(&ha, ms) || !b.channel().recv(&hb, ms)) die("a side failed to listen");
  a.channel().send(hb);
  b.channel().send(ha);
  std::string ra, rb;
  const int run_ms = ms * static_cast<int>(o.sizes.size() + o.lat_sizes.size() + 2);  // each row is bounded
  if (!a.channel().recv_str(&ra, run_ms) || !b.channel().recv_str(&rb, run_ms))
    die(("a run of " + path + " failed (see above)").c_str());
  a.channel().send_str("bye");
  b.channel().send_str("bye");
  if (a.wait_exit(ms) != 0 || b.wait_exit(ms) != 0) die("a side did not exit cleanly");
  std::vector<std::vector<std::string>> la, lb;
  parse_report(ra, &la);
  parse_report(rb, &lb);
  std::map<size_t, double> recv_cpu;
  for (auto& w : lb)
    if (w[0] == "bwr" && w.size() == 4) recv_cpu[std::stoull(w[1])] = std::stod(w[2]);
  std::string dev_b;
  for (auto& w : lb)
    if (w[0] == "name" && w.size() >= 4) dev_b = w[3];
  for (auto& w : la) {
    if (w[0] == "name" && w.size() >= 4)
      res->name = w[1] + " (" + w[2] + ", " + w[3] + (dev_b.empty() || dev_b == w[3] ? "" : " -> " + dev_b) + ")";
    if (w[0] == "bw" && w.size() == 6) {
      const size_t size = std::stoull(w[1]);
      const double secs = std::stod(w[2]), msgs = std::stod(w[3]);
      const double gbps = static_cast<double>(size) * msgs / secs / 1e9;
      const bool first = res->bw.count(size) == 0;
      const Row run{gbps, std::stod(w[4]) / msgs, std::stod(w[5]) / msgs, recv_cpu[size] / msgs, gbps};
      keep_best(&res->bw[size], run, first);
      res->bw_runs[size].push_back(gbps);
    }
    if (w[0] == "lat" && w.size() == 3) {
      const size_t size = std::stoull(w[1]);
      const double us = std::stod(w[2]);
      res->lat_runs[size].push_back(us);
      auto it = res->lat.find(size);
      if (it == res->lat.end()) res->lat[size] = Latency{us, us};
      else it->second = Latency{std::min(it->second.us, us), std::max(it->second.worst_us, us)};
    }
  }
}

// ---- the engine's own write-with-immediate ------------------------------------------------------

EngineOptions engine_options(const Options& o, bool side_a) {
  EngineOptions e;
  e.groups.push_back(std::vector<size_t>(static_cast<size_t>(o.nics), static_cast<size_t>(side_a ? o.dev_a : o.dev_b)));
  return e;
}

void engine_receiver(const Options& o, const Channel& ch) {
  auto e = Engine::create(engine_options(o, false));
  if (!e.ok()) die(e.status().message());
  const size_t len = o.engine_size * static_cast<size_t>(o.window * o.channels);
  auto* buf = static_cast<uint8_t*>(std::aligned_alloc(4096, (len + 4095) / 4096 * 4096));
  auto mr = (*e)->register_memory(0, buf, len);
  if (!mr.ok()) die(mr.status().message());
  auto addr = (*e)->address(0);
  auto region = mr->remote().encode();
  ch.send(addr.data(), addr.size());
  ch.send(region.data(), region.size());
  std::string done;
  ch.recv_str(&done, o.timeout_s * 4000);  // the sender says when it is finished
  (void)(*e)->deregister(mr.value());
  std::free(buf);
}

struct Counter {
  std::atomic<uint64_t> done{0};
  std::atomic<int> errors{0};
  static void fire(void* arg, const Status& st) {
    auto* c = static_cast<Counter*>(arg);
    if (!st.ok()) c->errors.fetch_add(1);
    c->done.fetch_add(1, std::memory_order_release);
  }
};

// window x channels write_imms in flight from this thread (as many as the plugin rows have), a
// slot re-posted when its completion was seen.
Row engine_sender(const Options& o, const Caller& caller) {
  std::vector<std::string> args = {"engine"};
  args.insert(args.end(), o.args.begin(), o.args.end());
  Peer peer(args);
  std::vector<uint8_t> addr, region_bytes;
  if (!peer.channel().recv(&addr) || !peer.channel().recv(&region_bytes)) die("engine peer");
  auto region = RemoteRegion::decode(region_bytes);
  if (!region.ok()) die(region.status().message());
  auto e = Engine::create(engine_options(o, true));
  if (!e.ok()) die(e.status().message());
  Engine& eng = **e;
  auto peer_id = eng.connect(0, addr);
  if (!peer_id.ok()) die(peer_id.status().message());
  const size_t size = o.engine_size;
  auto* src = static_cast<uint8_t*>(std::aligned_alloc(4096, (size + 4095) / 4096 * 4096));
  std::memset(src, 1, size);
  auto mr = eng.register_memory(0, src, size);
  if (!mr.ok()) die(mr.status().message());
  Counter c;
  const int iters = bw_iters(o, size), warm = bw_warmup(o, iters);
  const uint64_t total = static_cast<uint64_t>(iters + warm);
  uint64_t posted = 0, seen = 0;
  Meter m;
  const auto deadline = Clock::now() + std::chrono::seconds(o.timeout_s);
  while (seen < total) {
    if (seen >= static_cast<uint64_t>(warm) && m.t0 == Clock::time_point{}) m.start();
    const uint64_t done = c.done.load(std::memory_order_acquire);
    bool progress = done != seen;
    seen = done;
    const uint64_t in_flight = static_cast<uint64_t>(o.window * o.channels);
    while (posted < total && posted - seen < in_flight) {
      LocalSlice s{&mr.value(), 0, size};
      const size_t off = (posted % in_flight) * size;
      Status st = eng.write_imm(0, peer_id.value(), s, region.value(), off,
                                0x7000 + static_cast<uint32_t>(posted % 8), Notify{&Counter::fire, &c});
      if (st.code() == Code::kAgain) break;
      if (!st.ok()) die(st.message());
      ++posted, progress = true;
    }
    if (c.errors.load()) die("a write failed");
    if (Clock::now() > deadline) die("engine writes timed out");
    caller.pass(progress);
  }
  const double secs = m.secs(), msgs = static_cast<double>(total) - warm;
  const double gbps = static_cast<double>(size) * msgs / secs / 1e9;
  Row row{gbps, m.thread_ns() / msgs, m.proc_ns() / msgs, 0, gbps};
  (void)eng.deregister(mr.value());
  e->reset();  // close our side first: the peer's exit is then no news to anyone
  std::free(src);
  peer.channel().send_str("done");
  peer.wait_exit(30000);
  return row;
}

// ---- tables -----------------------------------------------------------------------------------

std::string fmt_size(size_t s) {
  char b[32];
  std::snprintf(b, sizeof(b), "%zu", s);
  return b;
}

void print_tables(const Options& o, const std::string& caller, const PluginResult& p, const PluginResult* c,
                  const Row* engine, const std::vector<double>& engine_runs) {
  std::printf("\n# caller %s, pass %s: bandwidth, %d in flight on each of %d channel(s) (sender isend/test, "
              "receiver irecv/test); sprd = (best - worst) / best over the runs; cpu = the proxy thread's CPU "
              "per message, proc = the sending process's\n",
              caller.c_str(), o.nccl_pass ? "nccl" : "all", o.window, o.channels);
  std::printf("# %-37s", p.name.c_str());
  if (c) std::printf(" | %-50s", c->name.c_str());
  std::printf("\n#%11s %7s %9s %8s %6s %8s %8s %8s", "size(B)", "count", "time(us)", "algbw", "sprd%",
              "cpu(ns)", "recv(ns)", "proc(ns)");
  if (c) std::printf(" | %9s %8s %6s %8s %8s %8s | %6s", "time(us)", "algbw", "sprd%", "cpu(ns)", "recv(ns)",
                     "proc(ns)", "ratio");
  std::printf("\n");
  auto cols = [](size_t size, const Row& r) {
    std::printf("%9.2f %8.3f %6.1f %8.0f %8.0f %8.0f", static_cast<double>(size) / (r.gbps * 1e3), r.gbps,
                spread_pct(r.gbps, r.worst_gbps), r.send_cpu_ns, r.recv_cpu_ns, r.send_proc_ns);
  };
  for (size_t size : o.sizes) {
    auto it = p.bw.find(size);
    if (it == p.bw.end()) continue;
    std::printf("%12s %7d ", fmt_size(size).c_str(), bw_iters(o, size));
    cols(size, it->second);
    if (c) {
      auto ct = c->bw.find(size);
      if (ct != c->bw.end()) {
        std::printf(" | ");
        cols(size, ct->second);
        std::printf(" | %6.3f", it->second.gbps / ct->second.gbps);
      }
    }
    std::printf("\n");
  }
  if (c && o.repeat > 1)
    for (size_t size : o.sizes)
      if (p.bw_runs.count(size) && c->bw_runs.count(size))
        std::printf("# %12s bandwidth %s\n", fmt_size(size).c_str(),
                    per_round(p.bw_runs.at(size), c->bw_runs.at(size)).c_str());
  if (engine) {
    auto it = p.bw.find(o.engine_size);
    std::printf("# engine write_imm %zu B x %d: %.3f GB/s (sprd %.1f%%), cpu %.0f ns/msg, proc %.0f ns/msg",
                o.engine_size, o.window * o.channels, engine->gbps, spread_pct(engine->gbps, engine->worst_gbps),
                engine->send_cpu_ns, engine->send_proc_ns);
    if (it != p.bw.end()) std::printf("; %s / engine = %.3f", p.name.c_str(), it->second.gbps / engine->gbps);
    std::printf("\n");
    if (it != p.bw.end() && o.repeat > 1)
      std::printf("# %12s plugin / engine %s\n", fmt_size(o.engine_size).c_str(),
                  per_round(p.bw_runs.at(o.engine_size), engine_runs).c_str());
  }
  if (o.lat_sizes.empty()) {  // --lat-sizes "": bandwidth only
    std::fflush(stdout);
    return;
  }
  std::printf("# caller %s: ping-pong latency (half a round trip, %d receive(s) kept posted on each side%s; "
              "sprd = (worst - best) / best%s)\n", caller.c_str(), o.lat_depth,
              o.lat_recv ? (", each of " + fmt_size(o.lat_recv) + " bytes").c_str() : "",
              c ? "; ratio = this plugin's time / the other's, below 1 faster" : "");
  std::printf("#%11s %7s %9s %6s", "size(B)", "count", "lat(us)", "sprd%");
  if (c) std::printf(" | %9s %6s | %6s", "cmp(us)", "sprd%", "ratio");
  std::printf("\n");
  auto lat_spread = [](const Latency& l) { return l.us > 0 ? (l.worst_us - l.us) / l.us * 100 : 0; };
  for (size_t size : o.lat_sizes) {
    auto it = p.lat.find(size);
    if (it == p.lat.end()) continue;
    std::printf("%12s %7d %9.2f %6.1f", fmt_size(size).c_str(), o.lat_iters, it->second.us,
                lat_spread(it->second));
    if (c) {
      auto ct = c->lat.find(size);
      if (ct != c->lat.end())
        std::printf(" | %9.2f %6.1f | %6.3f", ct->second.us, lat_spread(ct->second),
                    it->second.us / ct->second.us);
    }
    std::printf("\n");
  }
  if (c && o.repeat > 1)
    for (size_t size : o.lat_sizes)
      if (p.lat_runs.count(size) && c->lat_runs.count(size))
        std::printf("# %12s latency %s (a time ratio: below 1 is faster)\n", fmt_size(size).c_str(),
                    per_round(p.lat_runs.at(size), c->lat_runs.at(size)).c_str());
  std::fflush(stdout);
}

// Every run's value in round order, as a JSON array (the rows' "runs").
std::string json_runs(const std::vector<double>& runs) {
  std::string out = "[";
  char b[32];
  for (size_t k = 0; k < runs.size(); ++k) {
    std::snprintf(b, sizeof(b), "%s%.4f", k ? "," : "", runs[k]);
    out += b;
  }
  return out + "]";
}

void print_json(const std::string& caller, const PluginResult& r, const char* role, bool* first) {
  for (auto& [size, row] : r.bw) {
    std::printf("%s{\"caller\":\"%s\",\"plugin\":\"%s\",\"name\":\"%s\",\"test\":\"bw\",\"size\":%zu,"
                "\"GBps\":%.4f,\"worst_GBps\":%.4f,\"cpu_ns\":%.0f,\"recv_cpu_ns\":%.0f,\"proc_ns\":%.0f,"
                "\"runs\":%s}",
                *first ? "" : ",", caller.c_str(), role, r.name.c_str(), size, row.gbps, row.worst_gbps,
                row.send_cpu_ns, row.recv_cpu_ns, row.send_proc_ns, json_runs(r.bw_runs.at(size)).c_str());
    *first = false;
  }
  for (auto& [size, l] : r.lat) {
    std::printf("%s{\"caller\":\"%s\",\"plugin\":\"%s\",\"name\":\"%s\",\"test\":\"lat\",\"size\":%zu,"
                "\"us\":%.3f,\"worst_us\":%.3f,\"runs\":%s}",
                *first ? "" : ",", caller.c_str(), role, r.name.c_str(), size, l.us, l.worst_us,
                json_runs(r.lat_runs.at(size)).c_str());
    *first = false;
  }
}

}  // namespace

int main(int argc, char** argv) {
  set_test_environment();
  if (argc > 2 && std::string(argv[1]) == "--ponte-peer") {
    const std::string role = argv[2];
    Channel ch(3);
    if (role == "engine") {
      engine_receiver(parse_options(argc, argv, 3), ch);
      return 0;
    }
    if ((role == "side-a" || role == "side-b") && argc > 4)
      return run_side(role == "side-a", argv[3], argv[4], parse_options(argc, argv, 5), ch);
    die("unknown peer role");
  }
  const Options o = parse_options(argc, argv, 1);
  const char* backend = getenv("PONTE_BACKEND");
  const char* provider = getenv("PONTE_FABRIC_PROVIDER");
  if (!o.json)
    std::printf("# plugin-bench: %s%s%s; PONTE_BACKEND %s, PONTE_FABRIC_PROVIDER %s; window %d; "
                "channels %d; pass %s; best of %d%s runs; load average %s\n",
                o.plugin.c_str(), o.compare.empty() ? "" : " vs ", o.compare.c_str(),
                backend ? backend : "auto", provider ? provider : "-", o.window, o.channels,
                o.nccl_pass ? "nccl" : "all", o.repeat, o.compare.empty() ? "" : " alternating",
                load_average().c_str());
  bool first = true;
  if (o.json) std::printf("{\"results\":[");
  for (const std::string& caller : o.callers) {
    PluginResult p, c;
    Row engine;
    std::vector<double> engine_runs;  // every round's engine row, beside that round's plugin run
    for (int r = 0; r < o.repeat; ++r) {
      // The two plugins take turns going first (round 0: --plugin first), so neither always runs
      // right after the other's or the engine's run.
      const bool compare_first = !o.compare.empty() && r % 2 == 1;
      if (compare_first) run_plugin(o, o.compare, caller, &c);
      run_plugin(o, o.plugin, caller, &p);
      if (!o.compare.empty() && !compare_first) run_plugin(o, o.compare, caller, &c);
      if (o.engine) {
        const Row run = engine_sender(o, Caller{caller == "yield"});
        engine_runs.push_back(run.gbps);
        keep_best(&engine, run, r == 0);
      }
    }
    if (o.json) {
      print_json(caller, p, "plugin", &first);
      if (!o.compare.empty()) print_json(caller, c, "compare", &first);
      if (o.engine) {
        std::printf("%s{\"caller\":\"%s\",\"plugin\":\"engine\",\"test\":\"bw\",\"size\":%zu,"
                    "\"GBps\":%.4f,\"worst_GBps\":%.4f,\"cpu_ns\":%.0f,\"proc_ns\":%.0f,\"runs\":%s}",
                    first ? "" : ",", caller.c_str(), o.engine_size, engine.gbps, engine.worst_gbps,
                    engine.send_cpu_ns, engine.send_proc_ns,
                    json_runs(engine_runs).c_str());
        first = false;
      }
    } else {
      print_tables(o, caller, p, o.compare.empty() ? nullptr : &c, o.engine ? &engine : nullptr, engine_runs);
      std::printf("# load average after caller %s: %s\n", caller.c_str(), load_average().c_str());
    }
  }
  if (o.json) std::printf("],\"load_average\":\"%s\"}\n", load_average().c_str());
  return 0;
}
