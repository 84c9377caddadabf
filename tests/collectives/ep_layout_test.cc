// ep_layout: block headers (round trip, rejection), routing checks, pack -> unpack -> combine on one
// process with W simulated ranks, and the bf16 conversions.
#include <gtest/gtest.h>

#include <vector>

#include "collectives/ep_layout.h"

using namespace ponte;

TEST(EpLayout, HeaderRoundTripAndRejects) {
  EpShape s = make_ep_shape(4, 8, 16, 32, 2, DType::kFloat32, 0);
  ASSERT_EQ(s.local_experts, 2);
  std::vector<uint8_t> blk(ep_header_bytes(2), 0);
  int32_t counts[2] = {3, 4};
  EpBlockHeader h;
  h.phase = kEpPhaseDispatch;
  h.rows = 7;
  h.seq = 42;
  h.data_imms = 2;
  h.data_bytes = 7 * dispatch_row_stride(s);
  write_block_header(blk.data(), s, h, counts);
  EpBlockHeader got;
  int32_t c[2];
  ASSERT_TRUE(read_block_header(blk.data(), s, kEpPhaseDispatch, 42, &got, c).ok());
  EXPECT_EQ(got.rows, 7u);
  EXPECT_EQ(got.data_imms, 2u);
  EXPECT_EQ(c[0], 3);
  EXPECT_EQ(c[1], 4);
  EXPECT_FALSE(read_block_header(blk.data(), s, kEpPhaseCombine, 42, &got, c).ok());  // phase
  EXPECT_FALSE(read_block_header(blk.data(), s, kEpPhaseDispatch, 43, &got, c).ok());  // stale call
  auto bad = blk;
  bad[0] = 9;  // version
  EXPECT_FALSE(read_block_header(bad.data(), s, kEpPhaseDispatch, 42, &got, c).ok());
  counts[1] = 5;  // counts disagree with rows
  write_block_header(blk.data(), s, h, counts);
  EXPECT_FALSE(read_block_header(blk.data(), s, kEpPhaseDispatch, 42, &got, c).ok());
  counts[0] = 17;  // above max_tokens
  counts[1] = -10;
  write_block_header(blk.data(), s, h, counts);
  EXPECT_FALSE(read_block_header(blk.data(), s, kEpPhaseDispatch, 42, &got, c).ok());
  EpShape other = make_ep_shape(2, 8, 16, 32, 2, DType::kFloat32, 0);  // L = 4
  counts[0] = 3;
  counts[1] = 4;
  write_block_header(blk.data(), s, h, counts);
  std::vector<uint8_t> big(ep_header_bytes(4), 0);
  memcpy(big.data(), blk.data(), blk.size());
  EXPECT_FALSE(read_block_header(big.data(), other, kEpPhaseDispatch, 42, &got, c).ok());
}

TEST(EpLayout, RowBytesAndExtraBytesStayApart) {
  EpShape a = make_ep_shape(2, 4, 8, 128, 2, DType::kBFloat16, 0);
  EpShape b = make_ep_shape(2, 4, 8, 128, 2, DType::kBFloat16, 16);
  EXPECT_EQ(a.row_bytes, 256u);
  EXPECT_EQ(b.row_bytes, 256u);
  EXPECT_EQ(dispatch_row_stride(a), 272u);  // tag 8 + row 256, to 16 bytes
  EXPECT_EQ(dispatch_row_stride(b), 288u);  // tag 8 + row 256 + extra 16, to 16 bytes
  EXPECT_EQ(combine_row_stride(b), 256u);  // combine carries no extra bytes
  EXPECT_EQ(max_rows_per_block(a), 16u);   // 8 tokens x min(K 2, L 2)
}

TEST(EpLayout, RoutingChecks) {
  EpShape s = make_ep_shape(2, 4, 2, 4, 2, DType::kFloat32, 0);
  std::vector<int32_t> scratch(4);
  std::vector<int64_t> ok = {0, -1, 3, 3};
  EXPECT_TRUE(check_routing(s, ok.data(), 2, scratch.data()).ok());
  std::vector<int64_t> high = {0, 4};
  EXPECT_FALSE(check_routing(s, high.data(), 1, scratch.data()).ok());
  std::vector<int64_t> low = {-2, 0};
  EXPECT_FALSE(check_routing(s, low.data(), 1, scratch.data()).ok());
  std::vector<int64_t> dup = {1, 1, 1, 0};  // expert 1 gets 3 rows > max_tokens 2
  EXPECT_FALSE(check_routing(s, dup.data(), 2, scratch.data()).ok());
}

// W simulated ranks in one process: pack every rank's blocks, unpack at every destination, apply an
// expert-dependent function, pack the combine blocks back and reduce; compare with the direct sum.
TEST(EpLayout, PackUnpackCombineRoundTrip) {
  const int W = 3, E = 6, T = 5, H = 8, K = 3;
  for (DType d : {DType::kFloat32, DType::kBFloat16}) {
    EpShape s = make_ep_shape(W, E, T, H, K, d, 0);
    const int L = s.local_experts;
    const size_t per = static_cast<size_t>(W) * T, maxr = max_rows_per_block(s);
    std::vector<std::vector<int64_t>> idx(W);
    std::vector<std::vector<float>> x(W), w(W);
    std::vector<std::vector<uint8_t>> xb(W);
    for (int r = 0; r < W; r++) {
      for (int t = 0; t < T; t++)
        for (int k = 0; k < K; k++) {
          int64_t e = (r * 5 + t * 3 + k * 7) % (E + 1) - 1;  // -1 included
          if (k == 2 && t == 1) e = idx[r][static_cast<size_t>(t) * K];  // a duplicate
          idx[r].push_back(e);
          w[r].push_back(0.25f * static_cast<float>(k + 1));
        }
      xb[r].resize(static_cast<size_t>(T) * s.row_bytes);
      for (int i = 0; i < T * H; i++) {
        float v = static_cast<float>((r * 13 + i) % 17);
        if (d == DType::kFloat32) memcpy(&xb[r][4 * i], &v, 4);
        else {
          uint16_t b = float_to_bf16(v);
          memcpy(&xb[r][2 * i], &b, 2);
        }
      }
      std::vector<int32_t> scratch(E);
      ASSERT_TRUE(check_routing(s, idx[r].data(), T, scratch.data()).ok());
    }
    // Dispatch blocks [src][dst].
    std::vector<std::vector<std::vector<uint8_t>>> blocks(W, std::vector<std::vector<uint8_t>>(W));
    std::vector<std::vector<int32_t>> counts(W, std::vector<int32_t>(W * L)), send_map(W, std::vector<int32_t>(W * maxr, -1));
    for (int r = 0; r < W; r++) {
      count_routes(s, idx[r].data(), T, counts[r].data());
      std::vector<uint8_t*> at(W);
      for (int d2 = 0; d2 < W; d2++) {
        blocks[r][d2].assign(maxr * dispatch_row_stride(s), 0);
        at[d2] = blocks[r][d2].data();
      }
      std::vector<int32_t> cursor(W * L);
      pack_dispatch(s, xb[r].data(), nullptr, idx[r].data(), T, counts[r].data(), at.data(), cursor.data(), send_map[r].data());
    }
    // Unpack at each destination, run experts (y = x * (e + 2)), pack combine blocks.
    std::vector<std::vector<std::vector<uint8_t>>> cblocks(W, std::vector<std::vector<uint8_t>>(W));  // [dst][src]
    for (int me = 0; me < W; me++) {
      std::vector<uint8_t> rx(static_cast<size_t>(L) * per * s.row_bytes, 0xff);
      std::vector<int32_t> info(static_cast<size_t>(L) * per * 2, -1), layout(static_cast<size_t>(L) * W * 2);
      for (int l = 0; l < L; l++)
        for (int r = 0, b = 0; r < W; r++) {
          layout[2 * (l * W + r)] = b;
          layout[2 * (l * W + r) + 1] = counts[r][me * L + l];
          b += counts[r][me * L + l];
        }
      for (int r = 0; r < W; r++) {
        std::vector<int32_t> begins(L);
        for (int l = 0; l < L; l++) begins[l] = layout[2 * (l * W + r)];
        unpack_dispatch_block(s, blocks[r][me].data(), &counts[r][me * L], r, begins.data(), rx.data(), nullptr, info.data());
      }
      std::vector<uint8_t> y(rx.size());
      for (int l = 0; l < L; l++)
        for (size_t i = 0; i < per; i++)
          for (int h = 0; h < H; h++) {
            const size_t at = (l * per + i) * H + h;
            if (info[2 * (l * per + i)] < 0) continue;
            if (d == DType::kFloat32) {
              float v;
              memcpy(&v, &rx[4 * at], 4);
              v *= static_cast<float>(me * L + l + 2);
              memcpy(&y[4 * at], &v, 4);
            } else {
              uint16_t b;
              memcpy(&b, &rx[2 * at], 2);
              b = float_to_bf16(bf16_to_float(b) * static_cast<float>(me * L + l + 2));
              memcpy(&y[2 * at], &b, 2);
            }
          }
      for (int r = 0; r < W; r++) {
        cblocks[me][r].assign(maxr * combine_row_stride(s), 0);
        pack_combine_block(s, y.data(), r, layout.data(), cblocks[me][r].data());
      }
    }
    // Reduce at each source; compare with the direct weighted sum.
    for (int r = 0; r < W; r++) {
      std::vector<float> acc(static_cast<size_t>(T) * H, 0.0f);
      for (int d2 = 0; d2 < W; d2++) {
        uint32_t rows = 0;
        for (int l = 0; l < L; l++) rows += static_cast<uint32_t>(counts[r][d2 * L + l]);
        reduce_combine_block(s, cblocks[d2][r].data(), rows, &send_map[r][d2 * maxr], w[r].data(), acc.data());
      }
      std::vector<uint8_t> routed(T, 0), out(static_cast<size_t>(T) * s.row_bytes, 0xff);
      for (int t = 0; t < T; t++)
        for (int k = 0; k < K; k++) routed[t] |= idx[r][t * K + k] >= 0;
      finish_combine(s, acc.data(), routed.data(), T, out.data(), false);
      for (int t = 0; t < T; t++)
        for (int h = 0; h < H; h++) {
          double want = 0;
          float xv = static_cast<float>((r * 13 + t * H + h) % 17);
          for (int k = 0; k < K; k++) {
            int64_t e = idx[r][t * K + k];
            if (e < 0) continue;
            float yv = xv * static_cast<float>(e + 2);
            if (d == DType::kBFloat16) yv = bf16_to_float(float_to_bf16(yv));
            want += w[r][t * K + k] * yv;
          }
          float got;
          if (d == DType::kFloat32) memcpy(&got, &out[4 * (t * H + h)], 4);
          else {
            uint16_t b;
            memcpy(&b, &out[2 * (t * H + h)], 2);
            got = bf16_to_float(b);
          }
          EXPECT_NEAR(got, want, (d == DType::kFloat32 ? 1e-4 : 1e-2) * (1 + std::abs(want))) << "rank " << r << " t " << t;
        }
    }
  }
}

TEST(EpLayout, Bf16Conversion) {
  EXPECT_EQ(float_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(bf16_to_float(0x3f80), 1.0f);
  EXPECT_EQ(float_to_bf16(-2.0f), 0xc000);
  EXPECT_EQ(bf16_to_float(float_to_bf16(255.0f)), 255.0f);
  EXPECT_EQ(float_to_bf16(1.00390625f), 0x3f80);  // halfway: rounds to even
  EXPECT_EQ(float_to_bf16(1.01171875f), 0x3f82);  // halfway: rounds to even (up)
}
