"""Verifier families on tiny random configs (built by transformers on the CPU): the decoder parts
are found, the head read from safetensors by name equals the loaded model's, and the drafter's
target, lm_head(norm(last)) with the effective norm weight, reproduces the verifier's logits
(Gemma-style 1 + w norms included). README "Verifier families" summarises what this shows."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from peagle_ext import data as D
from peagle_ext.model import PEagleDraftModel
from peagle_ext.testing import make_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

COMMON = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    max_position_embeddings=512,
)
FAMILIES = {
    "llama": {},
    "qwen2": {},
    "qwen3": {},
    "mistral": {},
    "gemma": {},
    "gemma2": {},  # final-logit softcapping: the drafter's target is the logits before it
    "gemma3_text": {},
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=16),
    "phi3": dict(pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "olmo2": dict(pad_token_id=0, bos_token_id=1, eos_token_id=2),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_verifier_family(family, tmp_path):
    cfg = AutoConfig.for_model(family, **{**COMMON, **FAMILIES[family]})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    model.save_pretrained(tmp_path)
    make_tokenizer(tmp_path)  # a verifier directory has one; the head loader ignores it
    ids = torch.randint(3, 300, (1, 24))
    row = D.PackedSequence(ids[0], torch.zeros(24, dtype=torch.int32), torch.ones(24, dtype=torch.bool))
    aux, last = D.verifier_hidden_states(model, row, D.default_aux_layer_ids(4))
    assert aux.shape == (24, 3 * 64) and last.shape == (24, 64)
    # documents batched with right padding and no attention mask: each one's states are those of
    # the document alone, past a sliding window (gpt_oss's 16) and beside shorter documents
    lens = (24, 9, 4)
    docs = torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lens)])
    many = D.PackedSequence(torch.randint(3, 300, (sum(lens),)), docs, torch.ones(sum(lens), dtype=torch.bool))
    aux_m, last_m = D.verifier_hidden_states(model, many, D.default_aux_layer_ids(4), token_budget=4 * 24)
    start = 0
    for i, n in enumerate(lens):
        alone = D.PackedSequence(
            many.input_ids[start : start + n], torch.zeros(n, dtype=torch.int32), torch.ones(n, dtype=torch.bool)
        )
        aux_1, last_1 = D.verifier_hidden_states(model, alone, D.default_aux_layer_ids(4))
        torch.testing.assert_close(aux_m[start : start + n], aux_1, rtol=1e-4, atol=1e-4, msg=f"document {i}")
        torch.testing.assert_close(last_m[start : start + n], last_1, rtol=1e-4, atol=1e-4, msg=f"document {i}")
        start += n
    head = D.verifier_head_from_model(model)
    from_disk = D.load_verifier_head(str(tmp_path))
    for f in ("norm_weight", "lm_head_weight", "embed_weight"):
        assert torch.equal(getattr(head, f), getattr(from_disk, f)), f
    assert head.norm_eps == from_disk.norm_eps
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0]
    x = last.float()
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + head.norm_eps) * head.norm_weight
    target = normed @ head.lm_head_weight.T
    cap = getattr(cfg, "final_logit_softcapping", None)
    if cap:
        target = torch.tanh(target / cap) * cap  # what the verifier applies after its head
    torch.testing.assert_close(target, logits, rtol=1e-4, atol=1e-4)
    drafter = PEagleDraftModel.from_verifier(cfg, num_layers=1, num_depths=2, mask_token_id=300)
    drafter.attach_verifier(
        norm_weight=head.norm_weight,
        lm_head_weight=head.lm_head_weight,
        norm_eps=head.norm_eps,
        embed_weight=head.embed_weight,
    )
