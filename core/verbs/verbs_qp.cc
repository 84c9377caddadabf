// RC queue pair state transitions.
#include "core/verbs/verbs_qp.h"

#include <cerrno>
#include <cstring>

namespace ponte::verbs {

namespace {

ibv_qp_init_attr rc_init_attr(ibv_cq* cq, ibv_srq* srq, uint32_t sq_depth, uint32_t max_inline) {
  ibv_qp_init_attr a{};
  a.send_cq = cq;
  a.recv_cq = cq;
  a.srq = srq;
  a.qp_type = IBV_QPT_RC;
  a.sq_sig_all = 0;  // every WR is posted with IBV_SEND_SIGNALED (see verbs_nic.cc)
  a.cap.max_send_wr = sq_depth;
  a.cap.max_recv_wr = srq != nullptr ? 0 : 1;
  a.cap.max_send_sge = 1;
  a.cap.max_recv_sge = srq != nullptr ? 0 : 1;
  a.cap.max_inline_data = max_inline;
  return a;
}

}  // namespace

Result<std::unique_ptr<VerbsQp>> VerbsQp::create(const VerbsApi& api, ibv_pd* pd, ibv_cq* cq,
                                                 ibv_srq* srq, const QpParams& params,
                                                 uint16_t generation, uint32_t psn) {
  std::unique_ptr<VerbsQp> q(new VerbsQp(api));
  q->params_ = params;
  q->generation_ = generation;
  q->psn_ = psn & 0xffffff;
  ibv_qp_init_attr init = rc_init_attr(cq, srq, params.sq_depth, params.max_inline);
  q->qp_ = api.create_qp(pd, &init);
  if (q->qp_ == nullptr) {
    return Status(Code::kResource, "ibv_create_qp(RC, %u send WRs) failed: %s", params.sq_depth,
                  strerror(errno));
  }
  q->max_inline_ = params.max_inline;
  q->depth_ = params.sq_depth;
  uint32_t cap = 1;
  while (cap < q->depth_) cap <<= 1;
  q->mask_ = cap - 1;
  q->ring_.assign(cap, 0);

  ibv_qp_attr attr{};
  attr.qp_state = IBV_QPS_INIT;
  attr.pkey_index = 0;
  attr.port_num = params.port;
  attr.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
  int rc = api.modify_qp(q->qp_, &attr,
                         IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
  if (rc != 0) {
    return Status(Code::kTransport, "ibv_modify_qp(qpn %u, INIT) failed: %s", q->qp_->qp_num,
                  strerror(rc));
  }
  return q;
}

// The QP's state as the device reports it; -1 when it cannot be read.
int VerbsQp::device_state() const {
  if (api_.query_qp == nullptr) return -1;
  ibv_qp_attr attr{};
  ibv_qp_init_attr init{};
  return api_.query_qp(qp_, &attr, IBV_QP_STATE, &init) == 0 ? static_cast<int>(attr.qp_state) : -1;
}

// The same, for error messages.
const char* VerbsQp::state_name() const {
  const int st = device_state();
  if (st < 0) return "in an unknown state (ibv_query_qp failed)";
  switch (static_cast<ibv_qp_state>(st)) {
    case IBV_QPS_RESET: return "in RESET";
    case IBV_QPS_INIT: return "in INIT";
    case IBV_QPS_RTR: return "in RTR";
    case IBV_QPS_RTS: return "in RTS";
    case IBV_QPS_SQD: return "in SQD";
    case IBV_QPS_SQE: return "in SQE";
    case IBV_QPS_ERR: return "in ERR";
    default: return "in an unknown state";
  }
}

VerbsQp::~VerbsQp() {
  if (qp_ != nullptr) api_.destroy_qp(qp_);
}

Status VerbsQp::connect(const ConnectBlob& remote, size_t index, uint8_t traffic_class) {
  if (state_ != State::kInit) {
    return Status(Code::kInvalidArgument, "QP %u is not waiting for a peer blob", qp_->qp_num);
  }
  if (index >= remote.qp_count) {
    return Status(Code::kInvalidArgument, "QP %u: the peer's blob has %u QPs, not %zu", qp_->qp_num,
                  remote.qp_count, index + 1);
  }
  state_ = State::kError;  // until RTS succeeds

  ibv_qp_attr attr{};
  attr.qp_state = IBV_QPS_RTR;
  attr.path_mtu = static_cast<ibv_mtu>(remote.mtu < params_.active_mtu ? remote.mtu : params_.active_mtu);
  attr.dest_qp_num = remote.qpn[index];
  attr.rq_psn = remote.psn;
  attr.max_dest_rd_atomic = params_.max_rd_atomic;
  attr.min_rnr_timer = params_.min_rnr_timer;
  attr.ah_attr.port_num = params_.port;
  attr.ah_attr.sl = params_.service_level;
  attr.ah_attr.src_path_bits = 0;
  attr.ah_attr.dlid = remote.lid;
  // RoCE always routes by GID; InfiniBand only needs a GRH when the peer is in another subnet.
  bool global = params_.link_layer == LinkLayer::kEthernet ||
                memcmp(remote.gid.data(), params_.gid.raw, 8) != 0;
  if (global) {
    attr.ah_attr.is_global = 1;
    memcpy(attr.ah_attr.grh.dgid.raw, remote.gid.data(), 16);
    attr.ah_attr.grh.sgid_index = static_cast<uint8_t>(params_.gid_index);
    attr.ah_attr.grh.hop_limit = 255;
    attr.ah_attr.grh.traffic_class = traffic_class;
    attr.ah_attr.grh.flow_label = 0;
  }
  int rc = api_.modify_qp(qp_, &attr,
                          IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                              IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
  if (rc != 0) {
    return Status(Code::kTransport, "ibv_modify_qp(qpn %u -> %u, RTR) failed: %s", qp_->qp_num,
                  remote.qpn[index], strerror(rc));
  }

  attr = ibv_qp_attr{};
  attr.qp_state = IBV_QPS_RTS;
  attr.sq_psn = psn_;
  attr.timeout = params_.timeout;
  attr.retry_cnt = params_.retry_count;
  attr.rnr_retry = params_.rnr_retry;
  attr.max_rd_atomic = params_.max_rd_atomic;
  rc = api_.modify_qp(qp_, &attr,
                      IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                          IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC);
  if (rc != 0) {
    return Status(Code::kTransport, "ibv_modify_qp(qpn %u -> %u, RTS) failed: %s (the QP is %s)", qp_->qp_num,
                  remote.qpn[index], strerror(rc), state_name());
  }
  state_ = State::kRts;
  return Status::Ok();
}

void VerbsQp::force_error() {
  ibv_qp_attr attr{};
  attr.qp_state = IBV_QPS_ERR;
  api_.modify_qp(qp_, &attr, IBV_QP_STATE);
  if (state_ != State::kError) first_error_ = IBV_WC_WR_FLUSH_ERR;
  state_ = State::kError;
}

bool VerbsQp::still_connected() {
  if (state_ != State::kRts) return false;
  const int st = device_state();
  if (st == IBV_QPS_RTS || st == IBV_QPS_SQD) return true;
  set_error(IBV_WC_FATAL_ERR);
  return false;
}

uint32_t probe_max_inline(const VerbsApi& api, ibv_context* ctx, ibv_pd* pd) {
  ibv_cq* cq = api.create_cq(ctx, 4, nullptr, nullptr, 0);
  if (cq == nullptr) return 0;
  uint32_t found = 0;
  for (uint32_t want : {256u, 128u, 64u}) {
    ibv_qp_init_attr init = rc_init_attr(cq, nullptr, 4, want);
    ibv_qp* qp = api.create_qp(pd, &init);
    if (qp != nullptr) {
      found = want;
      api.destroy_qp(qp);
      break;
    }
  }
  api.destroy_cq(cq);
  return found;
}

}  // namespace ponte::verbs
