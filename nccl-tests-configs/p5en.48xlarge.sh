#!/usr/bin/env bash
# AWS p5en.48xlarge: 8x H200, 16x 200G EFA, two per GPU; ponte's libfabric backend on EFA.
#   HOSTFILE=hosts NNODES=2 ./p5en.48xlarge.sh all_reduce     (or alltoall, sendrecv, torch, env)
set -euo pipefail
source "$(dirname "$0")/common.sh"
ponte_common_env

export PONTE_BACKEND=fabric
export PONTE_FABRIC_PROVIDER=efa
export LD_LIBRARY_PATH="/opt/amazon/efa/lib:$LD_LIBRARY_PATH"
export FI_EFA_USE_DEVICE_RDMA=1
# The two EFA NICs next to each GPU become one NCCL device (makeVDevice), striped.
export NCCL_NET_MERGE_LEVEL="${NCCL_NET_MERGE_LEVEL:-PXB}"
export NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-^lo,docker,veth}"
export PONTE_STRIPE_MIN="${PONTE_STRIPE_MIN:-256k}"

GPUS_PER_NODE=8
ponte_main "$@"
