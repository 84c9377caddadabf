// The one narrow backend interface: a Backend lists NICs and opens them; a Nic registers memory,
// posts RDMA operations and reports completions. core/fabric and core/verbs mirror each other.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/status.h"

namespace ponte {

struct Config;

enum class BackendKind : uint8_t { kFabric = 1, kVerbs = 2 };
const char* backend_name(BackendKind k);

// What the engine and topology need to know about one NIC (a libfabric domain or a verbs port).
struct NicInfo {
  std::string name;        // "mlx5_0:1", "rdmap16s27", "lo": for logs only, never for matching
  std::string pci_bus_id;  // "0000:43:00.0" lowercase, empty when the NIC has no PCI device
  std::string provider;    // "tcp;ofi_rxm", "efa", "verbs"
  uint64_t speed_mbps = 0;       // link speed, 0 when unknown (loopback)
  size_t max_msg_size = 0;       // largest single write/send/read
  size_t max_inline = 0;         // payloads up to this size may be sent inline
  bool virt_addr = true;         // peers address this NIC's memory by virtual address (else offset)
  bool device_memory = false;    // can register CUDA memory (FI_HMEM, dmabuf or peermem)
  bool dmabuf = false;           // registers CUDA memory through dmabuf
  // Each write lands in order per aligned 128-byte line, so NCCL's LL128 lines arrive whole
  // (verbs RC; EFA once FI_OPT_EFA_WRITE_IN_ORDER_ALIGNED_128_BYTES is granted on the endpoint).
  bool write_ordered_128 = false;
  // A post can wait, without bound, on the peer process itself (libfabric's shm takes a lock in
  // the peer's shared memory): only the group's worker posts then, never a polling thread.
  bool post_may_block_on_peer = false;
  // fi_trywait resets the CQ's wait object, so that an idle worker may sleep on it
  // (PONTE_IDLE_WAKE, Nic::wait_fd); where it does not, the object stays readable after the first
  // completion and every sleep on it ends at once.
  bool cq_wait_resets = false;
};

enum class MemKind : uint8_t { kHost = 0, kCuda = 1 };

struct MemoryDesc {
  void* addr = nullptr;
  size_t len = 0;
  MemKind kind = MemKind::kHost;
  int cuda_device = -1;
  int dmabuf_fd = -1;          // >= 0: register CUDA memory through this dmabuf
  uint64_t dmabuf_offset = 0;
};

// A registration on one NIC.
struct NicMr {
  void* handle = nullptr;    // backend object (fid_mr*, ibv_mr*)
  void* desc = nullptr;      // local descriptor passed back in posts
  uint64_t rkey = 0;         // key the peer uses to reach this memory
  uint64_t remote_base = 0;  // address the peer uses for byte 0 (addr, or 0 for offset addressing)
};

using NicPeer = uint32_t;  // backend-local peer index, dense from 0

enum class CompletionKind : uint8_t {
  kLocal = 0,        // a posted write/read/send finished (or failed); ctx names it
  kRecv = 1,         // a posted receive got a message: ctx, len, imm (sender tag) valid
  kRemoteWrite = 2,  // a peer's write-with-immediate landed here: imm valid
};

struct Completion {
  uint64_t ctx = 0;
  uint32_t imm = 0;
  uint32_t len = 0;
  CompletionKind kind = CompletionKind::kLocal;
  Code error = Code::kOk;  // not kOk: the operation failed (ctx still names it)
  // With an error: it concerns this operation alone and the connection to the peer is intact (a
  // connectionless endpoint refusing one write: a bad key, a bad length). False: the connection
  // broke with it (an RC QP in error, a provider's lost connection) and must be rebuilt.
  bool op_only = false;
};

struct WriteWr {
  NicPeer peer = 0;
  const void* local = nullptr;
  size_t len = 0;
  void* desc = nullptr;  // NicMr::desc of the local registration (may be null when len == 0)
  uint64_t remote_addr = 0;
  uint64_t rkey = 0;
  uint32_t imm = 0;
  bool has_imm = false;
  // The local bytes are host memory the CPU may read: a backend may then copy a small payload into
  // the work request (verbs IBV_SEND_INLINE). False for GPU memory, where that copy would fault.
  bool inline_ok = false;
  uint64_t ctx = 0;
};

// One NIC: all methods except the destructor are called from one thread at a time (the owning
// NicGroup's worker). post_* never block and never allocate: kAgain means "queue full, poll and
// retry"; any other error is final for that post. NicGroup wraps each in core/watchdog.h's
// WatchedNic, which forwards every method: one added here must be forwarded there too.
class Nic {
 public:
  virtual ~Nic() = default;
  virtual const NicInfo& info() const = 0;
  // This NIC's endpoint address, sent to peers inside the group address.
  virtual std::span<const uint8_t> address() const = 0;

  // Peers. add_peer takes the peer NIC's address() bytes. connect_blob is what this side sends the
  // peer during the engine's handshake; complete_connect takes the peer's blob. A backend whose
  // endpoints are connectionless returns an empty blob and ignores the peer's.
  virtual Result<NicPeer> add_peer(std::span<const uint8_t> peer_address) = 0;
  virtual Result<std::vector<uint8_t>> connect_blob(NicPeer peer) = 0;
  virtual Status complete_connect(NicPeer peer, std::span<const uint8_t> peer_blob) = 0;
  // Operations still outstanding toward the peer complete with kCancelled at later polls.
  virtual void remove_peer(NicPeer peer) = 0;
  // The traffic class (RoCE: the IP header's DSCP/ECN byte) of the connection to peer, before its
  // connect_blob: verbs QPs send in it and ask the peer's side to do the same. Backends without
  // per-peer classes ignore it.
  virtual Status set_traffic_class(NicPeer peer, uint8_t traffic_class) {
    (void)peer;
    (void)traffic_class;
    return Status::Ok();
  }

  virtual Result<NicMr> register_memory(const MemoryDesc& mem) = 0;
  virtual void deregister(const NicMr& mr) = 0;

  virtual Status post_write(const WriteWr& wr) = 0;
  virtual Status post_read(NicPeer peer, void* local, size_t len, void* desc, uint64_t remote_addr,
                           uint64_t rkey, uint64_t ctx) = 0;
  // A two-sided send; imm travels with it and comes out of the receiver's kRecv completion.
  // inline_ok as in WriteWr: buf is host memory.
  virtual Status post_send(NicPeer peer, const void* buf, size_t len, void* desc, uint32_t imm,
                           uint64_t ctx, bool inline_ok) = 0;
  virtual Status post_recv(void* buf, size_t len, void* desc, uint64_t ctx) = 0;
  // Puts on the wire what the posts since the last call staged (a backend may gather a pass's
  // posts and hand them over together: verbs chains each QP's work requests behind one doorbell).
  // The engine calls it after each of its posting passes; poll() does it first too.
  virtual void flush_posts() {}

  // Reads up to max completions into out; returns how many, never blocks.
  virtual int poll(Completion* out, int max) = 0;

  // A file descriptor that turns readable when traffic arrives for this NIC while nobody polls it
  // (the provider's wait object), or -1 (none; or none needed: the hardware moves the data).
  // A manual-progress provider (tcp;ofi_rxm) moves incoming data only inside a poll, so an idle
  // worker sleeps on it instead of sleeping blind.
  virtual int wait_fd() const { return -1; }
  // Before sleeping on wait_fd(): whether the sleep may start now (fi_trywait: nothing is pending
  // that a poll would find, and the wait object is reset). False: poll first. Never blocks.
  virtual bool arm_wait() { return false; }
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual BackendKind kind() const = 0;
  // The NICs this host offers through this backend (after filters such as PONTE_IB_HCA).
  virtual const std::vector<NicInfo>& devices() const = 0;
  // Opens device i; opening one device twice gives two independent NICs (used on loopback to
  // stand for a multi-NIC host).
  virtual Result<std::unique_ptr<Nic>> open_nic(size_t device_index) = 0;
};

// Implemented by core/fabric and core/verbs. kUnavailable when the library or a device is absent.
Result<std::unique_ptr<Backend>> open_fabric_backend(const Config& cfg);
Result<std::unique_ptr<Backend>> open_verbs_backend(const Config& cfg);

}  // namespace ponte
