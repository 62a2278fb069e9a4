/* MPI_IN_PLACE as the MPI library trainhost is built against defines it.
 * It is a macro, and its value differs between libraries (MPICH and its
 * derivatives: (void *) -1; Open MPI: (void *) 1), so Rust cannot name it;
 * the `mpi` crate does not export it. Compiled by build.rs with the `mpi`
 * feature. */
#include <mpi.h>

void *const trainhost_mpi_in_place = MPI_IN_PLACE;
