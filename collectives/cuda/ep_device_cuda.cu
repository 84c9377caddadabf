// The CUDA EpDevice (ep_device_cuda.h): memory and copies through the CUDA runtime, the layout work
// through ep_kernels, every call on one stream; errors come back as Status naming the CUDA call.
#include <cuda_runtime.h>

#include <cstring>

#include "collectives/cuda/ep_device_cuda.h"
#include "collectives/cuda/ep_kernels.h"

namespace ponte::cuda {

namespace {

Status cuda_status(int err, const char* what) {
  if (err == cudaSuccess) return Status::Ok();
  return Status(Code::kUnavailable, "CUDA: %s: %s", what, cudaGetErrorString(static_cast<cudaError_t>(err)));
}

class CudaEpDevice final : public EpDevice {
 public:
  CudaEpDevice(int device, cudaStream_t stream, bool own) : device_(device), stream_(stream), own_(own) {}
  ~CudaEpDevice() override {
    if (own_) cudaStreamDestroy(stream_);
  }
  const char* name() const override { return "cuda"; }

  Result<uint8_t*> alloc_mapped(size_t bytes) override {
    PONTE_RETURN_IF_ERROR(cuda_status(cudaSetDevice(device_), "cudaSetDevice"));
    void* p = nullptr;
    PONTE_RETURN_IF_ERROR(cuda_status(cudaHostAlloc(&p, bytes, cudaHostAllocMapped | cudaHostAllocPortable), "cudaHostAlloc"));
    // The kernels take the host address itself: with unified addressing (every 64-bit platform
    // CUDA 13 runs on) the device pointer of mapped host memory is the same address.
    void* dp = nullptr;
    Status st = cuda_status(cudaHostGetDevicePointer(&dp, p, 0), "cudaHostGetDevicePointer");
    if (st.ok() && dp != p) st = Status(Code::kUnavailable, "CUDA: mapped host memory has another device address (no unified addressing)");
    if (!st.ok()) {
      cudaFreeHost(p);
      return st;
    }
    memset(p, 0, bytes);
    return static_cast<uint8_t*>(p);
  }
  void free_mapped(uint8_t* p) override {
    if (p) cudaFreeHost(p);
  }
  Result<void*> alloc(size_t bytes) override {
    PONTE_RETURN_IF_ERROR(cuda_status(cudaSetDevice(device_), "cudaSetDevice"));
    void* p = nullptr;
    PONTE_RETURN_IF_ERROR(cuda_status(cudaMalloc(&p, bytes ? bytes : 1), "cudaMalloc"));
    return p;
  }
  void free(void* p) override {
    if (p) cudaFree(p);
  }
  Status upload(void* dst, const void* src, size_t bytes) override {
    if (!bytes) return Status::Ok();
    return cuda_status(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_), "cudaMemcpyAsync (to the device)");
  }
  Status download(void* dst, const void* src, size_t bytes) override {
    if (bytes) PONTE_RETURN_IF_ERROR(cuda_status(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_),
                                                 "cudaMemcpyAsync (to the host)"));
    return sync();
  }
  Status fill(void* dst, int byte, size_t bytes) override {
    return cuda_status(cudaMemsetAsync(dst, byte, bytes, stream_), "cudaMemsetAsync");
  }
  Status sync() override { return cuda_status(cudaStreamSynchronize(stream_), "cudaStreamSynchronize"); }

  Status pack_dispatch(const EpShape& s, const void* x, const int64_t* topk_idx, int tokens, const int32_t* counts,
                       uint8_t* blocks_base, size_t block_stride, size_t block_offset, int32_t* cursor, int32_t* token_row,
                       int32_t* send_map, int32_t* rows_out) override {
    return cuda_status(ep_pack_dispatch(s, x, topk_idx, tokens, counts, blocks_base, block_stride, block_offset, cursor,
                                        token_row, send_map, rows_out, stream_),
                       "pack_dispatch kernels");
  }
  Status unpack_dispatch_block(const EpShape& s, const uint8_t* rows, uint32_t nrows, const int32_t* counts, int src,
                               const int32_t* begins, void* recv_x, int32_t* src_info, int32_t* pos) override {
    return cuda_status(ep_unpack_dispatch_block(s, rows, nrows, counts, src, begins, recv_x, src_info, pos, stream_),
                       "unpack_dispatch_block kernels");
  }
  Status pack_combine_block(const EpShape& s, const void* y, int src, const int32_t* layout_range, uint32_t nrows,
                            uint8_t* rows) override {
    return cuda_status(ep_pack_combine_block(s, y, src, layout_range, nrows, rows, stream_), "pack_combine_block kernel");
  }
  Status reduce_combine_block(const EpShape& s, const uint8_t* rows, uint32_t nrows, const int32_t* send_map_d,
                              const float* topk_weights, float* acc) override {
    return cuda_status(ep_reduce_combine_block(s, rows, nrows, send_map_d, topk_weights, acc, stream_),
                       "reduce_combine_block kernel");
  }
  Status finish_combine(const EpShape& s, const float* acc, const uint8_t* routed, int tokens, void* out,
                        bool accumulate) override {
    return cuda_status(ep_finish_combine(s, acc, routed, tokens, out, accumulate, stream_), "finish_combine kernel");
  }

 private:
  int device_;
  cudaStream_t stream_;
  bool own_;
};

}  // namespace

Result<std::unique_ptr<EpDevice>> make_ep_device(int device, void* stream) {
  if (device < 0) PONTE_RETURN_IF_ERROR(cuda_status(cudaGetDevice(&device), "cudaGetDevice"));
  int n = 0;
  PONTE_RETURN_IF_ERROR(cuda_status(cudaGetDeviceCount(&n), "cudaGetDeviceCount"));
  if (device >= n) return Status(Code::kInvalidArgument, "CUDA: device %d of %d", device, n);
  PONTE_RETURN_IF_ERROR(cuda_status(cudaSetDevice(device), "cudaSetDevice"));
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const bool own = s == nullptr;
  // A blocking stream: it waits for work on the legacy default stream (x and y written there are
  // there before a kernel reads them); on other streams the caller synchronizes first.
  if (own) PONTE_RETURN_IF_ERROR(cuda_status(cudaStreamCreate(&s), "cudaStreamCreate"));
  return std::unique_ptr<EpDevice>(new CudaEpDevice(device, s, own));
}

}  // namespace ponte::cuda
