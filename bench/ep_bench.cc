// ep-bench: MoE dispatch/combine latency over ponte's collectives (EpBuffer), against the memcpy of the
// same bytes in the same run, and all_to_all_v bandwidth against the engine's own writes. It starts
// its W ranks itself on this host (one process each, loopback). Prints a table, --json, --plot PNG.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "collectives/ep_buffer.h"
#include "tests/collectives/world.h"
#ifdef PONTE_EP_BENCH_CUDA
#include <cuda_runtime.h>

#include "collectives/cuda/ep_device_cuda.h"
#endif

using namespace ponte;
using namespace ponte::test;
using Clock = std::chrono::steady_clock;

namespace {

struct Shape {
  std::string provider = "shm";
  int world = 2;
  int tokens = 128;
  int hidden = 7168;
  int topk = 8;
  int experts = 256;
  DType dtype = DType::kBFloat16;
  int iters = 50;
  int warmup = 5;
  int combine_once = 0;  // 1: EpBuffer::combine (one call) instead of combine_send + combine_recv
  int dispatch_once = 0;  // 1: EpBuffer::dispatch (one call) instead of dispatch_send + dispatch_recv
  int cuda = 0;           // 1: x, recv_x and out in GPU memory (EpConfig::device, the CUDA EpDevice)
};

std::string encode(const Shape& s) {
  char b[256];
  snprintf(b, sizeof(b), "%s|%d|%d|%d|%d|%d|%d|%d|%d|%d|%d|%d", s.provider.c_str(), s.world, s.tokens, s.hidden, s.topk,
           s.experts, static_cast<int>(s.dtype), s.iters, s.warmup, s.combine_once, s.dispatch_once, s.cuda);
  return b;
}
Shape decode(const std::string& t) {
  Shape s;
  char prov[64] = {};
  int d = 0;
  sscanf(t.c_str(), "%63[^|]|%d|%d|%d|%d|%d|%d|%d|%d|%d|%d|%d", prov, &s.world, &s.tokens, &s.hidden, &s.topk, &s.experts,
         &d, &s.iters, &s.warmup, &s.combine_once, &s.dispatch_once, &s.cuda);
  s.provider = prov;
  s.dtype = static_cast<DType>(d);
  return s;
}

double us_since(Clock::time_point t) { return std::chrono::duration<double, std::micro>(Clock::now() - t).count(); }

// Per iteration, per rank: dispatch send, dispatch recv, combine send, combine recv (us); then the
// all_to_all_v and raw engine-write times (us per call) and the verdict.
struct RankResult {
  std::vector<double> ds, dr, cs, cr;
  std::vector<double> a2a, raw;
  double memcpy_us = 0;
  bool verified = false;
  std::string error;
};

std::vector<uint8_t> pack(const RankResult& r) {
  std::vector<uint8_t> out;
  auto put_vec = [&](const std::vector<double>& v) {
    uint32_t n = static_cast<uint32_t>(v.size());
    out.insert(out.end(), reinterpret_cast<uint8_t*>(&n), reinterpret_cast<uint8_t*>(&n) + 4);
    out.insert(out.end(), reinterpret_cast<const uint8_t*>(v.data()), reinterpret_cast<const uint8_t*>(v.data() + n));
  };
  for (auto* v : {&r.ds, &r.dr, &r.cs, &r.cr, &r.a2a, &r.raw}) put_vec(*v);
  std::vector<double> extra = {r.memcpy_us, r.verified ? 1.0 : 0.0};
  put_vec(extra);
  out.insert(out.end(), r.error.begin(), r.error.end());
  return out;
}
bool unpack(const std::vector<uint8_t>& in, RankResult* r) {
  size_t at = 0;
  auto get_vec = [&](std::vector<double>* v) {
    uint32_t n;
    if (at + 4 > in.size()) return false;
    memcpy(&n, in.data() + at, 4);
    at += 4;
    if (at + 8ull * n > in.size()) return false;
    v->resize(n);
    memcpy(v->data(), in.data() + at, 8ull * n);
    at += 8ull * n;
    return true;
  };
  std::vector<double> extra;
  for (auto* v : {&r->ds, &r->dr, &r->cs, &r->cr, &r->a2a, &r->raw})
    if (!get_vec(v)) return false;
  if (!get_vec(&extra) || extra.size() != 2) return false;
  r->memcpy_us = extra[0];
  r->verified = extra[1] != 0;
  r->error.assign(in.begin() + static_cast<long>(at), in.end());
  return true;
}

// Routing: each token picks K distinct experts at random (fixed seed per rank and iteration).
void routing(const Shape& s, int rank, int iter, std::vector<int64_t>* idx, std::vector<float>* w) {
  std::mt19937 rng(static_cast<uint32_t>(rank * 7919 + iter * 104729 + 1));
  idx->resize(static_cast<size_t>(s.tokens) * s.topk);
  w->resize(idx->size());
  std::vector<int> perm(s.experts);
  for (int t = 0; t < s.tokens; t++) {
    for (int e = 0; e < s.experts; e++) perm[e] = e;
    for (int k = 0; k < s.topk; k++) {
      int j = k + static_cast<int>(rng() % static_cast<unsigned>(s.experts - k));
      std::swap(perm[k], perm[j]);
      (*idx)[static_cast<size_t>(t) * s.topk + k] = perm[k];
      (*w)[static_cast<size_t>(t) * s.topk + k] = 1.0f / static_cast<float>(s.topk);
    }
  }
}

float elem(const void* p, DType d, size_t i) {
  return d == DType::kFloat32 ? static_cast<const float*>(p)[i] : bf16_to_float(static_cast<const uint16_t*>(p)[i]);
}
void set_elem(void* p, DType d, size_t i, float v) {
  if (d == DType::kFloat32) static_cast<float*>(p)[i] = v;
  else static_cast<uint16_t*>(p)[i] = float_to_bf16(v);
}

// Checks one iteration's outputs against the routing of every rank: counts are the bincount, each
// row's first two columns (source rank, token) match src_info and the routing names this expert for
// it; combine with y = recv_x and weights summing to 1 gives x back.
std::string verify(const Shape& s, EpBuffer& buf, const EpHandle& h, int me, int iter, const std::vector<uint8_t>& rx,
                   const std::vector<int32_t>& cnt) {
  const int L = buf.local_experts();
  const size_t per = buf.recv_rows_per_expert();
  std::vector<int32_t> want(L, 0);
  std::vector<std::vector<int64_t>> idx(s.world);
  std::vector<float> w;
  for (int r = 0; r < s.world; r++) {
    routing(s, r, iter, &idx[r], &w);
    for (int64_t e : idx[r])
      if (e / L == me) want[e % L]++;
  }
  auto info = h.src_info();
  for (int l = 0; l < L; l++) {
    if (cnt[l] != want[l]) return "expert " + std::to_string(me * L + l) + ": count " + std::to_string(cnt[l]) + " != bincount " + std::to_string(want[l]);
    for (int i = 0; i < cnt[l]; i++) {
      const size_t row = l * per + i;
      const int r = static_cast<int>(elem(rx.data(), s.dtype, row * s.hidden));
      const int t = static_cast<int>(elem(rx.data(), s.dtype, row * s.hidden + 1));
      if (info[2 * row] != r || info[2 * row + 1] != t || r < 0 || r >= s.world || t < 0 || t >= s.tokens)
        return "expert row does not match src_info";
      bool routed = false;
      for (int k = 0; k < s.topk; k++) routed |= idx[r][static_cast<size_t>(t) * s.topk + k] == me * L + l;
      if (!routed) return "a row reached an expert its token did not pick";
    }
  }
  return "";
}

// --device cuda: the CUDA EpDevice and the tensors it works on (bench/CMakeLists.txt builds it in
// where the CUDA kernels are built; elsewhere --device cuda fails the row by name).
struct DeviceTensors {
  std::unique_ptr<EpDevice> dev;
  void *x = nullptr, *rx = nullptr, *out = nullptr;
#ifdef PONTE_EP_BENCH_CUDA
  std::string open(EpConfig* cfg) {
    auto d = cuda::make_ep_device(0);
    if (!d.ok()) return std::string("CUDA device: ") + d.status().message();
    dev = std::move(*d);
    cfg->device = dev.get();
    return "";
  }
  std::string alloc(const std::vector<uint8_t>& xh, size_t rx_bytes, size_t out_bytes) {
    if (cudaMalloc(&x, xh.size() + 1) != cudaSuccess || cudaMalloc(&rx, rx_bytes + 1) != cudaSuccess ||
        cudaMalloc(&out, out_bytes + 1) != cudaSuccess)
      return "cudaMalloc failed";
    cudaMemcpy(x, xh.data(), xh.size(), cudaMemcpyHostToDevice);
    return "";
  }
  void fetch(void* dst, const void* src, size_t n) { cudaMemcpy(dst, src, n, cudaMemcpyDeviceToHost); }
  ~DeviceTensors() {
    cudaFree(x), cudaFree(rx), cudaFree(out);
  }
#else
  std::string open(EpConfig*) { return "--device cuda: this ep-bench was built without CUDA"; }
  std::string alloc(const std::vector<uint8_t>&, size_t, size_t) { return "no CUDA"; }
  void fetch(void*, const void*, size_t) {}
#endif
};

RankResult run_rank(Communicator& c, const Shape& s) {
  RankResult res;
  const int me = c.rank();
  EpConfig cfg;
  cfg.num_experts = s.experts;
  cfg.max_tokens = s.tokens;
  cfg.hidden = s.hidden;
  cfg.topk = s.topk;
  cfg.dtype = s.dtype;
  // --device cuda: the tensors in GPU memory (declared before the buffer, which must go first).
  DeviceTensors gpu;
  if (s.cuda) {
    std::string e = gpu.open(&cfg);
    if (!e.empty()) {
      res.error = e;
      return res;
    }
  }
  auto buf = EpBuffer::create(c, cfg);
  if (!buf.ok()) {
    res.error = std::string("EpBuffer: ") + buf.status().message();
    return res;
  }
  EpBuffer& b = **buf;
  const size_t eb = dtype_bytes(s.dtype);
  const int L = b.local_experts();
  std::vector<uint8_t> x(static_cast<size_t>(s.tokens) * s.hidden * eb), rx(static_cast<size_t>(L) * b.recv_rows_per_expert() * s.hidden * eb),
      out(x.size());
  for (int t = 0; t < s.tokens; t++)
    for (int hh = 0; hh < s.hidden; hh++)
      set_elem(x.data(), s.dtype, static_cast<size_t>(t) * s.hidden + hh, hh == 0 ? me : hh == 1 ? t : static_cast<float>((t + hh) % 13));
  std::vector<int32_t> cnt(L);
  EpRows xr{x.data(), static_cast<size_t>(s.tokens), static_cast<size_t>(s.hidden), s.dtype};
  EpRows rxr{rx.data(), static_cast<size_t>(L) * b.recv_rows_per_expert(), static_cast<size_t>(s.hidden), s.dtype};
  EpRows outr{out.data(), static_cast<size_t>(s.tokens), static_cast<size_t>(s.hidden), s.dtype};
  if (s.cuda) {
    std::string e = gpu.alloc(x, rx.size(), out.size());
    if (!e.empty()) {
      res.error = e;
      return res;
    }
    xr.data = gpu.x;
    rxr.data = gpu.rx;
    outr.data = gpu.out;
  }
  std::vector<int64_t> idx;
  std::vector<float> w;
  bool verified = true;
  for (int it = 0; it < s.warmup + s.iters; it++) {
    routing(s, me, it, &idx, &w);
    Status st = c.barrier();
    // In one call, d_send is 0 and d_recv the whole call.
    double ds = 0, dr = 0;
    Result<EpHandle> h = Status(Code::kInternal, "not run");
    if (s.dispatch_once) {
      auto t1 = Clock::now();
      h = b.dispatch(xr, idx, rxr, cnt);
      dr = us_since(t1);
    } else {
      auto t0 = Clock::now();
      h = b.dispatch_send(xr, idx);
      ds = us_since(t0);
      auto t1 = Clock::now();
      if (h.ok()) st = b.dispatch_recv(*h, rxr, cnt);
      dr = us_since(t1);
    }
    if (!h.ok() || !st.ok()) {
      res.error = std::string("dispatch: ") + (h.ok() ? st.message() : h.status().message());
      return res;
    }
    if (it == s.warmup || it == s.warmup + s.iters - 1) {  // check the first and last measured round
      if (s.cuda) gpu.fetch(rx.data(), gpu.rx, rx.size());
      std::string v = verify(s, b, *h, me, it, rx, cnt);
      if (!v.empty()) {
        verified = false;
        res.error = "verification: " + v;
      }
    }
    // The "experts" return their input: out = x * sum(w) = x. In one call, c_send is 0 and c_recv
    // the whole call.
    double cs = 0, cr = 0;
    if (s.combine_once) {
      auto t2 = Clock::now();
      st = b.combine(*h, rxr, w, outr);
      cr = us_since(t2);
    } else {
      auto t2 = Clock::now();
      st = b.combine_send(*h, rxr);
      cs = us_since(t2);
      auto t3 = Clock::now();
      if (st.ok()) st = b.combine_recv(*h, w, outr);
      cr = us_since(t3);
    }
    if (!st.ok()) {
      res.error = std::string("combine: ") + st.message();
      return res;
    }
    if (it == s.warmup && s.cuda) gpu.fetch(out.data(), gpu.out, out.size());
    if (it == s.warmup)
      for (int t = 0; t < s.tokens && verified; t++)
        for (int hh = 0; hh < std::min(s.hidden, 4); hh++) {
          const float want = elem(x.data(), s.dtype, static_cast<size_t>(t) * s.hidden + hh);
          if (std::fabs(elem(out.data(), s.dtype, static_cast<size_t>(t) * s.hidden + hh) - want) > 0.02f * (1 + std::fabs(want))) {
            verified = false;
            res.error = "verification: combine output differs from the weighted sum";
          }
        }
    if (it >= s.warmup) {
      res.ds.push_back(ds);
      res.dr.push_back(dr);
      res.cs.push_back(cs);
      res.cr.push_back(cr);
    }
  }
  res.verified = verified;
  // The memcpy bound: the routed rows copied once each way (dispatch and combine), row by row. All
  // ranks copy at once (a barrier first), as they run dispatch and combine: they share the memory
  // bandwidth the same way (one rank copying alone measured up to twice as fast).
  (void)c.barrier();
  {
    const size_t rows = static_cast<size_t>(s.tokens) * s.topk, rb = static_cast<size_t>(s.hidden) * eb;
    std::vector<uint8_t> dst(rows * rb);
    std::vector<double> t;
    for (int it = 0; it < 20; it++) {
      auto t0 = Clock::now();
      for (size_t r = 0; r < rows; r++) memcpy(dst.data() + r * rb, x.data() + (r % s.tokens) * rb, rb);
      for (size_t r = 0; r < rows; r++) memcpy(rx.data() + r * rb, dst.data() + r * rb, rb);
      t.push_back(us_since(t0));
    }
    std::sort(t.begin(), t.end());
    res.memcpy_us = t[t.size() / 2];
  }
  return res;
}

// all_to_all_v with 1 MiB per pair against the same pattern in raw engine writes (write_imm to each
// peer, wait for the peers' immediates), on the same communicator's engine.
void run_a2a(Communicator& c, int iters, RankResult* res) {
  const int W = c.world(), me = c.rank();
  const size_t kPair = 1 << 20;
  std::vector<uint8_t> send(kPair * W, static_cast<uint8_t>(me)), recv(kPair * W);
  auto sr = c.register_buffer(send.data(), send.size());
  auto rr = c.register_buffer(recv.data(), recv.size());
  if (!sr.ok() || !rr.ok()) {
    res->error = "register_buffer failed";
    return;
  }
  std::vector<size_t> counts(W, kPair);
  for (int it = 0; it < iters + 3; it++) {
    c.barrier().ok();
    auto t0 = Clock::now();
    Status st = c.all_to_all_v(BufferRef{&*sr, 0}, counts, BufferRef{&*rr, 0}, counts);
    double us = us_since(t0);
    if (!st.ok()) {
      res->error = std::string("all_to_all_v: ") + st.message();
      return;
    }
    if (it >= 3) res->a2a.push_back(us);
  }
  for (int r = 0; r < W; r++)
    if (recv[r * kPair] != r || recv[r * kPair + kPair - 1] != r) res->error = "all_to_all_v: wrong bytes";
  // Raw engine: exchange the receive region through all_to_all_v, then write to each peer's slot.
  std::vector<uint8_t> mine(512, 0), all(512 * static_cast<size_t>(W));
  auto enc = rr->region().remote().encode();
  memcpy(mine.data(), enc.data(), enc.size());
  std::vector<uint8_t> mine_w(512 * static_cast<size_t>(W));
  for (int r = 0; r < W; r++) memcpy(mine_w.data() + 512 * r, mine.data(), 512);
  std::vector<size_t> c512(W, 512);
  if (!c.all_to_all_v(mine_w.data(), c512, all.data(), c512).ok()) return;
  std::vector<RemoteRegion> regions(W);
  for (int r = 0; r < W; r++) {  // the encoded length is in bytes 2..3
    uint16_t len;
    memcpy(&len, all.data() + 512 * r + 2, 2);
    auto d = RemoteRegion::decode(std::span<const uint8_t>(all.data() + 512 * r, len));
    if (!d.ok()) {
      res->error = "raw: bad region";
      return;
    }
    regions[r] = *d;
  }
  Engine& e = c.engine();
  const uint32_t kRawImm = 0x00badbe0;  // bit 30 clear: outside the collectives' values
  for (int it = 0; it < iters + 3; it++) {
    c.barrier().ok();
    auto t0 = Clock::now();
    std::vector<Flag> flags(W);
    uint32_t expect = 0;
    int posted = 0;
    for (int r = 0; r < W; r++) {
      if (r == me) continue;
      expect += e.imms_per_write(c.group(), c.peer(r), kPair);
      if (e.write_imm(c.group(), c.peer(r), {&sr->region(), kPair * r, kPair}, regions[r], kPair * me, kRawImm, flags[r].notify()).ok())
        posted++;
    }
    Flag in;
    bool ok = W == 1 || e.expect_imm(c.group(), kRawImm, expect, kAnyPeer, in.notify()).ok();
    for (int r = 0; r < W; r++)
      if (r != me) ok &= flags[r].wait(std::chrono::seconds(60)).ok();
    if (W > 1) ok &= in.wait(std::chrono::seconds(60)).ok();
    double us = us_since(t0);
    if (!ok || posted != W - 1) {
      res->error = "raw engine writes failed";
      return;
    }
    if (it >= 3) res->raw.push_back(us);
  }
}

double pct(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  size_t i = static_cast<size_t>(std::ceil(p * static_cast<double>(v.size()))) ;
  return v[std::min(v.size() - 1, i == 0 ? 0 : i - 1)];
}

CommunicatorOptions options(const std::string& provider) {
  CommunicatorOptions o;
  o.engine.config = global_config();
  o.engine.config.backend = BackendChoice::kFabric;
  o.engine.config.fabric_provider = provider;
  if (o.engine.config.ctrl_addr.empty()) o.engine.config.ctrl_addr = "127.0.0.1";
  o.engine.groups = {{0}};
  return o;
}

int run_child(const Shape& s, int rank, bool a2a) {
  Channel ch(3);
  RankResult res;
  {
    auto c = Communicator::create(rank, s.world, channel_allgather(ch, s.world), options(s.provider));
    if (!c.ok()) res.error = std::string("communicator: ") + c.status().message();
    else if (a2a) run_a2a(**c, s.iters, &res);
    else res = run_rank(**c, s);
    if (c.ok()) (*c)->barrier().ok();
  }
  ch.send(pack(res));
  return 0;
}

struct Row {
  Shape s;
  double dp50 = 0, dp99 = 0, cp50 = 0, cp99 = 0, ds50 = 0, dr50 = 0, cs50 = 0, cr50 = 0, memcpy_us = 0;
  double a2a_gbs = 0, raw_gbs = 0;
  bool verified = false;
  std::string error;
};

// Starts W - 1 ranks, runs rank 0 here, merges: per iteration the slowest rank.
Row run_world(const Shape& s, bool a2a) {
  Row row;
  row.s = s;
  std::vector<std::unique_ptr<PeerProcess>> ranks;
  for (int r = 1; r < s.world; r++)
    ranks.push_back(std::make_unique<PeerProcess>(std::vector<std::string>{encode(s), std::to_string(r), a2a ? "a2a" : "ep"}));
  std::vector<RankResult> all(s.world);
  {
    auto c = Communicator::create(0, s.world, hub_allgather(ranks), options(s.provider));
    if (!c.ok()) {
      row.error = std::string("communicator: ") + c.status().message();
      return row;
    }
    if (a2a) run_a2a(**c, s.iters, &all[0]);
    else all[0] = run_rank(**c, s);
    (*c)->barrier().ok();
  }
  for (int r = 1; r < s.world; r++) {
    std::vector<uint8_t> m;
    if (!ranks[r - 1]->channel().recv(&m, 600000) || !unpack(m, &all[r])) all[r].error = "rank " + std::to_string(r) + " sent no result";
    ranks[r - 1]->wait_exit(10000);
  }
  row.verified = !a2a;
  for (int r = 0; r < s.world; r++) {
    if (!all[r].error.empty() && row.error.empty()) row.error = "rank " + std::to_string(r) + ": " + all[r].error;
    row.verified &= all[r].verified;
  }
  if (!row.error.empty()) {
    row.verified = false;
    return row;
  }
  auto slowest = [&](auto member) {
    std::vector<double> v(((all[0]).*member).size(), 0);
    for (auto& a : all)
      for (size_t i = 0; i < v.size() && i < (a.*member).size(); i++) v[i] = std::max(v[i], (a.*member)[i]);
    return v;
  };
  if (a2a) {
    const double bytes = static_cast<double>(s.world - 1) * (1 << 20);
    row.a2a_gbs = bytes / pct(slowest(&RankResult::a2a), 0.5) / 1e3;
    row.raw_gbs = bytes / pct(slowest(&RankResult::raw), 0.5) / 1e3;
    return row;
  }
  std::vector<double> ds = slowest(&RankResult::ds), dr = slowest(&RankResult::dr), cs = slowest(&RankResult::cs),
                      cr = slowest(&RankResult::cr), d(ds.size()), cmb(cs.size());
  for (size_t i = 0; i < d.size(); i++) {
    double worst_d = 0, worst_c = 0;
    for (auto& a : all) {
      worst_d = std::max(worst_d, a.ds[i] + a.dr[i]);
      worst_c = std::max(worst_c, a.cs[i] + a.cr[i]);
    }
    d[i] = worst_d;
    cmb[i] = worst_c;
  }
  row.dp50 = pct(d, 0.5);
  row.dp99 = pct(d, 0.99);
  row.cp50 = pct(cmb, 0.5);
  row.cp99 = pct(cmb, 0.99);
  row.ds50 = pct(ds, 0.5);
  row.dr50 = pct(dr, 0.5);
  row.cs50 = pct(cs, 0.5);
  row.cr50 = pct(cr, 0.5);
  for (auto& a : all) row.memcpy_us = std::max(row.memcpy_us, a.memcpy_us);
  return row;
}

[[noreturn]] void usage(int code) {
  fprintf(code ? stderr : stdout,
          "usage: ep-bench [--provider P[,P]] [--world W[,W]] [--tokens T[,T]] [--hidden H] [--topk K] [--experts E]\n"
          "                [--dtype bf16|f32] [--iters N] [--dispatch split|once] [--combine split|once] [--json]\n"
          "                [--device host|cuda] [--plot FILE.png]\n"
          "MoE dispatch/combine through ponte's EpBuffer on W ranks started here (loopback), p50/p99 of the\n"
          "slowest rank per iteration, the send/recv split, and the memcpy of the same bytes in the same\n"
          "run; then all_to_all_v at 1 MiB per pair against the engine's own writes. Without shape\n"
          "arguments: the decode shape (128 tokens, H 7168, top-8, 256 experts, bf16) and a small one\n"
          "(H 128, 16 experts, top-2) on shm and tcp;ofi_rxm with W = 2; more ranks than cores are\n"
          "labelled oversubscribed. --plot also sweeps W and tokens per rank (small shape, shm).\n"
          "--combine once times EpBuffer::combine (one call: this rank's own rows are read from y in place)\n"
          "instead of combine_send + combine_recv (the default, split); --dispatch once times\n"
          "EpBuffer::dispatch (one call: this rank's own rows are unpacked from x in place).\n"
          "--device cuda puts x, recv_x and out in GPU memory (all ranks on GPU 0; EpConfig::device, the\n"
          "kernels of collectives/cuda/); memcpy_us stays the host copy of the same bytes.\n");
  exit(code);
}

std::vector<int> ints(const char* s) {
  std::vector<int> v;
  for (const char* p = s; *p;) {
    v.push_back(atoi(p));
    const char* c = strchr(p, ',');
    if (!c) break;
    p = c + 1;
  }
  return v;
}

void print_table(const std::vector<Row>& rows, bool dispatch_once, bool combine_once) {
  const long cores = sysconf(_SC_NPROCESSORS_ONLN);
  printf("ep-bench: dispatch and combine through ponte's EpBuffer, us (p50/p99 over iterations of the slowest rank)\n");
  if (!rows.empty() && rows[0].s.cuda) printf("tensors: GPU memory (--device cuda)\n");
  printf("dispatch: %s\n", dispatch_once ? "in one call (EpBuffer::dispatch; d_send 0, d_recv the whole call)"
                                          : "split (dispatch_send, then dispatch_recv)");
  printf("combine: %s\n", combine_once ? "in one call (EpBuffer::combine; c_send 0, c_recv the whole call)"
                                        : "split (combine_send, then combine_recv)");
  printf("%-12s %3s %6s %6s %4s %7s %5s | %9s %9s %8s %8s | %9s %9s %8s %8s | %9s %6s %s\n", "provider", "W", "tokens",
         "hidden", "topk", "experts", "dtype", "disp_p50", "disp_p99", "d_send", "d_recv", "comb_p50", "comb_p99", "c_send",
         "c_recv", "memcpy_us", "ratio", "verified");
  for (auto& r : rows) {
    if (!r.error.empty()) {
      printf("%-12s %3d %6d %6d %4d %7d %5s | FAILED: %s\n", r.s.provider.c_str(), r.s.world, r.s.tokens, r.s.hidden, r.s.topk,
             r.s.experts, dtype_name(r.s.dtype), r.error.c_str());
      continue;
    }
    printf("%-12s %3d %6d %6d %4d %7d %5s | %9.1f %9.1f %8.1f %8.1f | %9.1f %9.1f %8.1f %8.1f | %9.1f %6.2f %s%s\n",
           r.s.provider.c_str(), r.s.world, r.s.tokens, r.s.hidden, r.s.topk, r.s.experts, dtype_name(r.s.dtype), r.dp50,
           r.dp99, r.ds50, r.dr50, r.cp50, r.cp99, r.cs50, r.cr50, r.memcpy_us, (r.dp50 + r.cp50) / r.memcpy_us,
           r.verified ? "yes" : "NO", r.s.world > cores ? "  (oversubscribed)" : "");
  }
  printf("ratio = (disp_p50 + comb_p50) / memcpy_us: memcpy_us copies the routed rows once for dispatch and once for\n"
         "combine in one rank (what a rank must at least copy). d_send/d_recv and c_send/c_recv: p50 of each phase.\n");
}

void print_json(const std::vector<Row>& rows) {
  printf("{\"results\": [");
  for (size_t i = 0; i < rows.size(); i++) {
    const Row& r = rows[i];
    printf("%s\n  {\"provider\": \"%s\", \"world\": %d, \"tokens\": %d, \"hidden\": %d, \"topk\": %d, \"experts\": %d, "
           "\"dtype\": \"%s\", \"dispatch_p50_us\": %.3f, \"dispatch_p99_us\": %.3f, \"combine_p50_us\": %.3f, "
           "\"combine_p99_us\": %.3f, \"dispatch_call\": \"%s\", \"combine_call\": \"%s\", \"memcpy_us\": %.3f, \"verified\": %s}",
           i ? "," : "", r.s.provider.c_str(), r.s.world, r.s.tokens, r.s.hidden, r.s.topk, r.s.experts, dtype_name(r.s.dtype),
           r.dp50, r.dp99, r.cp50, r.cp99, r.s.dispatch_once ? "once" : "split", r.s.combine_once ? "once" : "split",
           r.memcpy_us,
           r.verified && r.error.empty() ? "true" : "false");
  }
  printf("\n]}\n");
}

int plot(const std::string& file, const std::vector<Row>& by_w, const std::vector<Row>& by_t) {
  std::string data = "W = [";
  for (auto& r : by_w) data += "(" + std::to_string(r.s.world) + "," + std::to_string(r.dp50) + "," + std::to_string(r.cp50) + "),";
  data += "]\nT = [";
  for (auto& r : by_t) data += "(" + std::to_string(r.s.tokens) + "," + std::to_string(r.dp50) + "," + std::to_string(r.cp50) + "),";
  data += "]\n";
  std::string py = data +
                   "import matplotlib\nmatplotlib.use('Agg')\nimport matplotlib.pyplot as plt\n"
                   "fig, ax = plt.subplots(1, 2, figsize=(10, 4))\n"
                   "for a, pts, xl in ((ax[0], W, 'ranks (W)'), (ax[1], T, 'tokens per rank')):\n"
                   "    pts = [p for p in pts if p[1] > 0]\n"
                   "    a.plot([p[0] for p in pts], [p[1] for p in pts], 'o-', label='dispatch p50')\n"
                   "    a.plot([p[0] for p in pts], [p[2] for p in pts], 's-', label='combine p50')\n"
                   "    a.set_xlabel(xl); a.set_ylabel('us'); a.grid(True); a.legend()\n"
                   "ax[0].set_title('small shape, shm, by W'); ax[1].set_title('small shape, shm, W=2, by tokens')\n"
                   "fig.tight_layout()\nfig.savefig('" + file + "')\n";
  std::string path = "/tmp/ep-bench-plot-" + std::to_string(getpid()) + ".py";
  FILE* f = fopen(path.c_str(), "w");
  if (!f) return 1;
  fputs(py.c_str(), f);
  fclose(f);
  int rc = system(("/usr/bin/python3 " + path).c_str());
  unlink(path.c_str());
  if (rc != 0) fprintf(stderr, "ep-bench: plotting failed (is python3-matplotlib installed?)\n");
  return rc == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  setenv("FI_TCP_IFACE", "lo", 0);
  if (argc >= 5 && std::string(argv[1]) == "--ponte-peer") return run_child(decode(argv[2]), atoi(argv[3]), std::string(argv[4]) == "a2a");
  std::vector<std::string> providers = {"shm", "tcp;ofi_rxm"};
  std::vector<int> worlds = {2}, tokens;
  int hidden = 0, topk = 0, experts = 0, iters = 50;
  DType dtype = DType::kBFloat16;
  bool json = false, custom = false;
  int combine_once = 0, dispatch_once = 0, cuda = 0;
  std::string plot_file;
  for (int i = 1; i < argc; i++) {
    std::string a = argv[i];
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) usage(2);
      return argv[++i];
    };
    if (a == "--provider") {
      providers.clear();
      std::string v = next();
      for (size_t p = 0; p <= v.size();) {  // ',' separates providers; tcp;ofi_rxm keeps its ';'
        size_t c = v.find(',', p);
        if (c == std::string::npos) c = v.size();
        if (c > p) providers.push_back(v.substr(p, c - p));
        p = c + 1;
      }
    } else if (a == "--world") worlds = ints(next());
    else if (a == "--tokens") { tokens = ints(next()); custom = true; }
    else if (a == "--hidden") { hidden = atoi(next()); custom = true; }
    else if (a == "--topk") { topk = atoi(next()); custom = true; }
    else if (a == "--experts") { experts = atoi(next()); custom = true; }
    else if (a == "--dtype") {
      std::string d = next();
      if (d == "bf16") dtype = DType::kBFloat16;
      else if (d == "f32") dtype = DType::kFloat32;
      else usage(2);
      custom = true;
    } else if (a == "--iters") iters = atoi(next());
    else if (a == "--combine") {
      std::string m = next();
      if (m == "once") combine_once = 1;
      else if (m != "split") usage(2);
    } else if (a == "--dispatch") {
      std::string m = next();
      if (m == "once") dispatch_once = 1;
      else if (m != "split") usage(2);
    } else if (a == "--device") {
      std::string m = next();
      if (m == "cuda") cuda = 1;
      else if (m != "host") usage(2);
    } else if (a == "--json") json = true;
    else if (a == "--plot") plot_file = next();
    else if (a == "-h" || a == "--help") usage(0);
    else usage(2);
  }
  std::vector<Shape> shapes;
  auto add = [&](int T, int H, int K, int E, DType d) {
    for (auto& p : providers)
      for (int w : worlds) {
        Shape s;
        s.provider = p;
        s.world = w;
        s.tokens = T;
        s.hidden = H;
        s.topk = K;
        s.experts = E;
        s.dtype = d;
        s.iters = iters;
        s.combine_once = combine_once;
        s.dispatch_once = dispatch_once;
        s.cuda = cuda;
        shapes.push_back(s);
      }
  };
  if (custom) {
    if (tokens.empty()) tokens = {128};
    for (int T : tokens) add(T, hidden ? hidden : 7168, topk ? topk : 8, experts ? experts : 256, dtype);
  } else {
    add(128, 7168, 8, 256, DType::kBFloat16);  // decode shape of the published numbers
    add(128, 128, 2, 16, DType::kBFloat16);    // small shape
  }
  std::vector<Row> rows;
  for (auto& s : shapes) {
    if (s.experts % s.world) {
      fprintf(stderr, "ep-bench: %d experts do not divide over %d ranks\n", s.experts, s.world);
      return 2;
    }
    rows.push_back(run_world(s, false));
    if (!json) fprintf(stderr, "ep-bench: %s W=%d T=%d H=%d done\n", s.provider.c_str(), s.world, s.tokens, s.hidden);
  }
  std::vector<Row> a2a;
  for (auto& p : providers) {
    Shape s;
    s.provider = p;
    s.world = worlds[0];
    s.iters = iters;
    a2a.push_back(run_world(s, true));
  }
  if (json) print_json(rows);
  else {
    print_table(rows, dispatch_once != 0, combine_once != 0);
    printf("\nall_to_all_v, 1 MiB per pair, against the engine's own writes of the same pattern (same run)\n");
    printf("%-12s %3s %12s %14s %6s\n", "provider", "W", "a2a_GB/s", "engine_GB/s", "ratio");
    for (auto& r : a2a) {
      if (!r.error.empty()) printf("%-12s %3d FAILED: %s\n", r.s.provider.c_str(), r.s.world, r.error.c_str());
      else printf("%-12s %3d %12.2f %14.2f %6.2f\n", r.s.provider.c_str(), r.s.world, r.a2a_gbs, r.raw_gbs, r.a2a_gbs / r.raw_gbs);
    }
    printf("GB/s = bytes each rank sends to other ranks per call / p50 call time of the slowest rank.\n");
  }
  int rc = 0;
  for (auto& r : rows) rc |= !r.error.empty() || !r.verified;
  for (auto& r : a2a) rc |= !r.error.empty();
  if (!plot_file.empty()) {
    std::vector<Row> by_w, by_t;
    for (int w : {2, 4, 8}) {
      Shape s;
      s.world = w, s.tokens = 128, s.hidden = 128, s.topk = 2, s.experts = 16, s.iters = iters;
      by_w.push_back(run_world(s, false));
    }
    for (int t : {16, 32, 64, 128}) {
      Shape s;
      s.world = 2, s.tokens = t, s.hidden = 128, s.topk = 2, s.experts = 16, s.iters = iters;
      by_t.push_back(run_world(s, false));
    }
    rc |= plot(plot_file, by_w, by_t);
  }
  return rc;
}
