// The libfabric Nic: endpoint setup, peers, registration, posts and completion polling.
#include "core/fabric/fabric_endpoint.h"

#include <rdma/fi_cm.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>

#include <algorithm>
#include <cstdarg>
#include <cstdio>

#include "core/fabric/fabric_ep_options.h"
#include "core/log.h"

namespace ponte::fabric {
namespace {

// Completions read from the CQ per fi_cq_read call (on the stack).
constexpr int kPollBatch = 32;
// fi_cq_read calls per poll() at most.
constexpr int kPollRounds = 16;
// Contexts: the provider's queue sizes bound them; these bound the provider's claims.
constexpr uint32_t kMinTxContexts = 64;
constexpr uint32_t kMaxTxContexts = 16384;
constexpr uint32_t kMinRxContexts = 64;
constexpr uint32_t kMaxRxContexts = 16384;

// Built once: returning kAgain on the hot path must not format a message every time.
const Status& again_status() {
  static const Status st(Code::kAgain, "fabric: transmit queue full, poll and retry");
  return st;
}

}  // namespace

Result<std::unique_ptr<Nic>> FabricNic::open(const FabricLibrary& lib, const struct fi_info& info,
                                             const NicInfo& nic_info, uint32_t max_inflight, bool cq_wait) {
  std::unique_ptr<FabricNic> nic(new FabricNic(lib, nic_info));
  PONTE_RETURN_IF_ERROR(nic->init(info, max_inflight, cq_wait));
  return std::unique_ptr<Nic>(std::move(nic));
}

Status FabricNic::init(const struct fi_info& info, uint32_t max_inflight, bool cq_wait) {
  fi_.lib = &lib_;
  fi_.info = lib_.dupinfo(&info);
  if (fi_.info == nullptr) return Status(Code::kResource, "fi_dupinfo failed");
  struct fi_info* fi = fi_.info;

  PONTE_RETURN_IF_ERROR(domain_.open(lib_, fi));
  mrs_.init(lib_, *fi);
  PONTE_RETURN_IF_ERROR(av_.open(lib_, domain_.domain(), fi->addr_format));

  uint32_t tx =
      static_cast<uint32_t>(std::clamp<size_t>(fi->tx_attr->size, kMinTxContexts, kMaxTxContexts));
  if (max_inflight > 0) tx = std::max(kMinTxContexts, std::min(tx, max_inflight));
  uint32_t rx =
      static_cast<uint32_t>(std::clamp<size_t>(fi->rx_attr->size, kMinRxContexts, kMaxRxContexts));
  ops_.init(tx, rx);
  repost_ = std::make_unique<OpContext*[]>(rx);
  cancelled_ = std::make_unique<OpContext*[]>(tx);
  // With PONTE_IDLE_WAKE, a wait object for the idle worker to sleep on (Nic::wait_fd), where
  // fi_trywait resets it (NicInfo::cq_wait_resets: tcp;ofi_rxm on this host's libfabric 1.17, not
  // net). On tcp;ofi_rxm it turns readable when data arrives. shm needs none (its writers copy
  // into the target's memory themselves) and gives none. Opt-in: on tcp;ofi_rxm it costs every
  // completion a signal and the provider's progress an epoll set (8-byte ping-pong 1.2 -> 1.4x
  // raw libfabric's latency).
  PONTE_RETURN_IF_ERROR(cq_.open(lib_, domain_.domain(), static_cast<size_t>(tx) + rx, cq_wait));

  // shm names an endpoint's shared-memory region after the process id and a per-process endpoint
  // index, and refuses (EBUSY at fi_enable) a name a dead process left behind: a process killed
  // (SIGKILL) keeps its regions in /dev/shm, and process ids are reused. The next endpoint takes
  // the next index, so a few tries find a name of our own (the dead process had a few at most).
  int rc = 0;
  for (int attempt = 0;; ++attempt) {
    PONTE_RETURN_IF_ERROR(create_endpoint(fi));
    rc = fi_enable(ep_);
    if (rc != -FI_EBUSY || info_.provider != "shm" || attempt == kShmNameTries - 1) break;
    if (attempt == 0)
      PONTE_LOG_WARN("fabric: NIC %s: a shared-memory region named for this process id is left from a dead "
                     "process (pid reused); trying the next endpoint index", info_.name.c_str());
    close_fid(lib_, &ep_->fid, "endpoint");
    ep_ = nullptr;
  }
  if (rc != 0) return Status(Code::kTransport, "fi_enable: %s", lib_.error_text(rc));

  address_.assign(256, 0);
  size_t len = address_.size();
  rc = fi_getname(&ep_->fid, address_.data(), &len);
  if (rc == -FI_ETOOSMALL && len > address_.size()) {
    address_.assign(len, 0);
    rc = fi_getname(&ep_->fid, address_.data(), &len);
  }
  if (rc != 0) return Status(Code::kTransport, "fi_getname: %s", lib_.error_text(rc));
  if (len == 0 || len > address_.size()) {
    return Status(Code::kTransport, "fi_getname gave an address of %zu bytes", len);
  }
  address_.resize(len);
  return Status::Ok();
}

// The endpoint, bound to the address vector and the completion queue, with ponte's options set.
Status FabricNic::create_endpoint(struct fi_info* fi) {
  int rc = fi_endpoint(domain_.domain(), fi, &ep_, nullptr);
  if (rc != 0) {
    ep_ = nullptr;
    return Status(Code::kTransport, "fi_endpoint: %s", lib_.error_text(rc));
  }
  rc = fi_ep_bind(ep_, &av_.av()->fid, 0);
  if (rc != 0)
    return Status(Code::kTransport, "binding the address vector: %s", lib_.error_text(rc));
  rc = fi_ep_bind(ep_, &cq_.cq()->fid, FI_TRANSMIT | FI_RECV);
  if (rc != 0)
    return Status(Code::kTransport, "binding the completion queue: %s", lib_.error_text(rc));
  auto opts = set_endpoint_options(lib_, ep_, *fi);  // before fi_enable: EFA refuses them after
  if (!opts.ok()) return opts.status();
  info_.write_ordered_128 = opts->write_ordered_128;
  return Status::Ok();
}

FabricNic::~FabricNic() {
  if (ep_ != nullptr) close_fid(lib_, &ep_->fid, "endpoint");
  if (size_t n = mrs_.close_all())
    PONTE_LOG_WARN("fabric: NIC %s: closed %zu registrations still open at shutdown", info_.name.c_str(), n);
}

void FabricNic::warn_limited(const char* fmt, ...) {
  // The first few, then one in a thousand: a dead peer can fail thousands of operations.
  ++warnings_;
  if (warnings_ > 8 && warnings_ % 1000 != 0) return;
  char line[256];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(line, sizeof(line), fmt, ap);
  va_end(ap);
  PONTE_LOG_WARN("fabric: NIC %s: %s (warning %llu)", info_.name.c_str(), line,
                 static_cast<unsigned long long>(warnings_));
}

// --- peers ---------------------------------------------------------------------------------

Result<NicPeer> FabricNic::add_peer(std::span<const uint8_t> peer_address) {
  return av_.insert(peer_address, address_);
}

Result<std::vector<uint8_t>> FabricNic::connect_blob(NicPeer) {
  return std::vector<uint8_t>();  // FI_EP_RDM is connectionless
}

Status FabricNic::complete_connect(NicPeer, std::span<const uint8_t>) { return Status::Ok(); }

// Providers do not fail operations toward a peer that is gone (rxd never completes them, rxm and
// net answer -FI_EAGAIN forever): removing the peer ends them here, as kCancelled completions
// reported by the next polls. Their contexts stay taken until the provider lets go of them (it
// may still write into them), which is at the latest when the NIC closes.
void FabricNic::remove_peer(NicPeer peer) {
  if (av_.lookup(peer) == FI_ADDR_NOTAVAIL) return;
  for (uint32_t i = 0; i < ops_.tx_count(); ++i) {
    OpContext* op = ops_.slot(i);
    if (op->in_use && !op->orphaned && op->peer == peer) {
      op->orphaned = true;
      cancelled_[cancelled_count_++] = op;
    }
  }
  av_.remove(peer);
}

int FabricNic::report_cancelled(Completion* out, int max) {
  int n = 0;
  while (cancelled_count_ > 0 && n < max) {
    OpContext* op = cancelled_[--cancelled_count_];
    out[n++] = Completion{op->ctx, 0, 0, CompletionKind::kLocal, Code::kCancelled};
  }
  return n;
}

// --- memory --------------------------------------------------------------------------------

Result<NicMr> FabricNic::register_memory(const MemoryDesc& mem) {
  return mrs_.register_memory(domain_.domain(), ep_, mem);
}

void FabricNic::deregister(const NicMr& mr) { mrs_.deregister(mr); }

// --- posts ---------------------------------------------------------------------------------

Status FabricNic::post_failed(ssize_t rc, const char* what, OpContext* op) {
  ops_.give(op);
  if (rc == -FI_EAGAIN) return again_status();
  return Status(Code::kTransport, "%s: %s (%zd)", what, lib_.error_text(rc), rc);
}

Status FabricNic::check_length(size_t len) const {
  if (len <= info_.max_msg_size) return Status::Ok();
  return Status(Code::kInvalidArgument, "%zu bytes is over this NIC's largest message (%zu)", len,
                info_.max_msg_size);
}

#define PONTE_FABRIC_PEER_OR_RETURN(addr, peer)                                       \
  fi_addr_t addr = av_.lookup(peer);                                                  \
  if (addr == FI_ADDR_NOTAVAIL) [[unlikely]]                                          \
  return Status(Code::kInvalidArgument, "unknown or removed peer %u on NIC %s", peer, \
                info_.name.c_str())

// The common start of every transmit: the length check and a context slot for the completion.
OpContext* FabricNic::begin_tx(size_t len, NicPeer peer, uint64_t ctx, Status* st) {
  if (len > info_.max_msg_size) [[unlikely]] {
    *st = check_length(len);
    return nullptr;
  }
  OpContext* op = ops_.take_tx();
  if (op == nullptr) [[unlikely]] {
    *st = again_status();
    return nullptr;
  }
  op->ctx = ctx;
  op->peer = peer;
  return op;
}

Status FabricNic::post_write(const WriteWr& wr) {
  PONTE_FABRIC_PEER_OR_RETURN(dest, wr.peer);
  Status st;
  OpContext* op = begin_tx(wr.len, wr.peer, wr.ctx, &st);
  if (op == nullptr) [[unlikely]]
    return st;
  ssize_t rc =
      wr.has_imm ? fi_writedata(ep_, wr.local, wr.len, wr.desc, wr.imm, dest, wr.remote_addr,
                                wr.rkey, &op->fi)
                 : fi_write(ep_, wr.local, wr.len, wr.desc, dest, wr.remote_addr, wr.rkey, &op->fi);
  if (rc == 0) [[likely]]
    return Status::Ok();
  return post_failed(rc, wr.has_imm ? "fi_writedata" : "fi_write", op);
}

Status FabricNic::post_read(NicPeer peer, void* local, size_t len, void* desc, uint64_t remote_addr,
                            uint64_t rkey, uint64_t ctx) {
  PONTE_FABRIC_PEER_OR_RETURN(src, peer);
  Status st;
  OpContext* op = begin_tx(len, peer, ctx, &st);
  if (op == nullptr) [[unlikely]]
    return st;
  ssize_t rc = fi_read(ep_, local, len, desc, src, remote_addr, rkey, &op->fi);
  if (rc == 0) [[likely]]
    return Status::Ok();
  return post_failed(rc, "fi_read", op);
}

Status FabricNic::post_send(NicPeer peer, const void* buf, size_t len, void* desc, uint32_t imm,
                            uint64_t ctx, bool /*inline_ok*/) {
  PONTE_FABRIC_PEER_OR_RETURN(dest, peer);
  Status st;
  OpContext* op = begin_tx(len, peer, ctx, &st);
  if (op == nullptr) [[unlikely]]
    return st;
  ssize_t rc = fi_senddata(ep_, buf, len, desc, imm, dest, &op->fi);
  if (rc == 0) [[likely]]
    return Status::Ok();
  return post_failed(rc, "fi_senddata", op);
}

Status FabricNic::post_recv(void* buf, size_t len, void* desc, uint64_t ctx) {
  OpContext* op = ops_.take_rx();
  if (op == nullptr) return again_status();
  op->ctx = ctx;
  op->buf = buf;
  op->len = len;
  op->desc = desc;
  ssize_t rc = fi_recv(ep_, buf, len, desc, FI_ADDR_UNSPEC, &op->fi);
  if (rc == 0) [[likely]]
    return Status::Ok();
  return post_failed(rc, "fi_recv", op);
}

#undef PONTE_FABRIC_PEER_OR_RETURN

// --- completions ---------------------------------------------------------------------------

// Classifies one successful completion. false: nothing to report (not ours, no data).
bool FabricNic::classify(const struct fi_cq_data_entry& entry, Completion* out) {
  OpContext* op = ops_.find(entry.op_context);
  if (op != nullptr) {
    if (op->orphaned) [[unlikely]] {
      ops_.give(op);  // already reported as cancelled
      return false;
    }
    if (op->kind == CompletionKind::kRecv) {
      if ((entry.flags & (FI_RMA | FI_REMOTE_WRITE)) != 0) {
        // FI_RX_CQ_DATA: a peer's write with data consumed this receive. Report the write only
        // and give the buffer back to the provider (below, once the batch is read).
        *out = Completion{0, static_cast<uint32_t>(entry.data), 0, CompletionKind::kRemoteWrite,
                          Code::kOk};
        repost_[repost_count_++] = op;
        return true;
      }
      uint32_t imm = (entry.flags & FI_REMOTE_CQ_DATA) ? static_cast<uint32_t>(entry.data) : 0;
      uint32_t len = static_cast<uint32_t>(std::min<size_t>(entry.len, UINT32_MAX));
      *out = Completion{op->ctx, imm, len, CompletionKind::kRecv, Code::kOk};
    } else {
      *out = Completion{op->ctx, 0, 0, CompletionKind::kLocal, Code::kOk};
    }
    ops_.give(op);
    return true;
  }
  if (entry.flags & FI_REMOTE_CQ_DATA) {
    // A peer's write with immediate landed. Its len is 0 on rxm/net and the size on rxd/shm:
    // report 0 everywhere so that nobody depends on it.
    *out = Completion{0, static_cast<uint32_t>(entry.data), 0, CompletionKind::kRemoteWrite,
                      Code::kOk};
    return true;
  }
  return false;  // a provider-internal or remote completion ponte did not ask for
}

// A lost connection (ENOTCONN, ECONNRESET, a flush with ECANCELED) and EIO, whose cause is
// unknown, count as broken: the cautious side, since a connection that broke unnoticed would
// leave its users waiting, while a needless rebuild only fails what was in flight.
bool refuses_one_operation(int err) {
  switch (err) {
    case FI_EACCES:
    case FI_EINVAL:
    case FI_EFAULT:
    case FI_EMSGSIZE:
    case FI_EOVERFLOW:
    case FI_ETRUNC:
    case FI_EKEYREJECTED:
    case FI_ENOKEY:
    case FI_EBADFLAGS:
      return true;
    default:
      return false;
  }
}

// Reads one error completion: -1 none could be read, 0 read but not ponte's, 1 reported in *out.
int FabricNic::read_error(Completion* out) {
  struct fi_cq_err_entry err = {};
  ssize_t rc = fi_cq_readerr(cq_.cq(), &err, 0);
  if (rc != 1) return -1;
  OpContext* op = ops_.find(err.op_context);
  if (op != nullptr && op->orphaned) {
    ops_.give(op);  // already reported as cancelled
    return 0;
  }
  char detail[128];
  const char* text = fi_cq_strerror(cq_.cq(), err.prov_errno, err.err_data, detail, sizeof(detail));
  const char* what = op == nullptr                       ? "no context"
                     : op->kind == CompletionKind::kRecv ? "receive"
                                                         : "operation";
  warn_limited("error completion (%s): %s [%s]", what, lib_.error_text(err.err), text ? text : "");
  if (op == nullptr) return 0;
  *out = Completion{op->ctx, 0, 0, op->kind, Code::kTransport};
  out->op_only = refuses_one_operation(err.err);
  ops_.give(op);
  return 1;
}

// Posts again the receives that remote writes consumed. A receive that cannot be posted again for
// a reason other than back-pressure is handed back to its owner as a failed receive.
void FabricNic::repost_consumed_receives(Completion* out, int max, int* n) {
  uint32_t kept = 0;
  for (uint32_t i = 0; i < repost_count_; ++i) {
    OpContext* op = repost_[i];
    ssize_t rc = fi_recv(ep_, op->buf, op->len, op->desc, FI_ADDR_UNSPEC, &op->fi);
    if (rc == 0) continue;
    if (rc == -FI_EAGAIN || *n >= max) {
      repost_[kept++] = op;
      continue;
    }
    warn_limited("posting a receive again failed: %s", lib_.error_text(rc));
    out[(*n)++] = Completion{op->ctx, 0, 0, CompletionKind::kRecv, Code::kTransport};
    ops_.give(op);
  }
  repost_count_ = kept;
}

int FabricNic::poll(Completion* out, int max) {
  int n = 0;
  if (cancelled_count_ > 0) [[unlikely]]
    n = report_cancelled(out, max);
  if (repost_count_ > 0) [[unlikely]]
    repost_consumed_receives(out, max, &n);
  struct fi_cq_data_entry entries[kPollBatch];
  // Bounded: entries that are not ponte's (or error entries) could otherwise keep one call busy.
  for (int round = 0; n < max && round < kPollRounds; ++round) {
    size_t want = static_cast<size_t>(std::min(max - n, kPollBatch));
    ssize_t got = fi_cq_read(cq_.cq(), entries, want);
    if (got == -FI_EAGAIN) break;
    if (got == -FI_EAVAIL) {
      int r = read_error(&out[n]);
      if (r < 0) break;
      n += r;
      continue;
    }
    if (got < 0) [[unlikely]] {
      warn_limited("fi_cq_read: %s", lib_.error_text(got));
      break;
    }
    for (ssize_t i = 0; i < got; ++i) {
      if (classify(entries[i], &out[n])) ++n;
    }
    if (static_cast<size_t>(got) < want) break;
  }
  if (repost_count_ > 0) [[unlikely]]
    repost_consumed_receives(out, max, &n);
  return n;
}

bool FabricNic::arm_wait() {
  if (cq_.wait_fd() < 0 || cancelled_count_ > 0 || repost_count_ > 0) return false;
  struct fid* fids[1] = {&cq_.cq()->fid};
  return fi_trywait(domain_.fabric(), fids, 1) == FI_SUCCESS;
}

}  // namespace ponte::fabric
