// RemoteRegion: what a peer needs to reach registered memory (base address and one key per NIC of
// the owning group), and its versioned wire encoding, exchanged out of band.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "core/status.h"

namespace ponte {

constexpr int kMaxNicsPerGroup = 16;

struct RemoteRegion {
  uint64_t addr = 0;  // the owner's virtual address of byte 0 (for range checks and logs)
  uint64_t len = 0;
  uint8_t nics = 0;
  uint64_t rkey[kMaxNicsPerGroup] = {};
  uint64_t remote_base[kMaxNicsPerGroup] = {};  // what NIC i's peer passes as address of byte 0

  // Wire format: u8 version(1) u8 kind('R') u16 total length, u64 addr, u64 len, u8 nics,
  // 11 pad (32-byte header), then nics x (u64 rkey, u64 remote_base). Little endian.
  std::vector<uint8_t> encode() const;
  static Result<RemoteRegion> decode(std::span<const uint8_t> bytes);
  static constexpr size_t encoded_size(int nics) { return 32 + 16 * static_cast<size_t>(nics); }
  friend bool operator==(const RemoteRegion&, const RemoteRegion&) = default;
};

}  // namespace ponte
