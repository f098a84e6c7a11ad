"""The Qwen mixture-of-experts MLP block, shared by the qwen3_moe and qwen3_5_moe families
(docs/moe.md). Per token row x [H]:

    p      = softmax(x W_r^T)                   f32 over all E experts (router W_r [E, H])
    top    = the k largest p (ties: lowest id)  renormalised to sum 1 iff `renormalize`
    y      = sum over the k experts, in ASCENDING expert id, of w_e * down_e(silu(gate_e x) * up_e x)
    y     += sigmoid(x W_g^T) * shared(x)       Qwen3.5-MoE only: a dense SwiGLU expert, one gate per row

Expert-major: the R rows of a block (a verify, a draft block, a prefill chunk) are routed
first, then each selected expert's weights are read ONCE for every row that picked it (one
product over the gathered rows), and its output is scattered back, scaled by the routing
weight. A Q-row verify therefore reads the union of its rows' experts, not Q x k experts.

Row invariance (a Q-row verify == Q one-row steps, bit for bit): every product is the panel
GEMV (one fma chain per output, whatever the rows stacked with it), routing is per row (the
numba kernel of kernels/routing.py, also used by the op-by-op path, so both paths see the same bits), and each
row accumulates its k expert outputs in ascending expert id from zero: what other rows picked
never enters a row's arithmetic. Threads split a product's output columns, never the k experts.

Expert weights, per layer (`ExpertWeights`): gate and up of expert e concatenated into ONE
[2I, H] weight (first I rows = gate, as the Hub's fused `experts.gate_up_proj [E, 2I, H]` and
transformers' in-memory layout), down [H, I]; each prepared by the device's ops
(prepare_weight: bf16 panels, q8_0 / q4_0 integer panels, a device upload). On the CPU the
experts' panels are also stacked into one array per projection ([E, ...] views re-pointed as
each expert's `.panels`, no second copy) for the fused layer kernel (kernels/fused_moe.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..kernels.routing import route
from .layers import rnd_if, swiglu as swiglu_np


# ------------------------------------------------------------------ weights
@dataclass
class ExpertWeights:
    """One MoE layer's weights, prepared by the device's ops (module docstring).

    router [E, H]; gate_up[e] [2I, H]; down[e] [H, I]; shared = (gate, up, down) of the shared
    expert or None; shared_gate [1, H] or None. `stacked` = (gate_up panels [E, ...], down
    panels [E, ...]) on the CPU when every expert is packed alike, else None."""
    router: object
    gate_up: list
    down: list
    top_k: int
    renormalize: bool
    inter: int  # I, the expert width
    shared: tuple | None = None
    shared_gate: object = None
    stacked: tuple | None = None

    @property
    def num_experts(self) -> int:
        return len(self.gate_up)


def stack_panels(weights: list):
    """The experts' panels stacked on a new leading axis, each weight's `.panels` re-pointed to
    its slice (a view: the stack is the only copy). None where a weight has no panels (an f32
    checkpoint, a CUDA upload) or the experts differ in kind."""
    parts = [getattr(w, "panels", None) for w in weights]
    if any(p is None for p in parts):
        return None
    if isinstance(parts[0], tuple):  # quantized (qw, ws)
        if any(not isinstance(p, tuple) or len(p) != len(parts[0]) for p in parts):
            return None
        if any(p[i].shape != parts[0][i].shape or p[i].dtype != parts[0][i].dtype for p in parts for i in range(len(p))):
            return None
        stack = tuple(_stack([p[i] for p in parts]) for i in range(len(parts[0])))
        for e, w in enumerate(weights):
            w.panels = tuple(s[e] for s in stack)
        return stack
    if any(isinstance(p, tuple) or p.shape != parts[0].shape or p.dtype != parts[0].dtype for p in parts):
        return None
    stack = _stack(parts)
    for e, w in enumerate(weights):
        w.panels = stack[e]
    return stack


def _stack(arrays: list) -> np.ndarray:
    """The parts copied into one preallocated [len, ...] array (np.stack without a temporary).
    Until the caller re-points its weights, parts and stack are both alive: one layer's experts
    twice, transiently."""
    out = np.empty((len(arrays),) + arrays[0].shape, arrays[0].dtype)
    for e, a in enumerate(arrays):
        out[e] = a
    return out


# ------------------------------------------------------------------ the block, op by op
def sigmoid(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return np.float32(1.0) / (np.float32(1.0) + np.exp(-x))


def moe_mlp(x: np.ndarray, moe: ExpertWeights, linear, bf16: bool = False, swiglu=swiglu_np,
            counts: dict | None = None) -> np.ndarray:
    """The MoE block on x [n, H] (already normed) -> [n, H], expert-major with the device's
    `linear` / `swiglu` (the op-by-op path: any device, any row count; the fused CPU kernel is
    tested bit-identical to it). `counts`, if given, gets 'experts' += touched experts and
    'rows' += n (the union statistics of bench/)."""
    n = x.shape[0]
    I = moe.inter
    logits = rnd_if(linear(x, moe.router), bf16)  # [n, E]
    ids, w = route(logits, moe.top_k, moe.renormalize, bf16)  # [n, k] each
    out = np.zeros(x.shape, np.float32)  # [n, H]
    touched = np.unique(ids)  # ascending expert id
    for e in touched:
        rows, slots = np.nonzero(ids == e)  # each row picks an expert at most once
        gu = rnd_if(linear(np.ascontiguousarray(x[rows]), moe.gate_up[e]), bf16)  # [m, 2I]
        a = swiglu(np.ascontiguousarray(gu[:, :I]), np.ascontiguousarray(gu[:, I:2 * I]), bf16)  # [m, I]
        y = rnd_if(linear(a, moe.down[e]), bf16)  # [m, H]
        out[rows] = rnd_if(out[rows] + rnd_if(y * w[rows, slots][:, None], bf16), bf16)
    if counts is not None:
        counts["experts"] = counts.get("experts", 0) + len(touched)
        counts["rows"] = counts.get("rows", 0) + n
    if moe.shared is not None:
        g, u, d = moe.shared
        gu = rnd_if(linear(x, g), bf16), rnd_if(linear(x, u), bf16)
        s = rnd_if(linear(swiglu(gu[0], gu[1], bf16), d), bf16)  # [n, H]
        gate = rnd_if(sigmoid(rnd_if(linear(x, moe.shared_gate), bf16)), bf16)  # [n, 1]
        out = rnd_if(out + rnd_if(gate * s, bf16), bf16)
    return out


# ------------------------------------------------------------------ sizes (inspect, bench)
def moe_facts(expected, num_experts: int, top_k: int, tied: bool) -> dict:
    """Parameters and bytes of a MoE target from its inventory (ExpectedTensors, per-expert
    spelling): total and active-per-token parameters (every tensor but the E - k experts a
    token does not pick), and per weight format the bytes one decoded token reads (every matrix
    it uses, the embedding as one row, unpicked experts not at all)."""
    from ..quant.formats import FORMATS, matrix_bytes_per_weight

    shapes = expected.pick([])
    unused = (num_experts - top_k) / num_experts
    total = active = 0.0
    read = {fmt: 0.0 for fmt in ("bf16",) + FORMATS}
    for name, shape in shapes.items():
        if name in expected.optional and not (name == "lm_head.weight" and not tied):
            continue
        n = float(np.prod(shape))
        share = (1.0 - unused) if ".experts." in name else 1.0
        total += n
        active += n * share
        for fmt in read:
            per = matrix_bytes_per_weight(name, shape, fmt)
            if name.endswith("embed_tokens.weight"):
                read[fmt] += shape[1] * 2 * (0 if tied else 1)  # one bf16 row (tied: the head reads it all)
                if tied:
                    read[fmt] += n * per
            else:
                read[fmt] += n * share * (4 if per is None else per)
    return {"total_parameters": int(total), "active_parameters_per_token": int(active),
            "num_experts": num_experts, "experts_per_token": top_k,
            "bytes_read_per_token": {fmt: int(b) for fmt, b in read.items()}}


def moe_summary_lines(facts: dict) -> list[str]:
    from ..config import human_bytes

    def count(n: int) -> str:  # 30.53 B / 627.55 K
        for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
            if n >= div:
                return f"{n / div:.2f} {unit}"
        return str(n)

    per_tok = ", ".join(f"{fmt} {human_bytes(b)}" for fmt, b in facts["bytes_read_per_token"].items())
    return [f"mixture of experts: {facts['num_experts']} experts, {facts['experts_per_token']} per token; "
            f"parameters {count(facts['total_parameters'])} total, "
            f"{count(facts['active_parameters_per_token'])} active per token",
            f"weights read per decoded token: {per_tok}"]
