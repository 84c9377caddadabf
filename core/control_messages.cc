// Encoding and strict decoding of the control connection's messages (CHALLENGE, AUTH, HELLO,
// PING, PONG, BYE).
#include "core/control_messages.h"

#include <algorithm>

#include "core/wire.h"

namespace ponte {

static constexpr size_t kHeader = 4;
static constexpr size_t kMaxBlobs = 255;
static constexpr uint16_t kNoTrafficClass = 0xffff;  // HELLO: no class asked for

static void put_header(WireWriter& w, ControlType type) {
  w.u8(kControlVersion);
  w.u8(static_cast<uint8_t>(type));
  w.u16(0);  // total, patched when the message is complete
}

static std::vector<uint8_t> fixed_message(ControlType type, std::span<const uint8_t> body) {
  std::vector<uint8_t> out;
  out.reserve(kHeader + body.size());  // one allocation; also spares GCC 12 -O3 a false -Wstringop-overflow
  WireWriter w(out);
  put_header(w, type);
  w.bytes(body);
  w.patch_u16(2, static_cast<uint16_t>(out.size()));
  return out;
}

Result<ControlType> peek_control_type(std::span<const uint8_t> b) {
  if (b.size() < kHeader) return Status(Code::kInvalidArgument, "control message: %zu bytes is truncated", b.size());
  if (b[0] != kControlVersion)
    return Status(Code::kInvalidArgument, "control message: unsupported version %u (this ponte speaks %u)", b[0], kControlVersion);
  if (b[1] < static_cast<uint8_t>(ControlType::kHello) || b[1] > static_cast<uint8_t>(ControlType::kPong))
    return Status(Code::kInvalidArgument, "control message: unknown type %u", b[1]);
  const size_t total = static_cast<size_t>(b[2]) | (static_cast<size_t>(b[3]) << 8);
  if (total != b.size())
    return Status(Code::kInvalidArgument, "control message: length field %zu but %zu bytes", total, b.size());
  return static_cast<ControlType>(b[1]);
}

// The body of a message of the given type, after its header.
static Result<std::span<const uint8_t>> body_of(std::span<const uint8_t> b, ControlType want, const char* what) {
  auto type = peek_control_type(b);
  if (!type.ok()) return type.status();
  if (*type != want)
    return Status(Code::kInvalidArgument, "control message: type %u where %s was expected", b[1], what);
  return b.subspan(kHeader);
}

Result<std::vector<uint8_t>> encode_hello(const HelloMsg& m) {
  if (m.address.empty() || m.address.size() > UINT16_MAX || m.blobs.size() > kMaxBlobs)
    return Status(Code::kInvalidArgument, "hello: %zu address bytes, %zu blobs", m.address.size(), m.blobs.size());
  if (m.traffic_class < -1 || m.traffic_class > 255)
    return Status(Code::kInvalidArgument, "hello: traffic class %d (0..255, or -1)", m.traffic_class);
  std::vector<uint8_t> out;
  WireWriter w(out);
  put_header(w, ControlType::kHello);
  w.u32(m.id_for_receiver);
  w.u32(m.epoch);
  w.u16(m.traffic_class < 0 ? kNoTrafficClass : static_cast<uint16_t>(m.traffic_class));
  w.u16(static_cast<uint16_t>(m.address.size()));
  w.bytes(m.address);
  w.u8(static_cast<uint8_t>(m.blobs.size()));
  for (const auto& b : m.blobs) {
    if (b.size() > UINT16_MAX) return Status(Code::kInvalidArgument, "hello: connect blob of %zu bytes", b.size());
    w.u16(static_cast<uint16_t>(b.size()));
    w.bytes(b);
  }
  if (out.size() > UINT16_MAX) return Status(Code::kInvalidArgument, "hello: %zu bytes is too long", out.size());
  w.patch_u16(2, static_cast<uint16_t>(out.size()));
  return out;
}

Result<HelloMsg> decode_hello(std::span<const uint8_t> bytes) {
  auto body = body_of(bytes, ControlType::kHello, "a hello");
  if (!body.ok()) return body.status();
  WireReader r(*body);
  HelloMsg m;
  m.id_for_receiver = r.u32();
  m.epoch = r.u32();
  const uint16_t tc = r.u16();
  uint16_t alen = r.u16();
  auto addr = r.bytes(alen);
  uint8_t nblobs = r.u8();
  if (!r.ok()) return Status(Code::kInvalidArgument, "hello: %zu bytes is truncated", bytes.size());
  if (alen == 0) return Status(Code::kInvalidArgument, "hello: no group address");
  if (tc > 255 && tc != kNoTrafficClass) return Status(Code::kInvalidArgument, "hello: traffic class %u", tc);
  m.traffic_class = tc == kNoTrafficClass ? -1 : tc;
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

// A message with nothing after its header: BYE, PING, PONG.
static Status decode_bare(std::span<const uint8_t> bytes, ControlType type, const char* what) {
  auto body = body_of(bytes, type, what);
  if (!body.ok()) return body.status();
  if (!body->empty()) return Status(Code::kInvalidArgument, "%s: %zu trailing bytes", what, body->size());
  return Status::Ok();
}

std::vector<uint8_t> encode_bye() { return fixed_message(ControlType::kBye, {}); }
Status decode_bye(std::span<const uint8_t> bytes) { return decode_bare(bytes, ControlType::kBye, "a goodbye"); }

// PING and PONG go out on the hot side of liveness: their bytes are built once.
std::span<const uint8_t> ping_message() {
  static const uint8_t bytes[kHeader] = {kControlVersion, static_cast<uint8_t>(ControlType::kPing), kHeader, 0};
  return bytes;
}
std::span<const uint8_t> pong_message() {
  static const uint8_t bytes[kHeader] = {kControlVersion, static_cast<uint8_t>(ControlType::kPong), kHeader, 0};
  return bytes;
}
Status decode_ping(std::span<const uint8_t> bytes) { return decode_bare(bytes, ControlType::kPing, "a ping"); }
Status decode_pong(std::span<const uint8_t> bytes) { return decode_bare(bytes, ControlType::kPong, "a pong"); }

std::vector<uint8_t> encode_challenge(const Challenge& c) { return fixed_message(ControlType::kChallenge, c); }

Result<Challenge> decode_challenge(std::span<const uint8_t> bytes) {
  auto body = body_of(bytes, ControlType::kChallenge, "a challenge");
  if (!body.ok()) return body.status();
  Challenge c;
  if (body->size() != c.size()) return Status(Code::kInvalidArgument, "challenge: %zu bytes, expected %zu", body->size(), c.size());
  std::copy(body->begin(), body->end(), c.begin());
  return c;
}

std::vector<uint8_t> encode_auth(const Sha256Digest& proof) { return fixed_message(ControlType::kAuth, proof); }

Result<Sha256Digest> decode_auth(std::span<const uint8_t> bytes) {
  auto body = body_of(bytes, ControlType::kAuth, "an authentication proof");
  if (!body.ok()) return body.status();
  Sha256Digest d;
  if (body->size() != d.size()) return Status(Code::kInvalidArgument, "proof: %zu bytes, expected %zu", body->size(), d.size());
  std::copy(body->begin(), body->end(), d.begin());
  return d;
}

}  // namespace ponte
