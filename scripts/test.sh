#!/usr/bin/env bash
# The whole test suite: set-up (idempotent), build (shardserve and, once, the Kubernetes test
# environment), then every test through ctest.
# On a new machine most of the time goes to downloads (the reference environment) and to two
# builds, C++ and Go. The downloads run beside the C++ build; the Go build (the Kubernetes test
# environment) runs in its own session beside the C++ build and the tests that do not need it,
# and ctest's fixture k8s.testenv_build waits for it before the first test that does. The Go build
# is the longer path (the Kubernetes tiers, which run one at a time, come after it), so where the
# kernel groups sessions for scheduling (autogroup) its session gets a larger weight (nice -5:
# about three quarters of the CPU while both are busy) where this user may set it (root); the C++
# build, done long before, has the rest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh build  # what the C++ build needs: Debian packages, the CUDA wheels
logs=$(mktemp -d)
pids=()
trap 'for p in "${pids[@]}"; do kill -- -"$p" "$p" 2>/dev/null; done; rm -rf "$logs"' EXIT
bash scripts/setup.sh tests >"$logs/setup" 2>&1 &
pids+=($!)
setsid bash -c 'echo -5 >/proc/self/autogroup 2>/dev/null; exec bash scripts/testenv-build.sh' \
  >/dev/null 2>"$logs/testenv" &
pids+=($!)
bash scripts/build.sh
status=0
wait "${pids[0]}" || status=$?
cat "$logs/setup" >&2
[ "$status" = 0 ] || { echo "test.sh: scripts/setup.sh tests failed (exit $status)" >&2; exit 1; }
status=0
ctest --test-dir build --output-on-failure -j"$(nproc)" "$@" || status=$?
# The Go build has ended if a test needed it; a run of tests that did not is not kept waiting
# (the next run goes on from Go's build cache).
if kill -0 "${pids[1]}" 2>/dev/null; then
  kill -- -"${pids[1]}" 2>/dev/null || true
  echo "test.sh: stopped the Kubernetes test environment's build: no test it ran needed it" >&2
elif ! wait "${pids[1]}"; then
  cat "$logs/testenv" >&2
  status=1
fi
pids=()
exit "$status"
