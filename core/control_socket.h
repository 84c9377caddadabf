// ControlSocket: the small TCP connection per peer that carries the handshake (backend connect
// blobs) and is ponte's liveness signal: the kernel closes it when the peer's process dies.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "core/config.h"
#include "core/status.h"

namespace ponte {

struct ControlEndpoint {
  uint8_t family = 4;
  uint8_t ip[16] = {};
  uint16_t port = 0;
  std::string to_string() const;
};

// Opens a non-blocking listening socket on the address the config selects (PONTE_CTRL_ADDR, else
// PONTE_SOCKET_IFNAME's IPv4, else the first non-loopback IPv4 interface, else 127.0.0.1).
Result<int> control_listen(const Config& cfg, ControlEndpoint* advertised);

// One framed, non-blocking connection: messages are u32 length + payload.
class ControlSocket {
 public:
  ControlSocket() = default;
  ~ControlSocket();
  ControlSocket(const ControlSocket&) = delete;
  ControlSocket& operator=(const ControlSocket&) = delete;

  // Starts a non-blocking connect; poll_connected() tells when it is done.
  Status connect(const ControlEndpoint& to);
  void adopt(int fd);  // an accepted socket
  int fd() const { return fd_; }
  bool open() const { return fd_ >= 0; }
  // kOk + true when connected, kOk + false while in progress, error when refused/unreachable.
  Result<bool> poll_connected();

  // Queues a message and writes what the socket takes now.
  Status send_message(std::span<const uint8_t> payload);
  // Reads what is available. kOk with *msg filled when a whole message arrived (returns true),
  // false when none yet; kPeerDead when the peer closed or the socket failed.
  Result<bool> recv_message(std::vector<uint8_t>* msg);
  Status flush();
  void close();

 private:
  int fd_ = -1;
  bool connecting_ = false;
  std::vector<uint8_t> in_;
  std::vector<uint8_t> out_;
};

}  // namespace ponte
