// Plugin devices: probing the backend's NICs, the device table (physical and virtual devices),
// each device's engine built on first use, and the plugin's reference count.
#include "plugin/transport_internal.h"

#include <climits>
#include <cstdlib>

#include "core/log.h"
#include "plugin/log.h"
#include "ponte_version.h"

namespace ponte::plugin {

namespace {

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

std::string nic_list(const Device& d, const std::vector<NicInfo>& nics) {  // call with p.mu held
  std::string s;
  for (size_t i = 0; i < d.nics.size(); ++i) {
    if (i) s += ", ";
    const NicInfo& n = nics[d.nics[i]];
    s += n.name + (n.pci_bus_id.empty() ? "" : " (" + n.pci_bus_id + ")");
  }
  return s;
}

// ---- probing ----------------------------------------------------------------------------------

std::string sysfs_pci_path(const std::string& bus_id) {
  if (bus_id.empty()) return {};
  const std::string link = "/sys/bus/pci/devices/" + bus_id;
  char resolved[PATH_MAX];
  if (!realpath(link.c_str(), resolved)) return {};
  return resolved;
}

int port_of(const std::string& name) {
  const auto colon = name.rfind(':');
  if (colon == std::string::npos || colon + 1 >= name.size()) return 1;
  char* end = nullptr;
  const long v = std::strtol(name.c_str() + colon + 1, &end, 10);
  return (*end == 0 && v > 0 && v < 256) ? static_cast<int>(v) : 1;
}

bool name_taken(const Plugin& p, const std::string& name) {
  for (const auto& d : p.devices)
    if (d->name == name) return true;
  return false;
}

int ptr_support_of(const std::vector<const NicInfo*>& nics) {
  bool cuda = !nics.empty(), dmabuf = !nics.empty();
  for (const NicInfo* n : nics) {
    cuda = cuda && n->device_memory;
    dmabuf = dmabuf && n->dmabuf;
  }
  return nccl_abi::kPtrHost | (cuda ? nccl_abi::kPtrCuda : 0) |
         (cuda && dmabuf ? nccl_abi::kPtrDmabuf : 0);
}

// NCCL's LL128 protocol (on by default over the network on Hopper) needs each 128-byte line of a
// write to land whole and in order. Where the NIC cannot promise it (libfabric providers other than
// EFA with FI_OPT_EFA_WRITE_IN_ORDER_ALIGNED_128_BYTES granted), NCCL is told to use its Simple
// protocol, as aws-ofi-nccl does: NCCL_PROTO=simple in the environment NCCL reads when it builds a
// communicator, unless the user set NCCL_PROTO. Logged once per process.
void avoid_ll128_unless_ordered(const NicInfo& nic) {
  if (nic.write_ordered_128) return;
  static std::atomic<bool> logged{false};
  const char* user = getenv("NCCL_PROTO");
  const bool set = user == nullptr && setenv("NCCL_PROTO", "simple", 0) == 0;
  if (logged.exchange(true)) return;
  if (set)
    PONTE_NET_INFO("%s (provider %s) promises no 128-byte write ordering: NCCL_PROTO=simple set, "
                   "NCCL avoids LL128 and LL over ponte",
                   nic.name.c_str(), nic.provider.c_str());
  else
    PONTE_NET_INFO("%s (provider %s) promises no 128-byte write ordering; NCCL_PROTO=%s was set by "
                   "the user and is kept (LL128 there may corrupt data)",
                   nic.name.c_str(), nic.provider.c_str(), user ? user : "?");
}

// Lists the backend's NICs with a throwaway engine over NIC 0 (the engine offers no listing
// without opening one); kept as device 0's engine, as device 0 is the one most often used.
void probe_locked(Plugin& p) {
  p.probed = true;
  // The first line NCCL_DEBUG=INFO shows from ponte: which build is loaded.
  PONTE_NET_INFO("ponte %s, NCCL net plugin (ncclNet v11..v8)", PONTE_VERSION_STRING);
  EngineOptions opts;
  opts.groups.push_back({0});
  opts.dense_imm_values = kDenseImmValues;
  auto e = Engine::create(opts);
  if (!e.ok()) {
    PONTE_NET_INFO("no usable NIC, ponte offers no device (%s); NCCL falls back to its own "
                   "transports",
                   e.status().message());
    return;
  }
  std::unique_ptr<Engine> engine = std::move(e).value();
  p.backend = engine->backend();
  p.nics = engine->devices();
  avoid_ll128_unless_ordered(engine->nic_info(0, 0));  // NIC 0's endpoint, opened: what it granted
  const auto& cfg = global_config();
  PONTE_NET_INFO("%s backend%s%s, %zu NIC(s)", backend_name(p.backend),
                 p.backend == BackendKind::kFabric ? ", provider " : "",
                 p.backend == BackendKind::kFabric ? cfg.fabric_provider.c_str() : "",
                 p.nics.size());
  for (size_t i = 0; i < p.nics.size(); ++i) {
    const NicInfo& n = p.nics[i];
    auto d = std::make_unique<Device>();
    d->index = static_cast<int>(i);
    d->nics = {i};
    d->name = name_taken(p, n.name) ? n.name + "#" + std::to_string(i) : n.name;
    d->pci_path = sysfs_pci_path(n.pci_bus_id);
    d->has_pci = !d->pci_path.empty();
    d->guid = fnv1a(n.pci_bus_id.empty() ? n.provider + "/" + n.name + "/" + std::to_string(i)
                                         : n.pci_bus_id);
    d->speed = n.speed_mbps ? static_cast<int>(std::min<uint64_t>(n.speed_mbps, INT_MAX))
                            : kDefaultSpeedMbps;
    d->port = port_of(n.name);
    d->ptr_support = ptr_support_of({&n});
    d->vprops.ndevs = 1;
    d->vprops.devs[0] = static_cast<int>(i);
    d->nic_desc = nic_list(*d, p.nics);
    PONTE_NET_INFO("device %zu: %s, provider %s, pci %s, %d Mbps%s, GPUDirect %s%s", i,
                   d->name.c_str(), n.provider.c_str(),
                   d->has_pci ? d->pci_path.c_str() : "none (attached to the first CPU)",
                   d->speed, n.speed_mbps ? "" : " (default: link reports no speed)",
                   (d->ptr_support & nccl_abi::kPtrCuda) ? "yes" : "no",
                   (d->ptr_support & nccl_abi::kPtrDmabuf) ? " (dmabuf)" : "");
    p.devices.push_back(std::move(d));
  }
  if (!p.devices.empty()) {
    // No other thread can reach device 0 before p.mu is released: no need for d0->mu here.
    Device* d0 = p.devices[0].get();
    auto mr = engine->register_memory(d0->group, d0->ctrl_buf.ptr, d0->ctrl_buf.len);
    if (mr.ok()) {
      d0->ctrl_mr = mr.value();
      for (int i = 0; i < kCtrlSlots; ++i) { d0->ctrl_slots[i].dev = d0; d0->ctrl_slots[i].index = i; }
      engine->set_recv_handler(d0->group, &on_message, d0);
      d0->engine = std::move(engine);
      register_exit_teardown();
    }
  }
}

void core_log_sink(LogLevel level, const char* line) {
  if (level <= LogLevel::kWarn)
    PONTE_NET_WARN("%s", line);
  else
    PONTE_NET_INFO("%s", line);
}

}  // namespace

Plugin& plugin() {
  static Plugin* p = new Plugin;  // torn down explicitly (release / unload), never destroyed
  return *p;
}

static void teardown_at_exit() {
  try {
    teardown_all();
  } catch (...) {
  }
}

// Closing the engines at exit must happen before the engine's own statics go away: a handler
// registered after the first engine exists runs before those (exit handlers run in reverse).
void register_exit_teardown() {
  static std::once_flag once;
  std::call_once(once, [] { std::atexit(&teardown_at_exit); });
}

// Builds the device's engine (one group over its NICs) on first use. Call with d->mu held.
Status ensure_engine(Device* d) {
  if (d->engine) return Status::Ok();
  EngineOptions opts;
  opts.groups.push_back(d->nics);
  opts.dense_imm_values = kDenseImmValues;
  auto e = Engine::create(opts);
  if (!e.ok()) {
    PONTE_NET_WARN("device %d (%s): engine failed: %s", d->index, d->name.c_str(),
                   e.status().message());
    return e.status();
  }
  std::unique_ptr<Engine> engine = std::move(e).value();
  auto mr = engine->register_memory(d->group, d->ctrl_buf.ptr, d->ctrl_buf.len);
  if (!mr.ok()) return mr.status();
  d->ctrl_mr = mr.value();
  for (int i = 0; i < kCtrlSlots; ++i) { d->ctrl_slots[i].dev = d; d->ctrl_slots[i].index = i; }
  engine->set_recv_handler(d->group, &on_message, d);
  d->engine = std::move(engine);
  register_exit_teardown();
  PONTE_NET_INFO("device %d %s: engine up, %s backend, %d NIC(s): %s; GPUDirect %s", d->index,
                 d->name.c_str(), backend_name(d->engine->backend()),
                 d->engine->nics_in_group(d->group), d->nic_desc.c_str(),
                 (d->ptr_support & nccl_abi::kPtrCuda) ? "on" : "off");
  return Status::Ok();
}

Result<Device*> device_at(int dev) {
  Plugin& p = plugin();
  std::lock_guard<std::mutex> lock(p.mu);
  if (p.refs == 0) return Status(Code::kInvalidArgument, "the plugin is not initialized");
  if (dev < 0 || static_cast<size_t>(dev) >= p.devices.size())
    return Status(Code::kInvalidArgument, "device %d does not exist (%zu devices)", dev,
                  p.devices.size());
  return p.devices[dev].get();
}

nccl_abi::NcclResult to_nccl(const Status& st) {
  switch (st.code()) {
    case Code::kOk:
      return nccl_abi::kSuccess;
    case Code::kInvalidArgument:
    case Code::kNotFound:
      return nccl_abi::kInvalidArgument;
    case Code::kPeerDead:
    case Code::kTimeout:
      return nccl_abi::kRemoteError;
    case Code::kUnavailable:
    case Code::kTransport:
    case Code::kResource:
    case Code::kCancelled:
    case Code::kAgain:
      return nccl_abi::kSystemError;
    case Code::kInternal:
      return nccl_abi::kInternalError;
  }
  return nccl_abi::kInternalError;
}

Status acquire(nccl_abi::Logger logger) {
  set_logger(logger);
  if (logger) set_log_sink(&core_log_sink);  // the engine's own lines go to NCCL's logger too
  Plugin& p = plugin();
  std::lock_guard<std::mutex> lock(p.mu);
  ++p.refs;
  if (!p.probed) probe_locked(p);
  return Status::Ok();
}

void release() {
  Plugin& p = plugin();
  std::vector<std::unique_ptr<Device>> devices;
  {
    std::lock_guard<std::mutex> lock(p.mu);
    if (p.refs == 0) return;
    if (--p.refs > 0) return;
    devices = take_devices_locked(p);  // in the same step: a concurrent acquire probes afresh
  }
  for (auto& d : devices) teardown_device(d.get());
}

Status device_count(int* ndev) {
  if (!ndev) return bad("devices: NULL ndev");
  Plugin& p = plugin();
  std::lock_guard<std::mutex> lock(p.mu);
  if (p.refs == 0) return bad("devices: the plugin is not initialized");
  *ndev = static_cast<int>(p.devices.size());
  return Status::Ok();
}

Status device_properties(int dev, DeviceProps* props) {
  if (!props) return bad("getProperties: NULL props");
  PONTE_ASSIGN_OR_RETURN(Device * d, device_at(dev));
  *props = DeviceProps{};
  props->name = d->name.c_str();
  props->pci_path = d->has_pci ? d->pci_path.c_str() : nullptr;
  props->guid = d->guid;
  props->ptr_support = d->ptr_support;
  props->reg_is_global = 1;
  props->force_flush = 0;
  props->speed = d->speed;
  props->port = d->port;
  props->max_comms = static_cast<int>(kMaxCommId);
  props->max_recvs = kMaxRecvs;
  props->vprops = d->vprops;
  props->max_p2p_bytes = nccl_abi::kMaxNetSizeBytes;
  props->max_coll_bytes = nccl_abi::kMaxNetSizeBytes;
  return Status::Ok();
}

Status make_vdevice(int* out, const nccl_abi::VDeviceProps* vp) {
  if (!out || !vp) return bad("makeVDevice: NULL argument");
  Plugin& p = plugin();
  std::lock_guard<std::mutex> lock(p.mu);
  if (p.refs == 0) return bad("makeVDevice: the plugin is not initialized");
  if (vp->ndevs < 1 || vp->ndevs > kMaxNicsPerDevice)
    return Status(Code::kInvalidArgument, "makeVDevice: %d devices, must be 1..%d", vp->ndevs,
                  kMaxNicsPerDevice);
  auto d = std::make_unique<Device>();
  std::vector<const NicInfo*> infos;
  uint64_t speed = 0;
  for (int i = 0; i < vp->ndevs; ++i) {
    const int c = vp->devs[i];
    if (c < 0 || static_cast<size_t>(c) >= p.nics.size())
      return Status(Code::kInvalidArgument, "makeVDevice: %d is not a physical device (0..%zu)",
                    c, p.nics.size());
    const Device& child = *p.devices[c];
    d->nics.push_back(static_cast<size_t>(c));
    infos.push_back(&p.nics[c]);
    speed += static_cast<uint64_t>(child.speed);
    d->name += (i ? "+" : "") + child.name;
    d->vprops.devs[i] = c;
  }
  d->vprops.ndevs = vp->ndevs;
  d->nic_desc = nic_list(*d, p.nics);
  d->index = static_cast<int>(p.devices.size());
  if (name_taken(p, d->name)) {  // appended piece by piece: "#" + string trips GCC 12's -Wrestrict
    d->name += '#';
    d->name += std::to_string(d->index);
  }
  const Device& first = *p.devices[vp->devs[0]];
  d->pci_path = first.pci_path;
  d->has_pci = first.has_pci;
  d->guid = fnv1a(d->name);
  d->speed = static_cast<int>(std::min<uint64_t>(speed, INT_MAX));
  d->port = first.port;
  d->ptr_support = ptr_support_of(infos);
  PONTE_NET_INFO("made virtual device %d = %s (%d NICs, %d Mbps, GPUDirect %s)", d->index,
                 d->name.c_str(), vp->ndevs, d->speed,
                 (d->ptr_support & nccl_abi::kPtrCuda) ? "yes" : "no");
  *out = d->index;
  p.devices.push_back(std::move(d));
  return Status::Ok();
}

}  // namespace ponte::plugin
