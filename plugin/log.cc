// NCCL logger routing (see log.h).
#include "plugin/log.h"

#include <atomic>
#include <cstdarg>
#include <cstdio>

#include "core/config.h"

namespace ponte::plugin {

namespace {
std::atomic<nccl_abi::Logger> g_logger{nullptr};
}

void set_logger(nccl_abi::Logger logger) {
  if (logger) g_logger.store(logger, std::memory_order_release);
}

void log_line(nccl_abi::LogLevel level, const char* file, int line, const char* fmt, ...) {
  char text[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(text, sizeof(text), fmt, ap);
  va_end(ap);
  nccl_abi::Logger logger = g_logger.load(std::memory_order_acquire);
  if (logger) {
    logger(level, nccl_abi::kSubsysInit | nccl_abi::kSubsysNet, file, line, "NET/ponte : %s", text);
    return;
  }
  // No NCCL logger (a host program that loaded the plugin itself): warnings always, the rest
  // when PONTE_LOG asks for info.
  if (level == nccl_abi::kLogWarn || global_config().log_level >= 2)
    std::fprintf(stderr, "ponte-nccl %s: %s\n", level == nccl_abi::kLogWarn ? "WARN" : "INFO",
                 text);
}

}  // namespace ponte::plugin
