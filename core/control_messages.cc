// Encoding and strict decoding of the control connection's messages (HELLO, BYE).
#include "core/control_messages.h"

#include "core/wire.h"

namespace ponte {

static constexpr size_t kMaxBlobs = 255;

Result<ControlType> peek_control_type(std::span<const uint8_t> b) {
  if (b.size() < 2) return Status(Code::kInvalidArgument, "control message: %zu bytes is truncated", b.size());
  if (b[0] != kControlVersion)
    return Status(Code::kInvalidArgument, "control message: unsupported version %u (this ponte speaks %u)", b[0], kControlVersion);
  if (b[1] != static_cast<uint8_t>(ControlType::kHello) && b[1] != static_cast<uint8_t>(ControlType::kBye))
    return Status(Code::kInvalidArgument, "control message: unknown type %u", b[1]);
  return static_cast<ControlType>(b[1]);
}

Result<std::vector<uint8_t>> encode_hello(const HelloMsg& m) {
  if (m.address.empty() || m.address.size() > UINT16_MAX || m.blobs.size() > kMaxBlobs)
    return Status(Code::kInvalidArgument, "hello: %zu address bytes, %zu blobs", m.address.size(), m.blobs.size());
  std::vector<uint8_t> out;
  WireWriter w(out);
  w.u8(kControlVersion);
  w.u8(static_cast<uint8_t>(ControlType::kHello));
  w.u16(0);
  w.u32(m.id_for_receiver);
  w.u32(m.epoch);
  w.u16(static_cast<uint16_t>(m.address.size()));
  w.bytes(m.address);
  w.u8(static_cast<uint8_t>(m.blobs.size()));
  for (const auto& b : m.blobs) {
    if (b.size() > UINT16_MAX) return Status(Code::kInvalidArgument, "hello: connect blob of %zu bytes", b.size());
    w.u16(static_cast<uint16_t>(b.size()));
    w.bytes(b);
  }
  return out;
}

Result<HelloMsg> decode_hello(std::span<const uint8_t> bytes) {
  auto type = peek_control_type(bytes);
  if (!type.ok()) return type.status();
  if (*type != ControlType::kHello) return Status(Code::kInvalidArgument, "control message: type %u where a hello was expected", bytes[1]);
  WireReader r(bytes);
  r.skip(2);
  uint16_t reserved = r.u16();
  HelloMsg m;
  m.id_for_receiver = r.u32();
  m.epoch = r.u32();
  uint16_t alen = r.u16();
  auto addr = r.bytes(alen);
  uint8_t nblobs = r.u8();
  if (!r.ok()) return Status(Code::kInvalidArgument, "hello: %zu bytes is truncated", bytes.size());
  if (reserved != 0) return Status(Code::kInvalidArgument, "hello: reserved field is %u", reserved);
  if (alen == 0) return Status(Code::kInvalidArgument, "hello: no group address");
  m.address.assign(addr.begin(), addr.end());
  m.blobs.reserve(nblobs);
  for (int k = 0; k < nblobs; k++) {
    uint16_t blen = r.u16();
    auto blob = r.bytes(blen);
    if (!r.ok()) return Status(Code::kInvalidArgument, "hello: connect blob %d truncated", k);
    m.blobs.emplace_back(blob.begin(), blob.end());
  }
  if (r.remaining() != 0) return Status(Code::kInvalidArgument, "hello: %zu trailing bytes", r.remaining());
  return m;
}

std::vector<uint8_t> encode_bye() { return {kControlVersion, static_cast<uint8_t>(ControlType::kBye)}; }

Status decode_bye(std::span<const uint8_t> bytes) {
  auto type = peek_control_type(bytes);
  if (!type.ok()) return type.status();
  if (*type != ControlType::kBye || bytes.size() != 2)
    return Status(Code::kInvalidArgument, "control message: not a goodbye (type %u, %zu bytes)", bytes[1], bytes.size());
  return Status::Ok();
}

}  // namespace ponte
