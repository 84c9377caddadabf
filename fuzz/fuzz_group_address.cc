// Fuzzes GroupAddress::decode (bytes a peer hands over out of band and inside every HELLO):
// an accepted address is version 2 and re-encodes to exactly its bytes; any valid address built
// from the input survives encode + decode unchanged.
#include <fuzzer/FuzzedDataProvider.h>

#include <vector>

#include "core/group_address.h"
#include "core/remote_region.h"
#include "fuzz/fuzz_check.h"

using namespace ponte;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::span<const uint8_t> in(data, size);
  auto a = GroupAddress::decode(in);
  if (a.ok()) {
    FUZZ_CHECK(size >= 2 && data[0] == 2 && data[1] == 'A');
    FUZZ_CHECK(!a->nic_addrs.empty() && a->nic_addrs.size() <= static_cast<size_t>(kMaxNicsPerGroup));
    FUZZ_CHECK(a->encode() == std::vector<uint8_t>(in.begin(), in.end()));
  }

  FuzzedDataProvider fdp(data, size);
  GroupAddress x;
  x.engine_nonce = fdp.ConsumeIntegral<uint64_t>();
  x.group = fdp.ConsumeIntegral<uint8_t>();
  x.backend = fdp.ConsumeBool() ? BackendKind::kVerbs : BackendKind::kFabric;
  x.ip_family = fdp.ConsumeBool() ? 6 : 4;
  x.port = fdp.ConsumeIntegralInRange<uint16_t>(1, UINT16_MAX);
  for (auto& b : x.ip) b = fdp.ConsumeIntegral<uint8_t>();
  x.max_msg = fdp.ConsumeIntegral<uint64_t>();
  x.auth_kind = fdp.ConsumeBool() ? AuthKind::kJobKey : AuthKind::kSecret;
  x.auth_secret = x.auth_kind == AuthKind::kSecret ? fdp.ConsumeIntegralInRange<uint64_t>(1, UINT64_MAX) : 0;
  const int nics = fdp.ConsumeIntegralInRange<int>(1, kMaxNicsPerGroup);
  for (int i = 0; i < nics; i++) {
    auto bytes = fdp.ConsumeBytes<uint8_t>(fdp.ConsumeIntegralInRange<size_t>(1, 64));
    if (bytes.empty()) bytes.push_back(0);
    x.nic_addrs.push_back(bytes);
    x.imm_rkey.push_back(fdp.ConsumeIntegral<uint64_t>());
    x.imm_base.push_back(fdp.ConsumeIntegral<uint64_t>());
  }
  auto y = GroupAddress::decode(x.encode());
  FUZZ_CHECK(y.ok());
  FUZZ_CHECK(*y == x);
  return 0;
}
