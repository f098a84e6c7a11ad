"""At the edge of the token budget the draft still runs the runtime Q rows (spec §5).

The DFlash / DFlash2 block is non-causal: every row attends to every other row, so a block of
fewer rows gives different hidden states, and the DFlash2 conv's block length changes with it.
vLLM and the z-lab reference always draft Q rows; only the verify (and the emitted tokens) is
limited by the budget. Here a run whose budget ends mid-block is compared with an unlimited run
at the same step: same draft block (rows and values), same proposals, and the verify gets the
anchor plus the first Bv-1 of those proposals.

Red on: proposing `Bv = min(Q, remaining)` rows (the old loop); verifying Q rows past the budget.
"""

from __future__ import annotations

import numpy as np
import pytest

import dflash2_numba as dn
from dflash2_numba import tiny

from test_dflash2_draft import write_v2
from test_draft import B

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPT = [5, 17, 42, 9, 3, 77, 12]  # 7 tokens


class Recorder:
    """Wraps draft.block_forward and target.forward of one run: records per call
    (anchor position, rows, final-normed states) and the verify blocks (ids)."""

    def __init__(self, target, draft):
        self.blocks, self.verifies = {}, {}
        self.target, self.draft = target, draft
        self._bf, self._tf = draft.block_forward, target.forward

    def block_forward(self, states, anchor_ids, anchor_positions, n_rows):
        h = self._bf(states, anchor_ids, anchor_positions, n_rows)  # [Q, H]
        self.blocks[int(anchor_positions[0])] = (int(n_rows), h.copy())
        return h

    def forward(self, ids, cache, **kw):
        if cache.length > 0:  # a verify block (the prefill starts at 0)
            self.verifies[cache.length] = np.asarray(ids).copy()
        return self._tf(ids, cache, **kw)

    def __enter__(self):
        self.draft.block_forward, self.target.forward = self.block_forward, self.forward
        return self

    def __exit__(self, *exc):
        del self.draft.block_forward, self.target.forward  # back to the class methods


def run(target, draft, max_new: int, Q: int):
    with Recorder(target, draft) as rec:
        out = dn.generate(target, draft, prompt_ids=PROMPT, max_new_tokens=max_new, block_size=Q)
    return out, rec


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
@pytest.mark.parametrize("Q", [B, 5])
def test_last_step_drafts_the_full_block(tmp_path, target_dir, target, kind, Q):
    if kind == "dflash2":
        path = write_v2(tmp_path / "d", target_dir)
    else:
        path = tiny.write_draft(tmp_path / "d", target_dir, kind="dflash", block_size=B, seed=3, init_std=0.2)
    draft = dn.load_draft(path, target)

    full, ref = run(target, draft, 40, Q)
    anchors = sorted(ref.verifies)  # anchor position of every step of the unlimited run
    assert len(anchors) >= 3
    n = len(PROMPT)
    for cut in (2, Q - 1):  # the budget leaves 2 rows / Q-1 rows for the third step
        anchor = anchors[2]
        max_new = anchor + 1 + cut - n  # Bv = max_len - 1 - anchor = cut rows at that step
        limited, rec = run(target, draft, max_new, Q)
        assert limited.output_ids == full.output_ids[:max_new]  # lossless, and exactly the budget

        rows, h = rec.blocks[anchor]
        ref_rows, ref_h = ref.blocks[anchor]
        assert rows == ref_rows == Q  # the draft ran the runtime Q rows, not the budget
        # so every row's state is that of the unlimited run (up to float rounding: the earlier
        # verify blocks of the limited run had fewer rows, and the GEMV groups rows differently)
        np.testing.assert_allclose(h, ref_h, rtol=1e-5, atol=1e-5)
        # the verify got the anchor plus the first `cut`-1 proposals of the unlimited run's block
        assert rec.verifies[anchor].shape == (cut,)
        np.testing.assert_array_equal(rec.verifies[anchor], ref.verifies[anchor][:cut])
