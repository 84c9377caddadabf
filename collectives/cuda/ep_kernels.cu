// ep_kernels: CUDA kernels mirroring collectives/ep_layout.cc (same block layout, same tags), so a
// GPU-resident EpBuffer packs, unpacks and reduces on the device while the CPU proxy drives the engine.
#include <cuda_runtime.h>

#include "collectives/cuda/ep_kernels.h"

namespace ponte::cuda {

namespace {

struct DevShape {  // what the kernels need of an EpShape, by value
  int world, experts, local_experts, max_tokens, hidden, topk;
  int bf16;
  size_t row_bytes, extra_bytes, dispatch_stride, combine_stride, max_rows;
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

// cursor[d * L + l] = first row of (d, l) in d's block (exclusive scan over l per destination).
__global__ void cursor_kernel(DevShape s, const int32_t* counts, int32_t* cursor) {
  int d = blockIdx.x * blockDim.x + threadIdx.x;
  if (d >= s.world) return;
  int32_t at = 0;
  for (int l = 0; l < s.local_experts; l++) {
    cursor[d * s.local_experts + l] = at;
    at += counts[d * s.local_experts + l];
  }
}

// One block per (t, k): takes a row slot with an atomic, writes the tag, copies the row.
__global__ void pack_kernel(DevShape s, const uint8_t* x, const int64_t* idx, uint8_t* base, size_t block_stride,
                            size_t block_offset, int32_t* cursor, int32_t* send_map) {
  const int tk = blockIdx.x;
  const int t = tk / s.topk, k = tk % s.topk;
  const int64_t e = idx[tk];
  if (e < 0) return;
  __shared__ int32_t row;
  const int d = static_cast<int>(e / s.local_experts);
  if (threadIdx.x == 0) {
    row = atomicAdd(&cursor[e], 1);
    send_map[static_cast<size_t>(d) * s.max_rows + row] = tk;
  }
  __syncthreads();
  uint8_t* p = base + block_stride * d + block_offset + static_cast<size_t>(row) * s.dispatch_stride;
  if (threadIdx.x == 0) {
    reinterpret_cast<int32_t*>(p)[0] = t;
    reinterpret_cast<int32_t*>(p)[1] = k;
  }
  // The row starts 8 bytes in: copy with 8-byte words.
  const uint64_t* src = reinterpret_cast<const uint64_t*>(x + static_cast<size_t>(t) * s.row_bytes);
  uint64_t* dst = reinterpret_cast<uint64_t*>(p + kEpTagBytes);
  if ((s.row_bytes & 7) == 0 && (reinterpret_cast<uintptr_t>(src) & 7) == 0) {
    for (size_t i = threadIdx.x; i < s.row_bytes / 8; i += blockDim.x) dst[i] = src[i];
  } else {
    for (size_t i = threadIdx.x; i < s.row_bytes; i += blockDim.x)
      p[kEpTagBytes + i] = x[static_cast<size_t>(t) * s.row_bytes + i];
  }
}

// One block per row of the source's block; the row's expert is found from the counts.
__global__ void unpack_kernel(DevShape s, const uint8_t* rows, const int32_t* counts, int src, const int32_t* begins,
                              uint8_t* recv_x, int32_t* src_info) {
  const int i = blockIdx.x;
  int l = 0, first = 0;
  while (l < s.local_experts && i >= first + counts[l]) first += counts[l++];
  if (l >= s.local_experts) return;
  const uint8_t* p = rows + static_cast<size_t>(i) * s.dispatch_stride;
  const size_t r = static_cast<size_t>(l) * s.world * s.max_tokens + begins[l] + (i - first);
  copy_bytes(recv_x + r * s.row_bytes, p + kEpTagBytes, s.row_bytes, threadIdx.x, blockDim.x);
  if (threadIdx.x == 0) {
    src_info[2 * r] = src;
    src_info[2 * r + 1] = reinterpret_cast<const int32_t*>(p)[0];
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
                     uint8_t* blocks_base, size_t block_stride, size_t block_offset, int32_t* cursor, int32_t* send_map,
                     void* stream) {
  DevShape d = dev_shape(s);
  cursor_kernel<<<(s.world + 63) / 64, 64, 0, st(stream)>>>(d, counts, cursor);
  const int n = tokens * s.topk;
  if (n)
    pack_kernel<<<n, threads_for(s.row_bytes), 0, st(stream)>>>(d, static_cast<const uint8_t*>(x), topk_idx, blocks_base,
                                                                block_stride, block_offset, cursor, send_map);
  return last();
}

int ep_unpack_dispatch_block(const EpShape& s, const uint8_t* rows, const int32_t* counts, int src, const int32_t* begins,
                             void* recv_x, int32_t* src_info, void* stream) {
  // The row count is the sum of counts, known to the caller from the header on the host side; the
  // grid covers the most a block holds and idle blocks return at once.
  const size_t n = max_rows_per_block(s);
  if (n)
    unpack_kernel<<<static_cast<unsigned>(n), threads_for(s.row_bytes), 0, st(stream)>>>(
        dev_shape(s), rows, counts, src, begins, static_cast<uint8_t*>(recv_x), src_info);
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
