// Configuration: every PONTE_* environment variable, parsed once, in one place. The README's
// "Configuration" table documents each one with its default; keep the two in step.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "core/status.h"

namespace ponte {

enum class BackendChoice : uint8_t { kAuto, kFabric, kVerbs };

struct Config {
  BackendChoice backend = BackendChoice::kAuto;  // PONTE_BACKEND=auto|fabric|verbs
  std::string fabric_provider = "efa";           // PONTE_FABRIC_PROVIDER
  std::string fabric_lib;                        // PONTE_FABRIC_LIB: path of libfabric.so to load
  int fabric_hmem = -1;                          // PONTE_FABRIC_HMEM=auto(-1)|0|1: ask for FI_HMEM
  std::string verbs_lib;                         // PONTE_VERBS_LIB: path of libibverbs.so to load
  std::string ib_hca;                            // PONTE_IB_HCA: NCCL_IB_HCA syntax (^ excl, = exact)
  int ib_gid_index = -1;                         // PONTE_IB_GID_INDEX: -1 picks RoCEv2 IPv4
  int ib_traffic_class = 0;                      // PONTE_IB_TC
  int ib_service_level = 0;                      // PONTE_IB_SL
  int ib_timeout = 20;                           // PONTE_IB_TIMEOUT (4.096us * 2^x), NCCL's 20
  int ib_retry_count = 7;                        // PONTE_IB_RETRY_CNT
  int ib_qps_per_connection = 1;                 // PONTE_IB_QPS_PER_CONNECTION: RC QPs per peer NIC
  int nics_per_group = 0;                        // PONTE_NICS: NICs in the host group, 0 = all
  size_t stripe_min_bytes = 256 * 1024;          // PONTE_STRIPE_MIN: below this, one NIC per write
  uint32_t timeout_ms = 30000;                   // PONTE_TIMEOUT_MS: op / peer / connect timeout
  std::string ctrl_addr;                         // PONTE_CTRL_ADDR: IP advertised for the peer socket
  std::string job_key;                           // PONTE_JOB_KEY: shared control-socket key (never logged)
  std::string socket_ifname;                     // PONTE_SOCKET_IFNAME: interface for that IP
  uint32_t spin_us = 200;                        // PONTE_SPIN_US: busy-poll this long after work
  uint32_t poller_sleep_us = 5000;               // PONTE_POLLER_SLEEP_US: worker's longest sleep while polled
  uint32_t idle_sleep_us = 1000;                 // PONTE_IDLE_SLEEP_US: idle worker's longest sleep (>= 50)
  bool idle_wake_on_data = false;                // PONTE_IDLE_WAKE: idle worker also wakes for arriving data
  bool idle_wake_unchecked = false;  // tests only (no variable): with idle_wake_on_data, a wait object even
                                     // where NicInfo::cq_wait_resets is false (to check that rule)
  uint32_t poller_hold_us = 2000;                // PONTE_POLLER_HOLD_US: a poller keeps the data path this long
  uint32_t queue_depth = 8192;                   // PONTE_QUEUE_DEPTH: submission ring entries
  uint32_t max_inflight = 16384;                 // PONTE_MAX_INFLIGHT: ops in flight per group
  uint32_t recv_buf_size = 64 * 1024;            // PONTE_RECV_SIZE: largest two-sided message
  uint32_t recv_buf_count = 512;                 // PONTE_RECV_COUNT: receive buffers per NIC
  std::vector<int> progress_cores;               // PONTE_PROGRESS_CORES: "2,3" pins workers
  std::string topo_file;                         // PONTE_TOPO_FILE: hwloc XML instead of live host
  bool flush_host = false;                       // PONTE_FLUSH_HOST: plugin flushes host memory too
  uint32_t net_inline = 4096;                    // PONTE_NET_INLINE: plugin messages <= this go inline
  bool net_eager = true;                         // PONTE_NET_EAGER: plugin sends small messages before their CTS
  bool net_eager_nic_copy = false;               // PONTE_NET_EAGER_NIC_COPY: tests: eager data to host via a NIC
  uint32_t net_cts_ahead = 4;                    // PONTE_NET_CTS_AHEAD: plugin holds a CTS while this many are out
  uint32_t fault_drop_recvs = 0;                 // PONTE_FAULT_DROP_RECVS: tests: lose N messages
  uint32_t fault_failed_connects = 0;            // PONTE_FAULT_FAILED_CONNECTS: tests: N rounds fail here
  uint32_t fault_busy_acks = 0;                  // PONTE_FAULT_BUSY_ACKS: tests: N plugin ACKs find no buffer
  int log_level = 1;                             // PONTE_LOG: 0 error, 1 warn, 2 info, 3 debug

  // Parses the environment. Bad values give kInvalidArgument naming the variable.
  static Result<Config> from_env();
};

// The process-wide configuration, parsed on first use. A bad value is reported once on stderr and
// its default kept.
const Config& global_config();

// Parses "64k", "1m", "4096", "2g" into bytes.
Result<size_t> parse_size(const std::string& text);

// OK when this process may run on every one of cores (its sched_getaffinity); else
// kInvalidArgument "<what>: this process may not run on core N". A worker pinned to such a core
// would run unpinned, with a log line only.
Status check_cores_usable(const std::vector<int>& cores, const char* what);

}  // namespace ponte
