"""Tiny random verifiers and synthetic data, made offline in seconds: what the tests, the
benchmarks and the examples run on (no model hub, no download).

- `make_tiny_verifier(dir)`: a random llama / qwen3 causal LM directory with a byte-level BPE
  tokenizer and a ChatML chat template; `make_chat_jsonl(path)`: small chat data for it.
- `qwen3_8b_config()`, `make_peagle(...)`, `synthetic_example(...)`: a Qwen3-8B-shaped drafter
  with a random verifier head and packed rows of random verifier states (the benchmarks' setting).
- `random_documents`, `garbage_layout`, `random_draft_batch`: random and adversarial op inputs
  (packed documents, layouts that break every content rule, vLLM-shaped verifier batches).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from .data import TrainingExample
from .model import PEagleDraftModel
from .ops.cod import CodLayout

WORDS = (
    "the a of to and in is it you that he was for on are with as I his they be at one have this from "
    "or had by hot word but what some we can out other were all there when up use your how said an each "
    "she which do their time if will way about many then them write would like so these her long make "
    "thing see him two has look more day could go come did number sound no most people my over know "
    "water than call first who may down side been now find"
).split()

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def sentence(rng: random.Random, n: int) -> str:
    # a little structure (word bigram chains) so a drafter has something to learn
    w = rng.choice(WORDS)
    out = [w]
    for _ in range(n - 1):
        i = (WORDS.index(w) * 7 + rng.choice((1, 1, 1, 2, 3))) % len(WORDS)
        w = WORDS[i]
        out.append(w)
    return " ".join(out)


def make_tokenizer(directory: Path, *, vocab_size: int = 300, chat_template: bool = True):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    corpus = [sentence(rng, 12) for _ in range(400)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token=None
    )
    if chat_template:
        fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)
    return fast


def make_tiny_verifier(
    directory,
    *,
    hidden: int = 64,
    layers: int = 6,
    heads: int = 2,
    kv_heads: int = 1,
    vocab_size: int = 300,
    model_type: str = "llama",
    chat_template: bool = True,
    seed: int = 0,
) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(d, vocab_size=min(vocab_size, 300), chat_template=chat_template)
    cls = LlamaConfig if model_type == "llama" else Qwen3Config
    cfg = cls(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(d)
    return d


def make_chat_jsonl(path, *, n: int = 24, seed: int = 0, turns: int = 2, words=(6, 20)) -> Path:
    rng = random.Random(seed)
    p = Path(path)
    with open(p, "w") as f:
        for _ in range(n):
            msgs = []
            for _t in range(turns):
                msgs.append({"role": "user", "content": sentence(rng, rng.randint(*words))})
                msgs.append({"role": "assistant", "content": sentence(rng, rng.randint(*words))})
            f.write(json.dumps({"messages": msgs}) + "\n")
    return p


def qwen3_8b_config(vocab_size: int = 151_936):
    """Qwen3-8B's shape (the drafter mirrors it): hidden 4096, 32/8 heads, head dim 128,
    intermediate 12288, 36 layers (aux layers 2, 18, 33), rope theta 1e6."""
    from transformers import Qwen3Config

    return Qwen3Config(
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=vocab_size,
        rms_norm_eps=1e-6,
        max_position_embeddings=131072,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    )


def smollm2_config(**overrides):
    """SmolLM2-135M-Instruct's shape (the bundled verifier): Llama, hidden 576, 30 layers, 9/3
    heads of 64, intermediate 1536, vocab 49152, tied embeddings. overrides: any config field."""
    from transformers import LlamaConfig

    shape = dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        rms_norm_eps=1e-5,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    )
    return LlamaConfig(**{**shape, **overrides})


def smollm2_model(device, dtype, **overrides):
    """A LlamaForCausalLM of smollm2_config(**overrides) with random weights (seed 0), on device in
    dtype, in eval mode without gradients: the benchmarks' stand-in verifier, whose cost depends
    on the shape, not the weights."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(smollm2_config(**overrides)).to(device=device, dtype=dtype).eval().requires_grad_(False)


def make_peagle(
    verifier_config,
    *,
    num_layers: int,
    num_depths: int,
    mask_token_id: int,
    options=None,
    device="cpu",
    seed: int = 0,
    cls=None,
    draft_vocab_size: int | None = None,
):
    """A drafter with random weights and a random verifier head (norm weight near 1, head rows
    of the verifier's scale), built directly on `device` (no 2B-parameter CPU init on GPU runs).
    draft_vocab_size: a smaller draft vocab (ids 0..Vd-1 through d2t; None = the full vocab)."""
    cls = cls or PEagleDraftModel
    torch.manual_seed(seed)
    with torch.device(device):
        m = cls.from_verifier(
            verifier_config,
            num_layers=num_layers,
            num_depths=num_depths,
            mask_token_id=mask_token_id,
            options=options,
            verifier_name_or_path="synthetic/qwen3-shaped",
            draft_vocab_size=draft_vocab_size,
        )
    m = m.to(device)
    h = verifier_config.hidden_size
    v = verifier_config.vocab_size
    g = torch.Generator(device=device).manual_seed(seed + 1)
    norm_w = torch.rand(h, generator=g, device=device) + 0.5
    head_w = torch.randn(v, h, generator=g, device=device) * (1.0 / h**0.5) * 4.0
    m.attach_verifier(norm_weight=norm_w, lm_head_weight=head_w, init_from_verifier=True)
    return m


def synthetic_example(
    n: int,
    *,
    hidden: int,
    n_aux: int = 3,
    vocab: int,
    device="cpu",
    dtype=torch.bfloat16,
    doc_len=(512, 2048),
    prompt_frac=(0.1, 0.4),
    seed: int = 0,
    avoid_id: int | None = None,
):
    """A packed row of length n: documents of random length in doc_len, each a prompt part
    (loss 0) then an answer part (loss 1), with the EAGLE-shift padding (document id -1) at each
    document's last position and at the row's tail. Verifier states ~ N(0, 1) in `dtype`."""
    g = torch.Generator().manual_seed(seed)
    doc = torch.full((n,), -1, dtype=torch.int32)
    lm = torch.zeros(n, dtype=torch.bool)
    p, k = 0, 0
    lo, hi = doc_len
    while p < n:
        ln = int(torch.randint(lo, hi + 1, (1,), generator=g))
        ln = min(ln, n - p)
        if ln < 8:
            break
        doc[p : p + ln - 1] = k  # last position: no partner after the shift -> padding
        pf = float(torch.empty(1).uniform_(*prompt_frac, generator=g))
        lm[p + int(ln * pf) : p + ln - 1] = True
        p += ln
        k += 1
    ids = torch.randint(0, vocab, (n,), generator=g)
    if avoid_id is not None:
        ids[ids == avoid_id] = (avoid_id + 1) % vocab
    dev_g = torch.Generator(device=device).manual_seed(seed + 7)
    hid = torch.randn(n, n_aux * hidden, generator=dev_g, device=device, dtype=torch.float32).to(dtype)
    last = torch.randn(n, hidden, generator=dev_g, device=device, dtype=torch.float32).to(dtype)
    valid = (doc >= 0).to(device)
    hid = hid * valid[:, None]
    last = last * valid[:, None]
    return TrainingExample(
        input_ids=ids.to(device), document_ids=doc.to(device), loss_mask=lm.to(device), hidden=hid, last_hidden=last
    )


def random_documents(n: int, g: torch.Generator, *, max_doc_len: int = 200, pad_tail: int = 0, p_loss: float = 0.7):
    """Random packed sequence: documents of random length, trailing padding, random loss mask."""
    doc = torch.empty(n, dtype=torch.int32)
    pos, k = 0, 0
    while pos < n - pad_tail:
        ln = int(torch.randint(1, max_doc_len + 1, (1,), generator=g))
        ln = min(ln, n - pad_tail - pos)
        doc[pos : pos + ln] = k
        pos += ln
        k += 1
    doc[pos:] = -1
    lm = torch.rand(n, generator=g) < p_loss
    lm[doc < 0] = False
    return doc, lm


def garbage_layout(g, n, t, k, cross, device):
    """A hand-built layout whose contents break every rule (anchors outside [0, N), depths
    outside [0, K), unsorted), with valid shapes and depth_offsets (checked on every device)."""
    doc = torch.repeat_interleave(torch.arange(3, dtype=torch.int32), torch.tensor([n // 3, n // 3, n - 2 * (n // 3)]))
    if cross:
        offsets = [0] + sorted(torch.randint(0, t + 1, (k - 1,), generator=g).tolist()) + [t]
    else:  # symmetric mode needs N depth-0 rows: keep their count, scramble their contents anyway
        t = max(t, n + 1)
        offsets = [0, n] + sorted(torch.randint(n, t + 1, (k - 2,), generator=g).tolist()) + [t]
    anchor = torch.randint(-5, n + 6, (t,), generator=g, dtype=torch.int32)
    depth = torch.randint(-2, k + 3, (t,), generator=g, dtype=torch.int32)
    return CodLayout(anchor.to(device), depth.to(device), offsets, doc.to(device), not cross)


def garbage_metadata(g, t, n, k, device):
    """ranges int32 [5, T] and chains int32 [2, T, K] as cod_attention_fwd / _bwd take them, with
    entries no metadata build gives: range bounds far outside [0, N] (negative, past N, near the
    int32 limits), unsorted within depths, valid flags other than 0/1, chain entries outside
    [-1, T). For the raw ops' bound checks (CPU: ValueError) and clamps (CUDA: no out-of-bounds
    access)."""
    big = 2**31 - 1
    edges = [-big - 1, -big, -(2**20), -65, -1, 0, 1, n - 1, n, n + 1, n + 64, 2**20, big]
    pool = torch.tensor(edges, dtype=torch.int64)
    pick = torch.randint(0, pool.numel(), (5, t), generator=g)
    ranges = torch.where(
        torch.rand(5, t, generator=g) < 0.5, pool[pick], torch.randint(-3 * n - 10, 3 * n + 10, (5, t), generator=g)
    )
    ranges[4] = torch.randint(-2, 3, (t,), generator=g)
    cpool = torch.tensor([-big - 1, -7, -2, -1, 0, t - 1, t, t + 1, big], dtype=torch.int64)
    chains = torch.where(
        torch.rand(2, t, k, generator=g) < 0.5,
        cpool[torch.randint(0, cpool.numel(), (2, t, k), generator=g)],
        torch.randint(-3, t + 3, (2, t, k), generator=g),
    )
    return ranges.to(torch.int32).contiguous().to(device), chains.to(torch.int32).contiguous().to(device)


def uniform_int(g, lo, hi):
    """Uniform int in [lo, hi]."""
    return int(torch.randint(lo, hi + 1, (1,), generator=g))


def random_draft_batch(
    g,
    *,
    B,
    K,
    H,
    dtype=torch.float32,
    prefill_frac=0.3,
    max_prefill=40,
    general=False,
    near_max=False,
    with_rejected=True,
    block_size=None,
    max_model_len=None,
    extra_rows=0,
    extra_blocks=0,
    device="cpu",
):
    """A verifier batch as vLLM hands it to the proposer (padded drafter batch).

    Decode requests have K+1 tokens (K previous drafts + the verified token) and reject 0..K of
    them; prefill chunks have 1..max_prefill tokens and reject none. general=True draws any
    length with any allowed num_rejected in [0, len-1]. near_max puts request ends around
    max_model_len so positions hit max_model_len - 1 and beyond."""
    block_size = block_size or [1, 4, 16][uniform_int(g, 0, 2)]
    max_model_len = max_model_len or uniform_int(g, 48, 400)
    lens, nrej = [], []
    for _ in range(B):
        if general:
            n_tok = uniform_int(g, 1, K + 4)
            lens.append(n_tok)
            nrej.append(uniform_int(g, 0, n_tok - 1) if with_rejected else 0)
        elif float(torch.rand(1, generator=g)) < prefill_frac:
            lens.append(uniform_int(g, 1, max_prefill))
            nrej.append(0)
        else:
            lens.append(K + 1)
            nrej.append(uniform_int(g, 0, K) if with_rejected else 0)
    qsl = torch.zeros(B + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(lens, dtype=torch.int32).cumsum(0)
    t_in = int(qsl[-1])
    pos = []
    for n_tok in lens:
        if near_max:
            start = uniform_int(g, max(0, max_model_len - n_tok - K - 2), max_model_len + 2)
        else:
            start = uniform_int(g, 0, max(0, max_model_len - n_tok - K))
        pos.append(torch.arange(start, start + n_tok))
    positions = torch.cat(pos).long() if pos else torch.zeros(0, dtype=torch.long)
    blocks_per_req = -(-max_model_len // block_size) + extra_blocks
    args = dict(
        target_token_ids=torch.randint(1, 32000, (t_in,), generator=g, dtype=torch.int32),
        target_positions=positions,
        next_token_ids=torch.randint(1, 32000, (B,), generator=g, dtype=torch.int32),
        query_start_loc=qsl,
        num_rejected_tokens=torch.tensor(nrej, dtype=torch.int32),
        target_hidden=(torch.randn(t_in, H, generator=g) * 3 + 1).to(dtype),
        mask_hidden=(torch.randn(H, generator=g) - 2).to(dtype),
        block_table=torch.randint(0, 5000, (B + extra_rows, blocks_per_req), generator=g, dtype=torch.int32),
    )
    args = {k: v.to(device) for k, v in args.items()}
    kw = dict(
        num_spec_tokens=K,
        mask_token_id=uniform_int(g, 32000, 32100),
        block_size=block_size,
        max_model_len=max_model_len,
    )
    return args, kw


def make_fake_hub_cache(hf_home, repo_id: str, source_dir, *, repo_type: str = "model", commit: str | None = None):
    """Put the files of `source_dir` into a Hugging Face cache under `hf_home` the way the hub
    client lays out a download (hub/<type>s--org--name/snapshots/<commit>/..., refs/main), so that
    offline resolution of `repo_id` finds them. Returns the snapshot directory."""
    import hashlib
    import shutil

    commit = commit or hashlib.sha1(repo_id.encode()).hexdigest()
    repo = Path(hf_home) / "hub" / f"{repo_type}s--{repo_id.replace('/', '--')}"
    snap = repo / "snapshots" / commit
    src = Path(source_dir)
    for f in src.rglob("*"):
        if f.is_file():
            dst = snap / f.relative_to(src)
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, dst)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snap
