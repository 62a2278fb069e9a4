#!/usr/bin/env bash
# Run every test: unit tests, the integration tests (which compile the test
# guests and the example from source for wasm32-wasip2), the embedding
# example's test and the doc tests.
set -euo pipefail
cd "$(dirname "$0")/.."

# A rust-toolchain.toml does not add targets to an installed toolchain.
rustup target add wasm32-wasip2

cargo test "$@"
