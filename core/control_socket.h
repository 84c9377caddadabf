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
// PONTE_SOCKET_IFNAME's IPv4, else the first running non-loopback IPv4 interface that is not a
// local bridge (docker*, virbr*, veth*), else the first up non-loopback one, else 127.0.0.1).
Result<int> control_listen(const Config& cfg, ControlEndpoint* advertised);

// Framing of the control connection: u32 length (little endian) + payload, at most
// kMaxControlMessage payload bytes.
constexpr uint32_t kMaxControlMessage = 1 << 20;
// Looks for one whole frame at the start of in: returns the bytes it spans (0 when more must
// arrive first) and sets *payload; an error when the length field exceeds max_payload.
Result<size_t> take_frame(std::span<const uint8_t> in, uint32_t max_payload, std::span<const uint8_t>* payload);
// Appends the frame of payload to out.
void append_frame(std::span<const uint8_t> payload, std::vector<uint8_t>* out);

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
  // Takes what `from` has read but not delivered yet (bytes after the message that made the
  // connection change hands), ahead of anything this socket reads.
  void take_input(ControlSocket& from);
  bool has_input() const { return !in_.empty(); }
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
  // The largest message recv_message accepts (kMaxControlMessage unless lowered: an acceptor
  // reads no more than a proof from a connection that has not authenticated yet).
  void set_max_message(uint32_t bytes) { max_message_ = bytes; }

 private:
  void reserve_steady();

  int fd_ = -1;
  bool connecting_ = false;
  uint32_t max_message_ = kMaxControlMessage;
  std::vector<uint8_t> in_;
  std::vector<uint8_t> out_;
};

}  // namespace ponte
