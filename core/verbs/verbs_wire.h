// Wire formats of the verbs backend: a NIC's address (port, LID, GID) and the connect blob of one RC
// connection (PSN, GID, the QPNs of its queue pairs). Both carry a tag, a version and a length;
// decoders reject the rest.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <vector>

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

// What Nic::connect_blob() returns: one side of an RC connection toward one peer NIC, made of 1 to
// kMaxQps queue pairs (PONTE_IB_QPS_PER_CONNECTION). QP i of one side pairs with QP i of the other;
// when the two sides' counts differ, both use the first min(count) of them. The engine carries the
// blob over its per-peer control socket. Version 2 (this layout): tag, version, u16 length, u32 PSN,
// u16 LID, MTU, link layer, QP count, flags (bit 0: traffic class set), traffic class, a zero byte,
// the GID, then one u32 QPN per QP.
struct ConnectBlob {
  static constexpr uint8_t kTag = 0x51;  // 'Q'
  static constexpr uint8_t kVersion = 2;
  static constexpr size_t kMaxQps = 16;
  static constexpr size_t kHeaderSize = 32;
  static constexpr size_t kMaxSize = kHeaderSize + 4 * kMaxQps;
  static constexpr uint8_t kFlagTrafficClass = 1;

  uint32_t psn = 0;  // 24 bits: first packet sequence number every QP of this side sends
  uint16_t lid = 0;
  uint8_t mtu = 0;  // enum ibv_mtu
  LinkLayer link_layer = LinkLayer::kEthernet;
  // The side that opened the connection with a traffic class of its own (Engine::connect's
  // ConnectOptions) asks the other side to send in it too, as NCCL's receiver takes its sender's.
  bool has_traffic_class = false;
  uint8_t traffic_class = 0;
  std::array<uint8_t, 16> gid{};
  uint8_t qp_count = 0;                  // 1..kMaxQps
  std::array<uint32_t, kMaxQps> qpn{};   // 24 bits each, nonzero; entries past qp_count are zero

  size_t size() const { return kHeaderSize + 4 * size_t{qp_count}; }
  std::vector<uint8_t> encode() const;
  static Result<ConnectBlob> decode(std::span<const uint8_t> bytes);
  friend bool operator==(const ConnectBlob&, const ConnectBlob&) = default;
};

}  // namespace ponte::verbs
