# Sourced by the one-call GPU scripts (gpu_final.sh, gpu_verify.sh): a total time budget and
# time-boxed steps, so one call never runs past the device's per-call limit.
#   t_end, sum must be set by the caller.
left() { echo $(( t_end - $(date +%s) )); }
note() { echo "$*" | tee -a "$sum"; }
box() {  # box <max seconds> <log> <cmd...>: run with min(max, time left - 5)
  local max=$1 log=$2; shift 2
  local t=$(( $(left) - 5 )); [ $t -gt $max ] && t=$max
  if [ $t -lt 10 ]; then note "skipped (time): $*"; return 99; fi
  local t0=$(date +%s)
  timeout $t "$@" > "$log" 2>&1
  local rc=$?
  note "rc=$rc in $(( $(date +%s) - t0 ))s (box ${t}s): $*"
  return $rc
}
