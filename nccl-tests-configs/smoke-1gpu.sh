#!/usr/bin/env bash
# One-GPU smoke test: two ranks on one GPU made to look like two hosts (a different NCCL_HOSTID per
# rank), so NCCL cannot use P2P or SHM and every byte goes through the net plugin: ponte on
# tcp;ofi_rxm over loopback. Proves the plugin works under real NCCL; the numbers mean little.
#   ./smoke-1gpu.sh all_reduce | alltoall | sendrecv | torch | pair | env
#   SMOKE_NET=socket ./smoke-1gpu.sh all_reduce     (the same through NCCL's own Socket transport)
#   SMOKE_NET=/path/libnccl-net.so ./smoke-1gpu.sh torch   (the same through another net plugin,
#                                        e.g. aws-ofi-nccl, on the same libfabric provider)
# all_reduce/alltoall/sendrecv need nccl-tests built with MPI=1 and an mpirun; `pair` needs neither
# (nccl_pair_check.cc, built on first use, starts both ranks itself).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"

# Rank mode: run by mpirun/torchrun for each rank. Gives the rank its own host identity.
if [ "${1:-}" = "--rank" ]; then
  shift
  rank="${OMPI_COMM_WORLD_RANK:-${PMIX_RANK:-${PMI_RANK:-${SLURM_PROCID:-${RANK:-0}}}}}"
  export NCCL_HOSTID="ponte-smoke-host-$rank"
  exec "$@"
fi

source "$here/common.sh"
NNODES=1
GPUS_PER_NODE=2
SMOKE_NET="${SMOKE_NET:-ponte}"

export CUDA_VISIBLE_DEVICES="${SMOKE_GPU:-${CUDA_VISIBLE_DEVICES:-0}}"
export NCCL_TESTS_DEVICE=0            # nccl-tests: both ranks on (visible) GPU 0
export NCCL_MNNVL_ENABLE=0
export NCCL_NVLS_ENABLE=0
export NCCL_P2P_DISABLE=1             # already implied by the different host ids; explicit anyway
export NCCL_SHM_DISABLE=1
export NCCL_SOCKET_IFNAME=lo          # NCCL's bootstrap (and its Socket transport) on loopback
if [ "$SMOKE_NET" = "socket" ]; then
  export NCCL_NET_PLUGIN=none
  export NCCL_NET=Socket
  export NCCL_DEBUG="${NCCL_DEBUG:-INFO}" NCCL_DEBUG_SUBSYS="${NCCL_DEBUG_SUBSYS:-INIT,NET}"
elif [ "$SMOKE_NET" != "ponte" ]; then
  [ -f "$SMOKE_NET" ] || { echo "SMOKE_NET=$SMOKE_NET: neither ponte, socket nor a plugin file" >&2; exit 2; }
  export NCCL_NET_PLUGIN="$SMOKE_NET"
  export NCCL_NET_PLUGIN_REF_COUNT="${NCCL_NET_PLUGIN_REF_COUNT:-1}"
  export NCCL_DEBUG="${NCCL_DEBUG:-INFO}" NCCL_DEBUG_SUBSYS="${NCCL_DEBUG_SUBSYS:-INIT,NET}"
  export FI_PROVIDER="${FI_PROVIDER:-tcp;ofi_rxm}" FI_TCP_IFACE=lo
else
  ponte_common_env
  export NCCL_NET=ponte               # ponte or a loud failure: no silent fallback to Socket
  export PONTE_BACKEND=fabric
  export PONTE_FABRIC_PROVIDER="tcp;ofi_rxm"
  export FI_TCP_IFACE=lo
  export PONTE_CTRL_ADDR=127.0.0.1
fi

case "${1:-}" in
  all_reduce|alltoall|sendrecv)
    test="$1"; shift
    bin="$NCCL_TESTS/${test}_perf"
    [ -x "$bin" ] || { echo "$bin not found: build nccl-tests with build-nccl-tests.sh (MPI=1)" >&2; exit 1; }
    set -x
    # shellcheck disable=SC2046
    exec mpirun -np 2 --host localhost:2 --bind-to none --mca pml ob1 --mca btl tcp,self \
      $(mpirun_exports) "$here/smoke-1gpu.sh" --rank \
      "$bin" -b 1K -e "${MAX_BYTES:-64M}" -f 4 -g 1 -c 1 -n "${ITERS:-10}" -w 3 "$@"
    ;;
  torch)
    shift
    set -x
    exec torchrun --standalone --nproc-per-node=2 --no-python \
      "$here/smoke-1gpu.sh" --rank python3 "$here/torch_collectives.py" "$@"
    ;;
  pair)
    # Without MPI: nccl_pair_check forks the two ranks itself (each with its own NCCL_HOSTID) and
    # runs all_reduce, alltoall and sendrecv with nccl-tests-style output.
    shift
    pair="${PAIR_BIN:-${TMPDIR:-/tmp}/nccl_pair_check}"
    cuda="${CUDA_HOME:-/usr/local/cuda}"
    nccl="${NCCL_HOME:-$cuda}"
    if [ ! -x "$pair" ] || { [ "${PONTE_SKIP_BUILD:-0}" != 1 ] && [ "$here/nccl_pair_check.cc" -nt "$pair" ]; }; then
      g++ -O2 -std=c++17 "$here/nccl_pair_check.cc" -I"$nccl/include" -I"$cuda/include" \
        -L"$nccl/lib" -L"$cuda/lib64" -Wl,-rpath,"$nccl/lib" -lnccl -lcudart -o "$pair"
    fi
    set -x
    exec "$pair" --min 1K --max "${MAX_BYTES:-64M}" --iters "${ITERS:-10}" --gpu 0 "$@"
    ;;
  env) env | grep -E '^(NCCL|PONTE|FI|CUDA)_' | sort ;;
  *) echo "usage: $0 all_reduce|alltoall|sendrecv|torch|pair|env [extra test arguments]" >&2; exit 2 ;;
esac
