"""Batched forwards (models/batched.py): a request's bits do not depend on what is stacked with it.

- verify_batch over > 32 stacked rows (so the row-invariant chunking matters) == each request's
  own target.forward, array_equal (logits and taps);
- step_batch over mixed requests (greedy / seeded sampling, different Q and budgets, a prompt
  longer than one prefill chunk) == each request's solo `generate`, token for token, with the
  embedded DFlash2 and DFlash drafts and with no draft.
"""

import numpy as np
import pytest

import dflash2_numba as dn
from dflash2_numba.decode.sampling import SamplingParams
from dflash2_numba.decode.step import PREFILL_CHUNK, Decoding
from dflash2_numba.default import ASSET_DIR
from dflash2_numba.kernels.linear import GEMV_MAX_ROWS
from dflash2_numba.models import batched
from dflash2_numba.models.layers import ROW_INVARIANT_ROWS

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def pair():
    if not (ASSET_DIR / "target" / "config.json").is_file():
        pytest.skip("the embedded default pair is not shipped in this checkout")
    target = dn.load_target(ASSET_DIR / "target")
    return target, {k: dn.load_draft(ASSET_DIR / k, target) for k in ("dflash2", "dflash")}


def test_row_invariant_chunk_is_the_gemv_range():
    assert ROW_INVARIANT_ROWS == GEMV_MAX_ROWS


def test_verify_batch_bits_equal_solo_forward(pair):
    target, drafts = pair
    taps = tuple(drafts["dflash2"].target_layer_ids)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 4000, n) for n in (5, 40, 9, 17, 3)]
    blocks = [rng.integers(1, 4000, 8) for _ in prompts]  # 5 x 8 = 40 stacked rows > 32
    solo, many = [], []
    for p in prompts:
        for out in (solo, many):
            c = target.new_cache(64)
            target.forward(p, c, tap_layers=taps, last_only=True)
            out.append(c)
    want = [target.forward(b, c, tap_layers=taps) for b, c in zip(blocks, solo)]
    got = batched.verify_batch(target, blocks, many, taps)
    assert sum(len(b) for b in blocks) > GEMV_MAX_ROWS
    for (wl, wt), (gl, gt), cs, cm in zip(want, got, solo, many):
        np.testing.assert_array_equal(gl, wl)
        np.testing.assert_array_equal(gt, wt)
        assert cm.length == cs.length
        np.testing.assert_array_equal(cm.k[:, :, :cm.length], cs.k[:, :, :cs.length])


def run_batched(target, draft, decs, rule=None) -> list[list[int]]:
    """Every decode/step.Decoding to the end as the engine runs them: each prefill in whole
    chunks (as solo), then steps of all unfinished requests together (`rule`: the batch's
    verify-row budget, decode/batch_width.py). -> tokens per request."""
    out = [[] for _ in decs]
    for i, d in enumerate(decs):
        step = None
        while step is None:
            step = d.prefill_step()
        out[i] += step.token_ids
    while not all(d.finished for d in decs):
        live = [i for i, d in enumerate(decs) if not d.finished]
        for i, step in zip(live, batched.step_batch(target, draft, [decs[i] for i in live], rule)):
            out[i] += step.token_ids
    return out


REQUESTS = [  # (prompt, max_new, Q, temperature, top_k, seed)
    ("The cat sat on", 40, 4, 0.0, 0, None),
    ("Once upon a time there was", 33, 8, 0.8, 0, 3),
    ("In the beginning", 25, 8, 0.0, 0, None),
    ("def main():", 50, 3, 1.0, 20, 5),
    ("x = 1\n" * 150, 12, 6, 0.0, 0, None),  # > PREFILL_CHUNK tokens: a chunked prefill
    ("import numpy", 1, 4, 0.0, 0, None),  # done at the prefill token
]


@pytest.mark.parametrize("kind", ["dflash2", "dflash", None])
def test_step_batch_equals_solo_generate(pair, kind):
    target, drafts = pair
    draft = drafts.get(kind)
    tok = target.tokenizer
    assert len(tok.encode(REQUESTS[4][0])) > PREFILL_CHUNK
    solo, decs = [], []
    for prompt, n, Q, temp, k, seed in REQUESTS:
        kw = dict(max_new_tokens=n, temperature=temp, top_k=k, seed=seed, block_size=Q if draft else None)
        solo.append(dn.generate(target, draft, prompt, **kw).output_ids)
        decs.append(Decoding(target, draft, tok.encode(prompt), n, Q if draft else 1,
                             SamplingParams(temp, k, 1.0, seed), ()))
    assert run_batched(target, draft, decs) == solo
    if draft is not None:
        assert sum(d.stats.tau for d in decs[:4]) / 4 > 1.0  # the drafts were really accepted


def test_families_that_do_not_batch_run_per_request(pair):
    target, drafts = pair
    assert batched.batches_target(target) and batched.batches_draft(drafts["dflash2"])
    from dflash2_numba.decode.drafter import OracleDrafter
    assert not batched.batches_draft(OracleDrafter(target))


def test_stacked_context_updates_bits_equal_one_at_a_time(pair):
    _, drafts = pair
    draft = drafts["dflash2"]
    c = draft.config
    rng = np.random.default_rng(1)
    sizes = [8, 7, 8, 6, 8, 40]  # 37 stackable rows (> 32) and a prompt-sized update (alone, BLAS)
    taps = [rng.standard_normal((n, c.n_taps * c.hidden_size)).astype(np.float32) for n in sizes]
    prefix = [rng.standard_normal((p, c.n_taps * c.hidden_size)).astype(np.float32) for p in (3, 9, 1, 5, 2, 4)]
    one, many = [], []
    for pre in prefix:
        for states in (one, many):
            st = draft.new_state(128)
            draft.extend_context(st, pre, 0, np.zeros(len(pre), np.int64))
            states.append(st)
    for st, t in zip(one, taps):
        draft.extend_context(st, t, st.length, np.zeros(len(t), np.int64))
    draft.extend_contexts(many, taps, [st.length for st in many], [np.zeros(len(t), np.int64) for t in taps])
    for a, b in zip(one, many):
        assert a.length == b.length
        np.testing.assert_array_equal(a.k[:, :, :a.length], b.k[:, :, :b.length])
        np.testing.assert_array_equal(a.v[:, :, :a.length], b.v[:, :, :b.length])


def test_a_hybrid_target_runs_per_request_in_the_same_step(tmp_path):
    """Qwen3.5 (Gated DeltaNet + attention) does not stack its verify rows: step_batch runs its
    forward request by request, and the outputs are still each request's solo run."""
    from dflash2_numba import tiny
    from dflash2_numba.tiny_hybrid import write_qwen3_5_target

    tdir = write_qwen3_5_target(tmp_path / "t", layout="text", seed=2)
    target = dn.load_target(tdir)
    draft = dn.load_draft(tiny.write_draft(tmp_path / "d", tdir, kind="dflash2", block_size=4, seed=3), target)
    assert not batched.batches_target(target)
    reqs = [([5, 9, 2, 7], 12, 4, 0.0, None), ([3, 3, 8], 9, 3, 0.9, 4), ([11, 1], 7, 2, 0.0, None)]
    want = [dn.generate(target, draft, prompt_ids=p, max_new_tokens=n, block_size=Q, temperature=t, seed=s).output_ids
            for p, n, Q, t, s in reqs]
    decs = [Decoding(target, draft, p, n, Q, SamplingParams(t, 0, 1.0, s), ()) for p, n, Q, t, s in reqs]
    assert run_batched(target, draft, decs) == want


def test_step_batch_equals_solo_generate_on_q8_0_weights():
    """Quantized panels (quant/) are row-invariant too: batched == solo at q8_0."""
    if not (ASSET_DIR / "target" / "config.json").is_file():
        pytest.skip("the embedded default pair is not shipped in this checkout")
    target = dn.load_target(ASSET_DIR / "target", quantize="q8_0")
    draft = dn.load_draft(ASSET_DIR / "dflash2", target)
    assert batched.batches_target(target) and batched.batches_draft(draft)
    tok = target.tokenizer
    reqs = REQUESTS[:4]
    want = [dn.generate(target, draft, p, max_new_tokens=n, temperature=t, top_k=k, seed=s, block_size=Q).output_ids
            for p, n, Q, t, k, s in reqs]
    decs = [Decoding(target, draft, tok.encode(p), n, Q, SamplingParams(t, k, 1.0, s), ()) for p, n, Q, t, k, s in reqs]
    assert run_batched(target, draft, decs) == want
