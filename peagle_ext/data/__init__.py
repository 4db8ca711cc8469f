"""Verifier and training data for P-EAGLE (docs/design.md section 7).

    model, tok = load_verifier("smollm2")                       # or a hub id / local HF directory
    convs = load_conversations("sharegpt", limit=2000)          # or "my.jsonl"
    tokenized, stats = tokenize_conversations(tok, convs, max_len=seq_len)
    rows = pack_conversations(tokenized, seq_len, pad_token_id=pad_id)
    ids = default_aux_layer_ids(model.config.num_hidden_layers)
    for row in rows:
        aux, last = verifier_hidden_states(model, row, ids)     # per-document forwards
        ex = eagle_shift(row, aux, last)                        # -> TrainingExample
    # or precompute once: HiddenStateCache(dir, meta=...).generate(model, rows, ids)

Modules: `records` (PackedSequence, TrainingExample), `conversations` (sources), `chat`
(chat-template tokenization with loss masks), `packing`, `verifier` (locate / convert / load),
`hidden_states`, `shift` (the EAGLE shift), `cache` (the on-disk hidden-state cache), `dedup`
(duplicate conversations, a held-out split that shares no prompt with training), `datagen` (the
verifier's own answers), `loops` (answers that end in a repetition loop).

Conventions (those of vLLM / speculators, so a drafter trained here serves in vLLM):
- aux layer id k = residual stream entering decoder layer k (HF hidden_states[k]); the default
  ids are [2, L // 2, L - 3]. `last` = output of the last decoder layer BEFORE the final norm.
- loss mask: assistant content + its end-of-turn tokens, never the role header.
- EAGLE shift: see shift.eagle_shift.
"""

from .cache import HiddenStateCache, dequantize_fp8, packed_fingerprint, quantize_fp8
from .chat import (
    TokenizeStats,
    assistant_char_spans,
    tokenize_conversation,
    tokenize_conversations,
    tokenize_many,
    tokenize_workers,
)
from .conversations import (
    Conversation,
    iter_sharegpt_records,
    load_conversations,
    load_eval_prompts,
    normalize_messages,
    sharegpt_path,
)
from .dedup import conversation_key, disjoint_held_out, drop_duplicates, prompt_key
from .gguf import convert_gguf_to_hf
from .hidden_states import rows_per_pass, verifier_hidden_states, verifier_hidden_states_many
from .packing import pack_conversations
from .records import DataError, PackedSequence, TrainingExample, examples_to_host
from .shift import eagle_shift
from .sources import iter_records
from .verifier import (
    SMOLLM2_HUB_ID,
    cache_root,
    check_aux_layer_ids,
    decoder_parts,
    default_aux_layer_ids,
    hub_cache_dir,
    load_config,
    load_tokenizer,
    load_verifier,
    resolve_verifier_path,
    smollm2_gguf_path,
    verifier_name,
)
from .verifier_head import VerifierHead, load_verifier_head, verifier_head_from_model

__all__ = [
    "DataError",
    "PackedSequence",
    "TrainingExample",
    "examples_to_host",
    "rows_per_pass",
    "HiddenStateCache",
    "dequantize_fp8",
    "quantize_fp8",
    "packed_fingerprint",
    "TokenizeStats",
    "assistant_char_spans",
    "tokenize_conversation",
    "tokenize_conversations",
    "tokenize_many",
    "tokenize_workers",
    "Conversation",
    "conversation_key",
    "disjoint_held_out",
    "drop_duplicates",
    "prompt_key",
    "iter_sharegpt_records",
    "load_conversations",
    "load_eval_prompts",
    "normalize_messages",
    "sharegpt_path",
    "verifier_hidden_states",
    "verifier_hidden_states_many",
    "pack_conversations",
    "eagle_shift",
    "iter_records",
    "cache_root",
    "check_aux_layer_ids",
    "convert_gguf_to_hf",
    "decoder_parts",
    "default_aux_layer_ids",
    "load_verifier",
    "resolve_verifier_path",
    "smollm2_gguf_path",
    "SMOLLM2_HUB_ID",
    "hub_cache_dir",
    "verifier_name",
    "load_config",
    "load_tokenizer",
    "VerifierHead",
    "load_verifier_head",
    "verifier_head_from_model",
]
