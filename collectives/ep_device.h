// EpDevice: where an EpBuffer's rows live when not in host memory: the memory its kernels use and
// the kernels that mirror ep_layout's pack, unpack and reduce (collectives/cuda/ep_device_cuda.h).
#pragma once

#include <cstddef>
#include <cstdint>

#include "collectives/ep_layout.h"
#include "core/status.h"

namespace ponte {

// With EpConfig::device set, an EpBuffer's x, recv_x, y and out are that device's memory; topk_idx,
// topk_weights and recv_count stay in host memory (the CPU drives the engine and writes the block
// headers, so it routes). The arena is host memory the device maps (every NIC registers it), the
// kernels pack into it and unpack from it, and the calling thread is the proxy: it waits for the
// device before it posts a block and after the last kernel of a receive. Launches are ordered on
// one stream; a failed launch or copy fails the call that made it, by name.
class EpDevice {
 public:
  virtual ~EpDevice() = default;
  virtual const char* name() const = 0;
  // Host memory the device reads and writes at the same address (page-aligned, zeroed).
  virtual Result<uint8_t*> alloc_mapped(size_t bytes) = 0;
  virtual void free_mapped(uint8_t* p) = 0;
  virtual Result<void*> alloc(size_t bytes) = 0;  // device memory
  virtual void free(void* p) = 0;
  // Host -> device; src may be reused when it returns.
  virtual Status upload(void* dst, const void* src, size_t bytes) = 0;
  // Device -> host, after everything launched before it: returns with the bytes in dst.
  virtual Status download(void* dst, const void* src, size_t bytes) = 0;
  virtual Status fill(void* dst, int byte, size_t bytes) = 0;
  // Waits for everything launched so far.
  virtual Status sync() = 0;
  // ep_layout's functions on the device (collectives/cuda/ep_kernels.h says how each one maps):
  // destination d's rows start at blocks_base + block_stride * d + block_offset.
  virtual Status pack_dispatch(const EpShape& s, const void* x, const int64_t* topk_idx, int tokens, const int32_t* counts,
                               uint8_t* blocks_base, size_t block_stride, size_t block_offset, int32_t* cursor,
                               int32_t* token_row, int32_t* send_map, int32_t* rows_out) = 0;
  virtual Status unpack_dispatch_block(const EpShape& s, const uint8_t* rows, uint32_t nrows, const int32_t* counts, int src,
                                       const int32_t* begins, void* recv_x, int32_t* src_info, int32_t* pos) = 0;
  virtual Status pack_combine_block(const EpShape& s, const void* y, int src, const int32_t* layout_range, uint32_t nrows,
                                    uint8_t* rows) = 0;
  virtual Status reduce_combine_block(const EpShape& s, const uint8_t* rows, uint32_t nrows, const int32_t* send_map_d,
                                      const float* topk_weights, float* acc) = 0;
  virtual Status finish_combine(const EpShape& s, const float* acc, const uint8_t* routed, int tokens, void* out,
                                bool accumulate) = 0;
};

}  // namespace ponte
