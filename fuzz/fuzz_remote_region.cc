// Fuzzes RemoteRegion::decode (a peer's memory descriptor, also inside the plugin's CONNECT,
// ACCEPT and CTS): an accepted descriptor is version 1, its size matches its NIC count and it
// re-encodes to exactly its bytes; a valid region built from the input round-trips unchanged.
#include <fuzzer/FuzzedDataProvider.h>

#include <vector>

#include "core/remote_region.h"
#include "fuzz/fuzz_check.h"

using namespace ponte;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::span<const uint8_t> in(data, size);
  auto r = RemoteRegion::decode(in);
  if (r.ok()) {
    FUZZ_CHECK(data[0] == 1 && data[1] == 'R');
    FUZZ_CHECK(r->nics >= 1 && r->nics <= kMaxNicsPerGroup);
    FUZZ_CHECK(size == RemoteRegion::encoded_size(r->nics));
    FUZZ_CHECK(r->encode() == std::vector<uint8_t>(in.begin(), in.end()));
  }

  FuzzedDataProvider fdp(data, size);
  RemoteRegion x;
  x.addr = fdp.ConsumeIntegral<uint64_t>();
  x.len = fdp.ConsumeIntegral<uint64_t>();
  x.nics = fdp.ConsumeIntegralInRange<uint8_t>(1, kMaxNicsPerGroup);
  for (int i = 0; i < x.nics; i++) {
    x.rkey[i] = fdp.ConsumeIntegral<uint64_t>();
    x.remote_base[i] = fdp.ConsumeIntegral<uint64_t>();
  }
  auto y = RemoteRegion::decode(x.encode());
  FUZZ_CHECK(y.ok());
  FUZZ_CHECK(*y == x);
  return 0;
}
