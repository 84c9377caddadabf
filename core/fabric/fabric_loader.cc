// Run-time loading of libfabric: dlopen + dlsym of its few real exports, cached per process.
#include "core/fabric/fabric_loader.h"

#include <dlfcn.h>

#include <algorithm>
#include <memory>
#include <mutex>

#include "core/log.h"
#include "core/signal_guard.h"

namespace ponte::fabric {
namespace {

// Loaded libraries live until the process exits (reachable from this pointer, so leak checkers
// stay quiet); libfabric providers may own threads and handlers that must not be unmapped.
std::mutex g_cache_mutex;
std::vector<std::unique_ptr<FabricLibrary>>* g_cache = nullptr;

template <typename Fn>
bool bind_symbol(void* handle, const char* name, Fn* out, std::string* why) {
  dlerror();
  void* sym = dlsym(handle, name);
  if (sym == nullptr) {
    *why = std::string("no symbol ") + name;
    return false;
  }
  *out = reinterpret_cast<Fn>(sym);
  return true;
}

// Opens one candidate; nullptr and *why filled when it is not a usable libfabric.
std::unique_ptr<FabricLibrary> try_open(const std::string& path, std::string* why) {
  // Over the dlopen and a dlclose below: the handlers a dependency installs are given back
  // (core/signal_guard.h: Debian's libfabric links libinfinipath, whose handlers exit(1)).
  SignalGuard keep_handlers(path);
  dlerror();
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* err = dlerror();
    *why = err ? err : "dlopen failed";
    return nullptr;
  }
  auto lib = std::make_unique<FabricLibrary>();
  lib->path = path;
  lib->handle = handle;
  bool ok = bind_symbol(handle, "fi_getinfo", &lib->getinfo, why) &&
            bind_symbol(handle, "fi_freeinfo", &lib->freeinfo, why) &&
            bind_symbol(handle, "fi_dupinfo", &lib->dupinfo, why) &&
            bind_symbol(handle, "fi_fabric", &lib->fabric, why) &&
            bind_symbol(handle, "fi_strerror", &lib->strerror, why) &&
            bind_symbol(handle, "fi_version", &lib->fi_version, why);
  if (ok) {
    lib->version = lib->fi_version();
    if (FI_MAJOR(lib->version) != FI_MAJOR_VERSION) {
      *why = "libfabric major version " + std::to_string(FI_MAJOR(lib->version)) +
             ", ponte needs " + std::to_string(FI_MAJOR_VERSION);
      ok = false;
    }
  }
  if (!ok) {
    dlclose(handle);
    return nullptr;
  }
  // Ask for the API ponte was compiled against, or the library's own when it is older: the
  // structures ponte fills are then ones both sides know.
  lib->api_version =
      std::min<uint32_t>(lib->version, FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION));
  return lib;
}

}  // namespace

std::vector<std::string> fabric_library_candidates(const std::string& explicit_path) {
  std::vector<std::string> out;
  if (!explicit_path.empty()) out.push_back(explicit_path);
  out.push_back("/opt/amazon/efa/lib/libfabric.so.1");
  out.push_back("/opt/amazon/efa/lib64/libfabric.so.1");
  out.push_back("libfabric.so.1");
  return out;
}

Result<const FabricLibrary*> load_fabric_library(const std::vector<std::string>& candidates,
                                                 bool first_is_explicit) {
  std::lock_guard<std::mutex> lock(g_cache_mutex);
  if (g_cache == nullptr) g_cache = new std::vector<std::unique_ptr<FabricLibrary>>();
  std::string tried;
  for (size_t i = 0; i < candidates.size(); ++i) {
    const std::string& path = candidates[i];
    for (const auto& lib : *g_cache) {
      if (lib->path == path) return static_cast<const FabricLibrary*>(lib.get());
    }
    std::string why;
    std::unique_ptr<FabricLibrary> lib = try_open(path, &why);
    if (lib == nullptr) {
      if (i == 0 && first_is_explicit) {
        PONTE_LOG_WARN(
            "fabric: PONTE_FABRIC_LIB=%s is not a usable libfabric (%s); searching the default "
            "places",
            path.c_str(), why.c_str());
      }
      if (!tried.empty()) tried += "; ";
      tried += path + ": " + why;
      continue;
    }
    // dlopen of another name for an already loaded file returns the same handle: share it.
    for (const auto& known : *g_cache) {
      if (known->handle == lib->handle) {
        dlclose(lib->handle);  // drop the extra reference taken above
        return static_cast<const FabricLibrary*>(known.get());
      }
    }
    g_cache->push_back(std::move(lib));
    return static_cast<const FabricLibrary*>(g_cache->back().get());
  }
  return Status(Code::kUnavailable, "libfabric not found (%.90s)", tried.c_str());
}

}  // namespace ponte::fabric
