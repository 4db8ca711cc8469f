"""The few Python files of vLLM 0.33.0 that the plugin tests run, fetched once and cached.

The vLLM wheel is about 340 MB, nearly all compiled kernels; the tests need a handful of its
.py files. `ensure_vllm_sources()` downloads the pinned wheel with pip (no dependencies, one
platform so the same file comes everywhere), checks its sha256, extracts EXTRACTED_FILES
into $PEAGLE_EXT_CACHE (default ~/.cache/peagle_ext)/vllm-0.33.0 and deletes the wheel.
Later runs read the cache (a stamp file says the extraction completed). PEAGLE_EXT_VLLM_WHEEL
names a local copy of the wheel instead (an offline machine).

    python -m tests.serving.vllm_sources     # prefetch; prints the directory
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.request
import zipfile
from pathlib import Path

VLLM_VERSION = "0.33.0"
WHEEL_NAME = f"vllm-{VLLM_VERSION}-cp38-abi3-manylinux_2_28_x86_64.whl"
WHEEL_SHA256 = "4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa"

EXTRACTED_FILES = (
    "vllm/_version.py",
    "vllm/version.py",
    "vllm/v1/spec_decode/__init__.py",
    "vllm/v1/spec_decode/eagle.py",
    "vllm/v1/spec_decode/llm_base_proposer.py",
    "vllm/v1/spec_decode/utils.py",
    "vllm/v1/attention/backend.py",
    f"vllm-{VLLM_VERSION}.dist-info/METADATA",
)
"""Relative to the wheel's root. vllm_cpu.REAL_MODULES lists the modules among them that are
executed; the rest of vLLM is stubbed."""

_STAMP = ".complete"


class SourcesUnavailable(RuntimeError):
    """vLLM's sources cannot be fetched because the package index cannot be reached."""


def cache_dir() -> Path:
    root = os.environ.get("PEAGLE_EXT_CACHE") or os.path.join(Path.home(), ".cache", "peagle_ext")
    return Path(root) / f"vllm-{VLLM_VERSION}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _index_reachable(timeout: float = 10.0) -> bool:
    url = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/") + "/vllm/"
    try:
        with urllib.request.urlopen(url, timeout=timeout):
            return True
    except OSError:
        return False


def _download_wheel(dest: Path) -> Path:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--quiet",
        "--no-deps",
        "--no-cache-dir",
        "--only-binary=:all:",
        "--platform",
        "manylinux_2_28_x86_64",
        "--python-version",
        "3.11",
        "--implementation",
        "cp",
        "-d",
        str(dest),
        f"vllm=={VLLM_VERSION}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheel = dest / WHEEL_NAME
    if proc.returncode != 0 or not wheel.exists():
        if not _index_reachable():
            raise SourcesUnavailable(f"the package index is unreachable, so vLLM {VLLM_VERSION} cannot be downloaded")
        raise RuntimeError(f"`{' '.join(cmd)}` failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return wheel


def _extract(wheel: Path, out: Path) -> None:
    digest = _sha256(wheel)
    if digest != WHEEL_SHA256:
        raise RuntimeError(f"{wheel} has sha256 {digest}, expected {WHEEL_SHA256}")
    with zipfile.ZipFile(wheel) as z:
        for name in EXTRACTED_FILES:
            target = out / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(z.read(name))


def ensure_vllm_sources() -> Path:
    """The directory holding EXTRACTED_FILES (to put on sys.path); fetches them when missing.
    Raises SourcesUnavailable when they are not cached and the index cannot be reached."""
    out = cache_dir()
    if (out / _STAMP).is_file() and all((out / n).is_file() for n in EXTRACTED_FILES):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Extract next to the cache and rename into place, so that an interrupted run or a
    # concurrent one never leaves a half-filled cache behind.
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".vllm-{VLLM_VERSION}-") as tmp:
        tmp = Path(tmp)
        local = os.environ.get("PEAGLE_EXT_VLLM_WHEEL")
        wheel = Path(local) if local else _download_wheel(tmp / "wheel")
        staged = tmp / "src"
        _extract(wheel, staged)
        (staged / _STAMP).write_text(f"{WHEEL_NAME} {WHEEL_SHA256}\n")
        if out.exists():
            shutil.rmtree(out)
        try:
            staged.rename(out)
        except OSError:  # another process put a complete cache in place first
            if not (out / _STAMP).is_file():
                raise
    return out


if __name__ == "__main__":
    print(ensure_vllm_sources())
