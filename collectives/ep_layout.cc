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
size_t dispatch_tag_bytes(const EpShape& s) { return align_up(8 + 4 * static_cast<size_t>(s.topk), 16); }
size_t dispatch_row_stride(const EpShape& s) {
  return align_up(dispatch_tag_bytes(s) + s.row_bytes + s.extra_bytes, 16);
}
size_t combine_row_stride(const EpShape& s) { return align_up(s.row_bytes, 16); }
size_t max_dispatch_rows(const EpShape& s) { return static_cast<size_t>(s.max_tokens); }
size_t max_rows_per_block(const EpShape& s) {
  return static_cast<size_t>(s.max_tokens) * static_cast<size_t>(std::min(s.topk, s.local_experts));
}
size_t dispatch_block_bytes(const EpShape& s) {
  return ep_header_bytes(s.local_experts) + max_dispatch_rows(s) * dispatch_row_stride(s);
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
  put<uint32_t>(p, 28, h.entries);
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
  h->entries = get<uint32_t>(p, 28);
  if (h->seq != seq) return Status(Code::kInvalidArgument, "block of call %u, expected %u", h->seq, seq);
  const size_t max_rows = phase == kEpPhaseDispatch ? max_dispatch_rows(s) : max_rows_per_block(s);
  if (h->rows > max_rows) return Status(Code::kInvalidArgument, "block of %u rows, at most %zu fit", h->rows, max_rows);
  if (phase == kEpPhaseCombine ? h->entries != h->rows
                               : h->entries < h->rows || h->entries > static_cast<uint64_t>(h->rows) * s.topk)
    return Status(Code::kInvalidArgument, "block of %u rows carries %u routed copies", h->rows, h->entries);
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
  if (sum != h->entries)
    return Status(Code::kInvalidArgument, "block counts add up to %llu, header says %u routed copies",
                  static_cast<unsigned long long>(sum), h->entries);
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
                   const int32_t* counts, uint8_t* const* blocks, int32_t* cursor, int32_t* token_row,
                   int32_t* send_map, uint32_t* rows_out, int tags_only) {
  const int L = s.local_experts, K = s.topk;
  const size_t stride = dispatch_row_stride(s), tag = dispatch_tag_bytes(s);
  const size_t max_rows = max_rows_per_block(s);
  for (int d = 0; d < s.world; d++) {  // cursor: the next copy of (d, l) in d's unpack order
    int32_t at = 0;
    for (int l = 0; l < L; l++) {
      cursor[d * L + l] = at;
      at += counts[d * L + l];
    }
    rows_out[d] = 0;
    token_row[d] = -1;
  }
  const auto* xb = static_cast<const uint8_t*>(x);
  const auto* eb = static_cast<const uint8_t*>(x_extra);
  for (int t = 0; t < tokens; t++) {
    for (int k = 0; k < K; k++) {
      const int64_t e = topk_idx[static_cast<size_t>(t) * K + k];
      if (e < 0) continue;
      const int d = static_cast<int>(e / L);
      if (token_row[d] < 0) {  // the token's first copy to d: its row
        token_row[d] = static_cast<int32_t>(rows_out[d]++);
        uint8_t* p = blocks[d] + static_cast<size_t>(token_row[d]) * stride;
        put<int32_t>(p, 0, t);
        put<int32_t>(p, 4, 0);
        memset(p + 8, 0xff, 4 * static_cast<size_t>(K));  // -1 after the experts named
        if (d != tags_only) {  // tags_only's unpack reads x[t] itself
          memcpy(p + tag, xb + static_cast<size_t>(t) * s.row_bytes, s.row_bytes);
          if (s.extra_bytes && eb)
            memcpy(p + tag + s.row_bytes, eb + static_cast<size_t>(t) * s.extra_bytes, s.extra_bytes);
        }
      }
      uint8_t* p = blocks[d] + static_cast<size_t>(token_row[d]) * stride;
      const int32_t n = get<int32_t>(p, 4);
      put<int32_t>(p, 8 + 4 * static_cast<size_t>(n), static_cast<int32_t>(e % L));
      put<int32_t>(p, 4, n + 1);
      send_map[static_cast<size_t>(d) * max_rows + cursor[e]++] = t * K + k;  // e = d * L + l
    }
    for (int k = 0; k < K; k++) {
      const int64_t e = topk_idx[static_cast<size_t>(t) * K + k];
      if (e >= 0) token_row[e / L] = -1;
    }
  }
}

Status unpack_dispatch_block(const EpShape& s, const uint8_t* rows, uint32_t nrows, const int32_t* counts, int src,
                             const int32_t* begins, void* recv_x, void* recv_extra, int32_t* src_info,
                             int32_t* cursor, const void* x, int x_tokens) {
  const int L = s.local_experts, K = s.topk;
  if (x && s.extra_bytes)  // x holds the rows only: a tags-only block would lose the extra bytes
    return Status(Code::kInvalidArgument, "a block with %zu extra bytes per row cannot be unpacked from x", s.extra_bytes);
  const size_t stride = dispatch_row_stride(s), tag = dispatch_tag_bytes(s);
  const size_t per_expert = static_cast<size_t>(s.world) * s.max_tokens;
  auto* out = static_cast<uint8_t*>(recv_x);
  auto* extra = static_cast<uint8_t*>(recv_extra);
  std::fill(cursor, cursor + L, 0);
  for (uint32_t i = 0; i < nrows; i++) {
    const uint8_t* p = rows + static_cast<size_t>(i) * stride;
    const int32_t t = get<int32_t>(p, 0), n = get<int32_t>(p, 4);
    if (t < 0 || t >= s.max_tokens)
      return Status(Code::kInvalidArgument, "dispatch row %u names token %d (max_tokens %d)", i, t, s.max_tokens);
    if (x && t >= x_tokens)
      return Status(Code::kInvalidArgument, "dispatch row %u names token %d of x's %d", i, t, x_tokens);
    // The row's data: in the block after its tag, or (a block packed with tags_only) in x.
    const uint8_t* data = x ? static_cast<const uint8_t*>(x) + static_cast<size_t>(t) * s.row_bytes : p + tag;
    if (n < 1 || n > K)
      return Status(Code::kInvalidArgument, "dispatch row %u names %d experts (1..%d)", i, n, K);
    for (int j = 0; j < n; j++) {
      const int32_t l = get<int32_t>(p, 8 + 4 * static_cast<size_t>(j));
      if (l < 0 || l >= L) return Status(Code::kInvalidArgument, "dispatch row %u names local expert %d (0..%d)", i, l, L - 1);
      if (cursor[l] >= counts[l])
        return Status(Code::kInvalidArgument, "dispatch rows carry more copies for local expert %d than the %d counted", l,
                      counts[l]);
      const size_t r = static_cast<size_t>(l) * per_expert + static_cast<size_t>(begins[l] + cursor[l]++);
      memcpy(out + r * s.row_bytes, data, s.row_bytes);
      if (extra && s.extra_bytes) memcpy(extra + r * s.extra_bytes, p + tag + s.row_bytes, s.extra_bytes);
      src_info[2 * r] = src;
      src_info[2 * r + 1] = t;
    }
  }
  for (int l = 0; l < L; l++)
    if (cursor[l] != counts[l])
      return Status(Code::kInvalidArgument, "dispatch rows carry %d copies for local expert %d, %d counted", cursor[l], l,
                    counts[l]);
  return Status::Ok();
}

uint32_t pack_combine_block(const EpShape& s, const void* y, int src, const int32_t* layout_range, uint8_t* rows) {
  const size_t stride = combine_row_stride(s);
  return for_each_combine_row(s, y, src, layout_range,
                              [&](uint32_t n, const uint8_t* row) { memcpy(rows + n * stride, row, s.row_bytes); });
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

namespace {
// The body of combine_tokens, instantiated twice below: for the baseline ISA and for AVX2 + FMA
// (picked once at run time), since the host path's combine is bound by these loops. Columns go 32
// at a time in four 8-float vectors (GCC/clang vector extensions) that stay in registers while
// every routed row of the token is added, so each row is read once and the sum never touches
// memory; the columns past the last multiple of 32 go one by one.
typedef float V8f __attribute__((vector_size(32)));
typedef uint32_t V8u __attribute__((vector_size(32)));
typedef uint16_t V8h __attribute__((vector_size(16)));
constexpr int kCols = 32;

template <bool kBf16>
inline __attribute__((always_inline)) void load8(const uint8_t* p, V8f& f) {  // by reference: no vector ABI
  if constexpr (kBf16) {
    V8h h;
    memcpy(&h, p, sizeof h);
    V8u u = __builtin_convertvector(h, V8u) << 16;
    memcpy(&f, &u, sizeof f);
  } else {
    memcpy(&f, p, sizeof f);
  }
}

template <bool kBf16>
inline __attribute__((always_inline)) void store8(uint8_t* p, V8f& f, bool accumulate) {
  if (accumulate) {
    V8f prev;
    load8<kBf16>(p, prev);
    f += prev;
  }
  if constexpr (kBf16) {  // float_to_bf16, eight at a time
    V8u u;
    memcpy(&u, &f, sizeof u);
    const V8u rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const V8u quiet = (u >> 16) | 0x40u;
    const V8u nan = (u & 0x7fffffffu) > 0x7f800000u;  // all ones where NaN
    const V8h h = __builtin_convertvector((quiet & nan) | (rounded & ~nan), V8h);
    memcpy(p, &h, sizeof h);
  } else {
    memcpy(p, &f, sizeof f);
  }
}

template <bool kBf16>
inline __attribute__((always_inline)) void combine_tokens_body(const EpShape& s, const uint8_t* const* row_of,
                                                               const float* topk_weights, const uint8_t* routed,
                                                               int tokens, void* out, bool accumulate) {
  const int H = s.hidden, K = s.topk;
  constexpr size_t eb = kBf16 ? 2 : 4;
  for (int t = 0; t < tokens; t++) {
    if (!routed[t] && accumulate) continue;
    const uint8_t* const* rows = row_of + static_cast<size_t>(t) * K;
    const float* w = topk_weights + static_cast<size_t>(t) * K;
    uint8_t* o = static_cast<uint8_t*>(out) + static_cast<size_t>(t) * H * eb;
    int h0 = 0;
    for (; h0 + kCols <= H; h0 += kCols) {
      V8f a0 = {}, a1 = {}, a2 = {}, a3 = {};
      for (int k = 0; k < K; k++) {
        if (!rows[k]) continue;
        const uint8_t* p = rows[k] + eb * static_cast<size_t>(h0);
        const float wk = w[k];
        V8f v0, v1, v2, v3;
        load8<kBf16>(p, v0);
        load8<kBf16>(p + 8 * eb, v1);
        load8<kBf16>(p + 16 * eb, v2);
        load8<kBf16>(p + 24 * eb, v3);
        a0 += wk * v0;
        a1 += wk * v1;
        a2 += wk * v2;
        a3 += wk * v3;
      }
      uint8_t* q = o + eb * static_cast<size_t>(h0);
      store8<kBf16>(q, a0, accumulate);
      store8<kBf16>(q + 8 * eb, a1, accumulate);
      store8<kBf16>(q + 16 * eb, a2, accumulate);
      store8<kBf16>(q + 24 * eb, a3, accumulate);
    }
    for (; h0 < H; h0++) {
      float a = 0.0f;
      for (int k = 0; k < K; k++) {
        if (!rows[k]) continue;
        float v;
        if constexpr (kBf16) {
          uint16_t u;
          memcpy(&u, rows[k] + 2 * static_cast<size_t>(h0), 2);
          v = bf16_to_float(u);
        } else {
          memcpy(&v, rows[k] + 4 * static_cast<size_t>(h0), 4);
        }
        a += w[k] * v;
      }
      if constexpr (kBf16) {
        uint16_t u;
        memcpy(&u, o + 2 * static_cast<size_t>(h0), 2);
        u = float_to_bf16((accumulate ? bf16_to_float(u) : 0.0f) + a);
        memcpy(o + 2 * static_cast<size_t>(h0), &u, 2);
      } else {
        float v;
        memcpy(&v, o + 4 * static_cast<size_t>(h0), 4);
        v = (accumulate ? v : 0.0f) + a;
        memcpy(o + 4 * static_cast<size_t>(h0), &v, 4);
      }
    }
  }
}

using CombineFn = void (*)(const EpShape&, const uint8_t* const*, const float*, const uint8_t*, int, void*, bool);

void combine_tokens_base(const EpShape& s, const uint8_t* const* row_of, const float* topk_weights,
                         const uint8_t* routed, int tokens, void* out, bool accumulate) {
  if (s.dtype == DType::kBFloat16) combine_tokens_body<true>(s, row_of, topk_weights, routed, tokens, out, accumulate);
  else combine_tokens_body<false>(s, row_of, topk_weights, routed, tokens, out, accumulate);
}

#if defined(__x86_64__)
__attribute__((target("avx2,fma"))) void combine_tokens_avx2(const EpShape& s, const uint8_t* const* row_of,
                                                             const float* topk_weights, const uint8_t* routed,
                                                             int tokens, void* out, bool accumulate) {
  if (s.dtype == DType::kBFloat16) combine_tokens_body<true>(s, row_of, topk_weights, routed, tokens, out, accumulate);
  else combine_tokens_body<false>(s, row_of, topk_weights, routed, tokens, out, accumulate);
}
#endif

CombineFn pick_combine() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return combine_tokens_avx2;
#endif
  return combine_tokens_base;
}
}  // namespace

void combine_tokens(const EpShape& s, const uint8_t* const* row_of, const float* topk_weights, const uint8_t* routed,
                    int tokens, void* out, bool accumulate) {
  static const CombineFn fn = pick_combine();
  fn(s, row_of, topk_weights, routed, tokens, out, accumulate);
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
