// Parses every PONTE_* environment variable once (see the table in README.md).
#include "core/config.h"

#include <sched.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

namespace ponte {

Result<size_t> parse_size(const std::string& text) {
  if (text.empty()) return Status(Code::kInvalidArgument, "empty size");
  char* end = nullptr;
  errno = 0;
  unsigned long long v = strtoull(text.c_str(), &end, 10);
  if (errno != 0 || end == text.c_str() || text[0] == '-')
    return Status(Code::kInvalidArgument, "bad size '%s'", text.c_str());
  unsigned long long mult = 1;
  std::string suffix(end);
  if (suffix.empty() || suffix == "b" || suffix == "B") mult = 1;
  else if (suffix == "k" || suffix == "K" || suffix == "KiB" || suffix == "kb") mult = 1ull << 10;
  else if (suffix == "m" || suffix == "M" || suffix == "MiB" || suffix == "mb") mult = 1ull << 20;
  else if (suffix == "g" || suffix == "G" || suffix == "GiB" || suffix == "gb") mult = 1ull << 30;
  else return Status(Code::kInvalidArgument, "bad size suffix in '%s'", text.c_str());
  if (v > (~0ull) / mult) return Status(Code::kInvalidArgument, "size '%s' overflows", text.c_str());
  return static_cast<size_t>(v * mult);
}

namespace {

const char* env(const char* name) {
  const char* v = getenv(name);
  return (v && *v) ? v : nullptr;
}

Status parse_uint(const char* name, uint64_t max, uint64_t* out) {
  const char* v = env(name);
  if (!v) return Status::Ok();
  char* end = nullptr;
  errno = 0;
  unsigned long long x = strtoull(v, &end, 10);
  if (errno != 0 || *end != '\0' || v[0] == '-' || x > max)
    return Status(Code::kInvalidArgument, "%s='%s': expected an integer in [0, %llu]", name, v,
                  static_cast<unsigned long long>(max));
  *out = x;
  return Status::Ok();
}

template <typename T>
Status parse_into(const char* name, uint64_t max, T* field) {
  uint64_t x = static_cast<uint64_t>(*field);
  PONTE_RETURN_IF_ERROR(parse_uint(name, max, &x));
  *field = static_cast<T>(x);
  return Status::Ok();
}

}  // namespace

Result<Config> Config::from_env() {
  Config c;
  if (const char* v = env("PONTE_BACKEND")) {
    std::string s(v);
    if (s == "auto") c.backend = BackendChoice::kAuto;
    else if (s == "fabric" || s == "libfabric" || s == "ofi") c.backend = BackendChoice::kFabric;
    else if (s == "verbs" || s == "ib" || s == "ibverbs") c.backend = BackendChoice::kVerbs;
    else return Status(Code::kInvalidArgument, "PONTE_BACKEND='%s': expected auto|fabric|verbs", v);
  }
  if (const char* v = env("PONTE_FABRIC_PROVIDER")) c.fabric_provider = v;
  if (const char* v = env("PONTE_FABRIC_LIB")) c.fabric_lib = v;
  if (const char* v = env("PONTE_FABRIC_HMEM")) {
    std::string s(v);
    if (s == "auto") c.fabric_hmem = -1;
    else if (s == "1" || s == "on") c.fabric_hmem = 1;
    else if (s == "0" || s == "off") c.fabric_hmem = 0;
    else return Status(Code::kInvalidArgument, "PONTE_FABRIC_HMEM='%s': expected auto|1|0", v);
  }
  if (const char* v = env("PONTE_VERBS_LIB")) c.verbs_lib = v;
  if (const char* v = env("PONTE_IB_HCA")) c.ib_hca = v;
  if (const char* v = env("PONTE_IB_GID_INDEX")) {
    char* end = nullptr;
    long x = strtol(v, &end, 10);
    if (*end != '\0' || x < -1 || x > 255)
      return Status(Code::kInvalidArgument, "PONTE_IB_GID_INDEX='%s': expected -1..255", v);
    c.ib_gid_index = static_cast<int>(x);
  }
  PONTE_RETURN_IF_ERROR(parse_into("PONTE_IB_TC", 255, &c.ib_traffic_class));
  PONTE_RETURN_IF_ERROR(parse_into("PONTE_IB_SL", 15, &c.ib_service_level));
  PONTE_RETURN_IF_ERROR(parse_into("PONTE_IB_TIMEOUT", 31, &c.ib_timeout));
  PONTE_RETURN_IF_ERROR(parse_into("PONTE_IB_RETRY_CNT", 7, &c.ib_retry_count));
  PONTE_RETURN_IF_ERROR(parse_into("PONTE_IB_QPS_PER_CONNECTION", 16, &c.ib_qps_per_connection));
  if (c.ib_qps_per_connection == 0)
    return Status(Code::kInvalidArgument, "PONTE_IB_QPS_PER_CONNECTION must be 1..16");
  PONTE_RETURN_IF_ERROR(parse_into("PONTE_NICS", 16, &c.nics_per_group));
  int idle_wake = 0;
  PONTE_RETURN_IF_ERROR(parse_into("PONTE_IDLE_WAKE", 1, &idle_wake));
  c.idle_wake_on_data = idle_wake != 0;
  int flush_host = 0;
  PONTE_RETURN_IF_ERROR(parse_into("PONTE_FLUSH_HOST", 1, &flush_host));
  c.flush_host = flush_host != 0;
  PONTE_RETURN_IF_ERROR(parse_into("PONTE_NET_INLINE", 4096, &c.net_inline));
  int net_eager = 1, eager_nic_copy = 0;
  PONTE_RETURN_IF_ERROR(parse_into("PONTE_NET_EAGER", 1, &net_eager));
  PONTE_RETURN_IF_ERROR(parse_into("PONTE_NET_EAGER_NIC_COPY", 1, &eager_nic_copy));
  c.net_eager = net_eager != 0;
  c.net_eager_nic_copy = eager_nic_copy != 0;
  PONTE_RETURN_IF_ERROR(parse_into("PONTE_NET_CTS_AHEAD", 31, &c.net_cts_ahead));
  PONTE_RETURN_IF_ERROR(parse_into("PONTE_FAULT_DROP_RECVS", 1u << 20, &c.fault_drop_recvs));
  PONTE_RETURN_IF_ERROR(parse_into("PONTE_FAULT_FAILED_CONNECTS", 1000, &c.fault_failed_connects));
  PONTE_RETURN_IF_ERROR(parse_into("PONTE_FAULT_BUSY_ACKS", 1u << 20, &c.fault_busy_acks));
  if (const char* v = env("PONTE_STRIPE_MIN")) {
    auto r = parse_size(v);
    if (!r.ok()) return Status(Code::kInvalidArgument, "PONTE_STRIPE_MIN: %s", r.status().message());
    c.stripe_min_bytes = *r;
  }
  PONTE_RETURN_IF_ERROR(parse_into("PONTE_TIMEOUT_MS", 3600u * 1000u, &c.timeout_ms));
  if (c.timeout_ms == 0) return Status(Code::kInvalidArgument, "PONTE_TIMEOUT_MS must be > 0");
  if (const char* v = env("PONTE_CTRL_ADDR")) c.ctrl_addr = v;
  if (const char* v = env("PONTE_JOB_KEY")) c.job_key = v;
  if (const char* v = env("PONTE_SOCKET_IFNAME")) c.socket_ifname = v;
  PONTE_RETURN_IF_ERROR(parse_into("PONTE_SPIN_US", 10u * 1000u * 1000u, &c.spin_us));
  PONTE_RETURN_IF_ERROR(parse_into("PONTE_POLLER_SLEEP_US", 60u * 1000u * 1000u, &c.poller_sleep_us));
  if (c.poller_sleep_us < 50) return Status(Code::kInvalidArgument, "PONTE_POLLER_SLEEP_US must be >= 50");
  PONTE_RETURN_IF_ERROR(parse_into("PONTE_IDLE_SLEEP_US", 60u * 1000u * 1000u, &c.idle_sleep_us));
  if (c.idle_sleep_us < 50) return Status(Code::kInvalidArgument, "PONTE_IDLE_SLEEP_US must be >= 50");
  PONTE_RETURN_IF_ERROR(parse_into("PONTE_POLLER_HOLD_US", 1000u * 1000u, &c.poller_hold_us));
  if (c.poller_hold_us < 10) return Status(Code::kInvalidArgument, "PONTE_POLLER_HOLD_US must be >= 10");
  PONTE_RETURN_IF_ERROR(parse_into("PONTE_QUEUE_DEPTH", 1u << 20, &c.queue_depth));
  PONTE_RETURN_IF_ERROR(parse_into("PONTE_MAX_INFLIGHT", 1u << 20, &c.max_inflight));
  if (c.queue_depth < 2 || c.max_inflight < 1)
    return Status(Code::kInvalidArgument, "PONTE_QUEUE_DEPTH >= 2 and PONTE_MAX_INFLIGHT >= 1");
  if (const char* v = env("PONTE_RECV_SIZE")) {
    auto r = parse_size(v);
    if (!r.ok() || *r == 0 || *r > (64u << 20))
      return Status(Code::kInvalidArgument, "PONTE_RECV_SIZE='%s': expected 1..64m", v);
    c.recv_buf_size = static_cast<uint32_t>(*r);
  }
  PONTE_RETURN_IF_ERROR(parse_into("PONTE_RECV_COUNT", 65536, &c.recv_buf_count));
  if (c.recv_buf_count == 0) return Status(Code::kInvalidArgument, "PONTE_RECV_COUNT must be > 0");
  if (const char* v = env("PONTE_PROGRESS_CORES")) {
    std::string s(v);
    size_t pos = 0;
    while (pos <= s.size()) {
      size_t comma = s.find(',', pos);
      std::string item = s.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
      char* end = nullptr;
      long core = strtol(item.c_str(), &end, 10);
      if (item.empty() || *end != '\0' || core < 0 || core > 65535)
        return Status(Code::kInvalidArgument, "PONTE_PROGRESS_CORES='%s': expected a list like 2,3", v);
      c.progress_cores.push_back(static_cast<int>(core));
      if (comma == std::string::npos) break;
      pos = comma + 1;
    }
  }
  if (const char* v = env("PONTE_TOPO_FILE")) c.topo_file = v;
  if (const char* v = env("PONTE_LOG")) {
    std::string s(v);
    if (s == "error" || s == "0") c.log_level = 0;
    else if (s == "warn" || s == "1") c.log_level = 1;
    else if (s == "info" || s == "2") c.log_level = 2;
    else if (s == "debug" || s == "3") c.log_level = 3;
    else return Status(Code::kInvalidArgument, "PONTE_LOG='%s': expected error|warn|info|debug", v);
  }
  return c;
}

Status check_cores_usable(const std::vector<int>& cores, const char* what) {
  if (cores.empty()) return Status::Ok();
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  if (sched_getaffinity(0, sizeof(allowed), &allowed) != 0)
    return Status(Code::kInternal, "%s: sched_getaffinity: %s", what, strerror(errno));
  for (int core : cores)
    if (core < 0 || core >= CPU_SETSIZE || !CPU_ISSET(core, &allowed))
      return Status(Code::kInvalidArgument, "%s: this process may not run on core %d", what, core);
  return Status::Ok();
}

const Config& global_config() {
  static Config cfg = [] {
    auto r = Config::from_env();
    if (r.ok()) return r.value();
    fprintf(stderr, "ponte ERROR: %s; using defaults for all PONTE_* settings\n",
            r.status().message());
    return Config{};
  }();
  return cfg;
}

}  // namespace ponte
