#!/usr/bin/env bash
# Diagnoses C++ exceptions from ops crashing (seen on the H200 image: TORCH_CHECK in our ops
# segfaults instead of raising). Compares our build with a torch cpp_extension build.
set -x
which -a g++ gcc c++; g++ --version | head -1; ls /usr/bin/g++* /usr/bin/gcc-* 2>/dev/null; echo "CXX=$CXX CC=$CC"
python3 -c "import torch; print(torch.__config__.show())" | grep -iE "compiler|CXX_FLAGS|ABI" | head
ldd $(python3 -c "import peagle_ext._native as n, glob; print(glob.glob(str(n._HERE)+'/_C*.so')[0])") | grep -E "stdc|gcc_s|c10|torch"
python3 - <<'PY'
import torch, peagle_ext
try:
    torch.ops.peagle.cod_sample(torch.full((5,), -2, dtype=torch.int32), torch.ones(5, dtype=torch.bool), 8, .7, .2, -1, True, 0)
except Exception as e:
    print("OUR OP RAISED OK:", type(e).__name__, str(e)[:80])
PY
echo "our op rc=$?"
python3 - <<'PY'
import torch
from torch.utils.cpp_extension import load_inline
src = r'''
#include <torch/library.h>
#include <ATen/core/Tensor.h>
at::Tensor boom(const at::Tensor& x) { TORCH_CHECK_VALUE(false, "boom value"); return x; }
TORCH_LIBRARY(diagx, m) { m.def("boom(Tensor x) -> Tensor"); }
TORCH_LIBRARY_IMPL(diagx, CPU, m) { m.impl("boom", &boom); }
'''
load_inline("diagx", cpp_sources=[src], is_python_module=False, verbose=False, extra_cflags=["-O2"])
try:
    torch.ops.diagx.boom(torch.ones(2))
except Exception as e:
    print("CPP_EXTENSION OP RAISED OK:", type(e).__name__, e)
PY
echo "cpp_extension rc=$?"
