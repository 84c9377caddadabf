// Teardown: closing listen, send and recv comms (freed once the engine has ended their
// operations), device teardown at release, exit and unload.
#include "plugin/transport_internal.h"

#include "plugin/log.h"

namespace ponte::plugin {

void delete_comm(CommBase* c) {
  c->magic = kMagicFreed;
  if (c->is_send)
    delete static_cast<SendComm*>(c);
  else
    delete static_cast<RecvComm*>(c);
}

namespace {
// Comms of a wedged group (core/watchdog.h), kept for good: the provider call the watchdog
// claimed is still inside the provider, and when it returns (a stopped shm peer runs again) it
// reads or writes the memory it was given, a CTS slot, a size record, an inline message.
std::vector<CommBase*>& kept_comms() {
  static auto* kept = new std::vector<CommBase*>;  // never destroyed: still referenced at exit
  return *kept;
}
}  // namespace

// Frees a comm whose operations have all ended. If its group is wedged the comm is kept, memory
// and registrations (which the wedged group would refuse to close anyway): see kept_comms. Call
// with d->mu held.
void destroy_comm(Device* d, CommBase* c) {
  unpair_comm(c);  // no NOTICE reaches it any more
  const bool wedged = !d->engine->group_status(d->group).ok();
  if (!wedged) {
    for (auto& mr : c->mrs) {
      Status st = d->engine->deregister(mr);
      if (!st.ok()) PONTE_NET_INFO("device %d: deregister failed: %s", d->index, st.message());
    }
    c->mrs.clear();
  }
  if (c->comm_id) {
    // Deregistered first: nothing can land in the comm's own buffers any more. Data for a
    // receive left outstanding may still land in NCCL's buffers: such an id waits.
    d->comm_id_used[c->comm_id] = 0;
    if (c->dirty)
      d->comm_id_quarantine[c->comm_id] =
          Clock::now() + std::chrono::milliseconds(global_config().timeout_ms);
  }
  d->comms.erase(c);
  if (wedged) {  // retire_comm marked it freed already: NCCL's calls on it are refused
    kept_comms().push_back(c);
    return;
  }
  delete_comm(c);
}

// Whether a closed comm may be freed now; sends what its close still owes the other end. A
// paired comm waits for its operations to end, tells the other end (NOTICE CLOSED) and keeps its
// buffers until that end stops writing into them (see "comm pairs" in transport_internal.h).
bool ready_to_free(Device* d, CommBase* c) {
  if (c->inflight.load(std::memory_order_acquire) != 0) return false;
  if (c->callbacks.load(std::memory_order_acquire) != 0) return false;  // after inflight: see op_done
  if (!c->paired) return true;
  answer_stop(c);  // both ends closing: ours ended, so the other end's CLOSED is answered too
  const bool dead = d->engine->peer_dead(d->group, c->peer);
  if (!c->closed_sent && !dead) {
    const bool clean = !c->failed_any.load() && c->broken.load(std::memory_order_acquire) == 0;
    // A send comm started its matched requests, and the one an eager message went to (whose CTS it
    // had not read yet: a one-buffer receive, as predicted, has all it needs).
    const uint64_t started = c->is_send ? static_cast<SendComm*>(c)->head + static_cast<SendComm*>(c)->eager_pending
                                        : static_cast<RecvComm*>(c)->next;
    Status st = send_notice(c, NoticeWhat::kClosed, clean, started);
    if (st.code() == Code::kAgain) return false;  // no control buffer free: the next call tries
    if (!st.ok()) return true;                    // the other end cannot be reached
    c->closed_sent = true;
  }
  // The other end's own CLOSED also says that it writes here no more.
  return dead || c->acked.load(std::memory_order_acquire) || c->peer_closed.load() ||
         Clock::now() >= c->close_deadline;
}

void reap_graveyard(Device* d) {
  auto& g = d->graveyard;
  for (size_t i = 0; i < g.size();) {
    if (ready_to_free(d, g[i])) {
      destroy_comm(d, g[i]);
      g[i] = g.back();
      g.pop_back();
    } else {
      ++i;
    }
  }
}

// Closes a comm: now when it can go (see ready_to_free), else later, from the device's graveyard.
void retire_comm(Device* d, CommBase* c) {
  c->magic = kMagicFreed;  // no more calls through NCCL
  if (c->broken.load(std::memory_order_acquire) != 0 || c->failed_any.load()) c->dirty = true;
  c->close_deadline = Clock::now() + std::chrono::milliseconds(global_config().timeout_ms);
  if (ready_to_free(d, c)) {
    destroy_comm(d, c);
  } else {
    d->graveyard.push_back(c);
  }
  reap_graveyard(d);
}

void answer_stop(CommBase* c) {
  if (!c->paired || !c->peer_stop.load() || c->inflight.load() != 0 || c->ack_sent.load()) return;
  if (c->ack_sent.exchange(true)) return;
  Status st = send_ack(c->dev, c->peer, c->token, !c->is_send);
  // No control buffer free: owed to the next call, or to the next BROKEN (on_notice). Not logged:
  // the driving thread calls this on every pass.
  if (st.code() == Code::kAgain) c->ack_sent.store(false);
}

void teardown_device(Device* d) {
  std::lock_guard<std::mutex> lock(d->mu);
  if (!d->engine) return;
  // Registrations no operation uses any more go first, while the engine runs.
  reap_graveyard(d);
  for (CommBase* c : d->comms) {
    if (c->inflight.load(std::memory_order_acquire) != 0 || c->callbacks.load(std::memory_order_acquire) != 0) continue;
    for (auto& mr : c->mrs) (void)d->engine->deregister(mr);
    c->mrs.clear();
  }
  for (MrEntry* m : d->mrs) (void)d->engine->deregister(m->mr);
  if (d->ctrl_free.load() == ~0ull && d->ctrl_mr.id != 0) (void)d->engine->deregister(d->ctrl_mr);
  // What the flushes did, per NIC (iflush reads through every NIC that carried data).
  std::string reads;
  uint64_t total = 0;
  for (int k = 0; k < d->engine->nics_in_group(d->group); ++k) {
    const uint64_t r = d->engine->reads_posted(d->group, k);
    total += r;
    if (k) reads += ',';
    reads += std::to_string(r);
  }
  if (total) PONTE_NET_INFO("device %d (%s): flush reads posted per NIC: %s", d->index, d->nic_desc.c_str(), reads.c_str());
  // Then the engine: its worker runs no callback after this, so every object can go. Not reset():
  // that nulls d->engine before the destructor runs, and the worker's last passes (its linger)
  // may still run a callback that calls it (a close NOTICE answered with an ACK). The pointer stays
  // valid until the engine is gone; what such a callback submits then ends with kCancelled.
  delete d->engine.get();
  (void)d->engine.release();
  {
    Inbox& ib = inbox();
    std::lock_guard<std::mutex> ilock(ib.mu);
    for (PendingConnect* pc : d->pending_connects) ib.pending.erase(pc->token);
    for (ListenComm* l : d->listen_comms) ib.listeners.erase(l->id);
  }
  for (PendingConnect* pc : d->pending_connects) {
    if (pc->comm) d->comms.insert(pc->comm);
    delete pc;
  }
  for (CommBase* c : d->comms) unpair_comm(c);
  for (CommBase* c : d->graveyard) unpair_comm(c);
  d->pending_connects.clear();
  for (ListenComm* l : d->listen_comms) {
    if (l->accepting) d->comms.insert(l->accepting);
    l->magic = kMagicFreed;
    delete l;
  }
  d->listen_comms.clear();
  for (CommBase* c : d->graveyard) d->comms.insert(c);
  d->graveyard.clear();
  for (CommBase* c : d->comms) {
    c->mrs.clear();  // the registrations went with the engine
    delete_comm(c);
  }
  d->comms.clear();
  for (MrEntry* m : d->mrs) {
    m->magic = kMagicFreed;
    delete m;
  }
  d->mrs.clear();
  d->peers.clear();
  d->has_self.store(false);
}

// Takes the device table out (under p.mu): the next acquire probes afresh.
std::vector<std::unique_ptr<Device>> take_devices_locked(Plugin& p) {
  std::vector<std::unique_ptr<Device>> devices;
  devices.swap(p.devices);
  p.probed = false;
  p.nics.clear();
  return devices;
}

void teardown_all() {
  Plugin& p = plugin();
  std::vector<std::unique_ptr<Device>> devices;
  {
    std::lock_guard<std::mutex> lock(p.mu);
    devices = take_devices_locked(p);
  }
  for (auto& d : devices) teardown_device(d.get());
}

Status close_listen(void* listen_comm) {
  auto* l = static_cast<ListenComm*>(listen_comm);
  if (tag_at(l) != kMagicListen) return bad("closeListen: not a listen comm");
  Device* d = l->dev;
  std::lock_guard<std::mutex> lock(d->mu);
  std::deque<Incoming> left;
  {
    Inbox& ib = inbox();
    std::lock_guard<std::mutex> ilock(ib.mu);
    ib.listeners.erase(l->id);
    left.swap(l->queue);
  }
  for (const Incoming& in : left) reject(in.via, in.from, in.msg.token, RejectReason::kClosed);
  if (l->accepting) retire_comm(d, l->accepting);
  d->listen_comms.erase(l);
  l->magic = kMagicFreed;
  delete l;
  return Status::Ok();
}

Status close_send(void* send_comm) {
  SendComm* c = as_send(send_comm);
  if (!c) return bad("closeSend: not a send comm");
  Device* d = c->dev;
  std::lock_guard<std::mutex> lock(d->mu);
  // CTS slots that arrived and were never matched: take their counts out of the engine.
  for (int i = 0; i < kSendRequests; ++i) c->dirty = c->dirty || c->reqs[i].in_use;
  c->dirty = c->dirty || c->head_n >= 0 || c->eager_pending || c->inflight.load() != 0;
  retire_comm(d, c);
  return Status::Ok();
}

Status close_recv(void* recv_comm) {
  RecvComm* c = as_recv(recv_comm);
  if (!c) return bad("closeRecv: not a recv comm");
  drive(c);  // a scan of another thread writing its held CTS ends first
  Device* d = c->dev;
  std::lock_guard<std::mutex> lock(d->mu);
  for (const RecvRequest& r : c->reqs) c->dirty = c->dirty || r.in_use;
  c->dirty = c->dirty || c->inflight.load() != 0;
  retire_comm(d, c);
  return Status::Ok();
}

// Unload (dlclose) of the plugin: close whatever is still open (NCCL versions before 2.28 never
// call finalize).
__attribute__((destructor)) static void ponte_plugin_unload() {
  try {
    teardown_all();
  } catch (...) {
  }
}

}  // namespace ponte::plugin
