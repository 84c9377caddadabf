// Logging sink and level filter.
#include "core/log.h"

#include <atomic>
#include <cstdarg>
#include <cstdio>

#include "core/config.h"

namespace ponte {

static std::atomic<LogSink> g_sink{nullptr};

void set_log_sink(LogSink sink) { g_sink.store(sink, std::memory_order_release); }

void log(LogLevel level, const char* fmt, ...) {
  if (static_cast<int>(level) > global_config().log_level) return;
  char line[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(line, sizeof(line), fmt, ap);
  va_end(ap);
  LogSink sink = g_sink.load(std::memory_order_acquire);
  if (sink) {
    sink(level, line);
    return;
  }
  static const char* names[] = {"ERROR", "WARN", "INFO", "DEBUG"};
  fprintf(stderr, "ponte %s: %s\n", names[static_cast<int>(level)], line);
}

}  // namespace ponte
