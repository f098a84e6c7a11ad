"""DFlash2 draft (spec §4): DFlash v1 + a grouped dynamic conv around every sublayer + the
candidate selector in place of the per-slot argmax.

Each layer (the call sites live in DFlashDraft.block_forward, the ONE block forward every draft
code path runs; here they are filled in):

    a          = rms_in(h)
    a', k_att  = attention_conv.prepare(a)      # conv(a, delta[:,0], base[0]); keeps delta[:,1]
    h          = h + attention_conv.finish(attention(a'), k_att)     # conv(o, delta[:,1], base[1])
    m          = rms_post(h)
    m', k_mlp  = mlp_conv.prepare(m)
    h          = h + mlp_conv.finish(mlp(m'), k_mlp)

prepare(x): delta = kernel_projection(x) reshaped [N, 2, taps, G] — both sides' coefficients
come from this ONE projection of the sublayer input; side 0 prepares, side 1 finishes
(base_kernel [2, taps, H]: dim 0 is the side). The conv block length is the RUNTIME Q of the
step, never the checkpoint's block_size. Block embeddings are scaled by input_embedding_scale.

Selector: after the block forward and final norm, `CandidateSelector.select` picks the drafts.
A selector that cannot run faithfully (tensors absent, selector_top_k > vocab, codebook rows !=
target vocab, quantized tensors) does not stop the load: a NOTICE goes to stderr naming the
boundary, the block forward still runs (conv included), and `propose` raises
SelectorRefusedError there, before anything is sampled. Never a silent argmax fallback.
Since that refusal is certain at load time, `refusal_reason` exposes it and the decode loop
refuses a run before its prefill token is emitted (the notice still goes out at load).
"""

from __future__ import annotations

import sys

import numpy as np

from ..inventory import expected_draft_tensors
from ..kernels import fused
from ..decode.drafter import Proposal, valid_vocab
from ..decode.sampling import SamplingParams
from ..numerics import as_f32, bf16_to_f32_array, f32_to_bf16_array
from .draft import DFlashDraft
from .layers import rnd_if
from .selector import CandidateSelector, RefusedSelector

CONVS = ("attention_conv", "mlp_conv")


class DFlash2Draft(DFlashDraft):
    """Attributes beyond DFlashDraft: selector (CandidateSelector | RefusedSelector),
    selector_notice (str | None: the startup notice when the selector refuses)."""

    kind = "dflash2"

    def __init__(self, config, checkpoint, target, ops=None):
        super().__init__(config, checkpoint, target, ops)
        c = config
        self.taps, self.group_size, self.groups = c.conv_kernel_size, c.conv_group_size, c.conv_groups
        for i, L in enumerate(self.layers):
            for conv in CONVS:
                base = checkpoint.get(f"layers.{i}.{conv}.base_kernel")  # [2, taps, H] (side, tap, channel)
                # the conv kernel takes all-f32 (f32 mode) or all-bf16 bits (bf16 mode)
                base = f32_to_bf16_array(as_f32(base)) if self.bf16 and base.dtype != np.uint16 else base
                L[conv] = {
                    "base": base if self.bf16 else as_f32(base),  # [2, taps, H]
                    "proj": self.ops.prepare_weight(checkpoint.get(f"layers.{i}.{conv}.kernel_projection.weight")),
                }
        self.selector = CandidateSelector.from_checkpoint(
            checkpoint, c, target.config.vocab_size, valid_vocab(target), defer_refusal=True)
        self.selector_notice = getattr(self.selector, "notice", None)
        if self.selector_notice:
            print(self.selector_notice, file=sys.stderr)

    @property
    def refusal_reason(self) -> str | None:
        """Why every proposal will be refused (the selector cannot run faithfully), known at
        load time; the decode loop refuses a run with it before anything is emitted."""
        return getattr(self.selector, "reason", None) if isinstance(self.selector, RefusedSelector) else None

    def _validate_inventory(self) -> None:
        # Selector tensors are tolerated, not required, and their shapes are not checked here:
        # a selector that cannot run faithfully is the selector's refusal (at propose), not a
        # load failure. CandidateSelector.refusal_reason checks presence, dtype and shapes.
        self.checkpoint.require(expected_draft_tensors(self.config, self.target.config.vocab_size,
                                                       include_selector=False))

    # ------------------------------------------------------------------ block forward pieces
    def embed_block(self, anchor_ids, n_rows: int) -> np.ndarray:
        """DFlash2 scales the block embeddings (all rows) by input_embedding_scale."""
        e = super().embed_block(anchor_ids, n_rows)  # [R*Q, H]
        return rnd_if(e * np.float32(self.config.input_embedding_scale), self.bf16)

    def _conv(self, x: np.ndarray, delta: np.ndarray, base: np.ndarray, n_rows) -> np.ndarray:
        """ops.grouped_conv on x [N, H], delta [N, taps, G], base [taps, H] (§4.2), in the run
        mode's dtype: f32 arrays, or bf16 bits (x and delta are already bf16 values there).
        n_rows: the block length Q of every block, or a list of Q_r (blocks of a batch, laid end
        to end: each is convolved on its own)."""
        if not isinstance(n_rows, (int, np.integer)):
            bounds = np.cumsum([0] + list(n_rows))
            return np.concatenate([self._conv(x[a:b], delta[a:b], base, int(b - a))
                                   for a, b in zip(bounds[:-1], bounds[1:])])
        if not self.bf16:
            return self.ops.grouped_conv(x, delta, base, self.group_size, n_rows)
        out = self.ops.grouped_conv(f32_to_bf16_array(x), f32_to_bf16_array(delta), base,
                                    self.group_size, n_rows)  # [N, H] uint16
        return bf16_to_f32_array(out)

    def conv_prepare(self, layer: dict, name: str, x: np.ndarray, n_rows: int):
        """-> (conv(x, delta[:, 0], base[0]), delta[:, 1]) with delta = kernel_projection(x)."""
        conv, N = layer[name], x.shape[0]
        delta = rnd_if(self._row_linear(x, conv["proj"]), self.bf16)  # [N, 2*taps*G]
        delta = delta.reshape(N, 2, self.taps, self.groups)  # [N, side, tap, group]
        return self._conv(x, delta[:, 0], conv["base"][0], n_rows), delta[:, 1]

    def conv_finish(self, layer: dict, name: str, y: np.ndarray, coef, n_rows: int) -> np.ndarray:
        """conv(y, delta[:, 1], base[1]): the side-1 coefficients kept by prepare."""
        return self._conv(y, coef, layer[name]["base"][1], n_rows)

    # ------------------------------------------------------------------ the fused engine
    def _conv_weights(self, layer: dict) -> tuple:
        return layer["attention_conv"]["proj"], layer["mlp_conv"]["proj"]

    def _fused_conv(self, layer: dict) -> tuple:
        """(attention proj, mlp proj (panels), attention base, mlp base) for fused.decoder_layer."""
        return (layer["attention_conv"]["proj"].panels, layer["mlp_conv"]["proj"].panels,
                layer["attention_conv"]["base"], layer["mlp_conv"]["base"])

    def _fused_shape(self, n_rows: int) -> tuple:
        """The conv block length is the runtime Q of the step (spec §4.2)."""
        c = self.config
        return fused.layer_args(c.num_attention_heads, c.num_key_value_heads, c.head_dim, self._fused_offsets,
                                self.taps, self.group_size, n_rows)

    # ------------------------------------------------------------------ proposing
    def proposal_from(self, h: np.ndarray, z: np.ndarray, anchor_id: int, anchor_pos: int,
                      sampling: SamplingParams, rng: np.random.Generator) -> Proposal:
        """The selector walk (§4.4) over the mask rows h [Q-1, H] with their raw lm_head logits
        z [Q-1, V] (the selector masks padding itself). A refused selector raises
        SelectorRefusedError here, after the forward."""
        if isinstance(self.selector, RefusedSelector):
            self.selector.select()  # raises SelectorRefusedError, naming the boundary
        positions = np.arange(anchor_pos + 1, anchor_pos + 1 + h.shape[0])  # position each row predicts
        draft_ids, q, info, conf = self.selector.select(h, z, int(anchor_id), positions, sampling, rng,
                                                        with_confidence=True)
        return Proposal(np.asarray(draft_ids, np.int64), q, info, conf)
