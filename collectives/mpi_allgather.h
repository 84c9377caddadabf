// mpi_allgather: the Communicator's bootstrap AllGather over an MPI communicator (header-only, so that
// ponte_collectives itself does not link MPI). Include <mpi.h> first; launch with mpirun.
#pragma once

#include <mpi.h>

#include <vector>

#include "collectives/communicator.h"

namespace ponte {

inline AllGather mpi_allgather(MPI_Comm comm) {
  return [comm](std::span<const uint8_t> mine, std::vector<std::vector<uint8_t>>* all) -> Status {
    int n = 0;
    if (MPI_Comm_size(comm, &n) != MPI_SUCCESS) return Status(Code::kInternal, "MPI_Comm_size failed");
    int len = static_cast<int>(mine.size());
    std::vector<int> lens(n), displs(n);
    if (MPI_Allgather(&len, 1, MPI_INT, lens.data(), 1, MPI_INT, comm) != MPI_SUCCESS)
      return Status(Code::kInternal, "MPI_Allgather of lengths failed");
    int total = 0;
    for (int i = 0; i < n; i++) {
      displs[i] = total;
      total += lens[i];
    }
    std::vector<uint8_t> flat(total > 0 ? total : 1);
    if (MPI_Allgatherv(mine.data(), len, MPI_BYTE, flat.data(), lens.data(), displs.data(), MPI_BYTE, comm) != MPI_SUCCESS)
      return Status(Code::kInternal, "MPI_Allgatherv failed");
    all->assign(n, {});
    for (int i = 0; i < n; i++) (*all)[i].assign(flat.begin() + displs[i], flat.begin() + displs[i] + lens[i]);
    return Status::Ok();
  };
}

}  // namespace ponte
