#!/usr/bin/env bash
# Install the storage servers the tests start on loopback into
# .test-servers/: moto (S3, and GCS through object_store's GCS client) from
# PyPI and azurite (Azure Blob) from npm; and into the same Python,
# TensorBoard, whose own reader checks the event files trainhost writes. Prints the environment that points
# the tests at them; use as: eval "$(scripts/install-test-servers.sh)".
# Quick when they are already installed.
set -euo pipefail
cd "$(dirname "$0")/.."

MOTO_VERSION=5.2.1
AZURITE_VERSION=3.35.0
TENSORBOARD_VERSION=2.20.0
dir="$PWD/.test-servers"

if [ ! -x "$dir/venv/bin/moto_server" ]; then
    echo "installing moto $MOTO_VERSION into $dir/venv" >&2
    python3 -m venv "$dir/venv" >&2
    "$dir/venv/bin/pip" install --quiet --disable-pip-version-check "moto[server]==$MOTO_VERSION" >&2
fi
if ! "$dir/venv/bin/python" -c "import tensorboard" 2>/dev/null; then
    echo "installing tensorboard $TENSORBOARD_VERSION into $dir/venv" >&2
    "$dir/venv/bin/pip" install --quiet --disable-pip-version-check "tensorboard==$TENSORBOARD_VERSION" >&2
fi
if [ ! -x "$dir/node/node_modules/.bin/azurite-blob" ]; then
    echo "installing azurite $AZURITE_VERSION into $dir/node" >&2
    npm install --prefix "$dir/node" --silent --no-audit --no-fund "azurite@$AZURITE_VERSION" >&2
fi

echo "export TRAINHOST_MOTO_SERVER='$dir/venv/bin/moto_server'"
echo "export TRAINHOST_AZURITE_BLOB='$dir/node/node_modules/.bin/azurite-blob'"
