// The registration cache: regMr / deregMr, one engine registration per page-aligned range and
// memory kind per device, reference counted across comms.
#include "plugin/transport_internal.h"

#include <thread>

#include "plugin/log.h"

namespace ponte::plugin {

Status reg_mr(void* comm, void* data, size_t size, int type, void** mhandle, int dmabuf_fd,
              uint64_t dmabuf_offset) {
  if (!mhandle) return bad("regMr: NULL mhandle");
  *mhandle = nullptr;
  CommBase* c = as_comm(comm);
  if (!c) return bad("regMr: not a send or recv comm");
  if (!data || size == 0) return bad("regMr: empty buffer");
  Device* d = c->dev;
  MemKind kind;
  if (type == nccl_abi::kPtrHost) {
    kind = MemKind::kHost;
  } else if (type == nccl_abi::kPtrCuda) {
    if (!(d->ptr_support & nccl_abi::kPtrCuda))
      return Status(Code::kInvalidArgument,
                    "regMr: device %d (%s) cannot register GPU memory (no GPUDirect)", d->index,
                    d->name.c_str());
    kind = MemKind::kCuda;
  } else {
    return Status(Code::kInvalidArgument, "regMr: unknown memory type %d", type);
  }
  const uintptr_t a = reinterpret_cast<uintptr_t>(data);
  const uintptr_t start = a / kPage * kPage;
  const uintptr_t end = (a + size + kPage - 1) / kPage * kPage;
  if (dmabuf_fd >= 0 && (kind != MemKind::kCuda || dmabuf_offset < a - start))
    return Status(Code::kInvalidArgument,
                  "regMrDmaBuf: %s (fd %d, offset %llu of %p)",
                  kind != MemKind::kCuda ? "only GPU memory comes as a dmabuf"
                                         : "the offset leaves no room for the page the buffer starts in",
                  dmabuf_fd, static_cast<unsigned long long>(dmabuf_offset), data);
  std::lock_guard<std::mutex> lock(d->mu);
  for (MrEntry* m : d->mrs) {
    if (m->kind == kind && m->covers(a, size)) {
      ++m->refs;
      *mhandle = m;
      return Status::Ok();
    }
  }
  auto m = std::make_unique<MrEntry>();
  m->dev = d;
  m->start = start;
  m->len = end - start;
  m->kind = kind;
  // The registration starts at the page: so does its place in NCCL's dmabuf.
  auto mr = d->engine->register_memory(d->group, reinterpret_cast<void*>(start), m->len, kind, -1,
                                       dmabuf_fd, dmabuf_fd >= 0 ? dmabuf_offset - (a - start) : 0);
  if (!mr.ok()) return mr.status();
  m->mr = mr.value();
  m->remote = m->mr.remote();
  m->remote_bytes = m->remote.encode();
  m->refs = 1;
  d->mrs.push_back(m.get());
  *mhandle = m.release();
  return Status::Ok();
}

namespace {

// NCCL's abort deregisters receive buffers whose CTS the sender holds: a write into them after
// the deregistration would break the connection every comm of this device pair shares. Each recv
// comm with an outstanding receive into m is broken first (the sender hears BROKEN, stops and
// answers ACK once its writes have ended), and this waits for the answers, at most
// PONTE_TIMEOUT_MS (then the deregistration goes ahead and is logged, and later deregistrations
// do not wait for that comm again: an abort deregisters dozens of buffers). Call with d->mu held;
// it is released while waiting.
void quiesce_senders_into(Device* d, const MrEntry* m, std::unique_lock<std::mutex>& lock) {
  std::vector<CommBase*> exposed;
  for (CommBase* c : d->comms) {
    if (c->is_send || !c->paired || c->ack_given_up || c->acked.load(std::memory_order_acquire)) continue;
    auto* rc = static_cast<RecvComm*>(c);
    bool hit = false;
    for (const RecvRequest& q : rc->reqs)
      for (const auto& t : q.targets) hit = hit || t.load(std::memory_order_acquire) == m;
    if (hit) exposed.push_back(c);
  }
  if (exposed.empty()) return;
  const auto deadline = Clock::now() + std::chrono::milliseconds(global_config().timeout_ms);
  for (CommBase* c : exposed) break_comm(c, Code::kCancelled);
  // BROKEN goes again every kRetell: the sender's ACK may have found no control buffer free when
  // its last operation ended (answer_stop leaves it owed), and a repeated BROKEN asks for it again.
  constexpr auto kRetell = std::chrono::milliseconds(50);
  auto retell_at = Clock::now() + kRetell;
  for (;;) {
    // A comm closed and freed meanwhile (by another thread while mu was released) is done with.
    std::erase_if(exposed, [&](CommBase* c) { return d->comms.count(c) == 0; });
    bool waiting = false;
    for (CommBase* c : exposed) {
      if (c->acked.load(std::memory_order_acquire) || d->engine->peer_dead(d->group, c->peer)) continue;
      if (!c->broken_told.load()) break_comm(c, Code::kCancelled);  // its BROKEN found no buffer
      waiting = true;
    }
    if (!waiting) return;
    if (Clock::now() >= retell_at) {
      for (CommBase* c : exposed)
        if (!c->acked.load(std::memory_order_acquire)) (void)send_notice(c, NoticeWhat::kBroken);
      retell_at = Clock::now() + kRetell;
    }
    if (Clock::now() >= deadline) {
      for (CommBase* c : exposed)
        if (!c->acked.load(std::memory_order_acquire)) c->ack_given_up = true;
      PONTE_NET_WARN("device %d: deregMr of %p: a sender still writing into it did not answer "
                     "within PONTE_TIMEOUT_MS; deregistering anyway", d->index,
                     reinterpret_cast<void*>(m->start));
      return;
    }
    lock.unlock();
    std::this_thread::sleep_for(std::chrono::microseconds(200));
    lock.lock();
  }
}

}  // namespace

Status dereg_mr(void* /*comm: may be closed already; the handle knows its device*/, void* mhandle) {
  auto* m = static_cast<MrEntry*>(mhandle);
  if (tag_at(m) != kMagicMr) return bad("deregMr: not a memory handle");
  Device* d = m->dev;
  std::unique_lock<std::mutex> lock(d->mu);
  if (--m->refs > 0) return Status::Ok();
  for (size_t i = 0; i < d->mrs.size(); ++i) {
    if (d->mrs[i] == m) {
      d->mrs[i] = d->mrs.back();
      d->mrs.pop_back();
      break;
    }
  }
  m->magic = kMagicFreed;  // no new request can name it
  if (d->engine) quiesce_senders_into(d, m, lock);
  if (m->users.load(std::memory_order_acquire) != 0) {
    // Operations still read or write through it (NCCL deregisters mid-transfer when it aborts):
    // as ibv_dereg_mr on a NIC, nothing may touch the memory once this returns. They end within
    // the engine's operation timeout; the device stays usable meanwhile (mu is released).
    lock.unlock();
    const auto deadline = Clock::now() + std::chrono::milliseconds(global_config().timeout_ms) +
                          std::chrono::seconds(5);
    while (m->users.load(std::memory_order_acquire) != 0 && Clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    lock.lock();
    if (m->users.load(std::memory_order_acquire) != 0)  // leaked rather than freed under the NIC
      return Status(Code::kTimeout, "deregMr: operations on %p did not end", reinterpret_cast<void*>(m->start));
  }
  Status st = d->engine ? d->engine->deregister(m->mr) : Status::Ok();
  delete m;
  return st;
}

}  // namespace ponte::plugin
