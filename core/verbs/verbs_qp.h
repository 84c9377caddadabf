// One RC queue pair toward one peer NIC (a connection has 1..ConnectBlob::kMaxQps of them): creation
// (INIT), the move to RTR/RTS with the peer's connect blob, and the ring of outstanding send work
// requests whose completions the engine is owed.
#pragma once

#include <memory>
#include <vector>

#include "core/verbs/verbs_device.h"
#include "core/verbs/verbs_wire.h"

namespace ponte::verbs {

// Local facts every QP of a NIC shares.
struct QpParams {
  uint8_t port = 1;
  int gid_index = 0;
  LinkLayer link_layer = LinkLayer::kEthernet;
  uint16_t lid = 0;
  uint8_t active_mtu = IBV_MTU_1024;
  ibv_gid gid{};
  uint32_t sq_depth = 256;   // send work requests per QP
  uint32_t max_inline = 0;   // requested inline size
  uint8_t max_rd_atomic = 1; // outstanding RDMA reads, both directions
  uint8_t traffic_class = 0;
  uint8_t service_level = 0;
  uint8_t timeout = 20;      // local ACK timeout, 4.096 us * 2^timeout (NCCL's default: 4.3 s)
  uint8_t retry_count = 7;
  // Receiver not ready: a write-with-immediate or a send found the shared receive queue empty.
  // NCCL uses 12 (0.64 ms) and retries forever; its receives are posted by the protocol ahead of
  // every transfer, so an RNR there means a slow peer. Here the receives are the SRQ's whole depth,
  // given back by the target's worker on every poll pass (at most ~50 us apart when idle), so an
  // RNR is a burst outrunning one pass: 0.12 ms (7) lets the retry find the queue refilled, where
  // 0.64 ms idles the QP five times longer, and still keeps a stalled target's retries to ~8000/s
  // per QP. Retry forever (7), as NCCL: an RNR is back-pressure, not a failure; a finite count
  // would turn a busy target into a broken QP and a reconnect that fails every operation in
  // flight. A dead target is found by the engine's liveness checks and PONTE_TIMEOUT_MS instead.
  uint8_t rnr_retry = 7;
  uint8_t min_rnr_timer = 7;  // 0.12 ms
};

class VerbsQp {
 public:
  enum class State : uint8_t { kInit, kRts, kError };

  // Creates the QP on pd/cq/srq and moves it to INIT; psn is the first sequence number it sends.
  static Result<std::unique_ptr<VerbsQp>> create(const VerbsApi& api, ibv_pd* pd, ibv_cq* cq,
                                                 ibv_srq* srq, const QpParams& params,
                                                 uint16_t generation, uint32_t psn);
  ~VerbsQp();
  VerbsQp(const VerbsQp&) = delete;
  VerbsQp& operator=(const VerbsQp&) = delete;

  uint32_t qpn() const { return qp_->qp_num; }
  uint32_t psn() const { return psn_; }  // the first sequence number this QP sends
  // INIT -> RTR -> RTS toward QP `index` of the peer's blob, sending in traffic_class (RoCE: the
  // GRH's class, which becomes the IP header's DSCP/ECN byte). On failure the QP is left in kError.
  Status connect(const ConnectBlob& remote, size_t index, uint8_t traffic_class);
  // Moves the QP to ERR so that the provider flushes every outstanding WR as a completion.
  void force_error();
  const char* state_name() const;  // "in ERR", ...: the provider's view, for error messages
  // Asks the device whether a connected QP is still in RTS (a responder-side failure, such as a
  // peer writing with a bad rkey, moves it to ERR without any completion here). Marks it kError
  // when not.
  bool still_connected();

  State state() const { return state_; }
  void set_error(ibv_wc_status status) {
    if (state_ != State::kError) first_error_ = status;
    state_ = State::kError;
  }
  ibv_wc_status first_error() const { return first_error_; }
  uint16_t generation() const { return generation_; }
  ibv_qp* qp() const { return qp_; }
  uint32_t max_inline() const { return max_inline_; }

  // Ring of outstanding send WRs, in posting order. seq numbers are free-running 32-bit counters.
  uint32_t outstanding() const { return tail_ - head_; }
  bool full() const { return outstanding() >= depth_; }
  uint32_t tail() const { return tail_; }
  uint32_t head() const { return head_; }
  void push(uint64_t ctx) { ring_[tail_++ & mask_] = ctx; }
  uint64_t pop() { return ring_[head_++ & mask_]; }
  uint64_t take_last() { return ring_[--tail_ & mask_]; }  // a request pushed but never posted

 private:
  explicit VerbsQp(const VerbsApi& api) : api_(api) {}
  int device_state() const;  // ibv_qp_state as ibv_query_qp reads it, or -1

  const VerbsApi& api_;
  QpParams params_;
  ibv_qp* qp_ = nullptr;
  uint16_t generation_ = 0;
  uint32_t psn_ = 0;
  State state_ = State::kInit;
  ibv_wc_status first_error_ = IBV_WC_SUCCESS;
  uint32_t max_inline_ = 0;
  uint32_t depth_ = 0;
  uint32_t mask_ = 0;
  uint32_t head_ = 0;
  uint32_t tail_ = 0;
  std::vector<uint64_t> ring_;  // engine ctx per outstanding WR
};

// The largest inline payload an RC QP of this device accepts (tries 256, 128, 64 bytes; 0 if none).
uint32_t probe_max_inline(const VerbsApi& api, ibv_context* ctx, ibv_pd* pd);

}  // namespace ponte::verbs
