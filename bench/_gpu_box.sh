# Sourced by the one-call GPU scripts (gpu_final.sh, gpu_verify.sh), from the repository root:
# a total time budget, time-boxed steps (so one call never runs past the device's per-call
# limit), the build, and one archive of the logs (the device returns at most 8 files).
#   call_start NAME DEFAULT_BUDGET_S   sets OUT, work=$OUT/NAME, sum, t_end; builds the extension
#   box MAX_S LOG CMD...               runs CMD with min(MAX_S, time left - 5) seconds
#   call_end                           notes the time left, packs $work into $OUT/NAME.tgz
#   run_lanes F0 F1                    runs the functions F0 and F1 at the same time, F1 on GPU
#                                      $lane1_gpu = 1, on a machine with 2 GPUs; otherwise (or with
#                                      SERIAL=1) one after the other with lane1_gpu = 0
OUT=${OUT:-$PWD/gpu_out}
export PATH=/usr/local/cuda/bin:$PATH PYTHONUNBUFFERED=1
left() { echo $(( t_end - $(date +%s) )); }
note() { echo "$*" | tee -a "$sum"; }
call_start() {
  call_name=$1
  t_end=$(( $(date +%s) + ${CALL_BUDGET:-$2} ))
  work="$OUT/$call_name"
  sum="$OUT/summary.txt"
  mkdir -p "$work"
  OUT="$work/suite" bash bench/gpu_suite.sh build > "$work/build_phase.log" 2>&1
  cat "$work/suite/summary.txt" >> "$sum"
}
box() {
  local max=$1 log=$2; shift 2
  local t=$(( $(left) - 5 )); [ $t -gt $max ] && t=$max
  if [ $t -lt 10 ]; then note "skipped (time): $*"; return 99; fi
  local t0=$(date +%s)
  timeout $t "$@" > "$log" 2>&1
  local rc=$?
  note "rc=$rc in $(( $(date +%s) - t0 ))s (box ${t}s): $*"
  return $rc
}
call_end() {
  note "== $call_name done, $(left)s of the call budget left"
  (cd "$OUT" && tar czf "$call_name.tgz" "$call_name" && rm -rf "$call_name")
}
run_lanes() {
  local ngpu p0 p1
  ngpu=$(nvidia-smi -L 2>/dev/null | wc -l)
  lane1_gpu=1
  if [ "${SERIAL:-0}" = "1" ] || [ "$ngpu" -lt 2 ]; then lane1_gpu=0; fi
  if [ $lane1_gpu -eq 1 ]; then
    "$1" & p0=$!
    "$2" & p1=$!
    wait $p0 $p1
  else
    "$1"; "$2"
  fi
}
