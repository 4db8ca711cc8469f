#!/usr/bin/env bash
# Every CUDA op (every tools/sanitize/sanitize_<op>.py driver: attention, cod, decode_attention, loss, vllm) under
# compute-sanitizer memcheck, racecheck, initcheck and synccheck, one process per (tool, op) so
# that one op's failure or timeout cannot hide another's result. Needs a GPU and the CUDA build.
#
#   bash tools/sanitize/sanitize_all.sh                          # everything (~10-25 min on an H200)
#   SANITIZE_TOOLS="memcheck racecheck" bash tools/sanitize/sanitize_all.sh   # a subset (split long runs)
#   SANITIZE_OPS="attention loss" bash tools/sanitize/sanitize_all.sh
#
# Tools: memcheck (PyTorch's caching allocator on: as the ops run in practice), memcheck-nocache
# (PYTORCH_NO_CUDA_MEMORY_CACHING=1: every tensor is its own cudaMalloc, so an out-of-bounds
# access that would land inside another cached block is caught too), racecheck, initcheck,
# synccheck. Results: $OUT/sanitize_summary.md (a table), $OUT/sanitize.json, and one log per
# run ($OUT/sanitize_<tool>_<op>.log). Exit code: 0 iff every run reported no error.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export PATH=/usr/local/cuda/bin:$PATH PYTHONUNBUFFERED=1
tools=${SANITIZE_TOOLS:-memcheck memcheck-nocache racecheck initcheck synccheck}
ops=${SANITIZE_OPS:-$(ls tools/sanitize/sanitize_*.py | sed -n 's#^tools/sanitize/sanitize_\(.*\)\.py$#\1#p' | grep -vx ops)}
limit=${SANITIZE_TIMEOUT:-420}
summary="$OUT/sanitize_summary.md"
rows="$OUT/.sanitize_rows.tsv"
: > "$rows"
status=0
if ! command -v compute-sanitizer > /dev/null; then
  echo "compute-sanitizer not found (PATH=$PATH)"; exit 2
fi
{
  echo "## compute-sanitizer, $(date -u +%FT%TZ), $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)"
  echo
  echo "| tool | op | result | sanitizer summary | seconds |"
  echo "|---|---|---|---|---|"
} > "$summary"
for tool in $tools; do
  for op in $ops; do
    log="$OUT/sanitize_${tool}_${op}.log"
    t=$tool
    envs=()
    case $tool in
      memcheck-nocache) t=memcheck; envs=(PYTORCH_NO_CUDA_MEMORY_CACHING=1) ;;
      memcheck|racecheck|initcheck|synccheck) ;;
      *) echo "unknown tool $tool"; exit 2 ;;
    esac
    t0=$(date +%s)
    env "${envs[@]}" timeout "$limit" compute-sanitizer --tool "$t" --error-exitcode 99 \
      python3 tools/sanitize/sanitize_ops.py "$op" > "$log" 2>&1
    rc=$?
    secs=$(( $(date +%s) - t0 ))
    # "ERROR SUMMARY: N errors" (memcheck/initcheck/synccheck), "RACECHECK SUMMARY: ..." (racecheck)
    line=$(grep -E "(ERROR|RACECHECK) SUMMARY" "$log" | tail -1 | sed 's/^========= //')
    case $rc in
      0) result=ok ;;
      99) result="SANITIZER ERRORS" ;;
      124) result="TIMEOUT (${limit}s)" ;;
      *) result="FAILED rc=$rc" ;;
    esac
    [ $rc -eq 0 ] || status=1
    echo "| $tool | $op | $result | ${line:-none} | $secs |" >> "$summary"
    printf '%s\t%s\t%s\t%s\t%s\n' "$tool" "$op" "$rc" "${line:-}" "$secs" >> "$rows"
    echo "compute-sanitizer $tool $op: $result in ${secs}s ${line:+($line)}"
    if [ $rc -ne 0 ]; then grep -E "^========= (Invalid|Race|Uninitialized|Barrier|Error)|Error|FAILED" "$log" | head -8; fi
  done
done
python3 - "$rows" "$OUT/sanitize.json" <<'EOF'
import json, sys
runs = []
for line in open(sys.argv[1]):
    tool, op, rc, summary, secs = line.rstrip("\n").split("\t")
    runs.append({"tool": tool, "op": op, "rc": int(rc), "ok": rc == "0", "summary": summary, "seconds": int(secs)})
json.dump({"runs": runs, "all_ok": all(r["ok"] for r in runs)}, open(sys.argv[2], "w"), indent=1)
EOF
rm -f "$rows"
cat "$summary"
exit $status
