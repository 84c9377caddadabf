// The messages of a peer's control connection (core/control_socket.h frames them): the acceptor's
// CHALLENGE and the connector's AUTH (core/control_auth.h), then HELLO, one handshake round with
// the sender's group address and connect blobs, PING and PONG (liveness), and BYE. Versioned,
// with a length, decoded strictly.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/control_auth.h"
#include "core/status.h"

namespace ponte {

// Version 2 added CHALLENGE/AUTH and HELLO's length, version 3 PING/PONG, version 4 HELLO's
// traffic class; a peer of another version is refused by both sides (its challenge or proof does
// not decode).
constexpr uint8_t kControlVersion = 4;
enum class ControlType : uint8_t { kHello = 1, kBye = 2, kChallenge = 3, kAuth = 4, kPing = 5, kPong = 6 };

// Every message starts u8 version, u8 type, u16 total length (little endian).
// CHALLENGE (acceptor -> connector, first on every accepted connection): 16 random bytes.
// AUTH (connector -> acceptor, its first message): the 32-byte proof (auth_proof).
// HELLO: u32 id the sender gave the receiver, u32 epoch (handshake round), u16 traffic class
//   (0..255, or 0xffff: none asked for), u16 address length, the sender's group address, u8 blob
//   count, count x (u16 length, connect blob). The class is the connecting side's
//   ConnectOptions::traffic_class (the accepting side answers with the one it took): a remote group
//   is one peer per class at both ends, so the acceptor folds a connection into a peer only when
//   their classes match.
// PING, PONG: nothing more. A worker that has heard nothing from a ready peer for a quarter of its
//   PONTE_TIMEOUT_MS sends PING (again every quarter while that lasts) on a connection that carried
//   its hello; the peer's worker answers PONG at once; a peer heard nothing from for
//   PONTE_TIMEOUT_MS is dead. Only a running process answers: the kernel keeps a stopped
//   process's TCP connections (and TCP keepalives) answered, so they cannot tell. The asking side
//   sets the pace, so two ends with different timeouts each get what theirs needs.
// BYE: nothing more: the sender's engine is shutting down (an orderly close).
struct HelloMsg {
  uint32_t id_for_receiver = 0;  // travels as the immediate of the receiver's sends to the sender
  uint32_t epoch = 0;
  int traffic_class = -1;        // -1: none asked for (PONTE_IB_TC)
  std::vector<uint8_t> address;  // GroupAddress bytes (decoded by the receiver)
  std::vector<std::vector<uint8_t>> blobs;  // one per NIC: Nic::connect_blob()
  friend bool operator==(const HelloMsg&, const HelloMsg&) = default;
};

// The type of a control message, after checking its version and length field.
Result<ControlType> peek_control_type(std::span<const uint8_t> bytes);
Result<std::vector<uint8_t>> encode_hello(const HelloMsg& m);
Result<HelloMsg> decode_hello(std::span<const uint8_t> bytes);
std::vector<uint8_t> encode_bye();
Status decode_bye(std::span<const uint8_t> bytes);
// A PING's or PONG's bytes, built once: sending one allocates nothing.
std::span<const uint8_t> ping_message();
std::span<const uint8_t> pong_message();
Status decode_ping(std::span<const uint8_t> bytes);
Status decode_pong(std::span<const uint8_t> bytes);
std::vector<uint8_t> encode_challenge(const Challenge& c);
Result<Challenge> decode_challenge(std::span<const uint8_t> bytes);
std::vector<uint8_t> encode_auth(const Sha256Digest& proof);
Result<Sha256Digest> decode_auth(std::span<const uint8_t> bytes);
// The largest AUTH frame payload: what an unauthenticated connection may make the acceptor read.
constexpr uint32_t kMaxAuthMessage = 64;

}  // namespace ponte
