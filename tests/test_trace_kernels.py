"""tools/trace_kernels.py: kernels attributed to the host ops that launched them."""

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import trace_kernels  # noqa: E402


def _trace(tmp_path, gz=True):
    """One step: aten::linear > aten::mm launches a GEMM; aten::to > aten::copy_ a cast; a memset
    with no launch in the trace."""

    def op(cat, name, tid, ts, dur, corr=None):
        e = {"ph": "X", "cat": cat, "name": name, "tid": tid, "ts": ts, "dur": dur}
        return e if corr is None else {**e, "args": {"correlation": corr}}

    ev = [
        op("cpu_op", "ProfilerStep#1", 1, 0, 100),
        op("cpu_op", "aten::linear", 1, 10, 20),
        op("cpu_op", "aten::mm", 1, 12, 10),
        op("cuda_driver", "cuLaunchKernelEx", 1, 14, 2, 7),  # cuBLAS launches through the driver API
        op("cpu_op", "aten::to", 1, 40, 20),
        op("cpu_op", "aten::copy_", 1, 42, 10),
        op("cuda_runtime", "cudaLaunchKernel", 1, 44, 2, 8),
        op("kernel", "nvjet_sm90_tst_128x256", 7, 20, 3000, 7),
        op("kernel", "bfloat16_copy_kernel_cuda", 7, 3100, 500, 8),
        op("gpu_memset", "Memset (Device)", 7, 3700, 250, 99),
    ]
    path = tmp_path / ("t.json.gz" if gz else "t.json")
    data = json.dumps({"traceEvents": ev})
    if gz:
        with gzip.open(path, "wt") as f:
            f.write(data)
    else:
        path.write_text(data)
    return path


@pytest.mark.parametrize("gz", [True, False])
def test_kernels_grouped_by_class_and_launching_ops(tmp_path, gz):
    rows, by_class = trace_kernels.attribute(trace_kernels.load_events(_trace(tmp_path, gz)), depth=2)
    assert by_class == pytest.approx({"gemm": 3.0, "copy": 0.75})
    assert rows[("gemm", "aten::linear > aten::mm", "nvjet_sm90_tst_128x256")] == [pytest.approx(3.0), 1]
    assert rows[("copy", "aten::to > aten::copy_", "bfloat16_copy_kernel_cuda")] == [pytest.approx(0.5), 1]
    assert rows[("copy", "(no host op)", "Memset (Device)")] == [pytest.approx(0.25), 1]
    one = trace_kernels.attribute(trace_kernels.load_events(_trace(tmp_path, gz)), depth=1)[0]
    assert ("gemm", "aten::mm", "nvjet_sm90_tst_128x256") in one


def test_cli_prints_the_heaviest_rows_of_the_chosen_classes(tmp_path):
    p = subprocess.run(
        [sys.executable, str(ROOT / "tools/trace_kernels.py"), str(_trace(tmp_path)), "--cls", "copy"],
        capture_output=True,
        text=True,
        check=True,
    )
    lines = p.stdout.splitlines()
    assert lines[0].startswith("class ms: gemm 3.00, copy 0.75")
    assert "bfloat16_copy_kernel_cuda" in lines[2] and "aten::to > aten::copy_" in lines[2]
    assert "Memset" in lines[3] and len(lines) == 4  # the GEMM row is filtered out


@pytest.mark.parametrize(
    "content",
    [None, b"not json", b'{"x": 1}', b'{"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "tid": 1}]}'],
)
def test_bad_trace_file_exits_2_naming_it(tmp_path, content):
    path = tmp_path / "bad.json"
    if content is not None:
        path.write_bytes(content)
    tool = str(ROOT / "tools/trace_kernels.py")
    p = subprocess.run([sys.executable, tool, str(path)], capture_output=True, text=True)
    assert p.returncode == 2
    assert str(path) in p.stderr and "Traceback" not in p.stderr


def test_unknown_class_exits_2_naming_the_classes(tmp_path):
    tool = str(ROOT / "tools/trace_kernels.py")
    args = [sys.executable, tool, str(_trace(tmp_path)), "--cls", "copy,copies"]
    p = subprocess.run(args, capture_output=True, text=True)
    assert p.returncode == 2 and "--cls" in p.stderr and "copies" in p.stderr and "elementwise" in p.stderr


def test_a_launch_after_a_child_op_ended_belongs_to_the_parent():
    """aten::to (40-60 us) holds aten::copy_ (42-52); a launch at 55 us is aten::to's alone, and
    one at 70 us, after both, has no host op."""
    ev = [
        {"ph": "X", "cat": "cpu_op", "name": "aten::to", "tid": 1, "ts": 40, "dur": 20},
        {"ph": "X", "cat": "cpu_op", "name": "aten::copy_", "tid": 1, "ts": 42, "dur": 10},
    ]
    stacks = trace_kernels.HostStacks(ev)
    assert stacks.enclosing(1, 45) == ["aten::to", "aten::copy_"]
    assert stacks.enclosing(1, 55) == ["aten::to"]
    assert stacks.enclosing(1, 70) == [] and stacks.enclosing(2, 45) == []
