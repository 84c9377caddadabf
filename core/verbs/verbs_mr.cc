// Memory registration.
#include "core/verbs/verbs_mr.h"

#include "core/log.h"

#include <sys/resource.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace ponte::verbs {

namespace {
constexpr int kAccess = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
}

ibv_mr* VerbsMemory::reg_host(void* addr, size_t len, int access) {
  if (api_.reg_mr_iova2 == nullptr) relaxed_ordering_ = false;
  if (!relaxed_ordering_) return api_.reg_mr(pd_, addr, len, access);
  ibv_mr* mr = api_.reg_mr_iova2(pd_, addr, len, reinterpret_cast<uintptr_t>(addr),
                                 static_cast<unsigned>(access | IBV_ACCESS_RELAXED_ORDERING));
  if (mr != nullptr || (errno != EINVAL && errno != EOPNOTSUPP)) return mr;
  mr = api_.reg_mr(pd_, addr, len, access);
  if (mr != nullptr) relaxed_ordering_ = false;  // a kernel that rejects optional access flags
  return mr;
}

Result<NicMr> VerbsMemory::register_memory(const MemoryDesc& mem) {
  if (mem.addr == nullptr || mem.len == 0) {
    return Status(Code::kInvalidArgument, "register_memory: empty range (addr %p, len %zu)",
                  mem.addr, mem.len);
  }
  ibv_mr* mr = nullptr;
  if (mem.kind == MemKind::kHost) {
    mr = reg_host(mem.addr, mem.len, kAccess);
    if (mr == nullptr) {
      const int err = errno;
      // Registration pins the pages: without CAP_IPC_LOCK the kernel refuses past RLIMIT_MEMLOCK
      // with ENOMEM, which reads like an out-of-memory error unless the limit is named.
      rlimit lim{};
      if (err == ENOMEM && getrlimit(RLIMIT_MEMLOCK, &lim) == 0 && lim.rlim_cur != RLIM_INFINITY)
        return Status(Code::kResource, "ibv_reg_mr(%zu bytes) failed: %s (locked memory, ulimit -l, is %llu KiB)",
                      mem.len, strerror(err), static_cast<unsigned long long>(lim.rlim_cur >> 10));
      return Status(Code::kResource, "ibv_reg_mr(%p, %zu) failed: %s", mem.addr, mem.len, strerror(err));
    }
  } else if (mem.dmabuf_fd >= 0) {
    if (api_.reg_dmabuf_mr == nullptr) {
      return Status(Code::kUnavailable, "%s has no ibv_reg_dmabuf_mr (rdma-core < 34)",
                    api_.path.c_str());
    }
    int access = kAccess | (relaxed_ordering_ ? IBV_ACCESS_RELAXED_ORDERING : 0);
    mr = api_.reg_dmabuf_mr(pd_, mem.dmabuf_offset, mem.len, reinterpret_cast<uintptr_t>(mem.addr),
                            mem.dmabuf_fd, access);
    if (mr == nullptr && relaxed_ordering_) {
      mr = api_.reg_dmabuf_mr(pd_, mem.dmabuf_offset, mem.len,
                              reinterpret_cast<uintptr_t>(mem.addr), mem.dmabuf_fd, kAccess);
    }
    if (mr == nullptr) {
      return Status(Code::kResource, "ibv_reg_dmabuf_mr(fd %d, %zu bytes, GPU %d) failed: %s",
                    mem.dmabuf_fd, mem.len, mem.cuda_device, strerror(errno));
    }
  } else {
    mr = reg_host(mem.addr, mem.len, kAccess);  // nvidia-peermem resolves the device pointer
    if (mr == nullptr) {
      return Status(Code::kResource,
                    "ibv_reg_mr(GPU %d memory %p, %zu) failed: %s (is nvidia-peermem loaded?)",
                    mem.cuda_device, mem.addr, mem.len, strerror(errno));
    }
  }
  open_.push_back(mr);
  NicMr out;
  out.handle = mr;
  out.desc = mr;
  out.rkey = mr->rkey;
  out.remote_base = reinterpret_cast<uintptr_t>(mem.addr);
  return out;
}

void VerbsMemory::deregister(const NicMr& mr) {
  auto* m = static_cast<ibv_mr*>(mr.handle);
  if (m == nullptr) return;
  for (size_t i = 0; i < open_.size(); i++) {
    if (open_[i] != m) continue;
    open_[i] = open_.back();
    open_.pop_back();
    api_.dereg_mr(m);
    return;
  }
  PONTE_LOG_WARN("verbs: deregistering memory that is not registered here (ignored)");
}

VerbsMemory::~VerbsMemory() {
  if (!open_.empty())
    PONTE_LOG_WARN("verbs: closing %zu registrations still open at shutdown", open_.size());
  for (ibv_mr* m : open_) api_.dereg_mr(m);
}

bool probe_dmabuf(const VerbsApi& api, ibv_pd* pd) {
  if (api.reg_dmabuf_mr == nullptr) return false;
  errno = 0;
  ibv_mr* mr = api.reg_dmabuf_mr(pd, 0, 0, 0, -1, 0);
  if (mr != nullptr) {  // no provider accepts fd -1, but be tidy
    api.dereg_mr(mr);
    return true;
  }
  return errno != EOPNOTSUPP && errno != EPROTONOSUPPORT && errno != ENOSYS;
}

bool peermem_loaded() {
  return access("/sys/kernel/mm/memory_peers/nv_mem/version", F_OK) == 0 ||
         access("/sys/module/nvidia_peermem", F_OK) == 0 ||
         access("/sys/module/nv_peer_mem", F_OK) == 0;
}

}  // namespace ponte::verbs
