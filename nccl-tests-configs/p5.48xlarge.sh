#!/usr/bin/env bash
# AWS p5.48xlarge: 8x H100, 32x 100G EFA, four per GPU; ponte's libfabric backend on EFA.
#   HOSTFILE=hosts NNODES=2 ./p5.48xlarge.sh all_reduce     (or alltoall, sendrecv, torch, env)
# Needs the AWS EFA installer's libfabric (/opt/amazon/efa, with FI_HMEM CUDA support); ponte loads
# it from there before the system one (PONTE_FABRIC_LIB names another).
set -euo pipefail
source "$(dirname "$0")/common.sh"
ponte_common_env

export PONTE_BACKEND=fabric
export PONTE_FABRIC_PROVIDER=efa
export LD_LIBRARY_PATH="/opt/amazon/efa/lib:$LD_LIBRARY_PATH"
# GPUDirect RDMA on EFA (p4d/p5 support it; ponte reports NCCL_PTR_CUDA only when FI_HMEM works).
export FI_EFA_USE_DEVICE_RDMA=1
# The four EFA NICs behind each GPU's PCIe switch become one NCCL device: NCCL merges NICs up to
# this path type and calls ponte's makeVDevice, which stripes every message over all four.
# (NCCL_NET_FORCE_MERGE lists the groups by hand if the topology detection differs.)
export NCCL_NET_MERGE_LEVEL="${NCCL_NET_MERGE_LEVEL:-PXB}"
export NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-^lo,docker,veth}"
# Messages above this size are striped over the NICs of a device.
export PONTE_STRIPE_MIN="${PONTE_STRIPE_MIN:-256k}"

GPUS_PER_NODE=8
ponte_main "$@"
