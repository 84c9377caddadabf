// ponte's NCCL transport (see transport.h): the protocol on the engine, receiver driven.
//
// Each plugin device owns one Engine with one NIC group (its NICs: one for a physical device, up
// to four for a virtual one made by makeVDevice), built at the device's first use so that a host
// opens only the NICs its ranks use. (One engine per device rather than one per process: an
// engine's groups are fixed when it is created, and NCCL makes virtual devices after init; the
// engines share nothing a device needs from another.) The first init lists the NICs with device
// 0's engine. Connection setup goes through two-sided engine messages (CONNECT / ACCEPT /
// REJECT, see wire.h); data moves as one-sided writes with immediates:
//
//   receiver irecv  --CTS slot (write_imm, CTS value)-->  sender FIFO        sender: imm_arrived
//   sender   isend  --data (write_imm, data value)----->  receiver buffer    receiver: counts n
//                   --size record (write_imm, record)-->  receiver records   receiver: reads n
//
// Nothing depends on the order in which writes land: the receiver first waits for all size
// records of a request (record immediates), reads the number of data shards from them, then waits
// for that many data immediates.
#include "plugin/transport.h"

#include <bit>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "core/engine.h"
#include "core/log.h"
#include "plugin/log.h"
#include "plugin/wire.h"

namespace ponte::plugin {
namespace {

using Clock = std::chrono::steady_clock;

constexpr uint32_t kMagicListen = 0x706c736e;  // object tags, checked on every entry point
constexpr uint32_t kMagicSend = 0x70736e64;
constexpr uint32_t kMagicRecv = 0x70726376;
constexpr uint32_t kMagicMr = 0x706d7220;
constexpr uint32_t kMagicReq = 0x70726571;
constexpr uint32_t kMagicFreed = 0xdeadc0de;

constexpr size_t kPage = 4096;
constexpr int kCtrlSlots = 64;  // control message buffers per device
constexpr int kSendRequests = kMaxRequests * kMaxRecvs;

uint64_t random_u64() {
  static std::mutex mu;
  static std::mt19937_64 gen{std::random_device{}()};
  std::lock_guard<std::mutex> lock(mu);
  uint64_t v = 0;
  while (v == 0) v = gen();
  return v;
}

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

// Page-aligned, zeroed host memory for the protocol's own registered buffers.
struct HostBuffer {
  uint8_t* ptr = nullptr;
  size_t len = 0;
  HostBuffer() = default;
  explicit HostBuffer(size_t n) : len((n + kPage - 1) / kPage * kPage) {
    ptr = static_cast<uint8_t*>(std::aligned_alloc(kPage, len));
    if (ptr) std::memset(ptr, 0, len);
  }
  ~HostBuffer() { std::free(ptr); }
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;
};

struct Device;
struct CommBase;

// ---- memory registrations ---------------------------------------------------------------------

struct MrEntry {
  uint32_t magic = kMagicMr;
  Device* dev = nullptr;
  uintptr_t start = 0;  // page aligned
  size_t len = 0;       // multiple of the page size
  MemKind kind = MemKind::kHost;
  int refs = 0;
  MemoryRegion mr;
  RemoteRegion remote;
  std::vector<uint8_t> remote_bytes;  // remote.encode(), copied into CTS entries
  bool covers(uintptr_t a, size_t n) const { return a >= start && a + n <= start + len; }
};

// ---- requests ---------------------------------------------------------------------------------

enum class ReqType : uint8_t { kSend, kRecv, kFlush };

// Shared head of every request. The engine's Notify callbacks (worker thread) touch only
// `error`, `pending` and the owning comm's `inflight`; everything else belongs to the thread that
// drives the comm (NCCL's proxy thread).
struct Request {
  uint32_t magic = kMagicReq;
  ReqType type = ReqType::kSend;
  bool in_use = false;
  CommBase* comm = nullptr;
  std::atomic<uint32_t> pending{0};  // engine operations not yet completed
  std::atomic<uint8_t> error{0};     // first failure (a Code), 0 = none
};

struct SendRequest : Request {
  int index = 0;  // in SendComm::reqs; also selects the size record's outbox slot
  size_t size = 0;
  RemoteRegion dst;  // kept alive for the engine until the writes complete
  bool record_unsubmitted = false;
  size_t record_dst_offset = 0;
  uint32_t record_imm = 0;
};

struct RecvRequest : Request {
  uint64_t number = 0;
  int n = 0;
  uint32_t data_imm = 0;
  uint32_t record_imm = 0;
  bool records_read = false;
  uint32_t shards = 0;
  uint64_t posted[kMaxRecvs] = {};
  uint64_t received[kMaxRecvs] = {};
};

// ---- comms ------------------------------------------------------------------------------------

struct CommBase {
  uint32_t magic = 0;  // first member: see tag_at
  Device* dev = nullptr;
  PeerId peer = 0;
  uint32_t comm_id = 0;         // local: imm values landing here carry it
  uint32_t remote_comm_id = 0;  // the peer comm's
  std::atomic<uint32_t> inflight{0};  // engine operations not yet completed
  bool dirty = false;                 // closed with requests outstanding
  bool is_send = false;
  std::vector<MemoryRegion> mrs;      // the protocol's own registrations
};

struct SendComm : CommBase {
  HostBuffer fifo{kFifoBytes};                              // CTS slots, written by the receiver
  HostBuffer outbox{kSendRequests * kRecordBytes};          // size records to write
  RemoteRegion records;                                     // the receiver's record area
  uint64_t head = 0;                                        // request number being matched
  int head_n = -1;                                          // buffers in that CTS; -1 = not read
  uint32_t matched = 0;                                     // its buffers already sent to
  CtsElem elems[kMaxRecvs];
  RemoteRegion regions[kMaxRecvs];
  std::unique_ptr<SendRequest[]> reqs{new SendRequest[kSendRequests]};
  int free_list[kSendRequests];
  int free_count = 0;
};

struct RecvComm : CommBase {
  HostBuffer records{kRecordArea};  // size records, written by the sender
  HostBuffer cts{kFifoBytes};       // CTS slots to write into the sender's FIFO
  HostBuffer flush_buf{kPage};      // target of flush reads
  RemoteRegion fifo;                // the sender's FIFO
  uint64_t next = 0;                // next request number
  RecvRequest reqs[kMaxRequests];
  Request flushes[kMaxRequests];
};

struct Incoming {
  Device* via = nullptr;  // the device whose engine received the CONNECT (bootstrap or own)
  PeerId from = 0;        // the sender as that engine knows it
  ConnectMsg msg;
};

struct ListenComm {
  uint32_t magic = kMagicListen;
  Device* dev = nullptr;
  uint32_t id = 0;
  uint64_t nonce = 0;
  std::deque<Incoming> queue;  // guarded by Inbox::mu
  // An accepted comm whose ACCEPT message could not be sent yet (no control buffer free).
  RecvComm* accepting = nullptr;
  uint8_t accept_msg[kMaxMsgSize];
  size_t accept_len = 0;
};

enum class ConnectState : uint8_t { kSending, kWaiting, kAccepted, kRejected };

struct PendingConnect {
  uint64_t token = 0;
  SendComm* comm = nullptr;
  uint8_t msg[kMaxMsgSize];
  size_t msg_len = 0;
  ConnectState state = ConnectState::kSending;  // guarded by Inbox::mu
  bool bootstrap = false;  // the listener answers from its own group: the data peer is accept_from
  AcceptMsg accept;
  PeerId accept_from = 0;
  RejectReason reason = RejectReason::kNoListener;
};

// ---- devices ----------------------------------------------------------------------------------

struct CtrlSlot {
  Device* dev = nullptr;
  int index = 0;
};

struct Device {
  int index = 0;
  std::vector<size_t> nics;  // backend device indexes (repeats open the NIC again)
  std::string name;
  std::string nic_desc;  // "lo, lo" / "mlx5_0:1 (0000:18:00.0)": for logs
  std::string pci_path;
  bool has_pci = false;
  uint64_t guid = 0;
  int speed = kDefaultSpeedMbps;
  int port = 1;
  int ptr_support = nccl_abi::kPtrHost;
  nccl_abi::VDeviceProps vprops{};

  // mu: the engine's creation, registrations, comm ids, peers, object lists. Never taken by the
  // engine's worker thread, so engine calls that wait for the worker are safe under it.
  std::mutex mu;
  std::unique_ptr<Engine> engine;
  static constexpr int group = 0;
  HostBuffer ctrl_buf{kCtrlSlots * kMaxMsgSize};
  MemoryRegion ctrl_mr;
  std::atomic<uint64_t> ctrl_free{~0ull};
  CtrlSlot ctrl_slots[kCtrlSlots];
  std::vector<uint8_t> comm_id_used = std::vector<uint8_t>(kMaxCommId + 1, 0);
  // When a comm closed with work outstanding released its id: the id waits out the engine
  // timeout, after which no late immediate of the old comm can still land.
  std::vector<Clock::time_point> comm_id_quarantine =
      std::vector<Clock::time_point>(kMaxCommId + 1);
  std::unordered_map<std::string, PeerId> peers;  // by engine address bytes
  std::atomic<bool> has_self{false};  // self_peer is set (for flush reads)
  PeerId self_peer = 0;
  std::vector<MrEntry*> mrs;
  std::unordered_set<CommBase*> comms;      // open comms
  std::vector<CommBase*> graveyard;         // closed, waiting for their operations to end
  std::unordered_set<ListenComm*> listen_comms;
  std::unordered_set<PendingConnect*> pending_connects;
};

// What the engines' message handlers (worker threads of every device) look up: listeners and
// pending connects of all devices, as a CONNECT may arrive on a bootstrap device's engine.
// Engine calls are never made while mu is held.
struct Inbox {
  std::mutex mu;
  uint32_t next_listen_id = 1;
  std::unordered_map<uint32_t, ListenComm*> listeners;    // by listen id
  std::unordered_map<uint64_t, PendingConnect*> pending;  // by connect token
};

Inbox& inbox() {
  static Inbox* i = new Inbox;  // never destroyed: handlers may run during unload
  return *i;
}

struct Plugin {
  std::mutex mu;  // refs, probing, the device table
  int refs = 0;
  bool probed = false;
  BackendKind backend = BackendKind::kFabric;
  std::vector<NicInfo> nics;
  std::vector<std::unique_ptr<Device>> devices;
};

Plugin& plugin() {
  static Plugin* p = new Plugin;  // torn down explicitly (release / unload), never destroyed
  return *p;
}

// ---- small helpers ----------------------------------------------------------------------------

// The object tag at the start of what NCCL hands back (every tagged object has it first), read
// without assuming that the pointer names such an object or is aligned for one.
uint32_t tag_at(const void* p) {
  uint32_t t = 0;
  if (p) std::memcpy(&t, p, sizeof(t));
  return t;
}

SendComm* as_send(void* p) {
  return tag_at(p) == kMagicSend ? static_cast<SendComm*>(static_cast<CommBase*>(p)) : nullptr;
}
RecvComm* as_recv(void* p) {
  return tag_at(p) == kMagicRecv ? static_cast<RecvComm*>(static_cast<CommBase*>(p)) : nullptr;
}
CommBase* as_comm(void* p) {
  const uint32_t t = tag_at(p);
  return t == kMagicSend || t == kMagicRecv ? static_cast<CommBase*>(p) : nullptr;
}

void delete_comm(CommBase* c) {
  c->magic = kMagicFreed;
  if (c->is_send)
    delete static_cast<SendComm*>(c);
  else
    delete static_cast<RecvComm*>(c);
}

Status bad(const char* what) { return Status(Code::kInvalidArgument, "%s", what); }

void note_error(Request* r, const Status& st) {
  uint8_t expected = 0;
  r->error.compare_exchange_strong(expected, static_cast<uint8_t>(st.code()),
                                   std::memory_order_acq_rel);
}

// Notify target of every data-path operation.
void op_done(void* arg, const Status& st) {
  auto* r = static_cast<Request*>(arg);
  CommBase* c = r->comm;
  if (!st.ok()) note_error(r, st);
  r->pending.fetch_sub(1, std::memory_order_acq_rel);
  c->inflight.fetch_sub(1, std::memory_order_acq_rel);  // last touch: the comm may go after this
}

void ctrl_done(void* arg, const Status& st) {
  auto* s = static_cast<CtrlSlot*>(arg);
  if (!st.ok()) PONTE_NET_INFO("control message on device %d failed: %s", s->dev->index, st.message());
  s->dev->ctrl_free.fetch_or(1ull << s->index, std::memory_order_acq_rel);
}

Status request_error(const Request* r) {
  const auto code = static_cast<Code>(r->error.load(std::memory_order_acquire));
  return Status(code, "%s request failed: %s", r->type == ReqType::kRecv ? "receive" : r->type == ReqType::kSend ? "send" : "flush",
                code_name(code));
}

// Sends a control message (copied into a registered buffer) to peer. kAgain: no buffer free.
Status send_ctrl(Device* d, PeerId peer, const uint8_t* msg, size_t len) {
  uint64_t mask = d->ctrl_free.load(std::memory_order_acquire);
  int slot = -1;
  while (mask != 0) {
    const int i = std::countr_zero(mask);
    if (d->ctrl_free.compare_exchange_weak(mask, mask & ~(1ull << i), std::memory_order_acq_rel)) {
      slot = i;
      break;
    }
  }
  if (slot < 0) return Status(Code::kAgain, "no control buffer free on device %d", d->index);
  std::memcpy(d->ctrl_buf.ptr + slot * kMaxMsgSize, msg, len);
  LocalSlice src{&d->ctrl_mr, static_cast<size_t>(slot) * kMaxMsgSize, len};
  Status st = d->engine->send(d->group, peer, src, Notify{&ctrl_done, &d->ctrl_slots[slot]});
  if (!st.ok()) d->ctrl_free.fetch_or(1ull << slot, std::memory_order_acq_rel);
  return st;
}

// ---- the message handler (engine worker thread) -------------------------------------------------

void reject(Device* d, PeerId to, uint64_t token, RejectReason why) {
  uint8_t buf[kMaxMsgSize];
  const size_t len = encode_reject(RejectMsg{token, why}, buf);
  Status st = send_ctrl(d, to, buf, len);
  if (!st.ok()) PONTE_NET_WARN("device %d: could not send REJECT: %s", d->index, st.message());
}

void on_message(void* arg, PeerId from, std::span<const uint8_t> data) {
  auto* d = static_cast<Device*>(arg);
  try {
    auto kind = peek_kind(data);
    if (!kind.ok()) {
      PONTE_NET_WARN("device %d: dropped a message from peer %u: %s", d->index, from,
                     kind.status().message());
      return;
    }
    switch (kind.value()) {
      case MsgKind::kConnect: {
        auto m = decode_connect(data);
        if (!m.ok()) {
          PONTE_NET_WARN("device %d: bad CONNECT from peer %u: %s", d->index, from,
                         m.status().message());
          return;
        }
        bool queued = false;
        {
          Inbox& ib = inbox();
          std::lock_guard<std::mutex> lock(ib.mu);
          auto it = ib.listeners.find(m->listen_id);
          if (it != ib.listeners.end() && it->second->nonce == m->listen_nonce) {
            it->second->queue.push_back(Incoming{d, from, std::move(m).value()});
            queued = true;
          }
        }
        if (!queued) reject(d, from, m->token, RejectReason::kNoListener);
        return;
      }
      case MsgKind::kAccept: {
        auto m = decode_accept(data);
        if (!m.ok()) {
          PONTE_NET_WARN("device %d: bad ACCEPT from peer %u: %s", d->index, from,
                         m.status().message());
          return;
        }
        Inbox& ib = inbox();
        std::lock_guard<std::mutex> lock(ib.mu);
        auto it = ib.pending.find(m->token);
        // The answer must come to the connecting device's own engine.
        if (it != ib.pending.end() && it->second->comm->dev == d &&
            it->second->state != ConnectState::kRejected) {
          it->second->accept = m.value();
          it->second->accept_from = from;
          it->second->state = ConnectState::kAccepted;
        }
        return;
      }
      case MsgKind::kReject: {
        auto m = decode_reject(data);
        if (!m.ok()) return;
        Inbox& ib = inbox();
        std::lock_guard<std::mutex> lock(ib.mu);
        auto it = ib.pending.find(m->token);
        if (it != ib.pending.end() && it->second->state != ConnectState::kAccepted) {
          it->second->reason = m->reason;
          it->second->state = ConnectState::kRejected;
        }
        return;
      }
    }
  } catch (...) {
    PONTE_NET_WARN("device %d: exception while handling a message from peer %u", d->index, from);
  }
}

// ---- devices and engines ----------------------------------------------------------------------

void teardown_all();

void teardown_at_exit() {
  try {
    teardown_all();
  } catch (...) {
  }
}

// Closing the engines at exit must happen before the engine's own statics go away: a handler
// registered after the first engine exists runs before those (exit handlers run in reverse).
void register_exit_teardown() {
  static std::once_flag once;
  std::call_once(once, [] { std::atexit(&teardown_at_exit); });
}

std::string nic_list(const Device& d, const std::vector<NicInfo>& nics) {  // call with p.mu held
  std::string s;
  for (size_t i = 0; i < d.nics.size(); ++i) {
    if (i) s += ", ";
    const NicInfo& n = nics[d.nics[i]];
    s += n.name + (n.pci_bus_id.empty() ? "" : " (" + n.pci_bus_id + ")");
  }
  return s;
}

// Builds the device's engine (one group over its NICs) on first use. Call with d->mu held.
Status ensure_engine(Device* d) {
  if (d->engine) return Status::Ok();
  EngineOptions opts;
  opts.groups.push_back(d->nics);
  auto e = Engine::create(opts);
  if (!e.ok()) {
    PONTE_NET_WARN("device %d (%s): engine failed: %s", d->index, d->name.c_str(),
                   e.status().message());
    return e.status();
  }
  std::unique_ptr<Engine> engine = std::move(e).value();
  auto mr = engine->register_memory(d->group, d->ctrl_buf.ptr, d->ctrl_buf.len);
  if (!mr.ok()) return mr.status();
  d->ctrl_mr = mr.value();
  for (int i = 0; i < kCtrlSlots; ++i) d->ctrl_slots[i] = CtrlSlot{d, i};
  engine->set_recv_handler(d->group, &on_message, d);
  d->engine = std::move(engine);
  register_exit_teardown();
  PONTE_NET_INFO("device %d %s: engine up, %s backend, %d NIC(s): %s; GPUDirect %s", d->index,
                 d->name.c_str(), backend_name(d->engine->backend()),
                 d->engine->nics_in_group(d->group), d->nic_desc.c_str(),
                 (d->ptr_support & nccl_abi::kPtrCuda) ? "on" : "off");
  return Status::Ok();
}

Result<Device*> device_at(int dev) {
  Plugin& p = plugin();
  std::lock_guard<std::mutex> lock(p.mu);
  if (p.refs == 0) return Status(Code::kInvalidArgument, "the plugin is not initialized");
  if (dev < 0 || static_cast<size_t>(dev) >= p.devices.size())
    return Status(Code::kInvalidArgument, "device %d does not exist (%zu devices)", dev,
                  p.devices.size());
  return p.devices[dev].get();
}

// Lowest free comm id (keeps the set of immediate values small), skipping quarantined ones.
// Counts left on its values by an earlier owner are consumed first. Call with d->mu held.
Result<uint32_t> alloc_comm_id(Device* d) {
  const auto now = Clock::now();
  for (uint32_t id = 1; id <= kMaxCommId; ++id) {
    if (d->comm_id_used[id] || now < d->comm_id_quarantine[id]) continue;
    d->comm_id_used[id] = 1;
    for (uint32_t slot = 0; slot < static_cast<uint32_t>(kMaxRequests); ++slot) {
      for (bool record : {false, true}) {
        const uint32_t v = imm_value(record, id, slot);
        const uint32_t left = d->engine->imm_arrived(d->group, v);
        if (left) d->engine->consume_imm(d->group, v, left);
      }
    }
    return id;
  }
  return Status(Code::kResource, "device %d: all %u comm ids in use (or waiting after a close "
                "with work outstanding)", d->index, kMaxCommId);
}

Status register_own(Device* d, CommBase* c, HostBuffer& buf) {
  if (!buf.ptr) return Status(Code::kResource, "out of memory for protocol buffers");
  auto mr = d->engine->register_memory(d->group, buf.ptr, buf.len);
  if (!mr.ok()) return mr.status();
  c->mrs.push_back(mr.value());
  return Status::Ok();
}

// Frees a comm whose operations have all ended. Call with d->mu held.
void destroy_comm(Device* d, CommBase* c) {
  for (auto& mr : c->mrs) {
    Status st = d->engine->deregister(mr);
    if (!st.ok()) PONTE_NET_INFO("device %d: deregister failed: %s", d->index, st.message());
  }
  c->mrs.clear();
  if (c->comm_id) {
    // Deregistered first: nothing can land in the comm's own buffers any more. Data for a
    // receive left outstanding may still land in NCCL's buffers: such an id waits.
    d->comm_id_used[c->comm_id] = 0;
    if (c->dirty)
      d->comm_id_quarantine[c->comm_id] =
          Clock::now() + std::chrono::milliseconds(global_config().timeout_ms);
  }
  d->comms.erase(c);
  delete_comm(c);
}

void reap_graveyard(Device* d) {
  auto& g = d->graveyard;
  for (size_t i = 0; i < g.size();) {
    if (g[i]->inflight.load(std::memory_order_acquire) == 0) {
      destroy_comm(d, g[i]);
      g[i] = g.back();
      g.pop_back();
    } else {
      ++i;
    }
  }
}

// Closes a comm: now when nothing is in flight, else once the engine has ended its operations.
void retire_comm(Device* d, CommBase* c) {
  c->magic = kMagicFreed;  // no more calls through NCCL
  if (c->inflight.load(std::memory_order_acquire) == 0) {
    destroy_comm(d, c);
  } else {
    d->graveyard.push_back(c);
  }
  reap_graveyard(d);
}

// The engine peer for a remote group address: one per remote group, shared by every comm.
Result<PeerId> peer_for(Device* d, std::span<const uint8_t> address) {
  std::string key(reinterpret_cast<const char*>(address.data()), address.size());
  auto it = d->peers.find(key);
  if (it != d->peers.end() && !d->engine->peer_dead(d->group, it->second)) return it->second;
  auto peer = d->engine->connect(d->group, address);
  if (!peer.ok()) return peer.status();
  d->peers[key] = peer.value();
  return peer.value();
}


// Deletes a pending connect and its not-yet-returned comm. Call with d->mu held.
void drop_pending(Device* d, PendingConnect* pc) {
  {
    Inbox& ib = inbox();
    std::lock_guard<std::mutex> lock(ib.mu);
    ib.pending.erase(pc->token);
  }
  d->pending_connects.erase(pc);
  if (pc->comm) retire_comm(d, pc->comm);
  delete pc;
}

// ---- teardown ---------------------------------------------------------------------------------

void teardown_device(Device* d) {
  std::lock_guard<std::mutex> lock(d->mu);
  if (!d->engine) return;
  // Registrations no operation uses any more go first, while the engine runs.
  reap_graveyard(d);
  for (CommBase* c : d->comms) {
    if (c->inflight.load(std::memory_order_acquire) != 0) continue;
    for (auto& mr : c->mrs) (void)d->engine->deregister(mr);
    c->mrs.clear();
  }
  for (MrEntry* m : d->mrs) (void)d->engine->deregister(m->mr);
  if (d->ctrl_free.load() == ~0ull && d->ctrl_mr.id != 0) (void)d->engine->deregister(d->ctrl_mr);
  // Then the engine: its worker runs no callback after this, so every object can go.
  d->engine.reset();
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

// ---- probing ----------------------------------------------------------------------------------

std::string sysfs_pci_path(const std::string& bus_id) {
  if (bus_id.empty()) return {};
  const std::string link = "/sys/bus/pci/devices/" + bus_id;
  char resolved[PATH_MAX];
  if (!realpath(link.c_str(), resolved)) return {};
  return resolved;
}

int port_of(const std::string& name) {
  const auto colon = name.rfind(':');
  if (colon == std::string::npos || colon + 1 >= name.size()) return 1;
  char* end = nullptr;
  const long v = std::strtol(name.c_str() + colon + 1, &end, 10);
  return (*end == 0 && v > 0 && v < 256) ? static_cast<int>(v) : 1;
}

bool name_taken(const Plugin& p, const std::string& name) {
  for (const auto& d : p.devices)
    if (d->name == name) return true;
  return false;
}

int ptr_support_of(const std::vector<const NicInfo*>& nics) {
  bool cuda = !nics.empty(), dmabuf = !nics.empty();
  for (const NicInfo* n : nics) {
    cuda = cuda && n->device_memory;
    dmabuf = dmabuf && n->dmabuf;
  }
  return nccl_abi::kPtrHost | (cuda ? nccl_abi::kPtrCuda : 0) |
         (cuda && dmabuf ? nccl_abi::kPtrDmabuf : 0);
}

// Lists the backend's NICs with a throwaway engine over NIC 0 (the engine offers no listing
// without opening one); kept as device 0's engine, as device 0 is the one most often used.
void probe_locked(Plugin& p) {
  p.probed = true;
  EngineOptions opts;
  opts.groups.push_back({0});
  auto e = Engine::create(opts);
  if (!e.ok()) {
    PONTE_NET_INFO("no usable NIC, ponte offers no device (%s); NCCL falls back to its own "
                   "transports",
                   e.status().message());
    return;
  }
  std::unique_ptr<Engine> engine = std::move(e).value();
  p.backend = engine->backend();
  p.nics = engine->devices();
  const auto& cfg = global_config();
  PONTE_NET_INFO("%s backend%s%s, %zu NIC(s)", backend_name(p.backend),
                 p.backend == BackendKind::kFabric ? ", provider " : "",
                 p.backend == BackendKind::kFabric ? cfg.fabric_provider.c_str() : "",
                 p.nics.size());
  for (size_t i = 0; i < p.nics.size(); ++i) {
    const NicInfo& n = p.nics[i];
    auto d = std::make_unique<Device>();
    d->index = static_cast<int>(i);
    d->nics = {i};
    d->name = name_taken(p, n.name) ? n.name + "#" + std::to_string(i) : n.name;
    d->pci_path = sysfs_pci_path(n.pci_bus_id);
    d->has_pci = !d->pci_path.empty();
    d->guid = fnv1a(n.pci_bus_id.empty() ? n.provider + "/" + n.name + "/" + std::to_string(i)
                                         : n.pci_bus_id);
    d->speed = n.speed_mbps ? static_cast<int>(std::min<uint64_t>(n.speed_mbps, INT_MAX))
                            : kDefaultSpeedMbps;
    d->port = port_of(n.name);
    d->ptr_support = ptr_support_of({&n});
    d->vprops.ndevs = 1;
    d->vprops.devs[0] = static_cast<int>(i);
    d->nic_desc = nic_list(*d, p.nics);
    PONTE_NET_INFO("device %zu: %s, provider %s, pci %s, %d Mbps%s, GPUDirect %s%s", i,
                   d->name.c_str(), n.provider.c_str(),
                   d->has_pci ? d->pci_path.c_str() : "none (attached to the first CPU)",
                   d->speed, n.speed_mbps ? "" : " (default: link reports no speed)",
                   (d->ptr_support & nccl_abi::kPtrCuda) ? "yes" : "no",
                   (d->ptr_support & nccl_abi::kPtrDmabuf) ? " (dmabuf)" : "");
    p.devices.push_back(std::move(d));
  }
  if (!p.devices.empty()) {
    // No other thread can reach device 0 before p.mu is released: no need for d0->mu here.
    Device* d0 = p.devices[0].get();
    auto mr = engine->register_memory(d0->group, d0->ctrl_buf.ptr, d0->ctrl_buf.len);
    if (mr.ok()) {
      d0->ctrl_mr = mr.value();
      for (int i = 0; i < kCtrlSlots; ++i) d0->ctrl_slots[i] = CtrlSlot{d0, i};
      engine->set_recv_handler(d0->group, &on_message, d0);
      d0->engine = std::move(engine);
      register_exit_teardown();
    }
  }
}

}  // namespace

// ================================================================================================

nccl_abi::NcclResult to_nccl(const Status& st) {
  switch (st.code()) {
    case Code::kOk:
      return nccl_abi::kSuccess;
    case Code::kInvalidArgument:
    case Code::kNotFound:
      return nccl_abi::kInvalidArgument;
    case Code::kPeerDead:
    case Code::kTimeout:
      return nccl_abi::kRemoteError;
    case Code::kUnavailable:
    case Code::kTransport:
    case Code::kResource:
    case Code::kCancelled:
    case Code::kAgain:
      return nccl_abi::kSystemError;
    case Code::kInternal:
      return nccl_abi::kInternalError;
  }
  return nccl_abi::kInternalError;
}

namespace {
void core_log_sink(LogLevel level, const char* line) {
  if (level <= LogLevel::kWarn)
    PONTE_NET_WARN("%s", line);
  else
    PONTE_NET_INFO("%s", line);
}
}  // namespace

Status acquire(nccl_abi::Logger logger) {
  set_logger(logger);
  if (logger) set_log_sink(&core_log_sink);  // the engine's own lines go to NCCL's logger too
  Plugin& p = plugin();
  std::lock_guard<std::mutex> lock(p.mu);
  ++p.refs;
  if (!p.probed) probe_locked(p);
  return Status::Ok();
}

void release() {
  Plugin& p = plugin();
  std::vector<std::unique_ptr<Device>> devices;
  {
    std::lock_guard<std::mutex> lock(p.mu);
    if (p.refs == 0) return;
    if (--p.refs > 0) return;
    devices = take_devices_locked(p);  // in the same step: a concurrent acquire probes afresh
  }
  for (auto& d : devices) teardown_device(d.get());
}

Status device_count(int* ndev) {
  if (!ndev) return bad("devices: NULL ndev");
  Plugin& p = plugin();
  std::lock_guard<std::mutex> lock(p.mu);
  if (p.refs == 0) return bad("devices: the plugin is not initialized");
  *ndev = static_cast<int>(p.devices.size());
  return Status::Ok();
}

Status device_properties(int dev, DeviceProps* props) {
  if (!props) return bad("getProperties: NULL props");
  PONTE_ASSIGN_OR_RETURN(Device * d, device_at(dev));
  *props = DeviceProps{};
  props->name = d->name.c_str();
  props->pci_path = d->has_pci ? d->pci_path.c_str() : nullptr;
  props->guid = d->guid;
  props->ptr_support = d->ptr_support;
  props->reg_is_global = 1;
  props->force_flush = 0;
  props->speed = d->speed;
  props->port = d->port;
  props->max_comms = static_cast<int>(kMaxCommId);
  props->max_recvs = kMaxRecvs;
  props->vprops = d->vprops;
  props->max_p2p_bytes = nccl_abi::kMaxNetSizeBytes;
  props->max_coll_bytes = nccl_abi::kMaxNetSizeBytes;
  return Status::Ok();
}

Status make_vdevice(int* out, const nccl_abi::VDeviceProps* vp) {
  if (!out || !vp) return bad("makeVDevice: NULL argument");
  Plugin& p = plugin();
  std::lock_guard<std::mutex> lock(p.mu);
  if (p.refs == 0) return bad("makeVDevice: the plugin is not initialized");
  if (vp->ndevs < 1 || vp->ndevs > kMaxNicsPerDevice)
    return Status(Code::kInvalidArgument, "makeVDevice: %d devices, must be 1..%d", vp->ndevs,
                  kMaxNicsPerDevice);
  auto d = std::make_unique<Device>();
  std::vector<const NicInfo*> infos;
  uint64_t speed = 0;
  for (int i = 0; i < vp->ndevs; ++i) {
    const int c = vp->devs[i];
    if (c < 0 || static_cast<size_t>(c) >= p.nics.size())
      return Status(Code::kInvalidArgument, "makeVDevice: %d is not a physical device (0..%zu)",
                    c, p.nics.size());
    const Device& child = *p.devices[c];
    d->nics.push_back(static_cast<size_t>(c));
    infos.push_back(&p.nics[c]);
    speed += static_cast<uint64_t>(child.speed);
    d->name += (i ? "+" : "") + child.name;
    d->vprops.devs[i] = c;
  }
  d->vprops.ndevs = vp->ndevs;
  d->nic_desc = nic_list(*d, p.nics);
  d->index = static_cast<int>(p.devices.size());
  if (name_taken(p, d->name)) d->name += "#" + std::to_string(d->index);
  const Device& first = *p.devices[vp->devs[0]];
  d->pci_path = first.pci_path;
  d->has_pci = first.has_pci;
  d->guid = fnv1a(d->name);
  d->speed = static_cast<int>(std::min<uint64_t>(speed, INT_MAX));
  d->port = first.port;
  d->ptr_support = ptr_support_of(infos);
  PONTE_NET_INFO("made virtual device %d = %s (%d NICs, %d Mbps, GPUDirect %s)", d->index,
                 d->name.c_str(), vp->ndevs, d->speed,
                 (d->ptr_support & nccl_abi::kPtrCuda) ? "yes" : "no");
  *out = d->index;
  p.devices.push_back(std::move(d));
  return Status::Ok();
}

// ---- listen / connect / accept ----------------------------------------------------------------

Status listen(int dev, void* handle, void** listen_comm) {
  if (!handle || !listen_comm) return bad("listen: NULL argument");
  *listen_comm = nullptr;
  PONTE_ASSIGN_OR_RETURN(Device * d, device_at(dev));
  std::lock_guard<std::mutex> lock(d->mu);
  PONTE_RETURN_IF_ERROR(ensure_engine(d));
  reap_graveyard(d);
  std::vector<uint8_t> address = d->engine->address(d->group);
  bool bootstrap = false;
  if (address.size() > kHandleMaxAddress) {
    // Too long for NCCL's handle: hand out the address of the first NIC's own device (a one-NIC
    // group of this process) instead; connections are set up through it and then answered from
    // this device's group (see wire.h).
    const int first = d->vprops.devs[0];
    if (d->vprops.ndevs < 2 || first == d->index)
      return Status(Code::kInvalidArgument,
                    "listen: device %d's engine address is %zu bytes, more than the %zu a handle "
                    "holds",
                    d->index, address.size(), kHandleMaxAddress);
    PONTE_ASSIGN_OR_RETURN(Device * boot, device_at(first));
    std::lock_guard<std::mutex> block(boot->mu);  // lock order: virtual device, then physical
    PONTE_RETURN_IF_ERROR(ensure_engine(boot));
    address = boot->engine->address(boot->group);
    bootstrap = true;
  }
  auto l = std::make_unique<ListenComm>();
  l->dev = d;
  l->nonce = random_u64();
  {
    Inbox& ib = inbox();
    std::lock_guard<std::mutex> ilock(ib.mu);
    l->id = ib.next_listen_id++;
    if (ib.next_listen_id == 0) ib.next_listen_id = 1;
  }
  ListenHandle h{l->id, l->nonce, bootstrap, address};
  PONTE_RETURN_IF_ERROR(encode_handle(h, static_cast<uint8_t*>(handle)));
  {
    Inbox& ib = inbox();
    std::lock_guard<std::mutex> ilock(ib.mu);
    ib.listeners[l->id] = l.get();
  }
  d->listen_comms.insert(l.get());
  *listen_comm = l.release();
  return Status::Ok();
}

Status connect(int dev, void* handle, void** send_comm) {
  if (!handle || !send_comm) return bad("connect: NULL argument");
  *send_comm = nullptr;
  auto* hb = static_cast<uint8_t*>(handle);
  PONTE_ASSIGN_OR_RETURN(Device * d, device_at(dev));
  std::lock_guard<std::mutex> lock(d->mu);
  PONTE_RETURN_IF_ERROR(ensure_engine(d));
  reap_graveyard(d);
  Engine& e = *d->engine;
  const uint64_t token = handle_stage(hb);

  if (token == 0) {  // first call with this handle: start connecting
    PONTE_ASSIGN_OR_RETURN(ListenHandle h, decode_handle(hb));
    PONTE_ASSIGN_OR_RETURN(PeerId peer, peer_for(d, h.address));
    PONTE_ASSIGN_OR_RETURN(uint32_t id, alloc_comm_id(d));
    auto* c = new SendComm;
    c->magic = kMagicSend;
    c->is_send = true;
    c->dev = d;
    c->peer = peer;
    c->comm_id = id;
    d->comms.insert(c);
    auto pc = std::make_unique<PendingConnect>();
    pc->comm = c;
    Status st = register_own(d, c, c->fifo);
    if (st.ok()) st = register_own(d, c, c->outbox);
    if (!st.ok()) {
      retire_comm(d, c);
      return st;
    }
    for (int i = 0; i < kSendRequests; ++i) {
      c->reqs[i].type = ReqType::kSend;
      c->reqs[i].comm = c;
      c->reqs[i].index = i;
      c->free_list[i] = kSendRequests - 1 - i;
    }
    c->free_count = kSendRequests;
    pc->token = random_u64();
    ConnectMsg m;
    m.listen_id = h.listen_id;
    m.listen_nonce = h.nonce;
    m.token = pc->token;
    m.sender_comm_id = id;
    m.fifo = c->mrs[0].remote();
    pc->bootstrap = h.bootstrap;
    if (h.bootstrap) m.reply_address = e.address(d->group);  // the listener connects back here
    auto len = encode_connect(m, pc->msg);
    if (!len.ok()) {
      retire_comm(d, c);
      return len.status();
    }
    pc->msg_len = len.value();
    {
      Inbox& ib = inbox();
      std::lock_guard<std::mutex> ilock(ib.mu);
      ib.pending[pc->token] = pc.get();
    }
    d->pending_connects.insert(pc.get());
    set_handle_stage(hb, pc->token);
    pc.release();
  }

  PendingConnect* pc = nullptr;
  ConnectState state;
  {
    Inbox& ib = inbox();
    std::lock_guard<std::mutex> ilock(ib.mu);
    auto it = ib.pending.find(handle_stage(hb));
    if (it == ib.pending.end() || it->second->comm->dev != d)
      return bad("connect: the handle belongs to a connection that already completed or failed");
    pc = it->second;
    state = pc->state;
  }
  SendComm* c = pc->comm;
  if (state == ConnectState::kSending) {
    Status st = send_ctrl(d, c->peer, pc->msg, pc->msg_len);
    if (st.ok()) {
      std::lock_guard<std::mutex> ilock(inbox().mu);
      if (pc->state == ConnectState::kSending) pc->state = ConnectState::kWaiting;
      state = pc->state;
    } else if (st.code() != Code::kAgain) {
      drop_pending(d, pc);
      return st;
    }
  }
  if (state == ConnectState::kRejected) {
    const auto why = pc->reason;
    drop_pending(d, pc);
    return Status(Code::kInvalidArgument,
                  "connect: the listener refused (%s)",
                  why == RejectReason::kNoListener ? "no such listener: closed or a stale handle"
                  : why == RejectReason::kClosed   ? "listener closed"
                                                   : "no resources");
  }
  if (state == ConnectState::kAccepted) {
    // Through a bootstrap group, the listener answered from its own group: that peer carries the
    // data; the bootstrap peer only carried the CONNECT.
    if (pc->bootstrap) c->peer = pc->accept_from;
    c->remote_comm_id = pc->accept.receiver_comm_id;
    c->records = pc->accept.records;
    pc->comm = nullptr;
    drop_pending(d, pc);
    *send_comm = c;
    return Status::Ok();
  }
  if (e.peer_dead(d->group, c->peer)) {
    drop_pending(d, pc);
    return Status(Code::kPeerDead, "connect: the listening peer is dead or unreachable");
  }
  // A live listener that has not accepted yet is no error (NCCL accepts when it gets there); an
  // unreachable or dead one is, once the engine says so (its handshake has PONTE_TIMEOUT_MS).
  return Status::Ok();  // not yet: NCCL calls again
}

Status accept(void* listen_comm, void** recv_comm) {
  auto* l = static_cast<ListenComm*>(listen_comm);
  if (tag_at(l) != kMagicListen || !recv_comm) return bad("accept: not a listen comm");
  *recv_comm = nullptr;
  Device* d = l->dev;
  std::lock_guard<std::mutex> lock(d->mu);
  reap_graveyard(d);

  if (l->accepting) {  // the ACCEPT message of an earlier call still has to go out
    Status st = send_ctrl(d, l->accepting->peer, l->accept_msg, l->accept_len);
    if (st.code() == Code::kAgain) return Status::Ok();
    RecvComm* c = l->accepting;
    l->accepting = nullptr;
    if (!st.ok()) {
      retire_comm(d, c);
      return st;
    }
    *recv_comm = c;
    return Status::Ok();
  }

  Incoming in;
  {
    std::lock_guard<std::mutex> ilock(inbox().mu);
    if (l->queue.empty()) return Status::Ok();
    in = std::move(l->queue.front());
    l->queue.pop_front();
  }
  // The peer data moves with: the sender itself when its CONNECT came to this device's engine;
  // through a bootstrap handle, a connection from this device to the address the sender gave.
  PeerId peer = in.from;
  if (!in.msg.reply_address.empty()) {
    auto p = peer_for(d, in.msg.reply_address);
    if (!p.ok()) {
      reject(in.via, in.from, in.msg.token, RejectReason::kNoResources);
      return p.status();
    }
    peer = p.value();
  } else if (in.via != d) {
    reject(in.via, in.from, in.msg.token, RejectReason::kNoListener);
    return bad("accept: a CONNECT without a reply address came through another device");
  }
  auto id = alloc_comm_id(d);
  if (!id.ok()) {
    reject(in.via, in.from, in.msg.token, RejectReason::kNoResources);
    return id.status();
  }
  auto* c = new RecvComm;
  c->magic = kMagicRecv;
  c->dev = d;
  c->peer = peer;
  c->comm_id = id.value();
  c->remote_comm_id = in.msg.sender_comm_id;
  c->fifo = in.msg.fifo;
  d->comms.insert(c);
  for (int i = 0; i < kMaxRequests; ++i) {
    c->reqs[i].type = ReqType::kRecv;
    c->reqs[i].comm = c;
    c->flushes[i].type = ReqType::kFlush;
    c->flushes[i].comm = c;
  }
  Status st = register_own(d, c, c->records);
  if (st.ok()) st = register_own(d, c, c->cts);
  if (st.ok()) st = register_own(d, c, c->flush_buf);
  if (!st.ok()) {
    retire_comm(d, c);
    reject(in.via, in.from, in.msg.token, RejectReason::kNoResources);
    return st;
  }
  AcceptMsg m;
  m.token = in.msg.token;
  m.receiver_comm_id = id.value();
  m.records = c->mrs[0].remote();
  auto len = encode_accept(m, l->accept_msg);
  if (!len.ok()) {
    retire_comm(d, c);
    return len.status();
  }
  l->accept_len = len.value();
  st = send_ctrl(d, c->peer, l->accept_msg, l->accept_len);
  if (st.code() == Code::kAgain) {
    l->accepting = c;
    return Status::Ok();
  }
  if (!st.ok()) {
    retire_comm(d, c);
    return st;
  }
  *recv_comm = c;
  return Status::Ok();
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
  c->dirty = c->dirty || c->head_n >= 0 || c->inflight.load() != 0;
  retire_comm(d, c);
  return Status::Ok();
}

Status close_recv(void* recv_comm) {
  RecvComm* c = as_recv(recv_comm);
  if (!c) return bad("closeRecv: not a recv comm");
  Device* d = c->dev;
  std::lock_guard<std::mutex> lock(d->mu);
  for (const RecvRequest& r : c->reqs) c->dirty = c->dirty || r.in_use;
  c->dirty = c->dirty || c->inflight.load() != 0;
  retire_comm(d, c);
  return Status::Ok();
}

// ---- registration -----------------------------------------------------------------------------

Status reg_mr(void* comm, void* data, size_t size, int type, void** mhandle) {
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
  auto mr = d->engine->register_memory(d->group, reinterpret_cast<void*>(start), m->len, kind);
  if (!mr.ok()) return mr.status();
  m->mr = mr.value();
  m->remote = m->mr.remote();
  m->remote_bytes = m->remote.encode();
  m->refs = 1;
  d->mrs.push_back(m.get());
  *mhandle = m.release();
  return Status::Ok();
}

Status dereg_mr(void* /*comm: may be closed already; the handle knows its device*/, void* mhandle) {
  auto* m = static_cast<MrEntry*>(mhandle);
  if (tag_at(m) != kMagicMr) return bad("deregMr: not a memory handle");
  Device* d = m->dev;
  std::lock_guard<std::mutex> lock(d->mu);
  if (--m->refs > 0) return Status::Ok();
  for (size_t i = 0; i < d->mrs.size(); ++i) {
    if (d->mrs[i] == m) {
      d->mrs[i] = d->mrs.back();
      d->mrs.pop_back();
      break;
    }
  }
  Status st = d->engine ? d->engine->deregister(m->mr) : Status::Ok();
  m->magic = kMagicFreed;
  delete m;
  return st;
}

// ---- data path --------------------------------------------------------------------------------

namespace {

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

uint32_t cts_imms(Engine& e, const CommBase* c) {
  const uint32_t n = e.imms_per_write(Device::group, c->peer, kCtsSlotBytes);
  return n ? n : 1;
}

Status post_record(SendComm* c, SendRequest* r) {
  Device* d = c->dev;
  LocalSlice src{&c->mrs[1], static_cast<size_t>(r->index) * kRecordBytes, kRecordBytes};
  r->pending.fetch_add(1, std::memory_order_relaxed);
  c->inflight.fetch_add(1, std::memory_order_relaxed);
  Status st = d->engine->write_imm(d->group, c->peer, src, c->records, r->record_dst_offset,
                                   r->record_imm, Notify{&op_done, r});
  if (!st.ok()) {
    r->pending.fetch_sub(1, std::memory_order_relaxed);
    c->inflight.fetch_sub(1, std::memory_order_relaxed);
  }
  return st;
}

}  // namespace

Status isend(void* send_comm, void* data, size_t size, int tag, void* mhandle, void** request) {
  if (!request) return bad("isend: NULL request");
  *request = nullptr;
  SendComm* c = as_send(send_comm);
  if (!c) return bad("isend: not a send comm");
  Device* d = c->dev;
  Engine& e = *d->engine;
  if (e.peer_dead(d->group, c->peer))
    return Status(Code::kPeerDead, "isend: the receiving peer is dead or unreachable");

  const uint32_t cts_value = imm_value(false, c->comm_id, c->head);
  if (c->head_n < 0) {  // wait for the receiver's CTS for request `head`
    const uint32_t need = cts_imms(e, c);
    if (e.imm_arrived(d->group, cts_value) < need) return Status::Ok();
    const uint8_t* slot = c->fifo.ptr + (c->head % kMaxRequests) * kCtsSlotBytes;
    auto n = decode_cts_header(slot, static_cast<uint32_t>(c->head));
    if (!n.ok()) return Status(Code::kTransport, "isend: corrupt CTS: %s", n.status().message());
    for (int i = 0; i < n.value(); ++i) {
      Status st = decode_cts_elem(slot, i, &c->elems[i], &c->regions[i]);
      if (!st.ok()) return Status(Code::kTransport, "isend: corrupt CTS: %s", st.message());
    }
    c->head_n = n.value();
    c->matched = 0;
  }
  int i = 0;
  for (; i < c->head_n; ++i)
    if (!(c->matched & (1u << i)) && c->elems[i].tag == tag) break;
  if (i == c->head_n) return Status::Ok();  // the receiver has not posted this tag yet
  if (c->free_count == 0) return Status::Ok();

  const size_t len = std::min<uint64_t>(size, c->elems[i].size);  // a larger send is truncated
  const MrEntry* m = nullptr;
  if (len > 0) PONTE_RETURN_IF_ERROR(check_mr(d, mhandle, data, len, &m));

  SendRequest* r = &c->reqs[c->free_list[c->free_count - 1]];
  r->error.store(0, std::memory_order_relaxed);
  r->pending.store(0, std::memory_order_relaxed);
  r->size = len;
  r->dst = c->regions[i];
  r->record_unsubmitted = false;
  r->record_dst_offset = ((c->head % kMaxRequests) * kMaxRecvs + i) * kRecordBytes;
  r->record_imm = imm_value(true, c->remote_comm_id, c->head);
  SizeRecord rec;
  rec.size = len;
  rec.shards = len ? e.imms_per_write(d->group, c->peer, len) : 0;
  rec.request_number = static_cast<uint32_t>(c->head);
  encode_record(rec, c->outbox.ptr + static_cast<size_t>(r->index) * kRecordBytes);

  if (len > 0) {
    const uint32_t data_imm = imm_value(false, c->remote_comm_id, c->head);
    LocalSlice src{&m->mr, reinterpret_cast<uintptr_t>(data) - m->start, len};
    r->pending.store(1, std::memory_order_relaxed);
    c->inflight.fetch_add(1, std::memory_order_relaxed);
    Status st = e.write_imm(d->group, c->peer, src, r->dst, c->elems[i].offset, data_imm,
                            Notify{&op_done, r});
    if (!st.ok()) {
      r->pending.store(0, std::memory_order_relaxed);
      c->inflight.fetch_sub(1, std::memory_order_relaxed);
      if (st.code() == Code::kAgain) return Status::Ok();  // engine queue full: NCCL retries
      return st;
    }
  }
  Status st = post_record(c, r);
  if (st.code() == Code::kAgain) {
    r->record_unsubmitted = true;  // test() posts it
  } else if (!st.ok()) {
    note_error(r, st);
  }
  --c->free_count;
  r->in_use = true;
  c->matched |= 1u << i;
  if (std::popcount(c->matched) == c->head_n) {  // every buffer of this CTS has its send
    e.consume_imm(d->group, cts_value, cts_imms(e, c));
    ++c->head;
    c->head_n = -1;
  }
  *request = r;
  return Status::Ok();
}

Status irecv(void* recv_comm, int n, void** data, const size_t* sizes, const int* tags,
             void** mhandles, void** request) {
  if (!request) return bad("irecv: NULL request");
  *request = nullptr;
  RecvComm* c = as_recv(recv_comm);
  if (!c) return bad("irecv: not a recv comm");
  if (n < 1 || n > kMaxRecvs)
    return Status(Code::kInvalidArgument, "irecv: %d buffers, must be 1..%d", n, kMaxRecvs);
  if (!data || !sizes || !mhandles) return bad("irecv: NULL array");
  Device* d = c->dev;
  Engine& e = *d->engine;
  if (e.peer_dead(d->group, c->peer))
    return Status(Code::kPeerDead, "irecv: the sending peer is dead or unreachable");
  const uint64_t number = c->next;
  const size_t slot = number % kMaxRequests;
  RecvRequest* r = &c->reqs[slot];
  if (r->in_use) return Status::Ok();  // 32 requests in flight: NCCL retries

  CtsElem elems[kMaxRecvs];
  for (int i = 0; i < n; ++i) {
    elems[i].tag = tags ? tags[i] : 0;
    elems[i].size = sizes[i];
    if (sizes[i] == 0) continue;  // nothing can land: no region needed (NCCL may pass NULLs)
    const MrEntry* m = nullptr;
    PONTE_RETURN_IF_ERROR(check_mr(d, mhandles[i], data[i], sizes[i], &m));
    elems[i].offset = reinterpret_cast<uintptr_t>(data[i]) - m->start;
    elems[i].region = m->remote_bytes;
  }
  uint8_t* out = c->cts.ptr + slot * kCtsSlotBytes;
  PONTE_RETURN_IF_ERROR(
      encode_cts(static_cast<uint32_t>(number), std::span<const CtsElem>(elems, n), out));

  r->error.store(0, std::memory_order_relaxed);
  r->pending.store(1, std::memory_order_relaxed);
  r->number = number;
  r->n = n;
  r->data_imm = imm_value(false, c->comm_id, number);
  r->record_imm = imm_value(true, c->comm_id, number);
  r->records_read = false;
  r->shards = 0;
  for (int i = 0; i < n; ++i) r->posted[i] = sizes[i];
  c->inflight.fetch_add(1, std::memory_order_relaxed);
  LocalSlice src{&c->mrs[1], slot * kCtsSlotBytes, kCtsSlotBytes};
  Status st = e.write_imm(d->group, c->peer, src, c->fifo, slot * kCtsSlotBytes,
                          imm_value(false, c->remote_comm_id, number),
                          Notify{&op_done, r});
  if (!st.ok()) {
    r->pending.store(0, std::memory_order_relaxed);
    c->inflight.fetch_sub(1, std::memory_order_relaxed);
    if (st.code() == Code::kAgain) return Status::Ok();
    return st;
  }
  r->in_use = true;
  ++c->next;
  *request = r;
  return Status::Ok();
}

Status iflush(void* recv_comm, int n, void** data, const int* sizes, void** mhandles,
              void** request) {
  if (!request) return bad("iflush: NULL request");
  *request = nullptr;
  RecvComm* c = as_recv(recv_comm);
  if (!c) return bad("iflush: not a recv comm");
  if (n < 1 || n > kMaxRecvs || !data || !sizes || !mhandles) return bad("iflush: bad arguments");
  // Only data written by the NIC into GPU memory needs a flush: a read from the NIC after the
  // writes makes them visible to the GPU. Host memory is coherent already.
  int last = -1;
  for (int i = 0; i < n; ++i) {
    auto* m = static_cast<const MrEntry*>(mhandles[i]);
    if (sizes[i] > 0 && tag_at(m) == kMagicMr && m->kind == MemKind::kCuda) last = i;
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
  if (!d->has_self.load(std::memory_order_acquire)) {  // first flush: a peer for our own group
    std::lock_guard<std::mutex> lock(d->mu);
    if (!d->has_self.load(std::memory_order_relaxed)) {
      auto p = d->engine->connect(d->group, d->engine->address(d->group));
      if (!p.ok()) return p.status();
      d->self_peer = p.value();
      d->has_self.store(true, std::memory_order_release);
    }
  }
  const PeerId self = d->self_peer;
  const size_t len = std::min<size_t>(static_cast<size_t>(sizes[last]), 4);
  const size_t off = reinterpret_cast<uintptr_t>(data[last]) - m->start + sizes[last] - len;
  f->error.store(0, std::memory_order_relaxed);
  f->pending.store(1, std::memory_order_relaxed);
  c->inflight.fetch_add(1, std::memory_order_relaxed);
  Status st = d->engine->read(d->group, self, LocalSlice{&c->mrs[2], 0, len}, m->remote, off,
                              Notify{&op_done, f});
  if (!st.ok()) {
    f->pending.store(0, std::memory_order_relaxed);
    c->inflight.fetch_sub(1, std::memory_order_relaxed);
    if (st.code() == Code::kAgain) return Status::Ok();
    return st;
  }
  f->in_use = true;
  *request = f;
  return Status::Ok();
}

Status test(void* request, int* done, size_t* sizes, int* count) {
  if (!done) return bad("test: NULL done");
  *done = 0;
  if (count) *count = 0;
  auto* r = static_cast<Request*>(request);
  if (tag_at(r) != kMagicReq || !r->in_use) return bad("test: not an outstanding request");
  CommBase* c = r->comm;
  Device* d = c->dev;
  Engine& e = *d->engine;

  auto finish = [&](const Status& st) {
    r->in_use = false;
    if (r->type == ReqType::kSend) {
      auto* s = static_cast<SendComm*>(c);
      s->free_list[s->free_count++] = static_cast<SendRequest*>(r)->index;
    }
    return st;
  };

  if (r->error.load(std::memory_order_acquire) != 0) {
    // Keep the request until the engine has ended every operation it started for it.
    if (r->pending.load(std::memory_order_acquire) != 0) return Status::Ok();
    return finish(request_error(r));
  }

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
      if (!q->records_read) {
        if (e.imm_arrived(d->group, q->record_imm) < static_cast<uint32_t>(q->n)) {
          if (e.peer_dead(d->group, c->peer)) {
            note_error(q, Status(Code::kPeerDead, "peer dead"));
            if (q->pending.load(std::memory_order_acquire) == 0) return finish(request_error(q));
          }
          return Status::Ok();
        }
        uint32_t shards = 0;
        const uint8_t* base =
            rc->records.ptr + (q->number % kMaxRequests) * kMaxRecvs * kRecordBytes;
        for (int i = 0; i < q->n; ++i) {
          auto rec = decode_record(base + static_cast<size_t>(i) * kRecordBytes);
          if (!rec.ok() || rec->request_number != static_cast<uint32_t>(q->number) ||
              rec->size > q->posted[i]) {
            note_error(q, Status(Code::kTransport, "corrupt size record"));
            return Status::Ok();
          }
          q->received[i] = rec->size;
          shards += rec->shards;
        }
        q->shards = shards;
        q->records_read = true;
      }
      if (q->shards > 0 && e.imm_arrived(d->group, q->data_imm) < q->shards) {
        if (e.peer_dead(d->group, c->peer)) {
          note_error(q, Status(Code::kPeerDead, "peer dead"));
          if (q->pending.load(std::memory_order_acquire) == 0) return finish(request_error(q));
        }
        return Status::Ok();
      }
      if (q->pending.load(std::memory_order_acquire) != 0) return Status::Ok();
      e.consume_imm(d->group, q->record_imm, static_cast<uint32_t>(q->n));
      if (q->shards) e.consume_imm(d->group, q->data_imm, q->shards);
      *done = 1;
      for (int i = 0; i < q->n; ++i)
        if (sizes) sizes[i] = q->received[i];
      if (count) *count = q->n;
      return finish(Status::Ok());
    }
  }
  return Status(Code::kInternal, "test: unknown request type");
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
