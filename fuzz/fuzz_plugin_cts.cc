// Fuzzes what a receiver writes into a sender's CTS FIFO slot (bytes from another process, landed by
// RDMA) and into the receiver's size-record area. The input is u32 expected request number + slot
// bytes; the seal's seed is kSeed (the seeds are sealed with it). read_cts takes a slot only whole
// (version, request, length, seal) and never reads past cts_bytes(n); its elements then decode
// inside their regions (the elements are also decoded unsealed: the decoder must hold on its own);
// what was decoded, encoded again, is taken and decodes to the same; records round-trip.
#include <cstring>
#include <memory>
#include <vector>

#include "fuzz/fuzz_check.h"
#include "plugin/wire.h"

using namespace ponte;
using namespace ponte::plugin;

namespace {

constexpr uint64_t kSeed = 0x5eed5eed5eed5eedull;  // fuzz/make_seeds.cc seals with it too

struct Decoded {
  int n = 0;
  CtsElem elems[kMaxRecvs];
  RemoteRegion regions[kMaxRecvs];
};

// Every element of a slot copy with n buffers; any bad element rejects it all.
bool decode_elems(const uint8_t* copy, int n, Decoded* d) {
  FUZZ_CHECK(n >= 1 && n <= kMaxRecvs);
  d->n = n;
  for (int i = 0; i < d->n; i++) {
    if (!decode_cts_elem(copy, i, &d->elems[i], &d->regions[i]).ok()) return false;
    const CtsElem& e = d->elems[i];
    FUZZ_CHECK(e.region.data() >= copy && e.region.data() + e.region.size() <= copy + cts_bytes(n));
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
  auto copy = std::make_unique<uint8_t[]>(kCtsSlotBytes);
  auto n = read_cts(slot.get(), expected, kSeed, copy.get());
  if (n.ok()) {
    FUZZ_CHECK(slot[0] == kWireVersion && slot[1] == 'T');
    FUZZ_CHECK(std::memcmp(copy.get(), slot.get(), cts_bytes(*n)) == 0);
  } else {
    FUZZ_CHECK(n.status().code() == Code::kAgain);
  }
  // The slot read as an eager record of request `expected` (the same bytes an eager slot holds).
  EagerRecord er;
  if (read_eager(slot.get(), expected, &er)) {
    uint8_t again[kRecordBytes];
    encode_eager(er, again);
    EagerRecord er2;
    FUZZ_CHECK(read_eager(again, expected, &er2) && er2 == er);
  }
  // The elements as the header's count says, sealed or not.
  const int count = slot[8] >= 1 && slot[8] <= kMaxRecvs ? slot[8] : 1;
  Decoded d;
  if (decode_elems(slot.get(), count, &d)) {
    auto again = std::make_unique<uint8_t[]>(kCtsSlotBytes);
    const uint32_t oldest = cts_oldest_open(slot.get());
    FUZZ_CHECK(encode_cts(expected, oldest, kSeed, std::span<const CtsElem>(d.elems, d.n), again.get()).ok());
    auto n2 = read_cts(again.get(), expected, kSeed, copy.get());
    FUZZ_CHECK(n2.ok() && *n2 == d.n && cts_oldest_open(copy.get()) == oldest);
    Decoded d2;
    FUZZ_CHECK(decode_elems(copy.get(), d.n, &d2));
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
