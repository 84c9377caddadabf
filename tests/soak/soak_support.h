// ponte-soak's shared pieces: options, the checksummed message format, resource snapshots of this
// process (descriptors, threads, RSS, heap, libfabric objects through libponte-ficount) and the
// lock-step channel between the two processes.
#pragma once

#include <dirent.h>
#include <errno.h>
#include <dlfcn.h>
#include <malloc.h>
#include <unistd.h>

#include <chrono>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "tests/common/loopback.h"
#include "tests/common/peer_process.h"

namespace ponte::soak {

using Clock = std::chrono::steady_clock;
using Channel = ponte::test::Channel;

[[noreturn]] inline void die(const char* fmt, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof(buf), fmt, ap);
  va_end(ap);
  std::fprintf(stderr, "%s[%d]: %s\n", program_invocation_short_name, static_cast<int>(getpid()), buf);
  std::fflush(stderr);
  std::_Exit(1);
}

struct Options {
  bool short_run = false;
  std::string provider = "tcp;ofi_rxm";
  uint64_t plugin_bytes = 10ull << 30;  // verified through the plugin, both directions together
  uint64_t engine_bytes = 10ull << 30;  // verified through the engine, both directions together
  int plugin_cycles = 1000;
  int engine_cycles = 1000;
  int window = 8;                  // messages in flight per direction
  uint32_t max_msg = 4u << 20;     // largest message
  int nics = 1;                    // NICs per plugin device / engine group (loopback repeats lo)
  int timeout_s = 60;              // a phase making no progress for this long fails
  long rss_tolerance_kib = 8192;   // see README in tests/soak
  long heap_tolerance_kib = 1024;
  int engine_cycles_asked = 0;     // before a provider's cap (see soak.cc)
  std::vector<std::string> args;   // as given, for the peer process
};

// ---- the message format ---------------------------------------------------------------------
// [seq u64][len u32][magic u32] pseudo-random body [checksum u64 of everything before it].
// The body depends on (stream, seq), so a message that never landed, landed twice, landed in the
// wrong buffer or arrived torn fails the check at the receiver.
constexpr uint32_t kMagic = 0x4b414f53;  // "SOAK"
constexpr uint32_t kMinMsg = 24;

inline uint64_t splitmix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Length of message seq of a stream: 10 % small (24 B..4 KiB), 25 % medium (4..256 KiB), the rest
// large (256 KiB..max), odd lengths included; deterministic, so both ends know it.
inline uint32_t message_len(uint64_t stream, uint64_t seq, uint32_t max) {
  const uint64_t h = splitmix(stream * 0x100000001b3ull + seq);
  const uint32_t r = static_cast<uint32_t>(h % 100), v = static_cast<uint32_t>(h >> 32);
  auto cap = [max](uint32_t x) { return x < max ? x : max; };  // max >= kMinMsg
  uint32_t lo, hi;
  if (r < 10) lo = kMinMsg, hi = cap(4096);
  else if (r < 35) lo = cap(4096), hi = cap(256u << 10);
  else lo = cap(256u << 10), hi = max;
  return lo + v % (hi - lo + 1);
}

// Messages a stream carries to move at least `bytes`.
inline uint64_t stream_messages(uint64_t stream, uint64_t bytes, uint32_t max, uint64_t* total = nullptr) {
  uint64_t n = 0, sum = 0;
  while (sum < bytes) sum += message_len(stream, n++, max);
  if (total) *total = sum;
  return n;
}

inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

// A 4-lane multiply-rotate checksum (xxhash64's round) over n bytes.
inline uint64_t checksum(const uint8_t* p, size_t n) {
  constexpr uint64_t P1 = 0x9e3779b185ebca87ull, P2 = 0xc2b2ae3d27d4eb4full;
  uint64_t a[4] = {P1 + P2, P2, 0, 0 - P1};
  size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    for (int k = 0; k < 4; ++k) {
      uint64_t w;
      std::memcpy(&w, p + i + 8 * k, 8);
      a[k] = rotl(a[k] + w * P2, 31) * P1;
    }
  }
  uint64_t h = rotl(a[0], 1) + rotl(a[1], 7) + rotl(a[2], 12) + rotl(a[3], 18) + n;
  for (; i < n; ++i) h = rotl(h ^ (p[i] * P1), 11) * P2;
  return splitmix(h);
}

inline void fill_message(uint8_t* p, uint32_t len, uint64_t stream, uint64_t seq) {
  std::memcpy(p, &seq, 8);
  std::memcpy(p + 8, &len, 4);
  std::memcpy(p + 12, &kMagic, 4);
  uint64_t x = splitmix(stream ^ (seq << 20) ^ 0x5eed);
  const uint32_t body_end = len - 8;
  uint32_t i = 16;
  for (; i + 8 <= body_end; i += 8) {
    x ^= x >> 12, x ^= x << 25, x ^= x >> 27;
    const uint64_t w = x * 0x2545f4914f6cdd1dull;
    std::memcpy(p + i, &w, 8);
  }
  for (; i < body_end; ++i) p[i] = static_cast<uint8_t>(x >> (i & 7) * 8);
  const uint64_t c = checksum(p, body_end);
  std::memcpy(p + body_end, &c, 8);
}

enum class Verdict { kOk, kShort, kHeader, kSequence, kLength, kChecksum };
inline const char* verdict_name(Verdict v) {
  switch (v) {
    case Verdict::kOk: return "ok";
    case Verdict::kShort: return "shorter than a header";
    case Verdict::kHeader: return "bad magic";
    case Verdict::kSequence: return "wrong sequence number (lost, repeated or misplaced)";
    case Verdict::kLength: return "length differs from the header";
    case Verdict::kChecksum: return "checksum mismatch";
  }
  return "?";
}

// Checks a received message: got is the length the transport reported.
inline Verdict check_message(const uint8_t* p, size_t got, uint64_t expect_seq, uint32_t expect_len) {
  if (got < kMinMsg) return Verdict::kShort;
  uint64_t seq;
  uint32_t len, magic;
  std::memcpy(&seq, p, 8);
  std::memcpy(&len, p + 8, 4);
  std::memcpy(&magic, p + 12, 4);
  if (magic != kMagic) return Verdict::kHeader;
  if (seq != expect_seq) return Verdict::kSequence;
  if (len != got || len != expect_len) return Verdict::kLength;
  uint64_t c;
  std::memcpy(&c, p + len - 8, 8);
  return c == checksum(p, len - 8) ? Verdict::kOk : Verdict::kChecksum;
}

// What one direction of a stream did, as its receiver saw it.
struct StreamResult {
  uint64_t messages = 0;     // verified
  uint64_t bytes = 0;        // verified
  uint64_t failures = 0;     // messages that failed their check
  uint64_t expected_messages = 0, expected_bytes = 0;
  double secs = 0;
};

// ---- resource snapshots -----------------------------------------------------------------------

constexpr int kFiKinds = 8;
inline const char* const kFiNames[kFiKinds] = {"fi_fabric", "fi_domain", "fi_endpoint", "fi_av",
                                               "fi_av_entry", "fi_cq", "fi_mr", "fi_mr_bytes"};

struct Snapshot {
  long fds = 0, threads = 0, rss_kib = 0, heap_kib = 0;
  long shm_maps = 0, shm_rss_kib = 0;  // mappings of /dev/shm files (libfabric shm's peer regions)
  bool fi_known = false;
  long fi[kFiKinds] = {};
};

inline long count_dir(const char* path) {
  long n = 0;
  DIR* d = opendir(path);
  if (!d) return -1;
  while (dirent* e = readdir(d))
    if (e->d_name[0] != '.') n++;
  closedir(d);
  return n;
}

// libponte-ficount's counters, when PONTE_FABRIC_LIB names it and the engine has loaded it.
using FiCountRead = int (*)(long* live, long* made, int n);
inline FiCountRead ficount_reader() {
  const char* lib = getenv("PONTE_FABRIC_LIB");
  if (!lib || !*lib) return nullptr;
  void* h = dlopen(lib, RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
  return h ? reinterpret_cast<FiCountRead>(dlsym(h, "ponte_ficount_read")) : nullptr;
}

// Mappings of /dev/shm files (libfabric shm maps each peer's region) and their resident KiB.
inline void count_shm_maps(long* maps, long* rss_kib) {
  *maps = *rss_kib = 0;
  FILE* f = std::fopen("/proc/self/smaps", "r");
  if (!f) return;
  char line[512];
  bool in_shm = false;
  while (std::fgets(line, sizeof(line), f)) {
    const char* sp = std::strchr(line, ' ');
    const bool header = sp && sp > line && sp[-1] != ':' && std::memchr(line, '-', static_cast<size_t>(sp - line));
    long kib = 0;
    if (header) {
      in_shm = std::strstr(line, " /dev/shm/") != nullptr;
      if (in_shm) ++*maps;
    } else if (in_shm && std::sscanf(line, "Rss: %ld kB", &kib) == 1) {
      *rss_kib += kib;
    }
  }
  std::fclose(f);
}

inline Snapshot snapshot() {
  malloc_trim(0);  // freed heap goes back first: RSS then shows what is held, not what is cached
  Snapshot s;
  s.fds = count_dir("/proc/self/fd") - 1;  // less the directory's own descriptor
  s.threads = count_dir("/proc/self/task");
  if (FILE* f = std::fopen("/proc/self/statm", "r")) {
    long size = 0, resident = 0;
    if (std::fscanf(f, "%ld %ld", &size, &resident) == 2) s.rss_kib = resident * (sysconf(_SC_PAGESIZE) / 1024);
    std::fclose(f);
  }
  count_shm_maps(&s.shm_maps, &s.shm_rss_kib);
  struct mallinfo2 mi = mallinfo2();
  s.heap_kib = static_cast<long>((mi.uordblks + mi.hblkhd) / 1024);
  if (FiCountRead rd = ficount_reader()) {
    rd(s.fi, nullptr, kFiKinds);
    s.fi_known = true;
  }
  return s;
}

inline std::string encode_snapshot(const Snapshot& s) {
  char b[256];
  int n = std::snprintf(b, sizeof(b), "%ld %ld %ld %ld %ld %ld %d", s.fds, s.threads, s.rss_kib, s.heap_kib,
                        s.shm_maps, s.shm_rss_kib, s.fi_known ? 1 : 0);
  std::string out(b, static_cast<size_t>(n));
  for (long v : s.fi) {
    out += ' ';
    out += std::to_string(v);
  }
  return out;
}
inline Snapshot decode_snapshot(const std::string& t) {
  Snapshot s;
  int known = 0;
  const char* p = t.c_str();
  int used = 0;
  if (std::sscanf(p, "%ld %ld %ld %ld %ld %ld %d%n", &s.fds, &s.threads, &s.rss_kib, &s.heap_kib, &s.shm_maps,
                  &s.shm_rss_kib, &known, &used) < 7)
    return s;
  s.fi_known = known != 0;
  p += used;
  for (long& v : s.fi) {
    if (std::sscanf(p, " %ld%n", &v, &used) != 1) break;
    p += used;
  }
  return s;
}

// ---- the process's setup -------------------------------------------------------------------------

// Defaults for this host: processes on loopback over `provider`, libfabric's objects counted through
// libponte-ficount when the build made it (PONTE_FICOUNT_SO). Set before the engine reads its knobs;
// what the environment already says wins, except the provider.
inline void set_loopback_environment(const std::string& provider, const char* timeout_ms) {
  setenv("PONTE_BACKEND", "fabric", 0);
  setenv("PONTE_FABRIC_PROVIDER", provider.c_str(), 1);
  ponte::test::keep_test_traffic_on_loopback();
  setenv("PONTE_CTRL_ADDR", "127.0.0.1", 0);
  setenv("PONTE_TIMEOUT_MS", timeout_ms, 0);
#ifdef PONTE_FICOUNT_SO
  if (access(PONTE_FICOUNT_SO, R_OK) == 0) setenv("PONTE_FABRIC_LIB", PONTE_FICOUNT_SO, 0);
#endif
}

// glibc's malloc raises its mmap and trim thresholds after a large block is freed, so a thread
// arena's freed top (tens of MiB after an engine came and went) stays resident: bounded, but it
// would hide a real leak in an RSS measure or fail one at random. Fixed thresholds return freed
// memory to the kernel; mallinfo2's count of bytes in use does not depend on this.
inline void fix_malloc_thresholds() {
  mallopt(M_MMAP_THRESHOLD, 256 << 10);
  mallopt(M_TRIM_THRESHOLD, 1 << 20);
}

// ---- lock step between the two processes --------------------------------------------------------

// Both sides send a tag and read the other's: a barrier with a name, checked.
inline void sync(const Channel& ch, const std::string& tag, int timeout_s) {
  if (!ch.send_str(tag)) die("lost the peer process at '%s'", tag.c_str());
  std::string got;
  if (!ch.recv_str(&got, timeout_s * 1000)) die("the peer process did not reach '%s'", tag.c_str());
  if (got != tag) die("out of step: at '%s', the peer at '%s'", tag.c_str(), got.c_str());
}
inline std::vector<uint8_t> trade(const Channel& ch, const std::vector<uint8_t>& mine, int timeout_s,
                                  const char* what) {
  if (!ch.send(mine)) die("lost the peer process sending %s", what);
  std::vector<uint8_t> theirs;
  if (!ch.recv(&theirs, timeout_s * 1000)) die("the peer process sent no %s", what);
  return theirs;
}

// Watches a loop for progress: fails it after timeout without any.
struct Watchdog {
  Clock::time_point last = Clock::now();
  int timeout_s;
  explicit Watchdog(int t) : timeout_s(t) {}
  void progressed() { last = Clock::now(); }
  bool expired() const { return Clock::now() - last > std::chrono::seconds(timeout_s); }
};

}  // namespace ponte::soak
