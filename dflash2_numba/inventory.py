"""Tensor inventories (spec §2.1, §2.2): every tensor a checkpoint must hold, with its shape,
what it may hold besides, and what it holds that is ignored by name.

    expected = family.expected_tensors(cfg)     # or expected_draft_tensors(cfg, vocab)
    checkpoint.require(expected)                 # Missing / Unexpected / TensorShapeError
    expected.ignored(checkpoint.names())         # name -> why it is not read

Each target family builds its own from its config (families/*.py).
"""

from __future__ import annotations

from .config import DraftConfig


class ExpectedTensors(dict):
    """name -> shape, plus what `Checkpoint.require` needs to explain itself.

    `optional`: names tolerated in the file but not required (a redundant `lm_head.weight`
    next to tied embeddings; selector tensors when the caller did not ask for them).
    `notes`: name -> why the shape is what it is, appended to a TensorShapeError.
    `ignored_prefixes`: prefix -> why; every tensor under such a prefix is tolerated and never
    read (a vision tower, a built-in MTP head), and `inspect` lists it as ignored BY NAME.
    `layouts`: groups of alternative spellings of the same weights (a MoE layer's experts as
    per-expert tensors or as one fused [E, ...] tensor): [(what, [alternative {name: shape}, ...])].
    `pick(names)` resolves each group to the alternative the file holds (the first alternative
    when it holds none, so a missing tensor is named in the first spelling)."""

    def __init__(self, shapes=(), optional=(), notes=None, ignored_prefixes=None, layouts=None):
        super().__init__(shapes)
        self.optional = set(optional)
        self.notes = dict(notes or {})
        self.ignored_prefixes = dict(ignored_prefixes or {})
        self.layouts = list(layouts or [])

    def pick(self, names) -> "ExpectedTensors":
        """A copy with every layout group resolved against the tensor names of a file."""
        names = set(names)
        out = ExpectedTensors(self, self.optional, self.notes, self.ignored_prefixes)
        for _what, alternatives in self.layouts:
            chosen = next((alt for alt in alternatives if any(n in names for n in alt)), alternatives[0])
            out.update(chosen)
        return out

    def ignored(self, names) -> dict[str, str]:
        """name -> why, for the given tensor names that fall under an ignored prefix."""
        return {n: why for n in names for p, why in self.ignored_prefixes.items() if n.startswith(p)}


def expected_draft_tensors(cfg: DraftConfig, vocab_size: int, include_selector: bool = True) -> ExpectedTensors:
    """Every tensor of a DFlash v1 / DFlash2 draft (no `model.` prefix) with its shape.

    `vocab_size` is the TARGET's: the codebooks are indexed by target token ids, so a draft
    trained against another vocabulary shows up as a TensorShapeError on the codebooks.
    With `include_selector=False` the selector tensors are tolerated but not required."""
    H, I, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q_rows, kv_rows = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    fc, ctx_norm = cfg.context_tensor_names
    shapes = {fc: (H, cfg.n_taps * H), ctx_norm: (H,), "norm.weight": (H,)}
    notes = {fc: f"[hidden_size, n_taps * hidden_size] with {cfg.n_taps} taps {cfg.target_layer_ids}"}
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (H,),
            p + "post_attention_layernorm.weight": (H,),
            p + "self_attn.q_proj.weight": (q_rows, H),
            p + "self_attn.k_proj.weight": (kv_rows, H),
            p + "self_attn.v_proj.weight": (kv_rows, H),
            p + "self_attn.o_proj.weight": (H, q_rows),
            p + "self_attn.q_norm.weight": (hd,),
            p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate_proj.weight": (I, H),
            p + "mlp.up_proj.weight": (I, H),
            p + "mlp.down_proj.weight": (H, I),
        }
        if cfg.attention_bias:  # z-lab/gpt-oss-20b-DFlash
            shapes |= {p + "self_attn.q_proj.bias": (q_rows,), p + "self_attn.k_proj.bias": (kv_rows,),
                       p + "self_attn.v_proj.bias": (kv_rows,), p + "self_attn.o_proj.bias": (H,)}
        if cfg.kind == "dflash2":
            taps, G = cfg.conv_kernel_size, cfg.conv_groups
            for conv in ("attention_conv", "mlp_conv"):
                shapes[p + conv + ".base_kernel"] = (2, taps, H)  # [side, tap, channel]
                shapes[p + conv + ".kernel_projection.weight"] = (2 * taps * G, H)
                notes[p + conv + ".kernel_projection.weight"] = (
                    f"[2 * conv_kernel_size * (hidden_size / conv_group_size), hidden_size] = "
                    f"[2 * {taps} * {G}, {H}]"
                )
    optional: tuple = ()
    if cfg.kind == "dflash2":
        r = cfg.selector_rank
        selector = {
            "candidate_selector.hidden_projection.weight": (r, H),
            "candidate_selector.predecessor_codebook": (vocab_size, r),
            "candidate_selector.successor_codebook": (vocab_size, r),
        }
        for name in ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook"):
            notes[name] = (
                f"[target vocab_size, selector_rank] = [{vocab_size}, {r}]: the codebook rows must equal "
                "the TARGET's vocab_size (was this draft trained for another target?)"
            )
        if include_selector:
            shapes |= selector
        else:
            optional = tuple(selector)
    return ExpectedTensors(shapes, optional, notes)
