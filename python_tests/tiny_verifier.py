"""A tiny random causal-LM verifier directory (llama, hidden 64, vocab ~300) with a byte-level
BPE tokenizer and a ChatML chat template, plus tiny chat JSONL files: everything the trainer
needs, made offline in a second or two."""
from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = ("the a of to and in is it you that he was for on are with as I his they be at one have this from "
         "or had by hot word but what some we can out other were all there when up use your how said an each "
         "she which do their time if will way about many then them write would like so these her long make "
         "thing see him two has look more day could go come did number sound no most people my over know "
         "water than call first who may down side been now find").split()

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


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
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=None, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", unk_token=None)
    if chat_template:
        fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)
    return fast


def make_tiny_verifier(directory, *, hidden: int = 64, layers: int = 6, heads: int = 2, kv_heads: int = 1,
                       vocab_size: int = 300, model_type: str = "llama", chat_template: bool = True,
                       seed: int = 0) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(d, vocab_size=min(vocab_size, 300), chat_template=chat_template)
    cls = LlamaConfig if model_type == "llama" else Qwen3Config
    cfg = cls(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
              num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
              max_position_embeddings=1024, tie_word_embeddings=False,
              pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
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


def run_cli(args, timeout=120):
    """`python -m peagle_ext.cli ARGS` in a subprocess from the repo root (one OpenMP thread)."""
    import os
    import subprocess
    import sys
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "peagle_ext.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=str(root))
