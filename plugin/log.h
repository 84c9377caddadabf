// Logging of the NCCL plugin: every line goes through the logger NCCL passed to init(), so that
// NCCL_DEBUG=INFO/WARN shows ponte's lines with NCCL's; before init (or without one) to stderr.
#pragma once

#include "plugin/nccl_net_abi.h"

namespace ponte::plugin {

void set_logger(nccl_abi::Logger logger);
void log_line(nccl_abi::LogLevel level, const char* file, int line, const char* fmt, ...)
    __attribute__((format(printf, 4, 5)));

}  // namespace ponte::plugin

#define PONTE_NET_WARN(...) \
  ::ponte::plugin::log_line(::ponte::nccl_abi::kLogWarn, __FILE__, __LINE__, __VA_ARGS__)
#define PONTE_NET_INFO(...) \
  ::ponte::plugin::log_line(::ponte::nccl_abi::kLogInfo, __FILE__, __LINE__, __VA_ARGS__)
