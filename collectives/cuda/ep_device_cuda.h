// The CUDA EpDevice: an EpBuffer whose x, recv_x, y and out are CUDA device memory, its arena
// host memory the GPU maps (cudaHostAlloc), its packing and unpacking done by ep_kernels.
#pragma once

#include <memory>

#include "collectives/ep_device.h"

namespace ponte::cuda {

// On CUDA device `device` (-1: the calling thread's current one), launching on `stream` (a
// cudaStream_t; nullptr: a stream of its own, created here, which waits for the legacy default
// stream). Each EpBuffer call returns with its kernels done; x and y written on another stream must
// be complete before the call (synchronize that stream). The EpBuffer's calls run on a thread
// whose current CUDA device is `device` (this call makes it current on the calling thread). Outlives
// every EpBuffer given it.
Result<std::unique_ptr<EpDevice>> make_ep_device(int device = -1, void* stream = nullptr);

}  // namespace ponte::cuda
