// ponte's NCCL transport behind the versioned plugin tables: devices (engine NIC groups), comms
// and the receiver-driven protocol (CTS FIFO, write-with-immediate, size records) on the engine.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/status.h"
#include "plugin/nccl_net_abi.h"

namespace ponte::plugin {

// Speed reported for a NIC whose link reports none (loopback, some virtual NICs), in Mbps.
constexpr int kDefaultSpeedMbps = 100000;

// Properties of one plugin device, in the newest layout; the export shims narrow them per version.
// The strings stay valid until the plugin is unloaded or its last reference is finalized.
struct DeviceProps {
  const char* name = nullptr;
  const char* pci_path = nullptr;  // sysfs path of the NIC's PCI device; NULL when it has none
  uint64_t guid = 0;
  int ptr_support = nccl_abi::kPtrHost;
  int reg_is_global = 1;
  int force_flush = 0;
  int speed = kDefaultSpeedMbps;
  int port = 1;
  int max_comms = 0;
  int max_recvs = 0;
  nccl_abi::VDeviceProps vprops{};
  size_t max_p2p_bytes = 0;
  size_t max_coll_bytes = 0;
};

// Takes a reference on the plugin (probing the NICs on the first one). Succeeds with no devices
// when the host has no usable NIC, so that NCCL falls back to its own transports.
Status acquire(nccl_abi::Logger logger);
// Drops a reference; the last one closes every engine and forgets the devices.
void release();

Status device_count(int* ndev);
Status device_properties(int dev, DeviceProps* props);
Status make_vdevice(int* dev, const nccl_abi::VDeviceProps* props);

// Connection setup; none of these blocks: a NULL comm means "call again".
Status listen(int dev, void* handle, void** listen_comm);
// traffic_class: the connection's (NCCL's per-communicator class; -1: PONTE_IB_TC). Comms of one
// class share an engine peer (its verbs QPs send in that class); the accepting end follows.
Status connect(int dev, void* handle, void** send_comm, int traffic_class = -1);
Status accept(void* listen_comm, void** recv_comm);
Status close_listen(void* listen_comm);
Status close_send(void* send_comm);
Status close_recv(void* recv_comm);

// Memory registration (cached per device: page aligned, reference counted).
// dmabuf_fd >= 0 (regMrDmaBuf, GPU memory): the NIC registers through that dmabuf, in which data
// sits at dmabuf_offset.
Status reg_mr(void* comm, void* data, size_t size, int type, void** mhandle, int dmabuf_fd = -1,
              uint64_t dmabuf_offset = 0);
Status dereg_mr(void* comm, void* mhandle);

// Data path. A NULL request means "not now, call again".
Status isend(void* send_comm, void* data, size_t size, int tag, void* mhandle, void** request);
Status irecv(void* recv_comm, int n, void** data, const size_t* sizes, const int* tags,
             void** mhandles, void** request);
Status iflush(void* recv_comm, int n, void** data, const int* sizes, void** mhandles,
              void** request);
// On done, sizes[0..n) (n = 1 for sends and flushes, the grouped count for receives) get the
// bytes moved; *count says how many were written.
Status test(void* request, int* done, size_t* sizes, int* count);

// Maps a ponte error to the NCCL result code NCCL expects for it.
nccl_abi::NcclResult to_nccl(const Status& st);

}  // namespace ponte::plugin
