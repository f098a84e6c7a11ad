"""The Qwen3-MoE family (`Qwen3MoeForCausalLM`, model_type `qwen3_moe`: Qwen3-30B-A3B,
Qwen3-Coder-30B-A3B): the Qwen3 attention stack with a mixture-of-experts MLP (docs/moe.md).

    cfg    = resolve_qwen3_moe_config(raw, source)     # Qwen3MoeConfig: TargetConfig + the MoE keys
    target = Qwen3MoeModel.load(model_dir, quantize="q4_0")

Layer i is MoE iff num_experts > 0, i not in mlp_only_layers and (i+1) % decoder_sparse_step
== 0 (transformers' rule); otherwise a dense SwiGLU MLP of intermediate_size. The MoE block
(models/moe.py): router softmax over all E in f32, top-k (ties: lowest id), renormalised iff
norm_topk_prob, SwiGLU experts of moe_intermediate_size summed in ascending expert id.

Two spellings of the experts are read (tensor names alone decide, shapes are then checked):
    per expert (the Hub's and transformers' save_pretrained):
        mlp.gate.weight [E, H], mlp.experts.{e}.{gate,up}_proj.weight [I, H], .down_proj.weight [H, I]
    fused (transformers' in-memory layout, some conversions):
        mlp.gate.weight [E, H], mlp.experts.gate_up_proj [E, 2I, H] (first I rows = gate),
        mlp.experts.down_proj [E, H, I]
A transposed fused tensor (Qwen3-VL-MoE's [E, H, 2I]) is a TensorShapeError naming the expected
shape. Sliding windows: transformers' Qwen3-MoE applies `sliding_window` to EVERY layer when
use_sliding_window is true (no max_window_layers / layer_types here), and so does this module.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from ..config_checks import architecture_of, check_int_list, get_bool, get_int
from ..errors import ConfigValueError, UnknownArchitectureError
from ..inventory import ExpectedTensors
from ..kernels import fused, fused_moe
from ..kernels.panels import group_panels, pack_bf16
from ..models.base import Span
from ..quant.weights import release_pages
from ..models.moe import ExpertWeights, moe_facts, moe_mlp, moe_summary_lines, stack_panels
from .qwen3 import TargetConfig, TargetModel, attention_stack_fields, expected_target_tensors

ARCHITECTURE, MODEL_TYPE = "Qwen3MoeForCausalLM", "qwen3_moe"


# ---------------------------------------------------------------- config
@dataclass(frozen=True)
class Qwen3MoeConfig(TargetConfig):
    num_experts: int = 0  # E
    num_experts_per_tok: int = 1  # k
    moe_intermediate_size: int = 0  # I of one expert
    norm_topk_prob: bool = False  # the class default; Qwen3-30B-A3B's config sets true
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def is_moe_layer(self, i: int) -> bool:
        return (self.num_experts > 0 and i not in self.mlp_only_layers
                and (i + 1) % self.decoder_sparse_step == 0)

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]


def is_qwen3_moe(raw: dict) -> bool:
    archs = raw.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs else None
    return arch == ARCHITECTURE or raw.get("model_type") == MODEL_TYPE


def resolve_qwen3_moe_config(raw: dict, source: str = "config.json") -> Qwen3MoeConfig:
    arch = architecture_of(raw, source)
    if arch != ARCHITECTURE:
        raise UnknownArchitectureError(f"{source}: architectures[0] = {arch!r}; expected {ARCHITECTURE!r} for "
                                       f"model_type {MODEL_TYPE!r}")
    fields = attention_stack_fields(raw, arch, source)
    L = fields["num_hidden_layers"]
    use = get_bool(raw, "use_sliding_window", source, default=False)
    window = get_int(raw, "sliding_window", source, default=None, minimum=1) if use else None
    if use and window is None:
        raise ConfigValueError(f"{source}: use_sliding_window = true but sliding_window = null")
    fields.update(layer_window=(window,) * L, sliding_window=window)
    E = num_experts(raw, source)
    k = get_int(raw, "num_experts_per_tok", source, minimum=1, maximum=max(E, 1))
    only = check_int_list(raw.get("mlp_only_layers", []), "mlp_only_layers", source, minimum=0)
    out_of_range = [i for i in only if i >= L]
    if out_of_range:
        raise ConfigValueError(f"{source}: mlp_only_layers {out_of_range} outside 0..{L - 1} (num_hidden_layers {L})")
    return Qwen3MoeConfig(
        **fields,
        num_experts=E,
        num_experts_per_tok=k,
        moe_intermediate_size=get_int(raw, "moe_intermediate_size", source, minimum=1),
        norm_topk_prob=get_bool(raw, "norm_topk_prob", source, default=False),
        decoder_sparse_step=get_int(raw, "decoder_sparse_step", source, default=1, minimum=1),
        mlp_only_layers=tuple(only),
    )


def num_experts(raw: dict, source: str) -> int:
    """`num_experts` (the Hub's configs) or `num_local_experts` (what transformers 5 writes: its
    attribute_map renames the key); both present must agree."""
    a = get_int(raw, "num_experts", source, default=None, minimum=0)
    b = get_int(raw, "num_local_experts", source, default=None, minimum=0)
    if a is not None and b is not None and a != b:
        raise ConfigValueError(f"{source}: num_experts = {a} but num_local_experts = {b}; expected one value")
    if a is None and b is None:
        raise ConfigValueError(f"{source}: num_experts missing (looked for num_experts, num_local_experts)")
    return a if a is not None else b


# ---------------------------------------------------------------- tensors
def expert_layouts(p: str, E: int, H: int, I: int) -> list[dict]:
    """The two spellings of one layer's experts under p = '...mlp.': [per expert, fused]."""
    per_expert = {}
    for e in range(E):
        q = f"{p}experts.{e}."
        per_expert |= {q + "gate_proj.weight": (I, H), q + "up_proj.weight": (I, H), q + "down_proj.weight": (H, I)}
    fused_names = {p + "experts.gate_up_proj": (E, 2 * I, H), p + "experts.down_proj": (E, H, I)}
    return [per_expert, fused_names]


def expected_qwen3_moe_tensors(c: Qwen3MoeConfig) -> ExpectedTensors:
    """Qwen3's inventory with each MoE layer's dense MLP replaced by its router and experts (in
    either spelling: `ExpectedTensors.layouts`)."""
    base = expected_target_tensors(c)
    shapes, layouts, notes = dict(base), [], dict(base.notes)
    H, I, E = c.hidden_size, c.moe_intermediate_size, c.num_experts
    for i in c.moe_layers:
        p = f"model.layers.{i}.mlp."
        for n in ("gate_proj", "up_proj", "down_proj"):
            del shapes[p + n + ".weight"]
        shapes[p + "gate.weight"] = (E, H)
        notes[p + "gate.weight"] = f"the router: [num_experts, hidden_size] = [{E}, {H}]"
        notes[p + "experts.gate_up_proj"] = (f"[num_experts, 2 * moe_intermediate_size, hidden_size]; a [E, H, 2I] "
                                            "tensor is Qwen3-VL-MoE's transposed layout, not this family's")
        layouts.append((f"layer {i} experts", expert_layouts(p, E, H, I)))
    return ExpectedTensors(shapes, base.optional, notes, base.ignored_prefixes, layouts)


def describe_qwen3_moe(c: Qwen3MoeConfig) -> dict:
    """inspect's family facts: total / active parameters and the bytes a token reads per format."""
    facts = moe_facts(expected_qwen3_moe_tensors(c), c.num_experts, c.num_experts_per_tok, c.tie_word_embeddings)
    return {**facts, "moe_layers": c.moe_layers, "summary_lines": moe_summary_lines(facts)}


def load_experts(checkpoint, p: str, E: int, I: int, prepare, workers: int | None = None) -> tuple[list, list, tuple | None]:
    """One layer's experts (either spelling) -> (gate_up [E] of [2I, H], down [E] of [H, I],
    their stacked panels or None), each prepared with `prepare` (a quantizer: numpy, which
    releases the GIL) on `workers` threads (default: the CPU count), a few experts at a time."""
    get, names = checkpoint.get, checkpoint.tensors
    fused_file = p + "experts.gate_up_proj" in names
    if fused_file:
        gu_all, down_all = get(p + "experts.gate_up_proj"), get(p + "experts.down_proj")  # [E, 2I, H], [E, H, I]

    def one(e):
        if fused_file:
            sources = gu, d = gu_all[e], down_all[e]  # views of the memory map
        else:
            q = f"{p}experts.{e}."
            sources = get(q + "gate_proj.weight"), get(q + "up_proj.weight"), get(q + "down_proj.weight")
            gu, d = np.concatenate(sources[:2]), sources[2]  # [2I, H] (a copy), [H, I]
        out = prepare(gu), prepare(d)
        if not any(isinstance(w, np.ndarray) for w in out):  # quantized: the file's pages are not needed again
            for s in sources:
                release_pages(s)
        return out

    workers = workers or os.cpu_count() or 1
    if workers > 1 and E > 1:
        with ThreadPoolExecutor(workers) as pool:
            pairs = list(pool.map(one, range(E)))
    else:
        pairs = [one(e) for e in range(E)]
    gate_up, down = [a for a, _ in pairs], [b for _, b in pairs]
    return gate_up, down, _stacks(gate_up, down)


def _stacks(gate_up: list, down: list):
    gs, ds = stack_panels(gate_up), stack_panels(down)
    return (gs, ds) if gs is not None and ds is not None else None


# ---------------------------------------------------------------- model
class Qwen3MoeModel(TargetModel):
    """TargetModel with MoE layers: `layer["moe"]` (ExpertWeights) instead of gate/up/down.
    On the CPU a MoE layer is ONE numba call (kernels/fused_moe.py) for 1..32 rows, the dense
    layers the usual fused layer; longer prefills and other devices run op by op."""

    resolve_config = staticmethod(resolve_qwen3_moe_config)
    expected_tensors = staticmethod(expected_qwen3_moe_tensors)
    routing_counts: dict | None = None  # {} counts touched experts of op-by-op forwards (bench/: fused = False)

    def _load_mlp(self, i: int, p: str) -> dict:
        c = self.config
        if not c.is_moe_layer(i):
            return super()._load_mlp(i, p)
        return {"moe": self._experts(p, shared=None)}

    def _experts(self, p: str, shared) -> ExpertWeights:
        c, ops = self.config, self.ops
        exact = pack_bf16 if ops.device == "cpu" else ops.prepare_weight  # the router stays as stored
        gate_up, down, stacked = load_experts(self.checkpoint, p, c.num_experts, c.moe_intermediate_size,
                                              ops.prepare_weight)
        router = exact(self.checkpoint.get(p + "gate.weight"))  # [E, H]
        return ExpertWeights(router, gate_up, down, c.num_experts_per_tok, self.renormalize,
                             c.moe_intermediate_size, stacked=stacked, **(shared or {}))

    @property
    def renormalize(self) -> bool:
        return self.config.norm_topk_prob

    def _mlp_block(self, i, layer, m, linear):
        if "moe" not in layer:
            return super()._mlp_block(i, layer, m, linear)
        return moe_mlp(m, layer["moe"], linear, self.bf16, self.ops.swiglu, self.routing_counts)

    # ------------------------------------------------------------------ the fused engine
    def _fuse_layer(self, i, L):
        if "moe" not in L:
            return super()._fuse_layer(i, L)
        moe: ExpertWeights = L["moe"]
        if moe.stacked is None or not fused.can_fuse(1, (L["q"], L["k"], L["v"], L["o"], moe.router)):
            return None
        c, no_norm = self.config, np.empty(0, np.float32)
        qkv, (_, k_at, v_at) = group_panels([L["q"], L["k"], L["v"]])
        attn = (qkv, L["o"].panels, L["ln1"], L["ln2"], L.get("q_norm", no_norm), L.get("k_norm", no_norm),
                fused.NO_CONV[0], fused.NO_CONV[2])
        sh_gu, sh_down, sh_gate, sh_inter = self._shared_args(moe)
        args = (moe.router.panels, moe.stacked[0], moe.stacked[1], sh_gu, sh_down, sh_gate)
        shape = (c.num_attention_heads, c.num_key_value_heads, c.head_dim, k_at, v_at, moe.num_experts,
                 moe.top_k, int(moe.renormalize), moe.inter, sh_inter)
        return ("moe", attn, args, tuple(int(s) for s in shape))

    def _shared_args(self, moe: ExpertWeights):
        """(shared gate_up panels, down panels, gate panels, Is); Is = 0 and the router's panels
        as never-read stand-ins when the layer has no shared expert."""
        empty = moe.router.panels[:0]
        return empty, empty, empty, 0

    def _layer(self, i, layer, h, cache, start, q_pos, k_pos, cos, sin):
        if "moe" not in layer:
            return super()._layer(i, layer, h, cache, start, q_pos, k_pos, cos, sin)
        args = self._fused_layers[i] if self.fused and self._fused_layers is not None else None
        if args is not None and fused.can_fuse(h.shape[0]):
            h = np.ascontiguousarray(h, dtype=np.float32)  # updated in place
            _, attn, moe, shape = args
            fused_moe.moe_layer(h, attn, moe, cache.k[i], cache.v[i], start, q_pos, k_pos, cos, sin, shape, True,
                                self.layer_windows[i], np.float32(self.config.rms_norm_eps), self.bf16,
                                fused.parallel_min_macs())
            return h
        return self._layer_ops(i, layer, h, cos, sin, [Span(cache, start, q_pos, k_pos, slice(0, h.shape[0]))],
                               self.ops.linear)
