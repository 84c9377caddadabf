// The symbols NCCL looks up in libnccl-net-ponte.so: ncclNetPlugin_v11 (NCCL 2.28), _v10, _v9 and
// _v8 (NCCL 2.19 to 2.27). Each entry point converts its arguments and catches every exception.
#include <climits>
#include <cstring>
#include <new>

#include "plugin/log.h"
#include "plugin/nccl_net_abi.h"
#include "plugin/transport.h"
#include "plugin/wire.h"

namespace ponte::plugin {
namespace {

using namespace nccl_abi;

constexpr const char* kPluginName = "ponte";
constexpr uint32_t kMagicContext = 0x70637478;

// What v11's init hands NCCL as the per-communicator context.
struct Context {
  uint32_t magic = kMagicContext;
  uint64_t comm_id = 0;
  int traffic_class = kTrafficClassUndef;
};

// Runs body, mapping a non-OK Status to NCCL's result (logged) and any exception to an internal
// error: nothing may unwind into NCCL.
template <typename F>
NcclResult guarded(const char* what, F&& body) {
  try {
    Status st = body();
    if (st.ok()) return kSuccess;
    PONTE_NET_WARN("%s: %s (%s)", what, st.message(), code_name(st.code()));
    return to_nccl(st);
  } catch (const std::bad_alloc&) {
    PONTE_NET_WARN("%s: out of memory", what);
    return kSystemError;
  } catch (...) {
    PONTE_NET_WARN("%s: unexpected exception", what);
    return kInternalError;
  }
}

int clamp_int(size_t v) { return v > static_cast<size_t>(INT_MAX) ? INT_MAX : static_cast<int>(v); }

// ---- shared entry points ----------------------------------------------------------------------

NcclResult p_devices(int* ndev) {
  return guarded("devices", [&] { return device_count(ndev); });
}

template <typename Props>
void fill_common(const DeviceProps& p, Props* out) {
  std::memset(out, 0, sizeof(*out));
  out->name = const_cast<char*>(p.name);
  out->pci_path = const_cast<char*>(p.pci_path);
  out->guid = p.guid;
  out->ptr_support = p.ptr_support;
  out->reg_is_global = p.reg_is_global;
  out->speed = p.speed;
  out->port = p.port;
  out->latency = 0;
  out->max_comms = p.max_comms;
  out->max_recvs = p.max_recvs;
  out->net_device_type = kDeviceHost;
  out->net_device_version = kDeviceInvalidVersion;
}

template <typename Props>
void fill_v9(const DeviceProps& p, Props* out) {
  fill_common(p, out);
  out->force_flush = p.force_flush;
  out->vprops = p.vprops;
  out->max_p2p_bytes = p.max_p2p_bytes;
  out->max_coll_bytes = p.max_coll_bytes;
}

NcclResult p_props_v11(int dev, PropertiesV11* out) {
  return guarded("getProperties", [&] {
    if (!out) return Status(Code::kInvalidArgument, "NULL props");
    DeviceProps p;
    PONTE_RETURN_IF_ERROR(device_properties(dev, &p));
    fill_v9(p, out);
    out->max_multi_request_size = 1;
    return Status::Ok();
  });
}
NcclResult p_props_v9(int dev, PropertiesV9* out) {
  return guarded("getProperties", [&] {
    if (!out) return Status(Code::kInvalidArgument, "NULL props");
    DeviceProps p;
    PONTE_RETURN_IF_ERROR(device_properties(dev, &p));
    fill_v9(p, out);
    return Status::Ok();
  });
}
NcclResult p_props_v8(int dev, PropertiesV8* out) {
  return guarded("getProperties", [&] {
    if (!out) return Status(Code::kInvalidArgument, "NULL props");
    DeviceProps p;
    PONTE_RETURN_IF_ERROR(device_properties(dev, &p));
    fill_common(p, out);
    return Status::Ok();
  });
}

NcclResult p_listen(int dev, void* handle, void** listen_comm) {
  return guarded("listen", [&] { return listen(dev, handle, listen_comm); });
}
// traffic_class: NCCL's per-communicator class (v10's connect config, v11's init config), or
// kTrafficClassUndef for PONTE_IB_TC.
NcclResult connect_in_class(int dev, void* handle, void** send_comm, DeviceHandle** dev_comm,
                            int traffic_class) {
  return guarded("connect", [&] {
    // No device offload: NCCL reads a NULL device handle as "host progress only".
    if (dev_comm) *dev_comm = nullptr;
    return connect(dev, handle, send_comm, traffic_class);
  });
}
NcclResult p_connect(int dev, void* handle, void** send_comm, DeviceHandle** dev_comm) {
  return connect_in_class(dev, handle, send_comm, dev_comm, kTrafficClassUndef);
}
NcclResult p_accept(void* listen_comm, void** recv_comm, DeviceHandle** dev_comm) {
  return guarded("accept", [&] {
    if (dev_comm) *dev_comm = nullptr;
    return accept(listen_comm, recv_comm);
  });
}
NcclResult p_reg_mr(void* comm, void* data, size_t size, int type, void** mhandle) {
  return guarded("regMr", [&] { return reg_mr(comm, data, size, type, mhandle); });
}
// NCCL's own dmabuf (fd, and data's offset in it) is what the NIC registers, as aws-ofi-nccl and
// NCCL's net_ib do: the memory may come from an allocator whose range the engine could not export.
NcclResult p_reg_mr_dmabuf(void* comm, void* data, size_t size, int type, uint64_t offset, int fd,
                           void** mhandle) {
  return guarded("regMrDmaBuf", [&] { return reg_mr(comm, data, size, type, mhandle, fd, offset); });
}
NcclResult p_dereg_mr(void* comm, void* mhandle) {
  return guarded("deregMr", [&] { return dereg_mr(comm, mhandle); });
}
NcclResult p_isend(void* comm, void* data, size_t size, int tag, void* mhandle, void** request) {
  return guarded("isend", [&] { return isend(comm, data, size, tag, mhandle, request); });
}
NcclResult p_isend_ph(void* comm, void* data, size_t size, int tag, void* mhandle, void* /*phandle*/,
                  void** request) {
  return p_isend(comm, data, size, tag, mhandle, request);
}
NcclResult p_irecv(void* comm, int n, void** data, size_t* sizes, int* tags, void** mhandles,
               void** request) {
  return guarded("irecv", [&] { return irecv(comm, n, data, sizes, tags, mhandles, request); });
}
NcclResult p_irecv_ph(void* comm, int n, void** data, size_t* sizes, int* tags, void** mhandles,
                  void** /*phandles*/, void** request) {
  return p_irecv(comm, n, data, sizes, tags, mhandles, request);
}
NcclResult p_iflush(void* comm, int n, void** data, int* sizes, void** mhandles, void** request) {
  return guarded("iflush", [&] { return iflush(comm, n, data, sizes, mhandles, request); });
}
NcclResult p_test(void* request, int* done, int* sizes) {
  return guarded("test", [&] {
    size_t got[kMaxRecvs];
    int count = 0;
    PONTE_RETURN_IF_ERROR(test(request, done, got, &count));
    if (done && *done && sizes)
      for (int i = 0; i < count; ++i) sizes[i] = clamp_int(got[i]);
    return Status::Ok();
  });
}
NcclResult p_close_send(void* comm) {
  return guarded("closeSend", [&] { return close_send(comm); });
}
NcclResult p_close_recv(void* comm) {
  return guarded("closeRecv", [&] { return close_recv(comm); });
}
NcclResult p_close_listen(void* comm) {
  return guarded("closeListen", [&] { return close_listen(comm); });
}
NcclResult p_make_vdevice(int* d, VDeviceProps* props) {
  return guarded("makeVDevice", [&] { return make_vdevice(d, props); });
}

// ---- v11 --------------------------------------------------------------------------------------

NcclResult v11_init(void** ctx, uint64_t comm_id, CommConfig* config, Logger logger,
                ProfilerCallback /*profiler*/) {
  return guarded("init", [&] {
    if (!ctx) return Status(Code::kInvalidArgument, "init: NULL context pointer");
    *ctx = nullptr;
    auto* c = new Context;
    c->comm_id = comm_id;
    if (config) c->traffic_class = config->traffic_class;
    Status st = acquire(logger);  // takes a reference even when it fails: finalize drops it
    *ctx = c;
    return st;
  });
}
NcclResult v11_finalize(void* ctx) {
  return guarded("finalize", [&] {
    auto* c = static_cast<Context*>(ctx);
    if (!c) return Status::Ok();  // init failed before it made a context
    if (c->magic != kMagicContext) return Status(Code::kInvalidArgument, "finalize: not a context");
    c->magic = 0;
    delete c;
    release();
    return Status::Ok();
  });
}
NcclResult v11_listen(void* /*ctx*/, int dev, void* handle, void** listen_comm) {
  return p_listen(dev, handle, listen_comm);
}
NcclResult v11_connect(void* ctx, int dev, void* handle, void** send_comm,
                   DeviceHandle** dev_comm) {
  auto* c = static_cast<Context*>(ctx);
  const int tc = c && c->magic == kMagicContext ? c->traffic_class : kTrafficClassUndef;
  return connect_in_class(dev, handle, send_comm, dev_comm, tc);
}
NcclResult v11_set_net_attr(void* /*ctx*/, NetAttr* /*attr*/) { return kSuccess; }

// ---- v10, v9, v8: init once, never finalized (the unload destructor closes the engines) -------

NcclResult v10_init(Logger logger, ProfilerCallback /*profiler*/) {
  return guarded("init", [&] { return acquire(logger); });
}
NcclResult v9_init(Logger logger) {
  return guarded("init", [&] { return acquire(logger); });
}
NcclResult v10_connect(int dev, CommConfig* config, void* handle, void** send_comm,
                   DeviceHandle** dev_comm) {
  return connect_in_class(dev, handle, send_comm, dev_comm,
                          config ? config->traffic_class : kTrafficClassUndef);
}
NcclResult v8_isend(void* comm, void* data, int size, int tag, void* mhandle, void** request) {
  if (size < 0) {
    if (request) *request = nullptr;
    PONTE_NET_WARN("isend: negative size %d", size);
    return kInvalidArgument;
  }
  return p_isend(comm, data, static_cast<size_t>(size), tag, mhandle, request);
}
NcclResult v8_irecv(void* comm, int n, void** data, int* sizes, int* tags, void** mhandles,
                void** request) {
  if (request) *request = nullptr;
  if (n < 1 || n > kMaxRecvs || !sizes) {
    PONTE_NET_WARN("irecv: %d buffers, must be 1..%d", n, kMaxRecvs);
    return kInvalidArgument;
  }
  size_t wide[kMaxRecvs];
  for (int i = 0; i < n; ++i) {
    if (sizes[i] < 0) {
      PONTE_NET_WARN("irecv: negative size %d", sizes[i]);
      return kInvalidArgument;
    }
    wide[i] = static_cast<size_t>(sizes[i]);
  }
  return p_irecv(comm, n, data, wide, tags, mhandles, request);
}

}  // namespace
}  // namespace ponte::plugin

using namespace ponte::plugin;

extern "C" {

__attribute__((visibility("default"))) ponte::nccl_abi::NetV11 ncclNetPlugin_v11 = {
    kPluginName,     v11_init,      p_devices,      p_props_v11,    v11_listen,
    v11_connect,     p_accept,      p_reg_mr,       p_reg_mr_dmabuf, p_dereg_mr,
    p_isend_ph,      p_irecv_ph,    p_iflush,       p_test,         p_close_send,
    p_close_recv,    p_close_listen, nullptr,       nullptr,        p_make_vdevice,
    v11_finalize,    v11_set_net_attr,
};

__attribute__((visibility("default"))) ponte::nccl_abi::NetV10 ncclNetPlugin_v10 = {
    kPluginName,  v10_init,     p_devices,      p_props_v9,   p_listen,     v10_connect,
    p_accept,     p_reg_mr,     p_reg_mr_dmabuf, p_dereg_mr,  p_isend_ph,   p_irecv_ph,
    p_iflush,     p_test,       p_close_send,   p_close_recv, p_close_listen, nullptr,
    nullptr,      p_make_vdevice,
};

__attribute__((visibility("default"))) ponte::nccl_abi::NetV9 ncclNetPlugin_v9 = {
    kPluginName,  v9_init,      p_devices,      p_props_v9,   p_listen,     p_connect,
    p_accept,     p_reg_mr,     p_reg_mr_dmabuf, p_dereg_mr,  p_isend,      p_irecv,
    p_iflush,     p_test,       p_close_send,   p_close_recv, p_close_listen, nullptr,
    nullptr,      p_make_vdevice,
};

__attribute__((visibility("default"))) ponte::nccl_abi::NetV8 ncclNetPlugin_v8 = {
    kPluginName,  v9_init,      p_devices,      p_props_v8,   p_listen,     p_connect,
    p_accept,     p_reg_mr,     p_reg_mr_dmabuf, p_dereg_mr,  v8_isend,     v8_irecv,
    p_iflush,     p_test,       p_close_send,   p_close_recv, p_close_listen, nullptr,
    nullptr,
};

}  // extern "C"
