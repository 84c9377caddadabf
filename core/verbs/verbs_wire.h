// Wire formats of the verbs backend: a NIC's address (port, LID, GID) and the connect blob of one RC
// queue pair (QPN, PSN, ...). Both carry a tag, a version and a length; decoders reject the rest.
#pragma once

#include <array>
#include <cstdint>
#include <span>

#include "core/status.h"

namespace ponte::verbs {

enum class LinkLayer : uint8_t { kInfiniBand = 1, kEthernet = 2 };

// What Nic::address() returns: enough for a peer to reach this port.
struct VerbsAddress {
  static constexpr uint8_t kTag = 0x56;  // 'V'
  static constexpr uint8_t kVersion = 1;
  static constexpr size_t kSize = 28;

  LinkLayer link_layer = LinkLayer::kEthernet;
  uint8_t port = 1;
  uint16_t lid = 0;
  uint8_t mtu = 0;        // enum ibv_mtu of the port's active MTU (1 = 256 B ... 5 = 4096 B)
  uint8_t gid_index = 0;  // informational: the index this side uses
  std::array<uint8_t, 16> gid{};

  std::array<uint8_t, kSize> encode() const;
  static Result<VerbsAddress> decode(std::span<const uint8_t> bytes);
  friend bool operator==(const VerbsAddress&, const VerbsAddress&) = default;
};

// What Nic::connect_blob() returns: one side of an RC connection. The engine carries it over its
// per-peer control socket.
struct ConnectBlob {
  static constexpr uint8_t kTag = 0x51;  // 'Q'
  static constexpr uint8_t kVersion = 1;
  static constexpr size_t kSize = 36;

  uint32_t qpn = 0;  // 24 bits
  uint32_t psn = 0;  // 24 bits: first packet sequence number this side sends
  uint16_t lid = 0;
  uint8_t mtu = 0;  // enum ibv_mtu
  LinkLayer link_layer = LinkLayer::kEthernet;
  std::array<uint8_t, 16> gid{};

  std::array<uint8_t, kSize> encode() const;
  static Result<ConnectBlob> decode(std::span<const uint8_t> bytes);
  friend bool operator==(const ConnectBlob&, const ConnectBlob&) = default;
};

}  // namespace ponte::verbs
