#!/usr/bin/env bash
# Run the benchmark suite (tools/bench) in release mode. Installs what its
# baselines need: moto (the S3 server) and awscli v1. Arguments go to the
# suite; `scripts/bench.sh --write BENCHMARKS.md` regenerates the results
# file, `--quick` is a short smoke run, `--only GROUP` runs one group.
set -euo pipefail
cd "$(dirname "$0")/.."

rustup target add wasm32-wasip2
eval "$(scripts/install-test-servers.sh)"

AWSCLI_VERSION=1.46.3
awsdir="$PWD/.test-servers/awscli"
if [ ! -x "$awsdir/bin/aws" ]; then
    echo "installing awscli $AWSCLI_VERSION into $awsdir" >&2
    python3 -m venv "$awsdir" >&2
    "$awsdir/bin/pip" install --quiet --disable-pip-version-check "awscli==$AWSCLI_VERSION" >&2
fi
export TRAINHOST_AWS_CLI="$awsdir/bin/aws"
export AWS_EC2_METADATA_DISABLED=true

# The `nodes` group runs trainhost under mpiexec, against a bare
# MPI_Allreduce: both need MPICH.
scripts/install-mpi.sh
cargo build --release -p trainhost -p trainhost-bench --features trainhost-bench/mpi
exec target/release/trainhost-bench "$@"
