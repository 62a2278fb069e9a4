#!/usr/bin/env bash
# Install MPICH's launcher (mpiexec) from the system's packages if it is
# missing: the tests start trainhost under a real `mpiexec`. Needs root (or
# sudo) and apt-get; fails otherwise. Quick when mpiexec is installed.
set -euo pipefail

if command -v mpiexec >/dev/null; then
    exit 0
fi
if ! command -v apt-get >/dev/null; then
    echo "mpiexec is missing and there is no apt-get: install MPICH with your package manager" >&2
    exit 1
fi
sudo=""
if [ "$(id -u)" -ne 0 ]; then
    if ! command -v sudo >/dev/null; then
        echo "mpiexec is missing; installing MPICH needs root: apt-get install mpich" >&2
        exit 1
    fi
    sudo="sudo -n"
fi
echo "installing MPICH (apt-get install mpich)" >&2
$sudo apt-get update -qq >&2
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq mpich >&2
command -v mpiexec >/dev/null
