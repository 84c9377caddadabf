// Endpoint options ponte asks of a libfabric provider before enabling an endpoint: EFA's 128-byte
// write ordering (NCCL's LL128) and no CUDA calls inside the provider where it may touch GPU memory.
#pragma once

#include <rdma/fabric.h>
#include <rdma/fi_endpoint.h>

#include "core/fabric/fabric_loader.h"

namespace ponte::fabric {

// Option numbers. The libfabric 1.17 headers ponte may build against lack both (they arrived in
// libfabric 1.18, as enum members, so they cannot be tested with #ifdef): the values below are the
// ones libfabric 1.18+ defines, in rdma/fi_ext.h (EFA's provider-specific options, counted from
// -FI_PROV_SPECIFIC_EFA: RNR_RETRY, EMULATED_READ, EMULATED_WRITE, EMULATED_ATOMICS,
// USE_DEVICE_RDMA, SENDRECV_IN_ORDER_ALIGNED_128_BYTES, WRITE_IN_ORDER_ALIGNED_128_BYTES) and
// rdma/fi_endpoint.h (FI_OPT_CUDA_API_PERMITTED follows FI_OPT_XPU_TRIGGER). A library older than
// 1.18 answers -FI_ENOPROTOOPT, which ponte tolerates.
#if FI_VERSION_GE(FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION), FI_VERSION(1, 18))
constexpr int kOptEfaWriteInOrderAligned128 = FI_OPT_EFA_WRITE_IN_ORDER_ALIGNED_128_BYTES;
constexpr int kOptCudaApiPermitted = FI_OPT_CUDA_API_PERMITTED;
#else
constexpr int kOptEfaWriteInOrderAligned128 = -(0xefa << 16) + 6;
constexpr int kOptCudaApiPermitted = FI_OPT_XPU_TRIGGER + 1;
#endif

// What the provider granted.
struct EndpointOptions {
  bool write_ordered_128 = false;  // writes land in order per aligned 128-byte line
  bool cuda_api_off = false;       // the provider promised not to call CUDA itself
};

// Sets the options on ep (created, not yet enabled) for this fi_info: 128-byte write ordering on
// the efa provider; FI_OPT_CUDA_API_PERMITTED=false where the endpoint has FI_HMEM. A provider or
// library without an option (-FI_ENOPROTOOPT, -FI_EOPNOTSUPP) is not an error: the option is just
// not granted. Any other failure is.
Result<EndpointOptions> set_endpoint_options(const FabricLibrary& lib, struct fid_ep* ep,
                                             const struct fi_info& info);

// Whether the provider's name asks for EFA's options ("efa", "efa-direct", "efa;ofi_rxd" ...).
bool is_efa_provider(const char* prov_name);

}  // namespace ponte::fabric
