// Memory registration: requested keys, FI_MR_ENDPOINT binding, host and CUDA (FI_HMEM) memory.
#include "core/fabric/fabric_mr.h"

#include <sys/uio.h>

#include "core/log.h"

namespace ponte::fabric {
namespace {

constexpr uint64_t kAccess =
    FI_READ | FI_WRITE | FI_REMOTE_READ | FI_REMOTE_WRITE | FI_SEND | FI_RECV;
// A duplicate requested key (-FI_ENOKEY) is retried with the next one this many times.
constexpr int kKeyAttempts = 16;

}  // namespace

void FabricMrTable::init(const FabricLibrary& lib, const struct fi_info& info) {
  lib_ = &lib;
  mr_mode_ = static_cast<uint64_t>(info.domain_attr->mr_mode);
  size_t key_size = info.domain_attr->mr_key_size;
  key_mask_ = key_size == 0 || key_size >= 8 ? ~0ull : (1ull << (8 * key_size)) - 1;
  device_memory_ = (info.caps & FI_HMEM) != 0;
#ifdef FI_MR_DMABUF
  dmabuf_ = device_memory_;
#else
  dmabuf_ = false;  // headers older than libfabric 1.18: CUDA memory is registered by address
#endif
}

uint64_t FabricMrTable::next_key() {
  key_counter_ = (key_counter_ + 1) & key_mask_;
  if (key_counter_ == 0) key_counter_ = 1;
  return key_counter_;
}

Result<NicMr> FabricMrTable::register_memory(struct fid_domain* domain, struct fid_ep* ep,
                                             const MemoryDesc& mem) {
  if (mem.addr == nullptr || mem.len == 0) {
    return Status(Code::kInvalidArgument, "cannot register an empty region (addr %p, len %zu)",
                  mem.addr, mem.len);
  }
  struct iovec iov = {mem.addr, mem.len};
  struct fi_mr_attr attr = {};
  attr.mr_iov = &iov;
  attr.iov_count = 1;
  attr.access = kAccess;
  attr.iface = FI_HMEM_SYSTEM;
  uint64_t flags = 0;
  if (mem.kind == MemKind::kCuda) {
    if (!device_memory_) {
      return Status(Code::kUnavailable,
                    "this libfabric provider has no FI_HMEM: CUDA memory cannot be registered");
    }
    if (mem.cuda_device < 0) {
      return Status(Code::kInvalidArgument,
                    "CUDA memory at %p: its device ordinal is unknown (FI_HMEM needs the real one)",
                    mem.addr);
    }
    attr.iface = FI_HMEM_CUDA;
    attr.device.cuda = mem.cuda_device;
#ifdef FI_MR_DMABUF
    struct fi_mr_dmabuf dmabuf = {};
    if (mem.dmabuf_fd >= 0) {
      dmabuf.fd = mem.dmabuf_fd;
      dmabuf.offset = mem.dmabuf_offset;
      dmabuf.len = mem.len;
      dmabuf.base_addr = mem.addr;
      attr.dmabuf = &dmabuf;
      flags |= FI_MR_DMABUF;
    }
#endif
  }
  const bool prov_key = (mr_mode_ & FI_MR_PROV_KEY) != 0;
  struct fid_mr* mr = nullptr;
  int rc = 0;
  for (int attempt = 0; attempt < kKeyAttempts; ++attempt) {
    attr.requested_key = prov_key ? 0 : next_key();
    rc = fi_mr_regattr(domain, &attr, flags, &mr);
    if (rc != -FI_ENOKEY || prov_key) break;
  }
  if (rc != 0) {
    return Status(rc == -FI_ENOMEM ? Code::kResource : Code::kTransport,
                  "fi_mr_regattr(%zu bytes at %p): %s", mem.len, mem.addr, lib_->error_text(rc));
  }
  if (mr_mode_ & FI_MR_ENDPOINT) {
    rc = fi_mr_bind(mr, &ep->fid, 0);
    if (rc == 0) rc = fi_mr_enable(mr);
    if (rc != 0) {
      fi_close(&mr->fid);
      return Status(Code::kTransport, "binding a registration to the endpoint: %s",
                    lib_->error_text(rc));
    }
  }
  uint64_t key = fi_mr_key(mr);
  if (key == FI_KEY_NOTAVAIL) {
    fi_close(&mr->fid);
    return Status(Code::kUnavailable, "provider uses raw MR keys (FI_MR_RAW), ponte does not");
  }
  NicMr out;
  out.handle = mr;
  out.desc = fi_mr_desc(mr);
  out.rkey = key;
  out.remote_base = virt_addr() ? reinterpret_cast<uint64_t>(mem.addr) : 0;
  open_.push_back(mr);
  return out;
}

void FabricMrTable::deregister(const NicMr& nic_mr) {
  auto* mr = static_cast<struct fid_mr*>(nic_mr.handle);
  if (mr == nullptr) return;
  for (size_t i = 0; i < open_.size(); i++) {
    if (open_[i] != mr) continue;
    open_[i] = open_.back();
    open_.pop_back();
    int rc = fi_close(&mr->fid);
    if (rc != 0) PONTE_LOG_WARN("fabric: deregistering memory failed: %s", lib_->error_text(rc));
    return;
  }
  PONTE_LOG_WARN("fabric: deregistering memory that is not registered here (ignored)");
}

size_t FabricMrTable::close_all() {
  const size_t n = open_.size();
  for (struct fid_mr* mr : open_) {
    int rc = fi_close(&mr->fid);
    if (rc != 0) PONTE_LOG_WARN("fabric: closing a registration failed: %s", lib_->error_text(rc));
  }
  open_.clear();
  return n;
}

}  // namespace ponte::fabric
