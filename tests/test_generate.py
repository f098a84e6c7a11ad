"""Target-only (autoregressive) generation through the public API on tiny written targets:
greedy == a manual argmax loop over TargetModel.forward, exact lengths, stop ids (user,
config.json, generation_config.json) inclusive, seeds, padded ids, text streaming, chat."""

from __future__ import annotations

import numpy as np
import pytest

import dflash2_numba as dn
from dflash2_numba import tiny

from decode_doubles import greedy_reference


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    root = tmp_path_factory.mktemp("gen")
    # init_std 0.2: varied greedy text (at the default 0.02 a random model repeats one token)
    return {arch: dn.load_target(tiny.write_target(root / arch, architecture=arch, seed=1, init_std=STD))
            for arch in ("qwen3", "llama")}


PROMPT = "The quick brown fox"
STD = 0.2


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_greedy_equals_manual_argmax_loop(targets, arch):
    target = targets[arch]
    r = dn.generate(target, None, PROMPT, max_new_tokens=30)
    ids = target.tokenizer.encode(PROMPT)
    assert r.prompt_ids == ids
    ref = greedy_reference(target, ids, 30, target.tokenizer.stop_ids())
    assert r.output_ids == ref
    assert r.finish_reason == ("length" if len(ref) == 30 else "stop")
    assert r.text == target.tokenizer.decode(ref)
    assert r.stats.steps == len(ref) - 1 and r.stats.new_tokens == len(ref)
    assert r.stats.acceptance_lengths == [1] * (len(ref) - 1)


def test_streamed_text_concatenates_to_decode(targets):
    target = targets["qwen3"]
    steps = list(dn.stream_generate(target, None, PROMPT, max_new_tokens=40))
    ids = [t for s in steps for t in s.token_ids]
    assert "".join(s.text for s in steps) == target.tokenizer.decode(ids)
    assert all(len(s.token_ids) == 1 and s.accepted == 0 for s in steps)


@pytest.mark.parametrize("n", [1, 2, 5, 17])
def test_max_new_tokens_exact(targets, n):
    target = targets["qwen3"]
    ids = target.tokenizer.encode(PROMPT)
    ref = greedy_reference(target, ids, n, stops=())
    r = dn.generate(target, None, prompt_ids=ids, max_new_tokens=n)
    assert r.output_ids == ref[:len(r.output_ids)]
    assert len(r.output_ids) == n or r.finish_reason == "stop"


def test_user_stop_token_inclusive(targets):
    target = targets["qwen3"]
    ids = target.tokenizer.encode(PROMPT)
    ref = greedy_reference(target, ids, 30, stops=())
    k = next(i for i in range(2, 30) if ref.index(ref[i]) == i)  # first occurrence at k
    r = dn.generate(target, None, prompt_ids=ids, max_new_tokens=30, stop_token_ids=[ref[k]])
    assert r.output_ids == ref[:k + 1] and r.finish_reason == "stop"


@pytest.mark.parametrize("where", ["config", "generation_config"])
def test_model_eos_ids_stop(tmp_path, targets, where):
    """An eos id from config.json or generation_config.json stops generation (spec §5.2)."""
    base = targets["qwen3"]
    ids = base.tokenizer.encode(PROMPT)
    ref = greedy_reference(base, ids, 30, stops=())
    k = next(i for i in range(2, 30) if ref.index(ref[i]) == i)
    path = tiny.write_target(tmp_path / "t", seed=1, init_std=STD)  # = targets["qwen3"]
    if where == "config":
        tiny.write_target(path, seed=1, init_std=STD, extra_config={"eos_token_id": ref[k]})
    else:
        import json
        gc = json.loads((path / "generation_config.json").read_text())
        gc["eos_token_id"] = [ref[k]]
        (path / "generation_config.json").write_text(json.dumps(gc))
    target = dn.load_target(path)
    r = dn.generate(target, None, prompt_ids=ids, max_new_tokens=30)
    assert r.output_ids == ref[:k + 1] and r.finish_reason == "stop"


def test_sampling_seeded_and_never_padded(targets):
    target = targets["qwen3"]
    assert target.valid_vocab < target.config.vocab_size  # the writer pads the vocabulary
    kw = dict(max_new_tokens=60, temperature=3.0)  # hot: mass spreads towards every id
    a = dn.generate(target, None, PROMPT, seed=5, **kw).output_ids
    b = dn.generate(target, None, PROMPT, seed=5, **kw).output_ids
    c = dn.generate(target, None, PROMPT, seed=6, **kw).output_ids
    assert a == b and a != c
    assert max(a + c) < target.valid_vocab
    # greedy ignores the seed
    g = [dn.generate(target, None, PROMPT, seed=s, max_new_tokens=10).output_ids for s in (1, 2)]
    assert g[0] == g[1]


def test_padded_ids_never_emitted_even_when_best(targets, tmp_path):
    """Give the last (padded) id an lm_head row along the mean final state, scaled up, so that
    it is the unmasked argmax: greedy and sampled generation still never emit it."""
    from dflash2_numba.checkpoint import open_checkpoint
    from dflash2_numba.numerics import f32_to_bf16_array

    path = tiny.write_target(tmp_path / "pad", seed=1, init_std=STD)
    target = dn.load_target(path)
    ntok, V = target.valid_vocab, target.config.vocab_size
    ids = np.array(target.tokenizer.encode(PROMPT))
    L = target.config.num_hidden_layers
    _, last = target.forward(ids, target.new_cache(len(ids)), tap_layers=(L - 1,))  # [n, H]
    h = target.final_norm(last)  # [n, H]: what lm_head reads
    ck = open_checkpoint(path)
    w = {n: np.array(ck.get(n)) for n in ck.names()}
    direction = h.mean(0) / np.linalg.norm(h.mean(0))  # [H]
    w["lm_head.weight"][V - 1] = f32_to_bf16_array(50.0 * direction)
    del ck, target
    tiny.save_safetensors(path / "model.safetensors", w)
    target = dn.load_target(path)
    logits, _ = target.forward(ids, target.new_cache(len(ids)))
    assert int(np.argmax(logits[-1])) == V - 1 and ntok < V  # unmasked, padding would win
    for kw in (dict(), dict(temperature=1.0, seed=0)):
        out = dn.generate(target, None, PROMPT, max_new_tokens=20, **kw).output_ids
        assert max(out) < ntok


def test_chat_prompt_uses_template(targets, tmp_path):
    target = targets["qwen3"]
    r = dn.generate(target, None, "Hi there", chat=True, max_new_tokens=2)
    expect = target.tokenizer.encode(target.tokenizer.apply_chat_template("Hi there"), add_special_tokens=False)
    assert r.prompt_ids == expect and r.prompt_ids != target.tokenizer.encode("Hi there")
    bare = dn.load_target(tiny.write_target(tmp_path / "nochat", seed=1, init_std=STD, chat_template=False))
    with pytest.raises(dn.ChatTemplateMissingError):
        dn.generate(bare, None, "Hi", chat=True, max_new_tokens=2)


def test_prompt_errors(targets):
    target = targets["qwen3"]
    for kw in (dict(prompt=""), dict(prompt=None), dict(prompt_ids=[]),
               dict(prompt_ids=[target.config.vocab_size])):
        with pytest.raises(dn.GenerationArgumentError):
            dn.generate(target, None, max_new_tokens=3, **kw)
