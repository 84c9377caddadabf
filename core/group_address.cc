// GroupAddress encoding and its strict decoder.
#include "core/group_address.h"

#include <algorithm>

#include "core/remote_region.h"
#include "core/wire.h"

namespace ponte {

static constexpr uint8_t kAddressVersion = 2;
static constexpr uint8_t kAddressKind = 'A';

std::vector<uint8_t> GroupAddress::encode() const {
  std::vector<uint8_t> out;
  WireWriter w(out);
  w.u8(kAddressVersion);
  w.u8(kAddressKind);
  w.u16(0);  // total, patched below
  w.u64(engine_nonce);
  w.u8(group);
  w.u8(static_cast<uint8_t>(backend));
  w.u8(static_cast<uint8_t>(nic_addrs.size()));
  w.u8(ip_family);
  w.u16(port);
  w.bytes(std::span<const uint8_t>(ip, 16));
  w.u64(max_msg);
  w.u8(static_cast<uint8_t>(auth_kind));
  w.u64(auth_secret);
  for (size_t i = 0; i < nic_addrs.size(); i++) {
    w.u16(static_cast<uint16_t>(nic_addrs[i].size()));
    w.bytes(nic_addrs[i]);
    w.u64(i < imm_rkey.size() ? imm_rkey[i] : 0);
    w.u64(i < imm_base.size() ? imm_base[i] : 0);
  }
  w.patch_u16(2, static_cast<uint16_t>(w.size()));
  return out;
}

Result<GroupAddress> GroupAddress::decode(std::span<const uint8_t> bytes) {
  WireReader r(bytes);
  uint8_t version = r.u8();
  uint8_t kind = r.u8();
  uint16_t total = r.u16();
  if (!r.ok()) return Status(Code::kInvalidArgument, "group address: %zu bytes is truncated", bytes.size());
  if (kind != kAddressKind) return Status(Code::kInvalidArgument, "group address: not a ponte address (kind 0x%02x)", kind);
  if (version != kAddressVersion)
    return Status(Code::kInvalidArgument, "group address: unsupported version %u (this ponte speaks %u)", version, kAddressVersion);
  if (total != bytes.size())
    return Status(Code::kInvalidArgument, "group address: length field %u but %zu bytes given", total, bytes.size());
  GroupAddress a;
  a.engine_nonce = r.u64();
  a.group = r.u8();
  uint8_t backend = r.u8();
  uint8_t nics = r.u8();
  a.ip_family = r.u8();
  a.port = r.u16();
  auto ip = r.bytes(16);
  a.max_msg = r.u64();
  uint8_t auth = r.u8();
  a.auth_secret = r.u64();
  if (!r.ok()) return Status(Code::kInvalidArgument, "group address: truncated header");
  const bool auth_ok = (auth == static_cast<uint8_t>(AuthKind::kSecret) && a.auth_secret != 0) ||
                       (auth == static_cast<uint8_t>(AuthKind::kJobKey) && a.auth_secret == 0);
  if (!auth_ok)
    return Status(Code::kInvalidArgument, "group address: bad authentication kind %u", auth);
  a.auth_kind = static_cast<AuthKind>(auth);
  if (backend != static_cast<uint8_t>(BackendKind::kFabric) && backend != static_cast<uint8_t>(BackendKind::kVerbs))
    return Status(Code::kInvalidArgument, "group address: unknown backend %u", backend);
  a.backend = static_cast<BackendKind>(backend);
  if (a.ip_family != 4 && a.ip_family != 6) return Status(Code::kInvalidArgument, "group address: bad IP family %u", a.ip_family);
  if (a.port == 0) return Status(Code::kInvalidArgument, "group address: port 0");
  if (nics == 0 || nics > kMaxNicsPerGroup) return Status(Code::kInvalidArgument, "group address: bad NIC count %u", nics);
  std::copy(ip.begin(), ip.end(), a.ip);
  for (int i = 0; i < nics; i++) {
    uint16_t len = r.u16();
    auto b = r.bytes(len);
    if (!r.ok() || len == 0) return Status(Code::kInvalidArgument, "group address: NIC %d address truncated or empty", i);
    a.nic_addrs.emplace_back(b.begin(), b.end());
    a.imm_rkey.push_back(r.u64());
    a.imm_base.push_back(r.u64());
    if (!r.ok()) return Status(Code::kInvalidArgument, "group address: NIC %d entry truncated", i);
  }
  if (r.remaining() != 0) return Status(Code::kInvalidArgument, "group address: %zu trailing bytes", r.remaining());
  return a;
}

}  // namespace ponte
