#!/usr/bin/env bash
# The whole test suite: set-up (idempotent), build (shardserve and, once, the Kubernetes test
# environment), then every test through ctest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh
bash scripts/testenv-build.sh >/dev/null  # the Kubernetes test environment, built once
ctest --test-dir build --output-on-failure -j"$(nproc)" "$@"
