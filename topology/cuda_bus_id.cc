// CUDA device -> PCI bus id via the driver API, dlopen'ed: cuInit, cuDeviceGetCount, cuDeviceGet,
// cuDeviceGetPCIBusId. The driver stays loaded once found (CUDA does not support unloading it).
#include "topology/cuda_bus_id.h"

#include <dlfcn.h>

#include <string>
#include <type_traits>

#include "topology/topology.h"

#ifdef PONTE_WITH_CUDA
#include <cuda.h>
#endif

namespace ponte::topo {
namespace {

// The driver API's ABI: CUresult is an enum (int), CUdevice an int.
using CuResult = int;
using CuDevice = int;
using CuInitFn = CuResult (*)(unsigned int);
using CuDeviceGetCountFn = CuResult (*)(int*);
using CuDeviceGetFn = CuResult (*)(CuDevice*, int);
using CuDeviceGetPciBusIdFn = CuResult (*)(char*, int, CuDevice);
using CuGetErrorStringFn = CuResult (*)(CuResult, const char**);

#ifdef PONTE_WITH_CUDA
// When cuda.h is at hand, check that the signatures above match it.
static_assert(sizeof(CUresult) == sizeof(CuResult) && sizeof(CUdevice) == sizeof(CuDevice));
static_assert(std::is_same_v<decltype(&cuDeviceGetPCIBusId), CUresult (*)(char*, int, CUdevice)>);
static_assert(std::is_same_v<decltype(&cuDeviceGet), CUresult (*)(CUdevice*, int)>);
static_assert(std::is_same_v<decltype(&cuDeviceGetCount), CUresult (*)(int*)>);
static_assert(std::is_same_v<decltype(&cuInit), CUresult (*)(unsigned int)>);
#endif

struct Driver {
  CuInitFn init = nullptr;
  CuDeviceGetCountFn get_count = nullptr;
  CuDeviceGetFn get = nullptr;
  CuDeviceGetPciBusIdFn get_pci_bus_id = nullptr;
  CuGetErrorStringFn error_string = nullptr;

  std::string describe(const char* call, CuResult rc) const {
    const char* text = nullptr;
    if (error_string == nullptr || error_string(rc, &text) != 0 || text == nullptr) text = "unknown error";
    return std::string(call) + " failed: CUDA error " + std::to_string(rc) + " (" + text + ")";
  }
};

// Loads the driver and initialises it; on failure returns the error.
std::string load(const char* library, Driver& driver) {
  if (library == nullptr || *library == '\0') return "CUDA driver not available: no library named";
  void* handle = dlopen(library, RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* why = dlerror();
    return std::string("CUDA driver not available: ") + (why ? why : library);
  }
  driver.init = reinterpret_cast<CuInitFn>(dlsym(handle, "cuInit"));
  driver.get_count = reinterpret_cast<CuDeviceGetCountFn>(dlsym(handle, "cuDeviceGetCount"));
  driver.get = reinterpret_cast<CuDeviceGetFn>(dlsym(handle, "cuDeviceGet"));
  driver.get_pci_bus_id = reinterpret_cast<CuDeviceGetPciBusIdFn>(dlsym(handle, "cuDeviceGetPCIBusId"));
  driver.error_string = reinterpret_cast<CuGetErrorStringFn>(dlsym(handle, "cuGetErrorString"));
  if (!driver.init || !driver.get_count || !driver.get || !driver.get_pci_bus_id) {
    dlclose(handle);
    return std::string("CUDA driver not available: ") + library +
           " lacks cuInit/cuDeviceGetCount/cuDeviceGet/cuDeviceGetPCIBusId";
  }
  // The handle stays open: CUDA does not support unloading the driver.
  if (const CuResult rc = driver.init(0); rc != 0) return driver.describe("cuInit", rc);
  return {};
}

}  // namespace

CudaBusIds cuda_pci_bus_ids(const char* driver_library) {
  CudaBusIds out;
  Driver driver;
  out.error = load(driver_library, driver);
  if (!out.error.empty()) return out;
  int count = 0;
  if (const CuResult rc = driver.get_count(&count); rc != 0) {
    out.error = driver.describe("cuDeviceGetCount", rc);
    return out;
  }
  for (int ordinal = 0; ordinal < count; ++ordinal) {
    CuDevice device = 0;
    char text[64] = {};
    if (const CuResult rc = driver.get(&device, ordinal); rc != 0) {
      out.error = driver.describe("cuDeviceGet", rc);
      return out;
    }
    if (const CuResult rc = driver.get_pci_bus_id(text, sizeof(text) - 1, device); rc != 0) {
      out.error = driver.describe("cuDeviceGetPCIBusId", rc);
      return out;
    }
    std::string pci = normalize_pci_bus_id(text);
    if (pci.empty()) {
      out.error = std::string("cuDeviceGetPCIBusId gave an unreadable bus id: ") + text;
      return out;
    }
    out.pci.push_back(std::move(pci));
  }
  out.ok = true;
  return out;
}

CudaBusId cuda_pci_bus_id(int ordinal, const char* driver_library) {
  CudaBusId out;
  CudaBusIds all = cuda_pci_bus_ids(driver_library);
  if (!all.ok) {
    out.error = std::move(all.error);
    return out;
  }
  if (ordinal < 0 || static_cast<size_t>(ordinal) >= all.pci.size()) {
    out.error = "no CUDA device " + std::to_string(ordinal) + " (this process sees " +
                std::to_string(all.pci.size()) + ")";
    return out;
  }
  out.pci = all.pci[static_cast<size_t>(ordinal)];
  out.ok = true;
  return out;
}

}  // namespace ponte::topo
