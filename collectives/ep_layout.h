// ep_layout: the byte layout of dispatch/combine blocks and the plain pack / count / unpack / reduce
// functions over it, kept free of any transport so the CUDA kernels (collectives/cuda/) mirror them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "core/status.h"

namespace ponte {

enum class DType : uint8_t { kFloat32 = 0, kBFloat16 = 1 };
size_t dtype_bytes(DType d);
const char* dtype_name(DType d);

inline float bf16_to_float(uint16_t v) {
  uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}
// Round to nearest even; NaN stays NaN.
inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t quiet = (u >> 16) | 0x40u;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? quiet : rounded);  // a select: vectorises
}

// Everything the layout depends on. Rows of x/y are row_bytes = hidden * dtype bytes; a dispatched
// row also carries extra_bytes (fp8 scales later) and a tag naming its token and local experts.
struct EpShape {
  int world = 1;
  int experts = 0;
  int local_experts = 0;  // L = experts / world
  int max_tokens = 0;
  int hidden = 0;
  int topk = 0;
  DType dtype = DType::kBFloat16;
  size_t row_bytes = 0;
  size_t extra_bytes = 0;
};
EpShape make_ep_shape(int world, int experts, int max_tokens, int hidden, int topk, DType dtype,
                      size_t extra_bytes);

// Block: [header][rows]. The header (ep_header_bytes(L), a multiple of 64):
//   u8 version (2), u8 phase ('D' dispatch, 'C' combine), u16 header bytes, u32 rows, u32 seq,
//   u32 data_imms (immediates of the separate data write; 0: rows came inline with the header),
//   u64 data bytes, u32 L, u32 entries (routed copies: the sum of the counts), then L u32 counts
//   (routed copies per local expert of the receiver).
// Dispatch rows: one per (token, destination rank), in token order: a token picking several experts
//   of one rank crosses to it once. Tag i32 token, i32 n, then K i32 local experts (the n it picked
//   there, in k order, -1 after), padded to dispatch_tag_bytes, then row bytes, extra bytes, padded to dispatch_row_stride. The
//   receiver copies the row into each named expert's block in (row, entry) order, which is the
//   order in which the sender numbered its (t, k) per expert (send_map).
// Combine rows: one per routed copy, row bytes padded to combine_row_stride, expert by expert in
//   the order the dispatch block's copies were unpacked (so send_map names each one's (t, k)).
constexpr uint8_t kEpBlockVersion = 2;
constexpr uint8_t kEpPhaseDispatch = 'D';
constexpr uint8_t kEpPhaseCombine = 'C';
constexpr size_t kEpHeaderFixed = 32;

size_t ep_header_bytes(int local_experts);
size_t dispatch_tag_bytes(const EpShape& s);  // 8 + 4 K, to 16 bytes (rows stay 16-byte aligned)
size_t dispatch_row_stride(const EpShape& s);
size_t combine_row_stride(const EpShape& s);
// Most dispatch rows one rank sends to one rank: one per token.
size_t max_dispatch_rows(const EpShape& s);
// Most routed copies (combine rows) one rank sends to one rank: each token's K copies, and at
// most max_tokens per expert.
size_t max_rows_per_block(const EpShape& s);
size_t dispatch_block_bytes(const EpShape& s);
size_t combine_block_bytes(const EpShape& s);

struct EpBlockHeader {
  uint8_t phase = 0;
  uint32_t rows = 0;     // rows in the data area
  uint32_t entries = 0;  // routed copies (= rows for combine)
  uint32_t seq = 0;
  uint32_t data_imms = 0;
  uint64_t data_bytes = 0;
};

void write_block_header(uint8_t* p, const EpShape& s, const EpBlockHeader& h, const int32_t* counts);
// Rejects a wrong version, phase, seq, header size or L, counts that do not add up to entries or
// exceed max_tokens, more rows than fit, entries a dispatch block's rows cannot carry (fewer than
// its rows, more than K per row) or a combine block's entries other than its rows, and data bytes
// that do not match the rows. counts_out: L entries.
Status read_block_header(const uint8_t* p, const EpShape& s, uint8_t phase, uint32_t seq,
                         EpBlockHeader* h, int32_t* counts_out);

// Routing checks before anything is sent: every index in [-1, E), and at most max_tokens rows from
// this rank to any one expert (so expert blocks of W * max_tokens rows always suffice).
// expert_rows: scratch of E entries.
Status check_routing(const EpShape& s, const int64_t* topk_idx, int tokens, int32_t* expert_rows);

// counts [W * L]: rows this rank sends to rank d for its local expert l, at counts[d * L + l].
void count_routes(const EpShape& s, const int64_t* topk_idx, int tokens, int32_t* counts);

// Packs each token once per destination rank it routes to into the data area of that rank's block
// (blocks[d] points at the first row), rows in token order; rows_out[d] gets d's row count.
// send_map [W * max_rows_per_block] records, per destination and routed copy in the receiver's
// unpack order (expert by expert, then token and k order), t * K + k (what combine needs).
// cursor: scratch of W * L entries; token_row: scratch of W entries. tags_only: a rank whose block
// gets each row's tag but not its data (this rank's own, when its unpack reads x itself), or -1.
void pack_dispatch(const EpShape& s, const void* x, const void* x_extra, const int64_t* topk_idx, int tokens,
                   const int32_t* counts, uint8_t* const* blocks, int32_t* cursor, int32_t* token_row,
                   int32_t* send_map, uint32_t* rows_out, int tags_only = -1);

// Copies each of one source's nrows rows into recv_x (L blocks of W * max_tokens rows) once per
// local expert its tag names, expert l's copies starting at row begins[l] of its block, and
// records (src, token) in src_info ([L, W * max_tokens, 2]). recv_extra may be null. The tags come
// from a peer: a token out of range, a count of experts outside 1..K, an expert outside 0..L-1, or
// copies per expert other than counts[l] (the header's) are refused, and nothing is written past
// an expert's counted rows. cursor: scratch of L entries. x, when given, holds the rows' data
// ([x_tokens, H], the block packed with tags_only: this rank's own x): each row is read from x at
// its tag's token, which must then be below x_tokens; x carries no extra bytes, so a shape with
// extra bytes per row is refused.
Status unpack_dispatch_block(const EpShape& s, const uint8_t* rows, uint32_t nrows, const int32_t* counts, int src,
                             const int32_t* begins, void* recv_x, void* recv_extra, int32_t* src_info,
                             int32_t* cursor, const void* x = nullptr, int x_tokens = 0);

// Calls f(n, row) for each row of y answering source src's dispatch block, in that block's order
// (n = 0, 1, ...), using layout_range ([L, W, 2] of (begin, count)). Returns the row count.
template <typename F>
uint32_t for_each_combine_row(const EpShape& s, const void* y, int src, const int32_t* layout_range, F&& f) {
  const size_t per_expert = static_cast<size_t>(s.world) * static_cast<size_t>(s.max_tokens);
  const auto* yb = static_cast<const uint8_t*>(y);
  uint32_t n = 0;
  for (int l = 0; l < s.local_experts; l++) {
    const int32_t begin = layout_range[2 * (l * s.world + src)];
    const int32_t count = layout_range[2 * (l * s.world + src) + 1];
    for (int32_t i = 0; i < count; i++, n++)
      f(n, yb + (static_cast<size_t>(l) * per_expert + static_cast<size_t>(begin + i)) * s.row_bytes);
  }
  return n;
}

// Gathers the rows of y answering source src's dispatch block, in that block's order
// (for_each_combine_row), into rows (combine stride). Returns the row count.
uint32_t pack_combine_block(const EpShape& s, const void* y, int src, const int32_t* layout_range, uint8_t* rows);

// acc[t] += w[t, k] * row for each combine row from one destination; send_map_d: that
// destination's t * K + k per row. acc: [max_tokens, H] float32.
void reduce_combine_block(const EpShape& s, const uint8_t* rows, uint32_t nrows, const int32_t* send_map_d,
                          const float* topk_weights, float* acc);

// The host's combine in one pass over this rank's tokens, token by token: out[t] = sum over k of
// topk_weights[t, k] * row_of[t * K + k] (float32 sums in k order; a null row_of entry adds nothing),
// plus out[t] with accumulate; tokens with routed[t] == 0 get zeros, or are left untouched with
// accumulate. Sums stay in registers, 32 columns at a time, so each row is read once and nothing of
// size T * H is cleared or read back (AVX2 + FMA where the CPU has them: FMA rounds once where mul +
// add round twice). reduce_combine_block + finish_combine compute the same sums block by block (the
// CUDA kernels' order; kept as their reference).
void combine_tokens(const EpShape& s, const uint8_t* const* row_of, const float* topk_weights, const uint8_t* routed,
                    int tokens, void* out, bool accumulate);

// out[t] = acc[t] (or out[t] += acc[t] with accumulate), converted to the dtype. Tokens with
// routed[t] == 0 (no valid expert) get zeros, or are left untouched with accumulate.
void finish_combine(const EpShape& s, const float* acc, const uint8_t* routed, int tokens, void* out,
                    bool accumulate);

}  // namespace ponte
