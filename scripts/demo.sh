#!/usr/bin/env bash
# From a fresh clone: build the host and the digits example, train a
# classifier on the UCI handwritten digits as 2 data-parallel ranks
# (gradients all-reduced every step) on local storage
# (./trainhost_results), and list the committed checkpoints.
set -euo pipefail
cd "$(dirname "$0")/.."

# A rust-toolchain.toml does not add targets to an installed toolchain.
rustup target add wasm32-wasip2

cargo build --release --target wasm32-wasip2 -p digits-mlp
cargo build --release -p trainhost

guest=target/wasm32-wasip2/release/digits_mlp.wasm
name="demo-$(date -u +%Y%m%d-%H%M%S)"
target/release/trainhost run "$guest" --workers 2 --name "$name"
echo
target/release/trainhost checkpoints "$name"
