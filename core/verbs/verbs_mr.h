// Memory registration on a verbs protection domain: host memory with ibv_reg_mr, CUDA memory through
// a dmabuf (ibv_reg_dmabuf_mr) or nvidia-peermem (plain ibv_reg_mr on the device pointer).
#pragma once

#include <vector>

#include "core/nic.h"
#include "core/verbs/verbs_loader.h"

namespace ponte::verbs {

class VerbsMemory {
 public:
  VerbsMemory(const VerbsApi& api, ibv_pd* pd) : api_(api), pd_(pd) {}
  ~VerbsMemory();  // closes registrations still open (with a warning): the PD goes next
  VerbsMemory(const VerbsMemory&) = delete;
  VerbsMemory& operator=(const VerbsMemory&) = delete;

  // NicMr::handle and desc are the ibv_mr*, rkey is mr->rkey, remote_base is the address.
  Result<NicMr> register_memory(const MemoryDesc& mem);
  void deregister(const NicMr& mr);

 private:
  ibv_mr* reg_host(void* addr, size_t len, int access);

  const VerbsApi& api_;
  ibv_pd* pd_;
  std::vector<ibv_mr*> open_;  // registration is not a hot path: a plain list
  // IBV_ACCESS_RELAXED_ORDERING needs the ibv_reg_mr_iova2 entry point (rdma-core >= 28); dropped
  // for good after the first registration that refuses it.
  bool relaxed_ordering_ = true;
};

// Whether this device registers dmabufs (probed the way NCCL does: an invalid fd gives EBADF when
// supported, EOPNOTSUPP/EPROTONOSUPPORT when not).
bool probe_dmabuf(const VerbsApi& api, ibv_pd* pd);
// Whether nvidia-peermem (or the older nv_peer_mem) is loaded.
bool peermem_loaded();

}  // namespace ponte::verbs
