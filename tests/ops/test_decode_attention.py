"""ops.decode_attention (csrc/decode_attention) against a plain-PyTorch reference written from
its definition (explicit scores, GQA by repeating kv heads, one softmax per query and head), on
fresh random inputs: strided q and caches in both decoding layouts, runs of no key, one key and
every key, groups 1..8, and the values past each run set to NaN (the op must not read them); bad
arguments; the fake implementation; on a GPU the CUDA kernel, eager and replayed from a graph."""

from __future__ import annotations

import pytest
import torch

from peagle_ext.ops import decode_attention
from peagle_ext.ops.decode_attention import decode_attention_unsupported
from tests.helpers import requires_cuda


def reference(q, k, v, start, count, scale):
    """[T, Hq, D] in float64."""
    t, hq, d = q.shape
    group = hq // k.shape[1]
    out = torch.zeros(t, hq, d, dtype=torch.float64)
    for i in range(t):
        s, n = int(start[i]), int(count[i])
        if n == 0:
            continue
        kk = k[s : s + n].double().cpu().repeat_interleave(group, 1)  # [n, Hq, D]
        vv = v[s : s + n].double().cpu().repeat_interleave(group, 1)
        w = torch.softmax(torch.einsum("hd,nhd->hn", q[i].double().cpu(), kk) * scale, -1)
        out[i] = torch.einsum("hn,nhd->hd", w, vv)
    return out


def make_case(t, hq, hkv, d, rows, layout, dtype, device, seed):
    """q [t, hq, d] as a transposed view (strided like a verifier's [heads, T, D]); k/v a [rows,
    hkv, d] view of a cache in `layout`: "verifier" [hkv, rows, d] or "drafter" [rows, hkv, d];
    runs of 0, 1, all and random lengths with NaN past every run's end."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(hq, t, d, generator=g).to(dtype).to(device).transpose(0, 1)
    if layout == "verifier":
        k = torch.randn(hkv, rows, d, generator=g).to(dtype).to(device).transpose(0, 1)
        v = torch.randn(hkv, rows, d, generator=g).to(dtype).to(device).transpose(0, 1)
    else:
        k = torch.randn(rows, hkv, d, generator=g).to(dtype).to(device)
        v = torch.randn(rows, hkv, d, generator=g).to(dtype).to(device)
    count = torch.randint(0, rows + 1, (t,), generator=g)
    count[: min(t, 3)] = torch.tensor([0, 1, rows])[: min(t, 3)]
    start = torch.zeros(t, dtype=torch.int64)
    for i in range(t):
        start[i] = int(torch.randint(0, rows - int(count[i]) + 1, (1,), generator=g))
    # rows nobody's run covers hold NaN: reading them would show
    used = torch.zeros(rows, dtype=torch.bool)
    for i in range(t):
        used[int(start[i]) : int(start[i] + count[i])] = True
    k[~used.to(device)] = float("nan")
    v[~used.to(device)] = float("nan")
    return q, k, v, start.int().to(device), count.int().to(device)


@pytest.mark.parametrize("layout", ["verifier", "drafter"])
@pytest.mark.parametrize(
    "t,hq,hkv,d,rows",
    [(1, 1, 1, 8, 1), (4, 9, 3, 64, 40), (6, 8, 1, 16, 17), (5, 4, 4, 32, 33), (3, 16, 2, 128, 20), (7, 6, 3, 24, 64)],
)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_matches_reference_on_the_cpu(layout, t, hq, hkv, d, rows, dtype):
    q, k, v, start, count = make_case(t, hq, hkv, d, rows, layout, dtype, "cpu", seed=t * 100 + d + rows)
    scale = d**-0.5
    got = decode_attention(q, k, v, start, count, scale)
    assert got.shape == (t, hq, d) and got.dtype == dtype and got.is_contiguous()
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(got.double(), reference(q, k, v, start, count, scale), rtol=tol, atol=tol)
    assert bool((got[count == 0] == 0).all())  # a run of no key gives 0


def test_no_query_tokens():
    q = torch.randn(0, 4, 8)
    k = torch.randn(5, 2, 8)
    empty = torch.zeros(0, dtype=torch.int32)
    assert decode_attention(q, k, k, empty, empty, 1.0).shape == (0, 4, 8)


def test_bad_arguments_name_what_is_wrong():
    q, k = torch.randn(2, 4, 8), torch.randn(5, 2, 8)
    st, ct = torch.zeros(2, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    with pytest.raises(TypeError, match="key_start must have dtype in \\(int32\\)"):
        decode_attention(q, k, k, st.long(), ct, 1.0)
    with pytest.raises(ValueError, match="key_count must have shape \\(2,\\)"):
        decode_attention(q, k, k, st, ct[:1], 1.0)
    with pytest.raises(ValueError, match="v must have shape \\(5, 2, 8\\)"):
        decode_attention(q, k, k[:4], st, ct, 1.0)
    with pytest.raises(ValueError, match="q's heads \\(4\\) must be a multiple of k's kv heads \\(3\\)"):
        decode_attention(q, torch.randn(5, 3, 8), torch.randn(5, 3, 8), st, ct, 1.0)
    with pytest.raises(ValueError, match="k's head_dim 4 must equal q's 8"):
        decode_attention(q, torch.randn(5, 2, 4), torch.randn(5, 2, 4), st, ct, 1.0)
    with pytest.raises(TypeError, match="one dtype"):
        decode_attention(q, k.double(), k.double(), st, ct, 1.0)
    with pytest.raises(ValueError, match="contiguous rows"):
        decode_attention(torch.randn(2, 4, 16)[..., ::2], k, k, st, ct, 1.0)
    with pytest.raises(ValueError, match="scale must be finite"):
        decode_attention(q, k, k, st, ct, float("nan"))
    with pytest.raises(ValueError, match="query 1 reads key rows \\[4, 6\\).*outside the 5 rows of k"):
        decode_attention(q, k, k, torch.tensor([0, 4], dtype=torch.int32), torch.tensor([1, 2], dtype=torch.int32), 1.0)
    with pytest.raises(ValueError, match="query 0 reads key rows \\[-1"):
        decode_attention(q, k, k, torch.tensor([-1, 0], dtype=torch.int32), ct, 1.0)


def test_unsupported_inputs_are_named():
    assert decode_attention_unsupported("cpu", torch.float32, 9, 3, 64) is None
    assert "multiple of its kv heads" in decode_attention_unsupported("cpu", torch.float32, 9, 2, 64)
    assert "floating dtype" in decode_attention_unsupported("cpu", torch.int32, 9, 3, 64)
    if torch.cuda.is_available():
        assert "float16 or bfloat16" in decode_attention_unsupported("cuda", torch.float32, 9, 3, 64)
        assert "head dim of 64 or 128" in decode_attention_unsupported("cuda", torch.bfloat16, 9, 3, 96)
        assert "at most 8" in decode_attention_unsupported("cuda", torch.bfloat16, 16, 1, 64)


def test_fake_implementation_gives_the_shape():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k = torch.empty(3, 9, 64), torch.empty(10, 3, 64)
        idx = torch.empty(3, dtype=torch.int32)
        out = torch.ops.peagle.decode_attention(q, k, k, idx, idx, 0.125)
    assert out.shape == (3, 9, 64) and out.dtype == torch.float32


@requires_cuda
@pytest.mark.parametrize("layout", ["verifier", "drafter"])
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (32, 8, 128), (8, 1, 64), (4, 4, 128), (16, 2, 64)])
@pytest.mark.parametrize("t,rows", [(1, 1), (4, 130), (9, 2048), (16, 600), (600, 300), (2, 12000)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_matches_reference(layout, hq, hkv, d, t, rows, dtype):
    """Cases that take every path of the kernel's plan: one block per (token, KV head) over one
    tile or over several (600 tokens fill the device without splitting), and runs split across
    blocks, one tile each (9 x 2048) or many (2 x 12000), whose partials are combined."""
    q, k, v, start, count = make_case(t, hq, hkv, d, rows, layout, dtype, "cuda", seed=rows + t + d)
    got = decode_attention(q, k, v, start, count, d**-0.5)
    torch.cuda.synchronize()
    assert got.shape == (t, hq, d) and got.dtype == dtype
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    want = reference(q, k, v, start.cpu(), count.cpu(), d**-0.5)
    torch.testing.assert_close(got.double().cpu(), want, rtol=tol, atol=tol)


@requires_cuda
def test_cuda_clamps_runs_past_the_cache():
    """Runs outside the key rows read nothing out of bounds: the CUDA op clamps them (no sync)."""
    q, k = torch.randn(3, 9, 64, device="cuda").bfloat16(), torch.randn(50, 3, 64, device="cuda").bfloat16()
    start = torch.tensor([40, -3, 60], dtype=torch.int32, device="cuda")
    count = torch.tensor([100, 5, 4], dtype=torch.int32, device="cuda")
    got = decode_attention(q, k, k, start, count, 0.125)
    torch.cuda.synchronize()
    want = reference(q, k, k, torch.tensor([40, 0, 0]), torch.tensor([10, 0, 0]), 0.125)
    torch.testing.assert_close(got.double().cpu(), want, rtol=2e-2, atol=2e-2)


@requires_cuda
def test_cuda_names_misaligned_k_and_v():
    """The kernel reads k and v rows in 16-byte units: a view that starts off that grid is refused
    by name, not read out of line."""
    q, k = torch.randn(2, 4, 64, device="cuda").bfloat16(), torch.randn(5, 2, 64, device="cuda").bfloat16()
    off = torch.randn(5 * 2 * 64 + 1, device="cuda").bfloat16()[1:].view(5, 2, 64)  # 2 bytes past the grid
    st = torch.zeros(2, dtype=torch.int32, device="cuda")
    ct = torch.ones(2, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="v must be 16-byte aligned"):
        decode_attention(q, k, off, st, ct, 0.125)
    with pytest.raises(ValueError, match="k must be 16-byte aligned"):
        decode_attention(q, off, k, st, ct, 0.125)


@requires_cuda
def test_cuda_graph_replay_reads_the_runs_at_replay():
    q, k, v, start, count = make_case(4, 9, 3, 64, 512, "verifier", torch.bfloat16, "cuda", seed=7)
    k, v = k.nan_to_num(), v.nan_to_num()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        decode_attention(q, k, v, start, count, 0.125)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(q, k, v, start, count, 0.125)
    for n in (1, 100, 511):
        count.fill_(n)
        start.zero_()
        graph.replay()
        torch.cuda.synchronize()
        want = reference(q, k, v, start.cpu(), count.cpu(), 0.125)
        torch.testing.assert_close(out.double().cpu(), want, rtol=2e-2, atol=2e-2)
