// GroupAddress: the bytes a peer needs to reach one NIC group: which engine and group, the
// backend, the control socket (liveness + handshake) and every NIC's endpoint address. Versioned.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/control_auth.h"
#include "core/nic.h"
#include "core/status.h"

namespace ponte {

struct GroupAddress {
  uint64_t engine_nonce = 0;  // random per engine: tells engines apart, also across restarts
  uint8_t group = 0;
  BackendKind backend = BackendKind::kFabric;
  uint8_t ip_family = 4;      // 4 or 6
  uint8_t ip[16] = {};        // control socket address (IPv4 in the first 4 bytes)
  uint16_t port = 0;          // control socket port
  uint64_t max_msg = 0;       // smallest max_msg_size of the group's NICs (0: no limit known)
  AuthKind auth_kind = AuthKind::kSecret;  // how a connection proves it was invited (control_auth.h)
  uint64_t auth_secret = 0;   // kSecret: the group's invitation secret (nonzero); kJobKey: 0
  std::vector<std::vector<uint8_t>> nic_addrs;
  // Per NIC, a registered target for immediates alone (0-byte writes still need a valid key).
  std::vector<uint64_t> imm_rkey;
  std::vector<uint64_t> imm_base;

  // Wire: u8 version(2) u8 kind('A') u16 total, u64 nonce, u8 group, u8 backend, u8 nics,
  // u8 family, u16 port, 16 ip, u64 max_msg, u8 auth kind, u64 auth secret, then
  // nics x (u16 len, bytes, u64 imm_rkey, u64 imm_base). Version 2 added the auth fields.
  std::vector<uint8_t> encode() const;
  static Result<GroupAddress> decode(std::span<const uint8_t> bytes);
  friend bool operator==(const GroupAddress&, const GroupAddress&) = default;
};

}  // namespace ponte
