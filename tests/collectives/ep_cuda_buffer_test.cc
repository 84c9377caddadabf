// EpBuffer on GPU memory (EpConfig::device = the CUDA EpDevice) against EpBuffer on host memory,
// on every rank of W = 2 and 4 processes over tcp;ofi_rxm sharing GPU 0: the same inputs through
// both give the same recv_count, layout_range, src_info and received rows (byte for byte), and the
// same combine (float tolerance: the device sums with atomics), over iterations with fresh routing,
// split and one-call phases, accumulate, and a bad expert index refused before anything is sent.
// The host path's semantics are checked independently by collectives_test. Needs a GPU: run by
// scripts/ep-gpu-check, not by ctest (no GPU on the CI machines); without one it skips, loudly.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "collectives/cuda/ep_device_cuda.h"
#include "collectives/ep_buffer.h"
#include "tests/collectives/scenarios.h"
#include "tests/collectives/world.h"
#include "tests/common/loopback.h"
#include "tests/common/setups.h"

using namespace ponte;
using namespace ponte::test;

namespace {

constexpr int kExpertsPerRank = 3, kMaxTokens = 24, kHidden = 96, kTopk = 3, kIters = 4;

struct DevBuf {
  void* p = nullptr;
  explicit DevBuf(size_t n) {
    if (cudaMalloc(&p, n ? n : 1) != cudaSuccess) p = nullptr;
  }
  ~DevBuf() {
    if (p) cudaFree(p);
  }
};

float elem(const std::vector<uint8_t>& m, size_t i, DType d) {
  if (d == DType::kFloat32) {
    float f;
    memcpy(&f, m.data() + 4 * i, 4);
    return f;
  }
  uint16_t b;
  memcpy(&b, m.data() + 2 * i, 2);
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}
void set_elem(std::vector<uint8_t>& m, size_t i, DType d, float f) {
  if (d == DType::kFloat32) {
    memcpy(m.data() + 4 * i, &f, 4);
    return;
  }
  uint32_t u;
  memcpy(&u, &f, 4);
  const uint16_t b = static_cast<uint16_t>(u >> 16);  // truncation: the same bytes go to both paths
  memcpy(m.data() + 2 * i, &b, 2);
}

// One rank's run; "" or what differed.
std::string compare_paths(Communicator& c, DType dtype) {
  const int W = c.world(), me = c.rank();
  EpConfig cfg;
  cfg.num_experts = kExpertsPerRank * W;
  cfg.max_tokens = kMaxTokens;
  cfg.hidden = kHidden;
  cfg.topk = kTopk;
  cfg.dtype = dtype;
  auto dev = cuda::make_ep_device(0);
  CHECK_OR_RETURN(dev.ok(), "make_ep_device: %s", dev.status().message());
  auto host_ep = EpBuffer::create(c, cfg);
  CHECK_OR_RETURN(host_ep.ok(), "host EpBuffer: %s", host_ep.status().message());
  cfg.device = dev->get();
  auto dev_ep = EpBuffer::create(c, cfg);
  CHECK_OR_RETURN(dev_ep.ok(), "device EpBuffer: %s", dev_ep.status().message());
  const int L = (*host_ep)->local_experts();
  const size_t es = dtype == DType::kFloat32 ? 4 : 2, row = kHidden * es;
  const size_t per = (*host_ep)->recv_rows_per_expert(), rx_rows = static_cast<size_t>(L) * per;
  DevBuf x_d(kMaxTokens * row), rx_d(rx_rows * row), y_d(rx_rows * row), out_d(kMaxTokens * row);
  CHECK_OR_RETURN(x_d.p && rx_d.p && y_d.p && out_d.p, "cudaMalloc failed");
  std::mt19937 rng(1234 + 77 * me + static_cast<int>(dtype));
  for (int it = 0; it < kIters; it++) {
    // Fresh routing: -1 entries, a duplicate, T = 0 on one rank in iteration 1, max_tokens in 2.
    const int T = it == 1 && me == W - 1 ? 0 : it == 2 ? kMaxTokens : 5 + static_cast<int>(rng() % (kMaxTokens - 5));
    std::vector<int64_t> idx(static_cast<size_t>(T) * kTopk);
    std::vector<float> w(idx.size());
    for (int t = 0; t < T; t++)
      for (int k = 0; k < kTopk; k++) {
        int64_t e = static_cast<int64_t>(rng() % (cfg.num_experts + 1)) - 1;
        if (t == 3 && k == 1) e = idx[static_cast<size_t>(t) * kTopk];  // a duplicate (or -1 twice)
        idx[static_cast<size_t>(t) * kTopk + k] = e;
        w[static_cast<size_t>(t) * kTopk + k] = 0.125f * static_cast<float>(1 + rng() % 7);
      }
    std::vector<uint8_t> x(static_cast<size_t>(T) * row);
    for (size_t i = 0; i < static_cast<size_t>(T) * kHidden; i++)
      set_elem(x, i, dtype, static_cast<float>(static_cast<int>(rng() % 2001) - 1000) / 64.0f);
    if (T) cudaMemcpy(x_d.p, x.data(), x.size(), cudaMemcpyHostToDevice);
    cudaMemset(rx_d.p, 0x5a, rx_rows * row);  // poisoned: rows past the counts are unspecified
    cudaDeviceSynchronize();

    // Dispatch on both.
    std::vector<uint8_t> rx_h(rx_rows * row, 0xa5);
    std::vector<int32_t> cnt_h(L, -7), cnt_d(L, -9);
    EpRows xh{x.data(), static_cast<size_t>(T), kHidden, dtype}, xd{x_d.p, static_cast<size_t>(T), kHidden, dtype};
    EpRows rxh{rx_h.data(), rx_rows, kHidden, dtype}, rxd{rx_d.p, rx_rows, kHidden, dtype};
    auto hh = (*host_ep)->dispatch(xh, idx, rxh, cnt_h);
    CHECK_OR_RETURN(hh.ok(), "iteration %d: host dispatch: %s", it, hh.status().message());
    const bool split = it % 2 == 0;
    Result<EpHandle> hd = split ? (*dev_ep)->dispatch_send(xd, idx) : (*dev_ep)->dispatch(xd, idx, rxd, cnt_d);
    CHECK_OR_RETURN(hd.ok(), "iteration %d: device dispatch%s: %s", it, split ? "_send" : "", hd.status().message());
    if (split) {
      Status r = (*dev_ep)->dispatch_recv(*hd, rxd, cnt_d);
      CHECK_OR_RETURN(r.ok(), "iteration %d: device dispatch_recv: %s", it, r.message());
    }
    CHECK_OR_RETURN(cnt_d == cnt_h, "iteration %d: recv_count differs", it);
    CHECK_OR_RETURN(std::equal(hh->layout_range().begin(), hh->layout_range().end(), hd->layout_range().begin(),
                             hd->layout_range().end()),
                  "iteration %d: layout_range differs", it);
    CHECK_OR_RETURN(std::equal(hh->src_info().begin(), hh->src_info().end(), hd->src_info().begin(), hd->src_info().end()),
                  "iteration %d: src_info differs", it);
    std::vector<uint8_t> rx_back(rx_rows * row);
    cudaMemcpy(rx_back.data(), rx_d.p, rx_back.size(), cudaMemcpyDeviceToHost);
    for (int l = 0; l < L; l++) {
      for (int i = 0; i < cnt_h[l]; i++) {
        const size_t at = (static_cast<size_t>(l) * per + i) * row;
        CHECK_OR_RETURN(memcmp(rx_back.data() + at, rx_h.data() + at, row) == 0, "iteration %d: expert %d row %d differs", it, l, i);
      }
    }

    // The experts: y = recv_x * (expert + 1) - source rank (depends on the expert and the source).
    std::vector<uint8_t> y(rx_rows * row, 0);
    for (int l = 0; l < L; l++)
      for (int i = 0; i < cnt_h[l]; i++) {
        const size_t r = static_cast<size_t>(l) * per + i;
        const int src = hh->src_info()[2 * r];
        for (int hcol = 0; hcol < kHidden; hcol++) {
          const size_t e = r * kHidden + hcol;
          set_elem(y, e, dtype, elem(rx_h, e, dtype) * static_cast<float>(me * kExpertsPerRank + l + 1) - static_cast<float>(src));
        }
      }
    cudaMemcpy(y_d.p, y.data(), y.size(), cudaMemcpyHostToDevice);

    // Combine on both; iteration 3 accumulates into a prefilled out.
    const bool acc = it == 3;
    std::vector<uint8_t> out_h(static_cast<size_t>(T) * row, 0);
    for (size_t i = 0; i < static_cast<size_t>(T) * kHidden; i++) set_elem(out_h, i, dtype, acc ? 0.5f : 99.0f);
    if (T) cudaMemcpy(out_d.p, out_h.data(), out_h.size(), cudaMemcpyHostToDevice);
    cudaDeviceSynchronize();
    EpRows yh{y.data(), rx_rows, kHidden, dtype}, yd{y_d.p, rx_rows, kHidden, dtype};
    EpRows oh{out_h.data(), static_cast<size_t>(T), kHidden, dtype}, od{out_d.p, static_cast<size_t>(T), kHidden, dtype};
    Status ch = (*host_ep)->combine(*hh, yh, w, oh, acc);
    CHECK_OR_RETURN(ch.ok(), "iteration %d: host combine: %s", it, ch.message());
    Status cd = Status::Ok();
    if (split) {
      cd = (*dev_ep)->combine_send(*hd, yd);
      if (cd.ok()) cd = (*dev_ep)->combine_recv(*hd, w, od, acc);
    } else {
      cd = (*dev_ep)->combine(*hd, yd, w, od, acc);
    }
    CHECK_OR_RETURN(cd.ok(), "iteration %d: device combine: %s", it, cd.message());
    std::vector<uint8_t> out_back(out_h.size());
    if (T) cudaMemcpy(out_back.data(), out_d.p, out_back.size(), cudaMemcpyDeviceToHost);
    const float tol = dtype == DType::kFloat32 ? 1e-4f : 1e-2f;
    for (size_t i = 0; i < static_cast<size_t>(T) * kHidden; i++) {
      const float a = elem(out_back, i, dtype), b = elem(out_h, i, dtype);
      CHECK_OR_RETURN(std::fabs(a - b) <= tol * (1 + std::fabs(b)), "iteration %d: out element %zu: device %g, host %g", it, i, a,
                    b);
    }
    CHECK_OR_RETURN((*dev_ep)->live_handles() == 0, "iteration %d: %d device handles live after combine", it,
                  (*dev_ep)->live_handles());
  }

  // Bad input on the device path: refused before anything is sent, and the next call works.
  std::vector<int64_t> bad(kTopk, cfg.num_experts);
  EpRows one{x_d.p, 1, kHidden, dtype};
  auto b = (*dev_ep)->dispatch_send(one, bad);
  CHECK_OR_RETURN(!b.ok() && b.status().code() == Code::kInvalidArgument, "an expert index of %d was not refused",
                cfg.num_experts);
  std::vector<int64_t> good(kTopk, -1);
  good[0] = (me + 1) % cfg.num_experts;
  std::vector<float> gw(kTopk, 1.0f);
  std::vector<int32_t> cnt(L);
  EpRows rxd{rx_d.p, rx_rows, kHidden, dtype}, od{out_d.p, 1, kHidden, dtype};
  auto g = (*dev_ep)->dispatch(one, good, rxd, cnt);
  CHECK_OR_RETURN(g.ok(), "the dispatch after a refused one: %s", g.status().message());
  Status gc = (*dev_ep)->combine(*g, rxd, gw, od);
  CHECK_OR_RETURN(gc.ok(), "the combine after a refused dispatch: %s", gc.message());
  return "";
}

int run_peer(int argc, char** argv) {
  // --ponte-peer W RANK DTYPE
  if (argc < 5) return 2;
  Channel ch(3);
  const int W = atoi(argv[2]), rank = atoi(argv[3]);
  const DType dtype = std::string(argv[4]) == "bf16" ? DType::kBFloat16 : DType::kFloat32;
  std::string verdict;
  {
    auto c = Communicator::create(rank, W, channel_allgather(ch, W), comm_options(setups()[0], kTimeoutMs, rank));
    if (!c.ok()) {
      ch.send_str(std::string("communicator: ") + c.status().message());
      return 3;
    }
    verdict = compare_paths(**c, dtype);
  }
  ch.send_str(verdict.empty() ? "ok" : verdict);
  return 0;
}

struct Param {
  int world;
  DType dtype;
};

class EpCudaBuffer : public ::testing::TestWithParam<Param> {
 protected:
  void SetUp() override {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0)
      GTEST_SKIP() << "NO GPU: EpBuffer on GPU memory was not run (scripts/ep-gpu-check runs it on a GPU machine)";
  }
};

TEST_P(EpCudaBuffer, MatchesTheHostPath) {
  const int W = GetParam().world;
  const std::string dt = GetParam().dtype == DType::kBFloat16 ? "bf16" : "f32";
  std::vector<std::unique_ptr<PeerProcess>> ranks;
  for (int r = 1; r < W; r++) {
    ranks.push_back(std::make_unique<PeerProcess>(std::vector<std::string>{std::to_string(W), std::to_string(r), dt}));
    ASSERT_TRUE(ranks.back()->started());
  }
  std::string verdict;
  {
    auto c = Communicator::create(0, W, hub_allgather(ranks), comm_options(setups()[0], kTimeoutMs, 0));
    ASSERT_TRUE(c.ok()) << c.status().message();
    verdict = compare_paths(**c, GetParam().dtype);
  }
  EXPECT_EQ(verdict, "") << "rank 0";
  for (int r = 1; r < W; r++) {
    std::string m;
    EXPECT_TRUE(ranks[r - 1]->channel().recv_str(&m, 120000)) << "rank " << r << " sent no verdict";
    EXPECT_EQ(m, "ok") << "rank " << r;
    EXPECT_EQ(ranks[r - 1]->wait_exit(30000), 0) << "rank " << r << " did not exit cleanly";
  }
}

INSTANTIATE_TEST_SUITE_P(Worlds, EpCudaBuffer,
                         ::testing::Values(Param{2, DType::kFloat32}, Param{2, DType::kBFloat16}, Param{4, DType::kBFloat16}),
                         [](const ::testing::TestParamInfo<Param>& i) {
                           return std::string(i.param.dtype == DType::kBFloat16 ? "bf16" : "f32") + "_w" +
                                  std::to_string(i.param.world);
                         });

}  // namespace

int main(int argc, char** argv) {
  ponte::test::keep_test_traffic_on_loopback();
  if (argc >= 2 && std::string(argv[1]) == "--ponte-peer") return run_peer(argc, argv);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
