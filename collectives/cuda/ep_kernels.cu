// ep_kernels: CUDA kernels mirroring collectives/ep_layout.cc (same block layout, same tags), so a
// GPU-resident EpBuffer packs, unpacks and reduces on the device while the CPU proxy drives the engine.
#include <cuda_runtime.h>

#include "collectives/cuda/ep_kernels.h"

namespace ponte::cuda {

namespace {

struct DevShape {  // what the kernels need of an EpShape, by value
  int world, experts, local_experts, max_tokens, hidden, topk;
  int bf16;
  size_t row_bytes, extra_bytes, dispatch_tag, dispatch_stride, combine_stride, max_rows;
};

DevShape dev_shape(const EpShape& s) {
  DevShape d;
  d.world = s.world;
  d.experts = s.experts;
  d.local_experts = s.local_experts;
  d.max_tokens = s.max_tokens;
  d.hidden = s.hidden;
  d.topk = s.topk;
  d.bf16 = s.dtype == DType::kBFloat16;
  d.row_bytes = s.row_bytes;
  d.extra_bytes = s.extra_bytes;
  d.dispatch_tag = dispatch_tag_bytes(s);
  d.dispatch_stride = dispatch_row_stride(s);
  d.combine_stride = combine_row_stride(s);
  d.max_rows = max_rows_per_block(s);
  return d;
}

__device__ inline float load_elem(const uint8_t* p, int bf16, int h) {
  if (bf16) {
    uint32_t u = static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[h]) << 16;
    return __uint_as_float(u);
  }
  return reinterpret_cast<const float*>(p)[h];
}
__device__ inline uint16_t to_bf16(float f) {  // round to nearest even, as float_to_bf16
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// Copies n bytes with 16-byte vectors where both ends allow it (rows are 16-byte aligned in blocks).
__device__ inline void copy_bytes(uint8_t* dst, const uint8_t* src, size_t n, int lane, int lanes) {
  if (((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | n) & 15) == 0) {
    const uint4* s4 = reinterpret_cast<const uint4*>(src);
    uint4* d4 = reinterpret_cast<uint4*>(dst);
    for (size_t i = lane; i < n / 16; i += lanes) d4[i] = s4[i];
  } else {
    for (size_t i = lane; i < n; i += lanes) dst[i] = src[i];
  }
}

__global__ void count_kernel(const int64_t* idx, size_t n, int32_t* counts) {
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    int64_t e = idx[i];
    if (e >= 0) atomicAdd(&counts[e], 1);
  }
}

// One thread per destination d: numbers d's rows (one per token routing to d, in token order) and
// its copies per expert in (t, k) order, as the host's pack_dispatch does.
__global__ void plan_pack_kernel(DevShape s, const int64_t* idx, int tokens, const int32_t* counts, int32_t* cursor,
                                 int32_t* token_row, int32_t* send_map, int32_t* rows_out) {
  const int d = blockIdx.x * blockDim.x + threadIdx.x;
  if (d >= s.world) return;
  const int L = s.local_experts;
  int32_t at = 0;
  for (int l = 0; l < L; l++) {
    cursor[d * L + l] = at;
    at += counts[d * L + l];
  }
  int32_t rows = 0;
  for (int t = 0; t < tokens; t++) {
    bool hit = false;
    for (int k = 0; k < s.topk; k++) {
      const int64_t e = idx[static_cast<size_t>(t) * s.topk + k];
      if (e < 0 || e / L != d) continue;
      hit = true;
      send_map[static_cast<size_t>(d) * s.max_rows + cursor[e]++] = t * s.topk + k;
    }
    token_row[static_cast<size_t>(t) * s.world + d] = hit ? rows++ : -1;
  }
  rows_out[d] = rows;
}

// One block per (token, destination): the tag (token, n, the local experts in k order, -1 after)
// and the row.
__global__ void pack_kernel(DevShape s, const uint8_t* x, const int64_t* idx, uint8_t* base, size_t block_stride,
                            size_t block_offset, const int32_t* token_row) {
  const int t = blockIdx.x / s.world, d = blockIdx.x % s.world;
  const int32_t row = token_row[static_cast<size_t>(t) * s.world + d];
  if (row < 0) return;
  uint8_t* p = base + block_stride * d + block_offset + static_cast<size_t>(row) * s.dispatch_stride;
  if (threadIdx.x == 0) {
    int32_t* tag = reinterpret_cast<int32_t*>(p);
    int32_t n = 0;
    for (int k = 0; k < s.topk; k++) {
      const int64_t e = idx[static_cast<size_t>(t) * s.topk + k];
      if (e >= 0 && e / s.local_experts == d) tag[2 + n++] = static_cast<int32_t>(e % s.local_experts);
    }
    for (int j = n; j < s.topk; j++) tag[2 + j] = -1;
    tag[0] = t;
    tag[1] = n;
  }
  copy_bytes(p + s.dispatch_tag, x + static_cast<size_t>(t) * s.row_bytes, s.row_bytes, threadIdx.x, blockDim.x);
}

// One thread per local expert l: numbers l's copies in this block in (row, entry) order.
__global__ void plan_unpack_kernel(DevShape s, const uint8_t* rows, uint32_t nrows, int32_t* pos) {
  const int l = blockIdx.x * blockDim.x + threadIdx.x;
  if (l >= s.local_experts) return;
  int32_t c = 0;
  for (uint32_t i = 0; i < nrows; i++) {
    const int32_t* tag = reinterpret_cast<const int32_t*>(rows + static_cast<size_t>(i) * s.dispatch_stride);
    const int32_t n = min(max(tag[1], 0), s.topk);
    for (int j = 0; j < n; j++)
      if (tag[2 + j] == l) pos[static_cast<size_t>(i) * s.topk + j] = c++;
  }
}

// One block per row: copies it to each expert its tag names.
__global__ void unpack_kernel(DevShape s, const uint8_t* rows, const int32_t* counts, int src, const int32_t* begins,
                              const int32_t* pos, uint8_t* recv_x, int32_t* src_info) {
  const int i = blockIdx.x;
  const uint8_t* p = rows + static_cast<size_t>(i) * s.dispatch_stride;
  const int32_t* tag = reinterpret_cast<const int32_t*>(p);
  const int32_t t = tag[0], n = min(max(tag[1], 0), s.topk);
  if (t < 0 || t >= s.max_tokens) return;
  for (int j = 0; j < n; j++) {
    const int32_t l = tag[2 + j];
    if (l < 0 || l >= s.local_experts) continue;
    const int32_t at = pos[static_cast<size_t>(i) * s.topk + j];
    if (at < 0 || at >= counts[l]) continue;
    const size_t r = static_cast<size_t>(l) * s.world * s.max_tokens + begins[l] + at;
    copy_bytes(recv_x + r * s.row_bytes, p + s.dispatch_tag, s.row_bytes, threadIdx.x, blockDim.x);
    if (threadIdx.x == 0) {
      src_info[2 * r] = src;
      src_info[2 * r + 1] = t;
    }
  }
}

__global__ void pack_combine_kernel(DevShape s, const uint8_t* y, int src, const int32_t* layout, uint8_t* rows) {
  const int n = blockIdx.x;
  int l = 0, first = 0;
  while (l < s.local_experts && n >= first + layout[2 * (l * s.world + src) + 1]) first += layout[2 * (l * s.world + src) + 1], l++;
  if (l >= s.local_experts) return;
  const size_t r = static_cast<size_t>(l) * s.world * s.max_tokens + layout[2 * (l * s.world + src)] + (n - first);
  copy_bytes(rows + static_cast<size_t>(n) * s.combine_stride, y + r * s.row_bytes, s.row_bytes, threadIdx.x, blockDim.x);
}

__global__ void reduce_kernel(DevShape s, const uint8_t* rows, const int32_t* send_map_d, const float* w, float* acc) {
  const int i = blockIdx.x;
  const int32_t tk = send_map_d[i];
  const float wt = w[tk];
  float* a = acc + static_cast<size_t>(tk / s.topk) * s.hidden;
  const uint8_t* p = rows + static_cast<size_t>(i) * s.combine_stride;
  for (int h = threadIdx.x; h < s.hidden; h += blockDim.x) atomicAdd(&a[h], wt * load_elem(p, s.bf16, h));
}

__global__ void finish_kernel(DevShape s, const float* acc, const uint8_t* routed, uint8_t* out, int accumulate) {
  const int t = blockIdx.x;
  if (!routed[t] && accumulate) return;
  const float* a = acc + static_cast<size_t>(t) * s.hidden;
  for (int h = threadIdx.x; h < s.hidden; h += blockDim.x) {
    const size_t i = static_cast<size_t>(t) * s.hidden + h;
    const float add = routed[t] ? a[h] : 0.0f;
    if (s.bf16) {
      uint16_t* o = reinterpret_cast<uint16_t*>(out);
      float prev = accumulate ? __uint_as_float(static_cast<uint32_t>(o[i]) << 16) : 0.0f;
      o[i] = to_bf16(prev + add);
    } else {
      float* o = reinterpret_cast<float*>(out);
      o[i] = (accumulate ? o[i] : 0.0f) + add;
    }
  }
}

__global__ void signal_kernel(volatile uint32_t* flag, uint32_t value) {
  __threadfence_system();  // everything the stream wrote before is visible to the host first
  *flag = value;
}

__global__ void wait_kernel(const volatile uint32_t* flag, uint32_t value) {
  while (*flag < value) __nanosleep(200);
  __threadfence_system();
}

int threads_for(size_t bytes) { return bytes >= 4096 ? 256 : bytes >= 1024 ? 128 : 64; }
cudaStream_t st(void* s) { return static_cast<cudaStream_t>(s); }
int last() { return static_cast<int>(cudaGetLastError()); }

}  // namespace

int ep_count_routes(const EpShape& s, const int64_t* topk_idx, int tokens, int32_t* counts, void* stream) {
  cudaMemsetAsync(counts, 0, sizeof(int32_t) * s.world * s.local_experts, st(stream));
  const size_t n = static_cast<size_t>(tokens) * s.topk;
  if (n) count_kernel<<<static_cast<unsigned>((n + 255) / 256), 256, 0, st(stream)>>>(topk_idx, n, counts);
  return last();
}

int ep_pack_dispatch(const EpShape& s, const void* x, const int64_t* topk_idx, int tokens, const int32_t* counts,
                     uint8_t* blocks_base, size_t block_stride, size_t block_offset, int32_t* cursor, int32_t* token_row,
                     int32_t* send_map, int32_t* rows_out, void* stream) {
  DevShape d = dev_shape(s);
  plan_pack_kernel<<<(s.world + 63) / 64, 64, 0, st(stream)>>>(d, topk_idx, tokens, counts, cursor, token_row, send_map,
                                                                rows_out);
  const size_t n = static_cast<size_t>(tokens) * s.world;
  if (n)
    pack_kernel<<<static_cast<unsigned>(n), threads_for(s.row_bytes), 0, st(stream)>>>(
        d, static_cast<const uint8_t*>(x), topk_idx, blocks_base, block_stride, block_offset, token_row);
  return last();
}

int ep_unpack_dispatch_block(const EpShape& s, const uint8_t* rows, uint32_t nrows, const int32_t* counts, int src,
                             const int32_t* begins, void* recv_x, int32_t* src_info, int32_t* pos, void* stream) {
  if (!nrows) return last();
  DevShape d = dev_shape(s);
  plan_unpack_kernel<<<(s.local_experts + 63) / 64, 64, 0, st(stream)>>>(d, rows, nrows, pos);
  unpack_kernel<<<nrows, threads_for(s.row_bytes), 0, st(stream)>>>(d, rows, counts, src, begins, pos,
                                                                     static_cast<uint8_t*>(recv_x), src_info);
  return last();
}

int ep_pack_combine_block(const EpShape& s, const void* y, int src, const int32_t* layout_range, uint32_t nrows,
                          uint8_t* rows, void* stream) {
  if (nrows)
    pack_combine_kernel<<<nrows, threads_for(s.row_bytes), 0, st(stream)>>>(dev_shape(s), static_cast<const uint8_t*>(y),
                                                                            src, layout_range, rows);
  return last();
}

int ep_reduce_combine_block(const EpShape& s, const uint8_t* rows, uint32_t nrows, const int32_t* send_map_d,
                            const float* topk_weights, float* acc, void* stream) {
  if (nrows) reduce_kernel<<<nrows, 128, 0, st(stream)>>>(dev_shape(s), rows, send_map_d, topk_weights, acc);
  return last();
}

int ep_finish_combine(const EpShape& s, const float* acc, const uint8_t* routed, int tokens, void* out, bool accumulate,
                      void* stream) {
  if (tokens)
    finish_kernel<<<tokens, 128, 0, st(stream)>>>(dev_shape(s), acc, routed, static_cast<uint8_t*>(out), accumulate ? 1 : 0);
  return last();
}

int ep_signal_host(volatile uint32_t* host_flag, uint32_t value, void* stream) {
  signal_kernel<<<1, 1, 0, st(stream)>>>(host_flag, value);
  return last();
}

int ep_wait_host(const volatile uint32_t* host_flag, uint32_t value, void* stream) {
  wait_kernel<<<1, 1, 0, st(stream)>>>(host_flag, value);
  return last();
}

}  // namespace ponte::cuda
