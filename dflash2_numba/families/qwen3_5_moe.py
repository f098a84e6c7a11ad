"""The Qwen3.5-MoE family (model_type `qwen3_5_moe` / `qwen3_5_moe_text`: Qwen3.5-35B-A3B,
Qwen3.6-35B-A3B): the Qwen3.5 Gated-DeltaNet hybrid of families/qwen3_5.py with a mixture of
experts in EVERY layer, plus a shared expert (docs/moe.md).

    out = sum over the top-k routed experts (ALWAYS renormalised; ascending expert id)
        + sigmoid(x W_g^T) * shared(x)        W_g = mlp.shared_expert_gate.weight [1, H]: one gate per row

Config: the text keys (under `text_config` for Qwen3_5MoeForConditionalGeneration, flat for
Qwen3_5MoeForCausalLM) are the dense hybrid's plus num_experts (or num_local_experts),
num_experts_per_tok, moe_intermediate_size (here also the DecoderDims intermediate_size: the
expert width; there is no dense MLP) and shared_expert_intermediate_size.

Tensors under the text prefix (`model.language_model.` / `model.`), per layer `mlp.`:
    gate.weight [E, H]; shared_expert.{gate,up}_proj.weight [Is, H], .down_proj.weight [Is -> H];
    shared_expert_gate.weight [1, H]; the experts fused (the Hub's layout: experts.gate_up_proj
    [E, 2I, H], first I rows = gate; experts.down_proj [E, H, I]) or per expert (what
    transformers' save_pretrained writes: experts.{e}.{gate,up,down}_proj.weight).
The vision tower and the `mtp.*` head are ignored by name, as for the dense hybrid.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config_checks import get_int
from ..inventory import ExpectedTensors
from ..kernels.panels import pack_bf16
from ..models.moe import ExpertWeights, moe_facts, moe_mlp, moe_summary_lines
from .qwen3_5 import (Qwen3_5Config, Qwen3_5Model, describe_qwen3_5, expected_qwen3_5_tensors, hybrid_fields,
                      text_config)
from .qwen3_moe import expert_layouts, load_experts, num_experts

MULTIMODAL, TEXT = "qwen3_5_moe", "qwen3_5_moe_text"
ARCHITECTURES = {MULTIMODAL: "Qwen3_5MoeForConditionalGeneration", TEXT: "Qwen3_5MoeForCausalLM"}


@dataclass(frozen=True)
class Qwen3_5MoeConfig(Qwen3_5Config):
    num_experts: int = 0  # E
    num_experts_per_tok: int = 1  # k
    moe_intermediate_size: int = 0  # I of one routed expert (== intermediate_size here)
    shared_expert_intermediate_size: int = 0  # Is


def is_qwen3_5_moe(raw: dict) -> bool:
    archs = raw.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs else None
    mt = raw.get("model_type")
    return (isinstance(mt, str) and mt in ARCHITECTURES) or (isinstance(arch, str) and arch in ARCHITECTURES.values())


def resolve_qwen3_5_moe_config(raw: dict, source: str = "config.json") -> Qwen3_5MoeConfig:
    mt, text, tied, where = text_config(raw, source, ARCHITECTURES, MULTIMODAL)
    fields = hybrid_fields(raw, text, mt, tied, where, source, ARCHITECTURES[mt], intermediate_key="moe_intermediate_size")
    E = num_experts(text, where)
    return Qwen3_5MoeConfig(
        **fields,
        num_experts=E,
        num_experts_per_tok=get_int(text, "num_experts_per_tok", where, minimum=1, maximum=max(E, 1)),
        moe_intermediate_size=fields["intermediate_size"],
        shared_expert_intermediate_size=get_int(text, "shared_expert_intermediate_size", where, minimum=1),
    )


def expected_qwen3_5_moe_tensors(c: Qwen3_5MoeConfig) -> ExpectedTensors:
    """The hybrid's inventory with every layer's dense MLP replaced by router, shared expert,
    its gate and the routed experts (either spelling: ExpectedTensors.layouts)."""
    base = expected_qwen3_5_tensors(c)
    shapes, layouts, notes = dict(base), [], dict(base.notes)
    H, I, Is, E = c.hidden_size, c.moe_intermediate_size, c.shared_expert_intermediate_size, c.num_experts
    for i in range(c.num_hidden_layers):
        p = f"{c.prefix}layers.{i}.mlp."
        for n in ("gate_proj", "up_proj", "down_proj"):
            del shapes[p + n + ".weight"]
        shapes |= {p + "gate.weight": (E, H), p + "shared_expert_gate.weight": (1, H),
                   p + "shared_expert.gate_proj.weight": (Is, H), p + "shared_expert.up_proj.weight": (Is, H),
                   p + "shared_expert.down_proj.weight": (H, Is)}
        notes[p + "gate.weight"] = f"the router: [num_experts, hidden_size] = [{E}, {H}]"
        layouts.append((f"layer {i} experts", expert_layouts(p, E, H, I)))
    return ExpectedTensors(shapes, base.optional, notes, base.ignored_prefixes, layouts)


def describe_qwen3_5_moe(c: Qwen3_5MoeConfig) -> dict:
    """inspect's family facts: the hybrid's schedule and state sizes, then the MoE sizes."""
    hybrid = describe_qwen3_5(c)
    facts = moe_facts(expected_qwen3_5_moe_tensors(c), c.num_experts, c.num_experts_per_tok, c.tie_word_embeddings)
    return {**hybrid, **facts, "summary_lines": hybrid["summary_lines"] + moe_summary_lines(facts)}


class Qwen3_5MoeModel(Qwen3_5Model):
    """Qwen3_5Model whose `layer["mlp"]` is an ExpertWeights (router, experts, shared expert);
    the MoE block runs op by op on any device (models/moe.moe_mlp, expert-major)."""

    resolve_config = staticmethod(resolve_qwen3_5_moe_config)
    expected_tensors = staticmethod(expected_qwen3_5_moe_tensors)
    routing_counts: dict | None = None  # {} counts touched experts per MoE block (bench/)

    def _load_mlp(self, i: int, p: str) -> ExpertWeights:
        c, ops, get = self.config, self.ops, self.checkpoint.get
        exact = pack_bf16 if ops.device == "cpu" else ops.prepare_weight  # router and shared gate as stored
        gate_up, down, stacked = load_experts(self.checkpoint, p, c.num_experts, c.moe_intermediate_size,
                                              ops.prepare_weight)
        shared = tuple(ops.prepare_weight(get(p + f"shared_expert.{n}_proj.weight")) for n in ("gate", "up", "down"))
        return ExpertWeights(exact(get(p + "gate.weight")), gate_up, down, c.num_experts_per_tok, True,
                             c.moe_intermediate_size, shared=shared, shared_gate=exact(get(p + "shared_expert_gate.weight")),
                             stacked=stacked)

    def _mlp(self, moe: ExpertWeights, x):
        return moe_mlp(x, moe, self.ops.linear, self.bf16, self.ops.swiglu, self.routing_counts)
