"""The build itself: what it reports, which GPUs its kernels run on, and that every CUDA kernel
source compiles for every arch of the default build.

The kernel .cu files include no torch header, so nvcc compiles them on CPU-only machines
(CI included): a kernel compile error never lands even though CI has no GPU."""

import concurrent.futures as cf
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import peagle_ext
from peagle_ext._native import missing_kernel_image_message

ROOT = Path(__file__).resolve().parents[1]


def test_build_info_reports_backends_and_torch():
    info = peagle_ext.build_info()
    assert "cpu" in info["backends"]
    assert info["torch_version"] == torch.__version__
    if "cuda" in info["backends"]:
        assert info["cuda_archs"], "a CUDA build must say which archs it holds"
    assert hasattr(torch.ops.peagle, "cod_sample")


def test_torch_mismatch_is_a_clear_error(tmp_path, monkeypatch):
    import peagle_ext._native as native

    info = json.loads((Path(native.__file__).parent / "_build_info.json").read_text())
    fake = tmp_path / "_build_info.json"
    fake.write_text(json.dumps({**info, "torch_version": "0.0.1"}))
    monkeypatch.setattr(native, "_HERE", tmp_path)
    with pytest.raises(ImportError, match=r"built against torch 0\.0\.1.*rebuild"):
        native._load()


def _nvcc():
    return shutil.which("nvcc") or next((p for p in ["/usr/local/cuda/bin/nvcc"] if os.path.exists(p)), None)


def _nvcc_version():
    out = subprocess.run([_nvcc(), "--version"], capture_output=True, text=True).stdout
    m = re.search(r"release (\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def default_archs(nvcc_version):
    """CMakeLists.txt's PEAGLE_CUDA_ARCHS=AUTO: SASS for 80 and 90, plus 100 and 120 from nvcc
    12.8 on, and PTX of the newest."""
    sass = [80, 90] + ([100, 120] if nvcc_version >= (12, 8) else [])
    return sass, sass[-1]


@pytest.mark.skipif(_nvcc() is None, reason="nvcc not installed")
def test_cuda_kernel_sources_compile_for_every_arch(tmp_path):
    """Every kernel file for every arch of the default build (and its PTX), the *_sm90a.cu files
    for sm_90a, as the build compiles them; cod_attn_launch.cu also without the sm_90a kernels
    (its fallbacks). -O1: a compile check, not the build's code."""
    sources = sorted((ROOT / "csrc").glob("*/cuda/*.cu"))
    if not sources:
        pytest.skip("no CUDA kernel sources yet")
    sass, newest = default_archs(_nvcc_version())
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in sass if a != newest]
    gencode.append(f"-gencode=arch=compute_{newest},code=[sm_{newest},compute_{newest}]")
    jobs = []
    for src in sources:
        if src.stem.endswith("_sm90a"):
            jobs.append((src, ["-gencode=arch=compute_90a,code=sm_90a", "-DPEAGLE_ATTN_WGMMA=1"], "sm90a"))
        else:
            jobs.append((src, gencode + ["-DPEAGLE_ATTN_WGMMA=1"], "all"))
    jobs.append((ROOT / "csrc/attention/cuda/cod_attn_launch.cu", [f"-arch=sm_{sass[0]}"], "no-sm90a"))

    def compile_one(job):
        src, flags, tag = job
        out = tmp_path / f"{src.parent.parent.name}_{src.stem}_{tag}.o"
        cmd = [_nvcc(), "-std=c++17", "-O1", "--expt-relaxed-constexpr", *flags, "-I", str(ROOT / "csrc")]
        r = subprocess.run(cmd + ["-c", str(src), "-o", str(out)], capture_output=True, text=True)
        return src, tag, r.returncode, r.stderr[-4000:]

    with cf.ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as ex:
        results = list(ex.map(compile_one, jobs))
    failed = [(s.relative_to(ROOT), tag, err) for s, tag, rc, err in results if rc != 0]
    assert not failed, "nvcc failed:\n" + "\n\n".join(f"{s} ({t}):\n{e}" for s, t, e in failed)


def _torch_include():
    return Path(torch.__file__).parent / "include"


@pytest.mark.skipif(
    shutil.which("g++") is None or not Path("/usr/local/cuda/include/cuda_runtime_api.h").exists(),
    reason="needs g++ and the CUDA headers",
)
def test_cuda_glue_compiles_against_torch_headers(tmp_path):
    """The torch-facing glue (csrc/*/cuda/*.cpp) parses against this torch's headers and the CUDA
    runtime headers (a syntax check: a CPU torch ships the c10/cuda headers but not the one header
    its CMake generates, cuda_cmake_macros.h, which is empty here)."""
    stub = tmp_path / "c10" / "cuda" / "impl"
    stub.mkdir(parents=True)
    (stub / "cuda_cmake_macros.h").write_text("#pragma once\n")
    inc = _torch_include()
    flags = ["-std=c++20", "-fsyntax-only", "-I", str(ROOT / "csrc"), "-I", str(tmp_path), "-I", str(inc)]
    flags += ["-I", str(inc / "torch/csrc/api/include"), "-I", "/usr/local/cuda/include"]
    flags += ['-DPEAGLE_CUDA_ARCHS="80,90"', '-DPEAGLE_CUDA_SASS_ARCHS="80,90"', '-DPEAGLE_CUDA_PTX_ARCHS="90"']
    sources = sorted((ROOT / "csrc").glob("*/cuda/*.cpp"))

    def check(src):
        r = subprocess.run(["g++", *flags, str(src)], capture_output=True, text=True)
        return src, r.returncode, r.stderr[-3000:]

    with cf.ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as ex:
        results = list(ex.map(check, sources))
    failed = [(s.relative_to(ROOT), err) for s, rc, err in results if rc != 0]
    assert not failed, "\n\n".join(f"{s}:\n{e}" for s, e in failed)


def test_build_info_names_sass_and_ptx_archs():
    info = peagle_ext.build_info()
    for key in ("cuda_archs", "cuda_sass_archs", "cuda_ptx_archs"):
        assert isinstance(info[key], list)
    assert isinstance(info["hopper_kernels"], bool)
    if "cuda" in info["backends"]:
        assert info["cuda_sass_archs"] and info["cuda_ptx_archs"], info
        assert info["hopper_kernels"] == ("90a" in info["cuda_sass_archs"])
    else:
        assert not info["cuda_sass_archs"] and not info["hopper_kernels"]


DEFAULT_SASS = "80,90,90a,100,120"


@pytest.mark.parametrize("cc", [(8, 0), (8, 6), (8, 7), (8, 9), (9, 0), (10, 0), (10, 3), (12, 0), (12, 1), (13, 0)])
def test_default_archs_have_a_kernel_image(cc):
    """SASS runs on the same major at an equal or higher minor; PTX of the newest (compute_120) is
    compiled by the driver for anything after it."""
    assert missing_kernel_image_message(*cc, DEFAULT_SASS.split(","), ["120"]) == ""


@pytest.mark.parametrize("cc", [(7, 5), (11, 0)])
def test_gpu_without_a_kernel_image_is_named(cc):
    """No SASS of its major at or below its minor and no PTX at or below it (Turing; Thor's 11.0
    sits between sm_100 SASS and compute_120 PTX): the error names the arch and the rebuild."""
    arch = f"{cc[0]}{cc[1]}"
    msg = missing_kernel_image_message(*cc, DEFAULT_SASS.split(","), ["120"])
    assert f"compute capability {cc[0]}.{cc[1]}, sm_{arch}" in msg
    assert f'PEAGLE_CUDA_ARCHS="{arch}"' in msg
    assert "sm_80, sm_90, sm_90a, sm_100, sm_120" in msg and "compute_120" in msg


def test_arch_specific_image_does_not_cover_other_kernels():
    """sm_90a code (the Hopper kernels) is no image for the portable ones, and PTX covers only newer GPUs."""
    assert missing_kernel_image_message(9, 0, ["90a"], []) != ""
    assert missing_kernel_image_message(9, 0, ["80"], []) != ""  # sm_80 SASS is no image for 9.0
    assert missing_kernel_image_message(9, 0, ["80"], ["80"]) == ""  # ... but its PTX is
    assert missing_kernel_image_message(8, 9, [], ["90"]) != ""


@pytest.mark.skipif(_nvcc() is None, reason="nvcc not installed")
def test_block_row_mask_equals_row_ranges(tmp_path):
    """tools/kernels/check_block_row_mask.cu (host code: runs without a GPU): the wgmma forward's and dQ
    pass's per-block mask (BlockRowMask, cod_attn_tile.cuh) answers as RowRanges::allows for every
    key of 400K random and adversarial (range, block, jend) cases."""
    exe = tmp_path / "check_block_row_mask"
    r = subprocess.run(
        [
            _nvcc(),
            "-std=c++17",
            "-O2",
            "-I",
            str(ROOT / "csrc"),
            str(ROOT / "tools" / "kernels" / "check_block_row_mask.cu"),
            "-o",
            str(exe),
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.startswith("PASS"), run.stdout[-2000:]
