// NicGroup's scheduling: in-flight slots, starting submitted operations, posting their shards
// (striped over NICs) in FIFO order, and handling their completions.
#include "core/nic_group.h"

#include <string.h>
#include <sys/epoll.h>

#include <algorithm>

#include "core/log.h"
#include "core/nic_group_internal.h"

namespace ponte {

uint32_t NicGroup::alloc_slot() {
  if (free_slots_.empty()) return kNoSlot;
  uint32_t i = free_slots_.back();
  free_slots_.pop_back();
  Slot& s = slots_[i];
  s.used = true;
  s.error = Code::kOk;
  s.error_msg[0] = 0;
  s.next_shard = s.shards = s.outstanding = 0;
  s.prev = kNoSlot;
  s.next = active_head_;
  if (active_head_ != kNoSlot) slots_[active_head_].prev = i;
  active_head_ = i;
  active_count_++;
  return i;
}

void NicGroup::finish(uint32_t i) {
  Slot& s = slots_[i];
  Notify done = s.op.done;
  Code code = s.error;
  char msg[96];
  memcpy(msg, s.error_msg, sizeof(msg));
  // Release before notifying: the callback may submit again.
  s.used = false;
  s.runnable = false;
  s.gen++;
  if (s.prev != kNoSlot) slots_[s.prev].next = s.next; else active_head_ = s.next;
  if (s.next != kNoSlot) slots_[s.next].prev = s.prev;
  free_slots_.push_back(i);
  active_count_--;
  if (code == Code::kOk) done(Status::Ok());
  else done(Status(code, "%s", msg));
}

void NicGroup::fail_slot(uint32_t i, Code code, const char* why) {
  Slot& s = slots_[i];
  if (s.error == Code::kOk) {
    s.error = code;
    snprintf(s.error_msg, sizeof(s.error_msg), "%s", why);
  }
  if (s.runnable) {
    // Unlink from the runnable FIFO.
    uint32_t prev = kNoSlot;
    for (uint32_t r = run_head_; r != kNoSlot; prev = r, r = slots_[r].run_next) {
      if (r != i) continue;
      if (prev == kNoSlot) run_head_ = slots_[r].run_next; else slots_[prev].run_next = slots_[r].run_next;
      if (run_tail_ == r) run_tail_ = prev;
      break;
    }
    s.runnable = false;
  }
  // Shards still on the NIC complete later with a stale generation and are ignored.
  finish(i);
}

// Deadlines start from the clock as it is when the work starts. The loop's clock (now_) is only as
// fresh as the last pass that read it, and a worker that was off the CPU (a loaded host) or kept
// in a slow completion callback would start what was submitted meanwhile with its
// PONTE_TIMEOUT_MS already spent (under TSan on a loaded host a 64 MiB striped write failed with
// kTimeout half a second after it was posted; tests/faults/stall_test.cc). So drain_queue reads the
// clock once per batch it starts, and an operation started in place (submitted from a callback on
// this thread) reads it itself. Only the holder of the progress token runs either.
namespace {
thread_local bool tls_batch_clock = false;  // start_op runs inside drain_queue's batch
}  // namespace

bool NicGroup::drain_queue() {
  bool did = false;
  for (int n = 0; n < 256; n++) {
    Op* op = queue_.front();
    if (!op) break;
    if (op->needs_slot() && free_slots_.empty())
      break;  // back-pressure: leave it queued until a slot frees
    if (!did) {
      now_ = Clock::now();
      tls_batch_clock = true;
    }
    start_op(*op);  // reads the entry in place; it stays ours until pop()
    queue_.pop();
    did = true;
  }
  tls_batch_clock = false;
  return did;
}

void NicGroup::start_op(const Op& op) {
  if (!tls_batch_clock) now_ = Clock::now();
  const auto now = now_;  // deadlines are in ms
  switch (op.type) {
    case Op::kCall:
      op.call(op.call_arg);
      op.done(Status::Ok());
      return;
    case Op::kExpect: {
      uint32_t t = op.timeout_ms ? op.timeout_ms : cfg_.timeout_ms;
      if (op.peer != kAnyPeer && peer_dead(op.peer)) {  // a draining peer's counters still count
        op.done(Status(Code::kPeerDead, "expect_imm: peer %u is dead", op.peer));
        return;
      }
      Status st = imm_.expect(op.imm, op.count, op.peer, now + std::chrono::milliseconds(t), op.done);
      if (!st.ok()) op.done(st);
      return;
    }
    case Op::kConnect: {
      Peer& p = peers_[op.peer];  // new_outbound_peer recorded its address
      p.handshake_deadline = now + std::chrono::milliseconds(cfg_.timeout_ms);
      ControlEndpoint ep;
      ep.family = p.addr.ip_family;
      memcpy(ep.ip, p.addr.ip, 16);
      ep.port = p.addr.port;
      Status st = attach_backend(op.peer);
      if (st.ok()) st = p.sock[0].connect(ep);
      if (!st.ok()) return peer_died(op.peer, Code::kPeerDead, st.message());
      epoll_event ev{};
      ev.events = EPOLLIN | EPOLLOUT | EPOLLRDHUP;
      ev.data.u64 = static_cast<uint64_t>(op.peer) << 1;
      epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, p.sock[0].fd(), &ev);
      service_peer(op.peer, 0);
      return;
    }
    default:
      break;
  }
  uint32_t i = alloc_slot();  // drain_queue made sure one is free
  Slot& s = slots_[i];
  s.op = op;
  s.deadline = now + std::chrono::milliseconds(cfg_.timeout_ms);
  s.first_nic = first_nic_++;
  switch (op.type) {
    case Op::kWrite: {
      int n = op.whole ? 1 : std::min<int>(peer_nics(op.peer), op.remote.nics);
      s.plan = StripePlan::make(op.len, n, cfg_.stripe_min_bytes, peer_max_shard(op.peer));
      s.shards = s.plan.shards;
      break;
    }
    case Op::kPaged:
    case Op::kScatter:
    case Op::kBarrier:
      s.shards = op.count;
      break;
    case Op::kRead:
      s.shards = op.count ? op.count : 1;  // read_each_nic: one read per NIC
      break;
    default:
      s.shards = 1;
      break;
  }
  if (s.shards == 0) return finish(i);
  s.runnable = true;
  s.run_next = kNoSlot;
  if (run_tail_ == kNoSlot) run_head_ = i; else slots_[run_tail_].run_next = i;
  run_tail_ = i;
}

NicGroup::PostResult NicGroup::post_shard(Slot& s, uint32_t si) {
  const Op& op = s.op;
  const uint32_t j = s.next_shard;
  PeerId peer = op.peer;
  if (op.type == Op::kScatter) peer = op.targets[j].peer;
  else if (op.type == Op::kBarrier) peer = op.peers[j];
  uint8_t st = peers_[peer].state.load(std::memory_order_acquire);
  if (st == kDead) {
    fail_slot(si, Code::kPeerDead, "peer is dead");
    return PostResult::kFailed;
  }
  if (st != kReady) return PostResult::kWait;
  Peer& p = peers_[peer];
  int pn = p.nics.load(std::memory_order_relaxed);
  uint64_t ctx = (static_cast<uint64_t>(s.gen) << 32) | si;
  Status rc;
  const uint8_t* base = op.mr ? static_cast<const uint8_t*>(op.mr->addr) : nullptr;
  // Every write-type operation comes down to one write: NIC k, local bytes, remote address and key.
  auto write_on = [&](int k, const uint8_t* local, size_t len, void* desc, uint64_t raddr, uint64_t rkey) {
    WriteWr wr;
    wr.peer = p.nic_peer[k];
    wr.local = local;
    wr.len = len;
    wr.desc = desc;
    wr.remote_addr = raddr;
    wr.rkey = rkey;
    wr.imm = op.imm;
    wr.has_imm = op.has_imm;
    wr.inline_ok = !op.mr || op.mr->kind == MemKind::kHost;  // GPU memory never goes inline
    wr.ctx = ctx;
    return nics_[k]->post_write(wr);
  };
  switch (op.type) {
    case Op::kWrite: {
      int k = static_cast<int>((s.first_nic + j) % static_cast<uint32_t>(s.plan.nics));
      size_t len = s.plan.shard_len(j, op.len);
      size_t off = len ? s.plan.shard_offset(j) : 0;
      rc = write_on(k, base + op.offset + off, len, op.mr->nic_mrs[k].desc,
                    op.remote.remote_base[k] + op.remote_offset + off, op.remote.rkey[k]);
      break;
    }
    case Op::kRead: {
      const uint32_t n = static_cast<uint32_t>(std::min<int>(pn, op.remote.nics));
      int k = static_cast<int>((op.count ? j : s.first_nic) % n);
      rc = nics_[k]->post_read(p.nic_peer[k], static_cast<uint8_t*>(op.mr->addr) + op.offset, op.len,
                               op.mr->nic_mrs[k].desc, op.remote.remote_base[k] + op.remote_offset,
                               op.remote.rkey[k], ctx);
      // One writer at a time (the worker or the one thread inside progress): no read-modify-write.
      if (rc.ok()) reads_posted_[k].store(reads_posted_[k].load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
      break;
    }
    case Op::kPaged: {
      int k = static_cast<int>((s.first_nic + j) % static_cast<uint32_t>(std::min<int>(pn, op.remote.nics)));
      rc = write_on(k, base + static_cast<size_t>(op.src_pages[j]) * op.page_size, op.page_size,
                    op.mr->nic_mrs[k].desc,
                    op.remote.remote_base[k] + static_cast<size_t>(op.dst_pages[j]) * op.page_size, op.remote.rkey[k]);
      break;
    }
    case Op::kScatter: {
      const ScatterTarget& t = op.targets[j];
      int k = static_cast<int>((s.first_nic + j) % static_cast<uint32_t>(std::min<int>(pn, t.dst->nics)));
      rc = write_on(k, base + t.src_offset, t.len, op.mr->nic_mrs[k].desc, t.dst->remote_base[k] + t.dst_offset,
                    t.dst->rkey[k]);
      break;
    }
    case Op::kImm:
    case Op::kBarrier: {
      // No payload, but a real local buffer and remote key: the peer's receive-buffer region,
      // which a 0-byte write leaves untouched.
      int k = static_cast<int>((s.first_nic + j) % static_cast<uint32_t>(pn));
      rc = write_on(k, recv_bufs_[k].get(), 0, recv_mrs_[k].nic_mrs[k].desc, p.addr.imm_base[k], p.addr.imm_rkey[k]);
      break;
    }
    case Op::kSend: {
      int k = static_cast<int>(s.first_nic % static_cast<uint32_t>(pn));
      rc = nics_[k]->post_send(p.nic_peer[k], static_cast<const uint8_t*>(op.mr->addr) + op.offset, op.len,
                               op.mr->nic_mrs[k].desc, p.remote_tag, ctx, op.mr->kind == MemKind::kHost);
      break;
    }
    default:
      fail_slot(si, Code::kInternal, "unknown operation");
      return PostResult::kFailed;
  }
  if (rc.ok()) {
    s.next_shard++;
    s.outstanding++;
    return PostResult::kPosted;
  }
  if (rc.code() == Code::kAgain) return PostResult::kWait;
  fail_slot(si, rc.code(), rc.message());
  return PostResult::kFailed;
}

// Posts what the runnable slots have left, in the order they started, except that a `behind` write
// (Engine::write_imm_whole) lets the small operations that started after it in the same pass go
// first: on one connection (tcp, an RC QP) a small message then goes on the wire ahead of the
// clear-to-send queued just before it, which its receiver does not wait for yet. Not a large
// write: a clear-to-send held behind megabytes would stall its peer's next message.
bool NicGroup::post_runnable() {
  bool skipped = false;
  bool did = post_sweep(false, &skipped);
  if (skipped) did |= post_sweep(true, &skipped);
  return did;
}

namespace {
constexpr size_t kOvertakeMaxBytes = 64 << 10;  // what may pass a behind write (the plugin's small message)
bool overtakes(const Op& op) {
  return !op.behind && (op.type == Op::kWrite || op.type == Op::kImm || op.type == Op::kSend) &&
         op.len <= kOvertakeMaxBytes;
}
}  // namespace

// One sweep of the runnable FIFO. The first (rest false) passes over the behind writes and, once
// it has, over whatever may not overtake them (*skipped says whether it passed over any); the
// second posts what is left, in order.
bool NicGroup::post_sweep(bool rest, bool* skipped) {
  bool did = false;
  uint32_t prev = kNoSlot;
  for (uint32_t i = run_head_; i != kNoSlot;) {
    Slot& s = slots_[i];
    uint32_t next = s.run_next;
    if (!rest && (s.op.behind || (*skipped && !overtakes(s.op)))) {
      *skipped = true;
      prev = i;
      i = next;
      continue;
    }
    PostResult r = PostResult::kPosted;
    while (s.next_shard < s.shards) {
      r = post_shard(s, i);
      if (r != PostResult::kPosted) break;
      did = true;
    }
    if (r == PostResult::kFailed) {
      // fail_slot unlinked it; prev stays.
      i = next;
      continue;
    }
    if (s.next_shard == s.shards) {
      // Fully posted: leave the runnable FIFO.
      if (prev == kNoSlot) run_head_ = next; else slots_[prev].run_next = next;
      if (run_tail_ == i) run_tail_ = prev;
      s.runnable = false;
    } else {
      prev = i;
    }
    i = next;
  }
  return did;
}

void NicGroup::on_completion(int nic, const Completion& c) {
  switch (c.kind) {
    case CompletionKind::kRemoteWrite:
      if (c.error != Code::kOk) return;
      if (!imm_.arrive(c.imm) && (dropped_imms_++ % 1024) == 0)
        PONTE_LOG_ERROR("group %d: immediate counter table full: dropped immediate 0x%x", index_, c.imm);
      return;
    case CompletionKind::kRecv: {
      uint32_t b = static_cast<uint32_t>(c.ctx);
      if (b >= cfg_.recv_buf_count) return;
      uint8_t* buf = recv_bufs_[nic].get() + static_cast<size_t>(b) * cfg_.recv_buf_size;
      if (fault_drops_left_ > 0 && c.error == Code::kOk) [[unlikely]] {
        fault_drops_left_--;  // injected: as if lost on the wire
        PONTE_LOG_WARN("group %d: dropped a message from peer %u (PONTE_FAULT_DROP_RECVS)", index_, c.imm);
      } else if (c.error == Code::kOk && recv_fn_) {
        recv_fn_(recv_arg_, c.imm, std::span<const uint8_t>(buf, c.len));
      }
      if (stop_.load(std::memory_order_relaxed)) return;
      Status st = nics_[nic]->post_recv(buf, cfg_.recv_buf_size, recv_mrs_[nic].nic_mrs[nic].desc, b);
      if (!st.ok()) PONTE_LOG_WARN("group %d: reposting a receive: %s", index_, st.message());
      return;
    }
    case CompletionKind::kLocal: {
      uint32_t i = static_cast<uint32_t>(c.ctx);
      uint32_t gen = static_cast<uint32_t>(c.ctx >> 32);
      if (i >= slots_.size()) return;
      Slot& s = slots_[i];
      if (!s.used || s.gen != gen) return;  // a shard of an op that already failed
      s.outstanding--;
      if (c.error != Code::kOk) {
        // The failed op ends with the error. When the connection broke with it (an RC QP in
        // error, a provider's lost connection), it is rebuilt through a new handshake round; an
        // error of one operation alone (libfabric refusing one write) leaves the connection and
        // every other operation on it alone.
        // kCancelled: the NIC ended it because its peer's address was removed (libfabric, when a
        // handshake round is torn down or the peer leaves: FabricNic::remove_peer).
        PeerId peer = (s.op.type == Op::kScatter || s.op.type == Op::kBarrier) ? kAnyPeer : s.op.peer;
        const char* why = c.op_only ? "the NIC refused the operation"
                          : c.error == Code::kCancelled
                              ? "ended when its connection was torn down (new round, or the peer left)"
                              : "the NIC reported a failed completion";
        fail_slot(i, c.error, why);
        if (c.error == Code::kTransport && !c.op_only && peer != kAnyPeer && peer < kMaxPeers)
          start_reconnect(peer, "a transfer failed");
        return;
      }
      if (s.outstanding == 0 && s.next_shard == s.shards) finish(i);
      return;
    }
  }
}

}  // namespace ponte
