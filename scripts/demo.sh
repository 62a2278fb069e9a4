#!/usr/bin/env bash
# From a fresh clone: build the host and the digits example, train a
# classifier on the UCI handwritten digits as 2 data-parallel ranks
# (gradients all-reduced every step) on local storage
# (./trainhost_results), and list the committed checkpoints; then the
# same with the classifier written with burn, and written in Python on the
# host kernels (componentize-py from PyPI, installed on first use).
set -euo pipefail
cd "$(dirname "$0")/.."

# A rust-toolchain.toml does not add targets to an installed toolchain.
rustup target add wasm32-wasip2

# The guests go where the tests' guests are built (tests/artifacts), so
# that neither build repeats the other's.
guests=target/guests
cargo build --release --target wasm32-wasip2 --target-dir "$guests" -p digits-mlp -p digits-burn
cargo build --release -p trainhost

stamp="$(date -u +%Y%m%d-%H%M%S)"
name="demo-$stamp"
target/release/trainhost run "$guests/wasm32-wasip2/release/digits_mlp.wasm" --workers 2 --name "$name"
echo
target/release/trainhost checkpoints "$name"

# The same classifier written with burn (examples/digits-burn).
echo
target/release/trainhost run "$guests/wasm32-wasip2/release/digits_burn.wasm" --workers 2 --name "demo-burn-$stamp"
echo
target/release/trainhost checkpoints "demo-burn-$stamp"

# The same classifier written in Python (examples/digits-python), its maths
# in host kernels; its curves drawn from the run's history.
echo
python_guest="$guests/digits-python.wasm"
if scripts/build-python-guest.sh examples/digits-python/train.py -o "$python_guest" -p examples/digits-mlp/data; then
    target/release/trainhost run "$python_guest" --workers 2 --name "demo-python-$stamp"
    echo
    target/release/trainhost metrics "demo-python-$stamp" --metric train_loss,val_loss,val_accuracy \
        --plot "trainhost_results/demo-python-$stamp.png"
elif [ "${CI:-}" = true ]; then
    echo "the Python example did not build" >&2
    exit 1
else
    echo "skipped the Python example: it did not build (python3 with venv and PyPI are needed)" >&2
fi
