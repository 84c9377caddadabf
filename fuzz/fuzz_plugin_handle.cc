// Fuzzes the NCCL listen handle (128 bytes NCCL carries from the listening rank): an accepted
// handle is of this version, its address lies inside it, and encoding what was decoded gives the
// same bytes up to the connector's stage bytes; the address then goes through GroupAddress::decode
// as the transport does.
#include <fuzzer/FuzzedDataProvider.h>

#include <cstring>
#include <memory>

#include "core/group_address.h"
#include "fuzz/fuzz_check.h"
#include "plugin/wire.h"

using namespace ponte;
using namespace ponte::plugin;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // Exactly the handle's size on the heap, so a read past it is an ASan report.
  auto handle = std::make_unique<uint8_t[]>(kHandleSize);
  std::memset(handle.get(), 0, kHandleSize);
  std::memcpy(handle.get(), data, std::min(size, kHandleSize));
  auto h = decode_handle(handle.get());
  if (h.ok()) {
    FUZZ_CHECK(handle[0] == kWireVersion && (handle[1] == 'H' || handle[1] == 'B'));
    FUZZ_CHECK(h->address.data() >= handle.get() + kHandleHeader &&
               h->address.data() + h->address.size() <= handle.get() + kHandleStageOffset);
    uint8_t again[kHandleSize];
    FUZZ_CHECK(encode_handle(*h, again).ok());
    FUZZ_CHECK(std::memcmp(again, handle.get(), kHandleStageOffset) == 0);
    (void)GroupAddress::decode(h->address);
  }

  FuzzedDataProvider fdp(data, size);
  auto addr = fdp.ConsumeBytes<uint8_t>(fdp.ConsumeIntegralInRange<size_t>(1, kHandleMaxAddress));
  if (addr.empty()) addr.push_back(7);
  ListenHandle x;
  x.listen_id = fdp.ConsumeIntegralInRange<uint32_t>(1, UINT32_MAX);
  x.nonce = fdp.ConsumeIntegralInRange<uint64_t>(1, UINT64_MAX);
  x.bootstrap = fdp.ConsumeBool();
  x.address = addr;
  uint8_t enc[kHandleSize];
  FUZZ_CHECK(encode_handle(x, enc).ok());
  const uint64_t stage = fdp.ConsumeIntegral<uint64_t>();
  set_handle_stage(enc, stage);  // the connector's bytes do not change what the handle says
  auto y = decode_handle(enc);
  FUZZ_CHECK(y.ok() && y->listen_id == x.listen_id && y->nonce == x.nonce && y->bootstrap == x.bootstrap);
  FUZZ_CHECK(std::equal(y->address.begin(), y->address.end(), addr.begin(), addr.end()));
  FUZZ_CHECK(handle_stage(enc) == stage);
  return 0;
}
