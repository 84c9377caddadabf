// Fuzzes the verbs backend's wire formats, both from the peer: the NIC address (inside its group
// address) and the RC connect blob (inside its HELLO). Accepted bytes are of this version and
// re-encode to themselves; valid values built from the input round-trip unchanged.
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>

#include "core/verbs/verbs_wire.h"
#include "fuzz/fuzz_check.h"

using namespace ponte::verbs;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::span<const uint8_t> in(data, size);
  auto a = VerbsAddress::decode(in);
  if (a.ok()) {
    FUZZ_CHECK(data[0] == VerbsAddress::kTag && data[1] == VerbsAddress::kVersion);
    auto e = a->encode();
    FUZZ_CHECK(size == e.size() && std::equal(e.begin(), e.end(), data));
  }
  auto c = ConnectBlob::decode(in);
  if (c.ok()) {
    FUZZ_CHECK(data[0] == ConnectBlob::kTag && data[1] == ConnectBlob::kVersion);
    FUZZ_CHECK(c->qp_count >= 1 && c->qp_count <= ConnectBlob::kMaxQps && c->psn <= 0xffffff);
    for (size_t i = 0; i < ConnectBlob::kMaxQps; i++)
      FUZZ_CHECK(i < c->qp_count ? c->qpn[i] != 0 && c->qpn[i] <= 0xffffff : c->qpn[i] == 0);
    FUZZ_CHECK(c->has_traffic_class || c->traffic_class == 0);
    auto e = c->encode();
    FUZZ_CHECK(size == e.size() && std::equal(e.begin(), e.end(), data));
  }

  FuzzedDataProvider fdp(data, size);
  VerbsAddress x;
  x.link_layer = fdp.ConsumeBool() ? LinkLayer::kInfiniBand : LinkLayer::kEthernet;
  x.port = fdp.ConsumeIntegralInRange<uint8_t>(1, 255);
  x.lid = fdp.ConsumeIntegral<uint16_t>();
  x.mtu = fdp.ConsumeIntegralInRange<uint8_t>(1, 5);
  x.gid_index = fdp.ConsumeIntegral<uint8_t>();
  for (auto& b : x.gid) b = fdp.ConsumeIntegral<uint8_t>();
  auto xa = x.encode();
  auto y = VerbsAddress::decode(xa);
  FUZZ_CHECK(y.ok() && *y == x);
  ConnectBlob b;
  b.qp_count = fdp.ConsumeIntegralInRange<uint8_t>(1, ConnectBlob::kMaxQps);
  for (size_t i = 0; i < b.qp_count; i++) b.qpn[i] = fdp.ConsumeIntegralInRange<uint32_t>(1, 0xffffff);
  b.has_traffic_class = fdp.ConsumeBool();
  b.traffic_class = b.has_traffic_class ? fdp.ConsumeIntegral<uint8_t>() : 0;
  b.psn = fdp.ConsumeIntegralInRange<uint32_t>(0, 0xffffff);
  b.lid = fdp.ConsumeIntegral<uint16_t>();
  b.mtu = fdp.ConsumeIntegralInRange<uint8_t>(1, 5);
  b.link_layer = fdp.ConsumeBool() ? LinkLayer::kInfiniBand : LinkLayer::kEthernet;
  for (auto& g : b.gid) g = fdp.ConsumeIntegral<uint8_t>();
  auto xb = b.encode();
  auto z = ConnectBlob::decode(xb);
  FUZZ_CHECK(z.ok() && *z == b);
  return 0;
}
