// Fuzzes the control connection's framing, the first thing that reads a stranger's bytes: the pure
// take_frame over the whole input and, through a socket pair, ControlSocket::recv_message as the
// engine runs it. Both must yield the same messages; re-framing them gives back the bytes they
// came from; a length over the limit is an error, never a buffer of that size.
#include <sys/socket.h>
#include <unistd.h>

#include <vector>

#include "core/control_socket.h"
#include "fuzz/fuzz_check.h"

using namespace ponte;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // A small limit for inputs whose first byte is odd, so both sides of it get explored.
  const uint32_t limit = (size > 0 && (data[0] & 1)) ? 64 : kMaxControlMessage;
  std::span<const uint8_t> in(data, size);
  std::vector<std::vector<uint8_t>> frames;
  size_t used = 0;
  for (;;) {
    std::span<const uint8_t> payload;
    auto took = take_frame(in.subspan(used), limit, &payload);
    if (!took.ok()) break;  // over the limit: the connection is dropped
    if (*took == 0) break;
    FUZZ_CHECK(*took == 4 + payload.size() && payload.size() <= limit);
    FUZZ_CHECK(payload.data() == in.data() + used + 4);
    frames.emplace_back(payload.begin(), payload.end());
    used += *took;
  }
  std::vector<uint8_t> reframed;
  for (const auto& f : frames) append_frame(f, &reframed);
  FUZZ_CHECK(reframed == std::vector<uint8_t>(in.begin(), in.begin() + static_cast<long>(used)));

  if (limit != kMaxControlMessage || size > 64 * 1024) return 0;
  // The same bytes through a real socket, closed after them: the same frames, then kPeerDead.
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) return 0;
  size_t off = 0;
  while (off < size) {
    ssize_t n = write(sv[1], data + off, size - off);
    if (n <= 0) break;
    off += static_cast<size_t>(n);
  }
  close(sv[1]);
  ControlSocket sock;
  sock.adopt(sv[0]);
  std::vector<uint8_t> msg;
  size_t got = 0;
  for (;;) {
    auto r = sock.recv_message(&msg);
    if (!r.ok()) {
      FUZZ_CHECK(r.status().code() == Code::kPeerDead);
      break;
    }
    if (!*r) continue;  // a socket pair delivers everything: keep reading until the close
    FUZZ_CHECK(got < frames.size() && msg == frames[got]);
    got++;
  }
  FUZZ_CHECK(off != size || got == frames.size());
  return 0;
}
