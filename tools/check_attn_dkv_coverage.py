"""CPU check of the property the atomic dQ backward (PEAGLE_ATTN_BWD=atomic) relies on per row:
the query runs that cod_attn_dkv_kernel finds for each 64-key block (per depth: binary searches on
the sorted window / sink bounds, merged when they touch; csrc/attention/cuda/cod_attn_bwd.cuh)
contain every allowed (valid query, range key) pair of the block exactly once: no pair missed, none
in two runs. The default backward's dK tests see this only in aggregate (rel-L2 over whole tensors);
the atomic variant's dq depends on it row by row. Metadata from the CPU op (the CUDA metadata is
tested equal to it), layouts = python_tests/test_attention.py's GPU scenarios and the layouts of
its atomic-variant tests.
Run: PYTHONPATH=$PWD python tools/check_attn_dkv_coverage.py   (prints 'coverage ok' or raises; ~1 min)"""
import sys
sys.path.insert(0, "python_tests")
import numpy as np, torch
import test_attention as ta
from peagle_ext.attention import cod_attention_metadata

def lb(v, b, e, x):
    while b < e:
        m = b + (e - b) // 2
        if v[m] < x: b = m + 1
        else: e = m
    return b

def check(lay, cross, window, sink, BN=64):
    meta = cod_attention_metadata(lay, cross=cross, window=window, sink=sink)
    R = meta.ranges.numpy().astype(np.int64); lo, hi, slo, shi, valid = R
    use_sink = meta.use_sink
    if not use_sink: slo = shi = np.zeros_like(lo)
    T = lo.shape[0]; N = lay.seq_len; offs = list(lay.depth_offsets); K = len(offs) - 1
    total = 0
    for j0 in range(0, N, BN):
        j1 = min(j0 + BN, N)
        cnt = np.zeros((T, j1 - j0), dtype=np.int64)
        for e in range(K):
            b, en = offs[e], offs[e + 1]
            wb, we = lb(hi, b, en, j0 + 1), lb(lo, b, en, j1)
            sb = se = 0
            if use_sink: sb, se = lb(shi, b, en, j0 + 1), lb(slo, b, en, j1)
            spans = []
            hw, hs = wb < we, sb < se
            if hw and hs and sb <= we and wb <= se: spans.append((min(wb, sb), max(we, se)))
            else:
                if hs: spans.append((sb, se))
                if hw: spans.append((wb, we))
            for s0, s1 in spans:
                for i in range(s0, s1):
                    js = np.arange(j0, j1)
                    ok = valid[i] != 0
                    allow = ok & (((lo[i] <= js) & (js < hi[i])) | ((slo[i] <= js) & (js < shi[i])))
                    cnt[i] += allow
        js = np.arange(j0, j1)[None, :]
        want = (valid[:, None] != 0) & (((lo[:, None] <= js) & (js < hi[:, None])) | ((slo[:, None] <= js) & (js < shi[:, None])))
        assert np.array_equal(cnt, want.astype(np.int64)), (j0, np.argwhere(cnt != want)[:5])
        total += int(want.sum())
    return total

g = torch.Generator().manual_seed(0)
for scen in ta.GPU_SCENARIOS:
    name, n, hq, hkv, window, sink, max_anchors, k_depths, max_doc, pad = scen
    for cross in (False, True):
        lay = ta.make_layout(g, n, cross=cross, num_depths=k_depths, max_anchors=max_anchors, max_doc_len=max_doc, pad_tail=pad)
        print(name, cross, "pairs", check(lay, cross, window, sink), flush=True)
for cross in (False, True):
    lay = ta.make_layout(g, 3000, cross=cross, max_doc_len=1400, pad_tail=13)
    print("agree", cross, check(lay, cross, 700, 3))
    lay = ta.make_layout(g, 500, cross=cross, num_depths=64, max_doc_len=300, pad_tail=7)
    print("deep", cross, check(lay, cross, 64, 2))
print("coverage ok")
