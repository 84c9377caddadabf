// ponte-soak: moves data through the NCCL plugin (dlopen, driven as NCCL's proxy thread drives it)
// and through the engine between two processes on loopback, every message checksummed and checked
// at its receiver, then connects and closes plugin comms and engine peers many times; at the end
// each process's descriptors, threads, libfabric objects (through libponte-ficount), heap and RSS
// must be back at their baseline. Prints a summary table; exit status 1 on any failure.
//
//   ponte-soak [--short] [--provider tcp;ofi_rxm|shm] [--plugin-bytes 10g] [--engine-bytes 10g]
//              [--cycles N | --plugin-cycles N --engine-cycles N] [--window 8] [--max-msg 4m]
//              [--nics 1] [--timeout 60] [--rss-tolerance KiB] [--heap-tolerance KiB]
//
// Side A is this process, side B the same binary started again (tests/common/peer_process.h). The
// baseline is taken after a warm-up of every phase (the plugin builds its device's engine on first
// use and keeps it, as under NCCL; libfabric's pools grow once), so what it measures is what the
// soak adds: a leak per message, per comm, per registration or per peer shows up as a difference.
#include <sys/resource.h>

#include <cinttypes>
#include <sstream>

#include "tests/soak/soak_engine.h"
#include "tests/soak/soak_plugin.h"

using namespace ponte::soak;

namespace {

uint64_t parse_bytes(const std::string& s) {
  char* end = nullptr;
  double v = std::strtod(s.c_str(), &end);
  if (end == s.c_str() || v < 0) die("not a size: %s", s.c_str());
  switch (end && *end ? (*end | 0x20) : 0) {
    case 'k': v *= 1024; break;
    case 'm': v *= 1024.0 * 1024; break;
    case 'g': v *= 1024.0 * 1024 * 1024; break;
    default: break;
  }
  return static_cast<uint64_t>(v);
}

constexpr const char* kUsage =
    "usage: ponte-soak [--short] [--provider P] [--plugin-bytes B] [--engine-bytes B] [--cycles N]\n"
    "                  [--plugin-cycles N] [--engine-cycles N] [--window N] [--max-msg B] [--nics N]\n"
    "                  [--timeout S] [--rss-tolerance KiB] [--heap-tolerance KiB]\n";

Options parse(int argc, char** argv, int first) {
  Options o;
  for (int i = first; i < argc; ++i) {
    const std::string a = argv[i];
    o.args.push_back(a);
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) die("missing value after %s", a.c_str());
      o.args.push_back(argv[i + 1]);
      return argv[++i];
    };
    if (a == "--short") {
      o.short_run = true;
      o.plugin_bytes = o.engine_bytes = 256ull << 20;
      o.plugin_cycles = o.engine_cycles = 100;
    } else if (a == "--provider") o.provider = next();
    else if (a == "--plugin-bytes") o.plugin_bytes = parse_bytes(next());
    else if (a == "--engine-bytes") o.engine_bytes = parse_bytes(next());
    else if (a == "--cycles") o.plugin_cycles = o.engine_cycles = std::stoi(next());
    else if (a == "--plugin-cycles") o.plugin_cycles = std::stoi(next());
    else if (a == "--engine-cycles") o.engine_cycles = std::stoi(next());
    else if (a == "--window") o.window = std::stoi(next());
    else if (a == "--max-msg") o.max_msg = static_cast<uint32_t>(parse_bytes(next()));
    else if (a == "--nics") o.nics = std::stoi(next());
    else if (a == "--timeout") o.timeout_s = std::stoi(next());
    else if (a == "--rss-tolerance") o.rss_tolerance_kib = std::stol(next());
    else if (a == "--heap-tolerance") o.heap_tolerance_kib = std::stol(next());
    else {
      std::fputs(kUsage, stderr);
      std::exit(2);
    }
  }
  if (o.window < 1 || o.window > 32 || o.max_msg < kMinMsg || o.max_msg > (256u << 20) || o.nics < 1 ||
      o.nics > 4 || o.timeout_s < 1 || o.plugin_cycles < 0 || o.engine_cycles < 0)
    die("window 1..32, max-msg 24..256m, nics 1..4, timeout > 0, cycles >= 0");
  o.engine_cycles_asked = o.engine_cycles;
  // libfabric 1.17's shm address vector holds 256 addresses and ponte never removes a dead peer's
  // (core/fabric/fabric_av.cc), so a long-lived engine on shm can meet 256 peers in its life: the
  // stream's, the warm-up's and at most this many cycles'. More fail in fi_av_insert.
  constexpr int kShmCycleCap = 250;
  if (o.provider == "shm" && o.engine_cycles > kShmCycleCap) o.engine_cycles = kShmCycleCap;
  return o;
}

void set_environment(const Options& o) { set_loopback_environment(o.provider, "10000"); }

long peak_rss_kib() {
  long v = -1;
  if (FILE* f = std::fopen("/proc/self/status", "r")) {
    char line[256];
    while (std::fgets(line, sizeof(line), f))
      if (std::sscanf(line, "VmHWM: %ld", &v) == 1) break;
    std::fclose(f);
  }
  return v;
}

// What one side saw, sent to side A for the table.
struct Report {
  StreamResult plugin, engine;  // the direction this side received
  int plugin_cycles_ok = 0, engine_cycles_ok = 0;
  double plugin_cycle_secs = 0, engine_cycle_secs = 0;
  int peers_alive = 0;
  long warnings = 0, peak_rss_kib = 0;
  Snapshot before, after;
};

std::string encode_stream(const StreamResult& r) {
  char b[200];
  std::snprintf(b, sizeof(b), "%" PRIu64 " %" PRIu64 " %" PRIu64 " %" PRIu64 " %" PRIu64 " %.6f", r.messages,
                r.bytes, r.failures, r.expected_messages, r.expected_bytes, r.secs);
  return b;
}
StreamResult decode_stream(std::istream& in) {
  StreamResult r;
  in >> r.messages >> r.bytes >> r.failures >> r.expected_messages >> r.expected_bytes >> r.secs;
  return r;
}
std::string encode_report(const Report& r) {
  std::ostringstream os;
  os << encode_stream(r.plugin) << "\n" << encode_stream(r.engine) << "\n"
     << r.plugin_cycles_ok << " " << r.engine_cycles_ok << " " << r.plugin_cycle_secs << " "
     << r.engine_cycle_secs << " " << r.peers_alive << " " << r.warnings << " " << r.peak_rss_kib << "\n"
     << encode_snapshot(r.before) << "\n" << encode_snapshot(r.after) << "\n";
  return os.str();
}
Report decode_report(const std::string& t) {
  std::istringstream is(t);
  Report r;
  r.plugin = decode_stream(is);
  r.engine = decode_stream(is);
  is >> r.plugin_cycles_ok >> r.engine_cycles_ok >> r.plugin_cycle_secs >> r.engine_cycle_secs >>
      r.peers_alive >> r.warnings >> r.peak_rss_kib;
  std::string line;
  std::getline(is, line);
  std::getline(is, line);
  r.before = decode_snapshot(line);
  std::getline(is, line);
  r.after = decode_snapshot(line);
  return r;
}

double secs_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// Stream ids: what A sends is odd, what B sends even (phase * 2 + side).
constexpr uint64_t kPluginStream = 1, kEngineStream = 3, kPluginCycle = 5, kEngineCycle = 7;
constexpr uint64_t kWarmupBytes = 8u << 20;
constexpr int kWarmupCycles = 2;

Report run_side(bool a, const Options& o, const Channel& ch) {
  const uint64_t me = a ? 0 : 1, them = a ? 1 : 0;
  Report r;
  PluginSoak plug(o, ch);
  EngineSoak eng(o, ch, a);
  // Warm-up: every phase once, small.
  plug.stream(kWarmupBytes / 2, kPluginStream + me, kPluginStream + them);
  plug.cycles(0, kWarmupCycles, kPluginCycle + me, kPluginCycle + them);
  eng.stream(kWarmupBytes / 2, kEngineStream + me, kEngineStream + them);
  eng.cycles(0, kWarmupCycles, kEngineCycle + me, kEngineCycle + them);
  if (a && eng.settle() != 0) die("warm-up: the cycles' peers did not close");
  plug.quiesce();
  sync(ch, "baseline", o.timeout_s);
  r.before = snapshot();

  r.plugin = plug.stream(o.plugin_bytes / 2, kPluginStream + me, kPluginStream + them);
  auto t0 = Clock::now();
  r.plugin_cycles_ok = plug.cycles(kWarmupCycles, o.plugin_cycles, kPluginCycle + me, kPluginCycle + them);
  r.plugin_cycle_secs = secs_since(t0);
  r.engine = eng.stream(o.engine_bytes / 2, kEngineStream + me, kEngineStream + them);
  t0 = Clock::now();
  r.engine_cycles_ok = eng.cycles(kWarmupCycles, o.engine_cycles, kEngineCycle + me, kEngineCycle + them);
  r.engine_cycle_secs = secs_since(t0);
  r.peers_alive = a ? eng.settle() : 0;
  plug.quiesce();
  sync(ch, "final", o.timeout_s);
  r.after = snapshot();
  r.warnings = plug.warnings();
  r.peak_rss_kib = peak_rss_kib();
  sync(ch, "measured", o.timeout_s);  // neither side tears down while the other measures
  return r;
}

// ---- the table --------------------------------------------------------------------------------

struct Verdicts {
  std::vector<std::string> failures;
  void expect(bool ok, const std::string& what) {
    if (!ok) failures.push_back(what);
  }
};

void stream_row(const char* phase, const char* dir, const StreamResult& s, Verdicts* v) {
  const uint64_t lost = s.expected_bytes > s.bytes ? s.expected_bytes - s.bytes : 0;
  std::printf("%-14s %-5s %10" PRIu64 " %15" PRIu64 " %8.3f %9.3f %9" PRIu64 " %11" PRIu64 "\n", phase, dir,
              s.messages, s.bytes, static_cast<double>(s.bytes) / (1u << 30),
              s.secs > 0 ? static_cast<double>(s.bytes) / s.secs / (1u << 30) : 0.0, s.failures, lost);
  v->expect(s.failures == 0, std::string(phase) + " " + dir + ": checksum failures");
  v->expect(lost == 0 && s.messages == s.expected_messages, std::string(phase) + " " + dir + ": bytes lost");
}

// One resource row: A and B before/after. B may grow by at most b_max; A by at most a_max, or by
// exactly a_max when a_exact (what A's long-lived engine keeps of every dead peer, by design).
void resource_row(const char* name, long a0, long a1, long b0, long b1, long a_max, bool a_exact, long b_max,
                  const char* note, Verdicts* v) {
  const long da = a1 - a0, db = b1 - b0;
  const bool ok_a = a_exact ? da == a_max : da <= a_max;
  const bool ok_b = db <= b_max;
  char allowed[48];
  if (a_exact) std::snprintf(allowed, sizeof(allowed), "A +%ld, B <= %ld", a_max, b_max);
  else if (a_max != b_max) std::snprintf(allowed, sizeof(allowed), "A <= %ld, B <= %ld", a_max, b_max);
  else std::snprintf(allowed, sizeof(allowed), "<= %ld", a_max);
  std::printf("%-12s %10ld %10ld %+8ld | %10ld %10ld %+8ld | %-20s %s%s%s\n", name, a0, a1, da, b0, b1, db,
              allowed, ok_a && ok_b ? "ok" : "FAIL", note[0] ? "  " : "", note);
  v->expect(ok_a, std::string(name) + " on side A: " + std::to_string(da) + " after the soak");
  v->expect(ok_b, std::string(name) + " on side B: " + std::to_string(db) + " after the soak");
}

int print_table(const Options& o, const Report& a, const Report& b) {
  Verdicts v;
  std::printf("\n# ponte-soak%s: provider %s, 2 processes on loopback, %d NIC%s, window %d, "
              "messages %u B..%u KiB, checksummed, verified at the receiver\n",
              o.short_run ? " --short" : "", o.provider.c_str(), o.nics, o.nics > 1 ? "s" : "", o.window, kMinMsg, o.max_msg >> 10);
  std::printf("%-14s %-5s %10s %15s %8s %9s %9s %11s\n", "phase", "dir", "messages", "bytes", "GiB",
              "GiB/s", "cksum-bad", "bytes-lost");
  stream_row("plugin stream", "A->B", b.plugin, &v);
  stream_row("plugin stream", "B->A", a.plugin, &v);
  stream_row("engine stream", "A->B", b.engine, &v);
  stream_row("engine stream", "B->A", a.engine, &v);
  const uint64_t total = a.plugin.bytes + b.plugin.bytes + a.engine.bytes + b.engine.bytes;
  const uint64_t msgs = a.plugin.messages + b.plugin.messages + a.engine.messages + b.engine.messages;
  const uint64_t bad = a.plugin.failures + b.plugin.failures + a.engine.failures + b.engine.failures;
  std::printf("%-14s %-5s %10" PRIu64 " %15" PRIu64 " %8.3f %9s %9" PRIu64 "\n", "total", "", msgs, total,
              static_cast<double>(total) / (1u << 30), "", bad);
  std::printf("\n%-14s %6s %9s %9s %9s\n", "cycles", "asked", "A ok", "B ok", "secs");
  std::printf("%-14s %6d %9d %9d %9.1f   listen, connect+accept, regMr, 1 message each way, deregMr, close\n",
              "plugin comms", o.plugin_cycles, a.plugin_cycles_ok, b.plugin_cycles_ok, a.plugin_cycle_secs);
  std::printf("%-14s %6d %9d %9d %9.1f   a fresh engine in B, connect (A and B dial in turn), register, "
              "1 write_imm each way, destroy\n",
              "engine peers", o.engine_cycles, a.engine_cycles_ok, b.engine_cycles_ok, a.engine_cycle_secs);
  if (o.engine_cycles != o.engine_cycles_asked)
    std::printf("NOTE: engine peer cycles capped at %d of %d on %s: its address vector holds 256 addresses and "
                "ponte keeps every dead peer's entry (core/fabric/fabric_av.cc), so a long-lived engine meets at "
                "most 256 peers in its life\n",
                o.engine_cycles, o.engine_cycles_asked, o.provider.c_str());
  v.expect(a.plugin_cycles_ok == o.plugin_cycles && b.plugin_cycles_ok == o.plugin_cycles, "plugin cycles failed");
  v.expect(a.engine_cycles_ok == o.engine_cycles && b.engine_cycles_ok == o.engine_cycles, "engine cycles failed");
  v.expect(a.peers_alive == 0, std::to_string(a.peers_alive) + " cycle peers still alive on A after the settle");

  std::printf("\n%-12s %10s %10s %8s | %10s %10s %8s | %-20s %s\n", "resource", "A before", "A after", "delta",
              "B before", "B after", "delta", "allowed", "verdict");
  // A's long-lived engine keeps what every peer the engine cycles made leaves behind: its id's state
  // (about 0.7 KiB of heap), its AV entry per NIC, and on shm the peer's mapped region.
  const long dead = o.engine_cycles;
  const long dead_shm = o.provider == "shm" ? dead * o.nics : 0;
  resource_row("fds", a.before.fds, a.after.fds, b.before.fds, b.after.fds, 0, false, 0, "", &v);
  resource_row("threads", a.before.threads, a.after.threads, b.before.threads, b.after.threads, 0, false, 0, "", &v);
  resource_row("heap(KiB)", a.before.heap_kib, a.after.heap_kib, b.before.heap_kib, b.after.heap_kib,
               o.heap_tolerance_kib + dead, false, o.heap_tolerance_kib,
               "malloc'd bytes in use (mallinfo2); A: + 1 KiB per dead peer", &v);
  resource_row("rss(KiB)", a.before.rss_kib - a.before.shm_rss_kib, a.after.rss_kib - a.after.shm_rss_kib,
               b.before.rss_kib - b.before.shm_rss_kib, b.after.rss_kib - b.after.shm_rss_kib, o.rss_tolerance_kib,
               false, o.rss_tolerance_kib, "after malloc_trim, less /dev/shm mappings (next rows)", &v);
  resource_row("shm maps", a.before.shm_maps, a.after.shm_maps, b.before.shm_maps, b.after.shm_maps, dead_shm, true,
               0, dead_shm ? "A: each dead peer's region stays mapped (its AV entry stays)" : "", &v);
  std::printf("%-12s %10ld %10ld %+8ld | %10ld %10ld %+8ld | %-20s %s\n", "shm rss(KiB)", a.before.shm_rss_kib,
              a.after.shm_rss_kib, a.after.shm_rss_kib - a.before.shm_rss_kib, b.before.shm_rss_kib, b.after.shm_rss_kib,
              b.after.shm_rss_kib - b.before.shm_rss_kib, "(reported)", "resident pages of those mappings");
  if (a.before.fi_known && b.before.fi_known) {
    for (int k = 0; k < kFiKinds; ++k) {
      const bool entries = std::string(kFiNames[k]) == "fi_av_entry";
      // ponte never removes an AV entry (core/fabric/fabric_av.cc): each peer the cycles made on
      // A's long-lived engine costs one per NIC; B's fresh engines take theirs with them.
      resource_row(kFiNames[k], a.before.fi[k], a.after.fi[k], b.before.fi[k], b.after.fi[k],
                   entries ? dead * o.nics : 0, entries, 0, entries ? "A: one per dead peer per NIC, by design" : "", &v);
    }
  } else {
    std::printf("fi_*         not counted: libponte-ficount is not in use (PONTE_FABRIC_LIB)\n");
  }
  std::printf("peak RSS: A %ld KiB, B %ld KiB; plugin warnings: A %ld, B %ld\n", a.peak_rss_kib,
              b.peak_rss_kib, a.warnings, b.warnings);
  if (v.failures.empty()) {
    std::printf("SOAK PASSED: %.2f GiB verified, 0 bytes lost, %d + %d cycles, resources back at baseline\n",
                static_cast<double>(total) / (1u << 30), o.plugin_cycles, o.engine_cycles);
    return 0;
  }
  std::printf("SOAK FAILED:\n");
  for (auto& f : v.failures) std::printf("  %s\n", f.c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  fix_malloc_thresholds();
  if (argc > 2 && std::string(argv[1]) == "--ponte-peer") {
    const Options o = parse(argc, argv, 3);  // argv[2] is the role
    set_environment(o);
    Channel ch(3);
    Report r = run_side(false, o, ch);
    if (!ch.send_str(encode_report(r))) die("could not send the report");
    std::string bye;
    ch.recv_str(&bye, o.timeout_s * 1000);
    return 0;
  }
  const Options o = parse(argc, argv, 1);
  set_environment(o);
  std::vector<std::string> args = {"side-b"};
  args.insert(args.end(), o.args.begin(), o.args.end());
  ponte::test::PeerProcess peer(args);
  if (!peer.started()) die("could not start side B");
  const auto t0 = Clock::now();
  Report a = run_side(true, o, peer.channel());
  std::string text;
  if (!peer.channel().recv_str(&text, o.timeout_s * 1000)) die("side B sent no report");
  Report b = decode_report(text);
  int rc = print_table(o, a, b);
  std::printf("wall time %.1f s\n", secs_since(t0));
  std::fflush(stdout);
  peer.channel().send_str("bye");
  if (peer.wait_exit(o.timeout_s * 1000) != 0) {
    std::printf("side B did not exit cleanly\n");
    rc = 1;
  }
  return rc;
}
