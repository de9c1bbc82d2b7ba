#!/usr/bin/env bash
# Sharded execution on the TinyLlama-1.1B-shaped BF16 model (bench/runtime.sh generates it):
#  1. decode tokens/s: TP=1 with 2 threads vs TP=2 with 1 thread per rank (2 processes);
#  2. pipeline: P=2 (1 thread per stage) over a batch of 8 prompts of 64 tokens (one prefill
#     pass) cut into m = 1, 2, 4, 8 micro-batches, against the ideal m / (m + P - 1).
#     efficiency = (single-process 1-thread time of the same m micro-batches run one after the
#     other / P) / pipelined time: the bubble alone. "vs whole batch" divides by the 1-thread time
#     of the batch in one pass instead, so it also carries the cost of smaller matrix products;
#  3. resident memory of every rank against its stage's weights / T.
set -euo pipefail
cd "$(dirname "$0")/.."
SHARDSERVE_SKIP_REFERENCE=1 bash scripts/setup.sh
bash scripts/build.sh
M=build/bench-models/tinyllama-bf16
if [ ! -f "$M/config.json" ]; then
  build/bin/shardserve gen-model --arch llama --out "$M" --layers 22 --hidden 2048 \
    --intermediate 5632 --heads 32 --kv-heads 4 --vocab 32000 --dtype bf16 --seed 1
fi
run() {  # prints "seconds generated_tokens"
  build/bin/shardserve generate --model "$M" --format json --ignore-eos "$@" |
    python3 -c 'import json,sys; t=json.load(sys.stdin)["timing"]; print(t["seconds"], t["generated_tokens"])'
}
PROMPT8=1,5,9,13,17,21,25,29
echo "=== decode, batch 1, 8-token prompt, 48 tokens"
read -r s1 n1 < <(run --prompt-ids $PROMPT8 --max-tokens 48 --threads 2)
read -r s2 n2 < <(run --prompt-ids $PROMPT8 --max-tokens 48 --threads 2 --tp 2)
python3 - "$s1" "$n1" "$s2" "$n2" <<'PY'
import sys
s1, n1, s2, n2 = map(float, sys.argv[1:])
print(f"TP=1, 2 threads:       {n1/s1:6.2f} tokens/s")
print(f"TP=2, 1 thread/rank:   {n2/s2:6.2f} tokens/s  ({100*(n2/s2)/(n1/s1):.0f}% of TP=1)")
PY
echo "=== pipeline, P=2, batch 8 x 64-token prompts, one prefill pass"
PROMPT64=$(python3 -c 'print(",".join(str(7 + 13*i % 31000) for i in range(64)))')
read -r whole _ < <(run --prompt-ids "$PROMPT64" --max-tokens 1 --batch 8 --threads 1)
echo "single process, 1 thread, whole batch in one pass: ${whole} s"
for m in 1 2 4 8; do
  read -r part _ < <(run --prompt-ids "$PROMPT64" --max-tokens 1 --batch $((8 / m)) --threads 1)
  read -r s _ < <(run --prompt-ids "$PROMPT64" --max-tokens 1 --batch 8 --threads 2 --pp 2 \
    --microbatches "$m")
  python3 - "$whole" "$part" "$s" "$m" <<'PY'
import sys
whole, part, s, m = float(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
eff, ideal, vs_whole = (m * part / 2) / s, m / (m + 1), (whole / 2) / s
print(f"m={m}: {s:6.3f} s  efficiency {eff:5.2f}  ideal {ideal:5.2f} ({100*eff/ideal:3.0f}% of ideal)"
      f"  vs whole batch {vs_whole:5.2f}")
PY
done
echo "=== resident memory per rank, TP=2 and TP=2 x PP=2 (weights of its stage / T expected)"
for shape in "--tp 2" "--tp 2 --pp 2"; do
  SHARDSERVE_REPORT_MEMORY=1 build/bin/shardserve generate --model "$M" --prompt-ids $PROMPT8 \
    --max-tokens 4 --format json $shape 2>&1 >/dev/null | grep resident | sort
done
