// Address vector and peer table of one NIC.
#include "core/fabric/fabric_av.h"

#include <netinet/in.h>
#include <sys/socket.h>

#include <cstring>

#include "core/fabric/fabric_domain.h"
#include "core/log.h"

namespace ponte::fabric {
namespace {

constexpr size_t kMaxAddressBytes = 1024;

uint16_t socket_family(std::span<const uint8_t> bytes) {
  sa_family_t family = 0;
  if (bytes.size() >= sizeof(family)) memcpy(&family, bytes.data(), sizeof(family));
  return family;
}

}  // namespace

FabricAv::~FabricAv() {
  if (lib_ != nullptr) close_fid(*lib_, av_ ? &av_->fid : nullptr, "address vector");
}

Status FabricAv::open(const FabricLibrary& lib, struct fid_domain* domain, uint32_t addr_format) {
  lib_ = &lib;
  addr_format_ = addr_format;
  struct fi_av_attr attr = {};
  attr.type = FI_AV_TABLE;
  attr.count = 64;  // a sizing hint; the table grows
  int rc = fi_av_open(domain, &attr, &av_, nullptr);
  if (rc != 0) {
    av_ = nullptr;
    return Status(Code::kTransport, "fi_av_open(FI_AV_TABLE): %s", lib.error_text(rc));
  }
  return Status::Ok();
}

Status FabricAv::check_address(std::span<const uint8_t> peer, std::span<const uint8_t> own) const {
  if (peer.empty()) return Status(Code::kInvalidArgument, "empty peer address");
  if (peer.size() > kMaxAddressBytes) {
    return Status(Code::kInvalidArgument, "peer address of %zu bytes is too long", peer.size());
  }
  switch (addr_format_) {
    case FI_SOCKADDR_IN:
    case FI_SOCKADDR_IN6:
    case FI_SOCKADDR: {
      uint16_t family = socket_family(peer);
      size_t want = family == AF_INET    ? sizeof(sockaddr_in)
                    : family == AF_INET6 ? sizeof(sockaddr_in6)
                                         : 0;
      if (want == 0 || peer.size() != want || family != socket_family(own)) {
        return Status(Code::kInvalidArgument,
                      "peer address (%zu bytes, family %u) is not a socket address of this NIC's "
                      "family %u",
                      peer.size(), family, socket_family(own));
      }
      return Status::Ok();
    }
    case FI_ADDR_STR: {
      // "scheme://...": a NUL-terminated string whose scheme is this NIC's.
      if (peer.back() != 0 || memchr(peer.data(), 0, peer.size()) != &peer.back()) {
        return Status(Code::kInvalidArgument, "peer address is not one NUL-terminated string");
      }
      const char* own_text = reinterpret_cast<const char*>(own.data());
      const char* sep = static_cast<const char*>(memmem(own.data(), own.size(), "://", 3));
      size_t scheme = sep ? static_cast<size_t>(sep - own_text) + 3 : 0;
      if (scheme > 0 && (peer.size() <= scheme || memcmp(peer.data(), own.data(), scheme) != 0)) {
        return Status(Code::kInvalidArgument, "peer address is not a '%.*s' address",
                      static_cast<int>(scheme), own_text);
      }
      return Status::Ok();
    }
    default:
      if (peer.size() != own.size()) {
        return Status(Code::kInvalidArgument, "peer address has %zu bytes, this NIC's have %zu",
                      peer.size(), own.size());
      }
      return Status::Ok();
  }
}

Result<NicPeer> FabricAv::insert(std::span<const uint8_t> peer_address,
                                 std::span<const uint8_t> own_address) {
  PONTE_RETURN_IF_ERROR(check_address(peer_address, own_address));
  // Providers read the address through a (possibly unaligned-intolerant) struct: copy it aligned.
  alignas(16) uint8_t copy[kMaxAddressBytes];
  memcpy(copy, peer_address.data(), peer_address.size());
  fi_addr_t addr = FI_ADDR_NOTAVAIL;
  int rc = fi_av_insert(av_, copy, 1, &addr, 0, nullptr);
  if (rc != 1 || addr == FI_ADDR_NOTAVAIL) {
    return Status(Code::kInvalidArgument, "fi_av_insert refused the peer address: %s",
                  rc < 0 ? lib_->error_text(rc) : "not inserted");
  }
  peers_.push_back(addr);
  return static_cast<NicPeer>(peers_.size() - 1);
}

void FabricAv::remove(NicPeer peer) {
  if (peer >= peers_.size() || peers_[peer] == FI_ADDR_NOTAVAIL) return;
  // The peer index stops resolving, but the AV entry stays: libfabric 1.17's shm reuses a removed
  // entry's slot for the next insert while still holding the dead peer's transfer state under it,
  // and every later transfer to the new peer then hangs (seen in tests/engine's peer-killed test).
  // A dead peer costs one AV slot; rxd's shared entries (an address inserted twice) stay valid too.
  peers_[peer] = FI_ADDR_NOTAVAIL;
}

}  // namespace ponte::fabric
