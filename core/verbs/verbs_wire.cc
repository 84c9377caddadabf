// Encoding and checked decoding of the verbs address and connect blob (little-endian fields).
#include "core/verbs/verbs_wire.h"

#include <cstring>

namespace ponte::verbs {

namespace {

void put16(uint8_t* p, uint16_t v) {
  p[0] = static_cast<uint8_t>(v);
  p[1] = static_cast<uint8_t>(v >> 8);
}
void put32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
uint16_t get16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }
uint32_t get32(const uint8_t* p) {
  return static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) |
         (static_cast<uint32_t>(p[2]) << 16) | (static_cast<uint32_t>(p[3]) << 24);
}

// Tag, version and length checks shared by both formats.
Status check_header(std::span<const uint8_t> b, uint8_t tag, uint8_t version, size_t size,
                    const char* what) {
  if (b.size() < 4) {
    return Status(Code::kInvalidArgument, "verbs %s: %zu bytes, truncated", what, b.size());
  }
  if (b[0] != tag) {
    return Status(Code::kInvalidArgument, "not a verbs %s (tag 0x%02x, expected 0x%02x)", what,
                  b[0], tag);
  }
  if (b[1] != version) {
    return Status(Code::kInvalidArgument, "verbs %s version %u not supported (this build: %u)",
                  what, b[1], version);
  }
  size_t len = get16(b.data() + 2);
  if (len != size) {
    return Status(Code::kInvalidArgument, "verbs %s: length field %zu, expected %zu", what, len,
                  size);
  }
  if (b.size() != size) {
    return Status(Code::kInvalidArgument, "verbs %s: %zu bytes given, expected %zu", what,
                  b.size(), size);
  }
  return Status::Ok();
}

// Padding must be zero: a field this version does not know is not silently dropped.
Status check_zero(std::span<const uint8_t> b, size_t from, size_t to, const char* what) {
  for (size_t i = from; i < to; ++i) {
    if (b[i] != 0) return Status(Code::kInvalidArgument, "verbs %s: nonzero padding at byte %zu", what, i);
  }
  return Status::Ok();
}

bool valid_link_layer(uint8_t v) {
  return v == static_cast<uint8_t>(LinkLayer::kInfiniBand) ||
         v == static_cast<uint8_t>(LinkLayer::kEthernet);
}
bool valid_mtu(uint8_t v) { return v >= 1 && v <= 5; }

}  // namespace

std::array<uint8_t, VerbsAddress::kSize> VerbsAddress::encode() const {
  std::array<uint8_t, kSize> b{};
  b[0] = kTag;
  b[1] = kVersion;
  put16(&b[2], kSize);
  b[4] = static_cast<uint8_t>(link_layer);
  b[5] = port;
  put16(&b[6], lid);
  b[8] = mtu;
  b[9] = gid_index;
  memcpy(&b[12], gid.data(), 16);
  return b;
}

Result<VerbsAddress> VerbsAddress::decode(std::span<const uint8_t> b) {
  PONTE_RETURN_IF_ERROR(check_header(b, kTag, kVersion, kSize, "NIC address"));
  PONTE_RETURN_IF_ERROR(check_zero(b, 10, 12, "NIC address"));
  VerbsAddress a;
  if (!valid_link_layer(b[4])) {
    return Status(Code::kInvalidArgument, "verbs NIC address: bad link layer %u", b[4]);
  }
  if (b[5] == 0) return Status(Code::kInvalidArgument, "verbs NIC address: port 0");
  if (!valid_mtu(b[8])) return Status(Code::kInvalidArgument, "verbs NIC address: bad MTU %u", b[8]);
  a.link_layer = static_cast<LinkLayer>(b[4]);
  a.port = b[5];
  a.lid = get16(&b[6]);
  a.mtu = b[8];
  a.gid_index = b[9];
  memcpy(a.gid.data(), &b[12], 16);
  return a;
}

std::array<uint8_t, ConnectBlob::kSize> ConnectBlob::encode() const {
  std::array<uint8_t, kSize> b{};
  b[0] = kTag;
  b[1] = kVersion;
  put16(&b[2], kSize);
  put32(&b[4], qpn);
  put32(&b[8], psn);
  put16(&b[12], lid);
  b[14] = mtu;
  b[15] = static_cast<uint8_t>(link_layer);
  memcpy(&b[16], gid.data(), 16);
  return b;
}

Result<ConnectBlob> ConnectBlob::decode(std::span<const uint8_t> b) {
  PONTE_RETURN_IF_ERROR(check_header(b, kTag, kVersion, kSize, "connect blob"));
  PONTE_RETURN_IF_ERROR(check_zero(b, 32, kSize, "connect blob"));
  ConnectBlob c;
  c.qpn = get32(&b[4]);
  c.psn = get32(&b[8]);
  if (c.qpn == 0 || c.qpn > 0xffffff) {
    return Status(Code::kInvalidArgument, "verbs connect blob: bad QPN 0x%x", c.qpn);
  }
  if (c.psn > 0xffffff) return Status(Code::kInvalidArgument, "verbs connect blob: bad PSN 0x%x", c.psn);
  if (!valid_mtu(b[14])) return Status(Code::kInvalidArgument, "verbs connect blob: bad MTU %u", b[14]);
  if (!valid_link_layer(b[15])) {
    return Status(Code::kInvalidArgument, "verbs connect blob: bad link layer %u", b[15]);
  }
  c.lid = get16(&b[12]);
  c.mtu = b[14];
  c.link_layer = static_cast<LinkLayer>(b[15]);
  memcpy(c.gid.data(), &b[16], 16);
  return c;
}

}  // namespace ponte::verbs
