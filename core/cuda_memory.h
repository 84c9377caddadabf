// CUDA memory for registration: a dmabuf file descriptor for a device address range, through the
// CUDA driver API loaded at run time (no link dependency; a host without CUDA gets kUnavailable).
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/status.h"

namespace ponte {

struct CudaDmabuf {
  int fd = -1;
  uint64_t offset = 0;  // of the requested address within the exported (page-aligned) range
  CudaDmabuf() = default;
  CudaDmabuf(const CudaDmabuf&) = delete;
  CudaDmabuf& operator=(const CudaDmabuf&) = delete;
  CudaDmabuf(CudaDmabuf&& o) noexcept : fd(o.fd), offset(o.offset) { o.fd = -1; }
  CudaDmabuf& operator=(CudaDmabuf&& o) noexcept;
  ~CudaDmabuf();
};

// Exports [addr, addr+len) of CUDA memory as a dmabuf (cuMemGetHandleForAddressRange).
Result<CudaDmabuf> cuda_dmabuf_for_range(void* addr, size_t len);

// The ordinal of the CUDA device whose memory holds addr (cuPointerGetAttribute's
// DEVICE_ORDINAL): what libfabric's FI_HMEM registration needs. kUnavailable without a driver,
// kInvalidArgument when addr is no CUDA memory.
Result<int> cuda_device_of(const void* addr);

// Whether this host's CUDA driver loads and initializes (there is a GPU to register memory of).
bool cuda_driver_usable();

}  // namespace ponte
