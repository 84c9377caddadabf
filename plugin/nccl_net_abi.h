// The NCCL net-plugin ABI, versions 8 to 11, as ponte declares it: the tables and structures NCCL
// 2.19 to 2.28 look up with dlsym("ncclNetPlugin_vN"). Field order and types must match NCCL's.
#pragma once

// Written from the layouts NCCL publishes (ext-net/example/nccl/net_v8.h .. net_v11.h, NCCL
// 2.28.9). nccl.h carries none of this, so ponte keeps its own declarations in its own namespace;
// only the memory layout and the exported symbol names have to agree with NCCL.

#include <cstddef>
#include <cstdint>

namespace ponte::nccl_abi {

// ncclResult_t as the plugin interface uses it.
enum NcclResult : int {  // ncclResult_t
  kSuccess = 0,
  kUnhandledCudaError = 1,
  kSystemError = 2,
  kInternalError = 3,
  kInvalidArgument = 4,
  kInvalidUsage = 5,
  kRemoteError = 6,
};

// ncclDebugLogLevel and the subsystem flags passed with every log line.
enum LogLevel : int {
  kLogNone = 0,
  kLogVersion = 1,
  kLogWarn = 2,
  kLogInfo = 3,
  kLogAbort = 4,
  kLogTrace = 5,
};
constexpr unsigned long kSubsysInit = 1;
constexpr unsigned long kSubsysNet = 16;

using Logger = void (*)(LogLevel level, unsigned long flags, const char* file, int line,
                        const char* fmt, ...);
using ProfilerCallback = NcclResult (*)(void** event_handle, int type, void* phandle, int64_t plugin_id,
                                    void* ext_data);

constexpr size_t kHandleMaxSize = 128;  // NCCL_NET_HANDLE_MAXSIZE
constexpr int kPtrHost = 0x1;           // NCCL_PTR_HOST
constexpr int kPtrCuda = 0x2;           // NCCL_PTR_CUDA
constexpr int kPtrDmabuf = 0x4;         // NCCL_PTR_DMABUF
constexpr int kMaxRequests = 32;        // NCCL_NET_MAX_REQUESTS: requests in flight per comm
constexpr int kMaxDevsPerNic = 4;       // NCCL_NET_MAX_DEVS_PER_NIC: NICs in one virtual device
constexpr size_t kMaxNetSizeBytes = 1ull << 40;  // NCCL_MAX_NET_SIZE_BYTES (1 TB)
constexpr int kTrafficClassUndef = -1;

enum DeviceType : int { kDeviceHost = 0, kDeviceUnpack = 1 };  // ncclNetDeviceType
constexpr int kDeviceInvalidVersion = 0;

// ncclNetDeviceHandle_v7..v11 (identical in every version).
struct DeviceHandle {
  DeviceType net_device_type;
  int net_device_version;
  void* handle;
  size_t size;
  int needs_proxy_progress;
};

// ncclNetVDeviceProps_v9..v11.
struct VDeviceProps {
  int ndevs;
  int devs[kMaxDevsPerNic];
};

// ncclNetCommConfig_v10/_v11.
struct CommConfig {
  int traffic_class;
};

// ncclNetProperties_v8.
struct PropertiesV8 {
  char* name;
  char* pci_path;
  uint64_t guid;
  int ptr_support;
  int reg_is_global;
  int speed;  // Mbps
  int port;
  float latency;
  int max_comms;
  int max_recvs;
  DeviceType net_device_type;
  int net_device_version;
};

// ncclNetProperties_v9 and _v10 (same layout).
struct PropertiesV9 {
  char* name;
  char* pci_path;
  uint64_t guid;
  int ptr_support;
  int reg_is_global;
  int force_flush;
  int speed;
  int port;
  float latency;
  int max_comms;
  int max_recvs;
  DeviceType net_device_type;
  int net_device_version;
  VDeviceProps vprops;
  size_t max_p2p_bytes;
  size_t max_coll_bytes;
};
using PropertiesV10 = PropertiesV9;

// ncclNetProperties_v11.
struct PropertiesV11 {
  char* name;
  char* pci_path;
  uint64_t guid;
  int ptr_support;
  int reg_is_global;
  int force_flush;
  int speed;
  int port;
  float latency;
  int max_comms;
  int max_recvs;
  DeviceType net_device_type;
  int net_device_version;
  VDeviceProps vprops;
  size_t max_p2p_bytes;
  size_t max_coll_bytes;
  int max_multi_request_size;
};

// ncclNetCommAttr_v11 / ncclNetAttr_v11 (setNetAttr's argument).
struct CommAttr {
  int32_t max_concurrent_peers;
  int32_t min_concurrent_peers;
  int32_t max_flows_per_peer;
  int32_t min_flows_per_peer;
};
struct NetAttr {
  CommAttr send_comm_attr;
  CommAttr recv_comm_attr;
  uint32_t op;
  uint32_t algo;
  uint32_t proto;
};

// ncclNet_v11_t (NCCL 2.28): init and finalize per communicator, a context passed to listen/connect.
struct NetV11 {
  const char* name;
  NcclResult (*init)(void** ctx, uint64_t comm_id, CommConfig* config, Logger logger,
                 ProfilerCallback profiler);
  NcclResult (*devices)(int* ndev);
  NcclResult (*get_properties)(int dev, PropertiesV11* props);
  NcclResult (*listen)(void* ctx, int dev, void* handle, void** listen_comm);
  NcclResult (*connect)(void* ctx, int dev, void* handle, void** send_comm,
                    DeviceHandle** send_dev_comm);
  NcclResult (*accept)(void* listen_comm, void** recv_comm, DeviceHandle** recv_dev_comm);
  NcclResult (*reg_mr)(void* comm, void* data, size_t size, int type, void** mhandle);
  NcclResult (*reg_mr_dmabuf)(void* comm, void* data, size_t size, int type, uint64_t offset, int fd,
                          void** mhandle);
  NcclResult (*dereg_mr)(void* comm, void* mhandle);
  NcclResult (*isend)(void* send_comm, void* data, size_t size, int tag, void* mhandle, void* phandle,
                  void** request);
  NcclResult (*irecv)(void* recv_comm, int n, void** data, size_t* sizes, int* tags, void** mhandles,
                  void** phandles, void** request);
  NcclResult (*iflush)(void* recv_comm, int n, void** data, int* sizes, void** mhandles,
                   void** request);
  NcclResult (*test)(void* request, int* done, int* sizes);
  NcclResult (*close_send)(void* send_comm);
  NcclResult (*close_recv)(void* recv_comm);
  NcclResult (*close_listen)(void* listen_comm);
  NcclResult (*get_device_mr)(void* comm, void* mhandle, void** dptr_mhandle);
  NcclResult (*irecv_consumed)(void* recv_comm, int n, void* request);
  NcclResult (*make_vdevice)(int* d, VDeviceProps* props);
  NcclResult (*finalize)(void* ctx);
  NcclResult (*set_net_attr)(void* ctx, NetAttr* attr);
};

// ncclNet_v10_t (NCCL 2.24-2.27): init once, the comm config passed to connect.
struct NetV10 {
  const char* name;
  NcclResult (*init)(Logger logger, ProfilerCallback profiler);
  NcclResult (*devices)(int* ndev);
  NcclResult (*get_properties)(int dev, PropertiesV10* props);
  NcclResult (*listen)(int dev, void* handle, void** listen_comm);
  NcclResult (*connect)(int dev, CommConfig* config, void* handle, void** send_comm,
                    DeviceHandle** send_dev_comm);
  NcclResult (*accept)(void* listen_comm, void** recv_comm, DeviceHandle** recv_dev_comm);
  NcclResult (*reg_mr)(void* comm, void* data, size_t size, int type, void** mhandle);
  NcclResult (*reg_mr_dmabuf)(void* comm, void* data, size_t size, int type, uint64_t offset, int fd,
                          void** mhandle);
  NcclResult (*dereg_mr)(void* comm, void* mhandle);
  NcclResult (*isend)(void* send_comm, void* data, size_t size, int tag, void* mhandle, void* phandle,
                  void** request);
  NcclResult (*irecv)(void* recv_comm, int n, void** data, size_t* sizes, int* tags, void** mhandles,
                  void** phandles, void** request);
  NcclResult (*iflush)(void* recv_comm, int n, void** data, int* sizes, void** mhandles,
                   void** request);
  NcclResult (*test)(void* request, int* done, int* sizes);
  NcclResult (*close_send)(void* send_comm);
  NcclResult (*close_recv)(void* recv_comm);
  NcclResult (*close_listen)(void* listen_comm);
  NcclResult (*get_device_mr)(void* comm, void* mhandle, void** dptr_mhandle);
  NcclResult (*irecv_consumed)(void* recv_comm, int n, void* request);
  NcclResult (*make_vdevice)(int* d, VDeviceProps* props);
};

// ncclNet_v9_t (NCCL 2.22-2.23): size_t sizes, no profiler handles.
struct NetV9 {
  const char* name;
  NcclResult (*init)(Logger logger);
  NcclResult (*devices)(int* ndev);
  NcclResult (*get_properties)(int dev, PropertiesV9* props);
  NcclResult (*listen)(int dev, void* handle, void** listen_comm);
  NcclResult (*connect)(int dev, void* handle, void** send_comm, DeviceHandle** send_dev_comm);
  NcclResult (*accept)(void* listen_comm, void** recv_comm, DeviceHandle** recv_dev_comm);
  NcclResult (*reg_mr)(void* comm, void* data, size_t size, int type, void** mhandle);
  NcclResult (*reg_mr_dmabuf)(void* comm, void* data, size_t size, int type, uint64_t offset, int fd,
                          void** mhandle);
  NcclResult (*dereg_mr)(void* comm, void* mhandle);
  NcclResult (*isend)(void* send_comm, void* data, size_t size, int tag, void* mhandle,
                  void** request);
  NcclResult (*irecv)(void* recv_comm, int n, void** data, size_t* sizes, int* tags, void** mhandles,
                  void** request);
  NcclResult (*iflush)(void* recv_comm, int n, void** data, int* sizes, void** mhandles,
                   void** request);
  NcclResult (*test)(void* request, int* done, int* sizes);
  NcclResult (*close_send)(void* send_comm);
  NcclResult (*close_recv)(void* recv_comm);
  NcclResult (*close_listen)(void* listen_comm);
  NcclResult (*get_device_mr)(void* comm, void* mhandle, void** dptr_mhandle);
  NcclResult (*irecv_consumed)(void* recv_comm, int n, void* request);
  NcclResult (*make_vdevice)(int* d, VDeviceProps* props);
};

// ncclNet_v8_t (NCCL 2.19-2.21): int sizes, no virtual devices.
struct NetV8 {
  const char* name;
  NcclResult (*init)(Logger logger);
  NcclResult (*devices)(int* ndev);
  NcclResult (*get_properties)(int dev, PropertiesV8* props);
  NcclResult (*listen)(int dev, void* handle, void** listen_comm);
  NcclResult (*connect)(int dev, void* handle, void** send_comm, DeviceHandle** send_dev_comm);
  NcclResult (*accept)(void* listen_comm, void** recv_comm, DeviceHandle** recv_dev_comm);
  NcclResult (*reg_mr)(void* comm, void* data, size_t size, int type, void** mhandle);
  NcclResult (*reg_mr_dmabuf)(void* comm, void* data, size_t size, int type, uint64_t offset, int fd,
                          void** mhandle);
  NcclResult (*dereg_mr)(void* comm, void* mhandle);
  NcclResult (*isend)(void* send_comm, void* data, int size, int tag, void* mhandle, void** request);
  NcclResult (*irecv)(void* recv_comm, int n, void** data, int* sizes, int* tags, void** mhandles,
                  void** request);
  NcclResult (*iflush)(void* recv_comm, int n, void** data, int* sizes, void** mhandles,
                   void** request);
  NcclResult (*test)(void* request, int* done, int* sizes);
  NcclResult (*close_send)(void* send_comm);
  NcclResult (*close_recv)(void* recv_comm);
  NcclResult (*close_listen)(void* listen_comm);
  NcclResult (*get_device_mr)(void* comm, void* mhandle, void** dptr_mhandle);
  NcclResult (*irecv_consumed)(void* recv_comm, int n, void* request);
};

// Layout checks against the published x86-64 / aarch64 LP64 layouts.
static_assert(sizeof(DeviceHandle) == 32);
static_assert(sizeof(PropertiesV8) == 64);
static_assert(offsetof(PropertiesV9, vprops) == 64 && sizeof(PropertiesV9) == 104);
static_assert(sizeof(PropertiesV11) == 112);
static_assert(offsetof(PropertiesV11, max_multi_request_size) == 104);
static_assert(sizeof(NetV11) == 22 * sizeof(void*));
static_assert(sizeof(NetV10) == 20 * sizeof(void*));
static_assert(sizeof(NetV9) == 20 * sizeof(void*));
static_assert(sizeof(NetV8) == 19 * sizeof(void*));

}  // namespace ponte::nccl_abi
