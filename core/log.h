// Logging for everything built on core/: one sink (stderr by default, NCCL's logger inside the
// plugin) and a level from PONTE_LOG. Never called on the hot path.
#pragma once

namespace ponte {

enum class LogLevel : int { kError = 0, kWarn = 1, kInfo = 2, kDebug = 3 };

using LogSink = void (*)(LogLevel level, const char* line);

// Replaces the sink (nullptr restores stderr). The level filter still applies.
void set_log_sink(LogSink sink);
void log(LogLevel level, const char* fmt, ...) __attribute__((format(printf, 2, 3)));

#define PONTE_LOG_ERROR(...) ::ponte::log(::ponte::LogLevel::kError, __VA_ARGS__)
#define PONTE_LOG_WARN(...) ::ponte::log(::ponte::LogLevel::kWarn, __VA_ARGS__)
#define PONTE_LOG_INFO(...) ::ponte::log(::ponte::LogLevel::kInfo, __VA_ARGS__)
#define PONTE_LOG_DEBUG(...) ::ponte::log(::ponte::LogLevel::kDebug, __VA_ARGS__)

}  // namespace ponte
