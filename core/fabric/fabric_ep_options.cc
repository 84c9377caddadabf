// Endpoint options: EFA's 128-byte write ordering and FI_OPT_CUDA_API_PERMITTED, tolerating
// providers and libraries that do not know them.
#include "core/fabric/fabric_ep_options.h"

#include <rdma/fi_errno.h>

#include <cstring>

#include "core/log.h"

namespace ponte::fabric {
namespace {

// 1: granted, 0: the provider does not have the option, <0: it failed (the libfabric code).
int set_bool(struct fid_ep* ep, int name, bool value) {
  int rc = fi_setopt(&ep->fid, FI_OPT_ENDPOINT, name, &value, sizeof(value));
  if (rc == 0) return 1;
  if (rc == -FI_ENOPROTOOPT || rc == -FI_EOPNOTSUPP || rc == -FI_ENOSYS) return 0;
  return rc;
}

}  // namespace

bool is_efa_provider(const char* prov_name) {
  return prov_name != nullptr && std::strncmp(prov_name, "efa", 3) == 0;
}

Result<EndpointOptions> set_endpoint_options(const FabricLibrary& lib, struct fid_ep* ep,
                                             const struct fi_info& info) {
  EndpointOptions out;
  const char* prov = info.fabric_attr && info.fabric_attr->prov_name ? info.fabric_attr->prov_name : "";
  if (info.caps & FI_HMEM) {
    // The provider must not call CUDA from inside a libfabric call: NCCL may hold CUDA locks on
    // the proxy thread, and a cudaMemcpy there can deadlock (aws-ofi-nccl sets it too).
    int rc = set_bool(ep, kOptCudaApiPermitted, false);
    if (rc < 0)
      return Status(Code::kTransport, "fi_setopt(FI_OPT_CUDA_API_PERMITTED=false) on %s: %s", prov,
                    lib.error_text(rc));
    out.cuda_api_off = rc == 1;
    if (!out.cuda_api_off)
      PONTE_LOG_INFO("fabric: provider %s has no FI_OPT_CUDA_API_PERMITTED (libfabric < 1.18): it "
                     "may call CUDA itself on GPU memory", prov);
  }
  if (is_efa_provider(prov)) {
    int rc = set_bool(ep, kOptEfaWriteInOrderAligned128, true);
    if (rc < 0)
      return Status(Code::kTransport,
                    "fi_setopt(FI_OPT_EFA_WRITE_IN_ORDER_ALIGNED_128_BYTES) on %s: %s", prov,
                    lib.error_text(rc));
    out.write_ordered_128 = rc == 1;
  }
  return out;
}

}  // namespace ponte::fabric
