// nccl_pair_check: the one-GPU smoke test without MPI. Forks two ranks on one GPU, each with its
// own NCCL_HOSTID (so NCCL sends everything through the net plugin, or its Socket transport),
// runs all_reduce, alltoall and sendrecv over a size sweep, verifies, and prints nccl-tests-style
// tables (size, count, time, algbw, busbw, #wrong). Used by scripts/nccl-gpu-check when no MPI.
//
//   g++ -O2 -std=c++17 nccl_pair_check.cc -I$CUDA/include -L$CUDA/lib64 -lnccl -lcudart -o pair
//   ./pair [--min 1K] [--max 64M] [--iters 10] [--gpu 0]
#include <cuda_runtime.h>
#include <nccl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

#define CHECK_CUDA(x)                                                              \
  do {                                                                             \
    cudaError_t e_ = (x);                                                          \
    if (e_ != cudaSuccess) {                                                       \
      std::fprintf(stderr, "rank %d: %s: %s\n", g_rank, #x, cudaGetErrorString(e_)); \
      std::exit(2);                                                                \
    }                                                                              \
  } while (0)
#define CHECK_NCCL(x)                                                                  \
  do {                                                                                 \
    ncclResult_t r_ = (x);                                                             \
    if (r_ != ncclSuccess) {                                                           \
      std::fprintf(stderr, "rank %d: %s: %s\n", g_rank, #x, ncclGetErrorString(r_));   \
      std::exit(3);                                                                    \
    }                                                                                  \
  } while (0)

int g_rank = -1;
constexpr int kRanks = 2;

size_t parse_bytes(const char* s) {
  char* end = nullptr;
  double v = std::strtod(s, &end);
  if (*end == 'K' || *end == 'k') v *= 1024;
  if (*end == 'M' || *end == 'm') v *= 1024 * 1024;
  if (*end == 'G' || *end == 'g') v *= 1024.0 * 1024 * 1024;
  return static_cast<size_t>(v);
}

// One collective at one size: returns seconds per iteration and the number of wrong elements.
double run(const char* op, ncclComm_t comm, cudaStream_t s, float* send, float* recv,
           size_t count, int iters, long* wrong) {
  const int peer = 1 - g_rank;
  auto once = [&]() {
    if (!std::strcmp(op, "all_reduce")) {
      CHECK_NCCL(ncclAllReduce(send, recv, count, ncclFloat, ncclSum, comm, s));
    } else if (!std::strcmp(op, "alltoall")) {
      const size_t chunk = count / kRanks;
      CHECK_NCCL(ncclGroupStart());
      for (int p = 0; p < kRanks; ++p) {
        CHECK_NCCL(ncclSend(send + p * chunk, chunk, ncclFloat, p, comm, s));
        CHECK_NCCL(ncclRecv(recv + p * chunk, chunk, ncclFloat, p, comm, s));
      }
      CHECK_NCCL(ncclGroupEnd());
    } else {  // sendrecv: each rank sends to the other and receives from it
      CHECK_NCCL(ncclGroupStart());
      CHECK_NCCL(ncclSend(send, count, ncclFloat, peer, comm, s));
      CHECK_NCCL(ncclRecv(recv, count, ncclFloat, peer, comm, s));
      CHECK_NCCL(ncclGroupEnd());
    }
  };
  // send[i] = rank * 1e6 + i mod 1000003: every value (and every sum) is exact in float.
  std::vector<float> host(count);
  for (size_t i = 0; i < count; ++i) host[i] = static_cast<float>(g_rank * 1000000 + (i % 1000003));
  CHECK_CUDA(cudaMemcpy(send, host.data(), count * sizeof(float), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemset(recv, 0, count * sizeof(float)));
  once();
  CHECK_CUDA(cudaStreamSynchronize(s));
  CHECK_CUDA(cudaMemcpy(host.data(), recv, count * sizeof(float), cudaMemcpyDeviceToHost));
  *wrong = 0;
  const size_t chunk = count / kRanks;
  for (size_t i = 0; i < count; ++i) {
    const float mine = static_cast<float>(i % 1000003);
    float want;
    if (!std::strcmp(op, "all_reduce")) {
      want = 2 * mine + 1000000;  // rank 0 + rank 1
    } else if (!std::strcmp(op, "alltoall")) {
      const size_t p = i / chunk;  // chunk p came from rank p, its chunk g_rank
      want = static_cast<float>(p * 1000000 + ((g_rank * chunk + i % chunk) % 1000003));
    } else {
      want = static_cast<float>(peer * 1000000) + mine;
    }
    if (host[i] != want) ++*wrong;
  }
  for (int i = 0; i < 3; ++i) once();  // warmup
  CHECK_CUDA(cudaStreamSynchronize(s));
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) once();
  CHECK_CUDA(cudaStreamSynchronize(s));
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / iters;
}

int rank_main(int rank, int id_fd_read, int id_fd_write, size_t min_b, size_t max_b, int iters,
              int gpu) {
  g_rank = rank;
  const std::string hostid = "ponte-smoke-host-" + std::to_string(rank);
  setenv("NCCL_HOSTID", hostid.c_str(), 1);
  CHECK_CUDA(cudaSetDevice(gpu));
  ncclUniqueId id;
  if (rank == 0) {
    CHECK_NCCL(ncclGetUniqueId(&id));
    if (write(id_fd_write, &id, sizeof(id)) != static_cast<ssize_t>(sizeof(id))) return 4;
  } else {
    if (read(id_fd_read, &id, sizeof(id)) != static_cast<ssize_t>(sizeof(id))) return 4;
  }
  ncclComm_t comm;
  CHECK_NCCL(ncclCommInitRank(&comm, kRanks, id, rank));
  cudaStream_t s;
  CHECK_CUDA(cudaStreamCreate(&s));
  float *send = nullptr, *recv = nullptr;
  CHECK_CUDA(cudaMalloc(&send, max_b));
  CHECK_CUDA(cudaMalloc(&recv, max_b));
  long total_wrong = 0;
  for (const char* op : {"all_reduce", "alltoall", "sendrecv"}) {
    // busbw as nccl-tests defines it, for 2 ranks: all_reduce 2(n-1)/n = 1, alltoall (n-1)/n,
    // sendrecv 1.
    const double factor = !std::strcmp(op, "alltoall") ? 0.5 : 1.0;
    if (rank == 0) {
      std::printf("# %s_perf (2 ranks, 1 GPU, NCCL_NET=%s)\n", op,
                  getenv("NCCL_NET") ? getenv("NCCL_NET") : "(default)");
      std::printf("#%12s %12s %6s %10s %9s %9s %7s\n", "size", "count", "type", "time(us)",
                  "algbw", "busbw", "#wrong");
    }
    for (size_t b = min_b; b <= max_b; b *= 4) {
      const size_t count = b / sizeof(float) / kRanks * kRanks;
      if (count == 0) continue;
      long wrong = 0;
      const double sec = run(op, comm, s, send, recv, count, iters, &wrong);
      total_wrong += wrong;
      const double algbw = static_cast<double>(count * sizeof(float)) / sec / 1e9;
      if (rank == 0)
        std::printf(" %12zu %12zu %6s %10.1f %9.3f %9.3f %7ld\n", count * sizeof(float), count,
                    "float", sec * 1e6, algbw, algbw * factor, wrong);
      std::fflush(stdout);
    }
    if (rank == 0) std::printf("# Avg bus bandwidth: see busbw above\n#\n");
  }
  CHECK_NCCL(ncclCommDestroy(comm));
  cudaFree(send);
  cudaFree(recv);
  return total_wrong == 0 ? 0 : 5;
}

}  // namespace

int main(int argc, char** argv) {
  size_t min_b = 1024, max_b = 64 << 20;
  int iters = 10, gpu = 0;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--min")) min_b = parse_bytes(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--max")) max_b = parse_bytes(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--iters")) iters = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--gpu")) gpu = std::atoi(argv[i + 1]);
  }
  int p[2];
  if (pipe(p) != 0) return 1;
  pid_t pids[kRanks];
  for (int r = 0; r < kRanks; ++r) {
    pids[r] = fork();  // before any CUDA or NCCL call in this process
    if (pids[r] == 0) _exit(rank_main(r, p[0], p[1], min_b, max_b, iters, gpu));
  }
  int failed = 0;
  for (int r = 0; r < kRanks; ++r) {
    int st = 0;
    waitpid(pids[r], &st, 0);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
      std::fprintf(stderr, "rank %d failed (status %d)\n", r, WIFEXITED(st) ? WEXITSTATUS(st) : -1);
      failed = 1;
    }
  }
  return failed;
}
