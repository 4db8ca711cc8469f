# Sourced by the one-call attention GPU checks (attn_wgmma.sh, attn_pipe.sh), from the repository
# root: their common start, conditional build and wgmma building-block self-test.
#   attn_gpu_start NAME       OUT, summary=$OUT/NAME_summary.txt, note, status=0, and a time budget:
#                             every phase's cap is cut to what is left of CALL_BUDGET (seconds from
#                             here; default 540, the call limit is 600 with the machine's start)
#   attn_gpu_build NAME MARKER  builds (as bench/gpu_suite.sh, system compiler) unless the installed
#                             library already contains the string MARKER; exits 1 if the build fails
#   attn_gpu_selftest SECONDS tools/wgmma_selftest.cu (nvcc sm_90a, then run): its FAIL lines and
#                             verdict in the summary, the whole log in $OUT; status=1 if it fails
attn_gpu_start() {
  OUT=${OUT:-$PWD/gpu_out}
  mkdir -p "$OUT"
  export PYTHONUNBUFFERED=1 PATH=/usr/local/cuda/bin:$PATH
  # the tests and the benches set these per case
  unset PEAGLE_ATTN_FWD_MF PEAGLE_ATTN_FWD_WARPS PEAGLE_ATTN_FWD PEAGLE_ATTN_BWD PEAGLE_ATTN_WGMMA_BMQ PEAGLE_ATTN_WGMMA_PIPE
  summary="$OUT/$1_summary.txt"
  : > "$summary"
  status=0
  t_end=$(( $(date +%s) + ${CALL_BUDGET:-540} ))
  nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader 2>/dev/null | tee -a "$summary"
}
note() { echo "$*" | tee -a "$summary"; }
cap() { local left=$(( t_end - $(date +%s) - 5 )); [ $left -lt 1 ] && left=1; [ $1 -lt $left ] && echo $1 || echo $left; }

attn_gpu_build() {
  if ! MARKER="$2" python3 - <<'PYEOF' 2>/dev/null
import glob, os, sys
import peagle_ext
if not peagle_ext.has_cuda_kernels():
    sys.exit(1)
so = glob.glob(os.path.join(os.path.dirname(peagle_ext.__file__), "_C*.so"))
sys.exit(0 if so and os.environ["MARKER"].encode() in open(so[0], "rb").read() else 1)
PYEOF
  then
    if [ -x /usr/bin/g++ ]; then export CXX=/usr/bin/g++ CC=/usr/bin/gcc CUDAHOSTCXX=/usr/bin/g++; fi
    local t0=$(date +%s) rc
    MAX_JOBS=${MAX_JOBS:-16} PEAGLE_WITH_CUDA=ON python3 -m pip install --no-build-isolation --no-deps -e . \
      > "$OUT/$1_build.log" 2>&1
    rc=$?; note "build: rc=$rc in $(( $(date +%s) - t0 ))s"
    [ $rc -eq 0 ] || { tail -40 "$OUT/$1_build.log"; exit 1; }
  fi
  python3 -c "import peagle_ext; print(peagle_ext.build_info())" | tee -a "$summary"
}

attn_gpu_selftest() {
  local t0=$(date +%s) rc
  nvcc -std=c++17 -O2 -gencode arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -I csrc \
    tools/wgmma_selftest.cu -o "$OUT/wgmma_selftest" > "$OUT/wgmma_selftest_build.log" 2>&1
  rc=$?
  if [ $rc -eq 0 ]; then
    timeout $(cap $1) "$OUT/wgmma_selftest" > "$OUT/wgmma_selftest.log" 2>&1
    rc=$?
    grep -E "^(FAIL|    C\[)" "$OUT/wgmma_selftest.log" | head -20 | tee -a "$summary"
    tail -1 "$OUT/wgmma_selftest.log" | tee -a "$summary"
  else
    tail -20 "$OUT/wgmma_selftest_build.log" | tee -a "$summary"
  fi
  note "wgmma_selftest: rc=$rc in $(( $(date +%s) - t0 ))s"
  [ $rc -eq 0 ] || status=1
  rm -f "$OUT/wgmma_selftest"  # a binary does not need to come back
}
