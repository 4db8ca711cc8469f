"""vLLM plugin: run vLLM's parallel-drafting input step (P-EAGLE) through peagle_ext's op.

Entry point (group "vllm.general_plugins", loaded by vLLM in every process):
    peagle_ext = "peagle_ext.serving.vllm_plugin:register"

Supported vLLM: 0.33.x (the code this patch was written against). In vLLM 0.33,
`SpecDecodeBaseProposer.set_inputs_first_pass(target_token_ids, next_token_ids,
target_positions, target_hidden_states, token_indices_to_sample, cad, num_rejected_tokens_gpu)`
(vllm/v1/spec_decode/llm_base_proposer.py) has a branch for `needs_extra_input_slots` that
runs copy_and_expand_eagle_inputs_kernel, an index_put + torch.where on the hidden states,
compute_new_slot_mapping and extend_all_queries_by_N. `register()` overrides that method on
`EagleProposer` (vllm/v1/spec_decode/eagle.py) with a wrapper that, for P-EAGLE (method eagle
or eagle3, parallel_drafting, hidden states passed to the drafter, 1-D positions), writes the
same buffers with ONE call of `prepare_parallel_draft_inputs(..., out=...)` and keeps vLLM's
own `extend_all_queries_by_N` for the attention metadata. Every other case (EAGLE without
parallel drafting, M-RoPE, heterogeneous vocab, a device without our kernels, ...) calls
vLLM's original method unchanged, logging the reason once.

Environment: PEAGLE_EXT_VLLM_PLUGIN=0 disables the patch; PEAGLE_EXT_VLLM_ALLOW_UNTESTED=1
patches a vLLM version outside the supported list (when its method signature matches).
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import re

import torch

logger = logging.getLogger("peagle_ext")

SUPPORTED_VLLM_MINOR_VERSIONS = ((0, 33),)
"""(major, minor) of the vLLM releases whose proposer code this patch was written against."""

_EXPECTED_PARAMS = (
    "self",
    "target_token_ids",
    "next_token_ids",
    "target_positions",
    "target_hidden_states",
    "token_indices_to_sample",
    "cad",
    "num_rejected_tokens_gpu",
)
_PATCH_ATTR = "_peagle_ext_original"
_logged_reasons: set[str] = set()


def parse_version(version: str) -> tuple[int, int] | None:
    """(major, minor) of a version string such as '0.33.0', '0.33.1rc1' or '0.33.0.dev5+gabc'."""
    m = re.match(r"^\s*v?(\d+)\.(\d+)", str(version))
    return (int(m.group(1)), int(m.group(2))) if m else None


def is_supported_version(version: str) -> bool:
    return parse_version(version) in SUPPORTED_VLLM_MINOR_VERSIONS


def register() -> bool:
    """Patch vLLM when a supported version is importable. Never raises: returns True when the
    patch is installed (or already was), False otherwise, and logs why."""
    if os.environ.get("PEAGLE_EXT_VLLM_PLUGIN", "1").strip().lower() in ("0", "false", "no", "off"):
        logger.info("peagle_ext: vLLM plugin disabled by PEAGLE_EXT_VLLM_PLUGIN")
        return False
    try:
        import vllm
    except ImportError as e:
        logger.info("peagle_ext: vLLM is not importable (%s); the parallel-drafting plugin does nothing", e)
        return False
    except Exception as e:  # a broken vLLM install must not break the caller
        logger.warning("peagle_ext: importing vLLM failed (%r); the parallel-drafting plugin does nothing", e)
        return False
    version = str(getattr(vllm, "__version__", "unknown"))
    supported = ", ".join(f"{a}.{b}.x" for a, b in SUPPORTED_VLLM_MINOR_VERSIONS)
    if not is_supported_version(version):
        if os.environ.get("PEAGLE_EXT_VLLM_ALLOW_UNTESTED", "") != "1":
            logger.warning(
                "peagle_ext: vLLM %s is not a supported version (supported: %s); vLLM's own "
                "parallel-drafting step stays in use (PEAGLE_EXT_VLLM_ALLOW_UNTESTED=1 to try anyway)",
                version,
                supported,
            )
            return False
        logger.warning(
            "peagle_ext: vLLM %s is untested (supported: %s); patching because PEAGLE_EXT_VLLM_ALLOW_UNTESTED=1",
            version,
            supported,
        )
    try:
        from vllm.v1.spec_decode import utils as spec_utils
        from vllm.v1.spec_decode.eagle import EagleProposer

        extend = spec_utils.extend_all_queries_by_N
    except Exception as e:
        logger.warning(
            "peagle_ext: vLLM %s has no EagleProposer / extend_all_queries_by_N where expected (%r); "
            "the parallel-drafting plugin does nothing",
            version,
            e,
        )
        return False
    try:
        return install(EagleProposer, extend_all_queries_by_N=extend)
    except Exception as e:
        logger.warning("peagle_ext: patching vLLM %s failed (%r); vLLM's own step stays in use", version, e)
        return False


def install(proposer_cls, *, extend_all_queries_by_N) -> bool:
    """Override proposer_cls.set_inputs_first_pass with the fused step (idempotent)."""
    current = getattr(proposer_cls, "set_inputs_first_pass", None)
    if current is None:
        logger.warning("peagle_ext: %s has no set_inputs_first_pass; not patched", proposer_cls.__name__)
        return False
    if getattr(current, _PATCH_ATTR, None) is not None:
        return True
    params = tuple(inspect.signature(current).parameters)
    if params != _EXPECTED_PARAMS:
        logger.warning(
            "peagle_ext: %s.set_inputs_first_pass has parameters %s, expected %s; not patched",
            proposer_cls.__name__,
            params,
            _EXPECTED_PARAMS,
        )
        return False
    # The fused step still calls vLLM's extend_all_queries_by_N for the attention metadata; a
    # changed signature must refuse the patch here, not fail on the first decoding step.
    try:
        inspect.signature(extend_all_queries_by_N).bind(None, N=0, arange=None, new_slot_mapping=None)
    except (TypeError, ValueError) as e:
        logger.warning(
            "peagle_ext: extend_all_queries_by_N cannot be called as (cad, N=, arange=, new_slot_mapping=) "
            "(%s); %s.set_inputs_first_pass not patched",
            e,
            proposer_cls.__name__,
        )
        return False
    original = current
    had_own = "set_inputs_first_pass" in proposer_cls.__dict__

    @functools.wraps(original)
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
        reason = unsupported_reason(
            self, target_token_ids, next_token_ids, target_positions, target_hidden_states, cad, num_rejected_tokens_gpu
        )
        if reason is not None:
            _log_once(reason)
            return original(
                self,
                target_token_ids,
                next_token_ids,
                target_positions,
                target_hidden_states,
                token_indices_to_sample,
                cad,
                num_rejected_tokens_gpu,
            )
        return fused_first_pass(
            self,
            target_token_ids,
            next_token_ids,
            target_positions,
            target_hidden_states,
            cad,
            num_rejected_tokens_gpu,
            extend_all_queries_by_N,
        )

    setattr(set_inputs_first_pass, _PATCH_ATTR, (original, had_own))
    proposer_cls.set_inputs_first_pass = set_inputs_first_pass
    logger.info(
        "peagle_ext: %s.set_inputs_first_pass now builds parallel-drafting (P-EAGLE) inputs with "
        "peagle_ext.vllm.prepare_parallel_draft_inputs (one kernel)",
        proposer_cls.__name__,
    )
    return True


def uninstall(proposer_cls) -> bool:
    """Undo install(); True when a patch was removed."""
    current = proposer_cls.__dict__.get("set_inputs_first_pass")
    saved = getattr(current, _PATCH_ATTR, None)
    if saved is None:
        return False
    original, had_own = saved
    if had_own:
        proposer_cls.set_inputs_first_pass = original
    else:
        delattr(proposer_cls, "set_inputs_first_pass")
    return True


@functools.lru_cache(maxsize=1)
def _has_cuda_kernels() -> bool:
    from .._native import has_cuda_kernels

    return has_cuda_kernels()


def _log_once(reason: str) -> None:
    if reason not in _logged_reasons:
        _logged_reasons.add(reason)
        logger.info("peagle_ext: vLLM's own set_inputs_first_pass used: %s", reason)


def unsupported_reason(
    self, target_token_ids, next_token_ids, target_positions, target_hidden_states, cad, num_rejected_tokens_gpu
) -> str | None:
    """Why the fused step cannot stand in for vLLM's here, or None when it can."""
    from ..ops.parallel_draft import HIDDEN_DTYPES

    if not getattr(self, "parallel_drafting", False) or not getattr(self, "needs_extra_input_slots", False):
        return "parallel drafting is off (plain EAGLE path)"
    if getattr(self, "method", None) not in ("eagle", "eagle3"):
        return f"method {getattr(self, 'method', None)!r} is not eagle/eagle3"
    if not getattr(self, "pass_hidden_states_to_model", False):
        return "the drafter takes no hidden states (draft-model / PARD layout, no token shift)"
    k = int(self.extra_slots_per_request)
    if self.net_num_new_slots_per_request != k - 1:
        return f"unexpected slot counts (extra {k}, net {self.net_num_new_slots_per_request})"
    if getattr(self, "use_heterogeneous_vocab", False):
        return "heterogeneous vocab mapping"
    if getattr(self, "uses_mrope", False) or target_positions.dim() != 1:
        return "M-RoPE positions"
    mask_hidden = getattr(self, "parallel_drafting_hidden_state_tensor", None)
    if mask_hidden is None or self.is_rejected_token_mask is None or self.is_masked_token_mask is None:
        return "parallel-drafting buffers are not allocated"
    if self.block_size <= 0:
        return "block_size is not initialised"
    dev = target_token_ids.device
    if dev.type == "cuda":
        if not _has_cuda_kernels():
            return "peagle_ext was built without CUDA kernels"
    elif dev.type != "cpu":
        return f"device {dev.type} has no peagle_ext kernel"
    b = cad.batch_size()
    t_in = target_token_ids.shape[0]
    t_out = t_in + (k - 1) * b
    qsl = cad.query_start_loc
    bt = cad.block_table_tensor
    if (
        target_token_ids.dtype != torch.int32
        or next_token_ids.dtype != torch.int32
        or target_positions.dtype != torch.int64
        or qsl.dtype != torch.int32
        or bt.dtype != torch.int32
        or (num_rejected_tokens_gpu is not None and num_rejected_tokens_gpu.dtype != torch.int32)
    ):
        return "unexpected index dtypes"
    if (
        target_hidden_states.dtype not in HIDDEN_DTYPES
        or target_hidden_states.dtype != self.hidden_states.dtype
        or mask_hidden.dtype != target_hidden_states.dtype
    ):
        return f"hidden dtype {target_hidden_states.dtype} (buffer {self.hidden_states.dtype})"
    if (
        target_hidden_states.dim() != 2
        or target_hidden_states.shape[1] != self.hidden_states.shape[1]
        or mask_hidden.shape != (self.hidden_states.shape[1],)
    ):
        return "hidden size mismatch"
    if not all(
        t.is_contiguous()
        for t in (
            target_token_ids,
            target_positions,
            target_hidden_states,
            qsl,
            next_token_ids,
            mask_hidden,
            self.hidden_states,
        )
    ) or (num_rejected_tokens_gpu is not None and not num_rejected_tokens_gpu.is_contiguous()):
        return "non-contiguous inputs"
    if (
        qsl.shape[0] < b + 1
        or next_token_ids.shape[0] < b
        or bt.dim() != 2
        or bt.shape[0] < b
        or (num_rejected_tokens_gpu is not None and num_rejected_tokens_gpu.shape[0] < b)
    ):
        return "batch metadata shorter than the batch"
    if bt.stride(1) != 1 or bt.shape[1] * self.block_size < self.max_model_len:
        return "block table does not cover max_model_len"
    if t_out > min(
        self.input_ids.shape[0],
        self.positions.shape[0],
        self.hidden_states.shape[0],
        self.is_rejected_token_mask.shape[0],
    ):
        return "draft buffers smaller than the expanded batch"
    return None


def fused_first_pass(
    self,
    target_token_ids,
    next_token_ids,
    target_positions,
    target_hidden_states,
    cad,
    num_rejected_tokens_gpu,
    extend_all_queries_by_N,
):
    """The parallel-drafting branch of vLLM's set_inputs_first_pass with one op; returns what
    it returns: (num draft tokens, token_indices_to_sample, new CommonAttentionMetadata)."""
    from .._native import ops

    b = cad.batch_size()
    k = int(self.extra_slots_per_request)
    t_in = target_token_ids.shape[0]
    t_out = t_in + (k - 1) * b
    dev = target_token_ids.device
    token_indices_to_sample = torch.empty(b * k, dtype=torch.int32, device=dev)
    slot_mapping = torch.empty(t_out, dtype=torch.int64, device=dev)
    # The op itself (not the Python wrapper): unsupported_reason() has checked what the
    # wrapper would, the C++ op checks again, and this runs on every decoding step.
    ops.prepare_parallel_draft_inputs_out(
        target_token_ids,
        target_positions,
        next_token_ids[:b],
        cad.query_start_loc[: b + 1],
        None if num_rejected_tokens_gpu is None else num_rejected_tokens_gpu[:b],
        target_hidden_states,
        self.parallel_drafting_hidden_state_tensor,
        cad.block_table_tensor,
        k,
        int(self.parallel_drafting_token_id),
        int(self.block_size),
        int(self.max_model_len),
        input_ids=self.input_ids[:t_out],
        positions=self.positions[:t_out],
        hidden=self.hidden_states[:t_out],
        is_rejected=self.is_rejected_token_mask[:t_out],
        is_masked=self.is_masked_token_mask[:t_out],
        token_indices_to_sample=token_indices_to_sample,
        hidden_state_mapping=torch.empty(t_in, dtype=torch.int32, device=dev),
        slot_mapping=slot_mapping,
        new_query_start_loc=torch.empty(b + 1, dtype=torch.int32, device=dev),
    )
    new_cad = extend_all_queries_by_N(
        cad, N=self.net_num_new_slots_per_request, arange=self.arange, new_slot_mapping=slot_mapping
    )
    return t_out, token_indices_to_sample, new_cad
