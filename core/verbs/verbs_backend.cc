// Device and port discovery for the verbs backend, and open_verbs_backend().
#include "core/verbs/verbs_backend.h"

#include <cerrno>
#include <cstring>
#include <string>

#include "core/verbs/verbs_hca_filter.h"
#include "core/verbs/verbs_mr.h"
#include "core/verbs/verbs_nic.h"
#include "core/verbs/verbs_qp.h"

namespace ponte {

Result<std::unique_ptr<Backend>> open_verbs_backend(const Config& cfg) {
  auto b = verbs::VerbsBackend::open(cfg);
  if (!b.ok()) return b.status();
  return std::unique_ptr<Backend>(std::move(b).value());
}

}  // namespace ponte

namespace ponte::verbs {

namespace {

const char* port_state_name(ibv_port_state s) {
  switch (s) {
    case IBV_PORT_DOWN: return "DOWN";
    case IBV_PORT_INIT: return "INIT";
    case IBV_PORT_ARMED: return "ARMED";
    case IBV_PORT_ACTIVE: return "ACTIVE";
    case IBV_PORT_ACTIVE_DEFER: return "ACTIVE_DEFER";
    default: return "NOP";
  }
}

void append_note(std::string* notes, const std::string& note) {
  if (notes->size() > 200) return;
  if (!notes->empty()) *notes += "; ";
  *notes += note;
}

}  // namespace

Result<std::unique_ptr<VerbsBackend>> VerbsBackend::open(const Config& cfg) {
  PONTE_ASSIGN_OR_RETURN(const VerbsApi* api, load_verbs_api(cfg.verbs_lib));
  PONTE_ASSIGN_OR_RETURN(HcaFilter filter, HcaFilter::parse(cfg.ib_hca));
  std::unique_ptr<VerbsBackend> b(new VerbsBackend(*api, cfg));
  prepare_fork(*api);  // before any registration (verbs_loader.h), as NCCL's IB transport does

  int count = 0;
  errno = 0;
  b->list_ = api->get_device_list(&count);
  if (b->list_ == nullptr) {
    return Status(Code::kUnavailable, "ibv_get_device_list failed: %s (no RDMA support in this kernel?)",
                  strerror(errno));
  }
  if (count == 0) {
    return Status(Code::kUnavailable, "%s loaded, but this host has no RDMA devices",
                  api->path.c_str());
  }

  std::string skipped;  // why ports were left out, for the error when none is left
  for (int d = 0; d < count; ++d) {
    ibv_device* dev = b->list_[d];
    const char* raw_name = api->get_device_name(dev);
    std::string name = raw_name != nullptr ? raw_name : "?";
    auto ctx = DeviceContext::open(*api, dev, name);
    if (!ctx.ok()) {
      append_note(&skipped, ctx.status().message());
      continue;
    }
    ibv_device_attr dattr{};
    if (api->query_device(ctx.value()->context(), &dattr) != 0) {
      append_note(&skipped, name + ": ibv_query_device failed");
      continue;
    }
    std::string pci = sysfs_pci_bus_id(name);
    bool dmabuf = probe_dmabuf(*api, ctx.value()->pd());
    bool peermem = peermem_loaded();
    uint32_t max_inline = 0;
    bool probed = false;
    for (uint8_t p = 1; p <= dattr.phys_port_cnt; ++p) {
      std::string port_name = name + ":" + std::to_string(p);
      if (!filter.accepts(name, p)) {
        append_note(&skipped, port_name + " filtered by PONTE_IB_HCA");
        continue;
      }
      ibv_port_attr pattr{};
      if (api->query_port(ctx.value()->context(), p, &pattr) != 0) {
        append_note(&skipped, port_name + ": ibv_query_port failed");
        continue;
      }
      if (pattr.state != IBV_PORT_ACTIVE) {
        append_note(&skipped, port_name + " is " + port_state_name(pattr.state));
        continue;
      }
      if (pattr.link_layer != IBV_LINK_LAYER_ETHERNET && pattr.link_layer != IBV_LINK_LAYER_INFINIBAND &&
          pattr.link_layer != IBV_LINK_LAYER_UNSPECIFIED) {
        append_note(&skipped, port_name + ": unknown link layer");
        continue;
      }
      VerbsPort vp;
      vp.device = dev;
      vp.device_name = name;
      vp.port = p;
      vp.link_layer = pattr.link_layer == IBV_LINK_LAYER_ETHERNET ? LinkLayer::kEthernet : LinkLayer::kInfiniBand;
      vp.lid = pattr.lid;
      vp.active_mtu = static_cast<uint8_t>(pattr.active_mtu);
      Status gs = choose_gid(*api, ctx.value()->context(), name, p, pattr, cfg.ib_gid_index,
                             &vp.gid_index, &vp.gid);
      if (!gs.ok()) {
        if (gs.code() == Code::kInvalidArgument) return gs;  // a bad PONTE_IB_GID_INDEX is fatal
        append_note(&skipped, gs.message());
        continue;
      }
      memcpy(&vp.subnet_prefix, vp.gid.raw, 8);
      vp.max_qp_wr = dattr.max_qp_wr;
      vp.max_cqe = dattr.max_cqe;
      vp.max_srq_wr = dattr.max_srq_wr;
      vp.max_qp_rd_atom = dattr.max_qp_rd_atom;
      if (!probed) {
        max_inline = probe_max_inline(*api, ctx.value()->context(), ctx.value()->pd());
        probed = true;
      }
      NicInfo& info = vp.info;
      info.name = port_name;
      info.pci_bus_id = pci;
      info.provider = "verbs";
      info.speed_mbps = port_speed_mbps(pattr.active_speed, pattr.active_width);
      info.max_msg_size = pattr.max_msg_sz;
      info.max_inline = max_inline;
      info.virt_addr = true;
      info.dmabuf = dmabuf;
      info.write_ordered_128 = true;  // RC delivers a write's bytes in order (NCCL's IB transport relies on it)
      info.device_memory = dmabuf || peermem;
      b->ports_.push_back(std::move(vp));
    }
  }
  if (b->ports_.empty()) {
    return Status(Code::kUnavailable, "no usable verbs port (%.90s)", skipped.c_str());
  }
  for (const VerbsPort& p : b->ports_) b->infos_.push_back(p.info);
  return b;
}

VerbsBackend::~VerbsBackend() {
  // Opened contexts hold their own device references, so NICs may outlive the list.
  if (list_ != nullptr) api_.free_device_list(list_);
}

Result<std::unique_ptr<Nic>> VerbsBackend::open_nic(size_t device_index) {
  if (device_index >= ports_.size()) {
    return Status(Code::kInvalidArgument, "verbs device index %zu out of range (%zu devices)",
                  device_index, ports_.size());
  }
  auto nic = VerbsNic::open(api_, ports_[device_index], cfg_);
  if (!nic.ok()) return nic.status();
  return std::unique_ptr<Nic>(std::move(nic).value());
}

}  // namespace ponte::verbs
