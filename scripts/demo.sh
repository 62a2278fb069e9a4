#!/usr/bin/env bash
# From a fresh clone: build the host and the linear-regression example,
# train it as 2 ranks on local storage (./trainhost_results), and list the
# committed checkpoints.
set -euo pipefail
cd "$(dirname "$0")/.."

# A rust-toolchain.toml does not add targets to an installed toolchain.
rustup target add wasm32-wasip2

cargo build --release --target wasm32-wasip2 -p linear-regression
cargo build --release -p trainhost

guest=target/wasm32-wasip2/release/linear_regression.wasm
name="demo-$(date -u +%Y%m%d-%H%M%S)"
target/release/trainhost run "$guest" --workers 2 --config '{"num_epochs": 5}' --name "$name"
echo
target/release/trainhost checkpoints "$name"
