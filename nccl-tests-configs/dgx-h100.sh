#!/usr/bin/env bash
# NVIDIA DGX H100: 8x H100, 8x ConnectX-7 400G (InfiniBand), one NIC per GPU; ponte's verbs backend.
#   HOSTFILE=hosts NNODES=2 ./dgx-h100.sh all_reduce     (or alltoall, sendrecv, torch, env)
# Under SLURM the launcher is srun. nccl-tests must be built with MPI=1 (build-nccl-tests.sh).
set -euo pipefail
source "$(dirname "$0")/common.sh"
ponte_common_env

export PONTE_BACKEND=verbs
# The eight compute ConnectX-7 ports (the storage NICs stay out). Check the names with `ibstat`:
# they differ between DGX OS releases. "=" asks for exact names, as in NCCL_IB_HCA.
export PONTE_IB_HCA="${PONTE_IB_HCA:-=mlx5_0,mlx5_3,mlx5_4,mlx5_5,mlx5_6,mlx5_9,mlx5_10,mlx5_11}"
# InfiniBand: no GID choice needed (RoCE would take PONTE_IB_GID_INDEX / PONTE_IB_TC).
# Control sockets (liveness, handshake) and NCCL's bootstrap on the management network:
export NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-^lo,docker,virbr}"
# One NIC per GPU: no fusion of NICs into virtual devices.
export NCCL_NET_MERGE_LEVEL="${NCCL_NET_MERGE_LEVEL:-LOC}"
# GPUDirect RDMA through DMA-BUF (or nvidia-peermem): ponte reports NCCL_PTR_CUDA only when it works.
export NCCL_NET_GDR_LEVEL="${NCCL_NET_GDR_LEVEL:-PHB}"

GPUS_PER_NODE=8
ponte_main "$@"
