"""Build peagle_ext: setup.py drives CMake + Ninja to build the native module peagle_ext._C.

Environment knobs:
  PEAGLE_WITH_CUDA=AUTO|ON|OFF   (AUTO: build CUDA when torch has CUDA and nvcc is found)
  PEAGLE_CUDA_ARCHS=AUTO         (default: SASS for 80, 90 (+90a), 100, 120 where nvcc has them, PTX of
                                 the newest; or a CMake CUDA architecture list, e.g. "90" or "100-real;120")
  MAX_JOBS=N                     (parallel compile jobs)
Build with `pip install --no-build-isolation .` so the build uses the torch you run with.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    def __init__(self, name):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        try:
            import torch
        except ImportError as e:  # pragma: no cover - build-time message
            raise RuntimeError(
                "peagle_ext needs torch at build time. Install it first "
                "(CPU: pip install torch==2.13.0) and build with "
                "`pip install --no-build-isolation .`"
            ) from e
        # get_ext_fullpath("peagle_ext._C") is <build-lib>/peagle_ext/_C.<abi>.so
        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        out_dir.mkdir(parents=True, exist_ok=True)
        build_temp = Path(self.build_temp).resolve() / "cmake"
        build_temp.mkdir(parents=True, exist_ok=True)
        cfg = os.environ.get("PEAGLE_BUILD_TYPE", "Release")
        args = [
            "cmake",
            "-S",
            str(ROOT),
            "-B",
            str(build_temp),
            "-G",
            "Ninja",
            f"-DCMAKE_BUILD_TYPE={cfg}",
            f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-DPEAGLE_OUTPUT_DIR={out_dir}",
            f"-DPEAGLE_WITH_CUDA={os.environ.get('PEAGLE_WITH_CUDA', 'AUTO')}",
        ]
        if "PEAGLE_CUDA_ARCHS" in os.environ:
            args.append(f"-DPEAGLE_CUDA_ARCHS={os.environ['PEAGLE_CUDA_ARCHS']}")
        subprocess.check_call(args)
        jobs = os.environ.get("MAX_JOBS", str(os.cpu_count() or 2))
        subprocess.check_call(["cmake", "--build", str(build_temp), "-j", jobs])
        self._check_op_errors_raise(out_dir)
        # Editable installs copy only the extension back into the source tree; the build-info
        # file that the import guard reads must sit beside it there too.
        info = out_dir / "_build_info.json"
        src_info = ROOT / "peagle_ext" / "_build_info.json"
        if info.exists() and info.resolve() != src_info.resolve():
            shutil.copyfile(info, src_info)

    @staticmethod
    def _check_op_errors_raise(out_dir: Path):
        """An op's TORCH_CHECK must reach Python as ValueError. Seen on an H200 image whose CXX
        was a separately installed GCC (/opt/gcc): every op error segfaulted the process, while
        the system g++ worked. Catch that at build time instead of at a user's first bad input."""
        so = next(out_dir.glob("_C*.so"), None)
        if so is None or os.environ.get("PEAGLE_SKIP_BUILD_CHECK") == "1":
            return
        code = (
            "import torch\n"
            f"torch.ops.load_library({str(so)!r})\n"
            "try:\n"
            "    torch.ops.peagle.cod_sample(torch.full((3,), -2, dtype=torch.int32),"
            " torch.ones(3, dtype=torch.bool), 2, 0.7, 0.2, -1, True, 0)\n"
            "except ValueError:\n"
            "    raise SystemExit(0)\n"
            "raise SystemExit(3)\n"
        )
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(
                "peagle_ext built, but an op error does not reach Python as an exception (exit "
                f"{r.returncode}; -11 means a segfault). This happens when the C++ compiler's runtime "
                "does not match the libstdc++ torch loads (seen with CXX=/opt/gcc/bin/g++ on an H200 "
                "image). Rebuild with the system compiler, e.g. CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++ "
                "pip install --no-build-isolation -e .   (PEAGLE_SKIP_BUILD_CHECK=1 skips this check)\n"
                + r.stderr[-2000:]
            )


setup(
    ext_modules=[CMakeExtension("peagle_ext._C")],
    cmdclass={"build_ext": CMakeBuild},
)
