// Loads libfabric at run time (dlopen, never linked) and holds the few entry points it really
// exports; everything else in rdma/fi_*.h is inline and goes through each object's ops table.
#pragma once

#include <rdma/fabric.h>

#include <cstdint>
#include <string>
#include <vector>

#include "core/status.h"

namespace ponte::fabric {

// The exported libfabric functions ponte calls. Never call the exported symbols directly (not even
// through inline helpers such as fi_allocinfo): that would link ponte against libfabric.
struct FabricLibrary {
  std::string path;          // the name dlopen succeeded with
  void* handle = nullptr;    // dlopen handle; never closed (providers may keep threads)
  uint32_t version = 0;      // fi_version() of the loaded library
  uint32_t api_version = 0;  // what ponte asks for: min(headers ponte was built with, library)

  int (*getinfo)(uint32_t version, const char* node, const char* service, uint64_t flags,
                 const struct fi_info* hints, struct fi_info** info) = nullptr;
  void (*freeinfo)(struct fi_info* info) = nullptr;
  struct fi_info* (*dupinfo)(const struct fi_info* info) = nullptr;
  int (*fabric)(struct fi_fabric_attr* attr, struct fid_fabric** fabric, void* context) = nullptr;
  const char* (*strerror)(int errnum) = nullptr;
  uint32_t (*fi_version)() = nullptr;

  // fi_allocinfo() without touching the exported fi_dupinfo symbol.
  struct fi_info* allocinfo() const {
    return dupinfo(nullptr);
  }
  // Text for a libfabric return code (negative or positive errno).
  const char* error_text(long rc) const { return strerror(static_cast<int>(rc < 0 ? -rc : rc)); }
};

// Where ponte looks for libfabric, in order: the explicit path (PONTE_FABRIC_LIB) when set, then
// AWS's EFA installer folders, then "libfabric.so.1" through the dynamic loader's search path.
std::vector<std::string> fabric_library_candidates(const std::string& explicit_path);

// Loads the first candidate that is a usable libfabric (opens, has every symbol, major version 1).
// A failing explicit (first) candidate is reported on stderr and the search goes on. Loaded
// libraries are cached for the life of the process, so the pointer stays valid forever.
// kUnavailable, naming every candidate and why it failed, when none works.
Result<const FabricLibrary*> load_fabric_library(const std::vector<std::string>& candidates,
                                                 bool first_is_explicit);

}  // namespace ponte::fabric
