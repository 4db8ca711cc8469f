#!/usr/bin/env bash
# Which cases of bench/sanitize_loss.py make initcheck report "Uninitialized __global__ memory
# read" in the fused loss's row kernel, and does it depend on cuBLAS's kernel choice or on the
# caching allocator? Runs the driver under initcheck three ways (as is; cuBLAS without workspace,
# CUBLAS_WORKSPACE_CONFIG=:0:0, which rules out split-K; no caching allocator) and prints, per
# case marker, how many reports each way gives. Needs a GPU and the CUDA build.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
for variant in default noworkspace nocache; do
  envs=()
  case $variant in
    noworkspace) envs=(CUBLAS_WORKSPACE_CONFIG=:0:0) ;;
    nocache) envs=(PYTORCH_NO_CUDA_MEMORY_CACHING=1) ;;
  esac
  log="$OUT/initcheck_loss_$variant.log"
  env "${envs[@]}" timeout 120 compute-sanitizer --tool initcheck --print-limit 100000 --show-backtrace no \
    python3 bench/sanitize_ops.py loss > "$log" 2>&1
  echo "== initcheck loss, $variant: rc=$? $(grep -E 'ERROR SUMMARY' "$log" | tail -1)"
  awk '/^case /{c=substr($0, 6); next} /Uninitialized/{n[c]++} END {for (k in n) print "   " n[k] " reports: " k}' "$log" | sort -k4
  grep -m2 -A3 "Uninitialized" "$log" | grep -E "at |by thread|Address" | head -4
done
