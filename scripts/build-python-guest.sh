#!/usr/bin/env bash
# Build a training loop written in Python into a trainhost guest component:
#
#   scripts/build-python-guest.sh loop.py -o loop.wasm [-p DIR]...
#
# componentize-py (from PyPI, installed on first use into .python-guest/)
# puts CPython, the trainhost package (guest-sdk-python/) and the loop's
# directory into one WASI component built against wit/. The loop module
# declares its entry point with @trainhost.entry. Module top-level code runs
# here, at build time, and its state is frozen into the component: read the
# rank, the config and randomness inside the entry function. Each -p DIR
# adds a directory to the loop's Python path: its modules can be imported,
# and its files read while the module is imported at build time (data
# built into the guest); the loop's own directory is always on it.
set -euo pipefail

COMPONENTIZE_PY_VERSION=0.25.1
usage="usage: $0 LOOP.py -o OUT.wasm [-p DIR]..."
loop=""
out=""
paths=()
while [ $# -gt 0 ]; do
    case "$1" in
        -o) out="${2:?$usage}"; shift 2 ;;
        -p)
            dir="${2:?$usage}"
            if [ ! -d "$dir" ]; then
                echo "-p $dir: no such directory" >&2
                exit 2
            fi
            paths+=(-p "$(cd "$dir" && pwd)")
            shift 2
            ;;
        -h|--help) echo "$usage"; exit 0 ;;
        *) loop="$1"; shift ;;
    esac
done
if [ -z "$loop" ] || [ -z "$out" ]; then
    echo "$usage" >&2
    exit 2
fi
case "$loop" in
    *.py) ;;
    *) echo "$loop: give the loop's Python file (LOOP.py)" >&2; exit 2 ;;
esac
if [ ! -f "$loop" ]; then
    echo "$loop: no such file" >&2
    exit 2
fi

top="$(cd "$(dirname "$0")/.." && pwd)"
loop_dir="$(cd "$(dirname "$loop")" && pwd)"
module="$(basename "$loop" .py)"
case "$out" in
    /*) ;;
    *) out="$PWD/$out" ;;
esac

venv="$top/.python-guest/venv"
if ! "$venv/bin/componentize-py" --version 2>/dev/null | grep -q "$COMPONENTIZE_PY_VERSION"; then
    echo "installing componentize-py $COMPONENTIZE_PY_VERSION into $venv" >&2
    python3 -m venv "$venv" >&2
    "$venv/bin/pip" install --quiet --disable-pip-version-check "componentize-py==$COMPONENTIZE_PY_VERSION" >&2
fi

# The loop's directory first: its modules win over the SDK's names.
"$venv/bin/componentize-py" -d "$top/wit" -w trainer componentize \
    -p "$loop_dir" "${paths[@]}" -p "$top/guest-sdk-python" "$module" -o "$out"
echo "built $out" >&2
