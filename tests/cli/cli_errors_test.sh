#!/usr/bin/env bash
# The CLI through the real binary: flag errors and bad model directories give a clear message
# naming the problem and a non-zero exit; a good model generates deterministic JSON.
set -uo pipefail
BIN="$1"
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
fails=0
passes=0
expect_error() {  # expect_error "substring" cmd...
  local want="$1"; shift
  local out rc
  out=$("$@" 2>&1); rc=$?
  if [ $rc -eq 0 ] || [[ "$out" != *"$want"* ]]; then
    echo "FAIL: '$*' (rc=$rc) did not fail with '$want'; got: $out"; fails=$((fails + 1))
  else
    echo "ok: $want"; passes=$((passes + 1))
  fi
}
expect_error "unknown command 'frobnicate'" "$BIN" frobnicate
expect_error "not expected: --bogus" "$BIN" generate --bogus
expect_error "--tp: 1 required VALUE missing" "$BIN" generate --model "$TMP" --tp
expect_error "--cols must be a multiple of 32" "$BIN" bench kernels --cols 100
# bench kernels reads the worker contract's kernel level when --kernels is not given.
expect_error "SHARDSERVE_CPU_KERNELS='avx3'" env SHARDSERVE_CPU_KERNELS=avx3 "$BIN" bench kernels
# Every command answers --help with its own usage, on stdout, successfully.
for cmd in local plan gen-model gen-adapter generate inspect-adapter "bench load" "bench allreduce" \
  "bench kernels" "bench lora"; do
  # shellcheck disable=SC2086
  out=$("$BIN" $cmd --help 2>&1); rc=$?
  if [ $rc -eq 0 ] && [[ "$out" == *"Usage: shardserve $cmd [OPTIONS]"* ]] &&
     [[ "$out" == *"-h,--help"* ]]; then
    echo "ok: shardserve $cmd --help"; passes=$((passes + 1))
  else
    echo "FAIL: shardserve $cmd --help (rc=$rc): $out"; fails=$((fails + 1))
  fi
done
out=$("$(dirname "$BIN")/shardserve-operator" --help 2>&1); rc=$?
if [ $rc -eq 0 ] && [[ "$out" == *"Usage: shardserve-operator [OPTIONS]"* ]] &&
   [[ "$out" == *"--leader-elect"* ]]; then
  echo "ok: shardserve-operator --help"; passes=$((passes + 1))
else
  echo "FAIL: shardserve-operator --help (rc=$rc): $out"; fails=$((fails + 1))
fi
expect_error "--model is required" "$BIN" generate --prompt hi
expect_error "--adapter is required" "$BIN" inspect-adapter --model "$TMP"
expect_error "--rank must be in [1, 4096]" "$BIN" gen-adapter --model "$TMP" --out "$TMP/a" --rank 0
expect_error "--adapters: 'x' is not in [1, 1024]" "$BIN" bench lora --model "$TMP" --adapters 1,x
expect_error "give exactly one of --prompt and --prompt-ids" "$BIN" generate --model "$TMP"
expect_error "config.json: cannot open" "$BIN" generate --model "$TMP/none" --prompt hi
expect_error "--logit-bias '7=1' is not ID:BIAS" "$BIN" generate --model "$TMP" --prompt hi \
  --logit-bias 7=1
expect_error "repetition_penalty must be a finite number > 0" "$BIN" generate --model "$TMP" \
  --prompt hi --repetition-penalty 0
expect_error "--arch 'gpt2' is not one of llama, mistral, qwen2, qwen3, qwen3_moe, mixtral" "$BIN" gen-model --arch gpt2 --out "$TMP/x"
expect_error "--kv-heads 3 must divide --heads 4" "$BIN" gen-model --out "$TMP/x" --heads 4 --kv-heads 3
expect_error "--dtype 'f64' is not bf16, f16, f32" "$BIN" gen-model --out "$TMP/x" --dtype f64
expect_error "--fp8-block -2 is not a block size in [1, 4096] (or 0: none; tensor)" \
  "$BIN" gen-model --out "$TMP/x" --fp8-block -2
expect_error "is F8_E4M3: FP8 checkpoints are not converted to GGUF" \
  "$BIN" gen-model --out "$TMP/x.gguf" --format gguf --fp8-block 32
expect_error "gpt-oss GGUF files say no swiglu_limit or swiglu_alpha (llama.cpp takes 7.0" \
  "$BIN" gen-model --arch gpt_oss --swiglu-limit 1.5 --out "$TMP/x.gguf" --format gguf
expect_error "the legacy MLA layout is DeepSeek-V3's (deepseek2) only" \
  "$BIN" gen-model --out "$TMP/x.gguf" --format gguf --gguf-legacy-mla
expect_error "norm_topk_prob false has no qwen3moe GGUF form" \
  "$BIN" gen-model --arch qwen3_moe --no-norm-topk-prob --out "$TMP/x.gguf" --format gguf
expect_error "--mxfp4 is gpt_oss's" "$BIN" gen-model --out "$TMP/x" --mxfp4

"$BIN" gen-model --out "$TMP/m" --vocab 300 --layers 1 >/dev/null 2>&1 || { echo "FAIL: gen-model"; exit 1; }
expect_error "temperature must be a finite number >= 0" "$BIN" generate --model "$TMP/m" --prompt hi --temperature -1
expect_error "--prompt-ids: 'x' is not an id" "$BIN" generate --model "$TMP/m" --prompt-ids 1,x
expect_error "token id 999 is outside the vocabulary" "$BIN" generate --model "$TMP/m" --prompt-ids 1,999
expect_error "--format 'xml' is not text or json" "$BIN" generate --model "$TMP/m" --prompt hi --format xml
# shardserve local: manifests that cannot run here are refused with the reason.
manifest() {  # manifest FILE URI TENSOR PIPELINE [EXTRA_SPEC_LINE]
  printf 'apiVersion: shardserve.io/v1alpha1\nkind: ShardedModel\nmetadata: {name: m}\nspec:\n  model: {name: m, uri: "%s"}\n  parallelism: {tensor: %s, pipeline: %s}\n%s\n' "$2" "$3" "$4" "${5:-}" > "$1"
}
expect_error "--file is required" "$BIN" local
expect_error "$TMP/none.yaml: cannot open" "$BIN" local -f "$TMP/none.yaml"
manifest "$TMP/pvc.yaml" "pvc://store/m" 1 1
expect_error "is a PersistentVolumeClaim, which needs a cluster" "$BIN" local -f "$TMP/pvc.yaml"
manifest "$TMP/gone.yaml" "file://$TMP/gone" 1 1
expect_error "spec.model.uri: $TMP/gone/config.json: cannot open" "$BIN" local -f "$TMP/gone.yaml"
manifest "$TMP/deep.yaml" "file://$TMP/m" 1 4
expect_error "spec.parallelism.pipeline 4:" "$BIN" local -f "$TMP/deep.yaml"
manifest "$TMP/zero.yaml" "file://$TMP/m" 0 1
expect_error "spec.parallelism.tensor must be at least 1, got 0" "$BIN" local -f "$TMP/zero.yaml"
# perKey isolation separates the cache by API key: without keys it would isolate nothing.
manifest "$TMP/perkey.yaml" "file://$TMP/m" 1 1 "  serving: {prefixCacheIsolation: perKey}"
expect_error "prefixCacheIsolation perKey separates the cache by API key, and this deployment has none" \
  "$BIN" local -f "$TMP/perkey.yaml"
manifest "$TMP/typo.yaml" "file://$TMP/m" 1 1 "  replica: 2"
expect_error "spec.replica is not a field of spec" "$BIN" local -f "$TMP/typo.yaml"
manifest "$TMP/heads.yaml" "file://$TMP/m" 3 1
expect_error "num_attention_heads 4 is not divisible by tensor parallelism 3" "$BIN" local -f "$TMP/heads.yaml" --port 18555
# Loading that stops (here a weights file that is a FIFO nobody writes: its open never returns,
# like a model volume that no longer answers) ends the rank after spec.startup.loadStallSeconds,
# naming where it stopped; the deployment exits instead of hanging.
"$BIN" gen-model --out "$TMP/stalled" --vocab 300 --layers 2 >/dev/null 2>&1 || { echo "FAIL: gen-model"; exit 1; }
rm "$TMP/stalled/model.safetensors" && mkfifo "$TMP/stalled/model.safetensors"
manifest "$TMP/stall.yaml" "file://$TMP/stalled" 1 2 "  startup: {loadStallSeconds: 2}"
expect_error "loading made no progress for 2 s (stopped at 0 % of its weights)" \
  timeout 120 "$BIN" local -f "$TMP/stall.yaml" --port 18556

# shardserve plan: placement without a cluster, and the reason when a replica does not fit.
EX="$(cd "$(dirname "$0")/../../examples" && pwd)"
expect_error "replica 1 needs 2 nodes with 8 free nvidia.com/gpu; 1 has them (of 5 nodes: 1 by an untolerated taint" \
  "$BIN" plan -f "$EX/llama-70b.yaml" --nodes "$EX/nodes.yaml"
sed 's/    image: ghcr.io\/shardserve\/worker:latest/    image: w\n    tolerations: [{key: maintenance, operator: Exists}]/' \
  "$EX/llama-70b.yaml" > "$TMP/tolerant.yaml"
out=$("$BIN" plan -f "$TMP/tolerant.yaml" --nodes "$EX/nodes.yaml" 2>&1)
if [ $? -eq 0 ] && [[ "$out" == *"replica 1: stage 0 -> gpu-b1, stage 1 -> gpu-b2 (topology.kubernetes.io/zone=zone-b)"* ]]; then
  echo "ok: plan places both replicas once the taint is tolerated"; passes=$((passes + 1))
else
  echo "FAIL: plan with a toleration: $out"; fails=$((fails + 1))
fi
# With the model's files here, plan splits its layers as the operator will (4 layers: 2 + 2, the
# LM head on the last stage), and refuses more stages than layers.
"$BIN" gen-model --out "$TMP/m4" --vocab 300 --layers 4 >/dev/null 2>&1 || { echo "FAIL: gen-model"; exit 1; }
manifest "$TMP/split.yaml" "file://$TMP/m4" 1 2
out=$("$BIN" plan -f "$TMP/split.yaml" --nodes "$EX/nodes.yaml" 2>&1)
if [ $? -eq 0 ] && [[ "$out" == *"layers: stage 0 0-1, stage 1 2-3 (of 4)"* ]]; then
  echo "ok: plan splits the layers of a model it can read"; passes=$((passes + 1))
else
  echo "FAIL: plan's layer split: $out"; fails=$((fails + 1))
fi
manifest "$TMP/deep5.yaml" "file://$TMP/m4" 1 5
expect_error "spec.parallelism.pipeline 5: the model has 4 layers: too few for 5 pipeline stages" \
  "$BIN" plan -f "$TMP/deep5.yaml" --nodes "$EX/nodes.yaml"
# A rank checks the split it is given against the model it loads; `inspect` reports the shape.
head -c 32 /dev/urandom | base64 > "$TMP/secret" && chmod 600 "$TMP/secret"
expect_error "SHARDSERVE_STAGE_LAYERS: stage layers '0-2': ends at layer 2; the model has 4 layers" \
  env SHARDSERVE_MODEL_PATH="$TMP/m4" SHARDSERVE_STAGE_LAYERS=0-2 SHARDSERVE_METRICS=off \
  SHARDSERVE_API_PORT=0 SHARDSERVE_RENDEZVOUS_SECRET_FILE="$TMP/secret" \
  "$(dirname "$BIN")/shardserve-worker" rank
out=$(SHARDSERVE_MODEL_PATH="$TMP/m4" "$(dirname "$BIN")/shardserve-worker" inspect 2>&1)
if [ $? -eq 0 ] && [[ "$out" == *'"shape":{"expertsPerToken":0,"hidden":64,"intermediate":128,"kvDim":32,"layers":4,"qDim":64,"vocab":300}'* ]] &&
   [[ "$out" == *'"kinds":[{"count":4,'* ]]; then
  echo "ok: shardserve-worker inspect reports the model's shape and footprint"; passes=$((passes + 1))
else
  echo "FAIL: shardserve-worker inspect: $out"; fails=$((fails + 1))
fi
expect_error "$TMP/gone/config.json: cannot open" \
  env SHARDSERVE_MODEL_PATH="$TMP/gone" "$(dirname "$BIN")/shardserve-worker" inspect
# What each GPU holds: DeepSeek-V3's config (FP8 blocks, computed in FP8; MLA) on nodes of 8 GPUs
# of 80 GB (nvidia.com/gpu.memory, MiB), auto sizes, then a size whose stage cannot fit.
for i in 0 1 2; do
  printf -- '- metadata: {name: h100-%s, labels: {nvidia.com/gpu.memory: "81559"}}\n  status: {allocatable: {nvidia.com/gpu: "8"}}\n' "$i"
done > "$TMP/h100.yaml"
printf 'apiVersion: shardserve.io/v1alpha1\nkind: ShardedModel\nmetadata: {name: ds}\nspec:\n  model: {name: ds, uri: "pvc://models/ds"}\n  parallelism: {tensor: %s, pipeline: %s}\n  worker: {image: w}\n' auto auto > "$TMP/ds-auto.yaml"
out=$("$BIN" plan -f "$TMP/ds-auto.yaml" --nodes "$TMP/h100.yaml" --model "$EX/plan/deepseek-v3" 2>&1)
if [ $? -eq 0 ] && [[ "$out" == *"parallelism: TP=8 x PP=2 (auto)"* ]] &&
   [[ "$out" == *"stage 1 needs "*" GiB per GPU at TP=8 (weights "* ]] &&
   [[ "$out" == *"128x128 block), computed in FP8"* ]] &&
   [[ "$out" == *"(BF16, the compressed latent every rank keeps), against 81920 for full heads (71.1x)"* ]] &&
   [[ "$out" == *"replica 0: stage 0 -> h100-0, stage 1 -> h100-1"* ]]; then
  echo "ok: plan chooses TP=8 x PP=2 for DeepSeek-V3 on 80 GB GPUs, with each stage's bytes"; passes=$((passes + 1))
else
  echo "FAIL: plan's memory for DeepSeek-V3: $out"; fails=$((fails + 1))
fi
sed 's/tensor: auto, pipeline: auto/tensor: 8, pipeline: 1/' "$TMP/ds-auto.yaml" > "$TMP/ds-8.yaml"
expect_error "3 with too little GPU memory: stage 0 needs 100.6 GiB" \
  "$BIN" plan -f "$TMP/ds-8.yaml" --nodes "$TMP/h100.yaml" --model "$EX/plan/deepseek-v3"
expect_error "spec.parallelism auto needs the model's config" \
  "$BIN" plan -f "$TMP/ds-auto.yaml" --nodes "$TMP/h100.yaml"
sed 's/tensor: auto, pipeline: auto/tensor: 3, pipeline: 1/' "$TMP/ds-auto.yaml" > "$TMP/ds-3.yaml"
expect_error "spec.parallelism.tensor 3: num_attention_heads 128 is not divisible by tensor parallelism 3" \
  "$BIN" plan -f "$TMP/ds-3.yaml" --nodes "$TMP/h100.yaml" --model "$EX/plan/deepseek-v3"
printf 'items:\n- metadata: {name: n}\n  status: {allocatable: {nvidia.com/gpu: lots}}\n' > "$TMP/badnodes.yaml"
expect_error "node n allocatable nvidia.com/gpu 'lots' is not a whole number" \
  "$BIN" plan -f "$EX/llama-70b.yaml" --nodes "$TMP/badnodes.yaml"

# The KV cache's dtype: a bad name, from the flag or the worker contract.
expect_error "--kv-cache-dtype 'int4' must be auto, f32, bf16, f16 or fp8" \
  "$BIN" generate --model "$TMP/m" --prompt hi --max-tokens 2 --kv-cache-dtype int4
expect_error "SHARDSERVE_KV_CACHE_DTYPE='fp4' must be auto, f32, bf16, f16 or fp8" \
  env SHARDSERVE_KV_CACHE_DTYPE=fp4 "$BIN" generate --model "$TMP/m" --prompt hi --max-tokens 2

# The backend of the ranks: a bad name, and CUDA where there is none (no GPU or no CUDA build).
expect_error "SHARDSERVE_BACKEND 'tpu' must be cpu, cuda or auto" \
  env SHARDSERVE_BACKEND=tpu "$BIN" generate --model "$TMP/m" --prompt hi --max-tokens 2 --tp 2
if [ "$(nvidia-smi -L 2>/dev/null | wc -l)" = 0 ]; then
  expect_error "SHARDSERVE_BACKEND=cuda, but" \
    env SHARDSERVE_BACKEND=cuda "$BIN" generate --model "$TMP/m" --prompt hi --max-tokens 2 --tp 2
fi

# Same seed, same output (but for the measured time).
untimed() { sed 's/"timing":{[^}]*},\{0,1\}//'; }
a=$("$BIN" generate --model "$TMP/m" --prompt "hello" --temperature 0.9 --seed 5 --max-tokens 8 --format json --ignore-eos | untimed)
b=$("$BIN" generate --model "$TMP/m" --prompt "hello" --temperature 0.9 --seed 5 --max-tokens 8 --format json --ignore-eos | untimed)
if [ "$a" != "$b" ] || [[ "$a" != *'"tokens":['* ]]; then
  echo "FAIL: same seed gave different output: $a / $b"; fails=$((fails + 1))
else
  echo "ok: same seed, same JSON"; passes=$((passes + 1))
fi
echo "$passes passed, $fails failed"
[ $fails -eq 0 ]
