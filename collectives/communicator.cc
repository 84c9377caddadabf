// Communicator: bootstrap over AllGather, full mesh of engine peers, barrier, all_to_all_v and
// point-to-point on the engine's immediates (values from imm_space.h).
#include "collectives/communicator.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <thread>

#include "collectives/bytes.h"
#include "collectives/comm_impl.h"

namespace ponte {

using coll::get;
using coll::put;

using coll::imm_value;
using coll::ImmKind;

// ------------------------------------------------------------------------------------- FlagSet

void FlagSet::reserve(size_t n) {
  if (n <= cap_) return;
  flags_ = std::make_unique<Flag[]>(n);
  ranks_.assign(n, -1);
  cap_ = n;
  used_ = 0;
}

void FlagSet::refused(int rank, const Status& st) {
  if (refused_.ok()) {
    refused_ = st;
    refused_rank_ = rank;
  }
}

Status FlagSet::wait(Communicator::Impl& c, const char* what, bool interruptible) {
  // The waiting thread moves the data itself (Engine::progress, as NCCL's proxy does in test()):
  // the engine's worker then leaves it the data path instead of spinning beside it for the core,
  // and no completion needs a wake-up across threads. It yields after a pass that moved nothing;
  // after kPollWindow without progress it sleeps in growing steps (ranks may share cores, a
  // straggler may be computing), still polling between sleeps.
  constexpr auto kPollWindow = std::chrono::milliseconds(1);
  // An interrupt (c.interrupted) cancels every expectation of the group: those flags fire with
  // kCancelled at once, and the wait goes on for the rest (writes, which end by themselves), so
  // that no flag is left for the engine to fire into a set that is reused or freed.
  Engine& eng = *c.engine;
  auto idle_since = std::chrono::steady_clock::now();
  int bad = -1;
  Status first;
  int first_rank = -1;
  bool cancelled = false;
  auto cancel = [&] {
    cancelled = true;
    Status st = eng.cancel_expectations(c.group);
    if (!st.ok()) refused(-1, st);  // the engine is going down: its own errors end the flags
  };
  if (interruptible && c.was_interrupted && used_ > 0) cancel();  // a later wait of the same call
  unsigned passes = 0;
  for (size_t i = 0; i < used_; i++) {
    unsigned idle = 0;
    while (!flags_[i].done()) {
      if (interruptible && !cancelled && (++passes & 255u) == 0 && c.interrupt_requested()) cancel();
      if (eng.progress(c.group)) {
        idle = 0;
        continue;
      }
      if (++idle < 64 || (idle & 15u) != 0) {
        std::this_thread::yield();
        continue;
      }
      auto now = std::chrono::steady_clock::now();
      if (idle == 64) idle_since = now;
      auto idle_for = now - idle_since;
      if (idle_for >= kPollWindow)
        std::this_thread::sleep_for(idle_for < 2 * kPollWindow ? std::chrono::microseconds(5)
                                                               : std::chrono::microseconds(50));
    }
    const Status& st = flags_[i].status();
    if (!st.ok() && (first.ok() || (st.code() == Code::kPeerDead && first.code() != Code::kPeerDead))) {
      first = st;
      first_rank = ranks_[i];
      bad = static_cast<int>(i);
    }
  }
  (void)bad;
  used_ = 0;
  Status refused = refused_;
  int refused_rank = refused_rank_;
  refused_ = Status::Ok();
  refused_rank_ = -1;
  if (!refused.ok() && (first.ok() || refused.code() == Code::kPeerDead)) {
    first = refused;
    first_rank = refused_rank;
  }
  if (cancelled && first.code() != Code::kPeerDead) return c.interrupted_error(what);
  if (first.ok()) return first;
  return c.rank_error(first_rank, first, what);
}

// ------------------------------------------------------------------------------------- Impl

bool Communicator::Impl::interrupt_requested() {
  if (was_interrupted) return true;
  if (!interrupted) return false;
  const auto now = std::chrono::steady_clock::now();
  if (now < next_interrupt_check) return false;
  next_interrupt_check = now + kInterruptCheck;
  was_interrupted = interrupted(interrupted_arg);
  return was_interrupted;
}

Status Communicator::Impl::interrupted_error(const char* what) {
  Status out(Code::kCancelled, "%s: interrupted; the ranks are out of step, this communicator can no longer be used",
             what);
  if (failed.ok()) failed = out;
  return out;
}

Status Communicator::Impl::rank_error(int r, const Status& st, const char* what) {
  // Name the rank: the one the failed op concerned, else whichever peers the engine saw die.
  std::string dead;
  for (int o : others) {
    if (!engine->peer_dead(group, peers[o])) continue;
    if (!dead.empty()) dead += ',';  // appended in place: "," + string trips GCC 12's -Wrestrict
    dead += std::to_string(o);
  }
  Status out;
  if (st.code() == Code::kPeerDead || !dead.empty()) {
    int named = r;
    if (named < 0 || !engine->peer_dead(group, peers[named])) named = dead.empty() ? r : atoi(dead.c_str());
    out = Status(Code::kPeerDead, "%s: rank %d is dead (%s)", what, named, st.message());
  } else if (r >= 0) {
    out = Status(st.code(), "%s: rank %d: %s", what, r, st.message());
  } else {
    out = Status(st.code(), "%s: %s", what, st.message());
  }
  if (out.code() == Code::kPeerDead || out.code() == Code::kTimeout || out.code() == Code::kTransport) {
    if (failed.ok()) failed = out;
  }
  return out;
}

namespace {
constexpr uint8_t kRecordVersion = 1;
}  // namespace

void Communicator::Impl::reserve_scratch() {
  const size_t W = static_cast<size_t>(world);
  flags[0].reserve(3 * W + 2);  // all_to_all_v's writes: CTS, data and length record per rank
  for (int i = 1; i < 4; i++) flags[i].reserve(W + 1);
  send_off.assign(W + 1, 0);
  recv_off.assign(W + 1, 0);
  regions.assign(W, RemoteRegion{});
}

// Exchange slot: u8 version, u8 'X', u16 payload length, u32 call (low bits), payload.
Status Communicator::Impl::exchange(std::span<const uint8_t> mine, std::vector<std::vector<uint8_t>>* all) {
  PONTE_RETURN_IF_ERROR(failed);
  if (mine.size() > kCtrlSlot - 8) return Status(Code::kInvalidArgument, "exchange of %zu bytes (max %zu)", mine.size(), kCtrlSlot - 8);
  const uint32_t call = static_cast<uint32_t>(xchg_calls++);
  // This rank's own incoming slot is the staging of what it sends: nobody else writes it.
  uint8_t* out = ctrl_slot(kXchg, call, rank);
  put<uint8_t>(out, 0, kRecordVersion);
  put<uint8_t>(out, 1, 'X');
  put<uint16_t>(out, 2, static_cast<uint16_t>(mine.size()));
  put<uint32_t>(out, 4, call);
  memcpy(out + 8, mine.data(), mine.size());
  std::vector<ScatterTarget> targets;
  for (int r : others)
    targets.push_back({peers[r], ctrl_offset(kXchg, call, rank), 8 + mine.size(), &ctrl_remote[r],
                       ctrl_offset(kXchg, call, rank)});
  FlagSet fs(others.size() + 1);
  const uint32_t v = imm_value(ImmKind::kExchange, call, 0, static_cast<uint32_t>(rank));
  if (!targets.empty())
    fs.post(-1, [&](Notify n) { return engine->scatter(group, ctrl_mr, targets, &v, n); });
  for (int r : others)
    fs.post(r, [&](Notify n) {
      return engine->expect_imm(group, imm_value(ImmKind::kExchange, call, 0, static_cast<uint32_t>(r)), 1, peers[r], n);
    });
  PONTE_RETURN_IF_ERROR(fs.wait(*this, "exchange"));
  all->assign(world, {});
  for (int r = 0; r < world; r++) {
    const uint8_t* in = ctrl_slot(kXchg, call, r);
    const uint16_t len = get<uint16_t>(in, 2);
    if (get<uint8_t>(in, 0) != kRecordVersion || get<uint8_t>(in, 1) != 'X' || len > kCtrlSlot - 8 ||
        get<uint32_t>(in, 4) != call)
      return rank_error(r, Status(Code::kInvalidArgument, "malformed exchange record"), "exchange");
    (*all)[r].assign(in + 8, in + 8 + len);
  }
  return Status::Ok();
}

// ------------------------------------------------------------------------------------- Registration

Registration::Registration(Registration&& o) noexcept { *this = std::move(o); }
Registration& Registration::operator=(Registration&& o) noexcept {
  if (this != &o) {
    if (engine_ && mr_.id) engine_->deregister(mr_).ok();
    engine_ = o.engine_;
    mr_ = std::move(o.mr_);
    remote_ = std::move(o.remote_);
    o.engine_ = nullptr;
    o.mr_ = MemoryRegion{};
  }
  return *this;
}
Registration::~Registration() {
  if (engine_ && mr_.id) engine_->deregister(mr_).ok();
}

// ------------------------------------------------------------------------------------- Communicator

Communicator::Communicator() : impl_(std::make_unique<Impl>()) {}

Communicator::~Communicator() {
  // The engine's orderly shutdown ends what is still in flight.
  if (impl_->engine && impl_->ctrl_mr.id) impl_->engine->deregister(impl_->ctrl_mr).ok();
  impl_->engine.reset();
  free(impl_->ctrl);
}

int Communicator::rank() const { return impl_->rank; }
int Communicator::world() const { return impl_->world; }
Engine& Communicator::engine() { return *impl_->engine; }
int Communicator::group() const { return impl_->group; }
PeerId Communicator::peer(int r) const {
  return r >= 0 && r < impl_->world ? impl_->peers[r] : kAnyPeer;
}
uint32_t Communicator::timeout_ms() const { return impl_->timeout_ms; }

namespace {
// Bootstrap record: u8 version, u8 'B', u16 address bytes, u16 region bytes, u16 0, u32 world,
// u32 rank, address, control region.
constexpr size_t kBootHeader = 16;
}  // namespace

// A lower rank's hello (worker thread): remembers which inbound peer it is. Anything else is dropped.
static void on_hello(void* arg, PeerId from, std::span<const uint8_t> data) {
  auto* im = static_cast<Communicator::Impl*>(arg);
  if (data.size() != 12 || get<uint8_t>(data.data(), 0) != kRecordVersion || get<uint8_t>(data.data(), 1) != 'H' ||
      get<uint32_t>(data.data(), 4) != static_cast<uint32_t>(im->world))
    return;
  const uint32_t r = get<uint32_t>(data.data(), 8);
  if (r < static_cast<uint32_t>(im->rank)) im->hello_peer[r].store(from + 1, std::memory_order_release);
}

Result<std::unique_ptr<Communicator>> Communicator::create(int rank, int world, const AllGather& allgather,
                                                          CommunicatorOptions opts) {
  if (world < 1 || world > coll::kMaxRanks || rank < 0 || rank >= world)
    return Status(Code::kInvalidArgument, "Communicator: rank %d of world %d", rank, world);
  if (!allgather) return Status(Code::kInvalidArgument, "Communicator: no AllGather");
  std::unique_ptr<Communicator> c(new Communicator());
  Impl& im = *c->impl_;
  im.rank = rank;
  im.world = world;
  im.group = opts.group;
  im.timeout_ms = opts.engine.config.timeout_ms;
  im.interrupted = opts.interrupted;
  im.interrupted_arg = opts.interrupted_arg;
  im.hello_peer = std::make_unique<std::atomic<uint32_t>[]>(static_cast<size_t>(world));
  for (int r = 0; r < world; r++) im.hello_peer[r].store(0, std::memory_order_relaxed);
  PONTE_ASSIGN_OR_RETURN(im.engine, Engine::create(opts.engine));
  im.engine->set_recv_handler(im.group, &on_hello, &im);
  if (im.group < 0 || im.group >= im.engine->num_groups())
    return Status(Code::kInvalidArgument, "Communicator: the engine has no group %d", im.group);
  im.ctrl_len = Impl::kAreas * coll::kEpochs * static_cast<size_t>(world) * Impl::kCtrlSlot;
  im.ctrl = static_cast<uint8_t*>(aligned_alloc(4096, (im.ctrl_len + 4095) / 4096 * 4096));
  if (!im.ctrl) return Status(Code::kResource, "Communicator: no memory for the control arena");
  memset(im.ctrl, 0, im.ctrl_len);
  PONTE_ASSIGN_OR_RETURN(im.ctrl_mr, im.engine->register_memory(im.group, im.ctrl, im.ctrl_len));

  std::vector<uint8_t> addr = im.engine->address(im.group);
  std::vector<uint8_t> region = im.ctrl_mr.remote().encode();
  std::vector<uint8_t> mine(kBootHeader + addr.size() + region.size());
  put<uint8_t>(mine.data(), 0, kRecordVersion);
  put<uint8_t>(mine.data(), 1, 'B');
  put<uint16_t>(mine.data(), 2, static_cast<uint16_t>(addr.size()));
  put<uint16_t>(mine.data(), 4, static_cast<uint16_t>(region.size()));
  put<uint32_t>(mine.data(), 8, static_cast<uint32_t>(world));
  put<uint32_t>(mine.data(), 12, static_cast<uint32_t>(rank));
  memcpy(mine.data() + kBootHeader, addr.data(), addr.size());
  memcpy(mine.data() + kBootHeader + addr.size(), region.data(), region.size());
  std::vector<std::vector<uint8_t>> all;
  Status st = allgather(mine, &all);
  if (!st.ok()) return Status(st.code(), "Communicator: AllGather failed: %s", st.message());
  if (all.size() != static_cast<size_t>(world))
    return Status(Code::kInvalidArgument, "Communicator: AllGather returned %zu entries for world %d", all.size(), world);

  im.peers.assign(world, kAnyPeer);
  im.ctrl_remote.resize(world);
  im.p2p_sent.assign(world, 0);
  im.p2p_recvd.assign(world, 0);
  for (int r = 0; r < world; r++) {
    const auto& b = all[r];
    if (b.size() < kBootHeader || get<uint8_t>(b.data(), 0) != kRecordVersion || get<uint8_t>(b.data(), 1) != 'B')
      return Status(Code::kInvalidArgument, "Communicator: rank %d's bootstrap record is not one (%zu bytes)", r, b.size());
    const size_t al = get<uint16_t>(b.data(), 2), rl = get<uint16_t>(b.data(), 4);
    if (b.size() != kBootHeader + al + rl || get<uint32_t>(b.data(), 8) != static_cast<uint32_t>(world) ||
        get<uint32_t>(b.data(), 12) != static_cast<uint32_t>(r))
      return Status(Code::kInvalidArgument, "Communicator: rank %d's bootstrap record does not match (world %u, rank %u)",
                    r, get<uint32_t>(b.data(), 8), get<uint32_t>(b.data(), 12));
    auto rr = RemoteRegion::decode(std::span<const uint8_t>(b.data() + kBootHeader + al, rl));
    if (!rr.ok()) return Status(Code::kInvalidArgument, "Communicator: rank %d's control region: %s", r, rr.status().message());
    im.ctrl_remote[r] = *rr;
    if (r <= rank) continue;
    auto p = im.engine->connect(im.group, std::span<const uint8_t>(b.data() + kBootHeader, al));
    if (!p.ok()) return Status(p.status().code(), "Communicator: connecting to rank %d: %s", r, p.status().message());
    im.peers[r] = *p;
  }
  // Hello to every higher rank: u8 version, u8 'H', u16 0, u32 world, u32 rank.
  uint8_t* hello = im.ctrl_slot(Impl::kHello, 0, rank);
  put<uint8_t>(hello, 0, kRecordVersion);
  put<uint8_t>(hello, 1, 'H');
  put<uint16_t>(hello, 2, 0);
  put<uint32_t>(hello, 4, static_cast<uint32_t>(world));
  put<uint32_t>(hello, 8, static_cast<uint32_t>(rank));
  FlagSet hellos(static_cast<size_t>(world));
  for (int r = rank + 1; r < world; r++)
    hellos.post(r, [&](Notify n) {
      return im.engine->send(im.group, im.peers[r], {&im.ctrl_mr, im.ctrl_offset(Impl::kHello, 0, rank), 12}, n);
    });
  // Every lower rank's hello names its inbound peer.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(im.timeout_ms);
  for (int r = 0; r < rank; r++) {
    while (im.hello_peer[r].load(std::memory_order_acquire) == 0) {
      if (std::chrono::steady_clock::now() > deadline) {
        hellos.wait(im, "Communicator hello").ok();
        return Status(Code::kTimeout, "Communicator: rank %d did not connect within %u ms", r, im.timeout_ms);
      }
      if (im.interrupt_requested()) {
        hellos.wait(im, "Communicator hello").ok();
        return im.interrupted_error("Communicator: waiting for the lower ranks to connect");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    im.peers[r] = im.hello_peer[r].load(std::memory_order_acquire) - 1;
  }
  PONTE_RETURN_IF_ERROR(hellos.wait(im, "Communicator hello"));
  for (int r = 0; r < world; r++)
    if (r != rank) {
      im.others.push_back(r);
      im.other_peers.push_back(im.peers[r]);
    }
  im.reserve_scratch();
  PONTE_RETURN_IF_ERROR(c->barrier());
  return c;
}

Status Communicator::barrier() {
  Impl& im = *impl_;
  PONTE_RETURN_IF_ERROR(im.failed);
  if (im.others.empty()) return Status::Ok();
  // A rank leaves call n only after every rank entered it, so no rank is more than one call ahead of
  // any other: values of calls n and n + 4 never count together.
  const uint32_t call = static_cast<uint32_t>(im.barrier_calls++);
  FlagSet& fs = im.flags[1];
  fs.post(-1, [&](Notify n) {
    return im.engine->barrier(im.group, im.other_peers, imm_value(ImmKind::kBarrier, call, 0, static_cast<uint32_t>(im.rank)), n);
  });
  for (int r : im.others)
    fs.post(r, [&](Notify n) {
      return im.engine->expect_imm(im.group, imm_value(ImmKind::kBarrier, call, 0, static_cast<uint32_t>(r)), 1, im.peers[r], n);
    });
  return fs.wait(im, "barrier");
}

Result<Registration> Communicator::register_buffer(void* addr, size_t len) {
  Registration reg;
  PONTE_ASSIGN_OR_RETURN(reg.mr_, impl_->engine->register_memory(impl_->group, addr, len));
  reg.engine_ = impl_->engine.get();
  reg.remote_ = reg.mr_.remote().encode();
  return reg;
}

// ---- transfers: a clear-to-send record from the receiver, the data, and a length record.
//
// CTS (written by the receiver into the sender's incoming CTS slot for (call, receiver)):
//   u8 version, u8 'S', u16 region bytes, u32 call, u64 offset, u64 capacity, region.
// Length record (written by the sender into the receiver's incoming header slot for (call, sender)):
//   u8 version, u8 'L', u16 0, u32 call, u64 length (or ~0: refused, longer than the capacity),
//   u32 data immediates.
// The slots of call n are written again at call n + 4. A receiver writes call n + 4's CTS only after
// its call n + 3 got its data, which the sender wrote after it had read call n's CTS (calls between
// a pair run in order); a sender writes call n + 4's length record only after call n + 4's CTS,
// which the receiver wrote after reading call n's. Outgoing staging slots are reused only after the
// write from them completed (each call waits for its own writes).
namespace {
constexpr size_t kCtsFixed = 24;
constexpr uint64_t kRefused = ~uint64_t{0};
}  // namespace

struct TransferPlan {
  Communicator::Impl::Area in_cts, in_hdr, out_cts, out_hdr;
  ImmKind cts, hdr, data;
};
static const TransferPlan kA2a{Communicator::Impl::kA2aCts, Communicator::Impl::kA2aHdr, Communicator::Impl::kOutA2aCts,
                               Communicator::Impl::kOutA2aHdr, ImmKind::kCts, ImmKind::kHeader, ImmKind::kData};
// Point-to-point uses its own slots; its immediates differ from all_to_all_v's by the channel:
// 0 for all_to_all_v, 15 for send/recv (EpBuffers take 1..14).
static const TransferPlan kP2p{Communicator::Impl::kP2pCts, Communicator::Impl::kP2pHdr, Communicator::Impl::kOutP2pCts,
                               Communicator::Impl::kOutP2pHdr, ImmKind::kCts, ImmKind::kHeader, ImmKind::kData};
constexpr uint32_t kChannelA2a = 0;
constexpr uint32_t kChannelP2p = 15;

static Status check_ref(const BufferRef& b, size_t len, const char* what) {
  if (!b.reg || !b.reg->valid()) return Status(Code::kInvalidArgument, "%s: buffer is not registered", what);
  if (b.offset > b.reg->size() || len > b.reg->size() - b.offset)
    return Status(Code::kInvalidArgument, "%s: %zu bytes at offset %zu exceed the %zu-byte registration", what, len,
                  b.offset, b.reg->size());
  return Status::Ok();
}

namespace {
// Posts the clear-to-send for receiving `cap` bytes at buf from rank src.
void post_cts(Communicator::Impl& im, const TransferPlan& tp, uint32_t ch, uint32_t call, int src, const BufferRef& buf,
              size_t cap, FlagSet& fs) {
  uint8_t* o = im.ctrl_slot(tp.out_cts, call, src);
  const auto& rb = buf.reg->remote_bytes();
  put<uint8_t>(o, 0, kRecordVersion);
  put<uint8_t>(o, 1, 'S');
  put<uint16_t>(o, 2, static_cast<uint16_t>(rb.size()));
  put<uint32_t>(o, 4, call);
  put<uint64_t>(o, 8, buf.offset);
  put<uint64_t>(o, 16, cap);
  memcpy(o + kCtsFixed, rb.data(), rb.size());
  fs.post(src, [&](Notify n) {
    return im.engine->write_imm(im.group, im.peers[src],
                                {&im.ctrl_mr, im.ctrl_offset(tp.out_cts, call, src), kCtsFixed + rb.size()},
                                im.ctrl_remote[src], im.ctrl_offset(tp.in_cts, call, im.rank),
                                imm_value(tp.cts, call, ch, static_cast<uint32_t>(im.rank)), n);
  });
}

// With dst's CTS arrived: writes len bytes from buf (or refuses: len > capacity) and the length record.
Status send_after_cts(Communicator::Impl& im, const TransferPlan& tp, uint32_t ch, uint32_t call, int dst,
                      const BufferRef& buf, size_t len, RemoteRegion* region, FlagSet& fs) {
  const uint8_t* c = im.ctrl_slot(tp.in_cts, call, dst);
  const size_t rl = get<uint16_t>(c, 2);
  Status bad;
  if (get<uint8_t>(c, 0) != kRecordVersion || get<uint8_t>(c, 1) != 'S' || get<uint32_t>(c, 4) != call ||
      kCtsFixed + rl > Communicator::Impl::kCtrlSlot)
    return Status(Code::kInvalidArgument, "rank %d: malformed clear-to-send", dst);
  auto rr = RemoteRegion::decode(std::span<const uint8_t>(c + kCtsFixed, rl));
  if (!rr.ok()) return Status(Code::kInvalidArgument, "rank %d: clear-to-send region: %s", dst, rr.status().message());
  *region = *rr;
  const uint64_t off = get<uint64_t>(c, 8), cap = get<uint64_t>(c, 16);
  uint64_t sent = len;
  uint32_t data_imms = 0;
  if (len > cap) {
    sent = kRefused;
    bad = Status(Code::kInvalidArgument, "rank %d expects %llu bytes, this rank sends %zu", dst,
                 static_cast<unsigned long long>(cap), len);
  } else if (len > 0) {
    data_imms = im.engine->imms_per_write(im.group, im.peers[dst], len);
    fs.post(dst, [&](Notify n) {
      return im.engine->write_imm(im.group, im.peers[dst], {&buf.reg->region(), buf.offset, len}, *region, off,
                                  imm_value(tp.data, call, ch, static_cast<uint32_t>(im.rank)), n);
    });
  }
  uint8_t* h = im.ctrl_slot(tp.out_hdr, call, dst);
  put<uint8_t>(h, 0, kRecordVersion);
  put<uint8_t>(h, 1, 'L');
  put<uint16_t>(h, 2, 0);
  put<uint32_t>(h, 4, call);
  put<uint64_t>(h, 8, sent);
  put<uint32_t>(h, 16, data_imms);
  fs.post(dst, [&](Notify n) {
    return im.engine->write_imm(im.group, im.peers[dst], {&im.ctrl_mr, im.ctrl_offset(tp.out_hdr, call, dst), 20},
                                im.ctrl_remote[dst], im.ctrl_offset(tp.in_hdr, call, im.rank),
                                imm_value(tp.hdr, call, ch, static_cast<uint32_t>(im.rank)), n);
  });
  return bad;
}

// With src's length record arrived: checks it and expects its data. want: exact length, or
// SIZE_MAX for "at most the capacity".
Status recv_after_hdr(Communicator::Impl& im, const TransferPlan& tp, uint32_t ch, uint32_t call, int src, size_t want,
                      size_t* got, FlagSet& fs) {
  const uint8_t* h = im.ctrl_slot(tp.in_hdr, call, src);
  if (get<uint8_t>(h, 0) != kRecordVersion || get<uint8_t>(h, 1) != 'L' || get<uint32_t>(h, 4) != call)
    return Status(Code::kInvalidArgument, "rank %d: malformed length record", src);
  const uint64_t len = get<uint64_t>(h, 8);
  const uint32_t data_imms = get<uint32_t>(h, 16);
  if (len == kRefused) return Status(Code::kInvalidArgument, "rank %d sends more than this rank receives", src);
  if (want != SIZE_MAX && len != want)
    return Status(Code::kInvalidArgument, "rank %d sends %llu bytes, this rank expects %zu", src,
                  static_cast<unsigned long long>(len), want);
  if ((len == 0) != (data_imms == 0)) return Status(Code::kInvalidArgument, "rank %d: length record inconsistent", src);
  *got = len;
  if (data_imms)
    fs.post(src, [&](Notify n) {
      return im.engine->expect_imm(im.group, imm_value(tp.data, call, ch, static_cast<uint32_t>(src)), data_imms,
                                   im.peers[src], n);
    });
  return Status::Ok();
}

Status first_error(Status a, const Status& b) { return a.ok() ? b : a; }
}  // namespace

Status Communicator::all_to_all_v(BufferRef send, std::span<const size_t> send_counts, BufferRef recv,
                                  std::span<const size_t> recv_counts) {
  Impl& im = *impl_;
  PONTE_RETURN_IF_ERROR(im.failed);
  const size_t W = static_cast<size_t>(im.world);
  if (send_counts.size() != W || recv_counts.size() != W)
    return Status(Code::kInvalidArgument, "all_to_all_v: %zu send and %zu recv counts for world %zu", send_counts.size(),
                  recv_counts.size(), W);
  std::vector<size_t>& soff = im.send_off;
  std::vector<size_t>& roff = im.recv_off;
  for (size_t r = 0; r < W; r++) {
    soff[r + 1] = soff[r] + send_counts[r];
    roff[r + 1] = roff[r] + recv_counts[r];
  }
  PONTE_RETURN_IF_ERROR(check_ref(send, soff[W], "all_to_all_v send"));
  PONTE_RETURN_IF_ERROR(check_ref(recv, roff[W], "all_to_all_v recv"));
  const int me = im.rank;
  if (send_counts[me] != recv_counts[me])
    return Status(Code::kInvalidArgument, "all_to_all_v: this rank sends itself %zu bytes but receives %zu",
                  send_counts[me], recv_counts[me]);
  const uint32_t call = static_cast<uint32_t>(im.a2a_calls++);
  const uint32_t ch = kChannelA2a;
  FlagSet &sends = im.flags[0], &cts = im.flags[1], &hdrs = im.flags[2], &data = im.flags[3];
  // Clear-to-send to every source; expect every destination's, and every source's length record.
  for (int r : im.others) {
    post_cts(im, kA2a, ch, call, r, BufferRef{recv.reg, recv.offset + roff[r]}, recv_counts[r], sends);
    cts.post(r, [&](Notify n) {
      return im.engine->expect_imm(im.group, imm_value(kA2a.cts, call, ch, static_cast<uint32_t>(r)), 1, im.peers[r], n);
    });
    hdrs.post(r, [&](Notify n) {
      return im.engine->expect_imm(im.group, imm_value(kA2a.hdr, call, ch, static_cast<uint32_t>(r)), 1, im.peers[r], n);
    });
  }
  Status st = cts.wait(im, "all_to_all_v (clear-to-send)");
  std::vector<RemoteRegion>& regions = im.regions;
  if (st.ok())
    for (int r : im.others)
      st = first_error(st, send_after_cts(im, kA2a, ch, call, r, BufferRef{send.reg, send.offset + soff[r]},
                                          send_counts[r], &regions[r], sends));
  // This rank's own share is copied while the writes are on the wire. Before them, the copy only
  // overlapped the clear-to-send's round trip: ep-bench's 1 MiB per pair (shm, W 2, 400 calls) went
  // from 0.60-0.78 of the engine's own writes' bandwidth to 0.88-1.08.
  im.engine->start_submitted(im.group);
  memcpy(static_cast<uint8_t*>(recv.reg->data()) + recv.offset + roff[me],
         static_cast<const uint8_t*>(send.reg->data()) + send.offset + soff[me], send_counts[me]);
  // Length records come whether or not this rank could send (a dead peer's expectation fails).
  Status hs = hdrs.wait(im, "all_to_all_v (length records)");
  if (hs.ok())
    for (int r : im.others) {
      size_t got = 0;
      hs = first_error(hs, recv_after_hdr(im, kA2a, ch, call, r, recv_counts[r], &got, data));
    }
  hs = first_error(hs, data.wait(im, "all_to_all_v (data)"));
  Status ss = sends.wait(im, "all_to_all_v (writes)");
  return first_error(first_error(st, hs), ss);
}

Status Communicator::all_to_all_v(const void* send, std::span<const size_t> send_counts, void* recv,
                                  std::span<const size_t> recv_counts) {
  size_t sl = std::accumulate(send_counts.begin(), send_counts.end(), size_t{0});
  size_t rl = std::accumulate(recv_counts.begin(), recv_counts.end(), size_t{0});
  // Zero-length registrations are refused: register at least one byte of a valid pointer.
  static uint8_t dummy[64];
  Result<Registration> s = register_buffer(sl ? const_cast<void*>(send) : dummy, sl ? sl : 1);
  if (!s.ok()) return s.status();
  Result<Registration> r = register_buffer(rl ? recv : dummy + 32, rl ? rl : 1);
  if (!r.ok()) return r.status();
  return all_to_all_v(BufferRef{&*s, 0}, send_counts, BufferRef{&*r, 0}, recv_counts);
}

Status Communicator::send(int dst, BufferRef buf, size_t len) {
  Impl& im = *impl_;
  PONTE_RETURN_IF_ERROR(im.failed);
  if (dst < 0 || dst >= im.world || dst == im.rank)
    return Status(Code::kInvalidArgument, "send: destination rank %d (this is rank %d of %d)", dst, im.rank, im.world);
  PONTE_RETURN_IF_ERROR(check_ref(buf, len, "send"));
  const uint32_t call = static_cast<uint32_t>(im.p2p_sent[dst]++);
  FlagSet &cts = im.flags[1], &sends = im.flags[0];
  cts.post(dst, [&](Notify n) {
    return im.engine->expect_imm(im.group, imm_value(kP2p.cts, call, kChannelP2p, static_cast<uint32_t>(dst)), 1,
                                 im.peers[dst], n);
  });
  PONTE_RETURN_IF_ERROR(cts.wait(im, "send (clear-to-send)"));
  RemoteRegion region;
  Status st = send_after_cts(im, kP2p, kChannelP2p, call, dst, buf, len, &region, sends);
  return first_error(st, sends.wait(im, "send"));
}

Status Communicator::recv(int src, BufferRef buf, size_t len, size_t* recv_len) {
  Impl& im = *impl_;
  PONTE_RETURN_IF_ERROR(im.failed);
  if (src < 0 || src >= im.world || src == im.rank)
    return Status(Code::kInvalidArgument, "recv: source rank %d (this is rank %d of %d)", src, im.rank, im.world);
  PONTE_RETURN_IF_ERROR(check_ref(buf, len, "recv"));
  const uint32_t call = static_cast<uint32_t>(im.p2p_recvd[src]++);
  FlagSet &sends = im.flags[0], &hdr = im.flags[1], &data = im.flags[2];
  post_cts(im, kP2p, kChannelP2p, call, src, buf, len, sends);
  hdr.post(src, [&](Notify n) {
    return im.engine->expect_imm(im.group, imm_value(kP2p.hdr, call, kChannelP2p, static_cast<uint32_t>(src)), 1,
                                 im.peers[src], n);
  });
  Status st = hdr.wait(im, "recv (length record)");
  size_t got = 0;
  if (st.ok()) st = recv_after_hdr(im, kP2p, kChannelP2p, call, src, SIZE_MAX, &got, data);
  st = first_error(st, data.wait(im, "recv"));
  st = first_error(st, sends.wait(im, "recv (clear-to-send)"));
  if (st.ok() && recv_len) *recv_len = got;
  return st;
}

}  // namespace ponte
