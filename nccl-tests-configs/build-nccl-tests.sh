#!/usr/bin/env bash
# Builds nccl-tests from a source folder (a clone or release tarball of NVIDIA/nccl-tests):
#   ./build-nccl-tests.sh /path/to/nccl-tests [MPI=1] [MPI_HOME=/usr/lib/x86_64-linux-gnu/openmpi]
# Binaries land in /path/to/nccl-tests/build (point NCCL_TESTS there). CUDA_HOME and NCCL_HOME
# default to /usr/local/cuda (where the CUDA toolkit and NCCL are installed); MPI=1 is needed for
# multi-process runs (mpirun, srun --mpi=pmix) and found with mpicc when MPI_HOME is not given.
set -euo pipefail
src="${1:?usage: $0 NCCL_TESTS_SOURCE_DIR [make variables]}"
shift
[ -f "$src/src/Makefile" ] || { echo "$src does not look like nccl-tests (no src/Makefile)" >&2; exit 1; }
CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
NCCL_HOME="${NCCL_HOME:-$CUDA_HOME}"
mpi=1
mpi_home=""
for a in "$@"; do
  case "$a" in MPI=*) mpi="${a#MPI=}" ;; MPI_HOME=*) mpi_home="${a#MPI_HOME=}" ;; esac
done
if [ "$mpi" = 1 ] && [ -z "$mpi_home" ]; then
  if command -v mpicc >/dev/null; then
    # The folder whose include/ holds mpi.h, from the compiler wrapper's own flags.
    inc="$(mpicc -showme:incdirs 2>/dev/null | awk '{print $1}' || true)"
    [ -n "$inc" ] || inc="$(dirname "$(dirname "$(command -v mpicc)")")/include"
    mpi_home="$(dirname "$inc")"
  else
    echo "MPI=1 but no mpicc found: install an MPI (apt-get install libopenmpi-dev) or pass MPI=0" >&2
    exit 1
  fi
fi
# Compile for the GPUs of this machine when nvidia-smi can tell, else Hopper (sm_90).
gencode="${NVCC_GENCODE:-}"
if [ -z "$gencode" ] && command -v nvidia-smi >/dev/null; then
  cc="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d . || true)"
  [ -n "$cc" ] && gencode="-gencode=arch=compute_$cc,code=sm_$cc"
fi
gencode="${gencode:--gencode=arch=compute_90,code=sm_90}"
set -x
make -C "$src" -j"$(nproc)" MPI="$mpi" ${mpi_home:+MPI_HOME="$mpi_home"} CUDA_HOME="$CUDA_HOME" \
  NCCL_HOME="$NCCL_HOME" NVCC_GENCODE="$gencode" "$@"
ls "$src/build/"*_perf
