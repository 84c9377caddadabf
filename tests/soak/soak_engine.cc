// ponte-soak's engine half (see soak_engine.h).
#include "tests/soak/soak_engine.h"

#include <algorithm>
#include <atomic>
#include <thread>

namespace ponte::soak {

namespace {

// Immediate values (a bounded set: the engine's counter table never forgets a value).
constexpr uint32_t kData = 0x51000;    // + slot: a stream message landed in that slot
constexpr uint32_t kCredit = 0x52000;  // + slot: the receiver verified the slot; reuse it
constexpr uint32_t kCycle = 0x53000;   // a cycle's message

EngineOptions engine_options(const Options& o) {
  EngineOptions e;
  e.groups.push_back(std::vector<size_t>(static_cast<size_t>(o.nics), 0));
  return e;
}

std::unique_ptr<Engine> make_engine(const Options& o) {
  auto e = Engine::create(engine_options(o));
  if (!e.ok()) die("Engine::create: %s", e.status().message());
  return std::move(e).value();
}

// Page-aligned memory registered with an engine, freed with it.
struct Registered {
  Engine* eng = nullptr;
  uint8_t* ptr = nullptr;
  size_t len = 0;
  MemoryRegion mr;
  Registered(Engine& e, size_t n) : eng(&e), len((n + 4095) / 4096 * 4096) {
    ptr = static_cast<uint8_t*>(std::aligned_alloc(4096, len));
    if (!ptr) die("out of memory (%zu bytes)", len);
    std::memset(ptr, 0, len);
    auto r = e.register_memory(0, ptr, len);
    if (!r.ok()) die("register_memory(%zu): %s", len, r.status().message());
    mr = std::move(r).value();
  }
  ~Registered() {
    Status st = eng->deregister(mr);
    if (!st.ok()) die("deregister: %s", st.message());
    std::free(ptr);
  }
  Registered(const Registered&) = delete;
  Registered& operator=(const Registered&) = delete;
  std::vector<uint8_t> descriptor() const { return mr.remote().encode(); }
};

RemoteRegion decode_region(const std::vector<uint8_t>& b) {
  auto r = RemoteRegion::decode(b);
  if (!r.ok()) die("bad region descriptor from the peer: %s", r.status().message());
  return r.value();
}

// Completions counted where the engine's progress runs them (its worker or our progress call).
struct Done {
  std::atomic<uint64_t> count{0};
  std::atomic<uint64_t> errors{0};
  static void fire(void* arg, const Status& st) {
    auto* d = static_cast<Done*>(arg);
    if (!st.ok()) {
      if (d->errors.fetch_add(1) < 3) std::fprintf(stderr, "ponte-soak: engine operation failed: %s\n", st.message());
    }
    d->count.fetch_add(1, std::memory_order_release);
  }
};

// Waits for peers(0) to list more than `seen` inbound peers; returns the newest.
PeerId wait_inbound(Engine& e, size_t seen, int timeout_s) {
  Watchdog wd(timeout_s);
  for (;;) {
    auto ps = e.peers(0);
    if (ps.size() > seen) return ps.back();
    if (wd.expired()) die("no inbound peer after %d s", timeout_s);
    if (!e.progress(0)) std::this_thread::yield();
  }
}

}  // namespace

EngineSoak::EngineSoak(const Options& o, const Channel& ch, bool side_a) : o_(o), ch_(ch), a_(side_a) {
  eng_ = make_engine(o_);
  their_address_ = trade(ch_, eng_->address(0), o_.timeout_s, "engine address");
  if (a_) {
    auto p = eng_->connect(0, their_address_);
    if (!p.ok()) die("connect: %s", p.status().message());
    peer_ = p.value();
  } else {
    peer_ = wait_inbound(*eng_, 0, o_.timeout_s);
  }
  Watchdog wd(o_.timeout_s);
  while (!eng_->peer_ready(0, peer_)) {
    if (wd.expired() || eng_->peer_dead(0, peer_)) die("the engines did not connect");
    std::this_thread::yield();
  }
  sync(ch_, "engine-connected", o_.timeout_s);
}

EngineSoak::~EngineSoak() = default;

StreamResult EngineSoak::stream(uint64_t bytes_each_way, uint64_t out, uint64_t in) {
  Engine& e = *eng_;
  const int w = o_.window;
  const size_t slot = (o_.max_msg + 4095) / 4096 * 4096;
  Registered src(e, slot * static_cast<size_t>(w));
  Registered dst(e, slot * static_cast<size_t>(w));
  const RemoteRegion remote = decode_region(trade(ch_, dst.descriptor(), o_.timeout_s, "stream region"));

  StreamResult res;
  uint64_t out_bytes = 0;
  const uint64_t n_out = stream_messages(out, bytes_each_way, o_.max_msg, &out_bytes);
  res.expected_messages = stream_messages(in, bytes_each_way, o_.max_msg, &res.expected_bytes);
  const uint64_t n_in = res.expected_messages;

  // Message seq uses slot seq % w. A slot is written again once its last write completed here
  // and the receiver's credit for it arrived.
  std::vector<Done> writes(static_cast<size_t>(w));
  std::vector<uint64_t> posted(static_cast<size_t>(w), 0);
  std::vector<uint8_t> owed(static_cast<size_t>(w), 0);      // credits we must still send
  std::vector<uint8_t> awaiting(static_cast<size_t>(w), 0);  // credits we still wait for
  Done credits;
  uint64_t credits_posted = 0, next_send = 0, next_recv = 0, credits_in = 0;
  Watchdog wd(o_.timeout_s);
  const auto t0 = Clock::now();
  auto finished = [&] {
    return next_send == n_out && credits_in == n_out && next_recv == n_in &&
           credits.count.load(std::memory_order_acquire) == credits_posted &&
           std::all_of(owed.begin(), owed.end(), [](uint8_t x) { return x == 0; });
  };
  while (!finished()) {
    bool progress = e.progress(0);
    // Credits that came back free their slots.
    for (int s = 0; s < w; ++s) {
      if (awaiting[s] && e.imm_arrived(0, kCredit + s) > 0) {
        e.consume_imm(0, kCredit + s, 1);
        awaiting[s] = 0, ++credits_in, progress = true;
      }
    }
    // Sends in seq order while the next one's slot is free.
    while (next_send < n_out) {
      const size_t s = next_send % static_cast<uint64_t>(w);
      if (awaiting[s] || writes[s].count.load(std::memory_order_acquire) != posted[s]) break;
      const uint32_t len = message_len(out, next_send, o_.max_msg);
      fill_message(src.ptr + slot * s, len, out, next_send);
      Status st = e.write_imm(0, peer_, LocalSlice{&src.mr, slot * s, len}, remote, slot * s,
                              kData + static_cast<uint32_t>(s), Notify{&Done::fire, &writes[s]});
      if (st.code() == Code::kAgain) break;
      if (!st.ok()) die("write_imm: %s", st.message());
      ++posted[s], awaiting[s] = 1, ++next_send, progress = true;
    }
    // Receives in seq order: verify once all of its immediates arrived, then owe a credit.
    while (next_recv < n_in) {
      const size_t s = next_recv % static_cast<uint64_t>(w);
      if (owed[s]) break;  // its previous credit has not gone out yet
      const uint32_t len = message_len(in, next_recv, o_.max_msg);
      const uint32_t need = e.imms_per_write(0, peer_, len);
      const uint32_t value = kData + static_cast<uint32_t>(s);
      if (e.imm_arrived(0, value) < need) break;
      e.consume_imm(0, value, need);
      const Verdict v = check_message(dst.ptr + slot * s, len, next_recv, len);
      if (v == Verdict::kOk) {
        ++res.messages, res.bytes += len;
      } else if (++res.failures <= 5) {
        std::fprintf(stderr, "ponte-soak: engine message %llu (%u B): %s\n",
                     static_cast<unsigned long long>(next_recv), len, verdict_name(v));
      }
      owed[s] = 1, ++next_recv, progress = true;
    }
    for (int s = 0; s < w; ++s) {
      if (!owed[s]) continue;
      Status st = e.imm(0, peer_, kCredit + static_cast<uint32_t>(s), Notify{&Done::fire, &credits});
      if (st.code() == Code::kAgain) break;
      if (!st.ok()) die("imm (credit): %s", st.message());
      owed[s] = 0, ++credits_posted, progress = true;
    }
    uint64_t errors = credits.errors.load();
    for (auto& d : writes) errors += d.errors.load();
    if (errors) die("engine stream: %llu operations failed", static_cast<unsigned long long>(errors));
    if (progress) {
      wd.progressed();
    } else {
      if (wd.expired())
        die("engine stream stalled for %d s: sent %llu/%llu (credits back %llu), received %llu/%llu",
            o_.timeout_s, static_cast<unsigned long long>(next_send), static_cast<unsigned long long>(n_out),
            static_cast<unsigned long long>(credits_in), static_cast<unsigned long long>(next_recv),
            static_cast<unsigned long long>(n_in));
      std::this_thread::yield();
    }
  }
  // The last credits' local completions and the last writes' are in: nothing still uses src/dst.
  Watchdog tail(o_.timeout_s);
  for (int s = 0; s < w; ++s) {
    while (writes[s].count.load(std::memory_order_acquire) != posted[s]) {
      if (tail.expired()) die("engine stream: writes did not complete");
      if (!e.progress(0)) std::this_thread::yield();
    }
  }
  res.secs = std::chrono::duration<double>(Clock::now() - t0).count();
  sync(ch_, "engine-stream-done", o_.timeout_s);  // the peer no longer writes into dst
  return res;
}

int EngineSoak::cycles(int first, int n, uint64_t out, uint64_t in) {
  constexpr uint32_t kCycleMax = 64u << 10;
  int ok = 0;
  for (int k = first; k < first + n; ++k) {
    const bool a_dials = k % 2 == 0;
    std::unique_ptr<Engine> fresh;
    if (!a_) fresh = make_engine(o_);
    Engine& e = a_ ? *eng_ : *fresh;
    {
      Registered tx(e, kCycleMax), rx(e, kCycleMax);
      // Side B sends its fresh engine's address; both trade their receive regions.
      std::vector<uint8_t> fresh_addr = trade(ch_, a_ ? std::vector<uint8_t>{} : e.address(0), o_.timeout_s,
                                              "cycle address");
      const RemoteRegion remote = decode_region(trade(ch_, rx.descriptor(), o_.timeout_s, "cycle region"));
      PeerId p;
      if (a_ == a_dials) {
        auto r = e.connect(0, a_ ? fresh_addr : their_address_);
        if (!r.ok()) die("cycle %d: connect: %s", k, r.status().message());
        p = r.value();
      } else {
        p = wait_inbound(e, a_ ? inbound_seen_ : 0, o_.timeout_s);
      }
      if (a_) {
        if (a_ != a_dials) inbound_seen_++;
        cycle_peers_.push_back(p);
      }
      const uint32_t len = message_len(out, static_cast<uint64_t>(k), kCycleMax);
      const uint32_t rlen = message_len(in, static_cast<uint64_t>(k), kCycleMax);
      fill_message(tx.ptr, len, out, static_cast<uint64_t>(k));
      Done wrote;
      Watchdog wd(o_.timeout_s);
      for (;;) {
        Status st = e.write_imm(0, p, LocalSlice{&tx.mr, 0, len}, remote, 0, kCycle, Notify{&Done::fire, &wrote});
        if (st.ok()) break;
        if (st.code() != Code::kAgain || wd.expired()) die("cycle %d: write_imm: %s", k, st.message());
        std::this_thread::yield();
      }
      for (;;) {  // its immediates here (the count needs the peer's NIC count: known once ready)
        const uint32_t need = e.peer_ready(0, p) ? e.imms_per_write(0, p, rlen) : 0;
        if (need && e.imm_arrived(0, kCycle) >= need && wrote.count.load(std::memory_order_acquire) == 1) {
          e.consume_imm(0, kCycle, need);
          break;
        }
        if (wd.expired() || wrote.errors.load())
          die("cycle %d: %s", k, wrote.errors.load() ? "the write failed" : "the peer's message did not arrive");
        if (!e.progress(0)) std::this_thread::yield();
      }
      const Verdict v = check_message(rx.ptr, rlen, static_cast<uint64_t>(k), rlen);
      if (v == Verdict::kOk) ++ok;
      else std::fprintf(stderr, "ponte-soak: engine cycle %d: %s\n", k, verdict_name(v));
      sync(ch_, "engine-cycle-verified", o_.timeout_s);
    }  // deregistered, freed
    fresh.reset();  // side B: the fresh engine goes (A sees its peer close)
    sync(ch_, "engine-cycle-closed", o_.timeout_s);
  }
  return ok;
}

int EngineSoak::settle() {
  Watchdog wd(o_.timeout_s);
  for (;;) {
    int alive = 0;
    for (PeerId p : cycle_peers_) alive += eng_->peer_dead(0, p) ? 0 : 1;
    if (alive == 0 || wd.expired()) return alive;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

}  // namespace ponte::soak
