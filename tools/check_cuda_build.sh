#!/usr/bin/env bash
# Compile-check the FULL CUDA build (kernels + torch-facing glue) on a machine without a GPU,
# against a CUDA build of torch in a side venv. The CPU torch wheel cannot compile the
# c10/cuda headers, so this is the only local check of the glue files.
#   one-time: python -m venv /opt/cudatorch && /opt/cudatorch/bin/pip install torch==2.14.1 numpy setuptools wheel cmake ninja
# Builds a copy of this tree under /tmp (incremental across runs); the CPU build is untouched.
set -euo pipefail
PY=${CUDA_TORCH_PYTHON:-/opt/cudatorch/bin/python}
src=$(cd "$(dirname "$0")/.." && pwd)
dst=/tmp/peagle-cuda-check-$(echo "$src" | md5sum | cut -c1-8)
mkdir -p "$dst"
rsync -a --delete --exclude build --exclude '*.so' --exclude .git --exclude _build_info.json "$src/" "$dst/"
cd "$dst"
PATH=/usr/local/cuda/bin:$PATH PEAGLE_WITH_CUDA=ON PEAGLE_CUDA_ARCHS="${PEAGLE_CUDA_ARCHS:-90}" MAX_JOBS=${MAX_JOBS:-1} \
  "$PY" setup.py build_ext --inplace 2>&1 | grep -vE "^(copying|running|creating)" | tail -n 60
test ${PIPESTATUS[0]} -eq 0
"$PY" -c "import peagle_ext, torch; print('CUDA build imports:', peagle_ext.build_info())"
