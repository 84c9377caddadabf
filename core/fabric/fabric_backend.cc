// fi_getinfo for ponte's needs, the device list, and open_fabric_backend().
#include "core/fabric/fabric_backend.h"

#include "core/cuda_memory.h"

#include <rdma/fi_domain.h>
#include <rdma/fi_errno.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "core/fabric/fabric_endpoint.h"
#include "core/log.h"

namespace ponte {
namespace fabric {
namespace {

constexpr uint64_t kCaps =
    FI_MSG | FI_RMA | FI_READ | FI_WRITE | FI_REMOTE_READ | FI_REMOTE_WRITE | FI_SEND | FI_RECV;
// What ponte can live with: contexts are always fi_context2-sized; FI_RX_CQ_DATA is handled by
// reposting the consumed receive.
constexpr uint64_t kModes = FI_CONTEXT | FI_CONTEXT2 | FI_RX_CQ_DATA;
constexpr int kMrModes =
    FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY | FI_MR_ENDPOINT | FI_MR_HMEM;

// fi_getinfo for provider with or without FI_HMEM. *out is the list (free with freeinfo).
int query(const FabricLibrary& lib, const std::string& provider, bool hmem, struct fi_info** out) {
  struct fi_info* hints = lib.allocinfo();
  if (hints == nullptr) return -FI_ENOMEM;
  hints->caps = kCaps | (hmem ? FI_HMEM : 0);
  hints->mode = kModes;
  hints->ep_attr->type = FI_EP_RDM;
  hints->domain_attr->mr_mode = kMrModes;
  // Remote CQ data is asked for by size: FI_REMOTE_CQ_DATA in caps makes fi_getinfo fail (-61).
  hints->domain_attr->cq_data_size = 4;
  hints->domain_attr->threading = FI_THREAD_DOMAIN;
  hints->domain_attr->av_type = FI_AV_TABLE;
  hints->fabric_attr->prov_name = strdup(provider.c_str());  // freed by freeinfo
  int rc = lib.getinfo(lib.api_version, nullptr, nullptr, 0, hints, out);
  lib.freeinfo(hints);
  return rc;
}

// lib_version: fi_version() of the loaded library.
NicInfo describe(const struct fi_info& info, uint32_t lib_version) {
  NicInfo out;
  out.name = info.domain_attr->name ? info.domain_attr->name : "";
  out.provider = info.fabric_attr->prov_name ? info.fabric_attr->prov_name : "";
  out.post_may_block_on_peer = out.provider == "shm";  // it spins on a lock in the peer's memory
  // Which providers' fi_trywait resets the CQ's wait object. Before 1.18, tcp;ofi_rxm is rxm over
  // the old tcp code, whose fi_trywait is libfabric's common one: it resets (checked here, 1.17).
  // net (1.17) and tcp from 1.18 on are one code (xnet), whose fi_trywait returned 0 and reset
  // nothing until upstream commit 9057c4c95 ("prov/tcp: Fix spinning on fi_trywait()", in 1.19):
  // seen here as 3,719 wake-ups of an idle worker in 500 ms over net (tests/fabric checks both
  // behaviours on this host). From 1.19 on it resets: not checked here (Debian 12 has 1.17).
  const bool xnet_fixed = lib_version >= FI_VERSION(1, 19);
  if (out.provider == "tcp;ofi_rxm") out.cq_wait_resets = lib_version < FI_VERSION(1, 18) || xnet_fixed;
  if (out.provider == "net" || out.provider == "tcp") out.cq_wait_resets = xnet_fixed;
  if (info.nic != nullptr && info.nic->bus_attr != nullptr &&
      info.nic->bus_attr->bus_type == FI_BUS_PCI) {
    const struct fi_pci_attr& pci = info.nic->bus_attr->attr.pci;
    char bdf[32];
    snprintf(bdf, sizeof(bdf), "%04x:%02x:%02x.%x", pci.domain_id, pci.bus_id, pci.device_id,
             pci.function_id);
    out.pci_bus_id = bdf;
  }
  if (info.nic != nullptr && info.nic->link_attr != nullptr) {
    out.speed_mbps = info.nic->link_attr->speed / 1000000;  // bits per second -> Mbps
  }
  out.max_msg_size = info.ep_attr->max_msg_size;
  out.max_inline = info.tx_attr->inject_size;
  out.virt_addr = (info.domain_attr->mr_mode & FI_MR_VIRT_ADDR) != 0;
  out.device_memory = (info.caps & FI_HMEM) != 0;
#ifdef FI_MR_DMABUF
  out.dmabuf = out.device_memory;
#else
  out.dmabuf = false;
#endif
  return out;
}

}  // namespace

Result<std::unique_ptr<FabricBackend>> FabricBackend::open(const Config& cfg) {
  PONTE_ASSIGN_OR_RETURN(
      const FabricLibrary* lib,
      load_fabric_library(fabric_library_candidates(cfg.fabric_lib), !cfg.fabric_lib.empty()));
  const std::string provider = cfg.fabric_provider.empty() ? "efa" : cfg.fabric_provider;
  // FI_HMEM only where there is device memory to register: it is not free. shm, for one, turns
  // its CMA copies off for an FI_HMEM endpoint and halves host-memory bandwidth.
  const bool want_hmem = cfg.fabric_hmem == 1 || (cfg.fabric_hmem == -1 && cuda_driver_usable());
  struct fi_info* list = nullptr;
  int rc = want_hmem ? query(*lib, provider, /*hmem=*/true, &list) : -FI_ENODATA;
  if (rc == -FI_ENODATA) rc = query(*lib, provider, /*hmem=*/false, &list);
  if (rc != 0) {
    // libfabric's own filter hides every provider it does not name (aws-ofi-nccl's users often
    // export FI_PROVIDER=efa): say so, or the provider looks absent.
    const char* filter = getenv("FI_PROVIDER");
    if (filter != nullptr)
      return Status(Code::kUnavailable,
                    "libfabric offers no '%.24s' RDM endpoint with RMA + CQ data (%s); FI_PROVIDER=%.20s is set",
                    provider.c_str(), lib->error_text(rc), filter);
    return Status(Code::kUnavailable, "libfabric provider '%.24s' has no RDM endpoint with RMA + CQ data: %s",
                  provider.c_str(), lib->error_text(rc));
  }
  std::unique_ptr<FabricBackend> backend(new FabricBackend(*lib, cfg));
  for (struct fi_info* it = list; it != nullptr; it = it->next) {
    if (it->domain_attr == nullptr || it->domain_attr->name == nullptr) continue;
    bool seen = false;
    for (const NicInfo& d : backend->devices_) seen = seen || d.name == it->domain_attr->name;
    if (seen) continue;  // e.g. tcp offers IPv4 and IPv6 fabrics on one interface: keep the first
    struct fi_info* copy = lib->dupinfo(it);
    if (copy == nullptr) continue;
    backend->infos_.push_back(copy);
    backend->devices_.push_back(describe(*copy, lib->version));
  }
  lib->freeinfo(list);
  if (backend->devices_.empty()) {
    return Status(Code::kUnavailable, "libfabric provider '%.40s' offers no device",
                  provider.c_str());
  }
  return backend;
}

FabricBackend::~FabricBackend() {
  for (struct fi_info* info : infos_) lib_.freeinfo(info);
}

Result<std::unique_ptr<Nic>> FabricBackend::open_nic(size_t device_index) {
  if (device_index >= infos_.size()) {
    return Status(Code::kInvalidArgument, "no libfabric device %zu (%zu listed)", device_index,
                  infos_.size());
  }
  const NicInfo& nic = devices_[device_index];
  const bool cq_wait = wake_on_data_ && (nic.cq_wait_resets || wake_unchecked_);
  if (wake_on_data_ && !cq_wait) {
    PONTE_LOG_INFO("fabric: NIC %s: PONTE_IDLE_WAKE is not used on provider %s with libfabric %u.%u: its "
                   "fi_trywait is not known to reset a completion queue's wait object (README)",
                   nic.name.c_str(), nic.provider.c_str(), FI_MAJOR(lib_.version), FI_MINOR(lib_.version));
  }
  return FabricNic::open(lib_, *infos_[device_index], nic, max_inflight_, cq_wait);
}

}  // namespace fabric

Result<std::unique_ptr<Backend>> open_fabric_backend(const Config& cfg) {
  PONTE_ASSIGN_OR_RETURN(std::unique_ptr<fabric::FabricBackend> backend,
                         fabric::FabricBackend::open(cfg));
  return std::unique_ptr<Backend>(std::move(backend));
}

}  // namespace ponte
