// ep_layout: block headers (round trip, rejection), routing checks, pack -> unpack -> combine on one
// process with W simulated ranks, and the bf16 conversions.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
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
  h.rows = 6;
  h.entries = 7;
  h.seq = 42;
  h.data_imms = 2;
  h.data_bytes = 6 * dispatch_row_stride(s);
  write_block_header(blk.data(), s, h, counts);
  EpBlockHeader got;
  int32_t c[2];
  ASSERT_TRUE(read_block_header(blk.data(), s, kEpPhaseDispatch, 42, &got, c).ok());
  EXPECT_EQ(got.rows, 6u);
  EXPECT_EQ(got.entries, 7u);
  EXPECT_EQ(got.data_imms, 2u);
  EXPECT_EQ(c[0], 3);
  EXPECT_EQ(c[1], 4);
  EXPECT_FALSE(read_block_header(blk.data(), s, kEpPhaseCombine, 42, &got, c).ok());  // phase
  EXPECT_FALSE(read_block_header(blk.data(), s, kEpPhaseDispatch, 43, &got, c).ok());  // stale call
  auto bad = blk;
  bad[0] = 9;  // version
  EXPECT_FALSE(read_block_header(bad.data(), s, kEpPhaseDispatch, 42, &got, c).ok());
  counts[1] = 5;  // counts disagree with entries
  write_block_header(blk.data(), s, h, counts);
  EXPECT_FALSE(read_block_header(blk.data(), s, kEpPhaseDispatch, 42, &got, c).ok());
  counts[1] = 4;
  h.rows = 3;  // 7 copies cannot ride on 3 rows of K = 2 experts each
  h.data_bytes = 3 * dispatch_row_stride(s);
  write_block_header(blk.data(), s, h, counts);
  EXPECT_FALSE(read_block_header(blk.data(), s, kEpPhaseDispatch, 42, &got, c).ok());
  h.rows = 6;
  h.data_bytes = 6 * dispatch_row_stride(s);
  h.phase = kEpPhaseCombine;  // a combine block's rows are its copies
  h.data_bytes = 6 * combine_row_stride(s);
  write_block_header(blk.data(), s, h, counts);
  EXPECT_FALSE(read_block_header(blk.data(), s, kEpPhaseCombine, 42, &got, c).ok());
  h.phase = kEpPhaseDispatch;
  h.data_bytes = 6 * dispatch_row_stride(s);
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
  EXPECT_EQ(dispatch_tag_bytes(a), 16u);    // token, n, K = 2 experts
  EXPECT_EQ(dispatch_row_stride(a), 272u);  // tag 16 + row 256
  EXPECT_EQ(dispatch_row_stride(b), 288u);  // tag 16 + row 256 + extra 16
  EXPECT_EQ(max_dispatch_rows(a), 8u);      // a token crosses to a rank once
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
    std::vector<std::vector<uint32_t>> nrows(W, std::vector<uint32_t>(W));
    for (int r = 0; r < W; r++) {
      count_routes(s, idx[r].data(), T, counts[r].data());
      std::vector<uint8_t*> at(W);
      for (int d2 = 0; d2 < W; d2++) {
        blocks[r][d2].assign(max_dispatch_rows(s) * dispatch_row_stride(s), 0);
        at[d2] = blocks[r][d2].data();
      }
      std::vector<int32_t> cursor(W * L), token_row(W);
      pack_dispatch(s, xb[r].data(), nullptr, idx[r].data(), T, counts[r].data(), at.data(), cursor.data(),
                    token_row.data(), send_map[r].data(), nrows[r].data());
      for (int d2 = 0; d2 < W; d2++) {  // one row per token routing to d2 at all, however many copies
        uint32_t want = 0;
        for (int t = 0; t < T; t++) {
          bool any = false;
          for (int k = 0; k < K; k++) any |= idx[r][t * K + k] >= 0 && idx[r][t * K + k] / L == d2;
          want += any;
        }
        EXPECT_EQ(nrows[r][d2], want) << "rank " << r << " to " << d2;
      }
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
        std::vector<int32_t> cur(L);
        ASSERT_TRUE(unpack_dispatch_block(s, blocks[r][me].data(), nrows[r][me], &counts[r][me * L], r, begins.data(),
                                          rx.data(), nullptr, info.data(), cur.data())
                        .ok());
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
      // combine_tokens (EpBuffer's host path) gives the same sums from the same rows.
      std::vector<const uint8_t*> row_of(static_cast<size_t>(T) * K, nullptr);
      for (int d2 = 0; d2 < W; d2++) {
        uint32_t rows = 0;
        for (int l = 0; l < L; l++) rows += static_cast<uint32_t>(counts[r][d2 * L + l]);
        for (uint32_t i = 0; i < rows; i++)
          row_of[send_map[r][d2 * maxr + i]] = cblocks[d2][r].data() + i * combine_row_stride(s);
      }
      std::vector<uint8_t> out2(out.size(), 0xee);
      combine_tokens(s, row_of.data(), w[r].data(), routed.data(), T, out2.data(), false);
      for (int t = 0; t < T; t++)
        for (int h = 0; h < H; h++) {
          float a, b;
          if (d == DType::kFloat32) {
            memcpy(&a, &out[4 * (t * H + h)], 4);
            memcpy(&b, &out2[4 * (t * H + h)], 4);
          } else {
            uint16_t u, v;
            memcpy(&u, &out[2 * (t * H + h)], 2);
            memcpy(&v, &out2[2 * (t * H + h)], 2);
            a = bf16_to_float(u);
            b = bf16_to_float(v);
          }
          EXPECT_NEAR(a, b, (d == DType::kFloat32 ? 1e-5 : 1e-2) * (1 + std::abs(a))) << "combine_tokens, rank " << r;
        }
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

// A dispatch block's tags are a peer's bytes: each kind of bad tag is refused by name, and no copy
// lands past an expert's counted rows (the guard row after them keeps its bytes).
TEST(EpLayout, UnpackRefusesBadTags) {
  const int W = 2, E = 4, T = 3, H = 4, K = 2;  // L = 2
  EpShape s = make_ep_shape(W, E, T, H, K, DType::kFloat32, 0);
  const int L = s.local_experts;
  const size_t per = static_cast<size_t>(W) * T, stride = dispatch_row_stride(s);
  std::vector<int64_t> idx = {0, 1, 1, -1, 2, 0};  // to rank 0: t0 (experts 0, 1), t1 (1), t2 (0)
  std::vector<uint8_t> x(static_cast<size_t>(T) * s.row_bytes);
  for (size_t i = 0; i < x.size(); i++) x[i] = static_cast<uint8_t>(i + 1);
  std::vector<int32_t> counts(W * L), cursor(W * L), token_row(W), send_map(W * max_rows_per_block(s));
  std::vector<uint32_t> nrows(W);
  count_routes(s, idx.data(), T, counts.data());
  std::vector<std::vector<uint8_t>> blocks(W, std::vector<uint8_t>(max_dispatch_rows(s) * stride, 0));
  std::vector<uint8_t*> at = {blocks[0].data(), blocks[1].data()};
  pack_dispatch(s, x.data(), nullptr, idx.data(), T, counts.data(), at.data(), cursor.data(), token_row.data(),
                send_map.data(), nrows.data());
  ASSERT_EQ(nrows[0], 3u);  // three tokens, four copies
  ASSERT_EQ(counts[0] + counts[1], 4);
  EXPECT_EQ(nrows[1], 1u);
  // send_map in the receiver's order: expert 0's copies (t0 k0, t2 k1), then expert 1's (t0 k1, t1 k0).
  EXPECT_EQ(send_map[0], 0 * K + 0);
  EXPECT_EQ(send_map[1], 2 * K + 1);
  EXPECT_EQ(send_map[2], 0 * K + 1);
  EXPECT_EQ(send_map[3], 1 * K + 0);
  auto unpack = [&](const std::vector<uint8_t>& blk, const int32_t* c, std::vector<uint8_t>* rx) {
    rx->assign(static_cast<size_t>(L) * per * s.row_bytes, 0xab);
    std::vector<int32_t> begins(L, 0), cur(L), info(static_cast<size_t>(L) * per * 2, -1);
    return unpack_dispatch_block(s, blk.data(), nrows[0], c, 1, begins.data(), rx->data(), nullptr, info.data(), cur.data());
  };
  std::vector<uint8_t> rx;
  ASSERT_TRUE(unpack(blocks[0], counts.data(), &rx).ok());
  EXPECT_EQ(memcmp(rx.data(), x.data(), s.row_bytes), 0);                           // expert 0, copy 0: t0
  EXPECT_EQ(memcmp(rx.data() + s.row_bytes, x.data() + 2 * s.row_bytes, s.row_bytes), 0);  // expert 0, copy 1: t2
  auto put32 = [](std::vector<uint8_t>* b, size_t off, int32_t v) { memcpy(b->data() + off, &v, 4); };
  auto bad = blocks[0];
  put32(&bad, stride + 0, T);  // row 1's token out of range
  EXPECT_NE(std::string(unpack(bad, counts.data(), &rx).message()).find("token"), std::string::npos);
  bad = blocks[0];
  put32(&bad, 4, 0);  // row 0 names no expert
  EXPECT_NE(std::string(unpack(bad, counts.data(), &rx).message()).find("experts"), std::string::npos);
  bad = blocks[0];
  put32(&bad, 4, K + 1);  // more than K
  EXPECT_FALSE(unpack(bad, counts.data(), &rx).ok());
  bad = blocks[0];
  put32(&bad, 8, L);  // an expert out of range
  EXPECT_NE(std::string(unpack(bad, counts.data(), &rx).message()).find("local expert"), std::string::npos);
  bad = blocks[0];
  put32(&bad, 12, 0);  // row 0 names expert 0 twice: three copies for a count of two
  Status st = unpack(bad, counts.data(), &rx);
  EXPECT_NE(std::string(st.message()).find("more copies"), std::string::npos) << st.message();
  std::vector<uint8_t> guard(s.row_bytes, 0xab);
  EXPECT_EQ(memcmp(rx.data() + 2 * s.row_bytes, guard.data(), s.row_bytes), 0) << "a copy landed past expert 0's count";
  int32_t fewer[2] = {counts[0], counts[1] + 1};  // the header counts a copy the rows do not carry
  EXPECT_FALSE(unpack(blocks[0], fewer, &rx).ok());
}

// dispatch() packs this rank's own block with tags only and unpacks its rows from x: the same
// recv_x, src_info and send_map as the full block; the data area is not written; a tag naming a
// token past x's rows is refused.
TEST(EpLayout, TagsOnlyBlockUnpacksFromX) {
  const int W = 2, E = 4, T = 5, H = 3, K = 2;  // L = 2
  EpShape s = make_ep_shape(W, E, T, H, K, DType::kFloat32, 0);
  const int L = s.local_experts;
  const size_t per = static_cast<size_t>(W) * T, stride = dispatch_row_stride(s), tag = dispatch_tag_bytes(s);
  std::vector<int64_t> idx = {0, 1, 1, -1, 3, 0, -1, -1, 1, 1};  // t3 unrouted, t4 names expert 1 twice
  std::vector<uint8_t> x(static_cast<size_t>(T) * s.row_bytes);
  for (size_t i = 0; i < x.size(); i++) x[i] = static_cast<uint8_t>(3 * i + 1);
  std::vector<int32_t> counts(W * L), cursor(W * L), token_row(W);
  count_routes(s, idx.data(), T, counts.data());
  struct Packed {
    std::vector<std::vector<uint8_t>> blocks;
    std::vector<int32_t> send_map;
    std::vector<uint32_t> nrows;
  } full, tags;
  for (int mode = 0; mode < 2; mode++) {
    Packed& pk = mode ? tags : full;
    pk.blocks.assign(W, std::vector<uint8_t>(max_dispatch_rows(s) * stride, 0x5c));
    pk.send_map.assign(W * max_rows_per_block(s), -1);
    pk.nrows.assign(W, 0);
    std::vector<uint8_t*> at = {pk.blocks[0].data(), pk.blocks[1].data()};
    pack_dispatch(s, x.data(), nullptr, idx.data(), T, counts.data(), at.data(), cursor.data(), token_row.data(),
                  pk.send_map.data(), pk.nrows.data(), mode ? 0 : -1);
  }
  EXPECT_EQ(full.nrows, tags.nrows);
  EXPECT_EQ(full.send_map, tags.send_map);
  EXPECT_EQ(full.blocks[1], tags.blocks[1]) << "another rank's block is packed whole";
  ASSERT_EQ(full.nrows[0], 4u);  // t0, t1, t2, t4 go to rank 0
  for (uint32_t i = 0; i < tags.nrows[0]; i++) {
    const uint8_t* f = full.blocks[0].data() + i * stride;
    const uint8_t* g = tags.blocks[0].data() + i * stride;
    EXPECT_EQ(memcmp(f, g, tag), 0) << "row " << i << "'s tag";
    for (size_t b = 0; b < s.row_bytes; b++) ASSERT_EQ(g[tag + b], 0x5c) << "row " << i << "'s data was written";
  }
  auto unpack = [&](const std::vector<uint8_t>& blk, const void* from_x, int x_tokens, std::vector<uint8_t>* rx,
                    std::vector<int32_t>* info) {
    rx->assign(static_cast<size_t>(L) * per * s.row_bytes, 0xab);
    info->assign(static_cast<size_t>(L) * per * 2, -1);
    std::vector<int32_t> begins(L, 0), cur(L);
    return unpack_dispatch_block(s, blk.data(), full.nrows[0], counts.data(), 0, begins.data(), rx->data(), nullptr,
                                 info->data(), cur.data(), from_x, x_tokens);
  };
  std::vector<uint8_t> rx_full, rx_x;
  std::vector<int32_t> info_full, info_x;
  ASSERT_TRUE(unpack(full.blocks[0], nullptr, 0, &rx_full, &info_full).ok());
  ASSERT_TRUE(unpack(tags.blocks[0], x.data(), T, &rx_x, &info_x).ok());
  EXPECT_EQ(rx_full, rx_x);
  EXPECT_EQ(info_full, info_x);
  EXPECT_EQ(memcmp(rx_x.data() + (per + 2) * s.row_bytes, x.data() + 4 * s.row_bytes, s.row_bytes), 0)
      << "expert 1's third copy is t4";
  Status st = unpack(tags.blocks[0], x.data(), T - 1, &rx_x, &info_x);  // t4 is past 4 rows of x
  EXPECT_NE(std::string(st.message()).find("of x's 4"), std::string::npos) << st.message();
  EpShape with_extra = make_ep_shape(W, E, T, H, K, DType::kFloat32, 16);  // fp8 scales, later
  std::vector<int32_t> begins(L, 0), cur(L);
  st = unpack_dispatch_block(with_extra, tags.blocks[0].data(), 0, counts.data(), 0, begins.data(), rx_x.data(), nullptr,
                             info_x.data(), cur.data(), x.data(), T);
  EXPECT_NE(std::string(st.message()).find("extra bytes"), std::string::npos) << st.message();
}

// combine_tokens: unrouted tokens get zeros, or keep their bytes with accumulate; accumulate adds.
TEST(EpLayout, CombineTokensAccumulateAndUnrouted) {
  const int T = 2, H = 3, K = 2;
  EpShape s = make_ep_shape(1, 2, T, H, K, DType::kFloat32, 0);
  const float r0[3] = {1, 2, 3}, r1[3] = {10, 20, 30};
  const uint8_t* row_of[4] = {reinterpret_cast<const uint8_t*>(r0), reinterpret_cast<const uint8_t*>(r1), nullptr, nullptr};
  const float w[4] = {0.5f, 0.25f, 1, 1};
  const uint8_t routed[2] = {1, 0};
  float out[6] = {7, 7, 7, 7, 7, 7};
  combine_tokens(s, row_of, w, routed, T, out, false);
  EXPECT_FLOAT_EQ(out[0], 0.5f * 1 + 0.25f * 10);
  EXPECT_FLOAT_EQ(out[2], 0.5f * 3 + 0.25f * 30);
  EXPECT_EQ(out[3], 0.0f);
  for (float& v : out) v = 7;
  combine_tokens(s, row_of, w, routed, T, out, true);
  EXPECT_FLOAT_EQ(out[1], 7 + 0.5f * 2 + 0.25f * 20);
  EXPECT_EQ(out[4], 7.0f);  // unrouted, accumulate: untouched
}
