// The libibverbs function table: ponte dlopens libibverbs.so.1 (or PONTE_VERBS_LIB) at run time so a
// host without rdma-core still loads ponte. Only exported symbols are looked up; inline verbs are used.
#pragma once

#include <infiniband/verbs.h>

#include <string>

#include "core/status.h"

namespace ponte::verbs {

// Exported libibverbs entry points ponte calls. Names drop the ibv_ prefix because several ibv_*
// names are function-like macros in rdma-core's headers (ibv_reg_mr, ibv_query_port, ...).
// The data path (ibv_post_send, ibv_post_recv, ibv_post_srq_recv, ibv_poll_cq) is inline in
// verbs.h and goes through the context's ops table, so it needs no entry here.
struct VerbsApi {
  std::string path;  // what was dlopen'ed

  ibv_device** (*get_device_list)(int* num_devices) = nullptr;
  void (*free_device_list)(ibv_device** list) = nullptr;
  const char* (*get_device_name)(ibv_device* device) = nullptr;
  ibv_context* (*open_device)(ibv_device* device) = nullptr;
  int (*close_device)(ibv_context* context) = nullptr;
  int (*query_device)(ibv_context* context, ibv_device_attr* attr) = nullptr;
  // The real export behind verbs.h's inline ibv_query_port (it takes the older, shorter struct);
  // use query_port() below, which prefers the provider's own op as the inline wrapper does.
  int (*query_port_export)(ibv_context* context, uint8_t port, _compat_ibv_port_attr* attr) = nullptr;
  int (*query_gid)(ibv_context* context, uint8_t port, int index, ibv_gid* gid) = nullptr;
  ibv_pd* (*alloc_pd)(ibv_context* context) = nullptr;
  int (*dealloc_pd)(ibv_pd* pd) = nullptr;
  ibv_mr* (*reg_mr)(ibv_pd* pd, void* addr, size_t length, int access) = nullptr;
  // Optional (rdma-core >= 28 / >= 34): null when the library is older.
  ibv_mr* (*reg_mr_iova2)(ibv_pd* pd, void* addr, size_t length, uint64_t iova,
                          unsigned int access) = nullptr;
  ibv_mr* (*reg_dmabuf_mr)(ibv_pd* pd, uint64_t offset, size_t length, uint64_t iova, int fd,
                           int access) = nullptr;
  int (*dereg_mr)(ibv_mr* mr) = nullptr;
  ibv_cq* (*create_cq)(ibv_context* context, int cqe, void* cq_context, ibv_comp_channel* channel,
                       int comp_vector) = nullptr;
  int (*destroy_cq)(ibv_cq* cq) = nullptr;
  ibv_srq* (*create_srq)(ibv_pd* pd, ibv_srq_init_attr* attr) = nullptr;
  int (*destroy_srq)(ibv_srq* srq) = nullptr;
  ibv_qp* (*create_qp)(ibv_pd* pd, ibv_qp_init_attr* attr) = nullptr;
  int (*modify_qp)(ibv_qp* qp, ibv_qp_attr* attr, int attr_mask) = nullptr;
  int (*destroy_qp)(ibv_qp* qp) = nullptr;
  int (*query_qp)(ibv_qp* qp, ibv_qp_attr* attr, int attr_mask, ibv_qp_init_attr* init_attr) = nullptr;
  const char* (*wc_status_str)(ibv_wc_status status) = nullptr;
  int (*fork_init)() = nullptr;
  // Optional (rdma-core >= 35): null when the library is older.
  ibv_fork_status (*is_fork_initialized)() = nullptr;

  // ibv_query_port as verbs.h's inline wrapper does it: the provider's extended op when present,
  // else the export (the tail of the newer struct is zeroed). Returns 0 or an errno value.
  int query_port(ibv_context* context, uint8_t port, ibv_port_attr* attr) const;
  // "remote access error" etc.; never null.
  const char* status_str(ibv_wc_status status) const;
};

// fork() and registered memory. A child that shares a registered page makes the next write to it
// in the parent copy the page: the parent moves to the copy while the NIC keeps reading and writing
// the old one, which the child now holds, and RDMA data goes missing silently. Kernels from 5.12
// copy pinned pages into the child instead (libibverbs then reports IBV_FORK_UNNEEDED). Elsewhere
// (RHEL 8's 4.18, for one) ibv_fork_init() makes every registration MADV_DONTFORK, at one madvise
// per registration, and must come before the process's first registration: NCCL's IB transport
// calls it at init for the same reason (PyTorch forks DataLoader workers). What prepare_fork did:
enum class ForkSupport {
  kUnneeded,     // the kernel copies pinned pages on fork: nothing to do
  kEnabled,      // ibv_fork_init() succeeded (or had been called): registrations are MADV_DONTFORK
  kTooLate,      // memory was registered before (by another library): fork() is unsafe; warned
  kUnavailable,  // ibv_fork_init() failed otherwise (no MADV_DONTFORK): warned
};
// Asks the kernel's answer through api (is_fork_initialized) and calls api.fork_init where needed.
ForkSupport decide_fork(const VerbsApi& api);
// decide_fork once per process (later calls return the first answer), logged; called by the verbs
// backend before ponte's first registration.
ForkSupport prepare_fork(const VerbsApi& api);

// Loads lib once per process and path (lib empty: "libibverbs.so.1"); the table lives until exit.
// kUnavailable names the library and dlerror() when it or a required symbol is missing (a failed
// load is not remembered, so a later call may succeed).
Result<const VerbsApi*> load_verbs_api(const std::string& lib);

}  // namespace ponte::verbs
