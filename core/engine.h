// Engine: ponte's public RDMA API. It owns NIC groups (all NICs serving one GPU, or host memory),
// registers memory on every NIC of a group, and runs asynchronous transfers on each group's worker.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/config.h"
#include "core/nic.h"
#include "core/notify.h"
#include "core/remote_region.h"
#include "core/status.h"

namespace ponte {

class NicGroup;

using PeerId = uint32_t;  // a remote group as one local group knows it; dense from 0 per group
constexpr PeerId kAnyPeer = 0xffffffffu;

// A local registration: one NicMr per NIC of the group. Keep it alive (and registered) until every
// operation that uses it has completed.
struct MemoryRegion {
  void* addr = nullptr;
  size_t len = 0;
  int group = -1;
  MemKind kind = MemKind::kHost;  // GPU memory is never read by the CPU (no inline sends from it)
  uint64_t id = 0;  // engine-unique, 0 = invalid
  std::vector<NicMr> nic_mrs;
  // What a peer needs to write/read this memory; send its bytes (RemoteRegion::encode) out of band.
  RemoteRegion remote() const;
};

// A slice of local registered memory.
struct LocalSlice {
  const MemoryRegion* mr = nullptr;
  size_t offset = 0;
  size_t len = 0;
};

struct ScatterTarget {
  PeerId peer = 0;
  size_t src_offset = 0;  // within the scatter's source region
  size_t len = 0;
  const RemoteRegion* dst = nullptr;
  size_t dst_offset = 0;
};

// Per-connection settings of Engine::connect.
struct ConnectOptions {
  // Traffic class (0..255; RoCE: the IP header's DSCP/ECN byte) of the connection's verbs QPs, as
  // NCCL v11 hands a plugin one per communicator: both ends send in it (the accepting end takes it
  // from the handshake, as NCCL's receiver does). -1: PONTE_IB_TC. Ignored by the libfabric
  // backend, whose class (FI_TC) belongs to an endpoint, not to a peer.
  int traffic_class = -1;
};

// Called for every two-sided message on the thread that progresses the group (its worker, or one
// inside Engine::progress): the data is valid only during the call. Keep it short; it may submit.
using RecvHandler = void (*)(void* arg, PeerId from, std::span<const uint8_t> data);

struct EngineOptions {
  Config config = global_config();
  // Groups to build. Empty: one host-memory group over config.nics_per_group NICs (all when 0).
  // Each entry lists device indexes of the backend (repeating an index opens that device again).
  std::vector<std::vector<size_t>> groups;
  std::vector<std::vector<int>> group_cores;  // pin group i's worker to these cores (optional; each usable here)
  // With groups empty: true builds one group per GPU from the topology (hwloc, or PONTE_TOPO_FILE),
  // each GPU's nearest NICs matched by PCI bus id and its worker pinned near it; false (default)
  // one host-memory group.
  bool per_gpu_groups = false;
  // Immediate values below this are counted in a flat array per group (4 bytes each, any number
  // of them at once, never full) instead of the shared table of 57344 distinct values that never
  // forgets one. Poller view only (imm_arrived / consume_imm): expect_imm refuses them.
  uint32_t dense_imm_values = 0;
};

class Engine {
 public:
  static Result<std::unique_ptr<Engine>> create(EngineOptions opts = {});
  // Orderly shutdown: operations submitted before it run to their end (until 2 s pass without a
  // completion, or PONTE_TIMEOUT_MS if shorter, and PONTE_TIMEOUT_MS in all; the rest end with
  // kCancelled), counters still waiting end with
  // kCancelled, peers are told (they see their ops toward us end kPeerDead), registrations still
  // open are closed. Every callback has run when it returns. Submissions racing it get kCancelled.
  // An engine belongs to the process that created it: in a fork() child (its threads stayed in
  // the parent) every call fails with kUnavailable, and the destructor returns at once, leaving
  // what the parent still uses untouched. A child creates its own engine.
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  BackendKind backend() const;
  const std::vector<NicInfo>& devices() const;  // every NIC the backend offers
  int num_groups() const;
  int nics_in_group(int group) const;
  const NicInfo& nic_info(int group, int nic) const;
  // The PCI bus id of the GPU a group serves ("" for a host-memory group).
  std::string group_gpu(int group) const;

  // The group's address: versioned bytes a peer passes to connect().
  std::vector<uint8_t> address(int group) const;

  // Starts connecting group to the remote group at peer_address; never blocks. Operations to the
  // returned peer may be submitted at once: they wait until the handshake completes. A group that
  // connects to us appears through peers() / RecvHandler. A remote group is one peer per traffic
  // class, whichever end connected first: connecting to a group that is connected already (either
  // way) with the same class returns that peer; another class is another peer, at both ends. A
  // group connected to itself is two (the outbound and the inbound end).
  Result<PeerId> connect(int group, std::span<const uint8_t> peer_address, const ConnectOptions& options = {});
  // Whether the handshake with peer has completed (false when dead).
  bool peer_ready(int group, PeerId peer) const;
  // How many times the connection to peer was rebuilt (a new handshake round after it broke:
  // verbs QPs in error, a provider's lost connection). Operations in flight across a rebuild end
  // with an error (on verbs kTransport, the QP's flush; on libfabric kCancelled, the old round's
  // peer address removed under them), and what they carried may or may not have landed; once a
  // count has been read and peer_ready() is true again, nothing sent over the older connections
  // can still land.
  uint32_t peer_epoch(int group, PeerId peer) const;
  // Whether nothing more will come from peer: it died, or it closed its engine and the grace
  // for its last writes (250 ms, or PONTE_TIMEOUT_MS if shorter) has passed, or it stopped (its
  // worker answered nothing for PONTE_TIMEOUT_MS), or the group is wedged (group_status).
  // Operations toward a peer that closed are refused with kPeerDead at once.
  bool peer_dead(int group, PeerId peer) const;
  // OK, or why the group takes no more work: it is wedged (kUnavailable), a provider call made by
  // its worker (or by a thread inside progress()) did not return within PONTE_TIMEOUT_MS. Then
  // every operation and counter it held ended with an error, its peers are dead to it (and were
  // told), and each later call on it fails at once. Final: make a new Engine.
  Status group_status(int group) const;
  // Number of NICs that writes to this peer stripe over: min(local NICs, peer NICs); 0 until the
  // peer's address is known.
  int peer_nics(int group, PeerId peer) const;

  // Registers [addr, addr+len) on every NIC of the group (blocking; not for the hot path).
  // CUDA memory: cuda_device -1 asks the driver which device holds addr (libfabric's FI_HMEM
  // needs the real ordinal); dmabuf_fd >= 0 registers through that dmabuf (the caller's, e.g.
  // NCCL's regMrDmaBuf; dmabuf_offset is addr's offset in it), else one is exported for the range
  // when the driver can, else the NIC's peer-memory path is used.
  Result<MemoryRegion> register_memory(int group, void* addr, size_t len,
                                       MemKind kind = MemKind::kHost, int cuda_device = -1,
                                       int dmabuf_fd = -1, uint64_t dmabuf_offset = 0);
  Status deregister(MemoryRegion& mr);

  // ---- Operations. All asynchronous: Notify fires exactly once, with OK or the error, on the
  // thread that progresses the group: its worker, or a thread inside progress(). A non-OK return
  // means the op was rejected and Notify will not fire.
  // One-sided write of src to dst+dst_offset; with imm, every shard carries it (see
  // imms_per_write) so the target's ImmCounter learns when all of it landed.
  Status write(int group, PeerId peer, const LocalSlice& src, const RemoteRegion& dst,
               size_t dst_offset, const uint32_t* imm, Notify done);
  Status write(int group, PeerId peer, const LocalSlice& src, const RemoteRegion& dst,
               size_t dst_offset, Notify done) {
    return write(group, peer, src, dst, dst_offset, nullptr, done);
  }
  Status write_imm(int group, PeerId peer, const LocalSlice& src, const RemoteRegion& dst,
                   size_t dst_offset, uint32_t imm, Notify done) {
    return write(group, peer, src, dst, dst_offset, &imm, done);
  }
  // A write with imm that is never striped: one NIC, so exactly one immediate (unless longer than
  // the largest shard), whatever either end's PONTE_STRIPE_MIN. For protocol messages whose
  // immediates the target counts without knowing the writer's settings.
  // With `behind`, the write lets the small operations (64 KiB at most) that start after it in the
  // same pass go out first: for a protocol message that no one waits for now (NCCL's clear-to-send
  // for a later message) queued just before a small message that someone does wait for.
  Status write_imm_whole(int group, PeerId peer, const LocalSlice& src, const RemoteRegion& dst,
                         size_t dst_offset, uint32_t imm, Notify done, bool behind = false);
  // The same without an immediate: for a protocol message whose target reads its bytes (and
  // checks them whole) instead of counting it.
  Status write_whole(int group, PeerId peer, const LocalSlice& src, const RemoteRegion& dst,
                     size_t dst_offset, Notify done, bool behind = false);
  // RDMA read of len bytes from src+src_offset into dst.
  Status read(int group, PeerId peer, const LocalSlice& dst, const RemoteRegion& src,
              size_t src_offset, Notify done);
  // A flush: the same read once through each of the group's first `nics` NICs (NIC k reads from
  // the peer's NIC k; nics is capped at both ends' NIC counts). PCIe orders a NIC's writes only
  // before that NIC's own later reads, so data written into GPU memory through several NICs is
  // visible only once each of them has read. done fires once, when every read has ended.
  Status read_each_nic(int group, PeerId peer, const LocalSlice& dst, const RemoteRegion& src,
                       size_t src_offset, int nics, Notify done);
  // Reads posted through NIC `nic` of the group so far (a flush's reads among them).
  uint64_t reads_posted(int group, int nic) const;
  // Page i of the source (src_pages[i] * page_size within src) goes to page dst_pages[i] of dst.
  // Each page is one write; with imm each carries it (count = pages). The index arrays must stay
  // valid until done fires.
  Status paged_write(int group, PeerId peer, const MemoryRegion& src,
                     std::span<const uint32_t> src_pages, const RemoteRegion& dst,
                     std::span<const uint32_t> dst_pages, size_t page_size, const uint32_t* imm,
                     Notify done);
  // One source region to many peers/offsets: one write per target, each carrying imm when given.
  // targets must stay valid until done fires.
  Status scatter(int group, const MemoryRegion& src, std::span<const ScatterTarget> targets,
                 const uint32_t* imm, Notify done);
  // An immediate alone (a zero-byte write-with-immediate).
  Status imm(int group, PeerId peer, uint32_t value, Notify done);
  // The same immediate to every peer listed; done fires when all were delivered (or one failed).
  // peers must stay valid until done fires.
  Status barrier(int group, std::span<const PeerId> peers, uint32_t value, Notify done);
  // Two-sided send of src (at most config.recv_buf_size bytes) into an engine receive buffer.
  Status send(int group, PeerId peer, const LocalSlice& src, Notify done);
  void set_recv_handler(int group, RecvHandler fn, void* arg);

  // ---- Immediate counters. Fires done when `count` immediates carrying `value` have arrived in
  // this group (counting those that arrived before the call). With from != kAnyPeer the
  // expectation fails when that peer dies; it fails with kTimeout after timeout_ms (0: config).
  Status expect_imm(int group, uint32_t value, uint32_t count, PeerId from, Notify done,
                    uint32_t timeout_ms = 0);
  // Ends every expect_imm still waiting in group now, with kCancelled, as its timeout would later:
  // for a caller that stops waiting (Python's Ctrl-C). Immediates that arrive later are counted as
  // usual; expectations submitted after this call are not affected. Asynchronous: the waiters' done
  // fire from the worker, or from a polling thread's progress(), shortly after.
  Status cancel_expectations(int group);
  // Poller view of the same counters, for a thread that polls (such as NCCL's proxy): how many
  // immediates carrying value have arrived and are not yet consumed, and consume n of them. Use
  // either this or expect_imm for a given value, not both. Thread-safe, lock-free.
  uint32_t imm_arrived(int group, uint32_t value) const;
  void consume_imm(int group, uint32_t value, uint32_t n);

  // For a thread that polls (NCCL's proxy in test()): when the group's worker is asleep or is not
  // getting the CPU, runs one pass of its data path here: starts what was submitted, posts it,
  // reaps completions and arrived immediates, and runs their callbacks on this thread. One thread
  // at a time per group (a try-lock; the worker never waits behind more than one pass); control
  // sockets, liveness and timeouts stay with the worker, which backs off while a poller is active
  // and takes over again when the polling stops. Never blocks or allocates; false when it did
  // nothing (the worker is running, or there was nothing to do). When another thread is mid-pass
  // it yields the CPU once (sched_yield) before returning false: that thread moves this one's
  // data. A thread that called it within the last PONTE_POLLER_HOLD_US (2 ms) skips the worker's
  // wake-up when it submits (its next call starts the work, or stop_polling hands it to the
  // worker); other submissions wake the worker.
  // On shm it only reaps: a post there can block for good on a stopped peer's lock, so the worker
  // makes them.
  bool progress(int group);
  // The calling thread stops polling group (it will not call progress() for a while, e.g. it is
  // about to sleep or compute): the worker takes the data path back at once. Without it the worker
  // notices when it next wakes, up to PONTE_POLLER_SLEEP_US (5 ms) later while somebody polled (it
  // sleeps long then, so as not to take the poller's core); meanwhile nothing moves on a
  // manual-progress provider (tcp;ofi_rxm). Cheap; a no-op for a thread that is not polling group.
  void stop_polling(int group);
  // For a thread that polls group: posts what was submitted now (one pass of posting, without
  // reaping: callbacks of ops that fail to post may run here) instead of at its next progress()
  // call, so that it is on the wire while the thread computes. Never blocks; false when it posted
  // nothing (nothing queued, the token busy, or pollers do not post here: shm's worker does).
  bool start_submitted(int group);
  // Whether the calling thread is group's poller now: it called progress(group) within the last
  // PONTE_POLLER_HOLD_US (2 ms) and did not call stop_polling since. A thread that waits for a
  // stream of operations can call progress() again while this holds, even when the one it waits
  // for is done already, so that the worker goes on leaving it the data path. False for an unknown
  // group.
  bool polled_here(int group) const;
  // Whether a thread in progress(group) posts what is submitted itself (tcp;ofi_rxm, verbs), or
  // only reaps while the worker posts (shm: see progress). Where it only reaps, each submission
  // wakes the sleeping worker, which can land on the polling thread's core: Python's waits then
  // sleep on their completion instead (an 8-byte write and its wait on shm: 46-63 us polling,
  // 9 us sleeping). Measured, polling still pays on shm for a proxy that never yields (the
  // plugin's test(): without it 8-byte latency went 143 us -> 3.6 ms) and for collectives'
  // waits (ep-bench's small shape: 85-117 us polling, 129-145 us without). False for an unknown
  // group.
  bool polling_posts(int group) const;

  // How many immediates one write of len bytes to peer produces at the target.
  uint32_t imms_per_write(int group, PeerId peer, size_t len) const;

  // Peers that connected to this group from elsewhere, in arrival order (a later connect() to one
  // of them returns it).
  std::vector<PeerId> peers(int group) const;

 private:
  Engine();
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace ponte
