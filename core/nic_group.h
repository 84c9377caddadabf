// NicGroup: the NICs serving one GPU (or host memory), their worker thread, peers and their
// handshake state machine, in-flight operations and immediate counters. Internal to core/.
#pragma once

#include <pthread.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "core/control_auth.h"
#include "core/control_messages.h"
#include "core/control_socket.h"
#include "core/engine.h"
#include "core/group_address.h"
#include "core/imm_counter.h"
#include "core/nic.h"
#include "core/stripe_plan.h"
#include "core/submit_queue.h"
#include "core/watchdog.h"

namespace ponte {

// One submitted operation, copied into the submission queue (fixed size, no allocation).
struct Op {
  enum Type : uint8_t { kWrite, kRead, kPaged, kScatter, kImm, kBarrier, kSend, kExpect, kConnect, kCall };
  Type type = kWrite;
  bool has_imm = false;
  bool whole = false;  // kWrite: never striped over NICs (Engine::write_imm_whole)
  bool behind = false;  // kWrite: small ops that start after it in the same pass go first (post_runnable)
  uint32_t imm = 0;
  PeerId peer = 0;
  Notify done;
  const MemoryRegion* mr = nullptr;
  size_t offset = 0;
  size_t len = 0;
  size_t remote_offset = 0;
  const uint32_t* src_pages = nullptr;
  const uint32_t* dst_pages = nullptr;
  size_t page_size = 0;
  const ScatterTarget* targets = nullptr;
  const PeerId* peers = nullptr;
  uint32_t count = 0;       // pages, targets, peers, expected immediates, or kRead's NICs (0: one)
  uint32_t timeout_ms = 0;  // kExpect
  void (*call)(void* arg) = nullptr;  // kCall: runs on the worker
  void* call_arg = nullptr;
  RemoteRegion remote;
  // Operations that occupy an in-flight slot (the others run to completion when started).
  bool needs_slot() const { return type != kExpect && type != kCall && type != kConnect; }
};

// A call for the worker (NicGroup::run_on_worker) in a box of its own, shared by its caller and
// the queued op: the worker runs the box's copy of the caller's job, and a caller that stops
// waiting (the group is wedged, or the call overran) leaves the box to the other reference, so a
// call still running on a stuck worker never writes into a returned caller's stack.
struct WorkerCall {
  enum State : uint8_t { kQueued, kRunning, kDone, kCancelled, kAbandoned };
  std::atomic<uint8_t> state{kQueued};
  std::atomic<int> refs{2};  // the caller's and the queued op's
  virtual ~WorkerCall() = default;
  virtual void run() = 0;
  void unref() {
    if (refs.fetch_sub(1, std::memory_order_acq_rel) == 1) delete this;
  }
};

class NicGroup {
 public:
  NicGroup(int index, const Config& cfg, std::vector<std::unique_ptr<Nic>> nics,
           BackendKind backend, uint64_t engine_nonce, uint32_t dense_imm_values = 0);
  ~NicGroup();
  Status start(const std::vector<int>& cores);  // listen socket, receive buffers, worker thread
  void stop();                                   // fails what is outstanding, joins the worker

  int index() const { return index_; }
  int nic_count() const { return static_cast<int>(nics_.size()); }
  const NicInfo& nic_info(int i) const { return nics_[i]->info(); }
  uint64_t reads_posted(int i) const {
    return i >= 0 && i < kMaxNicsPerGroup ? reads_posted_[i].load(std::memory_order_relaxed) : 0;
  }
  const Config& config() const { return cfg_; }
  std::vector<uint8_t> address() const { return address_bytes_; }

  // Submission from any thread. kAgain when the queue is full.
  Status submit(const Op& op);
  // Runs job.run() on the worker and waits (directly when called on the worker): on a copy of job,
  // copied back once it ran. Job: copyable, with void run(). A wedged group refuses at once; a
  // call queued when it wedged, or not run within PONTE_TIMEOUT_MS + 5 s, ends with an error
  // (the copy is left to the worker).
  template <typename Job>
  Status run_on_worker(Job& job);
  // Whether the calling thread holds the group's progress token: it is the worker in a pass, or a
  // poller inside progress(). Worker-only state may be touched only by the token's holder.
  bool on_worker() const;
  // Progress on the calling thread for a thread that polls (NCCL's proxy in test()): when the
  // worker is asleep or has not run a pass since the last call, and neither the worker nor another
  // poller holds the token, one pass of posting and reaping (submissions, shards, completions,
  // immediates, callbacks) runs here. Housekeeping (control sockets, liveness, timeouts) stays
  // with the worker. Never blocks, never allocates; whether anything happened.
  bool progress();
  // The calling thread stops polling (it will not call progress() for a while): the worker takes
  // the data path back now instead of when it next wakes (up to PONTE_POLLER_SLEEP_US away).
  void stop_polling();
  // For a polling thread: starts what was submitted (posts it) now rather than at its next
  // progress() call; no reaping. Where pollers may not post (shm), or the token is busy: nothing.
  bool start_submitted();
  bool pollers_post() const { return pollers_post_; }  // progress() posts here (not on shm)
  // The calling thread called progress() on this group within PONTE_POLLER_HOLD_US and has not
  // stopped polling since: it is the group's poller, and its submissions start at its next progress().
  bool polled_here() const;

  // Peers.
  // The peer for a remote group: a live one with the same traffic class if there is one (it
  // connected to us, or we to it: *existing = true, nothing to start), else a new outbound one.
  Result<PeerId> new_outbound_peer(const GroupAddress& addr, int traffic_class, bool* existing);
  bool peer_ready(PeerId p) const;
  uint32_t peer_epoch(PeerId p) const;
  bool peer_dead(PeerId p) const;    // nothing more will come from it (after any drain)
  bool peer_closed(PeerId p) const;  // nothing may be sent to it
  int peer_nics(PeerId p) const;
  size_t peer_max_shard(PeerId p) const;
  bool peer_exists(PeerId p) const;
  std::vector<PeerId> inbound_peers() const;

  ImmCounterTable& imm_table() { return imm_; }
  void set_recv_handler(RecvHandler fn, void* arg) { recv_fn_ = fn; recv_arg_ = arg; }  // worker only
  uint32_t next_first_nic() { return first_nic_++; }  // worker only

  // Worker-side registration helpers (called through run_on_worker).
  Nic& nic(int i) { return *nics_[i]; }

  // ---- The watchdog (core/watchdog.h). Called by the engine's watchdog thread every period: a
  // provider call that has not returned for PONTE_TIMEOUT_MS is claimed and the group taken over
  // (its operations and counters end with errors, its peers are told); afterwards what raced the
  // verdict into the queue is refused.
  void watchdog_check(std::chrono::steady_clock::time_point now);
  bool wedged() const { return wedged_.load(std::memory_order_acquire); }
  Status wedge_status() const;  // OK, or why the group takes no more work (kUnavailable)
  // After stop(): the group was wedged, a thread may still be inside one of its NICs: never
  // destroy it, nor the backend its NICs came from.
  bool abandoned() const { return abandoned_; }
  void refuse_queued();  // a wedged group's queue, by whoever owns it (the watchdog, then stop)

 private:
  enum PeerState : uint8_t { kUnused = 0, kConnecting, kReady, kDead };
  struct Peer {
    std::atomic<uint8_t> state{kUnused};
    std::atomic<int> nics{0};
    std::atomic<uint64_t> max_shard{kMaxShardBytes};  // min of both groups' max_msg_size
    bool inbound = false;
    bool addr_known = false;
    GroupAddress addr;
    NicPeer nic_peer[kMaxNicsPerGroup] = {};
    bool nics_added = false;
    bool backend_connected = false;
    bool hello_received = false;
    bool hello_sent = false;
    AuthKey auth;                  // outbound: the key the peer's address names
    bool out_connected = false;    // outbound: the connect completed (sock[0] watched for input)
    bool out_authed = false;       // outbound: the peer's challenge was answered
    bool orderly_close = false;  // the peer said goodbye before closing, or we did
    std::atomic<bool> draining{false};  // closed in order: its writes still in flight may land until
    std::chrono::steady_clock::time_point drain_deadline;  // then its counters fail
    uint32_t remote_tag = 0;  // the id the peer gave us: travels as imm of our sends
    int traffic_class = -1;   // ConnectOptions::traffic_class (inbound: the hello's), set on every NIC peer
    std::atomic<uint32_t> rebuilds{0};  // connection rebuilds so far (Engine::peer_epoch)
    uint32_t epoch = 1;         // our handshake round: bumped to rebuild failed connections
    uint32_t remote_epoch = 0;  // the peer's latest round seen
    uint32_t failed_rounds = 0;  // rounds in a row whose backend connect failed here (kMaxFailedRounds)
    ControlSocket sock[2];
    bool sock_hello_sent[2] = {false, false};
    std::chrono::steady_clock::time_point last_heard;      // its last control message (liveness)
    std::chrono::steady_clock::time_point last_ping;       // our last PING to it
    std::chrono::steady_clock::time_point handshake_deadline;
  };
  struct Slot {
    Op op;
    uint32_t gen = 0;
    bool used = false;
    bool runnable = false;
    uint32_t next_shard = 0;
    uint32_t shards = 0;
    uint32_t outstanding = 0;
    uint32_t first_nic = 0;
    StripePlan plan;
    Code error = Code::kOk;
    char error_msg[96] = {0};
    std::chrono::steady_clock::time_point deadline;
    uint32_t prev = kNoSlot, next = kNoSlot;  // active list
    uint32_t run_next = kNoSlot;              // runnable FIFO
  };
  static constexpr uint32_t kNoSlot = 0xffffffffu;
  // An accepted connection until its HELLO names the peer: first it must answer the challenge
  // sent on accept (see control_auth.h), within a short window, in one small frame.
  struct PendingSocket {
    std::unique_ptr<ControlSocket> sock;
    std::chrono::steady_clock::time_point deadline;
    Challenge challenge{};
    bool authed = false;
  };

  void worker_main();  // the worker thread: run(), linger(), or a claimed provider call's way out
  void run();
  struct PassState {  // the worker loop's own (backoff, clock reads)
    uint32_t idle_us = 0;
    uint32_t iter = 0;
    bool worked = false;
    bool yield_now = false;  // spinning idle long enough: yield the core after this pass
    std::chrono::steady_clock::time_point last_house;
    uint64_t poll_calls_seen = 0;
    bool poller_active = false;  // a thread called progress() before poller_until
    std::chrono::steady_clock::time_point poller_until;
  };
  uint32_t worker_pass(PassState& st);  // one pass under the token; how long to sleep after (us)
  uint32_t poller_sleep(PassState& st) const;  // the next sleep while a thread polls (grows)
  bool poller_pass(bool reap);           // progress() and start_submitted(): one pass under the token
  bool pass_holding_token(bool reap);    // its body, the token taken (released unless wedged)
  void disarm_escape();                  // a poller's pass ends (rescue_)
  void rescue_poller();                  // the watchdog, having claimed a call (rescue_)
  bool take_token();                     // try
  bool hold_token();                     // the worker's last take, for linger and stop(); false: wedged
  void release_token();
  static bool pollers_may_post(const std::vector<std::unique_ptr<Nic>>& nics);
  void linger();  // orderly shutdown on the worker, after run() (bounded: see nic_group_worker.cc)
  bool poll_nics();
  void flush_nic_posts();  // Nic::flush_posts on every NIC: after each posting pass
  bool drain_queue();
  void start_op(const Op& op);
  bool post_runnable();
  bool post_sweep(bool rest, bool* skipped);
  enum class PostResult { kPosted, kWait, kFailed };
  PostResult post_shard(Slot& s, uint32_t slot_index);
  void on_completion(int nic, const Completion& c);
  void finish(uint32_t slot_index);
  void fail_slot(uint32_t slot_index, Code code, const char* why);
  void housekeeping(std::chrono::steady_clock::time_point now);
  void poll_control(std::chrono::steady_clock::time_point now);
  void service_peer(PeerId p, int which);
  void end_drains(std::chrono::steady_clock::time_point now);
  void keep_alive(PeerId p, std::chrono::steady_clock::time_point now, std::chrono::steady_clock::duration away);
  bool liveness_message(PeerId p, int which);  // msg_ was a PING (answered) or a PONG
  void take_over(uint64_t call_word, long long stuck_ms);  // the watchdog thread, once
  Status run_call(WorkerCall* call);
  Status handle_hello(PeerId p, int which, const HelloMsg& msg);
  Status answer_challenge(PeerId p);
  Status send_hello(PeerId p, int which);
  void start_reconnect(PeerId p, const char* why);
  Status propose_round(PeerId p);  // the next round, with fresh backend peers: our hello proposes it
  void reset_backend_peer(PeerId p);  // drops the peer from every NIC (re-added by attach_backend)
  void learn_address(Peer& p, const GroupAddress& addr);
  Status attach_backend(PeerId p);
  void peer_died(PeerId p, Code code, const char* why);
  void accept_new(std::chrono::steady_clock::time_point now);
  void service_pending(size_t i, std::chrono::steady_clock::time_point now);
  void adopt_pending(size_t i, const HelloMsg& hello, std::chrono::steady_clock::time_point now);
  void expire_pending(std::chrono::steady_clock::time_point now);
  void drop_pending(size_t i, const char* uninvited_why);
  void note_uninvited(const char* why);
  // A connecting or ready peer for the remote group (nonce, group) and traffic class; kAnyPeer if
  // none. Call with peers_mu_ held.
  PeerId find_peer(uint64_t nonce, uint8_t group, int traffic_class) const;
  uint32_t alloc_slot();
  // us = 0 does not sleep. on_nics: the NICs' wait objects are armed (arm_nic_waits), and incoming
  // traffic ends the sleep too.
  void sleep_idle(uint32_t us, bool on_nics = false);
  // Under the token, before a long idle sleep: whether every NIC with a wait object armed it, and
  // at least one has one.
  bool arm_nic_waits();
  void post_recv_buffers();
  void epoll_add(int fd, uint64_t tag);
  void epoll_del(int fd);
  bool slot_uses_peer(const Slot& s, PeerId p) const;
  // Ends every operation toward peer p with code; keep_on_wire spares those wholly posted and
  // still completing (an orderly close's grace period).
  void fail_ops_toward(PeerId p, Code code, const char* why, bool keep_on_wire);

  const int index_;
  Config cfg_;
  std::vector<std::unique_ptr<Nic>> nics_;
  BackendKind backend_;
  uint64_t engine_nonce_;
  std::vector<uint8_t> address_bytes_;
  ControlEndpoint ctrl_;
  uint64_t max_msg_ = kMaxShardBytes;  // smallest max_msg_size of our NICs
  int listen_fd_ = -1;
  int epoll_fd_ = -1;
  int wake_fd_ = -1;

  SubmitQueue<Op> queue_;
  std::vector<Slot> slots_;
  std::vector<uint32_t> free_slots_;
  uint32_t active_head_ = kNoSlot;
  uint32_t run_head_ = kNoSlot, run_tail_ = kNoSlot;
  size_t active_count_ = 0;

  std::vector<Peer> peers_;
  std::atomic<uint32_t> next_peer_{0};
  // One peer per remote group (and traffic class): new_outbound_peer (any thread) and adopt_pending
  // (the token's holder) find or create a peer under it, and write peers' addresses only under it.
  // Without it, a connection that arrived before our own connect() made a second peer for the
  // same group, whose QP the other end never connected to (its writes were never answered).
  std::mutex peers_mu_;
  std::atomic<uint64_t> reads_posted_[kMaxNicsPerGroup] = {};  // per NIC; read by reads_posted()
  std::vector<PendingSocket> pending_;
  AuthKey auth_;                 // what an accepted connection must prove
  uint64_t uninvited_ = 0;       // connections dropped for not proving it (the first is logged)
  bool listen_paused_ = false;   // out of descriptors: the port is not watched until listen_resume_
  std::chrono::steady_clock::time_point listen_resume_;
  std::chrono::steady_clock::time_point last_pending_scan_;
  std::vector<uint8_t> msg_;  // control message scratch

  ImmCounterTable imm_;
  RecvHandler recv_fn_ = nullptr;
  void* recv_arg_ = nullptr;
  std::vector<MemoryRegion> recv_mrs_;      // one per NIC
  std::vector<std::unique_ptr<uint8_t[]>> recv_bufs_;

  uint32_t first_nic_ = 0;
  std::atomic<bool> stop_{false};
  std::atomic<bool> wedged_{false};  // set by the watchdog: the group takes no more work
  std::atomic<bool> sleeping_{false};
  // The progress token: whoever holds it runs worker-only code (the worker each pass, a poller in
  // progress()). Pollers take it only when the worker sleeps or made no attempt since their last
  // call, so the worker is never starved of it.
  std::atomic<bool> token_{false};
  std::atomic<uint64_t> passes_{0};       // the worker's attempts (written by the worker only)
  std::atomic<uint64_t> passes_seen_{0};  // pollers: the count the last progress() call saw
  std::atomic<uint64_t> poll_calls_{0};   // progress() calls: a thread is polling this group
  std::atomic<bool> poller_left_{false};  // stop_polling(): the worker takes the data path back
  std::atomic<std::chrono::steady_clock::rep> last_poll_{0};  // progress()'s last call (clock ticks)
  std::thread worker_;
  static constexpr int kPollBatch = 32;
  Completion comps_[kPollBatch];  // worker only: poll_nics' batch
  uint32_t draining_ = 0;  // peers closed in order whose counters still wait (see peer_died)
  std::chrono::steady_clock::time_point now_;  // the worker loop's clock, read every few passes
  std::chrono::steady_clock::time_point last_activity_;
  std::chrono::steady_clock::time_point last_timeout_scan_;
  uint64_t dropped_imms_ = 0;
  uint32_t fault_drops_left_ = 0;  // PONTE_FAULT_DROP_RECVS: messages still to lose (worker only)
  uint32_t fault_connects_left_ = 0;  // PONTE_FAULT_FAILED_CONNECTS: rounds still to fail (worker only)
  std::chrono::milliseconds ping_after_, silence_limit_;  // PONTE_TIMEOUT_MS / 4, PONTE_TIMEOUT_MS

  // The watchdog's view (core/watchdog.h).
  CallGuard guard_;                        // every NIC's provider calls, written by the token holder
  bool in_drain_ = false;                  // token holder: inside drain_queue (its head mid-start)
  std::atomic<bool> watching_{false};      // from start() until stop()'s worker is gone
  std::atomic<bool> taken_over_{false};    // the watchdog has ended what the group held
  std::atomic<bool> worker_exited_{false};
  bool abandoned_ = false;
  bool pollers_post_ = true;               // see pollers_may_post (nic_group_worker.cc)
  // A polling thread stuck in a claimed provider call is sent back (core/watchdog.h, poller_rescue):
  // where pollers do not post (shm) and the signal is free. The state: idle, armed (a pass is on,
  // escape_thread_ set), signalling (the watchdog is sending it), signalled.
  bool rescue_ = false;
  static constexpr uint8_t kEscapeIdle = 0, kEscapeArmed = 1, kEscapeSignalling = 2, kEscapeSignalled = 3;
  std::atomic<uint8_t> escape_state_{kEscapeIdle};
  pthread_t escape_thread_{};
  char wedge_why_[96] = {0};               // written before wedged_ is set
  uint64_t watch_word_ = 0;                // the watchdog thread's: the call seen, since when
  std::chrono::steady_clock::time_point watch_since_;
  uint64_t watch_passes_ = 0;              // and the worker's passes, since when
  std::chrono::steady_clock::time_point passes_since_;
  bool warned_stall_ = false;
};

template <typename Job>
Status NicGroup::run_on_worker(Job& job) {
  if (wedged()) return wedge_status();
  if (on_worker() || !worker_.joinable()) {
    CallGuard::Nested nested;  // from a callback: a wedge here must not unwind through its frames
    job.run();
    return Status::Ok();
  }
  struct Box final : WorkerCall {
    explicit Box(const Job& j) : job(j) {}
    void run() override { job.run(); }
    Job job;
  };
  auto* box = new Box(job);
  Status st = run_call(box);
  if (st.ok()) job = box->job;
  box->unref();
  return st;
}

}  // namespace ponte
