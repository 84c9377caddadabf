// Device context + PD, and the sysfs / port-attribute facts the backend lists ports with.
#include "core/verbs/verbs_device.h"

#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace ponte::verbs {

Result<std::unique_ptr<DeviceContext>> DeviceContext::open(const VerbsApi& api, ibv_device* device,
                                                           const std::string& name) {
  std::unique_ptr<DeviceContext> d(new DeviceContext(api));
  d->ctx_ = api.open_device(device);
  if (d->ctx_ == nullptr) {
    return Status(Code::kUnavailable, "ibv_open_device(%s) failed: %s", name.c_str(), strerror(errno));
  }
  d->pd_ = api.alloc_pd(d->ctx_);
  if (d->pd_ == nullptr) {
    return Status(Code::kResource, "ibv_alloc_pd(%s) failed: %s", name.c_str(), strerror(errno));
  }
  return d;
}

DeviceContext::~DeviceContext() {
  if (pd_ != nullptr) api_.dealloc_pd(pd_);  // EBUSY if memory is still registered: the context
  if (ctx_ != nullptr) api_.close_device(ctx_);  // close below releases it in the kernel anyway
}

namespace {

const char* root_or_default(const char* root) {
  return root != nullptr ? root : "/sys/class/infiniband";
}

std::string read_line(const std::string& path) {
  FILE* f = fopen(path.c_str(), "r");
  if (f == nullptr) return "";
  char buf[128];
  std::string out;
  if (fgets(buf, sizeof(buf), f) != nullptr) out = buf;
  fclose(f);
  while (!out.empty() && (out.back() == '\n' || out.back() == ' ')) out.pop_back();
  return out;
}

// "0000:43:00.0": domain:bus:device.function, lowercase hex.
bool looks_like_pci_id(const std::string& s) {
  if (s.size() != 12 || s[4] != ':' || s[7] != ':' || s[10] != '.') return false;
  for (size_t i = 0; i < s.size(); ++i) {
    if (i == 4 || i == 7 || i == 10) continue;
    if (!isxdigit(static_cast<unsigned char>(s[i]))) return false;
  }
  return true;
}

}  // namespace

std::string sysfs_pci_bus_id(const std::string& device, const char* root) {
  std::string link = std::string(root_or_default(root)) + "/" + device + "/device";
  char resolved[PATH_MAX];
  if (realpath(link.c_str(), resolved) == nullptr) return "";
  std::string path(resolved);
  size_t slash = path.rfind('/');
  std::string last = slash == std::string::npos ? path : path.substr(slash + 1);
  for (char& c : last) c = static_cast<char>(tolower(static_cast<unsigned char>(c)));
  return looks_like_pci_id(last) ? last : "";
}

std::string sysfs_gid_type(const std::string& device, int port, int index, const char* root) {
  char path[512];
  snprintf(path, sizeof(path), "%s/%s/ports/%d/gid_attrs/types/%d", root_or_default(root),
           device.c_str(), port, index);
  return read_line(path);
}

uint64_t port_speed_mbps(uint8_t active_speed, uint8_t active_width) {
  uint64_t lane = 0;  // data rate per lane, Mb/s
  switch (active_speed) {
    case 1: lane = 2500; break;     // SDR
    case 2: lane = 5000; break;     // DDR
    case 4: lane = 10000; break;    // QDR
    case 8: lane = 10000; break;    // FDR10
    case 16: lane = 14000; break;   // FDR
    case 32: lane = 25000; break;   // EDR
    case 64: lane = 50000; break;   // HDR
    case 128: lane = 100000; break; // NDR
    default: return 0;
  }
  uint64_t lanes = 0;
  switch (active_width) {
    case 1: lanes = 1; break;
    case 2: lanes = 4; break;
    case 4: lanes = 8; break;
    case 8: lanes = 12; break;
    case 16: lanes = 2; break;
    default: return 0;
  }
  return lane * lanes;
}

size_t mtu_bytes(uint8_t mtu) {
  return mtu >= IBV_MTU_256 && mtu <= IBV_MTU_4096 ? size_t{128} << mtu : 0;
}

bool gid_is_ipv4_mapped(const ibv_gid& gid) {
  static const uint8_t prefix[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
  return memcmp(gid.raw, prefix, sizeof(prefix)) == 0;
}

Status choose_gid(const VerbsApi& api, ibv_context* ctx, const std::string& device, uint8_t port,
                  const ibv_port_attr& attr, int requested_index, int* index, ibv_gid* gid) {
  static const ibv_gid zero{};
  if (requested_index >= 0) {
    if (requested_index >= attr.gid_tbl_len) {
      return Status(Code::kInvalidArgument, "PONTE_IB_GID_INDEX=%d: %s:%u has %d GIDs",
                    requested_index, device.c_str(), port, attr.gid_tbl_len);
    }
    ibv_gid g{};
    if (api.query_gid(ctx, port, requested_index, &g) != 0 || memcmp(&g, &zero, sizeof(g)) == 0) {
      return Status(Code::kNotFound, "PONTE_IB_GID_INDEX=%d: GID of %s:%u is empty",
                    requested_index, device.c_str(), port);
    }
    *index = requested_index;
    *gid = g;
    return Status::Ok();
  }
  if (attr.link_layer != IBV_LINK_LAYER_ETHERNET) {
    ibv_gid g{};
    if (api.query_gid(ctx, port, 0, &g) != 0) {
      return Status(Code::kNotFound, "ibv_query_gid(%s:%u, 0) failed", device.c_str(), port);
    }
    *index = 0;
    *gid = g;
    return Status::Ok();
  }
  // RoCE: rank every populated GID; stop at the first RoCE v2 IPv4-mapped one (the usual choice:
  // routable, and what NCCL picks by default).
  int best = -1, best_rank = 0;
  ibv_gid best_gid{};
  for (int i = 0; i < attr.gid_tbl_len; ++i) {
    ibv_gid g{};
    if (api.query_gid(ctx, port, i, &g) != 0) continue;
    if (memcmp(&g, &zero, sizeof(g)) == 0) continue;
    bool v2 = sysfs_gid_type(device, port, i) == "RoCE v2";
    int rank = v2 && gid_is_ipv4_mapped(g) ? 3 : v2 ? 2 : 1;
    if (rank > best_rank) {
      best = i;
      best_rank = rank;
      best_gid = g;
      if (rank == 3) break;
    }
  }
  if (best < 0) {
    return Status(Code::kNotFound, "%s:%u has no populated GID (no IP address on its netdev?)",
                  device.c_str(), port);
  }
  *index = best;
  *gid = best_gid;
  return Status::Ok();
}

}  // namespace ponte::verbs
