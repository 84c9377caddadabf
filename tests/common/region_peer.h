// RegionPeer: a peer process (PeerProcess) that first sends its engine's group address and one
// registered region, then answers one-line commands. Shared by tests/engine, tests/faults, tests/liveness.
#pragma once

#include <string>
#include <vector>

#include "core/remote_region.h"
#include "tests/common/peer_process.h"

namespace ponte::test {

class RegionPeer {
 public:
  explicit RegionPeer(const std::vector<std::string>& args, const std::vector<std::string>& env = {})
      : proc_(args, env) {}
  // Reads the peer's address, then its region (30 s each); false with *err saying why (what the
  // peer sent instead of a region is usually its error).
  bool start(std::string* err) {
    std::vector<uint8_t> a, r;
    if (!proc_.channel().recv(&a, 30000)) return (*err = "the peer sent no address", false);
    if (!proc_.channel().recv(&r, 30000)) return (*err = "the peer sent no region", false);
    auto rr = RemoteRegion::decode(r);
    if (!rr.ok()) return (*err = std::string(a.begin(), a.end()), false);
    addr_ = a;
    region_ = *rr;
    return true;
  }
  bool send(const std::string& c) { return proc_.channel().send_str(c); }
  std::string reply(int timeout_ms = 60000) {
    std::string r;
    return proc_.channel().recv_str(&r, timeout_ms) ? r : "no reply";
  }
  // One command and its reply.
  std::string cmd(const std::string& c, int timeout_ms = 60000) {
    if (!send(c)) return "peer gone";
    std::string r;
    if (!proc_.channel().recv_str(&r, timeout_ms)) return "no reply to '" + c + "'";
    return r;
  }
  const std::vector<uint8_t>& address() const { return addr_; }
  const RemoteRegion& region() const { return region_; }
  PeerProcess& process() { return proc_; }

 protected:
  PeerProcess proc_;
  std::vector<uint8_t> addr_;
  RemoteRegion region_;
};

}  // namespace ponte::test
