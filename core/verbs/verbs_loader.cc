// The libibverbs function table, filled by dlopen/dlsym.
#include "core/verbs/verbs_loader.h"

#include <dlfcn.h>

#include <cerrno>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>

#include "core/log.h"
#include "core/signal_guard.h"

// Keep the promise of this file: the calls below must go through the table, never the library.
#undef ibv_get_device_list
#undef ibv_query_port
#undef ibv_reg_mr

namespace ponte::verbs {

int VerbsApi::query_port(ibv_context* context, uint8_t port, ibv_port_attr* attr) const {
  // Same logic as verbs.h's ___ibv_query_port, minus the link-time reference to the export.
  verbs_context* vctx = verbs_get_ctx_op(context, query_port);
  if (vctx != nullptr) return vctx->query_port(context, port, attr, sizeof(*attr));
  memset(attr, 0, sizeof(*attr));
  return query_port_export(context, port, reinterpret_cast<_compat_ibv_port_attr*>(attr));
}

const char* VerbsApi::status_str(ibv_wc_status status) const {
  const char* s = wc_status_str != nullptr ? wc_status_str(status) : nullptr;
  return s != nullptr ? s : "unknown work completion status";
}

namespace {

template <typename Fn>
bool bind(void* handle, const char* name, Fn*& out, std::string* missing) {
  out = reinterpret_cast<Fn*>(dlsym(handle, name));
  if (out == nullptr && missing != nullptr) {
    if (!missing->empty()) *missing += ", ";
    *missing += name;
  }
  return out != nullptr;
}

Result<std::unique_ptr<VerbsApi>> load(const std::string& path) {
  SignalGuard keep_handlers(path);  // core/signal_guard.h
  dlerror();
  // The handle is never closed: provider plugins loaded by libibverbs keep global state, and
  // ibv objects handed to the engine must stay valid for the whole process.
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* err = dlerror();
    return Status(Code::kUnavailable, "cannot load %s (%s): install libibverbs1 or set PONTE_VERBS_LIB",
                  path.c_str(), err != nullptr ? err : "unknown error");
  }
  auto api = std::make_unique<VerbsApi>();
  api->path = path;
  std::string missing;
  bind(handle, "ibv_get_device_list", api->get_device_list, &missing);
  bind(handle, "ibv_free_device_list", api->free_device_list, &missing);
  bind(handle, "ibv_get_device_name", api->get_device_name, &missing);
  bind(handle, "ibv_open_device", api->open_device, &missing);
  bind(handle, "ibv_close_device", api->close_device, &missing);
  bind(handle, "ibv_query_device", api->query_device, &missing);
  bind(handle, "ibv_query_port", api->query_port_export, &missing);
  bind(handle, "ibv_query_gid", api->query_gid, &missing);
  bind(handle, "ibv_alloc_pd", api->alloc_pd, &missing);
  bind(handle, "ibv_dealloc_pd", api->dealloc_pd, &missing);
  bind(handle, "ibv_reg_mr", api->reg_mr, &missing);
  bind(handle, "ibv_dereg_mr", api->dereg_mr, &missing);
  bind(handle, "ibv_create_cq", api->create_cq, &missing);
  bind(handle, "ibv_destroy_cq", api->destroy_cq, &missing);
  bind(handle, "ibv_create_srq", api->create_srq, &missing);
  bind(handle, "ibv_destroy_srq", api->destroy_srq, &missing);
  bind(handle, "ibv_create_qp", api->create_qp, &missing);
  bind(handle, "ibv_modify_qp", api->modify_qp, &missing);
  bind(handle, "ibv_destroy_qp", api->destroy_qp, &missing);
  bind(handle, "ibv_query_qp", api->query_qp, &missing);
  bind(handle, "ibv_wc_status_str", api->wc_status_str, &missing);
  bind(handle, "ibv_fork_init", api->fork_init, &missing);
  if (!missing.empty()) {
    return Status(Code::kUnavailable, "%s lacks %.60s", path.c_str(), missing.c_str());
  }
  // Optional entry points of newer rdma-core.
  bind(handle, "ibv_reg_mr_iova2", api->reg_mr_iova2, nullptr);
  bind(handle, "ibv_reg_dmabuf_mr", api->reg_dmabuf_mr, nullptr);
  bind(handle, "ibv_is_fork_initialized", api->is_fork_initialized, nullptr);
  return api;
}

}  // namespace

ForkSupport decide_fork(const VerbsApi& api) {
  if (api.is_fork_initialized != nullptr && api.is_fork_initialized() == IBV_FORK_UNNEEDED)
    return ForkSupport::kUnneeded;
  const int rc = api.fork_init();
  if (rc == 0) return ForkSupport::kEnabled;
  return rc == EINVAL ? ForkSupport::kTooLate : ForkSupport::kUnavailable;
}

ForkSupport prepare_fork(const VerbsApi& api) {
  static std::mutex mu;
  static std::optional<ForkSupport> decided;
  std::lock_guard<std::mutex> lock(mu);
  if (decided) return *decided;
  decided = decide_fork(api);
  switch (*decided) {
    case ForkSupport::kUnneeded:
      PONTE_LOG_DEBUG("verbs: the kernel copies registered pages on fork(); no ibv_fork_init needed");
      break;
    case ForkSupport::kEnabled:
      PONTE_LOG_DEBUG("verbs: ibv_fork_init: registrations are MADV_DONTFORK (a kernel without copy-on-fork)");
      break;
    case ForkSupport::kTooLate:
      PONTE_LOG_WARN("verbs: ibv_fork_init came too late: this process registered RDMA memory before ponte "
                     "started (another library), and its kernel does not copy registered pages on fork(): "
                     "a fork() may lose RDMA data in this process. RDMAV_FORK_SAFE=1 in the environment "
                     "makes every registration fork-safe");
      break;
    case ForkSupport::kUnavailable:
      PONTE_LOG_WARN("verbs: ibv_fork_init failed (no MADV_DONTFORK?): a fork() may lose RDMA data in this "
                     "process");
      break;
  }
  return *decided;
}

Result<const VerbsApi*> load_verbs_api(const std::string& lib) {
  static std::mutex mu;
  static std::map<std::string, std::unique_ptr<VerbsApi>> loaded;  // never freed (see load)
  const std::string path = lib.empty() ? std::string("libibverbs.so.1") : lib;
  std::lock_guard<std::mutex> lock(mu);
  auto it = loaded.find(path);
  if (it != loaded.end()) return static_cast<const VerbsApi*>(it->second.get());
  auto api = load(path);
  if (!api.ok()) return api.status();
  const VerbsApi* raw = api.value().get();
  loaded.emplace(path, std::move(api).value());
  return raw;
}

}  // namespace ponte::verbs
