// dmabuf export of CUDA memory through libcuda.so.1, loaded on first use.
#include "core/cuda_memory.h"

#include <dlfcn.h>
#include <unistd.h>

#include <mutex>

namespace ponte {

namespace {
// The two driver entry points used, declared by hand (CUDA's own enum values, CUDA >= 11.7).
using CUresult = int;
using CUdeviceptr = unsigned long long;
constexpr int kRangeHandleTypeDmaBufFd = 1;
using GetHandleFn = CUresult (*)(void* handle, CUdeviceptr dptr, size_t size, int type, unsigned long long flags);
using InitFn = CUresult (*)(unsigned int flags);
using PointerAttrFn = CUresult (*)(void* data, int attribute, CUdeviceptr ptr);
constexpr int kPointerAttributeDeviceOrdinal = 9;  // CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL

struct CudaDriver {
  GetHandleFn get_handle = nullptr;
  PointerAttrFn pointer_attr = nullptr;
  const char* error = nullptr;
};

const CudaDriver& driver() {
  static CudaDriver d = [] {
    CudaDriver r;
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      r.error = "libcuda.so.1 not found (no NVIDIA driver on this host)";
      return r;
    }
    auto init = reinterpret_cast<InitFn>(dlsym(lib, "cuInit"));
    r.get_handle = reinterpret_cast<GetHandleFn>(dlsym(lib, "cuMemGetHandleForAddressRange"));
    r.pointer_attr = reinterpret_cast<PointerAttrFn>(dlsym(lib, "cuPointerGetAttribute"));
    if (!init || !r.get_handle || !r.pointer_attr) {
      r.get_handle = nullptr;
      r.pointer_attr = nullptr;
      r.error = "the CUDA driver has no cuMemGetHandleForAddressRange (needs CUDA 11.7+)";
      return r;
    }
    if (init(0) != 0) {
      r.get_handle = nullptr;
      r.pointer_attr = nullptr;
      r.error = "cuInit failed (no usable GPU)";
    }
    return r;
  }();
  return d;
}
}  // namespace

CudaDmabuf& CudaDmabuf::operator=(CudaDmabuf&& o) noexcept {
  if (this != &o) {
    if (fd >= 0) close(fd);
    fd = o.fd;
    offset = o.offset;
    o.fd = -1;
  }
  return *this;
}

CudaDmabuf::~CudaDmabuf() {
  if (fd >= 0) close(fd);
}

Result<CudaDmabuf> cuda_dmabuf_for_range(void* addr, size_t len) {
  const CudaDriver& d = driver();
  if (!d.get_handle) return Status(Code::kUnavailable, "%s", d.error);
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  uint64_t a = reinterpret_cast<uint64_t>(addr);
  uint64_t base = a & ~(page - 1);
  uint64_t end = (a + len + page - 1) & ~(page - 1);
  int fd = -1;
  CUresult rc = d.get_handle(&fd, base, end - base, kRangeHandleTypeDmaBufFd, 0);
  if (rc != 0 || fd < 0) return Status(Code::kUnavailable, "cuMemGetHandleForAddressRange failed (%d): no dmabuf support", rc);
  CudaDmabuf out;
  out.fd = fd;
  out.offset = a - base;
  return out;
}

Result<int> cuda_device_of(const void* addr) {
  const CudaDriver& d = driver();
  if (!d.pointer_attr) return Status(Code::kUnavailable, "no device ordinal: %s", d.error);
  int ordinal = -1;
  CUresult rc = d.pointer_attr(&ordinal, kPointerAttributeDeviceOrdinal, reinterpret_cast<CUdeviceptr>(addr));
  if (rc != 0 || ordinal < 0)
    return Status(Code::kInvalidArgument, "%p is no CUDA memory (cuPointerGetAttribute: %d)", addr, rc);
  return ordinal;
}

bool cuda_driver_usable() { return driver().get_handle != nullptr; }

}  // namespace ponte
