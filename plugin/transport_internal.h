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
// for that many data immediates.
#pragma once

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
constexpr int kSendRequests = kMaxRequests * kMaxRecvs;

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
Status send_ctrl(Device* d, PeerId peer, const uint8_t* msg, size_t len);
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
