// ep_layout: the host implementation of the block layout and its pack / unpack / reduce steps.
#include "collectives/ep_layout.h"

#include <algorithm>

#include "collectives/bytes.h"

namespace ponte {

using coll::get;
using coll::put;

namespace {
constexpr size_t align_up(size_t v, size_t a) { return (v + a - 1) / a * a; }
}  // namespace

size_t dtype_bytes(DType d) { return d == DType::kFloat32 ? 4 : 2; }
const char* dtype_name(DType d) { return d == DType::kFloat32 ? "f32" : "bf16"; }

EpShape make_ep_shape(int world, int experts, int max_tokens, int hidden, int topk, DType dtype, size_t extra_bytes) {
  EpShape s;
  s.world = world;
  s.experts = experts;
  s.local_experts = world > 0 ? experts / world : 0;
  s.max_tokens = max_tokens;
  s.hidden = hidden;
  s.topk = topk;
  s.dtype = dtype;
  s.row_bytes = static_cast<size_t>(hidden) * dtype_bytes(dtype);
  s.extra_bytes = extra_bytes;
  return s;
}

size_t ep_header_bytes(int local_experts) { return align_up(kEpHeaderFixed + 4 * static_cast<size_t>(local_experts), 64); }
size_t dispatch_row_stride(const EpShape& s) { return align_up(kEpTagBytes + s.row_bytes + s.extra_bytes, 16); }
size_t combine_row_stride(const EpShape& s) { return align_up(s.row_bytes, 16); }
size_t max_rows_per_block(const EpShape& s) {
  return static_cast<size_t>(s.max_tokens) * static_cast<size_t>(std::min(s.topk, s.local_experts));
}
size_t dispatch_block_bytes(const EpShape& s) {
  return ep_header_bytes(s.local_experts) + max_rows_per_block(s) * dispatch_row_stride(s);
}
size_t combine_block_bytes(const EpShape& s) {
  return ep_header_bytes(s.local_experts) + max_rows_per_block(s) * combine_row_stride(s);
}

void write_block_header(uint8_t* p, const EpShape& s, const EpBlockHeader& h, const int32_t* counts) {
  const size_t hb = ep_header_bytes(s.local_experts);
  memset(p, 0, kEpHeaderFixed);
  put<uint8_t>(p, 0, kEpBlockVersion);
  put<uint8_t>(p, 1, h.phase);
  put<uint16_t>(p, 2, static_cast<uint16_t>(hb > 0xffff ? 0xffff : hb));
  put<uint32_t>(p, 4, h.rows);
  put<uint32_t>(p, 8, h.seq);
  put<uint32_t>(p, 12, h.data_imms);
  put<uint64_t>(p, 16, h.data_bytes);
  put<uint32_t>(p, 24, static_cast<uint32_t>(s.local_experts));
  memcpy(p + kEpHeaderFixed, counts, 4 * static_cast<size_t>(s.local_experts));
}

Status read_block_header(const uint8_t* p, const EpShape& s, uint8_t phase, uint32_t seq, EpBlockHeader* h,
                         int32_t* counts_out) {
  const size_t hb = ep_header_bytes(s.local_experts);
  if (get<uint8_t>(p, 0) != kEpBlockVersion)
    return Status(Code::kInvalidArgument, "block version %u, expected %u", get<uint8_t>(p, 0), kEpBlockVersion);
  h->phase = get<uint8_t>(p, 1);
  if (h->phase != phase) return Status(Code::kInvalidArgument, "block phase '%c', expected '%c'", h->phase, phase);
  if (get<uint16_t>(p, 2) != (hb > 0xffff ? 0xffff : hb))
    return Status(Code::kInvalidArgument, "block header of %u bytes, expected %zu", get<uint16_t>(p, 2), hb);
  if (get<uint32_t>(p, 24) != static_cast<uint32_t>(s.local_experts))
    return Status(Code::kInvalidArgument, "block for %u local experts, expected %d", get<uint32_t>(p, 24), s.local_experts);
  h->rows = get<uint32_t>(p, 4);
  h->seq = get<uint32_t>(p, 8);
  h->data_imms = get<uint32_t>(p, 12);
  h->data_bytes = get<uint64_t>(p, 16);
  if (h->seq != seq) return Status(Code::kInvalidArgument, "block of call %u, expected %u", h->seq, seq);
  if (h->rows > max_rows_per_block(s))
    return Status(Code::kInvalidArgument, "block of %u rows, at most %zu fit", h->rows, max_rows_per_block(s));
  const size_t stride = phase == kEpPhaseDispatch ? dispatch_row_stride(s) : combine_row_stride(s);
  if (h->data_bytes != h->rows * stride)
    return Status(Code::kInvalidArgument, "block of %u rows carries %llu bytes, expected %zu", h->rows,
                  static_cast<unsigned long long>(h->data_bytes), h->rows * stride);
  uint64_t sum = 0;
  memcpy(counts_out, p + kEpHeaderFixed, 4 * static_cast<size_t>(s.local_experts));
  for (int l = 0; l < s.local_experts; l++) {
    if (counts_out[l] < 0 || counts_out[l] > s.max_tokens)
      return Status(Code::kInvalidArgument, "block count %d for local expert %d (max_tokens %d)", counts_out[l], l,
                    s.max_tokens);
    sum += static_cast<uint64_t>(counts_out[l]);
  }
  if (sum != h->rows) return Status(Code::kInvalidArgument, "block counts add up to %llu, header says %u rows",
                                    static_cast<unsigned long long>(sum), h->rows);
  return Status::Ok();
}

Status check_routing(const EpShape& s, const int64_t* topk_idx, int tokens, int32_t* expert_rows) {
  std::fill(expert_rows, expert_rows + s.experts, 0);
  for (int t = 0; t < tokens; t++)
    for (int k = 0; k < s.topk; k++) {
      int64_t e = topk_idx[static_cast<size_t>(t) * s.topk + k];
      if (e == -1) continue;
      if (e < -1 || e >= s.experts)
        return Status(Code::kInvalidArgument, "topk_idx[%d, %d] = %lld: experts are -1 (none) or 0..%d", t, k,
                      static_cast<long long>(e), s.experts - 1);
      if (++expert_rows[e] > s.max_tokens)
        return Status(Code::kInvalidArgument,
                      "more than max_tokens (%d) rows of this rank go to expert %lld (a token names it twice?)",
                      s.max_tokens, static_cast<long long>(e));
    }
  return Status::Ok();
}

void count_routes(const EpShape& s, const int64_t* topk_idx, int tokens, int32_t* counts) {
  std::fill(counts, counts + static_cast<size_t>(s.world) * s.local_experts, 0);
  for (size_t i = 0; i < static_cast<size_t>(tokens) * s.topk; i++) {
    int64_t e = topk_idx[i];
    if (e >= 0) counts[e]++;  // e = d * L + l: the count index is the expert index
  }
}

void pack_dispatch(const EpShape& s, const void* x, const void* x_extra, const int64_t* topk_idx, int tokens,
                   const int32_t* counts, uint8_t* const* blocks, int32_t* cursor, int32_t* send_map) {
  const int L = s.local_experts;
  const size_t stride = dispatch_row_stride(s);
  const size_t max_rows = max_rows_per_block(s);
  for (int d = 0; d < s.world; d++) {  // cursor: first row of (d, l) within d's block
    int32_t at = 0;
    for (int l = 0; l < L; l++) {
      cursor[d * L + l] = at;
      at += counts[d * L + l];
    }
  }
  const auto* xb = static_cast<const uint8_t*>(x);
  const auto* eb = static_cast<const uint8_t*>(x_extra);
  for (int t = 0; t < tokens; t++)
    for (int k = 0; k < s.topk; k++) {
      int64_t e = topk_idx[static_cast<size_t>(t) * s.topk + k];
      if (e < 0) continue;
      const int d = static_cast<int>(e / L);
      const int32_t row = cursor[e]++;
      uint8_t* p = blocks[d] + static_cast<size_t>(row) * stride;
      put<int32_t>(p, 0, t);
      put<int32_t>(p, 4, k);
      memcpy(p + kEpTagBytes, xb + static_cast<size_t>(t) * s.row_bytes, s.row_bytes);
      if (s.extra_bytes && eb) memcpy(p + kEpTagBytes + s.row_bytes, eb + static_cast<size_t>(t) * s.extra_bytes, s.extra_bytes);
      send_map[static_cast<size_t>(d) * max_rows + row] = t * s.topk + k;
    }
}

void unpack_dispatch_block(const EpShape& s, const uint8_t* rows, const int32_t* counts, int src,
                           const int32_t* begins, void* recv_x, void* recv_extra, int32_t* src_info) {
  const size_t stride = dispatch_row_stride(s);
  const size_t per_expert = static_cast<size_t>(s.world) * s.max_tokens;
  auto* out = static_cast<uint8_t*>(recv_x);
  auto* extra = static_cast<uint8_t*>(recv_extra);
  const uint8_t* p = rows;
  for (int l = 0; l < s.local_experts; l++)
    for (int32_t i = 0; i < counts[l]; i++, p += stride) {
      const size_t r = static_cast<size_t>(l) * per_expert + static_cast<size_t>(begins[l] + i);
      memcpy(out + r * s.row_bytes, p + kEpTagBytes, s.row_bytes);
      if (extra && s.extra_bytes) memcpy(extra + r * s.extra_bytes, p + kEpTagBytes + s.row_bytes, s.extra_bytes);
      src_info[2 * r] = src;
      src_info[2 * r + 1] = get<int32_t>(p, 0);
    }
}

uint32_t pack_combine_block(const EpShape& s, const void* y, int src, const int32_t* layout_range, uint8_t* rows) {
  const size_t stride = combine_row_stride(s);
  const size_t per_expert = static_cast<size_t>(s.world) * s.max_tokens;
  const auto* yb = static_cast<const uint8_t*>(y);
  uint32_t n = 0;
  for (int l = 0; l < s.local_experts; l++) {
    const int32_t begin = layout_range[2 * (l * s.world + src)];
    const int32_t count = layout_range[2 * (l * s.world + src) + 1];
    for (int32_t i = 0; i < count; i++, n++) {
      const size_t r = static_cast<size_t>(l) * per_expert + static_cast<size_t>(begin + i);
      memcpy(rows + n * stride, yb + r * s.row_bytes, s.row_bytes);
    }
  }
  return n;
}

void reduce_combine_block(const EpShape& s, const uint8_t* rows, uint32_t nrows, const int32_t* send_map_d,
                          const float* topk_weights, float* acc) {
  const size_t stride = combine_row_stride(s);
  const int H = s.hidden;
  for (uint32_t i = 0; i < nrows; i++) {
    const int32_t tk = send_map_d[i];
    const float w = topk_weights[tk];
    float* a = acc + static_cast<size_t>(tk / s.topk) * H;
    const uint8_t* p = rows + i * stride;
    if (s.dtype == DType::kFloat32) {
      for (int h = 0; h < H; h++) a[h] += w * get<float>(p, 4 * static_cast<size_t>(h));
    } else {
      for (int h = 0; h < H; h++) a[h] += w * bf16_to_float(get<uint16_t>(p, 2 * static_cast<size_t>(h)));
    }
  }
}

void finish_combine(const EpShape& s, const float* acc, const uint8_t* routed, int tokens, void* out, bool accumulate) {
  const int H = s.hidden;
  for (int t = 0; t < tokens; t++) {
    const float* a = acc + static_cast<size_t>(t) * H;
    if (!routed[t] && accumulate) continue;
    if (s.dtype == DType::kFloat32) {
      float* o = static_cast<float*>(out) + static_cast<size_t>(t) * H;
      for (int h = 0; h < H; h++) o[h] = (accumulate ? o[h] : 0.0f) + (routed[t] ? a[h] : 0.0f);
    } else {
      uint16_t* o = static_cast<uint16_t*>(out) + static_cast<size_t>(t) * H;
      for (int h = 0; h < H; h++)
        o[h] = float_to_bf16((accumulate ? bf16_to_float(o[h]) : 0.0f) + (routed[t] ? a[h] : 0.0f));
    }
  }
}

}  // namespace ponte
