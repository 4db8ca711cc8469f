"""The vLLM plugin against vLLM 0.33.0's own proposer code, on CPU.

vLLM's sources come from the pinned wheel (tests/serving/vllm_sources.py: downloaded once,
about 10 s, then cached under ~/.cache/peagle_ext/vllm-0.33.0; the tests skip only when the
package index cannot be reached). tests/serving/vllm_cpu.py imports them:

Real, executed from vLLM's files: `EagleProposer` and `SpecDecodeBaseProposer` (its __init__,
which derives the parallel-drafting attributes and allocates the buffers the plugin writes,
and its `set_inputs_first_pass`), `spec_decode/utils` (`compute_new_slot_mapping`,
`extend_all_queries_by_N`, the body of `copy_and_expand_eagle_inputs_kernel`),
`CommonAttentionMetadata`, `vllm.__version__`.

Stubbed, because they need compiled extensions, a GPU or vLLM's whole dependency tree
(vllm._C, CUDA graphs, NCCL, pyzmq, msgspec, the engine and the model zoo) and the input
step uses none of them: every other vLLM module (attributes are MagicMocks), except
- Triton: `triton.jit` is the identity and `tl` a block-level emulator of the operations the
  kernel uses (program_id, arange, load, store, where, minimum), so vLLM's kernel body runs on
  CPU tensors; `triton_kernel_dispatcher_with_warmup` launches the grid its launcher returns.
  The emulated kernel is also checked against `peagle_ext.reference.parallel_draft_loop`.
- `current_platform` (not ROCm), `init_logger` (logging), `get_compress_ratios` (None: no
  DeepSeek-V4 draft).
The proposer's config is a SimpleNamespace holding only what __init__ reads, so a new field
read by __init__ fails loudly rather than reading a MagicMock.
"""

from __future__ import annotations

import inspect
import logging
from types import SimpleNamespace

import pytest
import torch

from peagle_ext.reference.parallel_draft import parallel_draft_loop
from peagle_ext.serving import vllm_plugin
from tests.helpers import assert_same_first_pass, first_pass_inputs
from tests.serving import vllm_sources
from tests.serving.vllm_cpu import vllm_on_cpu
from tests.serving.vllm_sources import VLLM_VERSION, SourcesUnavailable, ensure_vllm_sources

pytestmark = pytest.mark.usefixtures("one_thread")

# What the plugin reads from a proposer (vllm_plugin.unsupported_reason / fused_first_pass).
PLUGIN_ATTRS = (
    "parallel_drafting",
    "needs_extra_input_slots",
    "method",
    "pass_hidden_states_to_model",
    "extra_slots_per_request",
    "net_num_new_slots_per_request",
    "use_heterogeneous_vocab",
    "uses_mrope",
    "parallel_drafting_hidden_state_tensor",
    "parallel_drafting_token_id",
    "is_rejected_token_mask",
    "is_masked_token_mask",
    "block_size",
    "max_model_len",
    "input_ids",
    "positions",
    "hidden_states",
    "arange",
)


@pytest.fixture(scope="module")
def vllm():
    try:
        src = ensure_vllm_sources()
    except SourcesUnavailable as e:
        pytest.skip(f"vLLM {VLLM_VERSION} sources unavailable: {e}")
    with vllm_on_cpu(src) as finder:
        import vllm as vllm_pkg
        from vllm.v1.attention.backend import CommonAttentionMetadata
        from vllm.v1.spec_decode import eagle, llm_base_proposer, utils

        yield SimpleNamespace(
            version=vllm_pkg.__version__,
            EagleProposer=eagle.EagleProposer,
            Base=llm_base_proposer.SpecDecodeBaseProposer,
            base_module=llm_base_proposer,
            utils=utils,
            Cad=CommonAttentionMetadata,
            stubbed=finder.stubbed,
            src=src,
        )
        vllm_plugin.uninstall(eagle.EagleProposer)


@pytest.fixture
def patched(vllm):
    assert vllm_plugin.register() is True
    yield vllm.EagleProposer
    assert vllm_plugin.uninstall(vllm.EagleProposer)


def make_proposer(vllm, *, K, H, dtype, max_model_len, block_size, mask_token_id, mask_hidden, parallel=True):
    """A real EagleProposer built by vLLM's __init__ (block_size and the mask hidden state are
    set later in vLLM, by initialize_attn_backend and load_model)."""
    hf_config = SimpleNamespace(mask_token_id=mask_token_id)
    draft = SimpleNamespace(
        hf_config=hf_config, get_hidden_size=lambda: H, get_inputs_embeds_size=lambda: H, uses_mrope=False
    )
    spec = SimpleNamespace(
        draft_model_config=draft,
        method="eagle3",
        num_speculative_tokens=K,
        parallel_drafting=parallel,
        use_local_argmax_reduction=False,
        use_heterogeneous_vocab=False,
        disable_padded_drafter_batch=False,
        rejection_sample_method="strict",
        draft_sample_method="greedy",
    )
    model = SimpleNamespace(
        dtype=dtype,
        max_model_len=max_model_len,
        use_fp64_gumbel=False,
        get_vocab_size=lambda: 32000,
        supports_multimodal_inputs=False,
        uses_mrope=False,
    )
    cfg = SimpleNamespace(
        speculative_config=spec,
        model_config=model,
        parallel_config=SimpleNamespace(data_parallel_rank=0),
        scheduler_config=SimpleNamespace(max_num_seqs=64, max_num_batched_tokens=1024),
        compilation_config=SimpleNamespace(),
    )
    p = vllm.EagleProposer(cfg, torch.device("cpu"))
    p.block_size = block_size
    if p.parallel_drafting_hidden_state_tensor is not None:
        p.parallel_drafting_hidden_state_tensor.copy_(mask_hidden)
    return p


def make_step(vllm, g, *, K, dtype=torch.bfloat16, none_rejected=False, near_max=False, parallel=True):
    """(make_proposer(), keyword arguments of set_inputs_first_pass, the op's inputs)."""
    call, (args, kw) = first_pass_inputs(
        g, vllm.Cad, B=9, K=K, dtype=dtype, near_max=near_max, none_rejected=none_rejected
    )
    make = lambda: make_proposer(
        vllm,
        K=K,
        H=32,
        dtype=dtype,
        max_model_len=kw["max_model_len"],
        block_size=kw["block_size"],
        mask_token_id=kw["mask_token_id"],
        mask_hidden=args["mask_hidden"],
        parallel=parallel,
    )
    return make, call, (args, kw)


def test_sources_skip_only_when_the_index_is_unreachable(tmp_path, monkeypatch):
    monkeypatch.setenv("PEAGLE_EXT_CACHE", str(tmp_path))
    monkeypatch.delenv("PEAGLE_EXT_VLLM_WHEEL", raising=False)
    failed = SimpleNamespace(returncode=1, stdout="", stderr="no such version")
    monkeypatch.setattr(vllm_sources.subprocess, "run", lambda *a, **k: failed)
    monkeypatch.setattr(vllm_sources, "_index_reachable", lambda: False)
    with pytest.raises(SourcesUnavailable):
        ensure_vllm_sources()
    monkeypatch.setattr(vllm_sources, "_index_reachable", lambda: True)
    with pytest.raises(RuntimeError, match="no such version"):  # reachable: a real failure
        ensure_vllm_sources()
    bogus = tmp_path / vllm_sources.WHEEL_NAME
    bogus.write_bytes(b"not the wheel")
    monkeypatch.setenv("PEAGLE_EXT_VLLM_WHEEL", str(bogus))
    with pytest.raises(RuntimeError, match="sha256"):
        ensure_vllm_sources()
    assert not vllm_sources.cache_dir().exists()


# ----------------------------------------------------------------------------------------
# what the plugin patches, with vLLM's real signatures
# ----------------------------------------------------------------------------------------
def test_sources_are_vllm_033(vllm):
    assert vllm.version == VLLM_VERSION
    assert vllm_plugin.is_supported_version(vllm.version)
    # the modules under test are vLLM's files, not stubs
    for module in (vllm.base_module, vllm.utils, inspect.getmodule(vllm.EagleProposer), inspect.getmodule(vllm.Cad)):
        assert module.__name__ not in vllm.stubbed
        assert module.__file__.startswith(str(vllm.src)), module.__file__


def test_plugin_expects_vllms_signatures(vllm):
    method = vllm.Base.set_inputs_first_pass
    params = inspect.signature(method).parameters
    assert tuple(params) == vllm_plugin._EXPECTED_PARAMS
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD and p.default is p.empty for p in params.values())
    # EagleProposer inherits it: the patch overrides the subclass only
    assert "set_inputs_first_pass" not in vllm.EagleProposer.__dict__
    assert vllm.EagleProposer.set_inputs_first_pass is method
    # propose() calls it with every argument by keyword
    src = inspect.getsource(vllm.Base.propose)
    call = src[src.index("self.set_inputs_first_pass(") :].split(")", 1)[0]
    assert all(f"{p}=" in call for p in vllm_plugin._EXPECTED_PARAMS[1:]), call
    # the utility the patched step keeps, called as the plugin calls it
    extend = vllm.utils.extend_all_queries_by_N
    inspect.signature(extend).bind(None, N=1, arange=None, new_slot_mapping=None)
    assert vllm.base_module.extend_all_queries_by_N is extend


def test_vllms_proposer_has_what_the_plugin_reads(vllm, rng):
    make, call, _ = make_step(vllm, rng, K=4)
    p = make()
    missing = [a for a in PLUGIN_ATTRS if not hasattr(p, a)]
    assert not missing
    assert (p.extra_slots_per_request, p.net_num_new_slots_per_request, p.needs_extra_input_slots) == (4, 3, True)
    assert (p.input_ids.dtype, p.positions.dtype, p.hidden_states.dtype) == (torch.int32, torch.int64, torch.bfloat16)
    call.pop("token_indices_to_sample")
    assert vllm_plugin.unsupported_reason(p, **call) is None
    assert call["cad"].batch_size() == 9


def test_register_patches_eagle_proposer(vllm, caplog):
    original = vllm.Base.set_inputs_first_pass
    with caplog.at_level(logging.INFO, logger="peagle_ext"):
        assert vllm_plugin.register() is True
        patched = vllm.EagleProposer.__dict__["set_inputs_first_pass"]
        assert vllm_plugin.register() is True  # vLLM loads general plugins in every process
    try:
        assert "now builds parallel-drafting" in caplog.text
        assert vllm.EagleProposer.__dict__["set_inputs_first_pass"] is patched
        assert getattr(patched, vllm_plugin._PATCH_ATTR) == (original, False)
        own = inspect.signature(patched, follow_wrapped=False)
        assert own.parameters.keys() == inspect.signature(original).parameters.keys()
        assert vllm.Base.set_inputs_first_pass is original  # the base class is left alone
    finally:
        assert vllm_plugin.uninstall(vllm.EagleProposer)
    assert vllm.EagleProposer.set_inputs_first_pass is original


def _changed(kind):
    """set_inputs_first_pass as a later vLLM might change it."""
    if kind == "extra_param":

        def changed(
            self,
            target_token_ids,
            next_token_ids,
            target_positions,
            target_hidden_states,
            token_indices_to_sample,
            cad,
            num_rejected_tokens_gpu,
            mm_embed_inputs=None,
        ):
            pass

    elif kind == "renamed":

        def changed(
            self,
            target_token_ids,
            next_token_ids,
            target_positions,
            target_hidden_states,
            token_indices_to_sample,
            common_attn_metadata,
            num_rejected_tokens_gpu,
        ):
            pass

    else:  # reordered

        def changed(
            self,
            target_token_ids,
            target_positions,
            next_token_ids,
            target_hidden_states,
            token_indices_to_sample,
            cad,
            num_rejected_tokens_gpu,
        ):
            pass

    return changed


@pytest.mark.parametrize("kind", ["extra_param", "renamed", "reordered"])
def test_register_refuses_a_changed_signature(vllm, monkeypatch, caplog, kind):
    changed = _changed(kind)
    monkeypatch.setattr(vllm.Base, "set_inputs_first_pass", changed)
    with caplog.at_level(logging.INFO, logger="peagle_ext"):
        assert vllm_plugin.register() is False
    assert "set_inputs_first_pass has parameters" in caplog.text and "not patched" in caplog.text
    assert "set_inputs_first_pass" not in vllm.EagleProposer.__dict__
    assert vllm.Base.set_inputs_first_pass is changed


def test_register_refuses_a_changed_extend_all_queries_by_N(vllm, monkeypatch, caplog):
    def extend_all_queries_by_N(common_attn_metadata, num_new_tokens, arange, new_slot_mapping):
        pass

    monkeypatch.setattr(vllm.utils, "extend_all_queries_by_N", extend_all_queries_by_N)
    with caplog.at_level(logging.INFO, logger="peagle_ext"):
        assert vllm_plugin.register() is False
    assert "extend_all_queries_by_N" in caplog.text and "not patched" in caplog.text
    assert "set_inputs_first_pass" not in vllm.EagleProposer.__dict__


@pytest.mark.parametrize("missing", ["EagleProposer", "extend_all_queries_by_N", "set_inputs_first_pass"])
def test_register_refuses_a_missing_name(vllm, monkeypatch, caplog, missing):
    if missing == "EagleProposer":
        import vllm.v1.spec_decode.eagle as eagle_module

        monkeypatch.delattr(eagle_module, "EagleProposer")
    elif missing == "extend_all_queries_by_N":
        monkeypatch.delattr(vllm.utils, "extend_all_queries_by_N")
    else:
        monkeypatch.delattr(vllm.Base, "set_inputs_first_pass")
    with caplog.at_level(logging.INFO, logger="peagle_ext"):
        assert vllm_plugin.register() is False
    assert "not patched" in caplog.text or "does nothing" in caplog.text
    assert "set_inputs_first_pass" not in vllm.EagleProposer.__dict__


# ----------------------------------------------------------------------------------------
# the patched step against vLLM's own, both run on CPU
# ----------------------------------------------------------------------------------------
@pytest.fixture
def vllm_kernel_calls(vllm, monkeypatch):
    """Counts launches of vLLM's copy_and_expand_eagle_inputs (the emulated Triton kernel)."""
    calls = []
    launch = vllm.base_module._copy_and_expand_eagle_inputs

    def counted(*args, **kwargs):
        calls.append(1)
        return launch(*args, **kwargs)

    counted.register_warmup = launch.register_warmup
    monkeypatch.setattr(vllm.base_module, "_copy_and_expand_eagle_inputs", counted)
    return calls


def test_vllms_emulated_step_matches_the_reference(vllm, rng, vllm_kernel_calls):
    """The CPU run of vLLM's step (its kernel body under the Triton emulator, its torch ops)
    equals the independently written reference: the emulator is faithful."""
    for K, near_max in ((2, False), (5, True), (8, False)):
        make, call, (args, kw) = make_step(vllm, rng, K=K, near_max=near_max)
        p = make()
        n, tis, cad = vllm.Base.set_inputs_first_pass(p, **call)
        ref = parallel_draft_loop(*args.values(), **kw)
        assert n == ref.num_tokens
        assert torch.equal(tis, ref.token_indices_to_sample)
        assert torch.equal(p.input_ids[:n], ref.input_ids)
        assert torch.equal(p.positions[:n], ref.positions)
        assert torch.equal(p.hidden_states[:n], ref.hidden)
        assert torch.equal(p.is_rejected_token_mask[:n], ref.is_rejected)
        assert torch.equal(p.is_masked_token_mask[:n], ref.is_masked)
        assert torch.equal(cad.slot_mapping, ref.slot_mapping)
        assert torch.equal(cad.query_start_loc, ref.query_start_loc)
    assert len(vllm_kernel_calls) == 3


@pytest.mark.parametrize(
    "K,dtype,none_rejected,near_max",
    [
        (2, torch.bfloat16, False, False),
        (4, torch.float32, True, False),
        (4, torch.float16, False, True),
        (7, torch.bfloat16, False, True),
    ],
)
def test_patched_step_equals_vllms_own(vllm, patched, rng, vllm_kernel_calls, K, dtype, none_rejected, near_max):
    make, call, _ = make_step(vllm, rng, K=K, dtype=dtype, none_rejected=none_rejected, near_max=near_max)
    p_vllm, p_fused = make(), make()
    # A previous step's content in the persistent buffers: the rows vLLM does not write keep
    # it, the op writes zero hidden rows there (assert_same_first_pass checks both).
    for name in ("input_ids", "positions", "hidden_states"):
        garbage = torch.randint(-9, 9, getattr(p_vllm, name).shape, generator=rng)
        getattr(p_vllm, name).copy_(garbage)
        getattr(p_fused, name).copy_(garbage)
    res_vllm = vllm.Base.set_inputs_first_pass(p_vllm, **call)
    assert len(vllm_kernel_calls) == 1
    res_fused = p_fused.set_inputs_first_pass(**call)
    assert len(vllm_kernel_calls) == 1, "the patched step ran vLLM's kernel"
    assert_same_first_pass(p_fused, p_vllm, res_fused, res_vllm, cad_in=call["cad"])
    assert res_fused[2].slot_mapping.dtype == res_vllm[2].slot_mapping.dtype == torch.int64
    assert isinstance(res_fused[2], vllm.Cad)


def test_patched_proposer_falls_back_to_vllm_outside_p_eagle(
    vllm, patched, rng, vllm_kernel_calls, caplog, monkeypatch
):
    monkeypatch.setattr(vllm_plugin, "_logged_reasons", set())  # each reason is logged once a process
    # plain EAGLE (no parallel drafting): vLLM's own shift-and-copy path
    make, call, _ = make_step(vllm, rng, K=3, parallel=False)
    p_vllm, p_patched = make(), make()
    assert not p_patched.needs_extra_input_slots
    with caplog.at_level(logging.INFO, logger="peagle_ext"):
        res = p_patched.set_inputs_first_pass(**call)
    assert "plain EAGLE path" in caplog.text
    assert_same_first_pass(p_patched, p_vllm, res, vllm.Base.set_inputs_first_pass(p_vllm, **call))
    # P-EAGLE with an input the op does not take (int64 rejected counts): vLLM's step runs
    make, call, _ = make_step(vllm, rng, K=3)
    call["num_rejected_tokens_gpu"] = call["num_rejected_tokens_gpu"].long()
    p_vllm, p_patched = make(), make()
    res = p_patched.set_inputs_first_pass(**call)
    assert len(vllm_kernel_calls) == 1
    assert_same_first_pass(p_patched, p_vllm, res, vllm.Base.set_inputs_first_pass(p_vllm, **call))
