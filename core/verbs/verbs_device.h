// One verbs port as ponte sees it (device, port, GID, limits), the sysfs facts behind it, and an
// opened device context with its protection domain.
#pragma once

#include <memory>
#include <string>

#include "core/nic.h"
#include "core/verbs/verbs_loader.h"
#include "core/verbs/verbs_wire.h"

namespace ponte {
struct Config;
}

namespace ponte::verbs {

// Everything open_nic needs to know about one ACTIVE port, found once by the backend.
struct VerbsPort {
  ibv_device* device = nullptr;
  std::string device_name;  // "mlx5_0", "rxe1"
  uint8_t port = 1;
  NicInfo info;

  LinkLayer link_layer = LinkLayer::kEthernet;
  uint16_t lid = 0;
  uint8_t active_mtu = IBV_MTU_1024;  // enum ibv_mtu
  int gid_index = 0;
  ibv_gid gid{};
  uint64_t subnet_prefix = 0;  // IB: from the GID, to tell when a GRH is needed

  // Device limits the NIC sizes its queues from.
  int max_qp_wr = 0;
  int max_cqe = 0;
  int max_srq_wr = 0;
  int max_qp_rd_atom = 0;
};

// An opened device context plus one protection domain; closed on destruction.
class DeviceContext {
 public:
  static Result<std::unique_ptr<DeviceContext>> open(const VerbsApi& api, ibv_device* device,
                                                     const std::string& name);
  ~DeviceContext();
  DeviceContext(const DeviceContext&) = delete;
  DeviceContext& operator=(const DeviceContext&) = delete;

  ibv_context* context() const { return ctx_; }
  ibv_pd* pd() const { return pd_; }

 private:
  DeviceContext(const VerbsApi& api) : api_(api) {}
  const VerbsApi& api_;
  ibv_context* ctx_ = nullptr;
  ibv_pd* pd_ = nullptr;
};

// sysfs facts (root overridable for tests; default "/sys/class/infiniband").
// The PCI bus id ("0000:43:00.0") of the device, "" when it is not a PCI device (rxe, siw).
std::string sysfs_pci_bus_id(const std::string& device, const char* root = nullptr);
// "IB/RoCE v1", "RoCE v2" or "" when unreadable.
std::string sysfs_gid_type(const std::string& device, int port, int index, const char* root = nullptr);

// Link speed in Mb/s from ibv_port_attr's active_speed / active_width codes; 0 when unknown.
uint64_t port_speed_mbps(uint8_t active_speed, uint8_t active_width);
// 256..4096 for IBV_MTU_256..IBV_MTU_4096, 0 otherwise.
size_t mtu_bytes(uint8_t mtu);
// Whether a GID holds an IPv4-mapped IPv6 address (::ffff:a.b.c.d).
bool gid_is_ipv4_mapped(const ibv_gid& gid);

// Chooses the GID of a port: the requested index when >= 0 (checked against the table), else for
// Ethernet the first RoCE v2 GID with an IPv4-mapped address (then any RoCE v2 GID, then any
// non-zero GID), for InfiniBand index 0. kNotFound when the port has no usable GID.
Status choose_gid(const VerbsApi& api, ibv_context* ctx, const std::string& device, uint8_t port,
                  const ibv_port_attr& attr, int requested_index, int* index, ibv_gid* gid);

}  // namespace ponte::verbs
