"""`peagle train --profile-steps`: torch.profiler over a window of real training steps
(peagle_ext/train/profiling.py)."""

import functools
import gzip
import json

import pytest
import torch

from peagle_ext.train.profiling import (
    KERNEL_CLASSES,
    PHASES,
    describe,
    describe_by_class,
    gaps,
    idle_by_host,
    intersect,
    kernel_class,
    merge_intervals,
    overlap,
)
from tests.helpers import requires_cuda, run_cli, train_settings

pytestmark = pytest.mark.usefixtures("one_thread")

settings = functools.partial(train_settings, checkpoint_every=100, val_every=100, num_depths=3)


def _events(out):
    return [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]


def test_profile_window_summary_and_trace(tiny, tmp_path):
    from peagle_ext.train import train

    out = tmp_path / "run"
    train(settings(tiny, out, max_steps=7, profile_steps=3, profile_warmup=2))
    summary = json.loads((out / "profile" / "summary.json").read_text())
    assert summary["steps"] == [3, 5] and summary["device"] == "cpu"
    host = summary["host_ms_per_step"]
    assert list(host) == list(PHASES) and all(v >= 0 for v in host.values())
    assert host["forward_backward"] > 0 and host["optimizer"] > 0
    # the phases follow one another inside the step: together most of its wall, never more
    assert 0.5 * summary["wall_ms_per_step"] <= sum(host.values()) <= 1.05 * summary["wall_ms_per_step"]
    ops = summary["cpu_op_ms_per_step"]
    assert set(ops["classes_ms"]) == set(KERNEL_CLASSES) and ops["classes_ms"]["gemm"] > 0
    assert ops["top"] and all(c in KERNEL_CLASSES for _, c, _ in ops["top"])
    with gzip.open(out / "profile" / "trace.json.gz", "rt") as f:
        names = {e.get("name") for e in json.load(f)["traceEvents"]}
    assert {f"peagle.{p}" for p in PHASES} <= names
    profiled = [e for e in _events(out) if e.get("event") == "profile"]
    assert len(profiled) == 1 and profiled[0]["message"] == describe(summary)


def test_profiling_leaves_the_training_bitwise_unchanged(tiny, tmp_path):
    from safetensors.torch import load_file

    from peagle_ext.train import train

    a = train(settings(tiny, tmp_path / "a", max_steps=4))
    b = train(settings(tiny, tmp_path / "b", max_steps=4, profile_steps=2, profile_warmup=1))
    wa, wb = load_file(str(a.final_dir / "model.safetensors")), load_file(str(b.final_dir / "model.safetensors"))
    assert set(wa) == set(wb) and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not (tmp_path / "a" / "profile").exists()


def test_a_run_that_ends_inside_the_window_keeps_what_it_profiled(tiny, tmp_path):
    from peagle_ext.train import train

    out = tmp_path / "run"
    train(settings(tiny, out, max_steps=4, profile_steps=5, profile_warmup=2))
    assert json.loads((out / "profile" / "summary.json").read_text())["steps"] == [3, 4]


def test_a_run_that_ends_before_the_window_says_so(tiny, tmp_path):
    from peagle_ext.train import train

    out = tmp_path / "run"
    train(settings(tiny, out, max_steps=2, profile_steps=2, profile_warmup=5))
    assert not (out / "profile").exists()
    (msg,) = [e["message"] for e in _events(out) if e.get("event") == "profile"]
    assert "nothing profiled" in msg and "--profile-warmup" in msg


def test_describe_names_the_device_classes():
    s = {
        "steps": [6, 10],
        "wall_ms_per_step": 100.0,
        "host_ms_per_step": dict.fromkeys(PHASES, 1.0),
        "device_ms_per_step": {"classes_ms": {"gemm": 30.0, "copy": 0.01}, "total_ms": 40.0},
        "device_busy_fraction": 0.4,
        "device_idle_ms_per_step": {
            "idle_ms": 60.0,
            "by_phase": {"data": 45.0, "layout": 0.01, "forward_backward": 15.0},
            "by_host_op": [["aten::cat", 20.0], ["peagle.data", 9.0], ["aten::item", 3.0], ["aten::add", 1.0]],
        },
    }
    text = describe(s)
    assert text.startswith("steps 6-10: 100.0 ms a step") and "device kernels 40.0 ms, busy 40% of the wall" in text
    assert "gemm 30.0" in text and "copy" not in text.split("wall:")[1].split(";")[0]
    assert "device idle 60.0 ms in data 45.0, forward_backward 15.0 (host: aten::cat 20.0, peagle.data 9.0" in text
    assert "layout" not in text.split("device idle")[1] and "aten::add" not in text


def test_describe_by_class_gives_a_benchmark_its_profile_line():
    by_class = {"classes_ms": {"gemm": 3.25, "copy": 0.0, "loss": 1.5}, "total_ms": 4.75}
    line = describe_by_class("static batch 256", "new token", by_class)
    assert line == "static batch 256: ms per new token: gemm 3.25, loss 1.50 (all 4.75)"
    idle = {"idle_ms": 2.04, "by_host_op": [["aten::item", 1.5]] + [[f"op{i}", 0.1] for i in range(7)]}
    line = describe_by_class("auto:32768", "pass", by_class, idle, digits=1)
    assert line.startswith("auto:32768: ms per pass: gemm 3.2, loss 1.5 (all 4.8); device idle 2.0, the host then in")
    assert line.endswith("aten::item 1.5, op0 0.1, op1 0.1, op2 0.1, op3 0.1, op4 0.1")  # the first six


def test_interval_helpers():
    assert merge_intervals([(5, 7), (0, 2), (1, 3), (6, 9), (4, 4)]) == [(0, 3), (5, 9)]
    busy = [(0, 3), (5, 9)]
    assert gaps(busy, -1, 12) == [(-1, 0), (3, 5), (9, 12)]
    assert gaps(busy, 1, 8) == [(3, 5)] and gaps([], 2, 4) == [(2, 4)]
    idle = gaps(busy, 0, 12)
    starts = [a for a, _ in idle]
    assert overlap(idle, starts, 0, 12) == 5 and overlap(idle, starts, 4, 10) == 2 and overlap(idle, starts, 5, 9) == 0


def test_idle_by_host_attributes_device_gaps_to_phases_and_host_code():
    """Synthetic events: the device runs 0-10 and 30-35 us; the data phase (0-20) holds a host op
    aten::cat (12-18) with a child aten::empty (12-13); forward_backward is 20-40."""
    from types import SimpleNamespace as NS

    from torch.autograd import DeviceType

    def ev(name, a, b, dev=DeviceType.CPU, thread=1, children=(), annotation=False):
        return NS(
            name=name,
            time_range=NS(start=a, end=b),
            thread=thread,
            device_type=dev,
            cpu_children=list(children),
            is_user_annotation=annotation,
        )

    empty = ev("aten::empty", 12, 13)
    cat = ev("aten::cat", 12, 18, children=[empty])
    item = ev("aten::item", 36, 40)
    events = [
        ev("peagle.data", 0, 20, children=[cat]),
        cat,
        empty,
        ev("peagle.forward_backward", 20, 40, children=[item]),
        item,
        ev("aten::cat", 25, 28, thread=2),  # another thread: not the loop's
        ev("gemm_kernel", 0, 10, dev=DeviceType.CUDA),
        ev("gemm_kernel", 30, 35, dev=DeviceType.CUDA),
    ]
    # a record_function range's device-side span (first to last kernel inside it) is not device work
    events.append(ev("peagle.data", 0, 40, dev=DeviceType.CUDA, annotation=True))
    r = idle_by_host(events, steps=1)
    # idle: 10-30 and 35-40 = 25 us
    assert r["idle_ms"] == 0.025
    assert r["by_phase"] == {"data": 0.01, "forward_backward": 0.015}
    ops = dict(r["by_host_op"])
    assert ops["aten::cat"] == 0.005 and ops["aten::empty"] == 0.001 and ops["aten::item"] == 0.004
    # the ranges' own code (between their ops): data 10-12 and 18-20, forward_backward 20-30 and 35-36
    assert ops["peagle.data"] == 0.004 and ops["peagle.forward_backward"] == 0.011
    assert idle_by_host([ev("gemm_kernel", 0, 1, dev=DeviceType.CUDA)], 1)["idle_ms"] == 0.0
    # the backward on autograd's thread (22-27, an mm inside at 23-25): idle time while it works is its
    # own, not the waiting main thread's; every idle microsecond is attributed once
    mm = ev("aten::mm", 23, 25, thread=3)
    events += [ev("autograd::engine::evaluate_function: MmBackward0", 22, 27, thread=3, children=[mm]), mm]
    ops = dict(idle_by_host(events, steps=1)["by_host_op"])
    assert ops["autograd::engine::evaluate_function: MmBackward0"] == 0.003 and ops["aten::mm"] == 0.002
    assert ops["peagle.forward_backward"] == 0.006 and ops["peagle.data"] == 0.004
    assert abs(sum(ops.values()) - 0.025) < 1e-9


def test_intersect():
    assert intersect([(0, 3), (5, 9)], [(2, 6), (8, 12)]) == [(2, 3), (5, 6), (8, 9)]
    assert intersect([(0, 1)], [(1, 2)]) == [] and intersect([], [(0, 1)]) == []


@pytest.mark.parametrize(
    "name, device, cls",
    [
        ("nvjet_hsh_128x256_64x4_2x1_v_bz_coopA_TNT", "cuda", "gemm"),
        ("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu>", "cuda", "gemm"),
        ("void peagle::cod_attn_dq_wgmma_kernel<128>(CodAttnParams, TileMap)", "cuda", "attention"),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x64_4x1x1", "cuda", "attention"),
        ("void pytorch_flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<64>>", "cuda", "attention"),
        ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80(...)", "cuda", "attention"),
        ("aten::_cudnn_attention_forward", "cpu", "attention"),
        ("void peagle::draft_rows_kernel<__nv_bfloat16>(...)", "cuda", "loss"),
        ("void peagle::target_stats_kernel<__nv_bfloat16>(...)", "cuda", "loss"),
        ("void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor>", "cuda", "optimizer"),
        ("void at::native::indexSelectLargeIndex<float>", "cuda", "index"),
        ("Memcpy HtoD (Pageable -> Device)", "cuda", "copy"),
        ("void at::native::vectorized_elementwise_kernel<4, silu>", "cuda", "elementwise"),
        ("peagle_ext::fused_linear_kl", "cpu", "loss"),
        ("aten::addmm", "cpu", "gemm"),
    ],
)
def test_kernel_class(name, device, cls):
    assert kernel_class(name, device) == cls


@pytest.mark.parametrize("flag, value", [("--profile-steps", "-1"), ("--profile-warmup", "-2")])
def test_cli_rejects_negative_profile_counts(tmp_path, flag, value):
    r = run_cli(["train", flag, value, "--output", str(tmp_path / "o")])
    assert r.returncode == 2 and flag in r.stderr
    assert not (tmp_path / "o").exists()


def test_a_failing_profile_is_logged_and_training_goes_on(tiny, tmp_path, monkeypatch):
    from peagle_ext.train import profiling, train

    def broken(*a, **k):
        raise RuntimeError("no kernels")

    monkeypatch.setattr(profiling, "time_by_class", broken)
    out = tmp_path / "run"
    r = train(settings(tiny, out, max_steps=4, profile_steps=1, profile_warmup=1))
    assert r.steps == 4 and r.final_dir is not None
    (msg,) = [e["message"] for e in _events(out) if e.get("event") == "profile"]
    assert "profiling failed (RuntimeError: no kernels)" in msg


@requires_cuda
def test_profile_on_cuda_gives_device_time_by_class(tiny, tmp_path):
    from peagle_ext.testing import make_tiny_verifier
    from peagle_ext.train import train

    v = make_tiny_verifier(tmp_path / "v128", hidden=128, heads=2)  # head dim 64, as the CUDA attention needs
    out = tmp_path / "run"
    train(settings((v, tiny[1]), out, max_steps=5, profile_steps=2, profile_warmup=2, device="cuda"))
    summary = json.loads((out / "profile" / "summary.json").read_text())
    dev = summary["device_ms_per_step"]
    assert summary["device"].startswith("cuda") and dev["total_ms"] > 0 and dev["classes_ms"]["gemm"] > 0
    assert 0 < summary["device_busy_fraction"] <= 1
    assert "device kernels" in [e for e in _events(out) if e.get("event") == "profile"][0]["message"]
    idle = summary["device_idle_ms_per_step"]
    assert 0 <= idle["idle_ms"] <= summary["wall_ms_per_step"] and set(idle["by_phase"]) <= set(PHASES)
    # the kernel classes count device events once: never more than the wall of the window
    assert dev["total_ms"] <= summary["wall_ms_per_step"] * 1.01


@requires_cuda
def test_idle_by_host_on_a_real_cuda_profile():
    """A host sleep inside a phase is device idle time there (the range's own device-side span does
    not count as work); a phase of back-to-back GEMMs is busy."""
    import time

    from torch.profiler import ProfilerActivity, profile, record_function

    x = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function("peagle.data"):
            y = x @ x
            time.sleep(0.02)
            y = y @ x
            torch.cuda.synchronize()
        with record_function("peagle.forward_backward"):
            for _ in range(20):
                y = (y @ x) * 1e-3
            torch.cuda.synchronize()
    r = idle_by_host(prof.events(), 1)
    assert r["by_phase"]["data"] >= 15.0, r
    assert r["by_phase"]["forward_backward"] < 0.5 * r["by_phase"]["data"], r
    assert dict(r["by_host_op"]).get("peagle.data", 0.0) >= 15.0, r  # the sleep is the range's own code
