#!/usr/bin/env bash
# Run every test: unit tests, the integration tests (which compile the test
# guests and the example from source for wasm32-wasip2, and start S3, GCS
# and Azure emulators on loopback), the embedding example's test and the doc
# tests. Extra arguments go to `cargo test`. Installs MPICH's mpiexec
# with apt-get when it is missing and this user may.
set -euo pipefail
cd "$(dirname "$0")/.."

# A rust-toolchain.toml does not add targets to an installed toolchain.
rustup target add wasm32-wasip2

# Storage server tests skip (saying so) when the servers cannot be
# installed; CI sets TRAINHOST_REQUIRE_STORAGE_SERVERS=1 to fail instead.
if servers=$(scripts/install-test-servers.sh); then
    eval "$servers"
else
    echo "warning: could not install the storage test servers; their tests will be skipped" >&2
fi

# The tests of runs over several hosts start trainhost under a real
# mpiexec, and build it with the `mpi` feature; without MPICH they are
# skipped (saying so), and CI sets TRAINHOST_REQUIRE_MPI=1 to fail instead.
mpi=1
if ! scripts/install-mpi.sh; then
    echo "warning: could not install MPICH; the tests under mpiexec will be skipped" >&2
    mpi=0
    if [ "${TRAINHOST_REQUIRE_MPI:-}" = 1 ]; then
        echo "MPICH could not be installed and TRAINHOST_REQUIRE_MPI=1" >&2
        exit 1
    fi
fi

# Cloud clients must never reach for real credentials or metadata services.
export AWS_EC2_METADATA_DISABLED=true
# Compiled guests from test runs stay inside the tree, not in ~/.cache.
export TRAINHOST_CACHE_DIR="$PWD/target/compile-cache"

cargo test "$@"

# The same host built with the `mpi` feature, for the tests that need it
# (not when extra arguments choose the tests). The same packages as above
# (the workspace's default members, no `-p`): cargo unifies dependencies'
# features over the packages it builds, so `-p trainhost` alone would build
# wasmtime and most other dependencies again (9 of CI's minutes); this way
# only the host and MPI's own crates are compiled.
if [ "$mpi" = 1 ] && [ $# -eq 0 ]; then
    cargo test --features trainhost/mpi --lib cluster::
    cargo test --features trainhost/mpi --test all -- nodes::
fi
