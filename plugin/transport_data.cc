// The data path: isend / irecv / iflush / test on the receiver-driven protocol (CTS FIFO,
// write-with-immediate, size records), and the engine callbacks that complete requests.
#include "plugin/transport_internal.h"

#include <bit>
#include <thread>

namespace ponte::plugin {

namespace {

constexpr size_t kStartNowBytes = 64 << 10;  // isend posts messages up to this size itself

void note_error(Request* r, const Status& st) {
  uint8_t expected = 0;
  r->error.compare_exchange_strong(expected, static_cast<uint8_t>(st.code()),
                                   std::memory_order_acq_rel);
}

// Notify target of every data-path operation. The last operation to end after the other end
// asked this one to stop (BROKEN or CLOSED) sends the ACK it waits for: NCCL's abort never calls
// test() again, and the other end's deregMr waits for that ACK. `callbacks` keeps the comm from
// being freed while this runs after dropping `inflight` (ready_to_free checks inflight, then
// callbacks). Sequentially consistent, as on_notice's store of peer_stop and load of inflight:
// either this sees peer_stop, or on_notice sees no operation left and answers itself.
void op_done(void* arg, const Status& st) {
  auto* r = static_cast<Request*>(arg);
  CommBase* c = r->comm;
  if (!st.ok()) note_error(r, st);
  r->pending.fetch_sub(1, std::memory_order_acq_rel);
  c->callbacks.fetch_add(1);
  if (c->inflight.fetch_sub(1) == 1 && c->peer_stop.load()) [[unlikely]]
    answer_stop(c);
  c->callbacks.fetch_sub(1, std::memory_order_release);  // last touch: the comm may go after this
}

// Notify target of an operation that uses a user registration (Request::held): releases it first.
void held_done(void* arg, const Status& st) {
  auto* r = static_cast<Request*>(arg);
  r->held->users.fetch_sub(1, std::memory_order_acq_rel);  // deregMr may free it after this
  op_done(arg, st);
}

// Starts using m for one engine operation of r; undone by held_done or release_held.
void hold(Request* r, const MrEntry* m) {
  m->users.fetch_add(1, std::memory_order_acq_rel);
  r->held = m;
}
void release_held(Request* r) { r->held->users.fetch_sub(1, std::memory_order_acq_rel); }

Status request_error(const Request* r) {
  const auto code = static_cast<Code>(r->error.load(std::memory_order_acquire));
  return Status(code, "%s request failed: %s", r->type == ReqType::kRecv ? "receive" : r->type == ReqType::kSend ? "send" : "flush",
                code_name(code));
}

Status check_mr(Device* d, void* mhandle, const void* data, size_t len, const MrEntry** out) {
  auto* m = static_cast<const MrEntry*>(mhandle);
  if (tag_at(m) != kMagicMr)
    return Status(Code::kInvalidArgument, "buffer %p: no memory handle (register it first)", data);
  if (m->dev != d) return Status(Code::kInvalidArgument, "buffer %p: handle of another device", data);
  if (!m->covers(reinterpret_cast<uintptr_t>(data), len))
    return Status(Code::kInvalidArgument, "buffer %p+%zu: outside its registration", data, len);
  *out = m;
  return Status::Ok();
}


// Why no new request may start on c: its pair broke, or the other end closed. The other end's
// stop is checked again after raising inflight (start_op): an ACK it was sent meanwhile promised
// that nothing more is written there.
Status refusal(const CommBase* c) {
  const auto why = static_cast<Code>(c->broken.load(std::memory_order_acquire));
  if (why != Code::kOk)
    return Status(why, "this connection failed earlier (here or at the other end: %s); the "
                  "communicator must be closed", code_name(why));
  if (c->peer_closed.load())
    return Status(Code::kPeerDead, "the other end closed this connection");
  return Status::Ok();
}

// Counts one engine operation of r in flight on c, unless the other end closed meanwhile
// (sequentially consistent both here and in the NOTICE handler: see on_notice).
bool start_op(CommBase* c, Request* r) {
  c->inflight.fetch_add(1);
  if (c->peer_stop.load()) [[unlikely]] {
    c->inflight.fetch_sub(1);
    return false;
  }
  r->pending.fetch_add(1, std::memory_order_relaxed);
  return true;
}
// Counts one engine operation of r through the device's own peer (iflush's reads, an eager
// message's NIC copy): nothing goes toward the other end, so its stop refuses nothing here.
void start_local_op(CommBase* c, Request* r) {
  c->inflight.fetch_add(1);
  r->pending.fetch_add(1, std::memory_order_relaxed);
}
void undo_op(CommBase* c, Request* r) {
  r->pending.fetch_sub(1, std::memory_order_relaxed);
  c->inflight.fetch_sub(1, std::memory_order_relaxed);
}

// The device's peer for its own group (flush reads, eager copies into non-host buffers), connected
// on first use.
Result<PeerId> self_peer(Device* d) {
  if (!d->has_self.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> lock(d->mu);
    if (!d->has_self.load(std::memory_order_relaxed)) {
      auto p = d->engine->connect(d->group, d->engine->address(d->group));
      if (!p.ok()) return p.status();
      d->self_peer = p.value();
      d->has_self.store(true, std::memory_order_release);
    }
  }
  return d->self_peer;
}

Status post_record(SendComm* c, SendRequest* r) {
  Device* d = c->dev;
  LocalSlice src{&c->mrs[1], r->record_src_offset, r->record_len};
  if (!start_op(c, r)) return refusal(c);
  Status st = d->engine->write_imm_whole(d->group, c->peer, src, c->records, r->record_dst_offset,
                                   r->record_imm, Notify{&op_done, r});
  if (!st.ok()) undo_op(c, r);
  return st;
}

// The free send request that isend hands out next, reset for a message of `size` bytes for
// request `head` (its record immediate). Taken off the free list by the caller once it posted.
SendRequest* next_send_request(SendComm* c, size_t size) {
  SendRequest* r = &c->reqs[c->free_list[c->free_count - 1]];
  r->error.store(0, std::memory_order_relaxed);
  r->pending.store(0, std::memory_order_relaxed);
  r->size = size;
  r->record_unsubmitted = false;
  r->record_imm = imm_value(true, c->remote_comm_id, c->head);
  r->inline_slot = -1;
  return r;
}

// Posts r's record (or eager) write; with the engine's queue full test() posts it later, and a
// failure is test()'s to report (after the request's other writes end).
void post_record_or_defer(SendComm* c, SendRequest* r) {
  Status st = post_record(c, r);
  if (st.code() == Code::kAgain) {
    r->record_unsubmitted = true;
  } else if (!st.ok()) {
    note_error(r, st);
  }
}

// isend / irecv on a comm that can no longer move data (the pair broke, here or at the other end,
// or the other end closed): the request is handed out failed, and test() reports why, as NCCL's
// own transports report a connection's failure (net_ib: the write fails at test()). NCCL abandons
// an aborting comm's requests either way; a caller still posting while the other rank aborts
// (aws-ofi-nccl's functional test inflight_close: one rank deregisters and closes while the other
// posts 32 sends) is not stopped mid-loop by an error about the other rank's abort. With no request
// free (32 handed out and none tested), the error itself: a NULL request would be posted again
// forever. why OK (the other end asked to stop, and its CLOSED or BROKEN is not here yet): no
// request, the caller posts again.
Status failed_send(SendComm* c, const Status& why, void** request) {
  if (why.ok()) return why;
  if (c->free_count == 0) return why;
  SendRequest* r = &c->reqs[c->free_list[c->free_count - 1]];
  r->error.store(static_cast<uint8_t>(why.code()), std::memory_order_relaxed);
  r->pending.store(0, std::memory_order_relaxed);
  r->size = 0;
  r->record_unsubmitted = false;
  r->inline_slot = -1;
  --c->free_count;
  r->in_use = true;
  *request = r;
  return Status::Ok();
}

// Whether the other end closed cleanly after starting request `number` of c (CLOSED's count).
bool sent_before_peer_closed(const RecvComm* c, uint64_t number) {
  return c->peer_closed.load() && c->peer_clean && number < c->peer_count;
}

// Notify target of a receive's CTS write. A CTS the other end can no longer read (it closed or
// died) does not end the receive: what it sent before (an eager message) is received, and a
// receive still short of its immediates ends in test() once they cannot come (peer dead, or
// closed before starting it). Other failures end it as any operation's do.
void cts_done(void* arg, const Status& st) {
  op_done(arg, st.code() == Code::kPeerDead ? Status::Ok() : st);
}

// irecv's last step: r (set up for c's next request) is posted.
Status post_recv_request(RecvComm* c, RecvRequest* r, const MrEntry* const* targets, void** request) {
  for (int i = 0; i < r->n; ++i) r->targets[i].store(targets[i], std::memory_order_release);
  r->in_use = true;
  ++c->next;
  *request = r;
  return Status::Ok();
}

// Moves c->oldest past the requests that ended.
void advance_oldest(RecvComm* c) {
  while (c->oldest < c->next) {
    const RecvRequest& o = c->reqs[c->oldest % kMaxRequests];
    if (o.in_use && o.number == c->oldest) break;
    ++c->oldest;
  }
}

// Held CTS (plugin/README.md, step 7): while PONTE_NET_CTS_AHEAD receives of c have their CTS at
// the sender and no message yet (their size records have not landed), the sender has that many
// messages it may send before it needs the next CTS, and irecv holds that one; held ones go
// together, in one write. Only for a caller that tests its receives between its irecvs, as NCCL's
// proxy does: every test() and irecv looks again, and writes them once fewer are unfilled, or at
// once when the tested receive is held (its caller waits for it). A caller that posts a run of
// receives and then waits for sends before testing any gets every CTS at once.
// Whether fewer than PONTE_NET_CTS_AHEAD of c's receives with their CTS out are unfilled.
bool held_cts_due(RecvComm* c) {
  const uint32_t ahead = global_config().net_cts_ahead;
  if (ahead == 0) return true;
  advance_oldest(c);
  const Engine& e = *c->dev->engine;
  uint32_t unfilled = 0;
  for (uint64_t k = c->cts_sent; k-- > c->oldest;) {  // newest first: the unfilled ones
    const RecvRequest& q = c->reqs[k % kMaxRequests];
    if (q.in_use && e.imm_arrived(c->dev->group, q.record_imm) < static_cast<uint32_t>(q.n) && ++unfilled >= ahead)
      return false;
  }
  return true;
}

// Notify target of a write that carries the CTS of cts_batch requests from arg on: each one's
// cts_done. The requests are found before the first may end (and its slot be reused).
void cts_batch_done(void* arg, const Status& st) {
  auto* first = static_cast<RecvRequest*>(arg);
  auto* c = static_cast<RecvComm*>(first->comm);
  const uint32_t count = first->cts_batch;
  const size_t s0 = first->number % kMaxRequests;
  RecvRequest* batch[kMaxRequests];
  for (uint32_t k = 0; k < count; ++k) batch[k] = &c->reqs[s0 + k];
  for (uint32_t k = 0; k < count; ++k) cts_done(batch[k], st);
}

// Writes the held CTS of requests [cts_sent, next), one write per run of slots that does not wrap.
// None is written once the pair broke or the other end asked to stop: those receives end in test()
// as any still waiting for data. The engine's queue full: the next test() writes them. A failure
// ends the requests whose CTS it carried.
void write_held_cts(RecvComm* c) {
  Device* d = c->dev;
  Engine& e = *d->engine;
  while (c->cts_sent < c->next) {
    if (c->broken.load(std::memory_order_acquire) != 0 || c->peer_stop.load()) {
      c->cts_sent = c->next;
      return;
    }
    const size_t s0 = c->cts_sent % kMaxRequests;
    const uint32_t count = static_cast<uint32_t>(std::min<uint64_t>(c->next - c->cts_sent, kMaxRequests - s0));
    uint32_t k = 0;
    for (; k < count; ++k)
      if (!start_op(c, &c->reqs[s0 + k])) break;
    if (k < count) {  // the other end asked to stop meanwhile
      while (k-- > 0) undo_op(c, &c->reqs[s0 + k]);
      c->cts_sent = c->next;
      return;
    }
    RecvRequest* first = &c->reqs[s0];
    first->cts_batch = count;
    const size_t len = (count - 1) * kCtsSlotBytes + cts_bytes(c->reqs[s0 + count - 1].n);
    Status st = e.write_whole(d->group, c->peer, LocalSlice{&c->mrs[1], s0 * kCtsSlotBytes, len}, c->fifo,
                              s0 * kCtsSlotBytes, Notify{&cts_batch_done, first}, /*behind=*/true);
    if (!st.ok()) {
      for (k = 0; k < count; ++k) undo_op(c, &c->reqs[s0 + k]);
      if (st.code() == Code::kAgain) return;
      if (st.code() != Code::kPeerDead)  // kPeerDead: as in cts_done
        for (k = 0; k < count; ++k) note_error(&c->reqs[s0 + k], st);
    }
    c->cts_sent += count;
  }
}

// A caller that waits elsewhere. Held CTS go when the receive comm is tested or posted to; a
// caller that tests a receive, posts another (its CTS held) and then waits only for other
// requests (its sends, another comm's receives), never calling that comm again, would wait for
// ever for messages that need the held CTS. NCCL's proxy never does this (it tests its oldest
// receive on every pass); other callers might. So a thread that waits (a test() that finds its
// request not done, an isend that finds no CTS) looks at the receive comms it drives, on every
// device, at most every kHeldScanInterval, and writes the CTS it finds held at two looks in a row
// with none written between them: while its thread keeps calling the plugin, a CTS is held at
// most about twice that long. It costs a thread that holds none nothing, and one that holds some
// a clock read per 64 waiting calls.
constexpr auto kHeldScanInterval = std::chrono::milliseconds(100);

// Per calling thread, zero-initialised (no TLS constructor to check on each use).
struct WaitScan {
  uint64_t id = 0;          // driver_id(), 0 until first needed
  bool held = false;        // this thread held a CTS since its last scan found none
  uint32_t calls = 0;       // waiting calls: the clock is read at every 64th
  Clock::time_point next;   // no scan before this
};
thread_local WaitScan tl_wait;

uint64_t driver_id() {
  static std::atomic<uint64_t> next_id{1};
  uint64_t& id = tl_wait.id;
  if (id == 0) [[unlikely]]
    id = next_id.fetch_add(1, std::memory_order_relaxed);
  return id;
}

// Takes c's driver_busy for a scan of thread `me`: true when c is an open receive comm that
// thread drives (the scan then drops the flag), false (flag left alone or dropped) otherwise.
// Under d->mu: c is not freed meanwhile.
bool claim_for_scan(RecvComm* c, uint64_t me) {
  if (c->driver_busy.exchange(true, std::memory_order_acquire)) return false;
  if (c->magic == kMagicRecv && c->driver.load(std::memory_order_relaxed) == me) return true;
  c->driver_busy.store(false, std::memory_order_release);
  return false;
}

void scan_held_cts() {
  const uint64_t me = driver_id();
  constexpr size_t kMaxFlush = 64;  // more wait for the next scan
  RecvComm* due[kMaxFlush];
  size_t n = 0;
  bool held = false;
  Plugin& p = plugin();
  std::unique_lock<std::mutex> plock(p.mu, std::try_to_lock);
  if (!plock.owns_lock()) return;  // busy: the next waiting call looks
  for (auto& dev : p.devices) {
    Device* d = dev.get();
    std::unique_lock<std::mutex> lock(d->mu, std::try_to_lock);
    if (!lock.owns_lock()) {
      held = true;  // not looked at: look again
      continue;
    }
    for (CommBase* cb : d->comms) {
      if (cb->is_send) continue;
      auto* c = static_cast<RecvComm*>(cb);
      if (!claim_for_scan(c, me)) {
        held = held || c->driver_busy.load(std::memory_order_relaxed);  // being changed: look again
        continue;
      }
      const bool holds = c->cts_sent < c->next;
      held = held || holds;
      if (holds && c->held_mark == c->cts_sent && n < kMaxFlush) {
        due[n++] = c;  // its flag is dropped after the write
        continue;
      }
      c->held_mark = holds ? c->cts_sent : ~0ull;
      c->driver_busy.store(false, std::memory_order_release);
    }
  }
  plock.unlock();  // a comm in due[] stays: closing it waits for its flag (drive)
  for (size_t k = 0; k < n; ++k) {
    RecvComm* c = due[k];
    write_held_cts(c);  // engine calls: never under d->mu
    c->held_mark = c->cts_sent < c->next ? c->cts_sent : ~0ull;  // the queue full: next time
    c->driver_busy.store(false, std::memory_order_release);
  }
  tl_wait.held = held;
}

void note_waiting() {
  WaitScan& w = tl_wait;
  if (!w.held || (++w.calls & 63u) != 0) return;
  const auto now = Clock::now();
  if (now < w.next) return;
  w.next = now + kHeldScanInterval;
  scan_held_cts();
}

Status failed_recv(RecvComm* c, const Status& why, void** request) {
  if (why.ok()) return why;
  RecvRequest* r = &c->reqs[c->next % kMaxRequests];
  if (r->in_use) return why;
  r->error.store(static_cast<uint8_t>(why.code()), std::memory_order_relaxed);
  r->pending.store(0, std::memory_order_relaxed);
  r->number = c->next;
  r->n = 0;
  r->in_use = true;
  ++c->next;
  c->cts_sent = c->next;  // held CTS go nowhere now
  *request = r;
  return Status::Ok();
}

// Eager (plugin/README.md): whether a message may go before its CTS is read. The CTS read last
// predicts the receive: one buffer in host memory offering inline, at least this size, this tag
// (NCCL's proxy posts the same kind of receive step after step). A wrong prediction costs a copy
// at the receiver, never data: the eager record names its tag, and the receiver puts the data
// into that buffer whatever the receive turns out to be. The slot must be free: the CTS read last
// says request head - 32 ended at the receiver (its oldest open request is later).
bool eager_fits(SendComm* c, const void* data, size_t size, int tag, void* mhandle) {
  const Config& cfg = global_config();
  if (!cfg.net_eager || !c->last_cts_one_host || size > cfg.net_inline || size > c->elems[0].size ||
      tag != c->elems[0].tag || c->free_count == 0)
    return false;
  if (static_cast<uint32_t>(c->head) - c->last_cts_oldest >= static_cast<uint32_t>(kMaxRequests)) return false;
  const int user = c->inline_user[c->head % kMaxRequests];
  if (user >= 0 && c->reqs[user].pending.load(std::memory_order_acquire) != 0) return false;
  if (size == 0) return true;
  const MrEntry* m = nullptr;
  return check_mr(c->dev, mhandle, data, size, &m).ok() && m->kind == MemKind::kHost;
}

// Sends the message for request `head` into its eager slot at the receiver: the eager record and
// the data behind it, one write with the request's record immediate. head moves on once its CTS
// is read (isend).
Status send_eager(SendComm* c, const void* data, size_t size, int tag, void** request) {
  Engine& e = *c->dev->engine;
  const size_t islot = c->head % kMaxRequests;
  SendRequest* r = next_send_request(c, size);
  r->record_src_offset = static_cast<size_t>(kSendRequests) * kRecordBytes + islot * kInlineSlotBytes;
  r->record_dst_offset = eager_slot_offset(c->head);
  r->record_len = kRecordBytes + size;
  encode_eager(EagerRecord{size, c->head, tag}, c->outbox.ptr + r->record_src_offset);
  if (size > 0) std::memcpy(c->outbox.ptr + r->record_src_offset + kRecordBytes, data, size);
  post_record_or_defer(c, r);
  e.start_submitted(c->dev->group);
  c->inline_user[islot] = r->index;
  r->inline_slot = static_cast<int>(islot);
  --c->free_count;
  r->in_use = true;
  c->eager_pending = true;
  c->eager_tag = tag;
  *request = r;
  return Status::Ok();
}

}  // namespace

static Status isend_now(void* send_comm, void* data, size_t size, int tag, void* mhandle, void** request) {
  if (!request) return bad("isend: NULL request");
  *request = nullptr;
  SendComm* c = as_send(send_comm);
  if (!c) return bad("isend: not a send comm");
  Device* d = c->dev;
  Engine& e = *d->engine;
  if (e.peer_dead(d->group, c->peer))
    return Status(Code::kPeerDead, "isend: the receiving peer is dead or unreachable");
  if (Status why = refusal(c); !why.ok()) [[unlikely]]
    return failed_send(c, why, request);

  while (c->head_n < 0) {  // wait for the receiver's CTS for request `head`: its slot, whole (wire.h)
    if (!c->eager_pending && eager_fits(c, data, size, tag, mhandle)) return send_eager(c, data, size, tag, request);
    const uint8_t* slot = c->fifo.ptr + (c->head % kMaxRequests) * kCtsSlotBytes;
    const uint32_t number = static_cast<uint32_t>(c->head);
    auto n = read_cts(slot, number, c->token, c->cts_copy);
    if (!n.ok() && (!e.progress(d->group) || !(n = read_cts(slot, number, c->token, c->cts_copy)).ok())) {
      // An eager request's receive can end before its CTS is read, and the receiver then posts
      // request head + 32 into the same slot: CTS head is gone for good. That receive ended with
      // the eager message alone (a grouped one would still wait for its other messages), so the
      // request is done here too.
      if (c->eager_pending && read_cts(slot, number + kMaxRequests, c->token, c->cts_copy).ok()) {
        c->eager_pending = false;
        ++c->head;
        continue;
      }
      return Status::Ok();
    }
    for (int i = 0; i < n.value(); ++i) {
      Status st = decode_cts_elem(c->cts_copy, i, &c->elems[i], &c->regions[i]);
      if (!st.ok()) return Status(Code::kTransport, "isend: corrupt CTS: %s", st.message());
    }
    c->head_n = n.value();
    c->matched = 0;
    // What this receive was predicts the next one (eager_fits).
    c->last_cts_one_host = c->head_n == 1 && c->elems[0].inline_data;
    c->last_cts_oldest = cts_oldest_open(c->cts_copy);  // (cts_copy: a failed read_cts overwrites it)
    if (c->eager_pending) {  // one of its buffers has its message already: the eager one's tag
      c->eager_pending = false;
      int j = 0;
      while (j < c->head_n && c->elems[j].tag != c->eager_tag) ++j;
      if (j == c->head_n)
        return Status(Code::kTransport, "isend: the receive for an eager message of tag %d has no buffer of that tag",
                      c->eager_tag);
      c->matched = 1u << j;
      if (c->head_n == 1) {
        ++c->head;
        c->head_n = -1;
      }
    }
  }
  int i = 0;
  for (; i < c->head_n; ++i)
    if (!(c->matched & (1u << i)) && c->elems[i].tag == tag) break;
  if (i == c->head_n) return Status::Ok();  // the receiver has not posted this tag yet
  if (c->free_count == 0) return Status::Ok();

  const size_t len = std::min<uint64_t>(size, c->elems[i].size);  // a larger send is truncated
  const MrEntry* m = nullptr;
  if (len > 0) PONTE_RETURN_IF_ERROR(check_mr(d, mhandle, data, len, &m));
  // The receiver offers the inline slot (kCtsInline: one buffer, in host memory); the sender takes
  // it for a message of at most PONTE_NET_INLINE bytes from host memory: the data is copied behind
  // the size record and both go in one write. Offered and not taken (a larger message, or one from
  // GPU memory), the record still goes to the inline slot and the data into the buffer; the
  // record's shard count tells the receiver which (wire.h).
  const bool offered = c->elems[i].inline_data && c->head_n == 1;
  const bool copy = offered && (len == 0 || (len <= global_config().net_inline && m->kind == MemKind::kHost));
  const uint32_t shards = len > 0 && !copy ? e.imms_per_write(d->group, c->peer, len) : 0;
  // A message that fills the receiver's one buffer in one write carries the record immediate
  // and needs no record (wire.h: whole-buffer messages).
  const bool whole = shards == 1 && c->head_n == 1 && len == c->elems[i].size;
  const size_t islot = c->head % kMaxRequests;
  if (copy && c->inline_user[islot] >= 0 &&
      c->reqs[c->inline_user[islot]].pending.load(std::memory_order_acquire) != 0)
    return Status::Ok();  // the slot's previous inline write is still being sent

  SendRequest* r = next_send_request(c, len);
  r->dst = c->regions[i];
  if (!whole) {
    SizeRecord rec;
    rec.size = len;
    rec.shards = shards;
    rec.request_number = static_cast<uint32_t>(c->head);
    r->record_src_offset = copy ? static_cast<size_t>(kSendRequests) * kRecordBytes + islot * kInlineSlotBytes
                                : static_cast<size_t>(r->index) * kRecordBytes;
    r->record_dst_offset = offered ? inline_slot_offset(c->head) : record_offset(c->head, i);
    r->record_len = kRecordBytes;
    encode_record(rec, c->outbox.ptr + r->record_src_offset);
    if (copy && len > 0) {
      std::memcpy(c->outbox.ptr + r->record_src_offset + kRecordBytes, data, len);
      r->record_len += len;
    }
  }

  if (len > 0 && !copy) {
    const uint32_t data_imm = whole ? r->record_imm : imm_value(false, c->remote_comm_id, c->head);
    LocalSlice src{&m->mr, reinterpret_cast<uintptr_t>(data) - m->start, len};
    if (!start_op(c, r)) return failed_send(c, refusal(c), request);
    hold(r, m);
    Status st = e.write_imm(d->group, c->peer, src, r->dst, c->elems[i].offset, data_imm, Notify{&held_done, r});
    if (!st.ok()) {
      release_held(r);
      undo_op(c, r);
      if (st.code() == Code::kAgain) return Status::Ok();  // engine queue full: NCCL retries
      return st;
    }
  }
  if (!whole) post_record_or_defer(c, r);
  // A small message goes on the wire now, not at the next test(): a proxy thread that polls
  // (NCCL's) leaves what it submits to its next progress() pass, one provider poll later (a
  // syscall on tcp). Not a large one: posting 4 MiB here cost the bandwidth row 15-25 % on tcp.
  if (len <= kStartNowBytes) e.start_submitted(d->group);
  if (copy) {
    c->inline_user[islot] = r->index;
    r->inline_slot = static_cast<int>(islot);
  }
  --c->free_count;
  r->in_use = true;
  c->matched |= 1u << i;
  if (std::popcount(c->matched) == c->head_n) {  // every buffer of this CTS has its send
    ++c->head;
    c->head_n = -1;
  }
  *request = r;
  return Status::Ok();
}

Status isend(void* send_comm, void* data, size_t size, int tag, void* mhandle, void** request) {
  Status st = isend_now(send_comm, data, size, tag, mhandle, request);
  if (st.ok() && request && !*request) note_waiting();  // no CTS: this thread waits
  return st;
}

void drive(RecvComm* c) {
  const uint64_t me = driver_id();
  if (c->driver.load(std::memory_order_relaxed) == me) return;
  while (c->driver_busy.exchange(true, std::memory_order_acquire)) std::this_thread::yield();  // a scan's write
  c->driver.store(me, std::memory_order_relaxed);
  if (c->cts_sent < c->next) tl_wait.held = true;  // its held CTS are this thread's to look at now
  c->driver_busy.store(false, std::memory_order_release);
}

Status irecv(void* recv_comm, int n, void** data, const size_t* sizes, const int* tags,
             void** mhandles, void** request) {
  if (!request) return bad("irecv: NULL request");
  *request = nullptr;
  RecvComm* c = as_recv(recv_comm);
  if (!c) return bad("irecv: not a recv comm");
  drive(c);
  if (n < 1 || n > kMaxRecvs)
    return Status(Code::kInvalidArgument, "irecv: %d buffers, must be 1..%d", n, kMaxRecvs);
  if (!data || !sizes || !mhandles) return bad("irecv: NULL array");
  Device* d = c->dev;
  Engine& e = *d->engine;
  const uint64_t number = c->next;
  // The other end closed cleanly after starting this request: it went eagerly, before its CTS
  // (the only way a request can start unposted), and its data is here or on its way. It is
  // received without a CTS: the other end reads nothing more, and may have been told so.
  const bool sent_before_close = sent_before_peer_closed(c, number);
  if (!sent_before_close) {
    if (e.peer_dead(d->group, c->peer))
      return Status(Code::kPeerDead, "irecv: the sending peer is dead or unreachable");
    if (Status why = refusal(c); !why.ok()) [[unlikely]]
      return failed_recv(c, why, request);
  } else if (c->broken.load(std::memory_order_acquire) != 0) {
    return failed_recv(c, refusal(c), request);
  }
  const size_t slot = number % kMaxRequests;
  RecvRequest* r = &c->reqs[slot];
  if (r->in_use) return Status::Ok();  // 32 requests in flight: NCCL retries

  CtsElem elems[kMaxRecvs];
  const MrEntry* targets[kMaxRecvs] = {};
  for (int i = 0; i < n; ++i) {
    elems[i].tag = tags ? tags[i] : 0;
    elems[i].size = sizes[i];
    if (sizes[i] == 0) continue;  // nothing can land: no region needed (NCCL may pass NULLs)
    const MrEntry*& m = targets[i];
    PONTE_RETURN_IF_ERROR(check_mr(d, mhandles[i], data[i], sizes[i], &m));
    elems[i].offset = reinterpret_cast<uintptr_t>(data[i]) - m->start;
    elems[i].region = m->remote_bytes;
  }
  // One buffer in host memory, of any size: the sender may put a small message inline, behind the
  // size record in the request's inline slot (kCtsInline), and the copy out is ours. NCCL posts
  // whole step buffers (64 KiB and up) whatever it then sends into them, so the offer cannot
  // depend on the buffer's size, only on where it is.
  const bool inl = n == 1 && sizes[0] > 0 && global_config().net_inline > 0 && targets[0]->kind == MemKind::kHost;
  elems[0].inline_data = inl;
  // The oldest request still open: the sender may write request m's eager slot once it reads a
  // CTS whose oldest open request is after m - 32.
  advance_oldest(c);
  uint8_t* out = c->cts.ptr + slot * kCtsSlotBytes;
  PONTE_RETURN_IF_ERROR(encode_cts(static_cast<uint32_t>(number), static_cast<uint32_t>(c->oldest), c->token,
                                   std::span<const CtsElem>(elems, n), out));

  r->error.store(0, std::memory_order_relaxed);
  r->pending.store(0, std::memory_order_relaxed);
  r->epoch = e.peer_epoch(d->group, c->peer);
  r->number = number;
  r->n = n;
  r->data_imm = imm_value(false, c->comm_id, number);
  r->record_imm = imm_value(true, c->comm_id, number);
  r->records_read = false;
  r->inline_data = inl;
  r->inline_dst = inl ? data[0] : nullptr;
  r->shards = 0;
  r->whole = false;
  r->eager_buf = -1;
  r->eager_copying = false;
  for (int i = 0; i < n; ++i) {
    r->dst[i] = data[i];
    r->tags[i] = elems[i].tag;
  }
  // One buffer: its record slot is blanked before the CTS goes out, so that a message filling
  // the buffer can come without a record (wire.h: whole-buffer messages).
  if (n == 1)
    encode_blank_record(static_cast<uint32_t>(number),
                        c->records.ptr + (inl ? inline_slot_offset(number) : record_offset(number, 0)));
  for (int i = 0; i < n; ++i) r->posted[i] = sizes[i];
  if (sent_before_close) {
    c->cts_sent = number + 1;  // the other end reads no CTS any more
    return post_recv_request(c, r, targets, request);
  }
  const bool hold = c->tested && !held_cts_due(c);
  c->tested = false;
  if (hold) tl_wait.held = true;
  if (c->cts_sent < number || hold) {  // held, or behind held ones: written with them
    (void)post_recv_request(c, r, targets, request);
    if (!hold) write_held_cts(c);
    return Status::Ok();
  }
  if (!start_op(c, r)) return failed_recv(c, refusal(c), request);
  LocalSlice src{&c->mrs[1], slot * kCtsSlotBytes, cts_bytes(n)};
  // Behind: a small isend that follows in the same pass goes on the wire first (NCCL's proxy posts
  // the next receive just before a send; at depth 1, 8 B ping-pong half round trip against
  // aws-ofi-nccl on tcp;ofi_rxm went from 1.33-1.36x to 1.18-1.26x).
  Status st = e.write_whole(d->group, c->peer, src, c->fifo, slot * kCtsSlotBytes, Notify{&cts_done, r},
                            /*behind=*/true);
  if (!st.ok()) {
    undo_op(c, r);
    if (st.code() == Code::kAgain) return Status::Ok();
    if (st.code() != Code::kPeerDead) return st;
    // The other end is going (its engine closed in order: a grace period): as in cts_done, what
    // it sent before is received, and test() ends the receive if nothing comes.
  }
  c->cts_sent = number + 1;
  return post_recv_request(c, r, targets, request);
}

Status iflush(void* recv_comm, int n, void** data, const int* sizes, void** mhandles,
              void** request) {
  if (!request) return bad("iflush: NULL request");
  *request = nullptr;
  RecvComm* c = as_recv(recv_comm);
  if (!c) return bad("iflush: not a recv comm");
  if (n < 1 || n > kMaxRecvs || !data || !sizes || !mhandles) return bad("iflush: bad arguments");
  // Only data written by the NIC into GPU memory needs a flush: a read from the NIC after the
  // writes makes them visible to the GPU. Host memory is coherent already (PONTE_FLUSH_HOST=1
  // flushes it anyway, to test this path without a GPU).
  const bool flush_host = global_config().flush_host;
  int last = -1;
  for (int i = 0; i < n; ++i) {
    auto* m = static_cast<const MrEntry*>(mhandles[i]);
    if (sizes[i] > 0 && tag_at(m) == kMagicMr && (m->kind == MemKind::kCuda || flush_host)) last = i;
  }
  if (last < 0) return Status::Ok();
  Device* d = c->dev;
  const MrEntry* m = nullptr;
  PONTE_RETURN_IF_ERROR(check_mr(d, mhandles[last], data[last], sizes[last], &m));
  Request* f = nullptr;
  for (Request& q : c->flushes)
    if (!q.in_use) {
      f = &q;
      break;
    }
  if (!f) return Status::Ok();
  auto self_or = self_peer(d);
  if (!self_or.ok()) return self_or.status();
  const PeerId self = self_or.value();
  const size_t len = std::min<size_t>(static_cast<size_t>(sizes[last]), 4);
  const size_t off = reinterpret_cast<uintptr_t>(data[last]) - m->start + sizes[last] - len;
  f->error.store(0, std::memory_order_relaxed);
  f->pending.store(0, std::memory_order_relaxed);
  start_local_op(c, f);
  hold(f, m);
  // PCIe orders a NIC's writes only before that same NIC's later reads: read through every NIC
  // the peer's data may have come through (writes stripe and rotate over all of them).
  const int nics = std::max(1, d->engine->peer_nics(d->group, c->peer));
  Status st = d->engine->read_each_nic(d->group, self, LocalSlice{&c->mrs[2], 0, len}, m->remote,
                                       off, nics, Notify{&held_done, f});
  if (!st.ok()) {
    release_held(f);
    undo_op(c, f);
    if (st.code() == Code::kAgain) return Status::Ok();
    return st;
  }
  f->in_use = true;
  *request = f;
  return Status::Ok();
}

static Status test_now(void* request, int* done, size_t* sizes, int* count) {
  if (!done) return bad("test: NULL done");
  *done = 0;
  if (count) *count = 0;
  auto* r = static_cast<Request*>(request);
  if (tag_at(r) != kMagicReq || !r->in_use) return bad("test: not an outstanding request");
  CommBase* c = r->comm;
  Device* d = c->dev;
  Engine& e = *d->engine;
  e.progress(d->group);  // the proxy thread moves the data itself while the worker is idle

  auto finish = [&](const Status& st) {
    r->in_use = false;
    if (r->type == ReqType::kRecv)
      for (auto& t : static_cast<RecvRequest*>(r)->targets) t.store(nullptr, std::memory_order_release);
    if (r->type == ReqType::kSend) {
      auto* s = static_cast<SendComm*>(c);
      auto* sr = static_cast<SendRequest*>(r);
      // Its inline slot is free (its writes ended): the index, handed out again, no longer names
      // the slot's user (a later large send reusing it would make the slot's next small one wait).
      if (sr->inline_slot >= 0 && s->inline_user[sr->inline_slot] == sr->index) s->inline_user[sr->inline_slot] = -1;
      s->free_list[s->free_count++] = sr->index;
    }
    return st;
  };

  // The pair broke (here or at the other end): this request ends too.
  if (const uint8_t why = c->broken.load(std::memory_order_acquire); why != 0) [[unlikely]]
    note_error(r, Status(static_cast<Code>(why), "connection failed"));
  if (const uint8_t code = r->error.load(std::memory_order_acquire); code != 0) [[unlikely]] {
    break_comm(c, static_cast<Code>(code));  // its slots cannot be trusted: the pair is done
    // Keep the request until the engine has ended every operation it started for it.
    if (r->pending.load(std::memory_order_acquire) != 0) return Status::Ok();
    return finish(request_error(r));
  }
  if (c->peer_stop.load(std::memory_order_relaxed)) [[unlikely]]
    answer_stop(c);

  switch (r->type) {
    case ReqType::kSend: {
      auto* s = static_cast<SendRequest*>(r);
      if (s->record_unsubmitted) {
        Status st = post_record(static_cast<SendComm*>(c), s);
        if (st.ok()) {
          s->record_unsubmitted = false;
        } else if (st.code() != Code::kAgain) {
          note_error(s, st);
          return Status::Ok();
        }
      }
      if (s->record_unsubmitted || s->pending.load(std::memory_order_acquire) != 0) {
        if (e.peer_dead(d->group, c->peer))
          note_error(s, Status(Code::kPeerDead, "peer dead"));  // reported once pending drains
        return Status::Ok();
      }
      *done = 1;
      if (sizes) sizes[0] = s->size;
      if (count) *count = 1;
      return finish(Status::Ok());
    }
    case ReqType::kFlush: {
      if (r->pending.load(std::memory_order_acquire) != 0) return Status::Ok();
      *done = 1;
      if (sizes) sizes[0] = 0;
      if (count) *count = 1;
      return finish(Status::Ok());
    }
    case ReqType::kRecv: {
      auto* q = static_cast<RecvRequest*>(r);
      auto* rc = static_cast<RecvComm*>(c);
      drive(rc);
      // Held CTS go once this receive is one of them (the caller waits for it) or few are out.
      rc->tested = true;
      if (rc->cts_sent < rc->next && (q->number >= rc->cts_sent || held_cts_due(rc))) write_held_cts(rc);
      // A receive still short of immediates: whether they can still come. Ends it when not.
      auto waiting = [&](uint32_t value, uint32_t need) {
        if (e.peer_dead(d->group, c->peer)) {
          note_error(q, Status(Code::kPeerDead, "peer dead"));
        } else if (c->peer_closed.load() && !sent_before_peer_closed(rc, q->number)) {
          note_error(q, Status(Code::kPeerDead, "the sender closed before sending this"));
        } else if (c->peer_closed.load() &&
                   Clock::now() - c->peer_closed_at >= std::chrono::milliseconds(global_config().timeout_ms)) {
          // Started but never whole: a grouped receive whose eager message was all the sender
          // sent before it closed (its other buffers' messages needed the CTS it never read).
          // What it did send had PONTE_TIMEOUT_MS to land after its CLOSED.
          note_error(q, Status(Code::kPeerDead, "the sender closed without sending all of this"));
        } else if (q->epoch != e.peer_epoch(d->group, c->peer) && e.peer_ready(d->group, c->peer) &&
                   e.imm_arrived(d->group, value) < need) {
          // Rebuilt since it was posted, connected again, and still short: nothing of the old
          // connection can land any more, so what it lacks was lost with it (read in this order).
          note_error(q, Status(Code::kTransport, "lost in a connection rebuild"));
        } else {
          return Status::Ok();
        }
        break_comm(c, static_cast<Code>(q->error.load(std::memory_order_acquire)));
        if (q->pending.load(std::memory_order_acquire) == 0) return finish(request_error(q));
        return Status::Ok();
      };
      if (!q->records_read) {
        if (e.imm_arrived(d->group, q->record_imm) < static_cast<uint32_t>(q->n))
          return waiting(q->record_imm, static_cast<uint32_t>(q->n));
        uint32_t shards = 0;
        const uint8_t* base =
            rc->records.ptr + (q->inline_data ? inline_slot_offset(q->number) : record_offset(q->number, 0));
        // An eager message (sent before the sender read this request's CTS): its record names the
        // buffer by tag, and its data is copied there from the eager slot.
        EagerRecord er;
        if (read_eager(rc->records.ptr + eager_slot_offset(q->number), q->number, &er)) {
          int j = 0;
          while (j < q->n && q->tags[j] != er.tag) ++j;
          if (j == q->n || er.size > kInlineMax) {
            note_error(q, Status(Code::kTransport, "an eager message (tag %d, %llu bytes) fits no buffer of receive %llu",
                                 er.tag, static_cast<unsigned long long>(er.size),
                                 static_cast<unsigned long long>(q->number)));
            return Status::Ok();
          }
          q->eager_buf = j;
          q->received[j] = std::min<uint64_t>(er.size, q->posted[j]);
        }
        for (int i = 0; i < q->n; ++i) {
          if (i == q->eager_buf) continue;
          if (q->n == 1 && q->posted[0] > 0 && is_blank_record(base, static_cast<uint32_t>(q->number))) {
            q->received[0] = q->posted[0];  // the record immediate came with the whole buffer
            q->whole = true;
            break;
          }
          auto rec = decode_record(base + static_cast<size_t>(i) * kRecordBytes);
          if (!rec.ok() || rec->request_number != static_cast<uint32_t>(q->number) ||
              rec->size > q->posted[i] ||
              (q->inline_data && rec->shards == 0 && rec->size > kInlineMax)) {
            note_error(q, Status(Code::kTransport, "corrupt size record"));
            return Status::Ok();
          }
          q->received[i] = rec->size;
          shards += rec->shards;
        }
        q->shards = shards;
        q->records_read = true;
      }
      if (q->shards > 0 && e.imm_arrived(d->group, q->data_imm) < q->shards)
        return waiting(q->data_imm, q->shards);
      // An eager message into a buffer the CPU cannot copy to (GPU memory): written there from the
      // eager slot through the device's own peer, a NIC's loopback (PONTE_NET_EAGER_NIC_COPY
      // takes this path for host buffers too, for tests).
      const int eb = q->eager_buf;
      if (eb >= 0 && !q->eager_copying && q->received[eb] > 0 &&
          (q->targets[eb].load(std::memory_order_relaxed)->kind != MemKind::kHost || global_config().net_eager_nic_copy)) {
        const MrEntry* m = q->targets[eb].load(std::memory_order_relaxed);
        auto self = self_peer(d);
        if (!self.ok()) {
          note_error(q, self.status());
          return Status::Ok();
        }
        // The other end's stop (or its close, after it sent this message) refuses nothing here.
        start_local_op(c, q);
        hold(q, m);  // a deregMr of the buffer waits for the write (MrEntry::users)
        Status st = e.write(d->group, self.value(),
                            LocalSlice{&rc->mrs[0], eager_slot_offset(q->number) + kRecordBytes, q->received[eb]},
                            m->remote, reinterpret_cast<uintptr_t>(q->dst[eb]) - m->start, Notify{&held_done, q});
        if (st.code() == Code::kAgain) {
          release_held(q);
          undo_op(c, q);
          return Status::Ok();  // the next test() tries again
        }
        q->eager_copying = true;
        if (!st.ok()) {
          release_held(q);
          undo_op(c, q);
          note_error(q, st);
          return Status::Ok();
        }
      }
      if (q->pending.load(std::memory_order_acquire) != 0) return Status::Ok();
      if (eb >= 0 && !q->eager_copying && q->received[eb] > 0)
        std::memcpy(q->dst[eb], rc->records.ptr + eager_slot_offset(q->number) + kRecordBytes, q->received[eb]);
      // Data behind the record (no shards) is copied out; the slot is not reused before this
      // request ends. With shards it went into the buffer.
      if (q->inline_data && !q->whole && eb < 0 && q->shards == 0 && q->received[0] > 0)
        std::memcpy(q->inline_dst, rc->records.ptr + inline_slot_offset(q->number) + kRecordBytes,
                    q->received[0]);
      e.consume_imm(d->group, q->record_imm, static_cast<uint32_t>(q->n));
      if (q->shards) e.consume_imm(d->group, q->data_imm, q->shards);
      *done = 1;
      for (int i = 0; i < q->n; ++i)
        if (sizes) sizes[i] = q->received[i];
      if (count) *count = q->n;
      Status ended = finish(Status::Ok());
      if (rc->cts_sent < rc->next && held_cts_due(rc)) write_held_cts(rc);  // one fewer is out
      return ended;
    }
  }
  return Status(Code::kInternal, "test: unknown request type");
}

Status test(void* request, int* done, size_t* sizes, int* count) {
  Status st = test_now(request, done, sizes, count);
  if (st.ok() && !*done) note_waiting();
  return st;
}

}  // namespace ponte::plugin
