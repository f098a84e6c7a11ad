"""A target forward's taps: the residual stream after each listed layer in that layer's columns,
in list order, a layer listed twice in both of its column blocks (scaled published drafts repeat
tap layers, e.g. [0, 1, 2, 3, 0, 1, 2, 3]). The expected columns come from forwards that tap one
layer each, on fresh caches. Red on: a {layer: one slice} lookup (the second block of a repeated
layer left uninitialised), columns in another order."""

import numpy as np
import pytest

import dflash2_numba as dn
from dflash2_numba import tiny
from dflash2_numba.models import batched
from dflash2_numba.tiny_hybrid import write_qwen3_5_target

TAPS = (2, 0, 2, 1)


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5"])
def target(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    if request.param == "qwen3":
        path = tiny.write_target(d / "t", hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                 num_attention_heads=2, num_key_value_heads=1, head_dim=16, tokenizer_vocab_size=300,
                                 seed=3, init_std=0.5)
    else:
        path = write_qwen3_5_target(d / "t", hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                    full_attention_interval=3, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                    linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8,
                                    linear_value_head_dim=8, tokenizer_vocab_size=300, seed=3, init_std=0.5)
    return dn.load_target(path)


def one_layer_taps(target, ids, layer):
    return target.forward(ids, target.new_cache(32), tap_layers=(layer,))[1]  # [n, H]


def test_forward_taps_every_listed_layer_in_order_repeats_included(target):
    ids = np.arange(5, 12, dtype=np.int64)  # [n]
    _, taps = target.forward(ids, target.new_cache(32), tap_layers=TAPS)  # [n, 4 * H]
    want = np.concatenate([one_layer_taps(target, ids, l) for l in TAPS], axis=1)
    np.testing.assert_array_equal(taps, want)
    H = target.config.hidden_size
    assert not np.array_equal(taps[:, :H], taps[:, 3 * H:])  # layers 2 and 1 differ: the check can see order


def test_batched_verify_taps_repeats_included(target):
    if not hasattr(target, "_layer_ops"):
        pytest.skip("the batched forward serves the Qwen3 / Llama family")
    blocks = [np.arange(3, 7, dtype=np.int64), np.arange(20, 23, dtype=np.int64)]
    caches = [target.new_cache(32) for _ in blocks]
    got = batched.verify_batch(target, blocks, caches, TAPS)
    for b, (_, taps) in zip(blocks, got):
        want = np.concatenate([one_layer_taps(target, b, l) for l in TAPS], axis=1)
        np.testing.assert_array_equal(taps, want)  # a request's bits do not depend on its batch (test_batched.py)
