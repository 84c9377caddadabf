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

// Tag, version and length checks shared by both formats: the length field must equal the bytes
// given, and lie in [min_size, max_size].
Status check_header(std::span<const uint8_t> b, uint8_t tag, uint8_t version, size_t min_size,
                    size_t max_size, const char* what) {
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
  if (len < min_size || len > max_size) {
    return Status(Code::kInvalidArgument, "verbs %s: length field %zu, expected %zu..%zu", what,
                  len, min_size, max_size);
  }
  if (b.size() != len) {
    return Status(Code::kInvalidArgument, "verbs %s: %zu bytes given, length field says %zu", what,
                  b.size(), len);
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
  PONTE_RETURN_IF_ERROR(check_header(b, kTag, kVersion, kSize, kSize, "NIC address"));
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

std::vector<uint8_t> ConnectBlob::encode() const {
  std::vector<uint8_t> b(size(), 0);
  b[0] = kTag;
  b[1] = kVersion;
  put16(&b[2], static_cast<uint16_t>(b.size()));
  put32(&b[4], psn);
  put16(&b[8], lid);
  b[10] = mtu;
  b[11] = static_cast<uint8_t>(link_layer);
  b[12] = qp_count;
  b[13] = has_traffic_class ? kFlagTrafficClass : 0;
  b[14] = has_traffic_class ? traffic_class : 0;
  memcpy(&b[16], gid.data(), 16);
  for (size_t i = 0; i < qp_count && i < kMaxQps; ++i) put32(&b[kHeaderSize + 4 * i], qpn[i]);
  return b;
}

Result<ConnectBlob> ConnectBlob::decode(std::span<const uint8_t> b) {
  PONTE_RETURN_IF_ERROR(check_header(b, kTag, kVersion, kHeaderSize + 4, kMaxSize, "connect blob"));
  PONTE_RETURN_IF_ERROR(check_zero(b, 15, 16, "connect blob"));
  ConnectBlob c;
  c.qp_count = b[12];
  if (c.qp_count == 0 || c.qp_count > kMaxQps || c.size() != b.size()) {
    return Status(Code::kInvalidArgument, "verbs connect blob: %u QPs in %zu bytes", b[12], b.size());
  }
  c.psn = get32(&b[4]);
  if (c.psn > 0xffffff) return Status(Code::kInvalidArgument, "verbs connect blob: bad PSN 0x%x", c.psn);
  if (!valid_mtu(b[10])) return Status(Code::kInvalidArgument, "verbs connect blob: bad MTU %u", b[10]);
  if (!valid_link_layer(b[11])) {
    return Status(Code::kInvalidArgument, "verbs connect blob: bad link layer %u", b[11]);
  }
  if ((b[13] & ~kFlagTrafficClass) != 0) {
    return Status(Code::kInvalidArgument, "verbs connect blob: unknown flags 0x%02x", b[13]);
  }
  c.has_traffic_class = (b[13] & kFlagTrafficClass) != 0;
  if (!c.has_traffic_class && b[14] != 0) {
    return Status(Code::kInvalidArgument, "verbs connect blob: a traffic class without its flag");
  }
  c.traffic_class = b[14];
  for (size_t i = 0; i < c.qp_count; ++i) {
    c.qpn[i] = get32(&b[kHeaderSize + 4 * i]);
    if (c.qpn[i] == 0 || c.qpn[i] > 0xffffff) {
      return Status(Code::kInvalidArgument, "verbs connect blob: bad QPN 0x%x (QP %zu)", c.qpn[i], i);
    }
  }
  c.lid = get16(&b[8]);
  c.mtu = b[10];
  c.link_layer = static_cast<LinkLayer>(b[11]);
  memcpy(c.gid.data(), &b[16], 16);
  return c;
}

}  // namespace ponte::verbs
