#!/usr/bin/env bash
# Builds CPU-only variants of the extension and checks whether an op's TORCH_CHECK raises
# (ValueError) or crashes, to find which build setting breaks exceptions on the H200 image.
set -u
which -a c++ g++ | head -4; echo "CXX=${CXX:-} PATH=$PATH"
PREFIX=$(python3 -c "import torch;print(torch.utils.cmake_prefix_path)")
try() {
  name=$1; shift
  d=/tmp/diag_$name; rm -rf $d; mkdir -p $d/pkg; cp -r peagle_ext $d/pkg/; rm -f $d/pkg/peagle_ext/_C*.so
  cmake -S . -B $d/build -G Ninja -DCMAKE_PREFIX_PATH=$PREFIX -DPython_EXECUTABLE=$(which python3) \
     -DPEAGLE_WITH_CUDA=OFF -DPEAGLE_OUTPUT_DIR=$d/pkg/peagle_ext "$@" > $d/cfg.log 2>&1 || { echo "$name: configure failed"; tail -5 $d/cfg.log; return; }
  cmake --build $d/build -j 16 > $d/build.log 2>&1 || { echo "$name: build failed"; tail -5 $d/build.log; return; }
  grep -m1 "CMAKE_CXX_COMPILER:" $d/build/CMakeCache.txt
  (cd $d/pkg && python3 -c "
import torch, peagle_ext
try:
    torch.ops.peagle.cod_sample(torch.full((5,), -2, dtype=torch.int32), torch.ones(5, dtype=torch.bool), 8, .7, .2, -1, True, 0)
except ValueError as e:
    print('RAISED OK')
" 2>&1 | tail -1; echo "$name: rc=${PIPESTATUS[0]}")
}
try default
try cxx17 -DCMAKE_CXX_STANDARD=17
try usrbin -DCMAKE_CXX_COMPILER=/usr/bin/g++
try O2 -DCMAKE_CXX_FLAGS_RELEASE=-O2
try pylink -DPEAGLE_LINK_TORCH_PYTHON=ON
try all17 -DCMAKE_CXX_STANDARD=17 -DCMAKE_CXX_FLAGS_RELEASE=-O2 -DPEAGLE_LINK_TORCH_PYTHON=ON
