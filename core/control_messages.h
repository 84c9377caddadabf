// The messages of a peer's control connection (core/control_socket.h frames them): HELLO, one
// handshake round with the sender's group address and connect blobs, and BYE. Versioned, strict.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/status.h"

namespace ponte {

constexpr uint8_t kControlVersion = 1;
enum class ControlType : uint8_t { kHello = 1, kBye = 2 };

// HELLO: u8 version, u8 type 1, u16 0, u32 id the sender gave the receiver, u32 epoch (handshake
// round), u16 address length, the sender's group address, u8 blob count, count x (u16 length,
// connect blob). Nothing may follow.
// BYE: u8 version, u8 type 2: the sender's engine is shutting down (an orderly close).
struct HelloMsg {
  uint32_t id_for_receiver = 0;  // travels as the immediate of the receiver's sends to the sender
  uint32_t epoch = 0;
  std::vector<uint8_t> address;  // GroupAddress bytes (decoded by the receiver)
  std::vector<std::vector<uint8_t>> blobs;  // one per NIC: Nic::connect_blob()
  friend bool operator==(const HelloMsg&, const HelloMsg&) = default;
};

// The type of a control message, after checking its version.
Result<ControlType> peek_control_type(std::span<const uint8_t> bytes);
Result<std::vector<uint8_t>> encode_hello(const HelloMsg& m);
Result<HelloMsg> decode_hello(std::span<const uint8_t> bytes);
std::vector<uint8_t> encode_bye();
Status decode_bye(std::span<const uint8_t> bytes);

}  // namespace ponte
