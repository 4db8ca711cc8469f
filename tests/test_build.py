"""The build itself: what it reports, and that every CUDA kernel source compiles for sm_90.

The kernel .cu files include no torch header, so nvcc compiles them on CPU-only machines
(CI included): a kernel compile error never lands even though CI has no GPU."""

import concurrent.futures as cf
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import peagle_ext

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


@pytest.mark.skipif(_nvcc() is None, reason="nvcc not installed")
def test_cuda_kernel_sources_compile_for_sm90(tmp_path):
    sources = sorted((ROOT / "csrc").glob("*/cuda/*.cu"))
    if not sources:
        pytest.skip("no CUDA kernel sources yet")

    def compile_one(src):
        out = tmp_path / (src.parent.parent.name + "_" + src.stem + ".o")
        cmd = [
            _nvcc(),
            "-std=c++17",
            "-O1",
            "--expt-relaxed-constexpr",
            "-arch=sm_90",
            "-I",
            str(ROOT / "csrc"),
            "-c",
            str(src),
            "-o",
            str(out),
        ]
        r = subprocess.run(cmd, capture_output=True, text=True)
        return src, r.returncode, r.stderr[-4000:]

    with cf.ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as ex:
        results = list(ex.map(compile_one, sources))
    failed = [(s.relative_to(ROOT), err) for s, rc, err in results if rc != 0]
    assert not failed, "nvcc -arch=sm_90 failed:\n" + "\n\n".join(f"{s}:\n{e}" for s, e in failed)


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
