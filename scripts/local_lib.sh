# Sourced by scripts that run `shardserve local` in the background (demo, serving benchmark).
# start_local LOG MANIFEST [ARGS...]: starts it with its output in LOG, sets LOCAL to its pid,
# stops it with SIGINT on exit (then runs $LOCAL_CLEANUP, if set), and returns once it serves (or
# exits 1 with its log). SHARDSERVE_BIN names the binaries' directory (default build/bin).
start_local() {
  local log="$1"; shift
  "${SHARDSERVE_BIN:-build/bin}/shardserve" local -f "$@" >"$log" 2>&1 &
  LOCAL=$!
  trap 'kill -INT $LOCAL 2>/dev/null || true; wait $LOCAL 2>/dev/null || true; eval "${LOCAL_CLEANUP:-}"' EXIT
  for _ in $(seq 1 600); do
    grep -q "shardserve local: serving" "$log" && return 0
    kill -0 $LOCAL 2>/dev/null || { cat "$log"; exit 1; }
    sleep 0.2
  done
  echo "shardserve local did not become ready:"; cat "$log"; exit 1
}

# write_manifest FILE NAME MODEL_DIR TP PP SERVING [REPLICAS]: a ShardedModel for `shardserve
# local`, its spec.serving the flow mapping SERVING ("port: 18400, maxBatchSize: 16").
write_manifest() {
  cat >"$1" <<YAML
apiVersion: shardserve.io/v1alpha1
kind: ShardedModel
metadata: {name: $2}
spec:
  replicas: ${7:-1}
  model: {name: $2, uri: "file://$3"}
  parallelism: {tensor: $4, pipeline: $5}
  serving: {$6}
YAML
}
