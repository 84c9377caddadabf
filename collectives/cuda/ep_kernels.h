// ep_kernels: the CUDA side of EpBuffer's block layout (collectives/ep_layout.h, mirrored kernel for
// function): count routes per expert, pack rows by destination, unpack, reduce combine rows, finish;
// and the GPU <-> CPU-proxy signals (host-pinned flags). Built with PONTE_WITH_CUDA; the layout they
// mirror is tested on the CPU (tests/collectives/ep_layout_test), the kernels on a GPU by
// scripts/ep-gpu-check. All pointers are device memory unless named host_*; stream is a cudaStream_t.
#pragma once

#include <cstddef>
#include <cstdint>

#include "collectives/ep_layout.h"

namespace ponte::cuda {

// Returns 0 or the cudaError_t of the launch (the kernels themselves report through the stream).
// counts [W * L]: as count_routes (zeroed first).
int ep_count_routes(const EpShape& s, const int64_t* topk_idx, int tokens, int32_t* counts, void* stream);
// As pack_dispatch, byte for byte and with the same send_map: blocks_base + block_stride * d +
// block_offset is destination d's first row. One thread per destination numbers the rows and
// copies in token order first (token_row: device scratch of max_tokens * W; cursor: W * L), then
// one thread block per (token, destination) writes its row. rows_out [W] (device): rows per
// destination, for the proxy's headers.
int ep_pack_dispatch(const EpShape& s, const void* x, const int64_t* topk_idx, int tokens, const int32_t* counts,
                     uint8_t* blocks_base, size_t block_stride, size_t block_offset, int32_t* cursor, int32_t* token_row,
                     int32_t* send_map, int32_t* rows_out, void* stream);
// As unpack_dispatch_block for one source's nrows rows (the header's, read by the proxy): begins
// [L] (device), src_info [L, W * max_tokens, 2]; pos: device scratch of max_tokens * K (each
// copy's place in its expert, numbered by one thread per expert in the host's order). Tags out of
// range and copies past an expert's count are skipped, not reported: the host's unpack is the one
// that names them.
int ep_unpack_dispatch_block(const EpShape& s, const uint8_t* rows, uint32_t nrows, const int32_t* counts, int src,
                             const int32_t* begins, void* recv_x, int32_t* src_info, int32_t* pos, void* stream);
// As pack_combine_block: rows of y answering src's block, in its order; nrows = sum of src's counts.
int ep_pack_combine_block(const EpShape& s, const void* y, int src, const int32_t* layout_range, uint32_t nrows,
                          uint8_t* rows, void* stream);
// As reduce_combine_block (acc float32 [max_tokens, H], atomics: rows of one token may come from
// several destinations at once).
int ep_reduce_combine_block(const EpShape& s, const uint8_t* rows, uint32_t nrows, const int32_t* send_map_d,
                            const float* topk_weights, float* acc, void* stream);
// As finish_combine.
int ep_finish_combine(const EpShape& s, const float* acc, const uint8_t* routed, int tokens, void* out, bool accumulate,
                      void* stream);

// GPU -> proxy: once the stream reaches this point, *host_flag = value (host-pinned, mapped memory;
// the proxy polls it, then posts the writes). Proxy -> GPU: the stream waits until *host_flag >=
// value (the proxy sets it when the immediates counted the data in).
int ep_signal_host(volatile uint32_t* host_flag, uint32_t value, void* stream);
int ep_wait_host(const volatile uint32_t* host_flag, uint32_t value, void* stream);

}  // namespace ponte::cuda
