# Shared by the launch configurations in this folder (sourced, not run): locates the plugin and the
# nccl-tests binaries, sets the environment every ponte run needs, builds launcher lines.

# Where libnccl-net-ponte.so is (default: the build folder next to this repository).
_here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PONTE_LIB_DIR="${PONTE_LIB_DIR:-$_here/../build/plugin}"
# nccl-tests binaries (build-nccl-tests.sh puts them in <src>/build).
NCCL_TESTS="${NCCL_TESTS:-$HOME/nccl-tests/build}"
NNODES="${NNODES:-2}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
LAUNCHER="${LAUNCHER:-$( [ -n "${SLURM_JOB_ID:-}" ] && echo srun || echo mpirun )}"

ponte_common_env() {
  if [ ! -f "$PONTE_LIB_DIR/libnccl-net-ponte.so" ]; then
    echo "libnccl-net-ponte.so not found in PONTE_LIB_DIR=$PONTE_LIB_DIR" >&2
    return 1
  fi
  PONTE_LIB_DIR="$(cd "$PONTE_LIB_DIR" && pwd)"  # absolute: every rank resolves it alike
  # NCCL_NET_PLUGIN=ponte resolves to libnccl-net-ponte.so on LD_LIBRARY_PATH; a full path works too.
  export LD_LIBRARY_PATH="$PONTE_LIB_DIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export NCCL_NET_PLUGIN="${NCCL_NET_PLUGIN:-ponte}"
  # NCCL 2.28.9 unloads an external net plugin when its last communicator is destroyed and cannot
  # load it again (NVIDIA/nccl#1978): a job that destroys and re-creates communicators would fall
  # back to its own transports (or fail). A reference count of 1 keeps the plugin loaded.
  export NCCL_NET_PLUGIN_REF_COUNT="${NCCL_NET_PLUGIN_REF_COUNT:-1}"
  # Shows "NET/ponte : ..." lines: backend, NICs per device, GPUDirect or not.
  export NCCL_DEBUG="${NCCL_DEBUG:-INFO}"
  export NCCL_DEBUG_SUBSYS="${NCCL_DEBUG_SUBSYS:-INIT,NET}"
}

# The -x list for Open MPI: every NCCL_*, PONTE_*, FI_* variable plus the library path.
mpirun_exports() {
  local v
  printf -- '-x LD_LIBRARY_PATH -x PATH '
  for v in $(env | grep -oE '^(NCCL|PONTE|FI|CUDA|UCX|OMPI_MCA)_[A-Za-z0-9_]*' | sort -u); do
    printf -- '-x %s ' "$v"
  done
}

# Runs one nccl-tests binary (all_reduce_perf, alltoall_perf, sendrecv_perf) on NNODES nodes with
# GPUS_PER_NODE ranks each, one GPU per rank. HOSTFILE names the nodes for mpirun.
run_nccl_test() {
  local test="$1"; shift
  local bin="$NCCL_TESTS/${test}_perf"
  [ -x "$bin" ] || { echo "$bin not found: build nccl-tests with build-nccl-tests.sh (MPI=1)" >&2; return 1; }
  local args=(-b 8 -e "${MAX_BYTES:-8G}" -f 2 -g 1 -c 1 -n "${ITERS:-20}" -w 5 "$@")
  local np=$((NNODES * GPUS_PER_NODE))
  case "$LAUNCHER" in
    mpirun)
      # shellcheck disable=SC2046
      set -x
      mpirun -np "$np" -N "$GPUS_PER_NODE" ${HOSTFILE:+--hostfile "$HOSTFILE"} --bind-to numa \
        --mca pml ob1 --mca btl tcp,self $(mpirun_exports) "$bin" "${args[@]}"
      ;;
    srun)
      set -x
      srun -N "$NNODES" --ntasks-per-node="$GPUS_PER_NODE" --gpus-per-node="$GPUS_PER_NODE" \
        --cpu-bind=none --mpi=pmix --export=ALL "$bin" "${args[@]}"
      ;;
    *) echo "LAUNCHER must be mpirun or srun" >&2; return 1 ;;
  esac
}

# The PyTorch script, unmodified torch.distributed on the NCCL backend, through ponte.
# On each node (or once under SLURM with srun): MASTER_ADDR = the first node.
run_torch() {
  set -x
  torchrun --nnodes="$NNODES" --nproc-per-node="$GPUS_PER_NODE" \
    --rdzv-backend=c10d --rdzv-endpoint="${MASTER_ADDR:-localhost}:${MASTER_PORT:-29500}" \
    --rdzv-id="${RDZV_ID:-ponte}" "$_here/torch_collectives.py" "$@"
}

# Dispatch for the per-machine scripts: all_reduce | alltoall | sendrecv | torch | env.
ponte_main() {
  local what="${1:-}"; shift || true
  case "$what" in
    all_reduce|alltoall|sendrecv) run_nccl_test "$what" "$@" ;;
    torch) run_torch "$@" ;;
    env) env | grep -E '^(NCCL|PONTE|FI)_' | sort ;;
    *) echo "usage: $0 all_reduce|alltoall|sendrecv|torch|env [extra test arguments]" >&2; return 2 ;;
  esac
}
