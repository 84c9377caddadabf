// NicGroup's private constants, shared by its parts (lifecycle, handshake, scheduling, liveness,
// worker loop). Internal to core/nic_group*.cc.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>

namespace ponte {

using Clock = std::chrono::steady_clock;

inline constexpr uint32_t kMaxPeers = 4096;
inline constexpr uint8_t kHelloVersion = 1;
inline constexpr uint8_t kHelloType = 1;
inline constexpr uint8_t kByeType = 2;  // u8 version, u8 type: the peer's engine is shutting down
// HELLO: u8 version, u8 type, u16 0, u32 id we gave the peer, u32 epoch | u16 address length,
// address, u8 NIC count, NIC count x (u16 length, connect blob).
inline constexpr size_t kHelloHeaderBytes = 12;
inline constexpr uint64_t kWakeTag = ~uint64_t{0};
inline constexpr uint64_t kListenTag = ~uint64_t{0} - 1;
inline constexpr uint64_t kPendingTag = ~uint64_t{0} - 2;
inline constexpr size_t kImmTableSize = 1 << 16;
inline constexpr uint32_t kLingerMs = 250;  // orderly shutdown's bound (and PONTE_TIMEOUT_MS's)

}  // namespace ponte
