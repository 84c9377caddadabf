// ControlSocket over TCP with keepalive and a user timeout, so a dead host is noticed as well as
// a dead process.
#include "core/control_socket.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "core/log.h"
#include "core/wire.h"

namespace ponte {

std::string ControlEndpoint::to_string() const {
  char buf[64];
  inet_ntop(AF_INET, ip, buf, sizeof(buf));
  return std::string(buf) + ":" + std::to_string(port);
}

// Interfaces that carry a host's own containers' or VMs' traffic, not the cluster's: docker0 (up
// whenever Docker runs, with no carrier until a container starts), libvirt's virbr*, and the
// host ends of container veth pairs. NCCL's automatic choice skips docker* too.
static bool local_bridge(const char* name) {
  for (const char* prefix : {"docker", "virbr", "veth"})
    if (strncmp(name, prefix, strlen(prefix)) == 0) return true;
  return false;
}

// PONTE_CTRL_ADDR; else PONTE_SOCKET_IFNAME's IPv4 address; else the first interface that is up
// and running (a carrier: an unplugged port or an empty bridge is up but not running), not
// loopback and not a local bridge; else the first up non-loopback one; else 127.0.0.1.
static Status pick_ipv4(const Config& cfg, in_addr* out) {
  if (!cfg.ctrl_addr.empty()) {
    if (inet_pton(AF_INET, cfg.ctrl_addr.c_str(), out) != 1)
      return Status(Code::kInvalidArgument, "PONTE_CTRL_ADDR='%s' is not an IPv4 address", cfg.ctrl_addr.c_str());
    return Status::Ok();
  }
  ifaddrs* ifs = nullptr;
  if (getifaddrs(&ifs) != 0) return Status(Code::kUnavailable, "getifaddrs: %s", strerror(errno));
  int best = 0;  // 2: up, running, not a local bridge; 1: up, not loopback
  const char* chosen = nullptr;
  for (ifaddrs* i = ifs; i && best < 2; i = i->ifa_next) {
    if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET || !(i->ifa_flags & IFF_UP)) continue;
    int rank;
    if (!cfg.socket_ifname.empty()) {
      if (cfg.socket_ifname != i->ifa_name) continue;
      rank = 2;
    } else {
      if (i->ifa_flags & IFF_LOOPBACK) continue;
      rank = (i->ifa_flags & IFF_RUNNING) && !local_bridge(i->ifa_name) ? 2 : 1;
    }
    if (rank <= best) continue;
    best = rank;
    chosen = i->ifa_name;
    *out = reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr;
    if (rank == 1) PONTE_LOG_DEBUG("control address: %s is %s; looking further", chosen,
                                   local_bridge(chosen) ? "a local bridge" : "not running");
  }
  if (best == 1)
    PONTE_LOG_WARN("control address: no running interface besides local bridges; advertising %s's "
                   "(set PONTE_SOCKET_IFNAME or PONTE_CTRL_ADDR if peers cannot reach it)", chosen);
  freeifaddrs(ifs);
  if (best == 0) {
    if (!cfg.socket_ifname.empty())
      return Status(Code::kNotFound, "PONTE_SOCKET_IFNAME=%s has no IPv4 address", cfg.socket_ifname.c_str());
    out->s_addr = htonl(INADDR_LOOPBACK);
  }
  return Status::Ok();
}

static void set_socket_options(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
  int idle = 5, intvl = 2, cnt = 5;
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof(idle));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &intvl, sizeof(intvl));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &cnt, sizeof(cnt));
  unsigned user_timeout_ms = 20000;
  setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &user_timeout_ms, sizeof(user_timeout_ms));
}

Result<int> control_listen(const Config& cfg, ControlEndpoint* advertised) {
  in_addr ip{};
  PONTE_RETURN_IF_ERROR(pick_ipv4(cfg, &ip));
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return Status(Code::kResource, "socket: %s", strerror(errno));
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr = cfg.ctrl_addr.empty() && cfg.socket_ifname.empty() ? in_addr{htonl(INADDR_ANY)} : ip;
  sa.sin_port = 0;
  if (bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0 || listen(fd, 256) != 0) {
    Status st(Code::kResource, "control socket bind/listen: %s", strerror(errno));
    ::close(fd);
    return st;
  }
  socklen_t len = sizeof(sa);
  getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len);
  advertised->family = 4;
  memset(advertised->ip, 0, sizeof(advertised->ip));
  memcpy(advertised->ip, &ip, 4);
  advertised->port = ntohs(sa.sin_port);
  return fd;
}

Result<size_t> take_frame(std::span<const uint8_t> in, uint32_t max_payload, std::span<const uint8_t>* payload) {
  WireReader r(in);
  uint32_t len = r.u32();
  if (!r.ok()) return size_t{0};
  if (len > max_payload) return Status(Code::kPeerDead, "control message of %u bytes: not a ponte peer", len);
  if (r.remaining() < len) return size_t{0};
  *payload = r.bytes(len);
  return 4 + static_cast<size_t>(len);
}

void append_frame(std::span<const uint8_t> payload, std::vector<uint8_t>* out) {
  WireWriter w(*out);
  w.u32(static_cast<uint32_t>(payload.size()));
  w.bytes(payload);
}

ControlSocket::~ControlSocket() { close(); }

void ControlSocket::close() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  connecting_ = false;
  in_.clear();
  out_.clear();
}

// Room for the keep-alive traffic (PING/PONG frames, a few dozen bytes) taken when a socket
// opens, at setup: the worker's first PING or PONG on a connection, long after the handshake,
// then allocates nothing (the buffers keep their capacity; only a larger message grows them).
constexpr size_t kSteadyBufferBytes = 256;

void ControlSocket::reserve_steady() {
  in_.reserve(kSteadyBufferBytes);
  out_.reserve(kSteadyBufferBytes);
}

Status ControlSocket::connect(const ControlEndpoint& to) {
  close();
  reserve_steady();
  if (to.family != 4) return Status(Code::kInvalidArgument, "control socket: only IPv4 is supported");
  fd_ = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd_ < 0) return Status(Code::kResource, "socket: %s", strerror(errno));
  set_socket_options(fd_);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  memcpy(&sa.sin_addr, to.ip, 4);
  sa.sin_port = htons(to.port);
  int rc = ::connect(fd_, reinterpret_cast<sockaddr*>(&sa), sizeof(sa));
  if (rc != 0 && errno != EINPROGRESS) {
    Status st(Code::kPeerDead, "connect to %s: %s", to.to_string().c_str(), strerror(errno));
    close();
    return st;
  }
  connecting_ = (rc != 0);
  return Status::Ok();
}

void ControlSocket::adopt(int fd) {
  close();
  reserve_steady();
  fd_ = fd;
  int flags = fcntl(fd_, F_GETFL);
  fcntl(fd_, F_SETFL, flags | O_NONBLOCK);
  set_socket_options(fd_);
}

void ControlSocket::take_input(ControlSocket& from) {
  in_.insert(in_.begin(), from.in_.begin(), from.in_.end());
  from.in_.clear();
}

Result<bool> ControlSocket::poll_connected() {
  if (fd_ < 0) return Status(Code::kPeerDead, "control socket closed");
  if (!connecting_) return true;
  int err = 0;
  socklen_t len = sizeof(err);
  // A non-blocking connect is done when the socket is writable: probe with a zero-byte send.
  if (getsockopt(fd_, SOL_SOCKET, SO_ERROR, &err, &len) != 0 || err != 0)
    return Status(Code::kPeerDead, "control connect failed: %s", strerror(err ? err : errno));
  sockaddr_in peer{};
  socklen_t plen = sizeof(peer);
  if (getpeername(fd_, reinterpret_cast<sockaddr*>(&peer), &plen) != 0) {
    if (errno == ENOTCONN) return false;
    return Status(Code::kPeerDead, "control connect: %s", strerror(errno));
  }
  connecting_ = false;
  return true;
}

Status ControlSocket::send_message(std::span<const uint8_t> payload) {
  if (fd_ < 0) return Status(Code::kPeerDead, "control socket closed");
  append_frame(payload, &out_);
  return flush();
}

Status ControlSocket::flush() {
  if (fd_ < 0) return Status(Code::kPeerDead, "control socket closed");
  if (connecting_) return Status::Ok();
  while (!out_.empty()) {
    ssize_t n = ::send(fd_, out_.data(), out_.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return Status::Ok();
      return Status(Code::kPeerDead, "control send: %s", strerror(errno));
    }
    out_.erase(out_.begin(), out_.begin() + n);
  }
  return Status::Ok();
}

Result<bool> ControlSocket::recv_message(std::vector<uint8_t>* msg) {
  if (fd_ < 0) return Status(Code::kPeerDead, "control socket closed");
  if (connecting_) return false;
  uint8_t buf[4096];
  for (;;) {
    // Deliver a complete message first.
    std::span<const uint8_t> payload;
    auto took = take_frame(in_, max_message_, &payload);
    if (!took.ok()) return took.status();
    if (*took > 0) {
      msg->assign(payload.begin(), payload.end());
      in_.erase(in_.begin(), in_.begin() + static_cast<long>(*took));
      return true;
    }
    ssize_t n = ::recv(fd_, buf, sizeof(buf), MSG_DONTWAIT);
    if (n == 0) return Status(Code::kPeerDead, "peer closed its control connection (process exited?)");
    if (n < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return false;
      return Status(Code::kPeerDead, "control connection: %s", strerror(errno));
    }
    in_.insert(in_.end(), buf, buf + n);
  }
}

}  // namespace ponte
