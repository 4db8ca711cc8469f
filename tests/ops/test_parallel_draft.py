"""peagle_ext.vllm: the parallel-drafting batch step (docs/design.md section 6) and the vLLM plugin.

Ground truth: peagle_ext.reference.parallel_draft.parallel_draft_loop, a per-request loop written from
vLLM 0.33's set_inputs_first_pass / copy_and_expand_eagle_inputs_kernel /
compute_new_slot_mapping, plus a hand-computed example. Every comparison is exact (the op
only moves data)."""

import dataclasses
import logging
import sys
import types

import pytest
import torch

import peagle_ext
from peagle_ext.reference.parallel_draft import parallel_draft_loop, parallel_draft_torch
from peagle_ext.serving import vllm_plugin
from peagle_ext.testing import random_draft_batch, uniform_int
from peagle_ext.vllm import PADDING_SLOT_ID, DraftBatch, prepare_parallel_draft_inputs
from tests.helpers import (
    DRAFT_BATCH_FIELDS,
    assert_same_batch,
    assert_same_first_pass,
    first_pass_inputs,
    requires_cuda,
)

ops = torch.ops.peagle


# ----------------------------------------------------------------------------------------
# random batches
# ----------------------------------------------------------------------------------------


def call(fn, args, kw, **extra):
    return fn(*args.values(), **kw, **extra)


# ----------------------------------------------------------------------------------------
# semantics on the CPU
# ----------------------------------------------------------------------------------------
def test_hand_computed_example():
    """Two requests, K=3: a 3-token prefill and a decode that rejected 2 of its 3 drafts."""
    th = torch.arange(7 * 2, dtype=torch.float32).view(7, 2) + 1  # row i = [2i+1, 2i+2]
    mh = torch.tensor([-5.0, -6.0])
    bt = torch.tensor([[5, 6, 7], [8, 9, 3]], dtype=torch.int32)
    got = prepare_parallel_draft_inputs(
        torch.tensor([11, 12, 13, 21, 22, 23, 24], dtype=torch.int32),
        torch.tensor([0, 1, 2, 7, 8, 9, 10]),
        torch.tensor([99, 98], dtype=torch.int32),
        torch.tensor([0, 3, 7], dtype=torch.int32),
        torch.tensor([0, 2], dtype=torch.int32),
        th,
        mh,
        bt,
        num_spec_tokens=3,
        mask_token_id=77,
        block_size=4,
        max_model_len=10,
    )
    M, Z = [-5.0, -6.0], [0.0, 0.0]
    assert got.input_ids.tolist() == [12, 13, 99, 77, 77, 22, 98, 77, 77, 0, 0]
    assert got.positions.tolist() == [0, 1, 2, 3, 4, 7, 8, 9, 10, 0, 0]
    assert got.is_masked.tolist() == [False, False, False, True, True, False, False, True, True, False, False]
    assert got.is_rejected.tolist() == [False] * 9 + [True, True]
    assert got.hidden.tolist() == [
        th[0].tolist(),
        th[1].tolist(),
        th[2].tolist(),
        M,
        M,
        th[3].tolist(),
        th[4].tolist(),
        M,
        M,
        Z,
        Z,
    ]
    assert got.token_indices_to_sample.tolist() == [2, 3, 4, 6, 7, 8]
    assert got.hidden_state_mapping.tolist() == [0, 1, 2, 5, 6, 7, 8]
    # request 0: block 5 for positions 0..3, block 6 for 4; request 1: position 7 -> block
    # table[1][1] = 9 -> 39, 8 and 9 -> table[1][2] = 3 -> 12, 13; 10 >= max_model_len -> -1.
    assert got.slot_mapping.tolist() == [20, 21, 22, 23, 24, 39, 12, 13, -1, -1, -1]
    assert got.query_start_loc.tolist() == [0, 5, 11]
    assert_same_batch(
        got,
        parallel_draft_loop(
            torch.tensor([11, 12, 13, 21, 22, 23, 24], dtype=torch.int32),
            torch.tensor([0, 1, 2, 7, 8, 9, 10]),
            torch.tensor([99, 98], dtype=torch.int32),
            torch.tensor([0, 3, 7], dtype=torch.int32),
            torch.tensor([0, 2], dtype=torch.int32),
            th,
            mh,
            bt,
            num_spec_tokens=3,
            mask_token_id=77,
            block_size=4,
            max_model_len=10,
        ),
    )


def test_k1_keeps_the_layout_and_only_shifts():
    """K=1: no MASK rows, T_out = T_in, the bonus token replaces the last accepted slot."""
    got = prepare_parallel_draft_inputs(
        torch.tensor([5, 6, 7, 8], dtype=torch.int32),
        torch.tensor([3, 4, 5, 6]),
        torch.tensor([50], dtype=torch.int32),
        torch.tensor([0, 4], dtype=torch.int32),
        torch.tensor([1], dtype=torch.int32),
        torch.randn(4, 3),
        torch.randn(3),
        torch.tensor([[2, 3]], dtype=torch.int32),
        num_spec_tokens=1,
        mask_token_id=9,
        block_size=8,
        max_model_len=16,
    )
    assert got.input_ids.tolist() == [6, 7, 50, 0]
    assert got.positions.tolist() == [3, 4, 5, 0]
    assert not got.is_masked.any()
    assert got.is_rejected.tolist() == [False, False, False, True]
    assert got.token_indices_to_sample.tolist() == [2]
    assert got.slot_mapping.tolist() == [19, 20, 21, -1]


@pytest.mark.parametrize("K", range(1, 11))
@pytest.mark.parametrize("B", [1, 5, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_loop_reference(rng, K, B, dtype):
    args, kw = random_draft_batch(rng, B=B, K=K, H=uniform_int(rng, 1, 24), dtype=dtype)
    assert_same_batch(call(prepare_parallel_draft_inputs, args, kw), call(parallel_draft_loop, args, kw))


@pytest.mark.parametrize("K", [1, 2, 4, 10])
def test_general_lengths_and_rejections(rng, K):
    """Any request length with any num_rejected in [0, len-1], fp16 hidden."""
    args, kw = random_draft_batch(rng, B=40, K=K, H=7, dtype=torch.float16, general=True)
    assert_same_batch(call(prepare_parallel_draft_inputs, args, kw), call(parallel_draft_loop, args, kw))


def test_batch_of_512(rng):
    args, kw = random_draft_batch(rng, B=512, K=7, H=8, dtype=torch.bfloat16, prefill_frac=0.05)
    assert_same_batch(call(prepare_parallel_draft_inputs, args, kw), call(parallel_draft_loop, args, kw))


@pytest.mark.parametrize("K", [1, 3, 8])
def test_prefill_only_no_drafts(rng, K):
    """A prefill-only step: vLLM passes num_rejected_tokens_gpu=None; zeros are the same."""
    args, kw = random_draft_batch(rng, B=9, K=K, H=5, prefill_frac=1.0, max_prefill=60)
    none_args = {**args, "num_rejected_tokens": None}
    got = call(prepare_parallel_draft_inputs, none_args, kw)
    assert_same_batch(got, call(prepare_parallel_draft_inputs, args, kw))
    assert_same_batch(got, call(parallel_draft_loop, none_args, kw))
    assert not got.is_rejected.any()


@pytest.mark.parametrize("K", [1, 3, 7, 10])
def test_positions_at_and_beyond_max_model_len(rng, K):
    args, kw = random_draft_batch(rng, B=30, K=K, H=4, near_max=True, general=True)
    got = call(prepare_parallel_draft_inputs, args, kw)
    assert_same_batch(got, call(parallel_draft_loop, args, kw))
    mml = kw["max_model_len"]
    live = ~got.is_rejected
    assert bool((got.positions[live] >= mml).any()) and bool((got.positions[live] == mml - 1).any())
    # Independent of the references: -1 exactly where rejected or at/after max_model_len.
    assert torch.equal(got.slot_mapping == PADDING_SLOT_ID, got.is_rejected | (got.positions >= mml))


@pytest.mark.parametrize("K", [1, 4, 9])
def test_vectorised_reference_matches_loop(rng, K):
    """The bench baseline (vLLM-like torch ops) is the same function as the loop."""
    args, kw = random_draft_batch(rng, B=25, K=K, H=6, near_max=True, general=True)
    assert_same_batch(call(parallel_draft_torch, args, kw), call(parallel_draft_loop, args, kw))


def test_structure_invariants(rng):
    """Properties that hold whatever the reference: bonus/MASK tokens at the sample indices,
    MASK rows carry mask_hidden, mapped rows carry their target row, row counts."""
    K = 5
    args, kw = random_draft_batch(rng, B=50, K=K, H=9)
    got = call(prepare_parallel_draft_inputs, args, kw)
    B = args["next_token_ids"].shape[0]
    tis = got.token_indices_to_sample.long().view(B, K)
    assert torch.equal(got.input_ids[tis[:, 0]], args["next_token_ids"])
    assert bool((got.input_ids[tis[:, 1:]] == kw["mask_token_id"]).all())
    assert bool(got.is_masked[tis[:, 1:]].all()) and not got.is_masked[tis[:, 0]].any()
    assert int(got.is_masked.sum()) == B * (K - 1)
    assert int(got.is_rejected.sum()) == int(args["num_rejected_tokens"].sum())
    assert bool((got.hidden[got.is_masked] == args["mask_hidden"]).all())
    m = got.hidden_state_mapping.long()
    assert bool((m[1:] > m[:-1]).all())
    keep = ~got.is_masked[m]
    assert torch.equal(got.hidden[m][keep], args["target_hidden"][keep])
    live = keep & ~got.is_rejected[m]  # rejected rows get position 0
    assert torch.equal(got.positions[m][live], args["target_positions"][live])
    assert bool((got.input_ids[got.is_rejected] == 0).all()) and bool((got.positions[got.is_rejected] == 0).all())


def test_out_form_equals_allocating_form(rng):
    args, kw = random_draft_batch(rng, B=12, K=4, H=16, dtype=torch.bfloat16, general=True)
    want = call(prepare_parallel_draft_inputs, args, kw)
    out = DraftBatch.empty(args["target_token_ids"].shape[0], 12, 4, 16, dtype=torch.bfloat16)
    for t in out.as_tuple():  # garbage everywhere: every element must be written
        t.copy_(torch.randint(-100, 100, t.shape, generator=rng).to(t.dtype))
    ptrs = [t.data_ptr() for t in out.as_tuple()]
    got = call(prepare_parallel_draft_inputs, args, kw, out=out)
    assert got is out and [t.data_ptr() for t in got.as_tuple()] == ptrs
    assert_same_batch(got, want)


def test_block_table_view_with_extra_rows_and_columns(rng):
    """A [:, :n] view of a wider table (row stride > n) and more rows than requests."""
    args, kw = random_draft_batch(rng, B=6, K=3, H=4, extra_rows=3, extra_blocks=2)
    wide = torch.randint(0, 5000, (9, args["block_table"].shape[1] + 5), generator=rng, dtype=torch.int32)
    args["block_table"] = wide[:, : args["block_table"].shape[1]]
    assert args["block_table"].stride(0) > args["block_table"].shape[1]
    got = call(prepare_parallel_draft_inputs, args, kw)
    assert_same_batch(got, call(parallel_draft_loop, {**args, "block_table": args["block_table"].contiguous()}, kw))


def test_empty_batch():
    got = prepare_parallel_draft_inputs(
        torch.zeros(0, dtype=torch.int32),
        torch.zeros(0, dtype=torch.long),
        torch.zeros(0, dtype=torch.int32),
        torch.zeros(1, dtype=torch.int32),
        None,
        torch.zeros(0, 4),
        torch.ones(4),
        torch.zeros(0, 2, dtype=torch.int32),
        num_spec_tokens=3,
        mask_token_id=1,
        block_size=16,
        max_model_len=32,
    )
    assert got.num_tokens == 0 and got.query_start_loc.tolist() == [0]
    assert got.token_indices_to_sample.shape == (0,) and got.hidden.shape == (0, 4)


def test_opcheck_schemas_and_fake_impls(rng):
    args, kw = random_draft_batch(rng, B=4, K=3, H=8)
    pos = list(args.values()) + [kw["num_spec_tokens"], kw["mask_token_id"], kw["block_size"], kw["max_model_len"]]
    tests = ("test_schema", "test_faketensor", "test_autograd_registration")
    torch.library.opcheck(ops.prepare_parallel_draft_inputs.default, tuple(pos), test_utils=tests)
    out = DraftBatch.empty(args["target_token_ids"].shape[0], 4, 3, 8, dtype=torch.float32)
    names = {f: ("new_query_start_loc" if f == "query_start_loc" else f) for f in DRAFT_BATCH_FIELDS}
    torch.library.opcheck(
        ops.prepare_parallel_draft_inputs_out.default,
        tuple(pos),
        {names[f]: getattr(out, f) for f in DRAFT_BATCH_FIELDS},
        test_utils=tests,
    )


# ----------------------------------------------------------------------------------------
# bad inputs: clear errors naming the argument
# ----------------------------------------------------------------------------------------
def _good(g):
    return random_draft_batch(g, B=3, K=3, H=4, prefill_frac=0.0, block_size=4, max_model_len=64)


@pytest.mark.parametrize(
    "name,bad,exc,match",
    [
        ("target_token_ids", lambda a: a.long(), TypeError, "target_token_ids"),
        ("target_positions", lambda a: a.int(), TypeError, "target_positions"),
        ("next_token_ids", lambda a: a.long(), TypeError, "next_token_ids"),
        ("query_start_loc", lambda a: a.long(), TypeError, "query_start_loc"),
        ("num_rejected_tokens", lambda a: a.long(), TypeError, "num_rejected_tokens"),
        ("target_hidden", lambda a: a.double(), TypeError, "target_hidden"),
        ("mask_hidden", lambda a: a.half(), TypeError, "mask_hidden"),
        ("block_table", lambda a: a.long(), TypeError, "block_table"),
        ("target_positions", lambda a: a[:-1], ValueError, "target_positions"),
        ("next_token_ids", lambda a: a[:-1], ValueError, "next_token_ids"),
        ("num_rejected_tokens", lambda a: a[:-1], ValueError, "num_rejected_tokens"),
        ("target_hidden", lambda a: a[:-1], ValueError, "target_hidden"),
        ("target_hidden", lambda a: a[:, :0], ValueError, "target_hidden"),
        ("mask_hidden", lambda a: a[:-1], ValueError, "mask_hidden"),
        ("mask_hidden", lambda a: a.view(1, -1), ValueError, "mask_hidden"),
        ("block_table", lambda a: a[:-1], ValueError, "block_table"),
        ("block_table", lambda a: a[:, :-1], ValueError, "max_model_len"),
        ("block_table", lambda a: a.t().contiguous().t(), ValueError, "block_table"),
        ("target_hidden", lambda a: a.t().contiguous().t(), ValueError, "target_hidden"),
        ("target_token_ids", lambda a: a.view(1, -1), ValueError, "target_token_ids"),
        ("query_start_loc", lambda a: a[:0], ValueError, "query_start_loc"),
        ("target_hidden", lambda a: a.numpy(), TypeError, "target_hidden"),
    ],
)
def test_bad_tensor_arguments(rng, name, bad, exc, match):
    args, kw = _good(rng)
    args[name] = bad(args[name])
    with pytest.raises(exc, match=match):
        call(prepare_parallel_draft_inputs, args, kw)


@pytest.mark.parametrize(
    "key,value,exc",
    [
        ("num_spec_tokens", 0, ValueError),
        ("num_spec_tokens", 2.0, TypeError),
        ("block_size", 0, ValueError),
        ("max_model_len", 0, ValueError),
        ("mask_token_id", -1, ValueError),
        ("mask_token_id", 2**31, ValueError),
        ("block_size", True, TypeError),
    ],
)
def test_bad_scalar_arguments(rng, key, value, exc):
    args, kw = _good(rng)
    with pytest.raises(exc, match=key):
        call(prepare_parallel_draft_inputs, args, {**kw, key: value})


@pytest.mark.parametrize(
    "case,match",
    [
        ("qsl0", r"query_start_loc\[0\]"),
        ("qsl_last", r"query_start_loc\[B\]"),
        ("empty_request", "at least one"),
        ("too_many_rejected", "num_rejected_tokens"),
        ("negative_rejected", "num_rejected_tokens"),
        ("negative_position", "target_positions"),
    ],
)
def test_bad_values_are_checked_on_cpu(rng, case, match):
    args, kw = _good(rng)
    qsl, nrej = args["query_start_loc"], args["num_rejected_tokens"]
    if case == "qsl0":
        qsl[0] = 1
    elif case == "qsl_last":
        qsl[-1] -= 1
    elif case == "empty_request":
        qsl[1] = qsl[0]
    elif case == "too_many_rejected":
        nrej[1] = int(qsl[2] - qsl[1])  # = len: would reject the request's first token
    elif case == "negative_rejected":
        nrej[0] = -1
    else:
        args["target_positions"][int(qsl[2])] = -3
    with pytest.raises(ValueError, match=match):
        call(prepare_parallel_draft_inputs, args, kw)


@pytest.mark.parametrize(
    "name",
    [
        "target_positions",
        "next_token_ids",
        "query_start_loc",
        "num_rejected_tokens",
        "target_hidden",
        "mask_hidden",
        "block_table",
    ],
)
def test_device_mismatch_is_named(rng, name):
    args, kw = _good(rng)
    args[name] = args[name].to("meta")
    with pytest.raises(ValueError, match=f"{name} must be on cpu"):
        call(prepare_parallel_draft_inputs, args, kw)


def test_meta_tensors_give_shapes(rng):
    """The fake implementation (torch.compile, meta device) sizes every output."""
    args, kw = random_draft_batch(rng, B=7, K=4, H=12)
    t_in = args["target_token_ids"].shape[0]
    got = DraftBatch(*ops.prepare_parallel_draft_inputs(*[v.to("meta") for v in args.values()], *kw.values()))
    want = DraftBatch.empty(t_in, 7, 4, 12, dtype=torch.float32)
    for f in DRAFT_BATCH_FIELDS:
        assert getattr(got, f).shape == getattr(want, f).shape and getattr(got, f).dtype == getattr(want, f).dtype


def test_bad_out_arguments(rng):
    args, kw = _good(rng)
    t_in = args["target_token_ids"].shape[0]
    with pytest.raises(TypeError, match="out must be a DraftBatch"):
        call(prepare_parallel_draft_inputs, args, kw, out=tuple(DraftBatch.empty(t_in, 3, 3, 4).as_tuple()))
    for field, make in [
        ("hidden", lambda t: t[:-1]),
        ("slot_mapping", lambda t: t.int()),
        ("token_indices_to_sample", lambda t: t[:-1]),
        ("query_start_loc", lambda t: t.long()),
        ("hidden", lambda t: t.half()),
    ]:
        out = DraftBatch.empty(t_in, 3, 3, 4, dtype=torch.float32)
        setattr(out, field, make(getattr(out, field)))
        with pytest.raises((TypeError, ValueError), match=f"out.{field}"):
            call(prepare_parallel_draft_inputs, args, kw, out=out)


def test_native_op_checks_too(rng):
    """The C++ op raises ValueError/TypeError by itself (without the Python wrapper)."""
    args, kw = _good(rng)
    pos = list(args.values()) + [kw["num_spec_tokens"], kw["mask_token_id"], kw["block_size"], kw["max_model_len"]]
    bad = list(pos)
    bad[5] = bad[5].double()
    with pytest.raises(TypeError, match="target_hidden"):
        ops.prepare_parallel_draft_inputs(*bad)
    bad = list(pos)
    bad[8] = 0
    with pytest.raises(ValueError, match="num_spec_tokens"):
        ops.prepare_parallel_draft_inputs(*bad)
    out = DraftBatch.empty(args["target_token_ids"].shape[0], 3, 3, 4)
    kws = {("new_query_start_loc" if f == "query_start_loc" else f): getattr(out, f) for f in DRAFT_BATCH_FIELDS}
    kws["hidden"] = args["target_hidden"].new_empty(out.hidden.shape[0] + 4, 4)[: out.hidden.shape[0]]
    in_place = list(pos)
    in_place[5] = kws["hidden"][: args["target_hidden"].shape[0]]
    in_place[5].copy_(args["target_hidden"])
    with pytest.raises(ValueError, match="overlap"):
        ops.prepare_parallel_draft_inputs_out(*in_place, **kws)


# ----------------------------------------------------------------------------------------
# the CUDA kernel's schedule, emulated on the CPU (runs everywhere)
# ----------------------------------------------------------------------------------------
EMULATION_CASES = [
    # B, K, H, dtype, vec_bytes, extra kwargs
    (1, 3, 4096, torch.bfloat16, 16, {}),  # 512 units per row: 2 rows per block
    (5, 7, 4096, torch.float32, 16, {}),  # 1024 units per row: 1 row per block
    (5, 7, 8192, torch.float32, 16, {}),  # 2048 units per row: 2 passes per block
    (33, 5, 4096, torch.bfloat16, 8, {"general": True, "near_max": True}),
    (33, 5, 4096, torch.bfloat16, 4, {}),
    (33, 5, 4096, torch.bfloat16, 2, {}),
    (17, 4, 4095, torch.bfloat16, 0, {}),  # 2-byte rows
    (17, 4, 6, torch.bfloat16, 0, {}),  # 12-byte rows -> 4-byte units, 85 rows per block
    (17, 4, 3, torch.float32, 0, {}),
    (40, 1, 24, torch.float16, 0, {"general": True}),
    (3, 10, 16, torch.float32, 16, {"prefill_frac": 1.0, "max_prefill": 3000}),  # 256 rows per block
    (64, 2, 1, torch.bfloat16, 2, {"general": True}),  # 1 unit per row: 1024 rows per block
    (9000, 2, 8, torch.float32, 16, {"prefill_frac": 0.0}),  # query_start_loc searched in global memory
]


@pytest.mark.parametrize("B,K,H,dtype,vec_bytes,extra", EMULATION_CASES)
def test_cuda_kernel_schedule_emulated_on_cpu(rng, B, K, H, dtype, vec_bytes, extra):
    """The kernel's launch plan + block phases (the code the .cu compiles), run on the CPU."""
    args, kw = random_draft_batch(rng, B=B, K=K, H=H, dtype=dtype, **extra)
    want = call(prepare_parallel_draft_inputs, args, kw)
    got = DraftBatch(
        *ops._parallel_draft_kernel_emulation(
            *args.values(), kw["num_spec_tokens"], kw["mask_token_id"], kw["block_size"], kw["max_model_len"], vec_bytes
        )
    )
    assert_same_batch(got, want, f"emulated kernel (vec {vec_bytes}): ")


def test_cuda_kernel_emulation_rejects_a_unit_that_does_not_divide_rows(rng):
    args, kw = random_draft_batch(rng, B=2, K=2, H=6, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="vec_bytes"):
        ops._parallel_draft_kernel_emulation(*args.values(), *kw.values(), 8)


# ----------------------------------------------------------------------------------------
# CUDA
# ----------------------------------------------------------------------------------------
CUDA_CASES = [
    # B, K, H, dtype, extra kwargs
    (1, 3, 4096, torch.bfloat16, {}),
    (8, 7, 4096, torch.bfloat16, {}),
    (64, 7, 4096, torch.bfloat16, {"prefill_frac": 0.1, "max_prefill": 300}),
    (256, 3, 4096, torch.bfloat16, {}),
    (512, 10, 256, torch.float32, {"general": True, "near_max": True}),
    (37, 5, 4095, torch.bfloat16, {}),  # 2-byte rows: unsigned short copies
    (37, 5, 6, torch.bfloat16, {}),  # 12-byte rows: 4-byte copies
    (37, 5, 4, torch.bfloat16, {}),  # 8-byte rows: 8-byte copies
    (37, 5, 3, torch.float32, {}),  # 12-byte rows, fp32
    (20, 1, 64, torch.float16, {"general": True}),
    (3, 4, 16, torch.float32, {"prefill_frac": 1.0, "max_prefill": 3000}),  # many rows per block, long prefill
    (9000, 2, 8, torch.float32, {"prefill_frac": 0.0}),  # query_start_loc too big for shared memory
]


@requires_cuda
@pytest.mark.parametrize("B,K,H,dtype,extra", CUDA_CASES)
def test_cuda_matches_cpu(rng, B, K, H, dtype, extra):
    args, kw = random_draft_batch(rng, B=B, K=K, H=H, dtype=dtype, **extra)
    want = call(prepare_parallel_draft_inputs, args, kw)
    cuda_args = {k: v.cuda() for k, v in args.items()}
    assert_same_batch(call(prepare_parallel_draft_inputs, cuda_args, kw), want, "cuda: ")
    if B <= 64:
        assert_same_batch(want, call(parallel_draft_loop, args, kw), "cpu vs loop: ")


@requires_cuda
def test_cuda_misaligned_hidden_pointers(rng):
    """Contiguous but not 16-byte aligned hidden tensors fall back to narrower copies."""
    args, kw = random_draft_batch(rng, B=16, K=4, H=64, dtype=torch.bfloat16)
    want = call(prepare_parallel_draft_inputs, args, kw)
    t_in = args["target_hidden"].shape[0]
    big = torch.empty(t_in * 64 + 64 + 1, dtype=torch.bfloat16, device="cuda")
    th = big[1 : 1 + t_in * 64].view(t_in, 64)
    th.copy_(args["target_hidden"])
    mh = big[-64:]
    mh.copy_(args["mask_hidden"])
    cuda_args = {k: v.cuda() for k, v in args.items()}
    cuda_args.update(target_hidden=th, mask_hidden=mh)
    out = DraftBatch.empty(t_in, 16, 4, 64, dtype=torch.bfloat16, device="cuda")
    hb = torch.empty(out.hidden.numel() + 3, dtype=torch.bfloat16, device="cuda")
    out.hidden = hb[3:].view_as(out.hidden)
    assert_same_batch(call(prepare_parallel_draft_inputs, cuda_args, kw, out=out), want, "misaligned: ")


@requires_cuda
def test_cuda_out_form_no_sync_and_none_rejected(rng):
    args, kw = random_draft_batch(rng, B=40, K=6, H=512, dtype=torch.bfloat16)
    cuda_args = {k: v.cuda() for k, v in args.items()}
    want = call(prepare_parallel_draft_inputs, args, kw)
    out = DraftBatch.empty(args["target_token_ids"].shape[0], 40, 6, 512, dtype=torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host sync below raises
    try:
        got = call(prepare_parallel_draft_inputs, cuda_args, kw, out=out)
        got2 = call(prepare_parallel_draft_inputs, cuda_args, kw)
        got3 = call(prepare_parallel_draft_inputs, {**cuda_args, "num_rejected_tokens": None}, kw)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert_same_batch(got, want)
    assert_same_batch(got2, want)
    assert_same_batch(got3, call(prepare_parallel_draft_inputs, {**args, "num_rejected_tokens": None}, kw))


@requires_cuda
def test_cuda_graph_capture_and_replay(rng):
    """Capture the out= form once; replay with new values in the same static inputs."""
    B, K, H = 32, 5, 1024
    args, kw = random_draft_batch(
        rng, B=B, K=K, H=H, dtype=torch.bfloat16, prefill_frac=0.0, max_model_len=300, block_size=16
    )
    static = {k: v.cuda() for k, v in args.items()}
    out = DraftBatch.empty(args["target_token_ids"].shape[0], B, K, H, dtype=torch.bfloat16, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up outside capture
        call(prepare_parallel_draft_inputs, static, kw, out=out)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call(prepare_parallel_draft_inputs, static, kw, out=out)
    for _ in range(3):
        new_args, _ = random_draft_batch(
            rng, B=B, K=K, H=H, dtype=torch.bfloat16, prefill_frac=0.0, max_model_len=300, block_size=16
        )
        new_args["query_start_loc"] = args["query_start_loc"]  # same shapes; values may differ elsewhere
        for k, v in new_args.items():
            static[k].copy_(v)
        for t in out.as_tuple():
            t.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert_same_batch(out, call(prepare_parallel_draft_inputs, new_args, kw), "graph replay: ")


@requires_cuda
def test_cuda_validate_flag_checks_values(rng):
    args, kw = _good(rng)
    args["num_rejected_tokens"][0] = 99
    cuda_args = {k: v.cuda() for k, v in args.items()}
    call(prepare_parallel_draft_inputs, cuda_args, kw)  # unchecked on CUDA: no error, no fault
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match="num_rejected_tokens"):
        call(prepare_parallel_draft_inputs, cuda_args, kw, validate=True)


@requires_cuda
def test_cuda_garbage_metadata_is_memory_safe(rng):
    """Inconsistent values (unchecked on CUDA) must not fault: outputs are unspecified."""
    args, kw = random_draft_batch(rng, B=64, K=4, H=128, dtype=torch.bfloat16)
    cuda_args = {k: v.cuda() for k, v in args.items()}
    t_in = args["target_token_ids"].shape[0]
    cuda_args["query_start_loc"] = torch.randint(-50, t_in + 50, (65,), device="cuda", dtype=torch.int32)
    cuda_args["num_rejected_tokens"] = torch.randint(-20, 20, (64,), device="cuda", dtype=torch.int32)
    cuda_args["target_positions"] = torch.randint(-1000, 10**6, (t_in,), device="cuda")
    call(prepare_parallel_draft_inputs, cuda_args, kw)
    torch.cuda.synchronize()


# ----------------------------------------------------------------------------------------
# plugin
# ----------------------------------------------------------------------------------------
@dataclasses.dataclass
class FakeCad:
    """The fields of vLLM 0.33's CommonAttentionMetadata that the step reads or writes."""

    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens: torch.Tensor
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    block_table_tensor: torch.Tensor
    slot_mapping: torch.Tensor

    def batch_size(self):
        return self.num_reqs

    def replace(self, **kw):
        return dataclasses.replace(self, **kw)


def fake_extend_all_queries_by_N(cad, N, arange, new_slot_mapping):
    """vLLM's extend_all_queries_by_N: every query and sequence grows by N."""
    return cad.replace(
        query_start_loc=cad.query_start_loc + N * arange[: len(cad.query_start_loc)],
        query_start_loc_cpu=cad.query_start_loc_cpu + N * torch.arange(len(cad.query_start_loc_cpu), dtype=torch.int32),
        seq_lens=cad.seq_lens + N,
        num_actual_tokens=cad.num_actual_tokens + cad.batch_size() * N,
        max_query_len=cad.max_query_len + N,
        max_seq_len=cad.max_seq_len + N,
        slot_mapping=new_slot_mapping,
    )


class FakeBaseProposer:
    """Shaped like vLLM 0.33's SpecDecodeBaseProposer for P-EAGLE; its set_inputs_first_pass
    is vLLM's parallel-drafting branch done with the vLLM-like reference ops."""

    method = "eagle3"

    def __init__(
        self,
        *,
        K,
        H,
        dtype,
        device,
        max_tokens,
        max_model_len,
        block_size,
        mask_token_id,
        mask_hidden,
        parallel_drafting=True,
    ):
        self.parallel_drafting = parallel_drafting
        self.pass_hidden_states_to_model = True
        self.num_speculative_tokens = K
        self.extra_slots_per_request = K if parallel_drafting else 1
        self.net_num_new_slots_per_request = self.extra_slots_per_request - 1
        self.needs_extra_input_slots = self.net_num_new_slots_per_request > 0
        self.use_heterogeneous_vocab = False
        self.uses_mrope = False
        self.device = torch.device(device)
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.parallel_drafting_token_id = mask_token_id
        self.parallel_drafting_hidden_state_tensor = mask_hidden.to(device)
        self.input_ids = torch.zeros(max_tokens, dtype=torch.int32, device=device)
        self.positions = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.hidden_states = torch.zeros(max_tokens, H, dtype=dtype, device=device)
        self.is_rejected_token_mask = torch.zeros(max_tokens, dtype=torch.bool, device=device)
        self.is_masked_token_mask = torch.zeros(max_tokens, dtype=torch.bool, device=device)
        self.arange = torch.arange(max_tokens, dtype=torch.int32, device=device)
        self.original_calls = 0

    def set_inputs_first_pass(
        self,
        target_token_ids,
        next_token_ids,
        target_positions,
        target_hidden_states,
        token_indices_to_sample,
        cad,
        num_rejected_tokens_gpu,
    ):
        self.original_calls += 1
        if not self.needs_extra_input_slots:
            return target_token_ids.shape[0], token_indices_to_sample, cad
        K = self.extra_slots_per_request
        ref = parallel_draft_torch(
            target_token_ids,
            target_positions,
            next_token_ids,
            cad.query_start_loc,
            num_rejected_tokens_gpu,
            target_hidden_states,
            self.parallel_drafting_hidden_state_tensor,
            cad.block_table_tensor,
            num_spec_tokens=K,
            mask_token_id=self.parallel_drafting_token_id,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            hidden_out=self.hidden_states,
        )
        n = ref.num_tokens
        self.input_ids[:n] = ref.input_ids
        self.positions[:n] = ref.positions
        self.is_rejected_token_mask[:n] = ref.is_rejected
        self.is_masked_token_mask[:n] = ref.is_masked
        new_cad = fake_extend_all_queries_by_N(
            cad, N=self.net_num_new_slots_per_request, arange=self.arange, new_slot_mapping=ref.slot_mapping
        )
        return n, ref.token_indices_to_sample, new_cad


class FakeEagleProposer(FakeBaseProposer):
    pass


def _proposer_and_inputs(g, *, K, device="cpu", parallel_drafting=True, none_rejected=False):
    call_kw, (args, kw) = first_pass_inputs(g, FakeCad, B=10, K=K, device=device, none_rejected=none_rejected)
    make = lambda: FakeEagleProposer(  # noqa: E731
        K=K,
        H=32,
        dtype=torch.bfloat16,
        device=device,
        max_tokens=2048,
        max_model_len=kw["max_model_len"],
        block_size=kw["block_size"],
        mask_token_id=kw["mask_token_id"],
        mask_hidden=args["mask_hidden"],
        parallel_drafting=parallel_drafting,
    )
    return make, call_kw


@pytest.fixture
def patched_fake():
    assert vllm_plugin.install(FakeEagleProposer, extend_all_queries_by_N=fake_extend_all_queries_by_N)
    yield FakeEagleProposer
    assert vllm_plugin.uninstall(FakeEagleProposer)
    assert "set_inputs_first_pass" not in FakeEagleProposer.__dict__


@pytest.mark.parametrize("K", [2, 3, 7])
@pytest.mark.parametrize("none_rejected", [False, True])
def test_plugin_patch_matches_vllm_step(rng, patched_fake, K, none_rejected):
    make, call_kw = _proposer_and_inputs(rng, K=K, none_rejected=none_rejected)
    p_orig, p_fused = make(), make()
    res_orig = FakeBaseProposer.set_inputs_first_pass(p_orig, **call_kw)
    res_fused = p_fused.set_inputs_first_pass(**call_kw)
    assert p_fused.original_calls == 0, "the fused path must not call vLLM's step"
    assert_same_first_pass(p_fused, p_orig, res_fused, res_orig)


@requires_cuda
@pytest.mark.parametrize("K", [3, 7])
def test_plugin_patch_matches_vllm_step_cuda(rng, patched_fake, K):
    make, call_kw = _proposer_and_inputs(rng, K=K, device="cuda")
    p_orig, p_fused = make(), make()
    res_orig = FakeBaseProposer.set_inputs_first_pass(p_orig, **call_kw)
    res_fused = p_fused.set_inputs_first_pass(**call_kw)
    assert p_fused.original_calls == 0
    assert_same_first_pass(p_fused, p_orig, res_fused, res_orig)


def test_plugin_falls_back_outside_p_eagle(rng, patched_fake, caplog):
    make, call_kw = _proposer_and_inputs(rng, K=3, parallel_drafting=False)
    p = make()
    with caplog.at_level(logging.INFO, logger="peagle_ext"):
        p.set_inputs_first_pass(**call_kw)
    assert p.original_calls == 1
    make, call_kw = _proposer_and_inputs(rng, K=3)
    p = make()
    p.uses_mrope = True
    p.set_inputs_first_pass(**call_kw)
    assert p.original_calls == 1


def test_plugin_install_is_idempotent_and_checks_the_signature(patched_fake):
    first = FakeEagleProposer.__dict__["set_inputs_first_pass"]
    assert vllm_plugin.install(FakeEagleProposer, extend_all_queries_by_N=fake_extend_all_queries_by_N)
    assert FakeEagleProposer.__dict__["set_inputs_first_pass"] is first

    class Other:
        def set_inputs_first_pass(self, target_token_ids, next_token_ids, cad):
            pass

    assert not vllm_plugin.install(Other, extend_all_queries_by_N=fake_extend_all_queries_by_N)


def test_register_without_vllm_logs_and_returns_false(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    with caplog.at_level(logging.INFO, logger="peagle_ext"):
        assert peagle_ext.vllm.register() is False
    assert "vLLM is not importable" in caplog.text


def _fake_vllm(monkeypatch, version):
    """A module tree with the names register() imports from vLLM 0.33."""

    class EagleProposer(FakeBaseProposer):
        pass

    mods = {
        name: types.ModuleType(name)
        for name in ("vllm", "vllm.v1", "vllm.v1.spec_decode", "vllm.v1.spec_decode.eagle", "vllm.v1.spec_decode.utils")
    }
    mods["vllm"].__version__ = version
    mods["vllm"].v1 = mods["vllm.v1"]
    mods["vllm.v1"].spec_decode = mods["vllm.v1.spec_decode"]
    mods["vllm.v1.spec_decode"].eagle = mods["vllm.v1.spec_decode.eagle"]
    mods["vllm.v1.spec_decode"].utils = mods["vllm.v1.spec_decode.utils"]
    mods["vllm.v1.spec_decode.eagle"].EagleProposer = EagleProposer
    mods["vllm.v1.spec_decode.utils"].extend_all_queries_by_N = fake_extend_all_queries_by_N
    for name, m in mods.items():
        monkeypatch.setitem(sys.modules, name, m)
    return EagleProposer


def test_register_refuses_unsupported_vllm_versions(monkeypatch, caplog):
    cls = _fake_vllm(monkeypatch, "0.20.1")
    with caplog.at_level(logging.INFO, logger="peagle_ext"):
        assert peagle_ext.vllm.register() is False
    assert "not a supported version" in caplog.text
    assert "set_inputs_first_pass" not in cls.__dict__


def test_register_patches_supported_vllm(monkeypatch, caplog, rng):
    cls = _fake_vllm(monkeypatch, "0.33.0")
    with caplog.at_level(logging.INFO, logger="peagle_ext"):
        assert peagle_ext.vllm.register() is True
        assert peagle_ext.vllm.register() is True  # vLLM may load plugins more than once
    assert "set_inputs_first_pass" in cls.__dict__
    make, call_kw = _proposer_and_inputs(rng, K=4)
    p = cls.__new__(cls)
    p.__dict__.update(make().__dict__)
    n, tis, _ = p.set_inputs_first_pass(**call_kw)
    assert p.original_calls == 0 and n == call_kw["target_token_ids"].shape[0] + 3 * 10
    monkeypatch.setenv("PEAGLE_EXT_VLLM_PLUGIN", "0")
    assert peagle_ext.vllm.register() is False


@pytest.mark.parametrize(
    "version,ok",
    [
        ("0.33.0", True),
        ("0.33.2rc1", True),
        ("0.33.0.dev12+gabc", True),
        ("0.32.1", False),
        ("0.34.0", False),
        ("dev", False),
    ],
)
def test_version_gate(version, ok):
    assert vllm_plugin.is_supported_version(version) is ok
