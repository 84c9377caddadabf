// Fuzzes what a receiver writes into a sender's CTS FIFO slot (bytes from another process, landed by
// RDMA) and into the receiver's size-record area. The input is u32 expected request number + slot
// bytes. Accepted slots are of this version; every accepted buffer lies inside its region; what
// was decoded, encoded again, decodes to the same; records round-trip.
#include <cstring>
#include <memory>
#include <vector>

#include "fuzz/fuzz_check.h"
#include "plugin/wire.h"

using namespace ponte;
using namespace ponte::plugin;

namespace {

struct Decoded {
  int n = 0;
  CtsElem elems[kMaxRecvs];
  RemoteRegion regions[kMaxRecvs];
};

// As the transport reads a slot: the header, then every element; any bad element rejects it all.
bool decode_slot(const uint8_t* slot, uint32_t expected, Decoded* d) {
  auto n = decode_cts_header(slot, expected);
  if (!n.ok()) return false;
  FUZZ_CHECK(*n >= 1 && *n <= kMaxRecvs);
  d->n = *n;
  for (int i = 0; i < d->n; i++) {
    if (!decode_cts_elem(slot, i, &d->elems[i], &d->regions[i]).ok()) return false;
    const CtsElem& e = d->elems[i];
    FUZZ_CHECK(e.region.data() >= slot && e.region.data() + e.region.size() <= slot + kCtsSlotBytes);
    FUZZ_CHECK(e.offset <= d->regions[i].len && e.size <= d->regions[i].len - e.offset);
    // An inline offer may name a buffer of any size (wire version 4): the sender decides what goes
    // inline, and the receiver bounds what it copies out by kInlineMax (transport_data.cc).
  }
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 4) return 0;
  uint32_t expected;
  std::memcpy(&expected, data, 4);
  auto slot = std::make_unique<uint8_t[]>(kCtsSlotBytes);  // exactly a slot: over-reads are reports
  std::memset(slot.get(), 0, kCtsSlotBytes);
  std::memcpy(slot.get(), data + 4, std::min(size - 4, kCtsSlotBytes));
  Decoded d;
  if (decode_slot(slot.get(), expected, &d)) {
    FUZZ_CHECK(slot[0] == kWireVersion && slot[1] == 'T');
    auto again = std::make_unique<uint8_t[]>(kCtsSlotBytes);
    FUZZ_CHECK(encode_cts(expected, std::span<const CtsElem>(d.elems, d.n), again.get()).ok());
    Decoded d2;
    FUZZ_CHECK(decode_slot(again.get(), expected, &d2) && d2.n == d.n);
    for (int i = 0; i < d.n; i++) {
      FUZZ_CHECK(d2.elems[i].offset == d.elems[i].offset && d2.elems[i].size == d.elems[i].size &&
                 d2.elems[i].tag == d.elems[i].tag && d2.elems[i].inline_data == d.elems[i].inline_data &&
                 d2.regions[i] == d.regions[i]);
      FUZZ_CHECK(std::equal(d2.elems[i].region.begin(), d2.elems[i].region.end(),
                            d.elems[i].region.begin(), d.elems[i].region.end()));
    }
  }

  // The size record: the slot's first bytes, exactly kRecordBytes on the heap.
  auto rec = std::make_unique<uint8_t[]>(kRecordBytes);
  std::memcpy(rec.get(), slot.get(), kRecordBytes);
  auto r = decode_record(rec.get());
  if (r.ok()) {
    FUZZ_CHECK(rec[16] == kWireVersion && rec[17] == 'S');
    uint8_t again[kRecordBytes];
    encode_record(*r, again);
    auto r2 = decode_record(again);
    FUZZ_CHECK(r2.ok() && *r2 == *r);
    FUZZ_CHECK(std::memcmp(again, rec.get(), 20) == 0);
  }
  // A blank record is never a size record, and encoding one gives a blank of that request.
  uint32_t number = 0;  // where a record holds its request number (wire.h)
  std::memcpy(&number, rec.get() + 12, sizeof(number));
  if (is_blank_record(rec.get(), number)) FUZZ_CHECK(!r.ok());
  uint8_t blank[kRecordBytes];
  encode_blank_record(number, blank);
  FUZZ_CHECK(is_blank_record(blank, number) && !is_blank_record(blank, number + 1) && !decode_record(blank).ok());
  return 0;
}
