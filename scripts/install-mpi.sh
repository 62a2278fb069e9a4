#!/usr/bin/env bash
# Install MPICH from the system's packages if it is missing: its launcher
# (mpiexec), which the tests start trainhost under, and what building
# trainhost's `mpi` feature needs (MPICH's headers and libclang, for the
# `mpi` crate's bindings). Needs root (or sudo) and apt-get; fails
# otherwise. Quick when everything is installed.
set -euo pipefail

have() {
    command -v mpiexec >/dev/null && command -v mpicc >/dev/null &&
        ldconfig -p 2>/dev/null | grep -q 'libclang\(-[0-9.]*\)\?\.so'
}
if have; then
    exit 0
fi
if ! command -v apt-get >/dev/null; then
    echo "MPICH is missing and there is no apt-get: install MPICH (with its headers) and libclang with your package manager" >&2
    exit 1
fi
sudo=""
if [ "$(id -u)" -ne 0 ]; then
    if ! command -v sudo >/dev/null; then
        echo "MPICH is missing; installing it needs root: apt-get install mpich libmpich-dev libclang-dev" >&2
        exit 1
    fi
    sudo="sudo -n"
fi
echo "installing MPICH (apt-get install mpich libmpich-dev libclang-dev)" >&2
$sudo apt-get update -qq >&2
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq mpich libmpich-dev libclang-dev >&2
have
