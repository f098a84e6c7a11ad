"""Quantized models (load_target / load_draft with quantize=): lossless speculation at the same
format, Q-row verify == Q one-row steps bit for bit, sampling still exact, and what is held in
memory (every linear a QuantizedWeight, no bf16 copy beside it).

Mutation tried: quantize_rows made row-count dependent (ties away from zero when M > 1) stays
GREEN here (exact .5 ties are rare in real activations); tests/test_quant.py's activation test
catches it with constructed ties.
"""

from __future__ import annotations

import numba
import numpy as np
import pytest

from dflash2_numba import tiny
from dflash2_numba.api import load_draft, load_target
from dflash2_numba.decode.loop import generate
from dflash2_numba.decode.sampling import SamplingParams
from dflash2_numba.errors import GenerationArgumentError
from dflash2_numba.kernels.panels import PackedBF16
from dflash2_numba.quant.weights import QuantizedWeight

from test_sampling import _sample_sequences, exact_sequence_probs, gof_pvalue

LINEARS = ("q", "k", "v", "o", "gate", "up", "down")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    threads = numba.get_num_threads()
    numba.set_num_threads(1)
    root = tmp_path_factory.mktemp("quant_pair")
    tiny.write_target(root / "t", seed=0, init_std=0.2, dtype="bf16")
    tiny.write_draft(root / "d", root / "t", kind="dflash2", block_size=8, seed=1, dtype="bf16")
    yield root / "t", root / "d"
    numba.set_num_threads(threads)


@pytest.fixture(scope="module")
def pair256(tmp_path_factory):
    """The same kind of pair 256 wide: q4_k needs input features a multiple of 256."""
    threads = numba.get_num_threads()
    numba.set_num_threads(1)
    root = tmp_path_factory.mktemp("quant_pair256")
    tiny.write_target(root / "t", seed=0, init_std=0.1, dtype="bf16", hidden_size=256, intermediate_size=512,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=32)
    tiny.write_draft(root / "d", root / "t", kind="dflash2", block_size=8, seed=1, dtype="bf16",
                     intermediate_size=256)
    yield root / "t", root / "d"
    numba.set_num_threads(threads)


@pytest.fixture(params=["q8_0", "q4_0", "q4_k"])
def fmt_pair(request):
    """(format, pair directories): q4_k on the 256-wide pair, the others on the 64-wide one."""
    return request.param, request.getfixturevalue("pair256" if request.param == "q4_k" else "pair")


def test_weights_are_replaced_not_copied(fmt_pair):
    fmt, pair = fmt_pair
    target = load_target(pair[0], quantize=fmt)
    draft = load_draft(pair[1], target)
    for L in target.layers + draft.layers:
        assert all(isinstance(L[n], QuantizedWeight) and L[n].format == fmt for n in LINEARS)
        assert not any(isinstance(v, (PackedBF16, np.ndarray)) and getattr(v, "ndim", 0) == 2 for v in L.values())
    assert isinstance(target.lm_head_w, QuantizedWeight) and isinstance(draft.fc, QuantizedWeight)
    assert target._fused_layers is not None  # the fused engine runs on the integer panels
    kept = load_target(pair[0], quantize=fmt, keep_head=True)
    assert isinstance(kept.lm_head_w, PackedBF16) and isinstance(kept.layers[0]["q"], QuantizedWeight)
    plain = load_draft(pair[1], target, quantize="bf16")
    assert isinstance(plain.layers[0]["q"], PackedBF16)


def test_refusals(pair):
    with pytest.raises(GenerationArgumentError, match="q3_k"):
        load_target(pair[0], quantize="q3_k")


def test_greedy_speculative_equals_target_only(fmt_pair):
    fmt, pair = fmt_pair
    target = load_target(pair[0], quantize=fmt)
    draft = load_draft(pair[1], target)
    prompt = list(range(5, 30))
    ref = generate(target, None, prompt_ids=prompt, max_new_tokens=48).output_ids
    for Q in (2, 4, 8):
        assert generate(target, draft, prompt_ids=prompt, max_new_tokens=48, block_size=Q).output_ids == ref


def test_verify_rows_equal_single_steps(fmt_pair):
    """The logits of an 8-row verify block == those of 8 one-row steps, bit for bit, and a
    40-row prefill (the > 32-row path) == the same tokens fed 8 at a time."""
    fmt, pair = fmt_pair
    target = load_target(pair[0], quantize=fmt)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, target.valid_vocab, 48)
    whole_cache, step_cache = target.new_cache(64), target.new_cache(64)
    target.forward(ids[:40], whole_cache)
    block, _ = target.forward(ids[40:], whole_cache)
    chunks = [target.forward(ids[i:i + 8], step_cache)[0] for i in range(0, 40, 8)]
    singles = np.concatenate([target.forward(ids[i:i + 1], step_cache)[0] for i in range(40, 48)])
    assert np.array_equal(block, singles)
    prefill, _ = target.forward(ids[:40], target.new_cache(64))
    assert np.array_equal(prefill, np.concatenate(chunks))


def test_speculative_sampling_matches_exact_distribution(pair):
    """T = 0.8, top-k 3: 3-token sequences from the q8_0 target with its q8_0 DFlash2 draft
    (one 3-row step after the prefill token), 1500 samples against the enumerated distribution
    of the same quantized target: chi-square p > 1e-3."""
    target = load_target(pair[0], quantize="q8_0")
    draft = load_draft(pair[1], target)
    params = SamplingParams(temperature=0.8, top_k=3)
    exact = exact_sequence_probs(target, [3, 1], 3, params)
    spec = _sample_sequences(target, draft, 1500, params, 3, 3, 0)
    assert gof_pvalue(spec, exact, 1500) > 1e-3


@pytest.mark.parametrize("fmt", [None, "q8_0", "q4_k"])
def test_shipped_target_verify_rows_equal_single_steps(fmt):
    """The shipped default target on a held-out prompt: 4-row verify blocks == one-row steps bit
    for bit over 48 positions (before attention's causal rows stopped at their last visible key,
    every row differed: by ~1e-5 at bf16 and, through int8 activation rounding, by ~0.08 at
    q8_0, which flipped greedy tokens of 1 prompt in 32 in bench/acceptance.py)."""
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    target = load_target(root / "dflash2_numba" / "assets" / "default" / "target", quantize=fmt)
    text = json.loads((root / "bench" / "data" / "heldout_prompts.json").read_text())[5]
    ids = target.tokenizer.encode_prompt(text if isinstance(text, str) else text["text"], chat=False)
    seq = np.asarray(generate(target, None, prompt_ids=ids, max_new_tokens=48).output_ids[:48])
    single_cache, block_cache = target.new_cache(len(ids) + 64), target.new_cache(len(ids) + 64)
    target.forward(np.asarray(ids), single_cache)
    target.forward(np.asarray(ids), block_cache)
    single = np.concatenate([target.forward(seq[i:i + 1], single_cache)[0] for i in range(48)])
    blocks = np.concatenate([target.forward(seq[i:i + 4], block_cache)[0] for i in range(0, 48, 4)])
    assert np.array_equal(blocks, single)
