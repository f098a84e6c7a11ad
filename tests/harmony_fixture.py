"""A tiny gpt-oss-shaped chat model: the harmony vocabulary at its real ids, a harmony chat
template, and a Qwen3 target whose greedy reply is a fixed harmony message sequence.

    d = write_harmony_target(tmp / "t")       # config, generation_config, tokenizer, weights
    REPLY_TOKENS                              # the reply, as token strings; reply_ids(tok) as ids

Tokenizer: byte-level BPE (the 256 byte symbols, a few merges that make the words of the
reply single tokens), filler entries up to id 199997, then the harmony special tokens at
the ids o200k_harmony gives them (199998 <|startoftext|> ... 200018 <|endofprompt|>), so
the token ids of every stop and marker are gpt-oss's own. tokenizer_config / config /
generation_config carry gpt-oss's eos fields: eos_token "<|return|>", config eos 200002,
generation_config eos [200002, 199999, 200012]. The chat template is this project's harmony
template (tests/data/gpt_oss/chat_template.jinja, its README; checked by sha256).

Target: a 2-layer Qwen3 (vocab 201088 as gpt-oss, hidden 64) built by hand so that its
greedy continuation of any prompt that ends in the template's `<|start|>assistant` is

    <|channel|>analysis<|message|>User asks why. Answer briefly<|end|>
    <|start|>assistant<|channel|>final<|message|>Because, friend!<|return|>

How: each token of the reply has its own embedding direction (plus a shared "one" direction),
the MLPs and layer 1 are zero, and lm_head row x has weight 2 on the direction of the token
that precedes x. `<|channel|>` and `<|message|>` occur twice with different successors, so
one attention head adds a "seen" feature: every query matches only the key of the last
analysis token (" briefly"; score 32 on the lowest RoPE frequency, which barely turns), whose
value writes ~1 into the feature direction; before that token the head averages zero values.
The successor after the analysis message gets +2 from the feature and -2 from "one", the one
before it -2 from the feature, so the right successor wins by ~2 in both phases.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

from dflash2_numba import tiny
from dflash2_numba.numerics import f32_to_bf16_array

TEMPLATE_PATH = Path(__file__).parent / "data" / "gpt_oss" / "chat_template.jinja"
TEMPLATE_SHA256 = "8cde469330598efb2b310ed05e7d87f389714e42adf4e161275549272b72badc"

# o200k_harmony's special tokens from id 199998 on (gpt-oss-20b tokenizer_config.json)
SPECIALS = ["<|startoftext|>", "<|endoftext|>", "<|reserved_200000|>", "<|reserved_200001|>", "<|return|>",
            "<|constrain|>", "<|reserved_200004|>", "<|channel|>", "<|start|>", "<|end|>", "<|message|>",
            "<|reserved_200009|>", "<|reserved_200010|>", "<|reserved_200011|>", "<|call|>",
            "<|reserved_200013|>", "<|reserved_200014|>", "<|reserved_200015|>", "<|reserved_200016|>",
            "<|reserved_200017|>", "<|endofprompt|>"]
FIRST_SPECIAL = 199998
RETURN, ENDOFTEXT, CALL, END = 200002, 199999, 200012, 200007
VOCAB = 201088  # gpt-oss config.json vocab_size (the tokenizer has 200019 entries)

# words of the reply and the prompt's last token, made single tokens by merges ("Ġ" = a space)
WORDS = ["assistant", "analysis", "final", "User", "Ġasks", "Ġwhy", "ĠAnswer", "Ġbriefly", "Because", "Ġfriend"]
ANALYSIS, FINAL = "User asks why. Answer briefly", "Because, friend!"
REPLY_TOKENS = (["<|channel|>", "analysis", "<|message|>", "User", "Ġasks", "Ġwhy", ".", "ĠAnswer", "Ġbriefly",
                 "<|end|>", "<|start|>", "assistant", "<|channel|>", "final", "<|message|>",
                 "Because", ",", "Ġfriend", "!", "<|return|>"])
TRIGGER = "Ġbriefly"  # the last analysis token: from it on, the "seen" feature is on
H, NH, NKV, HD, LAYERS = 64, 4, 2, 16, 2
ONE, SEEN = 0, 1  # residual directions


def build_tokenizer() -> HFTokenizer:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    merges = []
    for w in WORDS:  # left-to-right chains: w[:2], w[:3], ... (shared prefixes share merges)
        for k in range(2, len(w) + 1):
            if w[:k] not in vocab:
                vocab[w[:k]] = len(vocab)
                merges.append((w[:k - 1], w[k - 1]))
    for i in range(len(vocab), FIRST_SPECIAL):  # ids no text encodes to (o200k's ordinary tokens)
        vocab[f"<|filler_{i}|>"] = i
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=merges))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens(SPECIALS)
    got = [hf.token_to_id(s) for s in SPECIALS]
    assert got == list(range(FIRST_SPECIAL, FIRST_SPECIAL + len(SPECIALS))), got
    return hf


def reply_ids(hf) -> list[int]:
    return [hf.token_to_id(t) for t in REPLY_TOKENS]


def template_text() -> str:
    data = TEMPLATE_PATH.read_bytes()
    assert hashlib.sha256(data).hexdigest() == TEMPLATE_SHA256, f"{TEMPLATE_PATH} was edited"
    return data.decode("utf-8")


def _successors(hf) -> dict[tuple[int, bool], int]:
    """(token, seen) -> next token along the prompt's last token + the reply."""
    chain = [hf.token_to_id("assistant")] + reply_ids(hf)
    trigger, seen, out = hf.token_to_id(TRIGGER), False, {}
    for cur, nxt in zip(chain, chain[1:]):
        seen = seen or cur == trigger
        assert out.setdefault((cur, seen), nxt) == nxt, f"token {cur} has two successors in one phase"
    return out


def weights(hf) -> dict[str, np.ndarray]:
    """The designed target (f32; see the module docstring)."""
    succ = _successors(hf)
    tokens = sorted({t for t, _ in succ} | set(succ.values()))
    dim = {t: 2 + i for i, t in enumerate(tokens)}
    assert len(dim) + 2 <= H
    w = {"model.embed_tokens.weight": np.zeros((VOCAB, H), np.float32), "model.norm.weight": np.ones(H, np.float32),
         "lm_head.weight": np.zeros((VOCAB, H), np.float32)}
    emb, head = w["model.embed_tokens.weight"], w["lm_head.weight"]
    emb[:, ONE] = 1.0
    for t, d in dim.items():
        emb[t, d] = 1.0
    for (cur, seen), nxt in succ.items():
        other = succ.get((cur, not seen), nxt)
        head[nxt, dim[cur]] = 2.0
        if other != nxt:  # this token's successor depends on the phase
            head[nxt, SEEN] = 2.0 if seen else -2.0
            if seen:
                head[nxt, ONE] = -2.0
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        for name, shape in (("self_attn.q_proj", (NH * HD, H)), ("self_attn.k_proj", (NKV * HD, H)),
                            ("self_attn.v_proj", (NKV * HD, H)), ("self_attn.o_proj", (H, NH * HD)),
                            ("mlp.gate_proj", (128, H)), ("mlp.up_proj", (128, H)), ("mlp.down_proj", (H, 128))):
            w[p + name + ".weight"] = np.zeros(shape, np.float32)
        for name, n in (("input_layernorm", H), ("post_attention_layernorm", H), ("self_attn.q_norm", HD),
                        ("self_attn.k_norm", HD)):
            w[p + name + ".weight"] = np.ones(n, np.float32)
    p, trig = "model.layers.0.", dim[hf.token_to_id(TRIGGER)]
    w[p + "self_attn.q_proj.weight"][HD - 1, ONE] = 1.0    # head 0 queries with "one" on its last dim
    w[p + "self_attn.k_proj.weight"][HD - 1, trig] = 1.0   # kv head 0: only the trigger has a key
    w[p + "self_attn.k_norm.weight"][HD - 1] = 8.0         # q.k / sqrt(HD) = 4 * 32 / 4 = 32
    w[p + "self_attn.v_proj.weight"][0, trig] = 0.25       # normed trigger entry sqrt(32) -> v 1.41
    w[p + "self_attn.o_proj.weight"][SEEN, 0] = 0.75       # -> the "seen" feature ~1.06
    return w


def write_harmony_target(path) -> Path:
    """The model directory (written once per call; ~55 MB of bf16 weights)."""
    d = Path(path)
    tiny.write_target(d, hidden_size=H, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=NH,
                      num_key_value_heads=NKV, head_dim=HD, vocab_size=VOCAB, rope_theta=1e9,
                      max_position_embeddings=4096, tokenizer_vocab_size=300,
                      extra_config={"bos_token_id": FIRST_SPECIAL, "eos_token_id": RETURN,
                                    "pad_token_id": ENDOFTEXT})
    hf = build_tokenizer()
    tiny.save_safetensors(d / "model.safetensors",
                          {k: f32_to_bf16_array(v) for k, v in weights(hf).items()})
    (d / "tokenizer.json").write_text(hf.to_str(), encoding="utf-8")
    (d / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|startoftext|>", "eos_token": "<|return|>", "pad_token": "<|endoftext|>",
        "clean_up_tokenization_spaces": False, "model_max_length": 4096,
        "tokenizer_class": "PreTrainedTokenizerFast"}), encoding="utf-8")
    (d / "generation_config.json").write_text(json.dumps({
        "bos_token_id": FIRST_SPECIAL, "do_sample": True, "eos_token_id": [RETURN, ENDOFTEXT, CALL],
        "pad_token_id": ENDOFTEXT}), encoding="utf-8")
    shutil.copyfile(TEMPLATE_PATH, d / "chat_template.jinja")
    template_text()  # the copy's source is unedited
    return d
