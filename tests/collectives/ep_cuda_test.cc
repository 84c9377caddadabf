// The CUDA kernels against the host layout functions on the same inputs (3 simulated ranks on one
// GPU): dispatch rows and send_map byte for byte, unpacked rows and src_info, combine sums within
// float tolerance (atomics sum in any order), and the host-pinned flag signals. Needs a GPU: run by
// scripts/ep-gpu-check, not by ctest (no GPU on the CI machines).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "collectives/cuda/ep_kernels.h"

using namespace ponte;

namespace {

template <typename T>
T* dev(const std::vector<T>& h) {
  T* d = nullptr;
  if (cudaMalloc(&d, std::max<size_t>(h.size(), 1) * sizeof(T)) != cudaSuccess) return nullptr;
  cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice);
  return d;
}
template <typename T>
std::vector<T> host(const T* d, size_t n) {
  std::vector<T> h(n);
  cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost);
  return h;
}

class EpCuda : public ::testing::Test {
 protected:
  void SetUp() override {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) GTEST_SKIP() << "NO GPU: the CUDA kernels were not run";
  }
};

TEST_F(EpCuda, DispatchAndCombineMatchTheHostLayout) {
  const int W = 3, E = 6, T = 7, H = 40, K = 3;
  for (DType d : {DType::kFloat32, DType::kBFloat16}) {
    EpShape s = make_ep_shape(W, E, T, H, K, d, 0);
    const int L = s.local_experts;
    const size_t stride = dispatch_row_stride(s), maxr = max_rows_per_block(s), hdr = ep_header_bytes(L);
    const size_t tag = dispatch_tag_bytes(s), block = hdr + max_dispatch_rows(s) * stride;
    for (int r = 0; r < W; r++) {
      std::vector<int64_t> idx;
      std::vector<float> w;
      for (int t = 0; t < T; t++)
        for (int k = 0; k < K; k++) {
          int64_t e = (r * 5 + t * 3 + k * 7) % (E + 1) - 1;
          if (t == 2 && k == 1) e = idx[static_cast<size_t>(t) * K];  // a duplicate
          idx.push_back(e);
          w.push_back(0.25f * (k + 1));
        }
      std::vector<uint8_t> x(static_cast<size_t>(T) * s.row_bytes);
      for (size_t i = 0; i < x.size(); i++) x[i] = static_cast<uint8_t>(i * 7 + r);
      if (d == DType::kBFloat16)  // keep values finite
        for (size_t i = 1; i < x.size(); i += 2) x[i] &= 0x3f;
      else
        for (size_t i = 3; i < x.size(); i += 4) x[i] &= 0x3f;
      // Host reference.
      std::vector<int32_t> counts(W * L), cursor(W * L), token_row(W), map_h(W * maxr, -1);
      std::vector<uint32_t> rows_h(W);
      count_routes(s, idx.data(), T, counts.data());
      std::vector<std::vector<uint8_t>> blocks_h(W, std::vector<uint8_t>(max_dispatch_rows(s) * stride));
      std::vector<uint8_t*> at(W);
      for (int q = 0; q < W; q++) at[q] = blocks_h[q].data();
      pack_dispatch(s, x.data(), nullptr, idx.data(), T, counts.data(), at.data(), cursor.data(), token_row.data(),
                    map_h.data(), rows_h.data());
      // Device.
      int64_t* d_idx = dev(idx);
      uint8_t* d_x = dev(x);
      int32_t *d_counts = nullptr, *d_cursor = nullptr, *d_map = nullptr, *d_token_row = nullptr, *d_rows = nullptr;
      uint8_t* d_blocks = nullptr;
      cudaMalloc(&d_counts, 4 * W * L);
      cudaMalloc(&d_cursor, 4 * W * L);
      cudaMalloc(&d_map, 4 * W * maxr);
      cudaMalloc(&d_token_row, 4 * T * W);
      cudaMalloc(&d_rows, 4 * W);
      cudaMalloc(&d_blocks, block * W);
      ASSERT_EQ(cuda::ep_count_routes(s, d_idx, T, d_counts, nullptr), 0);
      EXPECT_EQ(host(d_counts, W * L), counts);
      ASSERT_EQ(cuda::ep_pack_dispatch(s, d_x, d_idx, T, d_counts, d_blocks, block, hdr, d_cursor, d_token_row, d_map,
                                       d_rows, nullptr),
                0);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      auto blocks_d = host(d_blocks, block * W);
      auto map_d = host(d_map, W * maxr);
      auto rows_d = host(d_rows, W);
      for (int q = 0; q < W; q++) {  // the same rows, byte for byte (tag entries and row), the same send_map
        ASSERT_EQ(static_cast<uint32_t>(rows_d[q]), rows_h[q]) << "rank " << r << " destination " << q;
        for (uint32_t i = 0; i < rows_h[q]; i++) {
          const uint8_t* ph = blocks_h[q].data() + i * stride;
          const uint8_t* pd = blocks_d.data() + q * block + hdr + i * stride;
          EXPECT_EQ(memcmp(ph, pd, 8 + 4 * static_cast<size_t>(K)), 0) << "tag of row " << i << " to " << q;
          EXPECT_EQ(memcmp(ph + tag, pd + tag, s.row_bytes), 0) << "row " << i << " to " << q;
        }
        int entries = 0;
        for (int l = 0; l < L; l++) entries += counts[q * L + l];
        for (int i = 0; i < entries; i++) EXPECT_EQ(map_d[q * maxr + i], map_h[q * maxr + i]) << "send_map " << q << " " << i;
      }
      // Unpack each destination's block from this source alone (begins 0) on both; compare.
      const size_t per = static_cast<size_t>(W) * T;
      for (int q = 0; q < W; q++) {
        std::vector<int32_t> begins(L, 0), cur(L), info_h(L * per * 2, -1);
        std::vector<uint8_t> rx_h(L * per * s.row_bytes, 0);
        ASSERT_TRUE(unpack_dispatch_block(s, blocks_h[q].data(), rows_h[q], &counts[q * L], r, begins.data(), rx_h.data(),
                                          nullptr, info_h.data(), cur.data())
                        .ok());
        int32_t* d_begins = dev(begins);
        int32_t* d_qcounts = dev(std::vector<int32_t>(counts.begin() + q * L, counts.begin() + (q + 1) * L));
        int32_t* d_info = dev(info_h);  // the same -1s; the copies overwrite theirs
        std::vector<int32_t> pos_init(static_cast<size_t>(T) * K, -1);
        int32_t* d_pos = dev(pos_init);
        std::vector<uint8_t> zero(rx_h.size(), 0);
        uint8_t* d_rx = dev(zero);
        ASSERT_EQ(cuda::ep_unpack_dispatch_block(s, d_blocks + q * block + hdr, rows_h[q], d_qcounts, r, d_begins, d_rx,
                                                 d_info, d_pos, nullptr),
                  0);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        for (int l = 0; l < L; l++)
          for (int i = 0; i < counts[q * L + l]; i++) {
            const size_t row = l * per + i;
            EXPECT_EQ(memcmp(host(d_rx + row * s.row_bytes, s.row_bytes).data(), rx_h.data() + row * s.row_bytes,
                             s.row_bytes), 0) << "recv row " << row;
          }
        auto info_d = host(d_info, info_h.size());
        EXPECT_EQ(info_d, info_h);
        cudaFree(d_begins), cudaFree(d_qcounts), cudaFree(d_info), cudaFree(d_pos), cudaFree(d_rx);
      }
      // Combine on the device with y = the rows sent (an expert returning its input): out = x * sum(w).
      std::vector<float> acc_h(static_cast<size_t>(T) * H, 0.0f);
      float* d_acc = dev(acc_h);
      float* d_w = dev(w);
      for (int q = 0; q < W; q++) {
        uint32_t rows = 0;
        for (int l = 0; l < L; l++) rows += counts[q * L + l];
        std::vector<uint8_t> crow(maxr * combine_row_stride(s));
        for (uint32_t i = 0; i < rows; i++)  // copy i answers (t, k) = send_map[i]: x[t]
          memcpy(crow.data() + i * combine_row_stride(s), x.data() + static_cast<size_t>(map_h[q * maxr + i] / K) * s.row_bytes,
                 s.row_bytes);
        reduce_combine_block(s, crow.data(), rows, &map_h[q * maxr], w.data(), acc_h.data());
        uint8_t* d_crow = dev(crow);
        ASSERT_EQ(cuda::ep_reduce_combine_block(s, d_crow, rows, d_map + q * maxr, d_w, d_acc, nullptr), 0);
        cudaDeviceSynchronize();
        cudaFree(d_crow);
      }
      auto acc_d = host(d_acc, acc_h.size());
      for (size_t i = 0; i < acc_h.size(); i++) EXPECT_NEAR(acc_d[i], acc_h[i], 1e-3 * (1 + std::abs(acc_h[i])));
      cudaFree(d_idx), cudaFree(d_x), cudaFree(d_counts), cudaFree(d_cursor), cudaFree(d_map), cudaFree(d_blocks);
      cudaFree(d_token_row), cudaFree(d_rows);
      cudaFree(d_acc), cudaFree(d_w);
    }
  }
}

TEST_F(EpCuda, HostFlagSignals) {
  uint32_t* flag = nullptr;
  ASSERT_EQ(cudaHostAlloc(&flag, 8, cudaHostAllocMapped), cudaSuccess);
  flag[0] = 0;
  flag[1] = 0;
  uint32_t *dflag = nullptr;
  cudaHostGetDevicePointer(&dflag, flag, 0);
  cudaStream_t s;
  cudaStreamCreate(&s);
  ASSERT_EQ(cuda::ep_wait_host(dflag + 1, 5, s), 0);  // the stream waits for the "proxy"
  ASSERT_EQ(cuda::ep_signal_host(dflag, 7, s), 0);    // then tells the host
  usleep(20000);
  EXPECT_EQ(__atomic_load_n(&flag[0], __ATOMIC_ACQUIRE), 0u) << "the stream did not wait for the host flag";
  __atomic_store_n(&flag[1], 5, __ATOMIC_RELEASE);
  for (int i = 0; i < 2000 && __atomic_load_n(&flag[0], __ATOMIC_ACQUIRE) != 7; i++) usleep(1000);
  EXPECT_EQ(__atomic_load_n(&flag[0], __ATOMIC_ACQUIRE), 7u);
  cudaStreamSynchronize(s);
  cudaStreamDestroy(s);
  cudaFreeHost(flag);
}

}  // namespace
