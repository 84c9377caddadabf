// RemoteRegion's wire encoding: version 1, kind 'R', total length, then the keys per NIC.
#include "core/remote_region.h"

#include "core/wire.h"

namespace ponte {

static constexpr uint8_t kRegionVersion = 1;
static constexpr uint8_t kRegionKind = 'R';

std::vector<uint8_t> RemoteRegion::encode() const {
  std::vector<uint8_t> out;
  out.reserve(encoded_size(nics));
  WireWriter w(out);
  w.u8(kRegionVersion);
  w.u8(kRegionKind);
  w.u16(static_cast<uint16_t>(encoded_size(nics)));
  w.u64(addr);
  w.u64(len);
  w.u8(nics);
  w.zeros(11);
  for (int i = 0; i < nics; i++) {
    w.u64(rkey[i]);
    w.u64(remote_base[i]);
  }
  return out;
}

Result<RemoteRegion> RemoteRegion::decode(std::span<const uint8_t> bytes) {
  WireReader r(bytes);
  uint8_t version = r.u8();
  uint8_t kind = r.u8();
  uint16_t total = r.u16();
  if (!r.ok()) return Status(Code::kInvalidArgument, "remote region: %zu bytes is truncated", bytes.size());
  if (kind != kRegionKind) return Status(Code::kInvalidArgument, "remote region: not a region descriptor (kind 0x%02x)", kind);
  if (version != kRegionVersion)
    return Status(Code::kInvalidArgument, "remote region: unsupported version %u (this ponte speaks %u)", version, kRegionVersion);
  if (total != bytes.size())
    return Status(Code::kInvalidArgument, "remote region: length field %u but %zu bytes given", total, bytes.size());
  RemoteRegion rr;
  rr.addr = r.u64();
  rr.len = r.u64();
  rr.nics = r.u8();
  auto pad = r.bytes(11);
  if (!r.ok() || rr.nics == 0 || rr.nics > kMaxNicsPerGroup)
    return Status(Code::kInvalidArgument, "remote region: bad NIC count %u", rr.nics);
  for (uint8_t b : pad)
    if (b != 0) return Status(Code::kInvalidArgument, "remote region: nonzero padding (a newer format?)");
  if (total != encoded_size(rr.nics))
    return Status(Code::kInvalidArgument, "remote region: %u NICs need %zu bytes, got %u", rr.nics, encoded_size(rr.nics), total);
  for (int i = 0; i < rr.nics; i++) {
    rr.rkey[i] = r.u64();
    rr.remote_base[i] = r.u64();
  }
  if (!r.ok()) return Status(Code::kInvalidArgument, "remote region: truncated key list");
  return rr;
}

}  // namespace ponte
