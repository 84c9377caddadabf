// The collectives under a real launcher: `mpirun -np 4 collectives_mpi_test`, bootstrapped through
// the MPI adapter (collectives/mpi_allgather.h), over tcp;ofi_rxm on loopback. Every rank runs the
// dispatch/combine semantics and the all_to_all_v / point-to-point scenarios; exit 0 when all pass.
#include <mpi.h>

#include <cstdio>

#include "collectives/mpi_allgather.h"
#include "tests/collectives/scenarios.h"
#include "tests/common/loopback.h"

using namespace ponte;
using namespace ponte::test;

int main(int argc, char** argv) {
  ponte::test::keep_test_traffic_on_loopback();
  MPI_Init(&argc, &argv);
  int rank = 0, world = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  std::string verdict;
  {
    auto c = Communicator::create(rank, world, mpi_allgather(MPI_COMM_WORLD), comm_options(setup_by_name("tcp_rxm"), kTimeoutMs, rank));
    if (!c.ok()) verdict = std::string("communicator: ") + c.status().message();
    if (verdict.empty()) verdict = semantics(**c);
    if (verdict.empty()) verdict = a2a_and_p2p(**c);
  }
  int bad = verdict.empty() ? 0 : 1, total = 0;
  MPI_Allreduce(&bad, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  printf("rank %d of %d: %s\n", rank, world, verdict.empty() ? "ok" : verdict.c_str());
  if (rank == 0) printf("collectives_mpi_test: %d of %d ranks failed\n", total, world);
  MPI_Finalize();
  return total == 0 ? 0 : 1;
}
