// Fuzzes the header of an MoE dispatch/combine block (collectives/ep_layout.h), which a peer
// writes into this rank's receive area: for a shape, phase and call number taken from the input,
// an accepted header is of this version, its counts are in range and add up to its routed copies,
// its rows and data size match them, and writing what was read gives back the same bytes (version
// through entries, and the counts). For a dispatch header of a small enough shape, the rest of the
// input is its rows: unpacking them either is refused or writes exactly the counted copies.
#include <cstring>
#include <algorithm>
#include <memory>
#include <span>
#include <vector>

#include "collectives/ep_layout.h"
#include "fuzz/fuzz_check.h"

using namespace ponte;

constexpr size_t kEpFuzzPrefix = 14;

// Input: 14 bytes of parameters (ep_seed_prefix in make_seeds.cc), then the header bytes.
extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < kEpFuzzPrefix) return 0;
  auto u16 = [&](size_t i) { return static_cast<int>(data[i] | (data[i + 1] << 8)); };
  const int world = 1 + data[0] % 8;
  const int local = 1 + data[1] % 16;
  const EpShape s = make_ep_shape(world, world * local, 1 + u16(2) % 4096, 1 + u16(4) % 8192, 1 + data[6] % 8,
                                  data[7] & 1 ? DType::kFloat32 : DType::kBFloat16, data[8] % 65);
  const uint8_t phase = data[9] & 1 ? kEpPhaseCombine : kEpPhaseDispatch;
  uint32_t seq;
  std::memcpy(&seq, data + 10, 4);
  std::span<const uint8_t> rest(data + kEpFuzzPrefix, size - kEpFuzzPrefix);
  const size_t hb = ep_header_bytes(s.local_experts);
  auto block = std::make_unique<uint8_t[]>(hb);  // exactly the header: over-reads are reports
  std::memset(block.get(), 0, hb);
  std::memcpy(block.get(), rest.data(), std::min(rest.size(), hb));
  EpBlockHeader h;
  std::vector<int32_t> counts(static_cast<size_t>(s.local_experts));
  if (!read_block_header(block.get(), s, phase, seq, &h, counts.data()).ok()) return 0;
  FUZZ_CHECK(block[0] == kEpBlockVersion && h.phase == phase && h.seq == seq);
  FUZZ_CHECK(h.rows <= (phase == kEpPhaseDispatch ? max_dispatch_rows(s) : max_rows_per_block(s)));
  FUZZ_CHECK(phase == kEpPhaseDispatch ? h.entries >= h.rows && h.entries <= static_cast<uint64_t>(h.rows) * s.topk
                                       : h.entries == h.rows);
  const size_t stride = phase == kEpPhaseDispatch ? dispatch_row_stride(s) : combine_row_stride(s);
  FUZZ_CHECK(h.data_bytes == static_cast<uint64_t>(h.rows) * stride);
  uint64_t sum = 0;
  for (int32_t c : counts) {
    FUZZ_CHECK(c >= 0 && c <= s.max_tokens);
    sum += static_cast<uint64_t>(c);
  }
  FUZZ_CHECK(sum == h.entries);
  auto again = std::make_unique<uint8_t[]>(hb);
  write_block_header(again.get(), s, h, counts.data());
  FUZZ_CHECK(std::memcmp(again.get(), block.get(), kEpHeaderFixed) == 0);
  FUZZ_CHECK(std::memcmp(again.get() + kEpHeaderFixed, block.get() + kEpHeaderFixed, 4 * counts.size()) == 0);
  EpBlockHeader h2;
  std::vector<int32_t> counts2(counts.size());
  FUZZ_CHECK(read_block_header(again.get(), s, phase, seq, &h2, counts2.data()).ok());
  FUZZ_CHECK(h2.rows == h.rows && h2.entries == h.entries && h2.data_imms == h.data_imms && h2.data_bytes == h.data_bytes && counts2 == counts);
  const size_t per = static_cast<size_t>(s.world) * s.max_tokens;
  const size_t rx_bytes = static_cast<size_t>(s.local_experts) * per * s.row_bytes;
  if (phase != kEpPhaseDispatch || rx_bytes > (1u << 22) || h.data_bytes > (1u << 22)) return 0;
  // Rows: what input is left after the header, zeros after it; each expert's copies begin at row
  // 0 of its block, so the rows past its count are a guard that must keep its poison.
  auto rows = std::make_unique<uint8_t[]>(h.data_bytes + 1);
  std::memset(rows.get(), 0, h.data_bytes + 1);
  if (rest.size() > hb) std::memcpy(rows.get(), rest.data() + hb, std::min<size_t>(rest.size() - hb, h.data_bytes));
  std::vector<uint8_t> rx(rx_bytes, 0xa5);
  std::vector<int32_t> begins(counts.size(), 0), cursor(counts.size()), info(static_cast<size_t>(s.local_experts) * per * 2, -7);
  Status st = unpack_dispatch_block(s, rows.get(), h.rows, counts.data(), 1, begins.data(), rx.data(), nullptr, info.data(),
                                    cursor.data());
  for (int l = 0; l < s.local_experts; l++)
    for (size_t r = static_cast<size_t>(counts[l]); r < per; r++)
      FUZZ_CHECK(info[2 * (l * per + r)] == -7);  // nothing past the count, accepted or not
  if (st.ok())
    for (int l = 0; l < s.local_experts; l++)
      for (int32_t r = 0; r < counts[l]; r++) {
        const int32_t t = info[2 * (l * per + static_cast<size_t>(r)) + 1];
        FUZZ_CHECK(info[2 * (l * per + static_cast<size_t>(r))] == 1 && t >= 0 && t < s.max_tokens);
      }
  return 0;
}
