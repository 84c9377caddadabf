// consumer: a program outside ponte, built against an installed ponte (find_package or pkg-config)
// as a user's would be. Two engines in this process on loopback (libfabric tcp;ofi_rxm unless
// PONTE_FABRIC_PROVIDER says otherwise): A writes 4 MiB into B's memory with an immediate, B's
// counter sees it land, every byte is checked. Exit 0 and "consumer: ... verified" when it worked.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "core/engine.h"
#include "loopback_env.h"

namespace {

int fail(const char* what, const ponte::Status& st) {
  std::fprintf(stderr, "consumer: %s: %s\n", what, st.message());
  return 1;
}

}  // namespace

int main() {
  set_loopback_defaults();

  auto a = ponte::Engine::create();
  if (!a.ok()) return fail("engine A", a.status());
  auto b = ponte::Engine::create();
  if (!b.ok()) return fail("engine B", b.status());
  ponte::Engine& ea = *a.value();
  ponte::Engine& eb = *b.value();

  constexpr size_t kLen = size_t{4} << 20;
  constexpr uint32_t kImm = 42;
  std::vector<unsigned char> src(kLen), dst(kLen, 0);
  for (size_t i = 0; i < kLen; ++i) src[i] = static_cast<unsigned char>((i * 131 + 7) >> 3);

  auto src_mr = ea.register_memory(0, src.data(), kLen);
  if (!src_mr.ok()) return fail("register source", src_mr.status());
  auto dst_mr = eb.register_memory(0, dst.data(), kLen);
  if (!dst_mr.ok()) return fail("register destination", dst_mr.status());
  // B's region travels as bytes, as it would between two hosts.
  auto region = ponte::RemoteRegion::decode(dst_mr.value().remote().encode());
  if (!region.ok()) return fail("decode region", region.status());

  auto peer = ea.connect(0, eb.address(0));
  if (!peer.ok()) return fail("connect", peer.status());
  ponte::Flag landed, written;
  ponte::Status st = eb.expect_imm(0, kImm, ea.imms_per_write(0, peer.value(), kLen), ponte::kAnyPeer,
                                   landed.notify());
  if (!st.ok()) return fail("expect_imm", st);
  st = ea.write_imm(0, peer.value(), {&src_mr.value(), 0, kLen}, region.value(), 0, kImm,
                    written.notify());
  if (!st.ok()) return fail("write_imm", st);
  if (st = written.wait(std::chrono::seconds(60)); !st.ok()) return fail("write", st);
  if (st = landed.wait(std::chrono::seconds(60)); !st.ok()) return fail("immediate", st);
  if (std::memcmp(src.data(), dst.data(), kLen) != 0) {
    size_t i = 0;
    while (src[i] == dst[i]) ++i;
    std::fprintf(stderr, "consumer: byte %zu differs (%u, want %u)\n", i, dst[i], src[i]);
    return 1;
  }
  if (st = ea.deregister(src_mr.value()); !st.ok()) return fail("deregister source", st);
  if (st = eb.deregister(dst_mr.value()); !st.ok()) return fail("deregister destination", st);
  std::printf("consumer: %zu bytes written with an immediate between two engines (%s), verified\n",
              kLen, std::getenv("PONTE_FABRIC_PROVIDER"));
  return 0;
}
