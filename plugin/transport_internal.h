// The plugin transport's private declarations, shared by its parts: devices and engines, comms,
// requests, registrations, and the helpers every part uses. Not installed, not part of the ABI.
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
// for that many data immediates. A message that fills a one-buffer receive in one write carries
// the record immediate itself, and no record follows (the slot stays blank: wire.h).
//
// Handshakes are retried: connect() sends CONNECT again when its send failed and, while no answer
// came, every kConnectResendMs (doubling to kConnectResendMaxMs); the listening side knows every
// token it has seen, ignores a repeat while the first is queued and sends the ACCEPT again when it
// was already accepted (an ACCEPT lost in a connection rebuild). A dead peer ends the connect.
//
// Comm pairs: the send comm and recv comm made by one CONNECT / ACCEPT share its token. Every
// comm of a device pair shares one engine peer, so a rebuilt connection (Engine::peer_epoch) can
// lose what some comms had in flight; the rules that keep every request either complete with its
// data or ended with an error, never early and never forever, and keep a close from breaking a
// neighbour:
//   - A request that fails marks its comm broken: every later call on it fails at once (its
//     slots' immediate counts can no longer be trusted, its id is quarantined on close), and the
//     other end hears NOTICE BROKEN and breaks too.
//   - deregMr of a buffer that a posted receive exposes to the sender (NCCL's abort) breaks that
//     receive's comm first and waits (at most PONTE_TIMEOUT_MS) for the sender's ACK: a write into
//     memory deregistered under it would break the connection every comm shares (an RC QP in
//     error, tcp's dropped connection).
//   - Either end that hears BROKEN or CLOSED starts no write toward the other end any more and
//     answers ACK once its writes in flight have ended.
//   - A receive posted before a rebuild that still lacks data once the peer is ready again (no
//     write of the older connection can land after that) failed: it was lost with the connection.
//   - Comms with nothing in flight at a rebuild carry on untouched.
//   - Closing: once the comm's operations have ended it sends NOTICE CLOSED (how many requests it
//     started, whether all went well) and keeps its FIFO / record buffers registered until the
//     other end answers CLOSE_ACK (it writes into them no more), closes too, dies, or
//     PONTE_TIMEOUT_MS passes. The other end refuses new requests at once and fails those of its
//     receives whose data the closed sender never sent.
#pragma once

#include <sys/mman.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "core/engine.h"
#include "plugin/transport.h"
#include "plugin/wire.h"

namespace ponte::plugin {

using Clock = std::chrono::steady_clock;

constexpr uint32_t kMagicListen = 0x706c736e;  // object tags, checked on every entry point
constexpr uint32_t kMagicSend = 0x70736e64;
constexpr uint32_t kMagicRecv = 0x70726376;
constexpr uint32_t kMagicMr = 0x706d7220;
constexpr uint32_t kMagicReq = 0x70726571;
constexpr uint32_t kMagicFreed = 0xdeadc0de;

constexpr size_t kPage = 4096;
constexpr int kCtrlSlots = 64;  // control message buffers per device
constexpr int kConnectResendMs = 200;      // CONNECT again when no answer came within this
constexpr int kConnectResendMaxMs = 2000;  // doubling up to this
constexpr int kSendRequests = kMaxRequests * kMaxRecvs;

// Page-aligned, zeroed host memory for the protocol's own registered buffers.
struct HostBuffer {
  uint8_t* ptr = nullptr;
  size_t len = 0;
  HostBuffer() = default;
  // Zeroed pages from the kernel, touched only when used: a comm's inline slots cost no memory
  // until small messages flow (4096 comms on a device would otherwise hold 1 GiB).
  explicit HostBuffer(size_t n) : len((n + kPage - 1) / kPage * kPage) {
    void* p = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    ptr = p == MAP_FAILED ? nullptr : static_cast<uint8_t*>(p);
  }
  ~HostBuffer() {
    if (ptr) munmap(ptr, len);
  }
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
  // Engine operations reading or writing through mr right now (a send's data write, a flush's
  // read). deregMr waits for them: after it returns nothing touches the memory or this entry.
  mutable std::atomic<uint32_t> users{0};
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
  const MrEntry* held = nullptr;     // the registration its data operation uses (see MrEntry::users)
};

struct SendRequest : Request {
  int index = 0;  // in SendComm::reqs; also selects the size record's outbox slot
  size_t size = 0;
  RemoteRegion dst;  // kept alive for the engine until the writes complete
  bool record_unsubmitted = false;
  size_t record_src_offset = 0;  // in the outbox
  size_t record_len = 0;
  size_t record_dst_offset = 0;
  uint32_t record_imm = 0;
  int inline_slot = -1;  // the outbox inline slot its write copied into (SendComm::inline_user); -1: none
};

struct RecvRequest : Request {
  // While outstanding: the registrations its CTS exposed to the sender (deregMr looks for them).
  std::atomic<const MrEntry*> targets[kMaxRecvs] = {};
  uint64_t number = 0;
  uint32_t epoch = 0;  // the engine peer's rebuild count when posted (see "comm pairs")
  int n = 0;
  uint32_t data_imm = 0;
  uint32_t record_imm = 0;
  bool records_read = false;
  bool inline_data = false;  // its CTS offered the inline slot: the record is there
  void* inline_dst = nullptr;  // ... and data behind it (a record without shards) is copied here
  uint32_t shards = 0;
  bool whole = false;  // the data came without a record, filling the buffer (wire.h)
  int eager_buf = -1;  // the buffer an eager message (wire.h, eager slots) is for; -1: none came
  bool eager_copying = false;  // its data is being written into a non-host buffer (through a NIC)
  uint32_t cts_batch = 0;      // its CTS write carries the CTS of this many requests, from this one on
  void* dst[kMaxRecvs] = {};   // the buffers' addresses
  int32_t tags[kMaxRecvs] = {};
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
  std::atomic<uint32_t> callbacks{0};  // completion callbacks still touching the comm (op_done)
  bool dirty = false;                 // closed with requests outstanding
  bool is_send = false;
  std::vector<MemoryRegion> mrs;      // the protocol's own registrations

  // The pair (see "comm pairs" above). The NOTICE handler (an engine worker, under Inbox::mu)
  // writes the atomics; the thread that drives the comm reads them.
  uint64_t token = 0;   // the CONNECT token both ends share
  bool paired = false;  // in Inbox::pairs: established, closes with NOTICE CLOSED
  std::atomic<uint8_t> broken{0};      // a Code: why the pair can no longer be trusted; 0 = sound
  std::atomic<bool> broken_told{false};  // NOTICE BROKEN went to the other end
  std::atomic<bool> failed_any{false};   // some request of this comm failed
  std::atomic<bool> peer_stop{false};    // BROKEN or CLOSED arrived: write nothing more there
  std::atomic<bool> peer_closed{false};  // NOTICE CLOSED arrived
  bool peer_clean = false;               // ... every operation of the other end had ended well
  uint64_t peer_count = 0;               // ... after starting this many requests
  Clock::time_point peer_closed_at;      // ... when (a receive still short waits this + timeout)
  std::atomic<bool> ack_sent{false};     // our ACK to peer_stop went (or is being sent)
  std::atomic<bool> acked{false};        // the other end's ACK arrived: it writes here no more
  bool ack_given_up = false;             // a deregMr waited PONTE_TIMEOUT_MS for that ACK in vain
  bool closed_sent = false;              // closed, and NOTICE CLOSED sent
  Clock::time_point close_deadline;      // closed: free the buffers by then in any case
};

struct SendComm : CommBase {
  HostBuffer fifo{kFifoBytes};                              // CTS slots, written by the receiver
  // Size records to write (one per request), then one inline slot per CTS slot (record + data).
  HostBuffer outbox{kSendRequests * kRecordBytes + kInlineArea};
  // Per CTS slot: the request whose inline write last used that outbox slot (-1: none), which
  // must have ended before the slot is filled again. Cleared when that request is handed back
  // (test), so that the index, reused by a later request, never stands for the slot's user.
  int inline_user[kMaxRequests];
  RemoteRegion records;                                     // the receiver's record area
  uint64_t head = 0;                                        // request number being matched
  int head_n = -1;                                          // buffers in that CTS; -1 = not read
  uint32_t matched = 0;                                     // its buffers already sent to
  // Eager (plugin/README.md): a message for `head` sent before its CTS was read. The CTS read
  // last predicts the next receive: one host buffer offering inline, of elems[0]'s size and tag
  // (elems holds the CTS read last until the next one is read).
  bool eager_pending = false;                               // sent for head; CTS head not read yet
  int32_t eager_tag = 0;
  bool last_cts_one_host = false;
  uint32_t last_cts_oldest = 0;                             // its oldest open request (low 32 bits)
  CtsElem elems[kMaxRecvs];
  RemoteRegion regions[kMaxRecvs];
  uint8_t cts_copy[kCtsSlotBytes];                          // the CTS read_cts took whole
  std::unique_ptr<SendRequest[]> reqs{new SendRequest[kSendRequests]};
  int free_list[kSendRequests];
  int free_count = 0;
};

struct RecvComm : CommBase {
  HostBuffer records{kRecordRegionBytes};  // size records, inline and eager slots, by the sender
  HostBuffer cts{kFifoBytes};       // CTS slots to write into the sender's FIFO
  HostBuffer flush_buf{kPage};      // target of flush reads
  RemoteRegion fifo;                // the sender's FIFO
  uint64_t next = 0;                // next request number
  uint64_t oldest = 0;              // no request before this one is still open (CTS oldest_open)
  uint64_t cts_sent = 0;            // requests before this one had their CTS written (or need none);
                                    // the CTS of later ones is held (PONTE_NET_CTS_AHEAD)
  bool tested = false;              // a receive of c was tested since the last irecv
  // Held CTS and a caller that waits elsewhere (scan_held_cts): the thread that drives c (its
  // irecv / test / closeRecv calls; a driver_id), changed only with driver_busy taken, which a
  // scan of that thread also takes while it writes c's held CTS. held_mark: cts_sent when that
  // thread's last scan found c's CTS held (~0: not held then).
  std::atomic<uint64_t> driver{0};
  std::atomic<bool> driver_busy{false};
  uint64_t held_mark = ~0ull;
  RecvRequest reqs[kMaxRequests];
  Request flushes[kMaxRequests];
  uint8_t accept_msg[kMaxMsgSize];  // the ACCEPT that made it: sent again to a repeated CONNECT
  size_t accept_len = 0;
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
  std::unordered_set<uint64_t> seen;  // every CONNECT token queued here (Inbox::mu): repeats are dropped
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
  Clock::time_point resend_at;                  // kWaiting: CONNECT again from then on
  int resend_ms = kConnectResendMs;
  bool bootstrap = false;  // the listener answers from its own group: the data peer is accept_from
  AcceptMsg accept;
  PeerId accept_from = 0;
  RejectReason reason = RejectReason::kNoListener;
};

// ---- devices ----------------------------------------------------------------------------------

struct CtrlSlot {
  Device* dev = nullptr;
  int index = 0;
  std::atomic<uint64_t> connect_token{0};  // a CONNECT: its send failing makes connect() send again
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
  // Established comms by token, [0] recv comms, [1] send comms: NOTICEs and repeated CONNECTs
  // find them here. A comm leaves before it is freed (unpair_comm).
  std::unordered_map<uint64_t, CommBase*> pairs[2];
};

// Never destroyed: handlers may run during unload.
Inbox& inbox();

struct Plugin {
  std::mutex mu;  // refs, probing, the device table
  int refs = 0;
  bool probed = false;
  BackendKind backend = BackendKind::kFabric;
  std::vector<NicInfo> nics;
  std::vector<std::unique_ptr<Device>> devices;
};

// Torn down explicitly (release / unload), never destroyed.
Plugin& plugin();

// ---- small helpers ----------------------------------------------------------------------------

// The object tag at the start of what NCCL hands back (every tagged object has it first), read
// without assuming that the pointer names such an object or is aligned for one.
inline uint32_t tag_at(const void* p) {
  uint32_t t = 0;
  if (p) std::memcpy(&t, p, sizeof(t));
  return t;
}

inline SendComm* as_send(void* p) {
  return tag_at(p) == kMagicSend ? static_cast<SendComm*>(static_cast<CommBase*>(p)) : nullptr;
}
inline RecvComm* as_recv(void* p) {
  return tag_at(p) == kMagicRecv ? static_cast<RecvComm*>(static_cast<CommBase*>(p)) : nullptr;
}
inline CommBase* as_comm(void* p) {
  const uint32_t t = tag_at(p);
  return t == kMagicSend || t == kMagicRecv ? static_cast<CommBase*>(p) : nullptr;
}

inline Status bad(const char* what) { return Status(Code::kInvalidArgument, "%s", what); }

// ---- defined in transport_connect.cc --------------------------------------------------------------

// Sends a control message (copied into a registered buffer) to peer. kAgain: no buffer free.
// With connect_token, a failed send sets that pending connect back to sending.
Status send_ctrl(Device* d, PeerId peer, const uint8_t* msg, size_t len, uint64_t connect_token = 0);
// Sends a NOTICE to the other end of c's pair.
Status send_notice(CommBase* c, NoticeWhat what, bool clean = false, uint64_t count = 0);
// An ACK (the answer to a BROKEN or CLOSED for the pair token) to peer; kAgain: no control buffer
// free (or PONTE_FAULT_BUSY_ACKS held it back): the ACK is still owed.
Status send_ack(Device* d, PeerId peer, uint64_t token, bool to_send);
// Marks c's pair broken with code (first cause wins) and tells the other end (once; retried by
// later calls while no control buffer is free). Under d->mu or on the thread that drives c.
void break_comm(CommBase* c, Code code);
// Enters c into / takes it out of Inbox::pairs (takes Inbox::mu).
void pair_comm(CommBase* c);
void unpair_comm(CommBase* c);
// Sends the ACK that a BROKEN or CLOSED from the other end asks for, once c's operations have
// ended, unless it went already (the NOTICE handler answers at once when none were in flight).
void answer_stop(CommBase* c);
// Answers a CONNECT with REJECT (logged when it cannot be sent).
void reject(Device* d, PeerId to, uint64_t token, RejectReason why);
// The engine's message handler (CONNECT / ACCEPT / REJECT), on the engine's worker thread.
void on_message(void* arg, PeerId from, std::span<const uint8_t> data);

// ---- defined in transport_devices.cc -------------------------------------------------------------

// Builds the device's engine (one group over its NICs) on first use. Call with d->mu held.
Status ensure_engine(Device* d);
Result<Device*> device_at(int dev);
// Closing the engines at exit must happen before the engine's own statics go away.
void register_exit_teardown();

// ---- defined in transport_data.cc -----------------------------------------------------------------

// Makes the calling thread c's driver (on entry to irecv, a receive's test and closeRecv): a
// pointer compare when it is already; else waits out a scan that is writing c's held CTS.
void drive(RecvComm* c);

// ---- defined in transport_teardown.cc ------------------------------------------------------------

void delete_comm(CommBase* c);
// Frees a comm whose operations have all ended. Call with d->mu held.
void destroy_comm(Device* d, CommBase* c);
void reap_graveyard(Device* d);
// Closes a comm: now when nothing is in flight, else once the engine has ended its operations.
void retire_comm(Device* d, CommBase* c);
void teardown_device(Device* d);
// Takes the device table out (under p.mu): the next acquire probes afresh.
std::vector<std::unique_ptr<Device>> take_devices_locked(Plugin& p);
void teardown_all();

}  // namespace ponte::plugin
