// Names of ponte's error codes, for messages and logs.
#include "core/status.h"

#include "core/nic.h"

namespace ponte {

const char* code_name(Code c) {
  switch (c) {
    case Code::kOk: return "ok";
    case Code::kInvalidArgument: return "invalid argument";
    case Code::kNotFound: return "not found";
    case Code::kUnavailable: return "unavailable";
    case Code::kAgain: return "try again";
    case Code::kPeerDead: return "peer dead";
    case Code::kTimeout: return "timeout";
    case Code::kTransport: return "transport error";
    case Code::kResource: return "out of resources";
    case Code::kCancelled: return "cancelled";
    case Code::kInternal: return "internal error";
  }
  return "unknown";
}

const char* backend_name(BackendKind k) {
  switch (k) {
    case BackendKind::kFabric: return "fabric";
    case BackendKind::kVerbs: return "verbs";
  }
  return "unknown";
}

}  // namespace ponte
